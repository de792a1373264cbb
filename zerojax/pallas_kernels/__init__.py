"""Pallas GPU kernels for the hot paths, each with a pure-JAX reference that is its
specification and the CPU/TPU fallback. One folder per op: reference.py, kernel.py (the
Pallas Triton lowering) and api.py (the public function, `jax.custom_vjp`, a validated
block-size config and the `implementation="pallas" | "xla" | "auto"` switch).

The bridge substitutes them into converted models (config section `kernels:`): SDPA ->
`flash_attention`, `native_layer_norm` -> `layer_norm`, the RMSNorm op pattern -> `rms_norm`,
projection + log-softmax + NLL -> `linear_cross_entropy`; the training engine applies
`adamw_update_sharded` on each ZeRO shard.
"""

from zerojax.pallas_kernels.adamw import AdamWConfig, adamw_update, adamw_update_sharded
from zerojax.pallas_kernels.flash_attention import FlashAttentionConfig, flash_attention
from zerojax.pallas_kernels.layer_norm import NormConfig, layer_norm
from zerojax.pallas_kernels.linear_cross_entropy import (
    LinearCrossEntropyConfig,
    linear_cross_entropy,
)
from zerojax.pallas_kernels.rms_norm import rms_norm

__all__ = [
    "AdamWConfig",
    "FlashAttentionConfig",
    "LinearCrossEntropyConfig",
    "NormConfig",
    "adamw_update",
    "adamw_update_sharded",
    "flash_attention",
    "layer_norm",
    "linear_cross_entropy",
    "rms_norm",
]
