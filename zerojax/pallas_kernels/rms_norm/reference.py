"""RMSNorm over the last dimension in pure jnp: the spec of the Pallas kernel and its
CPU/TPU fallback (``implementation="xla"``).

Semantics are Hugging Face's ``LlamaRMSNorm`` (the module the bridge substitutes)::

    xf = x.float(); y = xf * rsqrt(mean(xf**2, -1) + eps); out = weight * y.to(x.dtype)

so for bf16 inputs ``y`` is rounded to bf16 *before* the weight multiply, and the output dtype is
``result_type(weight, x)`` (fp32 weight + bf16 x gives fp32). ``torch.nn.functional.rms_norm``
instead multiplies by the weight in fp32 and rounds once; the two agree exactly in fp32 and
differ by about one bf16 ulp in bf16. We follow HF because that is what converted checkpoints
were trained with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

STATISTICS = "rms_norm_statistics"
"""The name of the per-row reciprocal root mean square, which a rematerialized RMSNorm keeps
for its backward (`zerojax.pallas_kernels.rms_norm.api`)."""


def rms_norm_reference(
    x: jax.Array, weight: jax.Array | None = None, *, eps: float = 1e-6
) -> jax.Array:
    """HF-Llama RMSNorm over the last dimension; ``weight=None`` means no scale.

    >>> x = jnp.array([[3.0, 4.0]])
    >>> rms_norm_reference(x, jnp.full((2,), 2.0), eps=0.0).round(3)
    Array([[1.697, 2.263]], dtype=float32)
    """
    xf = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = xf * checkpoint_name(rstd, STATISTICS)
    y = y.astype(x.dtype)  # HF rounds here, before the weight multiply
    if weight is None:
        return y
    return weight * y
