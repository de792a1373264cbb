"""Flash attention (FlashAttention-2) for GPU as Pallas Triton kernels, with a jnp fallback.

`flash_attention(q, k, v, ...)` takes torch SDPA's layout and semantics (causal, bool/additive
mask, grouped-query heads, dropout) plus segment ids; see api.py.
"""

from zerojax.pallas_kernels.flash_attention.api import FlashAttentionConfig, flash_attention
from zerojax.pallas_kernels.flash_attention.reference import flash_attention_reference

__all__ = ["FlashAttentionConfig", "flash_attention", "flash_attention_reference"]
