"""LayerNorm forward and backward as Pallas kernels for the GPU (Triton) lowering.

Layout and masking are those of ``rows.py``: a program owns ``block_rows`` whole rows of
``x [n_rows, n_features]`` with the feature block padded to a power of two.

Backward: one program walks ``backward_block_rows`` rows in tiles of ``block_rows``, writing
``dx`` per tile and accumulating ``dweight``/``dbias`` partial sums in fp32 registers; each program
writes one partial row, summed afterwards with XLA. That keeps the partials small (one row per
program instead of one per tile) without atomics, so the result is deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zerojax.pallas_kernels.layer_norm.rows import (
    Block,
    fold_tiles,
    load_features,
    row_tiled_call,
    tile_masks,
)


def layer_norm_forward_kernel(
    x_ref, w_ref, b_ref, o_ref, mean_ref, rstd_ref, *, n_rows: int, n_features: int, eps: float
):
    """One ``[block_rows, padded]`` tile: fp32 statistics, affine in fp32, one final rounding.

    ``w_ref``/``b_ref`` are None without weight/bias; ``mean_ref``/``rstd_ref`` are None when no
    backward pass will need them.
    """
    block_rows, padded = x_ref.shape
    row_ok, col_ok, mask = tile_masks(
        pl.program_id(0) * block_rows, block_rows, n_rows, padded, n_features
    )
    x = plgpu.load(x_ref, mask=mask, other=0.0).astype(jnp.float32)
    mean = jnp.sum(x, axis=1) / n_features
    # Zero the padding so it adds nothing to the variance (x - mean is -mean there).
    centered = jnp.where(mask, x - mean[:, None], 0.0)
    rstd = lax.rsqrt(jnp.sum(centered * centered, axis=1) / n_features + eps)
    y = centered * rstd[:, None]
    if w_ref is not None:
        y = y * load_features(w_ref, col_ok)[None, :]
    if b_ref is not None:
        y = y + load_features(b_ref, col_ok)[None, :]
    plgpu.store(o_ref, y.astype(o_ref.dtype), mask=mask)
    if mean_ref is not None:
        plgpu.store(mean_ref, mean, mask=row_ok)
        plgpu.store(rstd_ref, rstd, mask=row_ok)


def layer_norm_backward_kernel(
    x_ref,
    w_ref,
    g_ref,
    mean_ref,
    rstd_ref,
    dx_ref,
    dw_ref,
    db_ref,
    *,
    n_rows: int,
    n_features: int,
    block_rows: int,
):
    """``dx`` for ``backward_block_rows`` rows plus this program's partial ``dw``/``db`` row.

    With ``xhat = (x - mean) * rstd`` and ``wg = weight * g``:
    ``dx = rstd * (wg - xhat * mean(xhat * wg) - mean(wg))``, ``dw = sum_rows(g * xhat)``,
    ``db = sum_rows(g)``.
    """
    program_rows, padded = x_ref.shape
    col_ok = jnp.arange(padded) < n_features
    w = load_features(w_ref, col_ok)

    def tile(rows, row_ok, mask, carry):
        dw_acc, db_acc = carry
        x = plgpu.load(x_ref.at[rows, :], mask=mask, other=0.0).astype(jnp.float32)
        g = plgpu.load(g_ref.at[rows, :], mask=mask, other=0.0).astype(jnp.float32)
        # Rows past n_rows read mean = rstd = 0, so everything below stays finite and zero.
        mean = plgpu.load(mean_ref.at[rows], mask=row_ok, other=0.0)
        rstd = plgpu.load(rstd_ref.at[rows], mask=row_ok, other=0.0)
        xhat = jnp.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wg = g if w is None else g * w[None, :]
        c1 = jnp.sum(xhat * wg, axis=1) / n_features
        c2 = jnp.sum(wg, axis=1) / n_features
        dx = (wg - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        plgpu.store(dx_ref.at[rows, :], dx.astype(dx_ref.dtype), mask=mask)
        if dw_ref is not None:
            dw_acc = dw_acc + jnp.sum(g * xhat, axis=0)
        if db_ref is not None:
            db_acc = db_acc + jnp.sum(g, axis=0)
        return dw_acc, db_acc

    zeros = jnp.zeros((padded,), jnp.float32)
    dw_acc, db_acc = fold_tiles(
        tile,
        (zeros, zeros),
        program_rows=program_rows,
        block_rows=block_rows,
        n_rows=n_rows,
        n_features=n_features,
    )
    if dw_ref is not None:
        plgpu.store(dw_ref, dw_acc, mask=col_ok)
    if db_ref is not None:
        plgpu.store(db_ref, db_acc, mask=col_ok)


def layer_norm_forward(
    x: jax.Array,
    weight: jax.Array | None,
    bias: jax.Array | None,
    *,
    eps: float,
    block_rows: int,
    num_warps: int,
    num_stages: int,
    with_stats: bool,
    interpret: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """``x [n_rows, n_features]`` -> ``(y, mean, rstd)``; the fp32 stats only if ``with_stats``."""
    stat = (jnp.float32, Block.STATS) if with_stats else None
    y, mean, rstd = row_tiled_call(
        layer_norm_forward_kernel,
        [(x, Block.ROWS), (weight, Block.FEATURES), (bias, Block.FEATURES)],
        [(x.dtype, Block.ROWS), stat, stat],
        rows_per_program=block_rows,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        name="layer_norm_forward",
        eps=eps,
    )
    return y, mean, rstd


def layer_norm_backward(
    x: jax.Array,
    weight: jax.Array | None,
    g: jax.Array,
    mean: jax.Array,
    rstd: jax.Array,
    *,
    want_dweight: bool,
    want_dbias: bool,
    block_rows: int,
    backward_block_rows: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """``(dx, dweight, dbias)`` for ``x, g [n_rows, n_features]``; the parameter grads are fp32
    sums of the per-program partials (the caller casts them to the parameter dtype)."""
    partial = (jnp.float32, Block.PARTIALS)
    dx, dweight, dbias = row_tiled_call(
        layer_norm_backward_kernel,
        [
            (x, Block.ROWS),
            (weight, Block.FEATURES),
            (g, Block.ROWS),
            (mean, Block.STATS),
            (rstd, Block.STATS),
        ],
        [(x.dtype, Block.ROWS), partial if want_dweight else None, partial if want_dbias else None],
        rows_per_program=backward_block_rows,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        name="layer_norm_backward",
        block_rows=block_rows,
    )
    return dx, dweight, dbias


__all__ = [
    "layer_norm_backward",
    "layer_norm_backward_kernel",
    "layer_norm_forward",
    "layer_norm_forward_kernel",
]
