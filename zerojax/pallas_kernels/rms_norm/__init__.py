"""RMSNorm (Hugging Face Llama order) over the last dimension: Pallas GPU kernel (forward +
backward) and jnp reference."""

from zerojax.pallas_kernels.layer_norm.api import NormConfig
from zerojax.pallas_kernels.rms_norm.api import rms_norm
from zerojax.pallas_kernels.rms_norm.reference import rms_norm_reference

__all__ = ["NormConfig", "rms_norm", "rms_norm_reference"]
