"""Lowerings: p-norm distances between rows (torch.cdist, F.pdist).

Distances use torch's gradient conventions: the gradient of a zero distance is 0 (a plain
sqrt / pow would give NaN or inf there), which matters for pdist/cdist of a set with itself.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from zerojax.bridge.registry import lowering

aten = torch.ops.aten

# cdist compute_mode: None/0 = matmul for p=2 when either set has > 25 rows, 1 = always, 2 = never.
_MM_IF_LARGE, _MM_ALWAYS = 0, 1
_MM_THRESHOLD = 25


def _safe_root(total, p):
    """total ** (1/p) with zero gradient where total == 0."""
    positive = total > 0
    return jnp.where(positive, jnp.where(positive, total, 1) ** (1.0 / p), 0)


def _p_norm(diff, p, axis=-1):
    """||diff||_p along axis, torch's special cases p = 0 (count), 1, 2 and inf."""
    if p == 0:
        return (diff != 0).sum(axis).astype(diff.dtype)
    if p == math.inf:
        return jnp.abs(diff).max(axis, initial=0)
    if p == -math.inf:
        return jnp.abs(diff).min(axis, initial=math.inf)
    if p == 1:
        return jnp.abs(diff).sum(axis)
    if p == 2:
        return _safe_root((diff * diff).sum(axis), 2)
    return _safe_root((jnp.abs(diff) ** p).sum(axis), p)


def _euclidean_by_matmul(x1, x2):
    """torch's _euclidean_dist: sqrt(max(|a|^2 - 2 a.b + |b|^2, 0)), one matmul."""
    sq1 = (x1 * x1).sum(-1, keepdims=True)
    sq2 = (x2 * x2).sum(-1, keepdims=True)
    cross = jnp.matmul(x1, jnp.swapaxes(x2, -1, -2), precision="highest")
    total = jnp.maximum(sq1 - 2 * cross + jnp.swapaxes(sq2, -1, -2), 0)
    return _safe_root(total, 2)


@lowering(aten._cdist_forward.default)
def lower__cdist_forward_default(ctx, x1, x2, p, compute_mode):
    """(..., P, M) x (..., R, M) -> (..., P, R) p-norm distances, batch dims broadcast."""
    compute = jnp.promote_types(jnp.result_type(x1, x2), jnp.float32)
    x1, x2 = x1.astype(compute), x2.astype(compute)
    rows1, rows2 = x1.shape[-2], x2.shape[-2]
    mode = _MM_IF_LARGE if compute_mode is None else compute_mode
    large = rows1 > _MM_THRESHOLD or rows2 > _MM_THRESHOLD
    if p == 2 and (mode == _MM_ALWAYS or (mode == _MM_IF_LARGE and large)):
        return _euclidean_by_matmul(x1, x2)
    return _p_norm(x1[..., :, None, :] - x2[..., None, :, :], p)


@lowering(aten._pdist_forward.default)
def lower__pdist_forward_default(ctx, self, p=2.0):
    """(N, M) -> N(N-1)/2 p-norm distances of row pairs i < j, row-major (i, then j)."""
    compute = jnp.promote_types(self.dtype, jnp.float32)
    x = self.astype(compute)
    first, second = np.triu_indices(x.shape[0], k=1)
    return _p_norm(x[first] - x[second], p)


@lowering(aten.dist.default)
def lower_dist_default(ctx, self, other, p=2):
    """p-norm of (self - other) over all elements, the two broadcast together."""
    compute = jnp.promote_types(jnp.result_type(self, other), jnp.float32)
    return _p_norm(self.astype(compute) - other.astype(compute), p, axis=None)
