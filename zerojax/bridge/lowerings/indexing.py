"""Lowerings: gather/scatter, advanced indexing, embedding.

Index tensors arrive as int32 (torch's int64 without jax_enable_x64). JAX clamps or drops
out-of-range indices where torch raises, so a program torch rejects may run here.
Ops whose output size depends on tensor values (nonzero, masked_select, x[bool_mask]) cannot be
traced with static shapes and raise `DataDependentShapeError` naming a static alternative.
"""

import jax
import jax.numpy as jnp
import torch
from jax import lax

from zerojax.bridge.dtypes import is_bool, is_floating, result_type
from zerojax.bridge.errors import DataDependentShapeError
from zerojax.bridge.registry import lowering

aten = torch.ops.aten


def _data_dependent(ctx, what: str, alternative: str):
    return DataDependentShapeError(
        f"{what} ({ctx.node.target}) has an output size that depends on the tensor's values; "
        f"torch.export records it as an unbacked size, and a jitted JAX program needs static "
        f"shapes. Rewrite it with a fixed size: {alternative}"
    )


def _dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def _is_mask(index) -> bool:
    # torch treats uint8 index tensors as (deprecated) masks too.
    return index is not None and (is_bool(index.dtype) or index.dtype == jnp.uint8)


def _index_tuple(indices) -> tuple:
    """torch's Tensor?[] indices as a numpy index: None means the whole dim, not a new axis.

    numpy and torch agree on advanced indexing: adjacent index tensors put the broadcast index
    dims in their place, index tensors separated by a sliced dim put them first.
    """
    return tuple(slice(None) if i is None else i for i in indices)


def _masks_to_positions(indices) -> list:
    """Replace each k-d bool mask by k int index arrays of static length mask.size.

    Unused slots point one past the end of their dim, so a scatter with mode="drop" skips them.
    """
    out = []
    for index in indices:
        if not _is_mask(index):
            out.append(index)
            continue
        fill = tuple(index.shape)  # out of bounds in every dim
        out.extend(jnp.nonzero(index, size=index.size, fill_value=fill))
    return out


# --- gather family ---------------------------------------------------------------------------


@lowering(aten.index.Tensor, aten._unsafe_index.Tensor)
def lower_index_tensor(ctx, self, indices):
    """self[indices] with numpy advanced-indexing semantics; None entries keep a dim whole."""
    if any(_is_mask(i) for i in indices):
        raise _data_dependent(
            ctx,
            "boolean-mask indexing x[mask]",
            "torch.where(mask, x, fill) keeps the shape; x.masked_fill(~mask, 0) or a weighted "
            "sum with mask.float() replace a selection followed by a reduction",
        )
    return self[_index_tuple(indices)]


@lowering(aten.gather.default)
def lower_gather_default(ctx, self, dim, index, *, sparse_grad=False):
    """out[..i_dim..] = self[..index[..]..]; index may be smaller than self in other dims."""
    if self.ndim == 0:
        return jnp.take(self.reshape(1), index.reshape(-1)).reshape(index.shape)
    dim = _dim(dim, self.ndim)
    # take_along_axis needs equal non-gathered dims: cut self down to index's extent.
    limits = [self.shape[d] if d == dim else index.shape[d] for d in range(self.ndim)]
    source = lax.slice(self, (0,) * self.ndim, tuple(limits))
    return jnp.take_along_axis(source, index, axis=dim, mode="clip")


@lowering(aten.index_select.default)
def lower_index_select_default(ctx, self, dim, index):
    if self.ndim == 0:
        return jnp.take(self.reshape(1), index.reshape(-1)).reshape(ctx.out_shape)
    return jnp.take(self, index.reshape(-1), axis=_dim(dim, self.ndim), mode="clip")


@lowering(aten.embedding.default)
def lower_embedding_default(
    ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False
):
    """weight[indices]; padding_idx rows get no gradient; scale_grad_by_freq divides each row's
    gradient by how often its index occurs in `indices`. `sparse` only picks torch's grad layout.
    """
    rows = jnp.take(weight, indices, axis=0, mode="clip")
    if scale_grad_by_freq:
        counts = jnp.zeros(weight.shape[0], jnp.int32).at[indices.reshape(-1)].add(1)
        scale = (1.0 / counts[indices]).astype(rows.dtype)[..., None]
        frozen = lax.stop_gradient(rows)
        # Same value, gradient scaled: frozen + (rows - frozen) * scale.
        rows = frozen + (rows - frozen) * scale
    if padding_idx is not None and padding_idx >= 0:
        keep = (indices != padding_idx)[..., None]
        rows = jnp.where(keep, rows, lax.stop_gradient(rows))
    return rows


@lowering(aten.embedding_dense_backward.default)
def lower_embedding_dense_backward_default(
    ctx, grad_output, indices, num_weights, padding_idx, scale_grad_by_freq
):
    """Gradient of embedding w.r.t. weight: scatter-add grad rows into a (num_weights, D) zero."""
    flat_indices = indices.reshape(-1)
    grads = grad_output.reshape(flat_indices.shape[0], -1)
    if padding_idx >= 0:
        grads = jnp.where((flat_indices != padding_idx)[:, None], grads, 0)
    if scale_grad_by_freq:
        counts = jnp.zeros(num_weights, jnp.int32).at[flat_indices].add(1)
        grads = grads / counts[flat_indices][:, None].astype(grads.dtype)
    dtype = grad_output.dtype if is_floating(grad_output.dtype) else jnp.float32
    return jnp.zeros((num_weights, grads.shape[1]), dtype).at[flat_indices].add(grads)


# --- scatter family --------------------------------------------------------------------------


def _scatter_positions(self, dim, index):
    """The full index tuple addressing self[.., index[i], ..] for every element i of index."""
    dim = _dim(dim, self.ndim)
    return tuple(
        index if d == dim else lax.broadcasted_iota(jnp.int32, index.shape, d)
        for d in range(index.ndim)
    )


def _scatter_source(src, index):
    """src cut down to index's shape (torch reads only that corner of src)."""
    if src.ndim == 0:
        return src
    return lax.slice(src, (0,) * src.ndim, tuple(index.shape))


def _check_scatter(self, index):
    if self.ndim == 0 or index.ndim == 0:
        raise NotImplementedError("scatter on 0-d tensors is not supported; unsqueeze first")


@lowering(aten.scatter.src)
def lower_scatter_src(ctx, self, dim, index, src):
    """self with self[.., index[i], ..] = src[i]; with duplicate indices torch picks any writer."""
    _check_scatter(self, index)
    positions = _scatter_positions(self, dim, index)
    return self.at[positions].set(_scatter_source(src, index).astype(self.dtype), mode="drop")


@lowering(aten.scatter.value)
def lower_scatter_value(ctx, self, dim, index, value):
    _check_scatter(self, index)
    positions = _scatter_positions(self, dim, index)
    return self.at[positions].set(jnp.asarray(value, self.dtype), mode="drop")


@lowering(aten.scatter_add.default)
def lower_scatter_add_default(ctx, self, dim, index, src):
    """self with src[i] added at self[.., index[i], ..]; duplicate indices accumulate."""
    _check_scatter(self, index)
    positions = _scatter_positions(self, dim, index)
    return _accumulate(self, positions, _scatter_source(src, index), "add", mode="drop")


def _reduce_identity(reduce: str, dtype):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    if is_floating(dtype):
        return jnp.asarray(-jnp.inf if reduce == "amax" else jnp.inf, dtype)
    if is_bool(dtype):
        return jnp.asarray(reduce == "amin", dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if reduce == "amax" else info.max, dtype)


def _accumulate(self, positions, values, op: str, **kwargs):
    """self.at[positions].<op>(values); bool accumulates in int32 (add = or, multiply = and)."""
    if is_bool(self.dtype):
        out = getattr(self.astype(jnp.int32).at[positions], op)(values.astype(jnp.int32), **kwargs)
        return out != 0
    return getattr(self.at[positions], op)(values.astype(self.dtype), **kwargs)


_REDUCE_OPS = {"sum": "add", "mean": "add", "prod": "multiply", "amax": "max", "amin": "min"}


def _reduce_into(self, positions, values, reduce: str, include_self: bool):
    """Reduce values into self.at[positions] with sum/prod/mean/amax/amin.

    include_self=False: reduced-into positions start from the reduction's identity instead of
    self; untouched positions keep self. mean divides by the number of contributions (+1 for
    self), flooring for integer dtypes as torch does.
    """
    if reduce not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce {reduce!r}")
    hit = jnp.zeros(self.shape, jnp.bool_).at[positions].set(True, mode="drop")
    base = self if include_self else jnp.where(hit, _reduce_identity(reduce, self.dtype), self)
    out = _accumulate(base, positions, values, _REDUCE_OPS[reduce], mode="drop")
    if reduce != "mean":
        return out
    counts = jnp.zeros(self.shape, jnp.int32).at[positions].add(1, mode="drop")
    counts = counts + int(include_self)
    counts = jnp.maximum(counts, 1).astype(out.dtype)
    if is_floating(out.dtype):
        return out / counts
    return jnp.floor_divide(out, counts)


@lowering(aten.scatter_reduce.two)
def lower_scatter_reduce_two(ctx, self, dim, index, src, reduce, *, include_self=True):
    """Reduce src into self at index with sum/prod/mean/amax/amin (see _reduce_into)."""
    _check_scatter(self, index)
    positions = _scatter_positions(self, dim, index)
    return _reduce_into(self, positions, _scatter_source(src, index), reduce, include_self)


# scatter's legacy reduce names.
_LEGACY_REDUCE = {"add": "sum", "multiply": "prod"}


@lowering(aten.scatter.reduce)
def lower_scatter_reduce(ctx, self, dim, index, src, *, reduce):
    """scatter with reduce='add'|'multiply': accumulate src into self (self included)."""
    _check_scatter(self, index)
    positions = _scatter_positions(self, dim, index)
    values = _scatter_source(src, index)
    return _reduce_into(self, positions, values, _LEGACY_REDUCE[reduce], True)


@lowering(aten.scatter.value_reduce)
def lower_scatter_value_reduce(ctx, self, dim, index, value, *, reduce):
    _check_scatter(self, index)
    positions = _scatter_positions(self, dim, index)
    values = jnp.full(index.shape, value, self.dtype)
    return _reduce_into(self, positions, values, _LEGACY_REDUCE[reduce], True)


@lowering(aten.index_reduce.default)
def lower_index_reduce_default(ctx, self, dim, index, source, reduce, *, include_self=True):
    """Reduce source's slices along dim into self's slices index[i] (prod/mean/amax/amin)."""
    if self.ndim == 0:
        self, source = self.reshape(1), source.reshape(1)
    dim = _dim(dim, self.ndim)
    moved = jnp.moveaxis(self, dim, 0)
    values = jnp.moveaxis(source, dim, 0)
    out = _reduce_into(moved, (index.reshape(-1),), values, reduce, include_self)
    return jnp.moveaxis(out, 0, dim).reshape(ctx.out_shape)


@lowering(aten.index_put.default, aten._unsafe_index_put.default)
def lower_index_put_default(ctx, self, indices, values, accumulate=False):
    """self with self[indices] = values (or += with accumulate, duplicates summing).

    values broadcasts to the indexed shape. Bool masks become fixed-size position lists whose
    unused slots are dropped, so masked assignment stays static.
    """
    values = values.astype(self.dtype)
    has_mask = any(_is_mask(i) for i in indices)
    if has_mask and _is_single_leading_mask(indices, values, self):
        return _masked_put(self, indices, values, accumulate)
    indices = _masks_to_positions(indices) if has_mask else indices
    mode = "drop" if has_mask else None
    if accumulate:
        return _accumulate(self, _index_tuple(indices), values, "add", mode=mode)
    return self.at[_index_tuple(indices)].set(values, mode=mode)


def _is_single_leading_mask(indices, values, self) -> bool:
    """indices is [mask] alone and values do not vary along the selected elements."""
    if not _is_mask(indices[0]) or any(i is not None for i in indices[1:]):
        return False
    trailing = self.ndim - indices[0].ndim
    # The indexed shape is (count, *trailing dims); values must broadcast along count.
    return values.ndim <= trailing or values.shape[values.ndim - trailing - 1] == 1


def _masked_put(self, indices, values, accumulate):
    """self[mask] = values for a leading mask, as a select (no scatter)."""
    mask = indices[0].astype(jnp.bool_)
    trailing = self.shape[mask.ndim :]
    if values.ndim > len(trailing):
        values = values.reshape(values.shape[values.ndim - len(trailing) :])
    values = jnp.broadcast_to(values, trailing)
    mask = mask.reshape(mask.shape + (1,) * len(trailing))
    if accumulate:
        return self + jnp.where(mask, values, jnp.zeros((), self.dtype))
    return jnp.where(mask, values, self)


@lowering(aten.put.default)
def lower_put_default(ctx, self, index, source, accumulate=False):
    """self.flatten()[index] = source (or +=), then self's shape; negative indices wrap."""
    flat, index = self.reshape(-1), index.reshape(-1)
    source = source.reshape(-1).astype(self.dtype)
    if accumulate:
        return _accumulate(flat, index, source, "add").reshape(self.shape)
    return flat.at[index].set(source).reshape(self.shape)


@lowering(aten.masked_scatter.default)
def lower_masked_scatter_default(ctx, self, mask, source):
    """Fill self's masked positions, in row-major order, with consecutive elements of source."""
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    flat_self = jnp.broadcast_to(self, shape).reshape(-1)
    # The k-th True takes source.flatten()[k]; cumsum counts Trues up to and including it.
    order = jnp.cumsum(flat_mask.astype(jnp.int32)) - 1
    taken = jnp.take(source.reshape(-1).astype(self.dtype), order, mode="clip")
    return jnp.where(flat_mask, taken, flat_self).reshape(shape)


@lowering(aten.select_scatter.default)
def lower_select_scatter_default(ctx, self, src, dim, index):
    dim = _dim(dim, self.ndim)
    index = index % self.shape[dim]
    return self.at[(slice(None),) * dim + (index,)].set(src.astype(self.dtype))


@lowering(aten.slice_scatter.default)
def lower_slice_scatter_default(ctx, self, src, dim=0, start=None, end=None, step=1):
    """self with self[.., start:end:step, ..] = src (bounds as in aten.slice)."""
    dim = _dim(dim, self.ndim)
    start, end, _ = slice(start, end, step).indices(self.shape[dim])
    end = max(start, end)
    return self.at[(slice(None),) * dim + (slice(start, end, step),)].set(src.astype(self.dtype))


# --- sorted search ---------------------------------------------------------------------------


def _searchsorted(sorted_sequence, values, side: str, sorter=None):
    """Insertion points of values in sorted_sequence's last dim; leading dims pair up."""
    dtype = result_type(sorted_sequence, values)
    sorted_sequence, values = sorted_sequence.astype(dtype), values.astype(dtype)
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    if sorted_sequence.ndim <= 1:
        return jnp.searchsorted(sorted_sequence.reshape(-1), values, side=side)
    # Batched: row b of sorted_sequence is searched by row b of values.
    lead = sorted_sequence.shape[:-1]
    rows = sorted_sequence.reshape(-1, sorted_sequence.shape[-1])
    queries = values.reshape(rows.shape[0], -1)
    found = jax.vmap(lambda row, q: jnp.searchsorted(row, q, side=side))(rows, queries)
    return found.reshape(lead + values.shape[-1:])


def _side(right: bool, side) -> str:
    return side if side is not None else ("right" if right else "left")


@lowering(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def lower_searchsorted_tensor(
    ctx, sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None
):
    """Index where each value would be inserted; side='right' (or right=True) after equals."""
    return _searchsorted(sorted_sequence, jnp.asarray(self), _side(right, side), sorter)


@lowering(aten.bucketize.Tensor, aten.bucketize.Scalar)
def lower_bucketize_tensor(ctx, self, boundaries, *, out_int32=False, right=False):
    """Bucket of each value in 1-D boundaries; right=False: boundaries[i-1] < x <= boundaries[i]."""
    return _searchsorted(boundaries, jnp.asarray(self), _side(right, None))


# --- data-dependent shapes -------------------------------------------------------------------


@lowering(aten.nonzero.default)
def lower_nonzero_default(ctx, self):
    raise _data_dependent(
        ctx,
        "torch.nonzero / torch.where(cond) / argwhere",
        "keep the mask and use torch.where(cond, a, b), or torch.nonzero_static(x, size=N, "
        "fill_value=-1) with a known upper bound N",
    )


@lowering(aten.masked_select.default)
def lower_masked_select_default(ctx, self, mask):
    raise _data_dependent(
        ctx,
        "torch.masked_select / x[mask]",
        "torch.where(mask, x, fill) keeps the shape; reduce with (x * mask).sum() instead",
    )


@lowering(aten.nonzero_static.default)
def lower_nonzero_static_default(ctx, self, *, size, fill_value=-1):
    """The first `size` nonzero coordinates (row-major), padded with fill_value: (size, ndim)."""
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int32)
    coords = jnp.nonzero(self, size=size, fill_value=fill_value)
    return jnp.stack(coords, axis=-1)
