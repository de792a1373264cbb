"""RMSNorm (Hugging Face Llama order) forward and backward as Pallas kernels for the GPU (Triton)
lowering.

Same layout as ``layer_norm/kernel.py`` (the row tiling of ``layer_norm/rows.py``): a program owns
``block_rows`` whole rows of ``x [n_rows, n_features]``, and the backward program walks
``backward_block_rows`` rows in tiles while it accumulates one fp32 partial row of ``dweight``
(summed afterwards; no atomics, deterministic).
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


def rms_norm_forward_kernel(
    x_ref, w_ref, o_ref, rstd_ref, *, n_rows: int, n_features: int, eps: float
):
    """``o = w * (x * rstd).astype(x.dtype)`` for one tile, ``rstd`` from fp32 ``mean(x**2)``.

    ``w_ref`` is None without a weight; ``rstd_ref`` is None when no backward pass needs it.
    """
    block_rows, padded = x_ref.shape
    row_ok, col_ok, mask = tile_masks(
        pl.program_id(0) * block_rows, block_rows, n_rows, padded, n_features
    )
    x = plgpu.load(x_ref, mask=mask, other=0.0)
    xf = x.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.sum(xf * xf, axis=1) / n_features + eps)
    # HF rounds the normalized value to x.dtype before the weight multiply; keep that rounding
    # so converted models match their PyTorch outputs bit for bit in bf16.
    y = (xf * rstd[:, None]).astype(x.dtype)
    if w_ref is not None:
        # The product of two bf16 values rounded once equals a bf16 multiply, so computing in
        # fp32 and casting to the output dtype matches `weight * y` in any dtype combination.
        y = load_features(w_ref, col_ok)[None, :] * y.astype(jnp.float32)
    plgpu.store(o_ref, y.astype(o_ref.dtype), mask=mask)
    if rstd_ref is not None:
        plgpu.store(rstd_ref, rstd, mask=row_ok)


def rms_norm_backward_kernel(
    x_ref,
    w_ref,
    g_ref,
    rstd_ref,
    dx_ref,
    dw_ref,
    *,
    n_rows: int,
    n_features: int,
    block_rows: int,
):
    """``dx`` for ``backward_block_rows`` rows plus this program's partial ``dw`` row.

    With ``y = x * rstd`` and ``dy = w * g``: ``dx = rstd * (dy - y * mean(dy * y))`` (the cast of
    ``y`` is a straight-through in autodiff) and ``dw = sum_rows(g * y.astype(x.dtype))``.
    """
    program_rows, padded = x_ref.shape
    col_ok = jnp.arange(padded) < n_features
    w = load_features(w_ref, col_ok)

    def tile(rows, row_ok, mask, dw_acc):
        x = plgpu.load(x_ref.at[rows, :], mask=mask, other=0.0)
        g = plgpu.load(g_ref.at[rows, :], mask=mask, other=0.0).astype(jnp.float32)
        rstd = plgpu.load(rstd_ref.at[rows], mask=row_ok, other=0.0)
        y = x.astype(jnp.float32) * rstd[:, None]
        dy = g if w is None else g * w[None, :]
        c = jnp.sum(dy * y, axis=1) / n_features
        dx = (dy - y * c[:, None]) * rstd[:, None]
        plgpu.store(dx_ref.at[rows, :], dx.astype(dx_ref.dtype), mask=mask)
        if dw_ref is not None:
            y_rounded = y.astype(x.dtype).astype(jnp.float32)
            dw_acc = dw_acc + jnp.sum(g * y_rounded, axis=0)
        return dw_acc

    dw_acc = fold_tiles(
        tile,
        jnp.zeros((padded,), jnp.float32),
        program_rows=program_rows,
        block_rows=block_rows,
        n_rows=n_rows,
        n_features=n_features,
    )
    if dw_ref is not None:
        plgpu.store(dw_ref, dw_acc, mask=col_ok)


def rms_norm_forward(
    x: jax.Array,
    weight: jax.Array | None,
    *,
    eps: float,
    block_rows: int,
    num_warps: int,
    num_stages: int,
    with_stats: bool,
    interpret: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """``x [n_rows, n_features]`` -> ``(y, rstd)``; the fp32 ``rstd`` only if ``with_stats``.

    ``y.dtype`` is ``result_type(weight, x)`` (``x.dtype`` without a weight)."""
    out_dtype = x.dtype if weight is None else jnp.result_type(weight, x)
    y, rstd = row_tiled_call(
        rms_norm_forward_kernel,
        [(x, Block.ROWS), (weight, Block.FEATURES)],
        [(out_dtype, Block.ROWS), (jnp.float32, Block.STATS) if with_stats else None],
        rows_per_program=block_rows,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        name="rms_norm_forward",
        eps=eps,
    )
    return y, rstd


def rms_norm_backward(
    x: jax.Array,
    weight: jax.Array | None,
    g: jax.Array,
    rstd: jax.Array,
    *,
    block_rows: int,
    backward_block_rows: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """``(dx, dweight)``; ``dweight`` is the fp32 sum of the per-program partials (None without
    a weight; the caller casts it to the weight dtype)."""
    dx, dweight = row_tiled_call(
        rms_norm_backward_kernel,
        [(x, Block.ROWS), (weight, Block.FEATURES), (g, Block.ROWS), (rstd, Block.STATS)],
        [(x.dtype, Block.ROWS), (jnp.float32, Block.PARTIALS) if weight is not None else None],
        rows_per_program=backward_block_rows,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        name="rms_norm_backward",
        block_rows=block_rows,
    )
    return dx, dweight


__all__ = [
    "rms_norm_backward",
    "rms_norm_backward_kernel",
    "rms_norm_forward",
    "rms_norm_forward_kernel",
]
