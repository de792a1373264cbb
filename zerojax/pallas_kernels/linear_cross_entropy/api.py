"""Fused linear cross-entropy: cross_entropy(hidden @ weight.T + bias, labels) without ever
materialising the [tokens, vocab] logits.

Implementations behind one function:

- "pallas": the Triton-lowered Pallas kernels of `kernel.py` (GPU; `interpret=True` runs them
  on CPU for tests);
- "xla": the vocabulary-chunked `lax.fori_loop` + `jax.custom_vjp` of `reference.py` (any
  backend; peak temporary [tokens, vocab_chunk]);
- "auto": "pallas" when `jax.default_backend() == "gpu"` and the shapes fit the block config,
  else "xla".

A Mosaic GPU kernel would be one more branch in `_per_token_loss_fwd/_bwd`.

Sharding over tokens (shard_map, data parallel): each shard's loss only sees its own tokens,
so "mean" would average per shard. Use reduction="sum" inside the shard_map and divide by the
psum of the non-ignored count:

    total = lax.psum(linear_cross_entropy(h, w, y, reduction="sum"), "data")
    count = lax.psum(jnp.sum(y != -100), "data")
    loss = total / count
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from zerojax.pallas_kernels.backend import auto_picks_pallas
from zerojax.pallas_kernels.linear_cross_entropy import kernel
from zerojax.pallas_kernels.linear_cross_entropy.reference import (
    REDUCTIONS,
    chunked_per_token_loss,
    reduce_per_token_loss,
)

IMPLEMENTATIONS = ("auto", "pallas", "xla")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearCrossEntropyConfig:
    """Tile sizes of the Pallas kernels and the chunk of the XLA path.

    block_tokens: token rows per program (forward, dh) and per step of the dW loop.
    block_vocab: vocabulary columns per logits tile; vocab must be >= block_vocab (a tail
        that is not a multiple is handled by a clamped, masked last tile).
    block_dim: slice of the hidden dimension per matmul step; d must be a multiple.
    num_warps, num_stages: Triton compiler parameters.
    vocab_chunk: vocabulary columns per step of the "xla" implementation (any positive int;
        peak temporary about 3 * tokens * vocab_chunk * 4 bytes).

    >>> LinearCrossEntropyConfig(block_tokens=32, block_vocab=128)   # doctest: +SKIP
    """

    block_tokens: int = 64
    block_vocab: int = 128
    block_dim: int = 64
    num_warps: int = 4
    num_stages: int = 2
    vocab_chunk: int = 4096

    def __post_init__(self) -> None:
        for name in ("block_tokens", "block_vocab", "block_dim"):
            value = getattr(self, name)
            # Triton dots need every tile dim >= 16, and loads/stores power-of-two sizes.
            if not (_is_power_of_two(value) and value >= 16):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if not _is_power_of_two(self.num_warps):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")
        if self.vocab_chunk < 1:
            raise ValueError(f"vocab_chunk={self.vocab_chunk} must be >= 1")

    def check_shapes(self, *, vocab: int, dim: int) -> None:
        """Raise ValueError when the Pallas kernels cannot tile these shapes."""
        block_vocab, block_dim = self.block_vocab, self.block_dim
        if vocab < block_vocab:
            raise ValueError(
                f"{vocab=} must be >= {block_vocab=}; pass a smaller block_vocab in "
                "LinearCrossEntropyConfig or implementation='xla'"
            )
        if dim % block_dim:
            raise ValueError(
                f"hidden size {dim=} must be a multiple of {block_dim=}; pass a block_dim "
                "dividing it in LinearCrossEntropyConfig or implementation='xla'"
            )


def _pad_tokens(x: jax.Array, tokens: int, value) -> jax.Array:
    pad = tokens - x.shape[0]
    if pad == 0:
        return x
    widths = [(0, pad)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, widths, constant_values=value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _pallas_per_token_loss(
    hidden, weight, bias, labels, ignore_index, label_smoothing, config, interpret
):
    per_token, _ = _pallas_fwd(
        hidden, weight, bias, labels, ignore_index, label_smoothing, config, interpret
    )
    return per_token


def _kernel_statics(config: LinearCrossEntropyConfig, interpret: bool) -> dict:
    return {
        "block_tokens": config.block_tokens,
        "block_vocab": config.block_vocab,
        "block_dim": config.block_dim,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "interpret": interpret,
    }


def _pallas_fwd(hidden, weight, bias, labels, ignore_index, label_smoothing, config, interpret):
    tokens = hidden.shape[0]
    # Padding tokens carry ignore_index: loss 0, cotangent 0; the pad copies [pad, d] only.
    padded = math.ceil(tokens / config.block_tokens) * config.block_tokens
    per_token, lse = kernel.linear_cross_entropy_fwd(
        _pad_tokens(hidden, padded, 0),
        weight,
        bias,
        _pad_tokens(labels, padded, ignore_index),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        **_kernel_statics(config, interpret),
    )
    return per_token[:tokens], (hidden, weight, bias, labels, lse)


def _pallas_bwd(ignore_index, label_smoothing, config, interpret, residuals, g):
    hidden, weight, bias, labels, lse = residuals
    tokens = hidden.shape[0]
    padded = lse.shape[0]
    g = jnp.where(labels != ignore_index, g.astype(jnp.float32), 0.0)
    dh, dw, db = kernel.linear_cross_entropy_bwd(
        _pad_tokens(hidden, padded, 0),
        weight,
        bias,
        _pad_tokens(labels, padded, ignore_index),
        lse,
        _pad_tokens(g, padded, 0.0),
        label_smoothing=label_smoothing,
        **_kernel_statics(config, interpret),
    )
    db = None if bias is None else db.astype(bias.dtype)
    return dh[:tokens].astype(hidden.dtype), dw.astype(weight.dtype), db, None


_pallas_per_token_loss.defvjp(_pallas_fwd, _pallas_bwd)


def _choose_implementation(
    implementation: str, interpret: bool, config: LinearCrossEntropyConfig, vocab: int, dim: int
) -> str:
    if implementation == "xla":
        return "xla"
    if implementation == "pallas":
        config.check_shapes(vocab=vocab, dim=dim)
        return "pallas"
    if not auto_picks_pallas(interpret):
        return "xla"
    try:
        config.check_shapes(vocab=vocab, dim=dim)
    except ValueError:
        return "xla"  # "auto" only: shapes the kernels cannot tile run chunked in XLA
    return "pallas"


def linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    implementation: str = "auto",
    interpret: bool = False,
    block_config: LinearCrossEntropyConfig | None = None,
) -> jax.Array:
    """torch.nn.functional.cross_entropy(hidden @ weight.T + bias, labels) without the logits.

    hidden [..., d] (leading dims are flattened into tokens), weight [vocab, d] (nn.Linear /
    tied lm_head layout), labels int [...], bias [vocab] or None. Logits and accumulation are
    fp32 whatever the input dtype; the loss is returned in fp32 (shape [...] for
    reduction="none", a scalar otherwise). Gradients flow to hidden, weight and bias, in their
    own dtypes. "mean" divides by the number of tokens whose label is not `ignore_index`
    (torch; NaN if there are none). Labels outside [0, vocab) other than ignore_index are not
    checked (torch raises): they contribute a target logit of 0.

    `interpret=True` runs the Pallas kernels in interpret mode (CPU tests) and makes "auto"
    pick them. Sharded over tokens: see the module docstring for the "mean" recipe.

    >>> loss = linear_cross_entropy(h, model.lm_head.weight, y)           # doctest: +SKIP
    >>> dh, dw = jax.grad(lambda h, w: linear_cross_entropy(h, w, y), (0, 1))(h, w)  # doctest: +SKIP
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"{reduction=} must be one of {REDUCTIONS}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{label_smoothing=} must be in [0, 1] (torch's range)")
    if weight.ndim != 2:
        raise ValueError(f"weight must be [vocab, d]; got {weight.shape=}")
    vocab, dim = weight.shape
    if hidden.shape[-1] != dim:
        raise ValueError(
            f"hidden's last dim must equal weight's (d); got {hidden.shape=}, {weight.shape=}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have hidden's leading shape; got {labels.shape=}, {hidden.shape=}"
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be integer class indices; got {labels.dtype=}")
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias must be [vocab]; got {bias.shape=} for {vocab=}")
    config = block_config if block_config is not None else LinearCrossEntropyConfig()

    lead_shape = labels.shape
    hidden_2d = hidden.reshape(-1, dim)
    labels_1d = labels.reshape(-1).astype(jnp.int32)
    label_smoothing = float(label_smoothing)
    chosen = _choose_implementation(implementation, interpret, config, vocab, dim)
    if chosen == "pallas":
        per_token = _pallas_per_token_loss(
            hidden_2d, weight, bias, labels_1d, ignore_index, label_smoothing, config, interpret
        )
    else:
        per_token = chunked_per_token_loss(
            hidden_2d,
            weight,
            bias,
            labels_1d,
            ignore_index,
            label_smoothing,
            config.vocab_chunk,
        )
    loss = reduce_per_token_loss(
        per_token, labels_1d, ignore_index=ignore_index, reduction=reduction
    )
    return loss.reshape(lead_shape) if reduction == "none" else loss
