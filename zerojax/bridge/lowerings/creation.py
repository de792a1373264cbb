"""Lowerings: tensor creation (arange, full, empty, ...).

Result dtypes come from torch's recorded output (`ctx.out_dtype`), which already applies torch's
inference (integer arange arguments -> int64, any float -> the default float). `empty*` returns
zeros: JAX has no uninitialized memory, and torch promises nothing about the contents.
"""

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from zerojax.bridge.dtypes import is_floating
from zerojax.bridge.registry import lowering

aten = torch.ops.aten


def _arange(ctx, start, end, step):
    # torch fixes the length as ceil((end - start) / step); use the length it recorded.
    (length,) = ctx.out_shape
    dtype = ctx.out_dtype
    if is_floating(dtype) or any(isinstance(v, float) for v in (start, end, step)):
        # Compute start + i * step in float32 at least (bf16 cannot count past 256 exactly).
        compute = jnp.promote_types(dtype, jnp.float32) if is_floating(dtype) else jnp.float32
        values = lax.iota(compute, length) * jnp.asarray(step, compute) + jnp.asarray(
            start, compute
        )
        return values.astype(dtype)
    return lax.iota(dtype, length) * step + start


@lowering(aten.arange.default)
def lower_arange_default(ctx, end, *, dtype=None):
    return _arange(ctx, 0, end, 1)


@lowering(aten.arange.start)
def lower_arange_start(ctx, start, end, *, dtype=None):
    return _arange(ctx, start, end, 1)


@lowering(aten.arange.start_step)
def lower_arange_start_step(ctx, start, end, step=1, *, dtype=None):
    return _arange(ctx, start, end, step)


@lowering(aten.empty.memory_format, aten.zeros.default)
def lower_empty_memory_format(ctx, size, *, dtype=None):
    return jnp.zeros(tuple(size), ctx.out_dtype)


@lowering(aten.empty_strided.default)
def lower_empty_strided_default(ctx, size, stride, *, dtype=None):
    """Zeros; strides are a layout detail a JAX array does not have."""
    return jnp.zeros(tuple(size), ctx.out_dtype)


@lowering(aten.empty_permuted.default)
def lower_empty_permuted_default(ctx, size, physical_layout, *, dtype=None):
    """Zeros; the physical layout is a memory-order detail a JAX array does not have."""
    return jnp.zeros(tuple(size), ctx.out_dtype)


@lowering(aten.ones.default)
def lower_ones_default(ctx, size, *, dtype=None):
    return jnp.ones(tuple(size), ctx.out_dtype)


@lowering(aten.full.default)
def lower_full_default(ctx, size, fill_value, *, dtype=None):
    return jnp.full(tuple(size), fill_value, ctx.out_dtype)


@lowering(aten.full_like.default)
def lower_full_like_default(ctx, self, fill_value, *, dtype=None):
    return jnp.full(self.shape, fill_value, ctx.out_dtype)


@lowering(aten.zeros_like.default, aten.empty_like.default)
def lower_zeros_like_default(ctx, self, *, dtype=None):
    return jnp.zeros(self.shape, ctx.out_dtype)


@lowering(aten.ones_like.default)
def lower_ones_like_default(ctx, self, *, dtype=None):
    return jnp.ones(self.shape, ctx.out_dtype)


@lowering(aten.new_zeros.default, aten.new_empty.default)
def lower_new_zeros_default(ctx, self, size, *, dtype=None):
    return jnp.zeros(tuple(size), ctx.out_dtype)


@lowering(aten.new_empty_strided.default)
def lower_new_empty_strided_default(ctx, self, size, stride, *, dtype=None):
    return jnp.zeros(tuple(size), ctx.out_dtype)


@lowering(aten.new_ones.default)
def lower_new_ones_default(ctx, self, size, *, dtype=None):
    return jnp.ones(tuple(size), ctx.out_dtype)


@lowering(aten.new_full.default)
def lower_new_full_default(ctx, self, size, fill_value, *, dtype=None):
    return jnp.full(tuple(size), fill_value, ctx.out_dtype)


@lowering(aten.scalar_tensor.default)
def lower_scalar_tensor_default(ctx, s, *, dtype=None):
    return jnp.asarray(s, ctx.out_dtype)


def _pair_indices(ctx, coords):
    # Static (row, col) pairs, row-major as torch orders them: a (2, N) constant.
    return jnp.asarray(np.stack(coords).reshape(2, -1), ctx.out_dtype)


@lowering(aten.tril_indices.default)
def lower_tril_indices_default(ctx, row, col, offset=0, *, dtype=None):
    """(2, N) coordinates of the row x col lower triangle (diagonal `offset` included)."""
    return _pair_indices(ctx, np.tril_indices(row, offset, col))


@lowering(aten.triu_indices.default)
def lower_triu_indices_default(ctx, row, col, offset=0, *, dtype=None):
    """(2, N) coordinates of the row x col upper triangle (diagonal `offset` included)."""
    return _pair_indices(ctx, np.triu_indices(row, offset, col))
