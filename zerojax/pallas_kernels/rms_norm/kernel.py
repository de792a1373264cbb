"""RMSNorm (Hugging Face Llama order) forward and backward as Pallas kernels for the GPU (Triton)
lowering.

Same layout as ``layer_norm/kernel.py``: ``x`` is ``[n_rows, n_features]``, a program owns
``block_rows`` whole rows, the feature block is ``n_features`` rounded up to a power of two with
masked tails, and the backward program walks ``backward_block_rows`` rows in tiles while it
accumulates one fp32 partial row of ``dweight`` (summed by the caller; no atomics, deterministic).
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


def rms_norm_forward_kernel(
    x_ref, w_ref, o_ref, rstd_ref, *, n_rows: int, n_features: int, eps: float
):
    """``o = w * (x * rstd).astype(x.dtype)`` for one tile, ``rstd`` from fp32 ``mean(x**2)``.

    ``w_ref`` is None without a weight; ``rstd_ref`` is None when no backward pass needs it.
    """
    block_rows, padded = x_ref.shape
    row_ok, col_ok, mask = _masks(
        pl.program_id(0) * block_rows, block_rows, n_rows, padded, n_features
    )
    x = plgpu.load(x_ref, mask=mask, other=0.0)
    xf = x.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.sum(xf * xf, axis=1) / n_features + eps)
    # HF rounds the normalized value to x.dtype before the weight multiply; keep that rounding
    # so converted models match their PyTorch outputs bit for bit in bf16.
    y = (xf * rstd[:, None]).astype(x.dtype)
    if w_ref is not None:
        w = plgpu.load(w_ref, mask=col_ok, other=0.0)
        # The product of two bf16 values rounded once equals a bf16 multiply, so computing in
        # fp32 and casting to the output dtype matches `weight * y` in any dtype combination.
        y = w.astype(jnp.float32)[None, :] * y.astype(jnp.float32)
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
    program_start = pl.program_id(0) * program_rows
    col_ok = jnp.arange(padded) < n_features
    w = None
    if w_ref is not None:
        w = plgpu.load(w_ref, mask=col_ok, other=0.0).astype(jnp.float32)

    def tile(t, dw_acc):
        start = pl.multiple_of(t * block_rows, block_rows)
        rows = pl.ds(start, block_rows)
        row_ok, _, mask = _masks(program_start + start, block_rows, n_rows, padded, n_features)
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

    dw_acc = lax.fori_loop(0, program_rows // block_rows, tile, jnp.zeros((padded,), jnp.float32))
    if dw_ref is not None:
        plgpu.store(dw_ref, dw_acc, mask=col_ok)


def _bind(kernel, present: tuple[bool, ...], **statics):
    """Adapt a kernel with optional refs: pallas_call passes only the refs that exist."""

    def body(*refs):
        it = iter(refs)
        kernel(*(next(it) if p else None for p in present), **statics)

    return body


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
    n_rows, n_features = x.shape
    padded = pl.next_power_of_2(n_features)
    out_dtype = x.dtype if weight is None else jnp.result_type(weight, x)
    row_block = pl.BlockSpec((block_rows, padded), lambda i: (i, 0))
    operands = [x] + ([weight] if weight is not None else [])
    in_specs = [row_block] + (
        [pl.BlockSpec((padded,), lambda i: (0,))] if weight is not None else []
    )
    out_shape = [jax.ShapeDtypeStruct(x.shape, out_dtype)]
    out_specs = [row_block]
    if with_stats:
        out_shape.append(jax.ShapeDtypeStruct((n_rows,), jnp.float32))
        out_specs.append(pl.BlockSpec((block_rows,), lambda i: (i,)))
    present = (True, weight is not None, True, with_stats)
    outs = pl.pallas_call(
        _bind(rms_norm_forward_kernel, present, n_rows=n_rows, n_features=n_features, eps=eps),
        grid=(pl.cdiv(n_rows, block_rows),),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="rms_norm_forward",
    )(*operands)
    return outs[0], (outs[1] if with_stats else None)


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
    n_rows, n_features = x.shape
    padded = pl.next_power_of_2(n_features)
    n_programs = pl.cdiv(n_rows, backward_block_rows)
    row_block = pl.BlockSpec((backward_block_rows, padded), lambda i: (i, 0))
    has_weight = weight is not None
    operands = [x] + ([weight] if has_weight else []) + [g, rstd]
    in_specs = [row_block] + ([pl.BlockSpec((padded,), lambda i: (0,))] if has_weight else [])
    in_specs += [row_block, pl.BlockSpec((backward_block_rows,), lambda i: (i,))]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_specs = [row_block]
    if has_weight:
        out_shape.append(jax.ShapeDtypeStruct((n_programs, n_features), jnp.float32))
        out_specs.append(pl.BlockSpec((pl.squeezed, padded), lambda i: (i, 0)))
    present = (True, has_weight, True, True, True, has_weight)
    outs = pl.pallas_call(
        _bind(
            rms_norm_backward_kernel,
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
        name="rms_norm_backward",
    )(*operands)
    return outs[0], (outs[1].sum(axis=0) if has_weight else None)


__all__ = [
    "rms_norm_backward",
    "rms_norm_backward_kernel",
    "rms_norm_forward",
    "rms_norm_forward_kernel",
]
