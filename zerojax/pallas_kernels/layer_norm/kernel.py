"""LayerNorm forward and backward as Pallas kernels for the GPU (Triton) lowering.

Layout: ``x`` is flattened to ``[n_rows, n_features]``. A program owns ``block_rows`` whole rows,
so the row statistics never leave registers. The feature block is ``n_features`` rounded up to a
power of two (Triton tensors must have power-of-two sizes); the tail columns, and the rows past
``n_rows`` in the last block, are masked on every load and store, so any feature dimension works
without padding copies in HBM.

Backward: one program walks ``backward_block_rows`` rows in tiles of ``block_rows``, writing
``dx`` per tile and accumulating ``dweight``/``dbias`` partial sums in fp32 registers; each program
writes one partial row, and the api sums the ``[programs, n_features]`` partials with XLA. That
keeps the partials small (one row per program instead of one per tile) without atomics, so the
result is deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _masks(row_start, block_rows: int, n_rows: int, padded: int, n_features: int):
    """Validity of the rows and columns of one ``[block_rows, padded]`` tile."""
    row_ok = row_start + jnp.arange(block_rows) < n_rows
    col_ok = jnp.arange(padded) < n_features
    return row_ok, col_ok, row_ok[:, None] & col_ok[None, :]


def layer_norm_forward_kernel(
    x_ref, w_ref, b_ref, o_ref, mean_ref, rstd_ref, *, n_rows: int, n_features: int, eps: float
):
    """One ``[block_rows, padded]`` tile: fp32 statistics, affine in fp32, one final rounding.

    ``w_ref``/``b_ref`` are None without weight/bias; ``mean_ref``/``rstd_ref`` are None when no
    backward pass will need them.
    """
    block_rows, padded = x_ref.shape
    row_ok, col_ok, mask = _masks(
        pl.program_id(0) * block_rows, block_rows, n_rows, padded, n_features
    )
    x = plgpu.load(x_ref, mask=mask, other=0.0).astype(jnp.float32)
    mean = jnp.sum(x, axis=1) / n_features
    # Zero the padding so it adds nothing to the variance (x - mean is -mean there).
    centered = jnp.where(mask, x - mean[:, None], 0.0)
    rstd = lax.rsqrt(jnp.sum(centered * centered, axis=1) / n_features + eps)
    y = centered * rstd[:, None]
    if w_ref is not None:
        y = y * plgpu.load(w_ref, mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
    if b_ref is not None:
        y = y + plgpu.load(b_ref, mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
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
    program_start = pl.program_id(0) * program_rows
    col_ok = jnp.arange(padded) < n_features
    w = None
    if w_ref is not None:
        w = plgpu.load(w_ref, mask=col_ok, other=0.0).astype(jnp.float32)

    def tile(t, carry):
        dw_acc, db_acc = carry
        start = pl.multiple_of(t * block_rows, block_rows)
        rows = pl.ds(start, block_rows)
        row_ok, _, mask = _masks(program_start + start, block_rows, n_rows, padded, n_features)
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
    dw_acc, db_acc = lax.fori_loop(0, program_rows // block_rows, tile, (zeros, zeros))
    if dw_ref is not None:
        plgpu.store(dw_ref, dw_acc, mask=col_ok)
    if db_ref is not None:
        plgpu.store(db_ref, db_acc, mask=col_ok)


def _bind(kernel, present: tuple[bool, ...], **statics):
    """Adapt a kernel with optional refs: pallas_call passes only the refs that exist."""

    def body(*refs):
        it = iter(refs)
        kernel(*(next(it) if p else None for p in present), **statics)

    return body


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
    n_rows, n_features = x.shape
    padded = pl.next_power_of_2(n_features)
    row_block = pl.BlockSpec((block_rows, padded), lambda i: (i, 0))
    col_block = pl.BlockSpec((padded,), lambda i: (0,))
    stat_block = pl.BlockSpec((block_rows,), lambda i: (i,))
    operands = [a for a in (x, weight, bias) if a is not None]
    in_specs = [row_block] + [col_block] * (len(operands) - 1)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_specs = [row_block]
    if with_stats:
        out_shape += [jax.ShapeDtypeStruct((n_rows,), jnp.float32)] * 2
        out_specs += [stat_block] * 2
    present = (True, weight is not None, bias is not None, True, with_stats, with_stats)
    outs = pl.pallas_call(
        _bind(layer_norm_forward_kernel, present, n_rows=n_rows, n_features=n_features, eps=eps),
        grid=(pl.cdiv(n_rows, block_rows),),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="layer_norm_forward",
    )(*operands)
    if with_stats:
        return outs[0], outs[1], outs[2]
    return outs[0], None, None


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
    n_rows, n_features = x.shape
    padded = pl.next_power_of_2(n_features)
    n_programs = pl.cdiv(n_rows, backward_block_rows)
    row_block = pl.BlockSpec((backward_block_rows, padded), lambda i: (i, 0))
    col_block = pl.BlockSpec((padded,), lambda i: (0,))
    stat_block = pl.BlockSpec((backward_block_rows,), lambda i: (i,))
    partial_block = pl.BlockSpec((pl.squeezed, padded), lambda i: (i, 0))
    partial_shape = jax.ShapeDtypeStruct((n_programs, n_features), jnp.float32)

    operands = [x] + ([weight] if weight is not None else []) + [g, mean, rstd]
    in_specs = [row_block] + ([col_block] if weight is not None else []) + [row_block]
    in_specs += [stat_block] * 2
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_specs = [row_block]
    for wanted in (want_dweight, want_dbias):
        if wanted:
            out_shape.append(partial_shape)
            out_specs.append(partial_block)
    present = (True, weight is not None, True, True, True, True, want_dweight, want_dbias)
    outs = pl.pallas_call(
        _bind(
            layer_norm_backward_kernel,
            present,
            n_rows=n_rows,
            n_features=n_features,
            block_rows=block_rows,
        ),
        grid=(n_programs,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="layer_norm_backward",
    )(*operands)
    dx, *partials = outs
    dweight = partials.pop(0).sum(axis=0) if want_dweight else None
    dbias = partials.pop(0).sum(axis=0) if want_dbias else None
    return dx, dweight, dbias


__all__ = [
    "layer_norm_backward",
    "layer_norm_backward_kernel",
    "layer_norm_forward",
    "layer_norm_forward_kernel",
]
