"""Fused, in-place torch AdamW (one pass over weight, grad and moments) as a Pallas kernel."""

from zerojax.pallas_kernels.adamw.api import AdamWConfig, adamw_update, adamw_update_sharded
from zerojax.pallas_kernels.adamw.reference import adamw_hyper, adamw_update_reference

__all__ = [
    "AdamWConfig",
    "adamw_hyper",
    "adamw_update",
    "adamw_update_reference",
    "adamw_update_sharded",
]
