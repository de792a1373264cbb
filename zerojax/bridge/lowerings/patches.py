"""Lowerings: im2col (F.unfold) and its adjoint col2im (F.fold).

torch's core-ATen decompositions turn F.unfold/F.fold into index/index_put graphs, so these
only run when a graph names them directly; col2im is computed as the transpose (VJP) of im2col,
which is exactly "add every column entry back into the pixel it was read from".
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import torch
from jax import lax

from zerojax.bridge.registry import lowering

aten = torch.ops.aten


def _pair(value) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    value = tuple(int(v) for v in value)
    return value * 2 if len(value) == 1 else value


def _im2col(x, kernel_size, dilation, padding, stride):
    """(N, C, H, W) -> (N, C*kh*kw, L): one column per sliding window, rows ordered (C, kh, kw)."""
    kernel, dilation, padding, stride = map(_pair, (kernel_size, dilation, padding, stride))
    batched = x.ndim == 4
    if not batched:
        x = x[None]
    n, c, height, width = x.shape
    out = [
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, k, d, p, s in zip((height, width), kernel, dilation, padding, stride)
    ]
    x = jnp.pad(x, [(0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2])
    columns = []
    for i, j in itertools.product(range(kernel[0]), range(kernel[1])):
        start = (0, 0, i * dilation[0], j * dilation[1])
        limit = (
            n,
            c,
            start[2] + (out[0] - 1) * stride[0] + 1,
            start[3] + (out[1] - 1) * stride[1] + 1,
        )
        columns.append(lax.slice(x, start, limit, (1, 1) + stride))
    cols = jnp.stack(columns, axis=2).reshape(n, c * kernel[0] * kernel[1], out[0] * out[1])
    return cols if batched else cols[0]


@lowering(aten.im2col.default)
def lower_im2col_default(ctx, self, kernel_size, dilation, padding, stride):
    return _im2col(self, kernel_size, dilation, padding, stride)


@lowering(aten.col2im.default)
def lower_col2im_default(ctx, self, output_size, kernel_size, dilation, padding, stride):
    """(N, C*kh*kw, L) -> (N, C, *output_size), overlapping windows summed."""
    kernel = _pair(kernel_size)
    lead = self.shape[:-2]
    channels = self.shape[-2] // (kernel[0] * kernel[1])
    image_shape = lead + (channels,) + tuple(int(s) for s in _pair(output_size))
    compute = jnp.promote_types(self.dtype, jnp.float32)
    _, transpose = jax.vjp(
        lambda image: _im2col(image, kernel_size, dilation, padding, stride),
        jnp.zeros(image_shape, compute),
    )
    return transpose(self.astype(compute))[0]
