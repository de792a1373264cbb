"""LayerNorm over the last dimension: Pallas GPU kernel (forward + backward) and jnp reference."""

from zerojax.pallas_kernels.layer_norm.api import NormConfig, layer_norm
from zerojax.pallas_kernels.layer_norm.reference import layer_norm_reference

__all__ = ["NormConfig", "layer_norm", "layer_norm_reference"]
