"""LayerNorm over the last dimension in pure jnp: the spec of the Pallas kernel and its
CPU/TPU fallback (``implementation="xla"``).

Semantics are ``torch.nn.functional.layer_norm(x, (d,), weight, bias, eps)``: mean and biased
variance in fp32, the affine transform in fp32, and one rounding to ``x.dtype`` at the end (what
PyTorch's CUDA kernel does for bf16/fp16 inputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

STATISTICS = "layer_norm_statistics"
"""The name of the per-row mean and reciprocal standard deviation, which a rematerialized
layer norm keeps for its backward (`zerojax.pallas_kernels.layer_norm.api`)."""


def layer_norm_reference(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = 1e-5,
) -> jax.Array:
    """Normalize ``x`` over its last dimension; output dtype is ``x.dtype``.

    >>> x = jnp.arange(8.0).reshape(2, 4)
    >>> [round(v, 2) for v in layer_norm_reference(x, jnp.ones(4), jnp.zeros(4))[0].tolist()]
    [-1.34, -0.45, 0.45, 1.34]
    """
    xf = x.astype(jnp.float32)
    mean = checkpoint_name(jnp.mean(xf, axis=-1, keepdims=True), STATISTICS)
    centered = xf - mean
    # Two-pass variance: the row is in memory anyway, and E[x^2] - E[x]^2 cancels badly.
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    y = centered * checkpoint_name(jax.lax.rsqrt(var + eps), STATISTICS)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
