"""Fused linear cross-entropy (lm_head + loss without the [tokens, vocab] logits)."""

from zerojax.pallas_kernels.linear_cross_entropy.api import (
    LinearCrossEntropyConfig,
    linear_cross_entropy,
)
from zerojax.pallas_kernels.linear_cross_entropy.reference import (
    linear_cross_entropy_reference,
    linear_cross_entropy_xla,
)

__all__ = [
    "LinearCrossEntropyConfig",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "linear_cross_entropy_xla",
]
