"""flash_attention: the public entry point, dispatching to the Pallas kernel or the jnp reference.

`implementation="pallas"` runs the FlashAttention-2 Triton kernels of `kernel.py` (forward, dK/dV
and dQ under one `jax.custom_vjp`); `"xla"` runs plain causal self-attention by query blocks with
a flash-style backward (`causal_blocks.py`, what a CPU step uses) and everything else through
`reference.flash_attention_reference`, differentiated by autodiff; `"auto"` picks pallas on GPU
when the shapes fit the block config and xla otherwise. A Mosaic GPU kernel could later sit
beside the Triton one behind this switch.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from zerojax.pallas_kernels.backend import auto_picks_pallas
from zerojax.pallas_kernels.flash_attention import kernel
from zerojax.pallas_kernels.flash_attention.causal_blocks import (
    causal_block_attention,
    causal_blocks_fit,
)
from zerojax.pallas_kernels.flash_attention.reference import (
    dropout_seed,
    flash_attention_reference,
    repeat_kv_heads,
)

Implementation = Literal["auto", "pallas", "xla"]
_IMPLEMENTATIONS = ("auto", "pallas", "xla")
_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The Triton lowering needs power-of-two tiles and dots of at least 16 x 16.
_MIN_BLOCK = 16
_MAX_HEAD_DIM = 256
# Each tile size of FlashAttentionConfig and the sequence it tiles.
_BLOCK_FIELDS = {
    "block_q": "seq_q",
    "block_k": "seq_k",
    "block_q_dkv": "seq_q",
    "block_k_dkv": "seq_k",
    "block_q_dq": "seq_q",
    "block_k_dq": "seq_k",
}


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class FlashAttentionConfig:
    """Tile sizes and launch parameters of the Pallas flash attention kernels.

    block_q/block_k tile the forward pass; block_q_dkv/block_k_dkv the dK/dV kernel (one program
    per key block); block_q_dq/block_k_dq the dQ kernel (one program per query block). A block
    larger than its sequence shrinks to the sequence length when that is a power of two.
    num_warps None picks 4 for head_dim <= 64 and 8 above. The defaults follow the Triton
    tutorial's FlashAttention-2 tiles for H100-class GPUs; tune per model.

    Example:
        >>> config = FlashAttentionConfig(block_q=64, block_k=32)
        >>> config.resolve(seq_q=32, seq_k=256).block_q  # shrunk to the sequence
        32
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for field in _BLOCK_FIELDS:
            block = getattr(self, field)
            if not isinstance(block, int) or block < _MIN_BLOCK or not _is_power_of_two(block):
                raise ValueError(
                    f"{field}={block!r} must be a power of two >= {_MIN_BLOCK} "
                    "(Triton tiles are powers of two and its dots need 16 x 16)"
                )
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps!r} must be None or one of 1, 2, 4, 8, 16")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages!r} must be an int >= 1")

    def resolve(self, seq_q: int, seq_k: int) -> "FlashAttentionConfig":
        """This config with blocks fitted to the sequence lengths; ValueError when they don't fit.

        A block shrinks to its sequence when the sequence is shorter and a power of two >= 16;
        otherwise the sequence must be a multiple of the block.
        """
        fitted = {}
        for field, seq_name in _BLOCK_FIELDS.items():
            block = getattr(self, field)
            seq = seq_q if seq_name == "seq_q" else seq_k
            if seq < block and _is_power_of_two(seq) and seq >= _MIN_BLOCK:
                block = seq
            if seq % block:
                raise ValueError(
                    f"{seq_name}={seq} must be a multiple of {field}={block} for the pallas "
                    "flash attention (pad the sequence, pass a smaller block in "
                    'FlashAttentionConfig, or use implementation="xla")'
                )
            fitted[field] = block
        return dataclasses.replace(self, **fitted)


@dataclass(frozen=True, slots=True)
class _KernelStatics:
    """Everything static about one pallas call (hashable: a custom_vjp nondiff argument)."""

    scale: float
    causal: bool
    dropout_p: float
    config: FlashAttentionConfig
    interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _pallas_attention(q, k, v, mask, segment_ids, seed, statics: _KernelStatics):
    out, _ = _pallas_forward(q, k, v, mask, segment_ids, seed, statics)
    return out


def _pallas_forward(q, k, v, mask, segment_ids, seed, statics: _KernelStatics):
    config = statics.config
    return kernel.flash_attention_forward(
        q,
        k,
        v,
        mask,
        segment_ids,
        seed,
        scale=statics.scale,
        causal=statics.causal,
        dropout_p=statics.dropout_p,
        block_q=config.block_q,
        block_k=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=statics.interpret,
    )


def _pallas_attention_fwd(q, k, v, mask, segment_ids, seed, statics: _KernelStatics):
    # symbolic_zeros: each array arrives as CustomVJPPrimal(value, perturbed). Only a perturbed
    # additive mask (a learned bias: Swin, T5, MaxViT) makes the dQ kernel write the
    # [batch, heads_q, seq_q, seq_k] score gradient; a padding mask built from the inputs costs
    # nothing extra.
    with_dbias = (
        mask is not None and mask.perturbed and jnp.issubdtype(mask.value.dtype, jnp.floating)
    )
    q, k, v, mask, segment_ids, seed = jax.tree.map(
        lambda primal: primal.value,
        (q, k, v, mask, segment_ids, seed),
        is_leaf=lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal),
    )
    out, lse = _pallas_forward(q, k, v, mask, segment_ids, seed, statics)
    return out, (q, k, v, mask, segment_ids, seed, out, lse, with_dbias)


def _pallas_attention_bwd(statics: _KernelStatics, residuals, d_out):
    q, k, v, mask, segment_ids, seed, out, lse, with_dbias = residuals
    if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
        d_out = jnp.zeros_like(out)
    config = statics.config
    dq, dk, dv, dbias = kernel.flash_attention_backward(
        q,
        k,
        v,
        mask,
        segment_ids,
        seed,
        out,
        lse,
        d_out,
        scale=statics.scale,
        causal=statics.causal,
        dropout_p=statics.dropout_p,
        block_q_dkv=config.block_q_dkv,
        block_k_dkv=config.block_k_dkv,
        block_q_dq=config.block_q_dq,
        block_k_dq=config.block_k_dq,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=statics.interpret,
        with_dbias=with_dbias,
    )
    d_mask = None  # a boolean mask (int8 here) has no gradient; None = zero cotangent
    if with_dbias:
        # The kernel's mask broadcasts over batch/heads where its dim is 1: sum those.
        broadcast_dims = tuple(d for d in (0, 1) if mask.shape[d] == 1 and dbias.shape[d] > 1)
        d_mask = jnp.sum(dbias, axis=broadcast_dims, keepdims=True).astype(mask.dtype)
    # Segment ids and the dropout seed are integers: no gradient.
    return dq, dk, dv, d_mask, None, None


_pallas_attention.defvjp(_pallas_attention_fwd, _pallas_attention_bwd, symbolic_zeros=True)
_pallas_attention_jit = jax.jit(_pallas_attention, static_argnums=(6,))


def _check_inputs(q, k, v, mask, segment_ids, dropout_p, dropout_rng, implementation):
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {_IMPLEMENTATIONS}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "q, k, v must be [batch, heads, seq, head_dim] (SDPA layout); got "
            f"{q.shape=}, {k.shape=}, {v.shape=}"
        )
    batch, heads_q, seq_q, head_dim = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            "k and v must share batch, heads and seq, and k's head_dim must be q's; got "
            f"{q.shape=}, {k.shape=}, {v.shape=}"
        )
    if heads_q % k.shape[1]:
        raise ValueError(
            f"heads_q={heads_q} must be a multiple of heads_kv={k.shape[1]} (grouped-query)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None:
        target = (batch, heads_q, seq_q, k.shape[2])
        padded = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        if mask.ndim > 4 or any(m not in (1, t) for m, t in zip(padded, target)):
            raise ValueError(
                f"mask.shape={tuple(mask.shape)} must broadcast to [batch, heads_q, seq_q, "
                f"seq_k]={target}"
            )
    if segment_ids is not None:
        q_segment_ids, kv_segment_ids = segment_ids
        if q_segment_ids.shape != (batch, seq_q) or kv_segment_ids.shape != (batch, k.shape[2]):
            raise ValueError(
                "segment_ids must be (q_segment_ids [batch, seq_q], kv_segment_ids "
                f"[batch, seq_k]) = ({(batch, seq_q)}, {(batch, k.shape[2])}); got "
                f"({q_segment_ids.shape}, {kv_segment_ids.shape})"
            )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{dropout_p=} must be in [0, 1)")
    if dropout_p > 0.0 and dropout_rng is None:
        raise ValueError(f"{dropout_p=} > 0 needs a dropout_rng key (jax.random.key)")


def pallas_unsupported_reason(
    q: jax.Array, k: jax.Array, v: jax.Array, config: FlashAttentionConfig
) -> str | None:
    """Why the pallas kernel can't take these shapes/dtypes (None when it can)."""
    if q.dtype not in _KERNEL_DTYPES:
        return f"q.dtype={q.dtype} is not one of float32, bfloat16, float16"
    for name, dim in (("head_dim", q.shape[3]), ("head_dim_v", v.shape[3])):
        if not _is_power_of_two(dim) or not _MIN_BLOCK <= dim <= _MAX_HEAD_DIM:
            return (
                f"{name}={dim} must be a power of two in [{_MIN_BLOCK}, {_MAX_HEAD_DIM}] for "
                "the pallas flash attention (64 and 128 are the tuned ones)"
            )
    try:
        config.resolve(q.shape[2], k.shape[2])
    except ValueError as error:
        return str(error)
    return None


def flash_attention(
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
    implementation: Implementation = "auto",
    interpret: bool = False,
    block_config: FlashAttentionConfig | None = None,
) -> jax.Array:
    """Scaled dot-product attention with torch SDPA semantics, FlashAttention-2 on GPU.

    Args:
        q: [batch, heads_q, seq_q, head_dim].
        k: [batch, heads_kv, seq_k, head_dim]; heads_q a multiple of heads_kv (grouped-query:
            kv head j serves q heads j*groups .. j*groups+groups-1, torch's enable_gqa).
        v: [batch, heads_kv, seq_k, head_dim_v].
        mask: bool (True = attend) or additive float, broadcastable to
            [batch, heads_q, seq_q, seq_k]. An additive mask gets its gradient (a learned
            bias: Swin's relative position table, T5's relative attention bias); the pallas
            backward computes it only when the mask is differentiated, into an fp32
            [batch, heads_q, seq_q, seq_k] buffer (no atomics) summed to the mask's shape.
        segment_ids: (q_segment_ids [batch, seq_q], kv_segment_ids [batch, seq_k]) ints;
            queries attend only to keys of the same id (packed sequences).
        causal: torch's is_causal, top-left aligned (`ones(seq_q, seq_k).tril()`).
        scale: score scale, default 1/sqrt(head_dim).
        dropout_p: attention dropout probability; kept weights are scaled by 1/(1 - dropout_p).
        dropout_rng: JAX PRNG key, required when dropout_p > 0. The keep mask is a hash of
            (key, batch index, head index, q index, k index); under shard_map the batch index is
            the local one, so fold the shard index into the key to decorrelate shards.
        implementation: "pallas" (Triton kernel; ValueError when the shapes don't fit),
            "xla" (jnp: plain causal self-attention by query blocks, `causal_blocks.py`;
            anything else the reference), or "auto" (pallas on GPU when the shapes fit, else xla;
            pallas also when interpret=True).
        interpret: run the pallas kernels in interpret mode (CPU, for tests).
        block_config: tile sizes of the kernels; FlashAttentionConfig() by default.

    Returns:
        [batch, heads_q, seq_q, head_dim_v] in q's dtype. Rows whose keys are all masked are 0
        (torch's behaviour), with zero gradients.

    Example:
        >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 4, 128, 64), jnp.bfloat16)
        >>> out = flash_attention(q, k, v, causal=True, implementation="pallas", interpret=True,
        ...                       block_config=FlashAttentionConfig(block_q=64, block_k=64))
        >>> out.shape
        (2, 4, 128, 64)
    """
    _check_inputs(q, k, v, mask, segment_ids, dropout_p, dropout_rng, implementation)
    config = FlashAttentionConfig() if block_config is None else block_config
    if segment_ids is not None:
        segment_ids = tuple(jnp.asarray(ids).astype(jnp.int32) for ids in segment_ids)

    use_pallas = implementation == "pallas"
    if implementation == "auto":
        fits = pallas_unsupported_reason(q, k, v, config) is None
        use_pallas = fits and auto_picks_pallas(interpret)
    if not use_pallas:
        plain_causal = causal and mask is None and segment_ids is None and dropout_p == 0.0
        if plain_causal and causal_blocks_fit(q, k):
            k, v = repeat_kv_heads(k, v, q.shape[1])  # grouped-query, as the reference
            return causal_block_attention(q, k, v, scale=scale)
        return flash_attention_reference(
            q,
            k,
            v,
            mask=mask,
            segment_ids=segment_ids,
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            dropout_rng=dropout_rng,
        )

    reason = pallas_unsupported_reason(q, k, v, config)
    if reason is not None:
        raise ValueError(reason)
    seq_q, head_dim, seq_k = q.shape[2], q.shape[3], k.shape[2]
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        # Batch/head broadcasting stays free (the index maps reuse block 0); the [seq_q, seq_k]
        # plane is materialized so every tile can be loaded. Booleans travel as int8.
        mask = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], seq_q, seq_k))
        if mask.dtype == jnp.bool_:
            mask = mask.astype(jnp.int8)
        elif not jnp.issubdtype(mask.dtype, jnp.floating):
            mask = mask.astype(jnp.float32)  # an integer mask is additive, like torch's
    seed = None if dropout_p == 0.0 else dropout_seed(dropout_rng).reshape(1)
    statics = _KernelStatics(
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        causal=bool(causal),
        dropout_p=float(dropout_p),
        config=config.resolve(seq_q, seq_k),
        interpret=bool(interpret),
    )
    return _pallas_attention_jit(q, k, v, mask, segment_ids, seed, statics)
