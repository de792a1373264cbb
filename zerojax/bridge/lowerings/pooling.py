"""Lowerings: max / average / adaptive pooling (2-d and 3-d), their backwards, embedding_bag.

Pooling windows are static (shapes are static), so window geometry -- output sizes, padding,
divisors, adaptive window bounds -- is computed in Python/numpy at trace time with torch's own
formulas (aten/src/ATen/native/Pool.h, AdaptivePooling.h) and only the data flows through jnp.
Max pooling returns torch's indices: the flat position of the chosen element within its
input plane (H*W, or D*H*W), the first maximum in window scan order.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from zerojax.bridge.dtypes import is_floating
from zerojax.bridge.registry import lowering

aten = torch.ops.aten


def _expand(value, num_dims: int) -> tuple[int, ...]:
    """torch's int[N] argument: a single int (or 1-element list) means the same for every dim."""
    if isinstance(value, int):
        return (value,) * num_dims
    value = tuple(int(v) for v in value)
    return value * num_dims if len(value) == 1 else value


def _pool_geometry(x, num_dims, kernel_size, stride, padding, dilation=1):
    kernel = _expand(kernel_size, num_dims)
    # An empty stride list means stride = kernel size.
    stride = _expand(stride, num_dims) if stride not in (None, [], ()) else kernel
    return kernel, stride, _expand(padding, num_dims), _expand(dilation, num_dims)


def _pool_output_size(size, kernel, pad, stride, dilation, ceil_mode) -> int:
    """torch's pooling_output_shape: with ceil_mode, the last window must start inside the input
    or its left padding."""
    span = size + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _pad_for_windows(x, num_dims, kernel, stride, padding, dilation, out_sizes, fill):
    """x padded by `padding` with `fill` on the low side and cropped or padded on the high side
    so that exactly out_sizes windows fit (ceil_mode overhang, or rows no window reaches)."""
    lead = x.ndim - num_dims
    config = [(0, 0, 0)] * lead
    for size, k, s, p, d, o in zip(x.shape[lead:], kernel, stride, padding, dilation, out_sizes):
        needed = (o - 1) * s + (k - 1) * d + 1
        config.append((p, needed - size - p, 0))  # lax.pad crops on a negative pad
    return lax.pad(x, np.asarray(fill, x.dtype), config)


def _window_views(padded, num_dims, kernel, stride, dilation, out_sizes):
    """Every kernel offset's strided view of the padded input, stacked last: (..., *out, K),
    in torch's window scan order (last spatial dim fastest)."""
    lead = padded.ndim - num_dims
    views = []
    for offsets in itertools.product(*(range(k) for k in kernel)):
        start = [0] * lead + [off * d for off, d in zip(offsets, dilation)]
        limit = list(padded.shape[:lead]) + [
            st + (o - 1) * s + 1 for st, o, s in zip(start[lead:], out_sizes, stride)
        ]
        views.append(lax.slice(padded, start, limit, [1] * lead + list(stride)))
    return jnp.stack(views, axis=-1)


def _lowest(dtype):
    return -jnp.inf if is_floating(dtype) else jnp.iinfo(dtype).min


def _max_pool_with_indices(x, num_dims, kernel_size, stride, padding, dilation, ceil_mode):
    kernel, stride, padding, dilation = _pool_geometry(
        x, num_dims, kernel_size, stride, padding, dilation
    )
    spatial = x.shape[x.ndim - num_dims :]
    out_sizes = [
        _pool_output_size(n, k, p, s, d, ceil_mode)
        for n, k, p, s, d in zip(spatial, kernel, padding, stride, dilation)
    ]
    padded = _pad_for_windows(
        x, num_dims, kernel, stride, padding, dilation, out_sizes, _lowest(x.dtype)
    )
    lead = x.ndim - num_dims
    # Indices by argmax over the stacked windows: the first maximum, as torch's scan picks
    # (XLA drops this when the graph never reads the indices).
    views = _window_views(padded, num_dims, kernel, stride, dilation, out_sizes)
    choice = jnp.argmax(views, axis=-1)
    if all(d == 1 for d in dilation):
        # A windowed max: its VJP (select-and-scatter) sends each gradient to the window's first
        # maximum, as torch's backward does, without materializing the windows.
        values = lax.reduce_window(
            padded,
            np.asarray(_lowest(x.dtype), x.dtype),
            lax.max,
            (1,) * lead + kernel,
            (1,) * lead + stride,
            "VALID",
        )
    else:
        # JAX has no VJP for a dilated windowed max; gather the argmax instead (same gradient).
        values = jnp.take_along_axis(views, choice[..., None], axis=-1)[..., 0]
    # Window offset -> input coordinate per dim -> flat index into the input plane.
    offsets = jnp.unravel_index(choice, kernel)
    flat = jnp.zeros(choice.shape, jnp.int32)
    for axis, (off, size, s, p, d) in enumerate(zip(offsets, spatial, stride, padding, dilation)):
        shape = [1] * choice.ndim
        shape[choice.ndim - num_dims + axis] = -1
        origin = jnp.arange(out_sizes[axis], dtype=jnp.int32).reshape(shape) * s - p
        flat = flat * size + origin + off.astype(jnp.int32) * d
    return values, flat


@lowering(aten.max_pool2d_with_indices.default)
def lower_max_pool2d_with_indices_default(
    ctx, self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False
):
    """(values, int64 indices into each input H*W plane); padding counts as -inf."""
    return _max_pool_with_indices(self, 2, kernel_size, stride, padding, dilation, ceil_mode)


@lowering(aten.max_pool3d_with_indices.default)
def lower_max_pool3d_with_indices_default(
    ctx, self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False
):
    """(values, int64 indices into each input D*H*W volume); padding counts as -inf."""
    return _max_pool_with_indices(self, 3, kernel_size, stride, padding, dilation, ceil_mode)


def _scatter_to_indices(grad_output, self, indices, num_dims):
    """Add each output gradient into the input element its flat plane index names."""
    lead = self.shape[: self.ndim - num_dims]
    plane = math.prod(self.shape[self.ndim - num_dims :])
    rows = math.prod(lead)
    grad = grad_output.reshape(rows, -1)
    where = indices.reshape(rows, -1)
    grad_input = jnp.zeros((rows, plane), grad.dtype)
    grad_input = grad_input.at[jnp.arange(rows)[:, None], where].add(grad)
    return grad_input.reshape(self.shape)


@lowering(aten.max_pool2d_with_indices_backward.default)
def lower_max_pool2d_with_indices_backward_default(
    ctx, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices
):
    return _scatter_to_indices(grad_output, self, indices, 2)


@lowering(aten.max_pool3d_with_indices_backward.default)
def lower_max_pool3d_with_indices_backward_default(
    ctx, grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices
):
    return _scatter_to_indices(grad_output, self, indices, 3)


def _avg_divisor_1d(size, kernel, stride, pad, out, count_include_pad) -> np.ndarray:
    """Per-output window length along one dim, as torch's avg_pool kernels count it."""
    start = np.arange(out) * stride - pad
    end = np.minimum(start + kernel, size + pad)
    if count_include_pad:
        return end - start  # padding counts, the ceil_mode overhang past it does not
    return np.minimum(end, size) - np.maximum(start, 0)


def _avg_pool(
    x, num_dims, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    kernel, stride, padding, _ = _pool_geometry(x, num_dims, kernel_size, stride, padding)
    spatial = x.shape[x.ndim - num_dims :]
    out_sizes = [
        _pool_output_size(n, k, p, s, 1, ceil_mode)
        for n, k, p, s in zip(spatial, kernel, padding, stride)
    ]
    compute = jnp.promote_types(x.dtype, jnp.float32)  # torch accumulates in opmath (float)
    padded = _pad_for_windows(
        x.astype(compute), num_dims, kernel, stride, padding, (1,) * num_dims, out_sizes, 0
    )
    lead = x.ndim - num_dims
    # A concrete numpy zero lets JAX see a windowed sum (differentiable reduce_window_sum).
    total = lax.reduce_window(
        padded, np.zeros((), compute), lax.add, (1,) * lead + kernel, (1,) * lead + stride, "VALID"
    )
    if divisor_override:
        return total / divisor_override
    divisor = np.ones((), np.float64)
    for size, k, s, p, o in zip(spatial, kernel, stride, padding, out_sizes):
        divisor = np.multiply.outer(divisor, _avg_divisor_1d(size, k, s, p, o, count_include_pad))
    return total / jnp.asarray(divisor, compute)


@lowering(aten.avg_pool2d.default)
def lower_avg_pool2d_default(
    ctx,
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    return _avg_pool(
        self, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )


@lowering(aten.avg_pool1d.default)
def lower_avg_pool1d_default(
    ctx, self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True
):
    return _avg_pool(self, 1, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


@lowering(aten.avg_pool3d.default)
def lower_avg_pool3d_default(
    ctx,
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    return _avg_pool(
        self, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )


def _linear_backward(forward, grad_output, self):
    """The backward of a linear op in `self`: its VJP, evaluated at grad_output."""
    compute = jnp.promote_types(self.dtype, jnp.float32)
    _, vjp = jax.vjp(forward, jnp.zeros(self.shape, compute))
    return vjp(grad_output.astype(compute))[0]


def _avg_pool_backward(num_dims, grad_output, self, *pool_args):
    """avg_pool is linear in its input: its backward is the VJP of the forward."""
    return _linear_backward(lambda x: _avg_pool(x, num_dims, *pool_args), grad_output, self)


@lowering(aten.avg_pool2d_backward.default)
def lower_avg_pool2d_backward_default(
    ctx,
    grad_output,
    self,
    kernel_size,
    stride,
    padding,
    ceil_mode,
    count_include_pad,
    divisor_override,
):
    return _avg_pool_backward(
        2,
        grad_output,
        self,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )


@lowering(aten.avg_pool3d_backward.default)
def lower_avg_pool3d_backward_default(
    ctx,
    grad_output,
    self,
    kernel_size,
    stride,
    padding,
    ceil_mode,
    count_include_pad,
    divisor_override,
):
    return _avg_pool_backward(
        3,
        grad_output,
        self,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )


def _adaptive_windows(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's adaptive windows: start = floor(i*in/out), end = ceil((i+1)*in/out)."""
    i = np.arange(out)
    start = (i * size) // out
    end = -((-(i + 1) * size) // out)
    return start, end


def _adaptive_taps(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """(out, L) gather positions of each window, padded by repeating its last element, and a
    mask of the real ones. Repeats come after the real maximum, so argmax is unaffected."""
    start, end = _adaptive_windows(size, out)
    taps = np.arange((end - start).max())
    positions = np.minimum(start[:, None] + taps, end[:, None] - 1)
    return positions, start[:, None] + taps < end[:, None]


def _adaptive_avg_pool(x, output_size):
    num_dims = len(output_size)
    compute = jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(compute)
    for axis_from_end, out in zip(range(num_dims, 0, -1), output_size):
        axis = x.ndim - axis_from_end
        size = x.shape[axis]
        if size % out == 0:
            # Equal, disjoint windows: a reshape and a mean.
            x = x.reshape(x.shape[:axis] + (out, size // out) + x.shape[axis + 1 :])
            x = x.mean(axis=axis + 1)
            continue
        positions, mask = _adaptive_taps(size, out)
        gathered = jnp.take(x, jnp.asarray(positions), axis=axis)  # (..., out, L, ...)
        shape = [1] * gathered.ndim
        shape[axis : axis + 2] = mask.shape
        weights = mask / mask.sum(axis=1, keepdims=True)
        x = (gathered * jnp.asarray(weights.reshape(shape), compute)).sum(axis=axis + 1)
    return x


@lowering(
    aten.adaptive_avg_pool1d.default,
    aten._adaptive_avg_pool2d.default,
    aten._adaptive_avg_pool3d.default,
)
def lower__adaptive_avg_pool_default(ctx, self, output_size):
    """Mean over torch's adaptive windows (overlapping when sizes do not divide)."""
    return _adaptive_avg_pool(self, [int(o) for o in output_size])


@lowering(aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default)
def lower__adaptive_avg_pool_backward_default(ctx, grad_output, self):
    num_dims = 2 if ctx.node.target == aten._adaptive_avg_pool2d_backward.default else 3
    output_size = grad_output.shape[grad_output.ndim - num_dims :]
    return _linear_backward(lambda x: _adaptive_avg_pool(x, output_size), grad_output, self)


def _adaptive_max_pool(x, output_size):
    num_dims = len(output_size)
    lead = x.ndim - num_dims
    spatial = x.shape[lead:]
    gathered, taps = x, []
    # Gather every dim's windows: (..., o1, L1, o2, L2, ...).
    for axis_index, (size, out) in enumerate(zip(spatial, output_size)):
        positions, _ = _adaptive_taps(size, out)
        taps.append(positions)
        gathered = jnp.take(gathered, jnp.asarray(positions), axis=lead + 2 * axis_index)
    order = (
        list(range(lead))
        + [lead + 2 * i for i in range(num_dims)]
        + [lead + 2 * i + 1 for i in range(num_dims)]
    )
    windows = gathered.transpose(order)
    windows = windows.reshape(windows.shape[: lead + num_dims] + (-1,))
    choice = jnp.argmax(windows, axis=-1)
    values = jnp.take_along_axis(windows, choice[..., None], axis=-1)[..., 0]
    offsets = jnp.unravel_index(choice, [t.shape[1] for t in taps])
    flat = jnp.zeros(choice.shape, jnp.int32)
    for axis_index, (off, positions, size) in enumerate(zip(offsets, taps, spatial)):
        # positions[o, l] is the input coordinate of tap l of window o along this dim.
        shape = [1] * choice.ndim
        shape[lead + axis_index] = -1
        rows = jnp.arange(positions.shape[0]).reshape(shape)
        flat = flat * size + jnp.asarray(positions, jnp.int32)[rows, off]
    return values, flat


@lowering(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def lower_adaptive_max_pool_default(ctx, self, output_size):
    """(values, int64 flat indices into each input plane) over torch's adaptive windows."""
    return _adaptive_max_pool(self, [int(o) for o in output_size])


@lowering(aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default)
def lower_adaptive_max_pool_backward_default(ctx, grad_output, self, indices):
    num_dims = 2 if ctx.node.target == aten.adaptive_max_pool2d_backward.default else 3
    return _scatter_to_indices(grad_output, self, indices, num_dims)


def _fractional_starts(sample, size, out, kernel):
    """torch's generate_intervals, in the sample's float type: window i starts at
    int((i + u) * alpha) - int(u * alpha), alpha = (size - kernel) / (out - 1); the last window
    ends at the input's end."""
    i = jnp.arange(out - 1, dtype=sample.dtype)
    alpha = jnp.asarray((size - kernel) / (out - 1) if out > 1 else 0, sample.dtype)
    u = sample[..., None]
    starts = ((i + u) * alpha).astype(jnp.int32) - (u * alpha).astype(jnp.int32)
    last = jnp.full(starts.shape[:-1] + (1,), size - kernel, jnp.int32)
    return jnp.concatenate([starts, last], axis=-1)


def _fractional_max_pool(x, kernel_size, output_size, random_samples, sample_order):
    """Max over pseudo-random windows; random_samples (N, C, num_dims) in [0, 1) place them.
    sample_order[d] is the sample spatial dim d uses (2-d: (1, 0), i.e. W draws sample 0)."""
    num_dims = len(output_size)
    unbatched = x.ndim == num_dims + 1
    if unbatched:
        x = x[None]
    kernel = _expand(kernel_size, num_dims)
    spatial = x.shape[2:]
    samples = random_samples.astype(jnp.promote_types(x.dtype, jnp.float32))

    def pool_plane(plane, sample):
        """One (spatial...) plane and its num_dims samples -> (values, flat indices)."""
        positions = [
            (_fractional_starts(sample[sample_order[d]], size, out, k)[:, None] + jnp.arange(k))
            for d, (size, out, k) in enumerate(zip(spatial, output_size, kernel))
        ]  # per dim: (out_d, k_d) input coordinates
        windows = plane[jnp.ix_(*(p.reshape(-1) for p in positions))]
        windows = windows.reshape([n for out, k in zip(output_size, kernel) for n in (out, k)])
        order = [2 * d for d in range(num_dims)] + [2 * d + 1 for d in range(num_dims)]
        windows = windows.transpose(order).reshape(tuple(output_size) + (-1,))
        choice = jnp.argmax(windows, axis=-1)
        values = jnp.take_along_axis(windows, choice[..., None], axis=-1)[..., 0]
        offsets = jnp.unravel_index(choice, kernel)
        flat = jnp.zeros(choice.shape, jnp.int32)
        for d, (off, p, size) in enumerate(zip(offsets, positions, spatial)):
            shape = [1] * num_dims
            shape[d] = -1
            flat = flat * size + p[:, 0].reshape(shape) + off.astype(jnp.int32)
        return values, flat

    values, flat = jax.vmap(jax.vmap(pool_plane))(x, samples)
    if unbatched:
        values, flat = values[0], flat[0]
    return values, flat


@lowering(aten.fractional_max_pool2d.default)
def lower_fractional_max_pool2d_default(ctx, self, kernel_size, output_size, random_samples):
    """(values, flat H*W indices); random_samples[..., 0] places the W windows, [..., 1] H."""
    return _fractional_max_pool(self, kernel_size, list(output_size), random_samples, (1, 0))


@lowering(aten.fractional_max_pool3d.default)
def lower_fractional_max_pool3d_default(ctx, self, kernel_size, output_size, random_samples):
    """(values, flat D*H*W indices); random_samples[..., 0/1/2] place the D/H/W windows."""
    return _fractional_max_pool(self, kernel_size, list(output_size), random_samples, (0, 1, 2))


_EMBEDDING_BAG_SUM, _EMBEDDING_BAG_MEAN, _EMBEDDING_BAG_MAX = 0, 1, 2


@lowering(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def lower__embedding_bag_default(
    ctx,
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    """(output, offset2bag, bag_size, max_indices): bag b reduces weight[indices[offsets[b]:
    offsets[b+1]]]; with include_last_offset the last bag still runs to the end of `indices`.
    Empty bags give 0. Only `output` is torch-exact; the other three have torch's shapes."""
    metas = ctx.out_meta
    num_bags = int(metas[0].shape[0])
    n = indices.shape[0]
    bag = jnp.searchsorted(offsets[:num_bags], jnp.arange(n, dtype=offsets.dtype), side="right")
    bag = (bag - 1).astype(jnp.int32)
    keep = indices != padding_idx if padding_idx >= 0 else jnp.ones((n,), bool)
    # Excluded positions go to segment num_bags, which segment_* drops.
    segment = jnp.where(keep, bag, num_bags)
    rows = jnp.take(weight, indices, axis=0)
    counts = jax.ops.segment_sum(keep.astype(jnp.int32), segment, num_segments=num_bags)
    if mode == _EMBEDDING_BAG_MAX:
        output = jax.ops.segment_max(rows, segment, num_segments=num_bags)
        output = jnp.where(counts[:, None] > 0, output, 0)
        # The index of each bag's (first) maximum per feature, 0 for empty bags, like torch.
        hit = (rows == output[jnp.minimum(segment, num_bags - 1)]) & keep[:, None]
        position = jnp.where(hit, jnp.arange(n)[:, None], n)
        first = jax.ops.segment_min(position, segment, num_segments=num_bags)
        max_indices = jnp.where(first < n, indices[jnp.minimum(first, n - 1)], 0)
    else:
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[:, None].astype(rows.dtype)
        if include_last_offset:
            # torch's sum/mean stop the last bag at offsets[-1] yet (mean) divide by its size
            # counted to the end of `indices`; max runs to the end. Same when well-formed.
            inside = jnp.arange(n, dtype=offsets.dtype) < offsets[num_bags]
            rows = jnp.where(inside[:, None], rows, 0)
        output = jax.ops.segment_sum(rows, segment, num_segments=num_bags)
        if mode == _EMBEDDING_BAG_MEAN:
            output = output / jnp.maximum(counts, 1)[:, None].astype(output.dtype)
        max_indices = jnp.zeros((num_bags,), jnp.int32)
    offset2bag = bag if mode != _EMBEDDING_BAG_SUM else jnp.zeros((0,), jnp.int32)
    bag_size = counts if mode != _EMBEDDING_BAG_SUM else jnp.zeros((num_bags,), jnp.int32)
    return (
        output,
        _fit(offset2bag, metas[1].shape),
        _fit(bag_size, metas[2].shape),
        _fit(max_indices, metas[3].shape),
    )


def _fit(value, shape):
    """Zero-pad or crop the leading dim to torch's recorded shape (forward_only sizes some
    auxiliary outputs by len(offsets), _embedding_bag by the number of bags)."""
    shape = tuple(int(d) for d in shape)
    if value.shape == shape:
        return value
    value = value[: shape[0]]
    pad = [(0, shape[0] - value.shape[0])] + [(0, 0)] * (value.ndim - 1)
    return jnp.broadcast_to(jnp.pad(value, pad), shape)
