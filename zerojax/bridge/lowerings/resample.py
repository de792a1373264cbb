"""Lowerings: upsampling (nearest, (bi/tri)linear, bicubic, antialiased bilinear), grid_sample.

Upsampling is separable and its source positions depend only on static sizes, so each spatial
dim is resampled by a gather of `taps` source rows and a weighted sum, with the taps and weights
computed at trace time in float32 by torch's formulas (aten/src/ATen/native/UpSample.h): the
same rounding of the source coordinate as torch's kernels, hence the same indices.
grid_sampler_{2,3}d gathers at data-dependent positions (GridSampler.h).
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from zerojax.bridge.registry import lowering

aten = torch.ops.aten

_f32 = np.float32


def _inverse_scale(size_in: int, size_out: int, scale) -> np.float32:
    """torch's compute_scales_value: 1/scale when a scale factor was given, else in/out."""
    if scale is not None and scale > 0:
        return _f32(1.0 / scale)
    return _f32(size_in) / _f32(size_out)


def _nearest_taps(size_in, size_out, scale, exact=False):
    """torch's nearest_idx (and nearest_neighbor_exact_compute_source_index)."""
    out = np.arange(size_out)
    if exact:
        ratio = _inverse_scale(size_in, size_out, scale)
        source = np.floor((out.astype(_f32) + _f32(0.5)) * ratio).astype(np.int64)
    elif size_out == size_in:
        source = out
    elif size_out == 2 * size_in:
        source = out >> 1
    else:
        ratio = _inverse_scale(size_in, size_out, scale)
        source = np.floor(out.astype(_f32) * ratio).astype(np.int64)
    return np.minimum(source, size_in - 1)[:, None], None


def _source_coordinate(size_in, size_out, align_corners, scale, cubic=False):
    """torch's area_pixel_compute_scale + area_pixel_compute_source_index, in float32."""
    out = np.arange(size_out).astype(_f32)
    if align_corners:
        ratio = _f32(size_in - 1) / _f32(size_out - 1) if size_out > 1 else _f32(0)
        return ratio * out
    ratio = _inverse_scale(size_in, size_out, scale)
    source = ratio * (out + _f32(0.5)) - _f32(0.5)
    # Linear modes clamp negative coordinates to 0; cubic keeps them (its taps are clamped).
    return source if cubic else np.maximum(source, _f32(0))


def _linear_taps(size_in, size_out, align_corners, scale):
    source = _source_coordinate(size_in, size_out, align_corners, scale)
    low = np.floor(source).astype(np.int64)
    high = low + (low < size_in - 1)
    frac = source - low.astype(_f32)
    return np.stack([low, high], 1), np.stack([_f32(1) - frac, frac], 1)


def _cubic_coefficients(t, a=-0.75):
    """Weights of the taps at offsets -1, 0, 1, 2 from floor(x), t = x - floor(x): Keys' cubic
    convolution with torch's a = -0.75. Plain arithmetic, so numpy or jnp."""

    def near(s):  # |s| <= 1
        return ((a + 2) * s - (a + 3)) * s * s + 1

    def far(s):  # 1 < |s| < 2
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _cubic_taps(size_in, size_out, align_corners, scale):
    source = _source_coordinate(size_in, size_out, align_corners, scale, cubic=True)
    low = np.floor(source)
    weights = np.stack(_cubic_coefficients(source - low, _f32(-0.75)), 1).astype(_f32)
    taps = low.astype(np.int64)[:, None] + np.arange(-1, 3)
    # Taps past the border repeat the edge pixel (torch's upsample_get_value_bounded).
    return np.clip(taps, 0, size_in - 1), weights


def _triangle(x):
    return np.maximum(0.0, 1.0 - np.abs(x))


def _keys_cubic(x, a=-0.5):
    """PIL's bicubic filter (a = -0.5), which torch's antialiased bicubic uses."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _antialias_taps(size_in, size_out, align_corners, scale, *, filter_fn, filter_size):
    """torch's _compute_index_ranges_weights with antialias: when downsampling by `ratio`, the
    filter is stretched by it so every input pixel contributes; weights are renormalized."""
    if align_corners:
        ratio = _f32(size_in - 1) / _f32(size_out - 1) if size_out > 1 else _f32(0)
    else:
        ratio = _inverse_scale(size_in, size_out, scale)
    ratio = float(ratio)
    support = filter_size * 0.5 * max(ratio, 1.0)
    inverse = 1.0 / ratio if ratio >= 1.0 else 1.0
    width = math.ceil(support) * 2 + 1
    taps = np.zeros((size_out, width), np.int64)
    weights = np.zeros((size_out, width), _f32)
    for i in range(size_out):
        center = ratio * (i + 0.5)
        # int() truncates toward zero, as torch's static_cast<int64_t> does.
        lo = max(int(center - support + 0.5), 0)
        count = min(int(center + support + 0.5), size_in) - lo
        w = filter_fn((np.arange(count) + lo - center + 0.5) * inverse)
        total = w.sum()
        weights[i, :count] = w / total if total != 0 else w
        taps[i, :count] = np.arange(lo, lo + count)
        taps[i, count:] = lo + count - 1  # weight 0: any valid index will do
    return taps, weights


_bilinear_aa_taps = functools.partial(_antialias_taps, filter_fn=_triangle, filter_size=2)
_bicubic_aa_taps = functools.partial(_antialias_taps, filter_fn=_keys_cubic, filter_size=4)


def _resample(x, out_sizes, make_taps):
    """Resample the trailing len(out_sizes) dims, one at a time, with make_taps(in, out, dim)."""
    num_dims = len(out_sizes)
    # Integer images (uint8) only take the nearest mode's gathers; floats compute in >= fp32.
    integer = jnp.issubdtype(x.dtype, jnp.integer)
    compute = x.dtype if integer else jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(compute)
    # Last dim first, as torch's separable CPU kernels do.
    for dim in reversed(range(num_dims)):
        axis = x.ndim - num_dims + dim
        taps, weights = make_taps(x.shape[axis], out_sizes[dim], dim)
        gathered = jnp.take(x, jnp.asarray(taps), axis=axis)  # (..., out, T, ...)
        if weights is None:
            x = jnp.squeeze(gathered, axis + 1)
            continue
        shape = [1] * gathered.ndim
        shape[axis : axis + 2] = weights.shape
        x = (gathered * jnp.asarray(weights.reshape(shape), compute)).sum(axis=axis + 1)
    return x


def _vec_scales(scale_factors, num_dims):
    return list(scale_factors) if scale_factors is not None else [None] * num_dims


def _nearest(ctx, x, scales, exact=False):
    num_dims = len(scales)
    out_sizes = ctx.out_shape[-num_dims:]
    return _resample(x, out_sizes, lambda n, o, d: _nearest_taps(n, o, scales[d], exact))


def _interpolating(ctx, x, align_corners, scales, taps_fn):
    num_dims = len(scales)
    out_sizes = ctx.out_shape[-num_dims:]
    return _resample(x, out_sizes, lambda n, o, d: taps_fn(n, o, align_corners, scales[d]))


@lowering(aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec)
def lower_upsample_nearest_vec(ctx, input, output_size, scale_factors):
    """Nearest upsampling to output_size, or by scale_factors (torch then floors in*scale and
    maps back with 1/scale, not in/out)."""
    num_dims = input.ndim - 2
    return _nearest(ctx, input, _vec_scales(scale_factors, num_dims))


@lowering(aten.upsample_nearest1d.default)
def lower_upsample_nearest1d_default(ctx, self, output_size, scales=None):
    return _nearest(ctx, self, [scales])


@lowering(aten.upsample_nearest2d.default)
def lower_upsample_nearest2d_default(ctx, self, output_size, scales_h=None, scales_w=None):
    return _nearest(ctx, self, [scales_h, scales_w])


@lowering(aten.upsample_nearest3d.default)
def lower_upsample_nearest3d_default(
    ctx, self, output_size, scales_d=None, scales_h=None, scales_w=None
):
    return _nearest(ctx, self, [scales_d, scales_h, scales_w])


@lowering(
    aten._upsample_nearest_exact1d.vec,
    aten._upsample_nearest_exact2d.vec,
    aten._upsample_nearest_exact3d.vec,
)
def lower__upsample_nearest_exact_vec(ctx, input, output_size, scale_factors):
    """'nearest-exact': source = floor((out + 0.5) / scale), PIL/scikit-image's convention."""
    return _nearest(ctx, input, _vec_scales(scale_factors, input.ndim - 2), exact=True)


@lowering(aten._upsample_nearest_exact1d.default)
def lower__upsample_nearest_exact1d_default(ctx, self, output_size, scales=None):
    return _nearest(ctx, self, [scales], exact=True)


@lowering(aten._upsample_nearest_exact2d.default)
def lower__upsample_nearest_exact2d_default(ctx, self, output_size, scales_h=None, scales_w=None):
    return _nearest(ctx, self, [scales_h, scales_w], exact=True)


@lowering(aten._upsample_nearest_exact3d.default)
def lower__upsample_nearest_exact3d_default(
    ctx, self, output_size, scales_d=None, scales_h=None, scales_w=None
):
    return _nearest(ctx, self, [scales_d, scales_h, scales_w], exact=True)


@lowering(aten.upsample_linear1d.vec, aten.upsample_bilinear2d.vec, aten.upsample_trilinear3d.vec)
def lower_upsample_linear_vec(ctx, input, output_size, align_corners, scale_factors):
    """(Bi/tri)linear upsampling; without align_corners, source = (out + 0.5) / scale - 0.5."""
    scales = _vec_scales(scale_factors, input.ndim - 2)
    return _interpolating(ctx, input, align_corners, scales, _linear_taps)


@lowering(aten.upsample_linear1d.default)
def lower_upsample_linear1d_default(ctx, self, output_size, align_corners, scales=None):
    return _interpolating(ctx, self, align_corners, [scales], _linear_taps)


@lowering(aten.upsample_bilinear2d.default)
def lower_upsample_bilinear2d_default(
    ctx, self, output_size, align_corners, scales_h=None, scales_w=None
):
    return _interpolating(ctx, self, align_corners, [scales_h, scales_w], _linear_taps)


@lowering(aten.upsample_trilinear3d.default)
def lower_upsample_trilinear3d_default(
    ctx, self, output_size, align_corners, scales_d=None, scales_h=None, scales_w=None
):
    return _interpolating(ctx, self, align_corners, [scales_d, scales_h, scales_w], _linear_taps)


@lowering(aten.upsample_bicubic2d.vec)
def lower_upsample_bicubic2d_vec(ctx, input, output_size, align_corners, scale_factors):
    """Bicubic (a = -0.75) upsampling; taps beyond the border repeat the edge pixel."""
    scales = _vec_scales(scale_factors, 2)
    return _interpolating(ctx, input, align_corners, scales, _cubic_taps)


@lowering(aten.upsample_bicubic2d.default)
def lower_upsample_bicubic2d_default(
    ctx, self, output_size, align_corners, scales_h=None, scales_w=None
):
    return _interpolating(ctx, self, align_corners, [scales_h, scales_w], _cubic_taps)


@lowering(aten._upsample_bilinear2d_aa.vec)
def lower__upsample_bilinear2d_aa_vec(ctx, input, output_size, align_corners, scale_factors):
    """Antialiased bilinear (interpolate(..., antialias=True)): PIL's triangle filter."""
    scales = _vec_scales(scale_factors, 2)
    return _interpolating(ctx, input, align_corners, scales, _bilinear_aa_taps)


@lowering(aten._upsample_bilinear2d_aa.default)
def lower__upsample_bilinear2d_aa_default(
    ctx, self, output_size, align_corners, scales_h=None, scales_w=None
):
    return _interpolating(ctx, self, align_corners, [scales_h, scales_w], _bilinear_aa_taps)


@lowering(aten._upsample_bicubic2d_aa.vec)
def lower__upsample_bicubic2d_aa_vec(ctx, input, output_size, align_corners, scale_factors):
    """Antialiased bicubic: PIL's cubic filter (a = -0.5)."""
    scales = _vec_scales(scale_factors, 2)
    return _interpolating(ctx, input, align_corners, scales, _bicubic_aa_taps)


@lowering(aten._upsample_bicubic2d_aa.default)
def lower__upsample_bicubic2d_aa_default(
    ctx, self, output_size, align_corners, scales_h=None, scales_w=None
):
    return _interpolating(ctx, self, align_corners, [scales_h, scales_w], _bicubic_aa_taps)


# grid_sampler's integer codes (GridSamplerInterpolation / GridSamplerPadding in torch).
_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _unnormalize(coord, size, align_corners):
    """[-1, 1] grid coordinate -> input pixel coordinate."""
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord, twice_low, twice_high):
    """torch's reflect_coordinates: fold coord into [low, high] by mirroring."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _apply_padding(coord, size, padding_mode, align_corners):
    """torch's compute_coordinates: border clamps, reflection mirrors then clamps."""
    if padding_mode == _BORDER:
        return jnp.clip(coord, 0, size - 1)
    if padding_mode == _REFLECTION:
        if align_corners:
            coord = _reflect(coord, 0, 2 * (size - 1))
        else:
            coord = _reflect(coord, -1, 2 * size - 1)
        return jnp.clip(coord, 0, size - 1)
    return coord


def _gather_points(x, coords, sizes):
    """x (N, C, *sizes) at integer coords [(N, *out) per spatial dim]; 0 out of bounds.
    Returns (N, C, *out)."""
    n, c = x.shape[:2]
    out_shape = coords[0].shape[1:]
    inside = jnp.ones(coords[0].shape, bool)
    flat = jnp.zeros(coords[0].shape, jnp.int32)
    for coord, size in zip(coords, sizes):
        inside &= (coord >= 0) & (coord < size)
        flat = flat * size + jnp.clip(coord, 0, size - 1).astype(jnp.int32)
    planes = x.reshape(n, c, -1)
    values = jax.vmap(lambda plane, where: plane[:, where])(planes, flat.reshape(n, -1))
    values = values.reshape((n, c) + out_shape)
    return jnp.where(inside[:, None], values, jnp.zeros((), values.dtype))


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    num_dims = input.ndim - 2
    compute = jnp.promote_types(jnp.result_type(input, grid), jnp.float32)
    input, grid = input.astype(compute), grid.astype(compute)
    sizes = input.shape[2:]
    # grid's last axis is (x, y[, z]): x indexes the last (W) dim.
    raw = [
        _unnormalize(grid[..., num_dims - 1 - d], sizes[d], align_corners) for d in range(num_dims)
    ]
    if interpolation_mode == _BICUBIC:
        return _grid_sample_bicubic(input, raw, padding_mode, align_corners)
    coords = [_apply_padding(c, size, padding_mode, align_corners) for c, size in zip(raw, sizes)]
    if interpolation_mode == _NEAREST:
        # nearbyint: halves round to even, as jnp.round does.
        return _gather_points(input, [jnp.round(c).astype(jnp.int32) for c in coords], sizes)
    if interpolation_mode != _BILINEAR:
        raise ValueError(f"grid_sampler: unknown interpolation_mode {interpolation_mode}")
    lows = [jnp.floor(c) for c in coords]
    result = 0
    for corner in itertools.product((0, 1), repeat=num_dims):
        weight = 1
        for c, low, high in zip(coords, lows, corner):
            # Weight of a corner = product of distances to the opposite corner.
            weight = weight * ((c - low) if high else (low + 1 - c))
        points = [(low + high).astype(jnp.int32) for low, high in zip(lows, corner)]
        result = result + _gather_points(input, points, sizes) * weight[:, None]
    return result


def _grid_sample_bicubic(input, raw, padding_mode, align_corners):
    """4x4 taps around the unpadded coordinate; padding is applied to each tap's integer
    position (torch's get_value_bounded)."""
    ys, xs = raw
    height, width = input.shape[2:]
    y0, x0 = jnp.floor(ys), jnp.floor(xs)
    wy, wx = _cubic_coefficients(ys - y0), _cubic_coefficients(xs - x0)
    result = 0
    for i, j in itertools.product(range(4), repeat=2):
        ty = _apply_padding(y0 - 1 + i, height, padding_mode, align_corners)
        tx = _apply_padding(x0 - 1 + j, width, padding_mode, align_corners)
        points = [ty.astype(jnp.int32), tx.astype(jnp.int32)]
        result = result + _gather_points(input, points, (height, width)) * (wy[i] * wx[j])[:, None]
    return result


@lowering(aten.grid_sampler_2d.default)
def lower_grid_sampler_2d_default(
    ctx, input, grid, interpolation_mode, padding_mode, align_corners
):
    """Sample input (N, C, H, W) at grid (N, Ho, Wo, 2) in [-1, 1] (x, y) coordinates;
    modes 0/1/2 = bilinear/nearest/bicubic, padding 0/1/2 = zeros/border/reflection."""
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


@lowering(aten.grid_sampler_3d.default)
def lower_grid_sampler_3d_default(
    ctx, input, grid, interpolation_mode, padding_mode, align_corners
):
    """The volumetric grid_sampler: (N, C, D, H, W) at grid (N, Do, Ho, Wo, 3) (x, y, z)."""
    if interpolation_mode == _BICUBIC:
        raise ValueError("grid_sampler_3d: torch has no bicubic mode for 5-D inputs")
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)
