"""Lowerings: view and shape ops.

After functionalization a view op is a value-producing op (nothing aliases), so each lowering
returns the jnp value the view denotes. Shapes, dims and slice bounds are static Python ints.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from zerojax.bridge.dtypes import result_type
from zerojax.bridge.registry import lowering
from zerojax.bridge.symbolic_shapes import concrete

aten = torch.ops.aten


def _dim(dim: int, ndim: int) -> int:
    """torch's wrap of a possibly negative dim; a 0-d tensor accepts dim 0 and -1."""
    bound = max(ndim, 1)
    if not -bound <= dim < bound:
        raise IndexError(f"dim {dim} out of range for a {ndim}-d tensor")
    return dim % bound


def _slice_bounds(size: int, start, end, step: int) -> tuple[int, int]:
    """torch's slice bounds: None means the edge, negatives count from the end, then clamp."""
    if step <= 0:
        raise ValueError(f"slice step must be positive, got {step}")
    start, end, _ = slice(start, end, step).indices(size)
    return start, max(start, end)


@lowering(aten.view.default, aten._unsafe_view.default, aten.view_copy.default)
def lower_view_default(ctx, self, size):
    return jnp.reshape(self, tuple(size))


@lowering(aten.alias.default)
def lower_alias_default(ctx, self):
    return self


@lowering(aten.view.dtype)
def lower_view_dtype(ctx, self, dtype):
    """Reinterpret the bits as `dtype`; a wider/narrower dtype shrinks/grows the last dim."""
    from_torch = ctx.node.args[0].meta["val"].dtype
    target = ctx.jax_dtype(dtype)
    if from_torch.itemsize != jnp.dtype(self.dtype).itemsize or dtype.itemsize != target.itemsize:
        # Without jax_enable_x64, int64/float64 tensors hold 32-bit values: their bits are gone.
        raise NotImplementedError(
            f"Tensor.view({dtype}) on a {from_torch} tensor reinterprets 64-bit storage, which "
            f"JAX holds in 32 bits without jax_enable_x64; use Tensor.to({dtype}) for a value "
            f"conversion instead"
        )
    if from_torch.itemsize == dtype.itemsize:
        return lax.bitcast_convert_type(self, target)
    if from_torch.itemsize > dtype.itemsize:
        # bitcast to a narrower type appends a dim of ratio elements; torch folds it into the last.
        bits = lax.bitcast_convert_type(self, target)
        return bits.reshape(*self.shape[:-1], -1)
    ratio = dtype.itemsize // from_torch.itemsize
    grouped = self.reshape(*self.shape[:-1], self.shape[-1] // ratio, ratio)
    return lax.bitcast_convert_type(grouped, target)


@lowering(aten.expand.default)
def lower_expand_default(ctx, self, size, *, implicit=False):
    """-1 keeps an existing dim; extra sizes are new leading dims."""
    lead = len(size) - self.ndim
    shape = tuple(self.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(self, shape)


@lowering(aten.permute.default, aten.permute_copy.default)
def lower_permute_default(ctx, self, dims):
    return jnp.transpose(self, tuple(_dim(d, self.ndim) for d in dims))


@lowering(aten.unsqueeze.default)
def lower_unsqueeze_default(ctx, self, dim):
    return jnp.expand_dims(self, _dim(dim, self.ndim + 1))


def _squeeze(self, dims):
    # torch leaves a named dim whose size is not 1 alone instead of raising.
    dims = {_dim(d, self.ndim) for d in dims}
    return jnp.squeeze(self, tuple(d for d in sorted(dims) if d < self.ndim and self.shape[d] == 1))


@lowering(aten.squeeze.default)
def lower_squeeze_default(ctx, self):
    return _squeeze(self, range(self.ndim))


@lowering(aten.squeeze.dim)
def lower_squeeze_dim(ctx, self, dim):
    return _squeeze(self, [dim])


@lowering(aten.squeeze.dims)
def lower_squeeze_dims(ctx, self, dim):
    return _squeeze(self, dim)


@lowering(aten.select.int)
def lower_select_int(ctx, self, dim, index):
    dim = _dim(dim, self.ndim)
    size = self.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select: index {index} out of range for dim {dim} of size {size}")
    return lax.index_in_dim(self, index % size, axis=dim, keepdims=False)


@lowering(aten.slice.Tensor)
def lower_slice_tensor(ctx, self, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, self.ndim)
    start, end = _slice_bounds(self.shape[dim], start, end, step)
    return lax.slice_in_dim(self, start, end, step, axis=dim)


@lowering(aten.narrow_copy.default)
def lower_narrow_copy_default(ctx, self, dim, start, length):
    dim = _dim(dim, self.ndim)
    start = start % self.shape[dim] if start < 0 else start
    return lax.slice_in_dim(self, start, start + length, axis=dim)


@lowering(aten.unbind_copy.int)
def lower_unbind_copy_int(ctx, self, dim=0):
    dim = _dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, axis=dim, keepdims=False) for i in range(self.shape[dim])]


@lowering(aten.cat.default)
def lower_cat_default(ctx, tensors, dim=0):
    """Concatenate after torch's promotion; legacy 1-D empty tensors of shape (0,) are skipped."""
    dtype = result_type(*tensors)
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros(ctx.out_shape, dtype)
    dim = _dim(dim, kept[0].ndim)
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=dim)


@lowering(aten.stack.default)
def lower_stack_default(ctx, tensors, dim=0):
    """Stack after torch's promotion. A capture decomposes stack into cat; live tensors meet it
    whole (torch's clip_grad_norm_ stacks the per-gradient norms), where torch's reference
    would be a view per tensor and a cat."""
    dtype = result_type(*tensors)
    dim = _dim(dim, tensors[0].ndim + 1)
    return jnp.stack([t.astype(dtype) for t in tensors], axis=dim)


@lowering(aten.split_with_sizes.default)
def lower_split_with_sizes_default(ctx, self, split_sizes, dim=0):
    dim = _dim(dim, self.ndim)
    if sum(split_sizes) != self.shape[dim]:
        raise ValueError(f"split sizes {split_sizes} do not sum to dim {dim}'s size {self.shape}")
    offsets = np.cumsum([0, *split_sizes])
    return [
        lax.slice_in_dim(self, int(a), int(b), axis=dim) for a, b in itertools.pairwise(offsets)
    ]


@lowering(aten.flip.default)
def lower_flip_default(ctx, self, dims):
    if not dims or self.ndim == 0:
        return self
    return jnp.flip(self, tuple(_dim(d, self.ndim) for d in dims))


@lowering(aten.repeat.default)
def lower_repeat_default(ctx, self, repeats):
    """Tile; more repeats than dims adds leading dims."""
    if len(repeats) < self.ndim:
        raise ValueError(f"repeat needs at least {self.ndim} repeats, got {list(repeats)}")
    lead = len(repeats) - self.ndim
    return jnp.tile(self.reshape((1,) * lead + self.shape), tuple(repeats))


@lowering(aten.constant_pad_nd.default)
def lower_constant_pad_nd_default(ctx, self, pad, value=0):
    """pad = (last_lo, last_hi, prev_lo, prev_hi, ...); negative amounts crop."""
    if len(pad) % 2 or len(pad) // 2 > self.ndim:
        raise ValueError(f"constant_pad_nd: pad {list(pad)} does not fit a {self.ndim}-d tensor")
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        config[self.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, jnp.asarray(value, self.dtype), config)


def _pad_last_dims(self, padding, mode):
    count = len(padding) // 2
    widths = [(0, 0)] * (self.ndim - count)
    widths += [(padding[2 * i], padding[2 * i + 1]) for i in reversed(range(count))]
    return jnp.pad(self, widths, mode=mode)


@lowering(
    aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default
)
def lower_reflection_pad(ctx, self, padding):
    """Mirror padding of the last len(padding)/2 dims, edge excluded."""
    return _pad_last_dims(self, padding, "reflect")


@lowering(
    aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default
)
def lower_replication_pad(ctx, self, padding):
    """Edge-value padding of the last len(padding)/2 dims."""
    return _pad_last_dims(self, padding, "edge")


@lowering(aten.diagonal.default)
def lower_diagonal_default(ctx, self, offset=0, dim1=0, dim2=1):
    """The diagonal of dims (dim1, dim2) as a new last dim; offset > 0 is above the main one."""
    dim1, dim2 = _dim(dim1, self.ndim), _dim(dim2, self.ndim)
    rows, cols = self.shape[dim1], self.shape[dim2]
    length = max(0, min(rows + min(offset, 0), cols - max(offset, 0)))
    if length == 0:
        return jnp.zeros(ctx.out_shape, self.dtype)
    return jnp.diagonal(self, offset, dim1, dim2)


@lowering(aten.diagonal_scatter.default)
def lower_diagonal_scatter_default(ctx, self, src, offset=0, dim1=0, dim2=1):
    """self with its diagonal(offset, dim1, dim2) replaced by src (diagonal as src's last dim)."""
    dim1, dim2 = _dim(dim1, self.ndim), _dim(dim2, self.ndim)
    moved = jnp.moveaxis(self, (dim1, dim2), (-2, -1))
    length = src.shape[-1]
    rows = jnp.arange(length) + max(-offset, 0)
    cols = jnp.arange(length) + max(offset, 0)
    moved = moved.at[..., rows, cols].set(src.astype(self.dtype))
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))


def _storage_positions(shape, stride, offset) -> np.ndarray:
    """The storage index of every element of a strided view (static, numpy)."""
    positions = np.full(tuple(shape), offset, np.int64)
    for axis, (size, step) in enumerate(zip(shape, stride)):
        positions += (np.arange(size) * step).reshape((-1,) + (1,) * (len(shape) - axis - 1))
    return positions


@lowering(aten.as_strided.default, aten.as_strided_copy.default)
def lower_as_strided_default(ctx, self, size, stride, storage_offset=None):
    """Read `size` elements at `stride`/`storage_offset` of the input's storage.

    zerojax holds values, not storage: the input's storage is rebuilt from its recorded strides
    (a permuted or sliced view included), which covers every read that stays inside the input.
    """
    meta = ctx.node.args[0].meta["val"]
    in_stride = tuple(concrete(s, ctx.sizes) for s in meta.stride())
    in_offset = concrete(meta.storage_offset(), ctx.sizes)
    offset = in_offset if storage_offset is None else storage_offset
    held = _storage_positions(self.shape, in_stride, in_offset).reshape(-1)
    wanted = _storage_positions(size, stride, offset)
    if wanted.size == 0:
        return jnp.zeros(tuple(size), self.dtype)
    base = int(min(held.min(initial=offset), wanted.min()))
    span = int(max(held.max(initial=offset), wanted.max())) - base + 1
    covered = np.zeros(span, bool)
    covered[held - base] = True
    if not covered[wanted - base].all():
        raise NotImplementedError(
            f"as_strided(size={list(size)}, stride={list(stride)}, storage_offset={offset}) "
            f"reads storage outside its input (shape {list(self.shape)}, stride "
            f"{list(in_stride)}, offset {in_offset}); zerojax holds tensor values, not "
            f"storage. Apply as_strided to the base tensor, or use unfold/slicing instead"
        )
    if span == held.size and np.array_equal(held - base, np.arange(span)):
        storage = self.reshape(-1)  # contiguous input: its values are its storage
    else:
        storage = (
            jnp.zeros(span, self.dtype)
            .at[jnp.asarray(held - base, jnp.int32)]
            .set(self.reshape(-1), unique_indices=True)
        )
    index = jnp.full(tuple(size), offset - base, jnp.int32)
    for axis, step in enumerate(stride):
        # An iota expression instead of a constant: no index table baked into the program.
        index = index + lax.broadcasted_iota(jnp.int32, tuple(size), axis) * step
    return jnp.take(storage, index, mode="clip")


@lowering(aten.as_strided_scatter.default)
def lower_as_strided_scatter_default(ctx, self, src, size, stride, storage_offset=None):
    """A clone of self with clone.as_strided(size, stride, storage_offset) = src.

    The clone keeps self's strides with a fresh storage (offset 0), which is what size, stride
    and storage_offset address; writes outside that storage are not representable.
    """
    in_stride = tuple(concrete(s, ctx.sizes) for s in ctx.node.args[0].meta["val"].stride())
    held = _storage_positions(self.shape, in_stride, 0).reshape(-1)
    wanted = _storage_positions(size, stride, storage_offset or 0).reshape(-1)
    span = int(held.max(initial=-1)) + 1
    if wanted.size and (wanted.min() < 0 or wanted.max() >= span):
        raise NotImplementedError(
            f"as_strided_scatter(size={list(size)}, stride={list(stride)}) writes outside its "
            f"input's storage; zerojax holds tensor values, not storage"
        )
    held_index = jnp.asarray(held, jnp.int32)
    storage = jnp.zeros(span, self.dtype).at[held_index].set(self.reshape(-1))
    storage = storage.at[jnp.asarray(wanted, jnp.int32)].set(src.reshape(-1).astype(self.dtype))
    return storage[held_index].reshape(self.shape)


@lowering(aten.unfold.default)
def lower_unfold_default(ctx, self, dimension, size, step):
    """Sliding windows of `size` every `step` along `dimension`, window as a new last dim."""
    if self.ndim == 0:
        return jnp.broadcast_to(self, (size,))
    dim = _dim(dimension, self.ndim)
    count = (self.shape[dim] - size) // step + 1
    index = np.arange(count)[:, None] * step + np.arange(size)[None, :]
    windows = jnp.take(self, jnp.asarray(index, jnp.int32), axis=dim)  # (..., count, size, ...)
    return jnp.moveaxis(windows, dim + 1, -1)
