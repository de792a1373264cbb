"""Flash attention, the spec: plain jnp attention with torch SDPA's semantics, fp32 softmax.

This is both what the Pallas kernel is tested against and the "xla" implementation (the CPU/TPU
fallback). It materializes the [batch, heads, seq_q, seq_k] score matrix, so it is only meant for
short sequences or as a fallback.

Semantics (those of `torch.nn.functional.scaled_dot_product_attention`, and of the bridge's
`zerojax.bridge.lowerings.attention.attention_reference`):

- layout [batch, heads, seq, head_dim]; k/v may have fewer heads than q (grouped-query: kv head
  `j` serves q heads `j * groups ... (j + 1) * groups - 1`, torch's `enable_gqa=True`);
- `mask` is boolean (True = attend) or additive, broadcastable to [batch, heads_q, seq_q, seq_k];
- `causal` is top-left aligned (`ones(seq_q, seq_k).tril()`), also when seq_q != seq_k;
- a query row whose keys are all masked gives zeros (and zero gradients), as torch's math and
  CPU flash backends do (`_safe_softmax`), never NaN;
- dropout keeps each weight with probability `1 - dropout_p` and scales kept weights by
  `1 / (1 - dropout_p)`. The keep mask is not drawn with `jax.random` but from a counter-based
  hash of (seed, batch, head, q index, k index) — `dropout_keep` below — so that the Pallas
  kernel can regenerate exactly the same mask block by block in its forward and backward passes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

# Odd multipliers (golden ratio, murmur3/xxhash primes) that spread each coordinate over all 32
# bits before it is mixed in.
_BATCH_MULTIPLIER = np.uint32(0x9E3779B1)
_HEAD_MULTIPLIER = np.uint32(0x7FEB352D)
_QUERY_MULTIPLIER = np.uint32(0x846CA68B)
_KEY_MULTIPLIER = np.uint32(0x27D4EB2F)
# Kept values are compared on the top 24 bits of the hash: `dropout_p` is resolved to 2**-24.
_DROPOUT_BITS = 24


def _fmix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijection on uint32 with full avalanche.

    Only uint32 multiply, xor and logical shift, so the same code runs in jnp and inside a
    Triton kernel, bit for bit.
    """
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def dropout_seed(dropout_rng: jax.Array) -> jax.Array:
    """The uint32 seed of `dropout_keep`, drawn from a JAX PRNG key (raw or typed)."""
    return jax.random.bits(dropout_rng, (), jnp.uint32)


def dropout_threshold(dropout_p: float) -> int:
    """Integer threshold on the top `_DROPOUT_BITS` bits: P(bits >= threshold) = 1 - dropout_p."""
    return min(round(dropout_p * (1 << _DROPOUT_BITS)), 1 << _DROPOUT_BITS)


def dropout_keep(
    seed: jax.Array,
    batch_index: jax.Array | int,
    head_index: jax.Array | int,
    q_index: jax.Array,
    k_index: jax.Array,
    *,
    dropout_p: float,
) -> jax.Array:
    """Boolean keep mask of attention dropout for the given (broadcastable) coordinates.

    A counter-based hash: the mask at (batch, q head, q position, k position) depends on nothing
    else, so the reference (whole matrix at once) and the kernel (one [block_q, block_k] tile at a
    time, forward and backward) produce identical masks. Integer ops only (uint32 multiply, xor,
    logical shift), which the Pallas Triton lowering supports.

    Example:
        >>> seed = dropout_seed(jax.random.key(0))
        >>> keep = dropout_keep(seed, 0, 0, jnp.arange(4)[:, None], jnp.arange(8)[None, :],
        ...                     dropout_p=0.1)
        >>> keep.shape
        (4, 8)
    """

    def as_u32(x):
        return jnp.asarray(x).astype(jnp.uint32)

    x = _fmix32(as_u32(seed) ^ (as_u32(batch_index) * _BATCH_MULTIPLIER))
    x = _fmix32(x ^ (as_u32(head_index) * _HEAD_MULTIPLIER))
    x = _fmix32(x ^ (as_u32(q_index) * _QUERY_MULTIPLIER))
    x = _fmix32(x ^ (as_u32(k_index) * _KEY_MULTIPLIER))
    threshold = np.uint32(dropout_threshold(dropout_p))
    return (x >> np.uint32(32 - _DROPOUT_BITS)) >= threshold


def attention_allowed(
    batch: int,
    seq_q: int,
    seq_k: int,
    *,
    mask: jax.Array | None,
    segment_ids: tuple[jax.Array, jax.Array] | None,
    causal: bool,
) -> jax.Array | None:
    """Boolean [batch|1, heads|1, seq_q, seq_k] "may attend" of causal, bool mask and segments."""
    allowed = None

    def conjoin(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if causal:
        allowed = jnp.tril(jnp.ones((seq_q, seq_k), dtype=bool))[None, None]
    if mask is not None and mask.dtype == jnp.bool_:
        allowed = conjoin(allowed, mask)
    if segment_ids is not None:
        q_segment_ids, kv_segment_ids = segment_ids
        same = q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
        allowed = conjoin(allowed, same)
    return allowed


def repeat_kv_heads(k: jax.Array, v: jax.Array, heads_q: int) -> tuple[jax.Array, jax.Array]:
    """Grouped-query k/v [..., heads_kv, seq, d] widened to `heads_q` heads, as
    repeat_interleave: kv head j serves q heads j*groups .. j*groups + groups - 1."""
    groups = heads_q // k.shape[-3]
    if groups == 1:
        return k, v
    return jnp.repeat(k, groups, axis=-3), jnp.repeat(v, groups, axis=-3)


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T * scale + mask) v with torch SDPA semantics (see the module docstring).

    q: [batch, heads_q, seq_q, head_dim]; k: [batch, heads_kv, seq_k, head_dim];
    v: [batch, heads_kv, seq_k, head_dim_v]; returns [batch, heads_q, seq_q, head_dim_v] in q's
    dtype. Matmuls accumulate in fp32 and the softmax runs in fp32. Differentiable by autodiff,
    which is the backward's spec: an additive float mask gets dL/dS, the gradient of the scaled
    scores, summed over the dimensions it broadcasts along (the pallas kernel's dbias).

    Example:
        >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 2, 16, 64))
        >>> flash_attention_reference(q, k, v, causal=True).shape
        (1, 2, 16, 64)
    """
    batch, heads_q, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    k, v = repeat_kv_heads(k, v, heads_q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(scale)
    if mask is not None and mask.dtype != jnp.bool_:
        scores = scores + mask.astype(jnp.float32)
    allowed = attention_allowed(
        batch, seq_q, seq_k, mask=mask, segment_ids=segment_ids, causal=causal
    )
    if allowed is not None:
        scores = jnp.where(allowed, scores, -jnp.inf)
    # A fully masked row has max -inf; shifting by 0 instead keeps exp() at 0 rather than NaN.
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = jnp.exp(scores - row_max)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)
    if dropout_p > 0.0:
        if dropout_rng is None:
            raise ValueError(f"{dropout_p=} > 0 needs a dropout_rng key")
        keep = dropout_keep(
            dropout_seed(dropout_rng),
            jnp.arange(batch)[:, None, None, None],
            jnp.arange(heads_q)[None, :, None, None],
            jnp.arange(seq_q)[None, None, :, None],
            jnp.arange(seq_k)[None, None, None, :],
            dropout_p=dropout_p,
        )
        weights = jnp.where(keep, weights * jnp.float32(1.0 / (1.0 - dropout_p)), 0.0)
    out = jnp.einsum(
        "bhqk,bhkd->bhqd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.astype(q.dtype)
