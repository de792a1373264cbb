"""Lowerings: scaled_dot_product_attention, kept whole by capture (see capture.KEPT_WHOLE).

torch's decomposition of SDPA produces bad strides (pytorch#141107) and would scatter the op
into a dozen nodes; kept whole it is one call the bridge routes to the flash-attention kernel
(zerojax.pallas_kernels.flash_attention) unless the config's `kernels.attention` is "off".
On a mesh whose config sets `sequence_parallel`, it runs as Ulysses or ring attention over the
sequence axis instead (zerojax.parallel.sequence_parallel).
"""

import math

import jax
import jax.numpy as jnp
import torch

from zerojax.bridge.errors import node_location
from zerojax.bridge.kernel_sharding import per_batch_shard
from zerojax.bridge.registry import lowering
from zerojax.pallas_kernels.flash_attention.reference import repeat_kv_heads
from zerojax.parallel.sequence_parallel import sequence_parallel_attention

aten = torch.ops.aten


def attention_reference(
    query, key, value, *, mask=None, causal=False, scale=None, dropout_p=0.0, rng=None
):
    """softmax(q k^T * scale + mask) v with torch's SDPA semantics, fp32 softmax.

    `mask` is boolean (True = attend) or additive, broadcastable to (..., L, S); `causal` is
    top-left aligned like torch (`ones(L, S).tril()`). Rows with every key masked give zeros,
    as torch's math backend does (its `_safe_softmax`).
    """
    length, source_length = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    # bf16/fp16 matmuls accumulate in fp32; the softmax runs in fp32 too.
    scores = jnp.einsum(
        "...le,...se->...ls", query, key, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    allowed = None
    if causal:
        allowed = jnp.tril(jnp.ones((length, source_length), dtype=bool))
    if mask is not None:
        if mask.dtype == jnp.bool_:
            allowed = mask if allowed is None else jnp.logical_and(allowed, mask)
        else:
            scores = scores + mask.astype(jnp.float32)
    if allowed is not None:
        scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - jax.lax.stop_gradient(row_max))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)
    if dropout_p > 0.0:
        keep = jax.random.bernoulli(rng, 1.0 - dropout_p, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_p), 0.0)
    return jnp.einsum(
        "...ls,...se->...le",
        weights.astype(value.dtype),
        value,
        preferred_element_type=jnp.float32,
    ).astype(query.dtype), weights


def _sdpa(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key, value = repeat_kv_heads(key, value, query.shape[-3])
    rng = ctx.rng_key() if dropout_p > 0.0 else None
    return attention_reference(
        query,
        key,
        value,
        mask=attn_mask,
        causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        rng=rng,
    )


@lowering(aten.scaled_dot_product_attention.default)
def lower_scaled_dot_product_attention(
    ctx,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    *,
    scale=None,
    enable_gqa=False,
):
    """Sequence-parallel when the engine splits the sequence; else routed to the
    flash-attention kernel (config `kernels.attention`), else the reference."""
    placement = None if ctx.parallel is None else ctx.parallel.sequence
    stack = (ctx.node.meta.get("nn_module_stack") or {}).values()
    if (
        placement is not None
        and query.ndim == 4
        and key.ndim == 4
        and placement.covers([path for path, _ in stack])
    ):
        where = f"{ctx.node.target} in {node_location(ctx.node)}"
        if dropout_p > 0.0:
            raise NotImplementedError(
                f"sequence_parallel: attention dropout (dropout_p={dropout_p}) is not "
                f"supported under sequence parallelism ({where}); set the model's attention "
                "dropout to 0 (e.g. Hugging Face `attention_dropout` / "
                "`attention_probs_dropout_prob`) or remove `sequence_parallel`"
            )
        if enable_gqa is False and key.shape[1] != query.shape[1]:
            raise ValueError(
                f"scaled_dot_product_attention: {query.shape[1]} query heads and "
                f"{key.shape[1]} key heads without enable_gqa ({where})"
            )
        return sequence_parallel_attention(
            placement,
            query,
            key,
            value,
            attn_mask,
            causal=is_causal,
            scale=scale,
            kernel=ctx.kernel("attention"),
            where=where,
        )
    choice = ctx.kernel("attention")
    # The kernel takes SDPA's usual [batch, heads, seq, head_dim]; other ranks stay here.
    if choice is None or query.ndim != 4 or key.ndim != 4:
        out, _ = _sdpa(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return out
    from zerojax.pallas_kernels.flash_attention import flash_attention

    implementation, interpret = choice
    rng = ctx.rng_key() if dropout_p > 0.0 else None

    def kernel(query, key, value, mask, *, axis_index):
        # One dropout stream per batch shard: the kernel hashes the shard-local batch index.
        dropout_rng = rng
        if rng is not None and axis_index is not None:
            dropout_rng = jax.random.fold_in(rng, axis_index)
        # The kernel serves grouped-query heads itself; torch only allows them with enable_gqa.
        return flash_attention(
            query,
            key,
            value,
            mask=mask,
            causal=is_causal,
            scale=scale,
            dropout_p=dropout_p,
            dropout_rng=dropout_rng,
            implementation=implementation,
            interpret=interpret,
        )

    mask_batched = (
        attn_mask is not None and attn_mask.ndim == 4 and attn_mask.shape[0] == query.shape[0]
    )
    return per_batch_shard(
        ctx,
        kernel,
        (query, key, value, attn_mask),
        (True, True, True, mask_batched),
        family="attention",
    )


@lowering(aten._scaled_dot_product_attention_math.default)
def lower_scaled_dot_product_attention_math(
    ctx,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    dropout_mask=None,
    *,
    scale=None,
    enable_gqa=False,
):
    """(output, attention weights); an explicit dropout_mask replaces the random draw."""
    if dropout_mask is not None:
        raise NotImplementedError(
            "aten._scaled_dot_product_attention_math with an explicit dropout_mask is not "
            "supported; call F.scaled_dot_product_attention with dropout_p instead"
        )
    out, weights = _sdpa(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out, weights


@lowering(aten._scaled_dot_product_flash_attention_for_cpu.default)
def lower_scaled_dot_product_flash_attention_for_cpu(
    ctx, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None
):
    """(output, logsumexp of the scaled, masked scores per query row)."""
    out, _ = _sdpa(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, False)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = jnp.einsum("...le,...se->...ls", query, key, preferred_element_type=jnp.float32)
    scores = scores * scale
    if is_causal:
        causal = jnp.tril(jnp.ones((query.shape[-2], key.shape[-2]), dtype=bool))
        scores = jnp.where(causal, scores, -jnp.inf)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            scores = jnp.where(attn_mask, scores, -jnp.inf)
        else:
            scores = scores + attn_mask.astype(jnp.float32)
    return out, jax.nn.logsumexp(scores, axis=-1)
