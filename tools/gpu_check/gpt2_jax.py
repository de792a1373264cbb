"""Hugging Face's GPT-2 (`GPT2LMHeadModel`) written by hand in plain JAX: the peer the GPU
check's train_step section judges zerojax against ("zerojax >= 0.9x hand-written JAX").

Written as a JAX user who wants a fast step would write it, and numerically the same model as
transformers' GPT-2 (checked in fp32 against it by the section):

- Conv1D weights are stored [in, out], so a projection is `x @ w + b`;
- `gelu_new` is the tanh approximation (`jax.nn.gelu(approximate=True)`);
- layer norm eps is `layer_norm_epsilon` (1e-5), its statistics in float32 whatever the
  compute dtype (as torch autocast and every bf16 JAX LM do);
- attention scores are scaled by 1/sqrt(head_dim), causal, through
  `jax.nn.dot_product_attention` (`implementation` chooses XLA or cuDNN);
- `lm_head` is tied to `wte`: one array, used twice, so its gradient is the sum of both uses;
- the loss is transformers' `ForCausalLMLoss` with `labels=input_ids`: logits upcast to float32,
  position t predicts token t + 1, the mean over the B * (T - 1) predicted tokens.

Mixed precision is the usual JAX recipe: float32 master parameters are the step's state, cast
to the compute dtype inside the differentiated function (so the gradients come back in
float32), and the whole update (optax AdamW) is one jitted program whose parameter and optimizer
buffers are donated.

The blocks are a Python loop (unrolled in the traced program), as nanoGPT-style JAX ports
write them: XLA then sees every layer, and may fuse a block's residual add into the next
block's layer norm. (`jax.lax.scan` over stacked layers compiles faster but keeps the loop.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Dims:
    """The dimensions of a transformers `GPT2Config` this module needs."""

    num_layers: int
    num_heads: int
    width: int
    vocab_size: int
    max_positions: int
    layer_norm_epsilon: float

    @classmethod
    def from_hf_config(cls, config) -> GPT2Dims:
        if config.activation_function != "gelu_new":
            raise ValueError(f"{config.activation_function=}: only gelu_new is written here")
        if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            raise ValueError(
                "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn: not written here"
            )
        if not config.scale_attn_weights:
            raise ValueError(f"{config.scale_attn_weights=}: only scaled attention is written here")
        return cls(
            num_layers=config.n_layer,
            num_heads=config.n_head,
            width=config.n_embd,
            vocab_size=config.vocab_size,
            max_positions=config.n_positions,
            layer_norm_epsilon=config.layer_norm_epsilon,
        )


def params_from_state_dict(state_dict: dict, dims: GPT2Dims) -> Params:
    """float32 numpy parameters from a GPT2LMHeadModel's `state_dict()` (torch tensors), as
    the nested dict `forward` takes. `lm_head.weight` is `wte` (tied) and is not copied."""

    def get(name: str) -> np.ndarray:
        return state_dict[name].detach().to("cpu").float().numpy().copy()

    def linear(prefix: str) -> Params:
        return {"w": get(f"{prefix}.weight"), "b": get(f"{prefix}.bias")}

    def norm(prefix: str) -> Params:
        return {"scale": get(f"{prefix}.weight"), "bias": get(f"{prefix}.bias")}

    blocks = []
    for index in range(dims.num_layers):
        prefix = f"transformer.h.{index}"
        blocks.append(
            {
                "ln_1": norm(f"{prefix}.ln_1"),
                "c_attn": linear(f"{prefix}.attn.c_attn"),
                "attn_proj": linear(f"{prefix}.attn.c_proj"),
                "ln_2": norm(f"{prefix}.ln_2"),
                "c_fc": linear(f"{prefix}.mlp.c_fc"),
                "mlp_proj": linear(f"{prefix}.mlp.c_proj"),
            }
        )
    return {
        "wte": get("transformer.wte.weight"),
        "wpe": get("transformer.wpe.weight"),
        "blocks": blocks,
        "ln_f": norm("transformer.ln_f"),
    }


def layer_norm(x: jax.Array, params: Params, epsilon: float) -> jax.Array:
    """Statistics and normalization in float32, the result in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    variance = jnp.square(x32 - mean).mean(-1, keepdims=True)
    normalized = (x32 - mean) * jax.lax.rsqrt(variance + epsilon)
    scaled = normalized * params["scale"].astype(jnp.float32) + params["bias"].astype(jnp.float32)
    return scaled.astype(x.dtype)


def linear(x: jax.Array, params: Params) -> jax.Array:
    return x @ params["w"] + params["b"]


def block(x: jax.Array, params: Params, dims: GPT2Dims, attention_implementation) -> jax.Array:
    batch, seq, _ = x.shape
    head_dim = dims.width // dims.num_heads
    qkv = linear(layer_norm(x, params["ln_1"], dims.layer_norm_epsilon), params["c_attn"])
    # [B, T, 3 * width] -> three [B, T, heads, head_dim]: the layout dot_product_attention takes.
    query, key, value = jnp.split(qkv.reshape(batch, seq, 3, dims.num_heads, head_dim), 3, axis=2)
    attended = jax.nn.dot_product_attention(
        query.squeeze(2),
        key.squeeze(2),
        value.squeeze(2),
        is_causal=True,
        implementation=attention_implementation,
    )
    x = x + linear(attended.reshape(batch, seq, dims.width), params["attn_proj"])
    hidden = linear(layer_norm(x, params["ln_2"], dims.layer_norm_epsilon), params["c_fc"])
    return x + linear(jax.nn.gelu(hidden, approximate=True), params["mlp_proj"])


def forward(
    params: Params, tokens: jax.Array, dims: GPT2Dims, attention_implementation=None
) -> jax.Array:
    """Logits [B, T, vocab] in the parameters' dtype (cast the parameters to compute in bf16)."""
    positions = jnp.arange(tokens.shape[1])
    x = params["wte"][tokens] + params["wpe"][positions]
    for block_params in params["blocks"]:
        x = block(x, block_params, dims, attention_implementation)
    x = layer_norm(x, params["ln_f"], dims.layer_norm_epsilon)
    return x @ params["wte"].T  # lm_head tied to wte


def causal_lm_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """transformers' loss for `labels=input_ids`: float32 cross-entropy of position t against
    token t + 1, averaged over the B * (T - 1) predictions."""
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    targets = tokens[:, 1:]
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()


def make_train_step(
    dims: GPT2Dims,
    optimizer,
    *,
    compute_dtype=jnp.bfloat16,
    attention_implementation=None,
) -> Callable:
    """`step(master_params, opt_state, tokens) -> (master_params, opt_state, loss)`: forward,
    backward and the optimizer update as one jitted program; the float32 masters and the
    optimizer state are donated (updated in place)."""
    import optax

    def loss_fn(master_params: Params, tokens: jax.Array) -> jax.Array:
        compute_params = jax.tree.map(lambda p: p.astype(compute_dtype), master_params)
        logits = forward(compute_params, tokens, dims, attention_implementation)
        return causal_lm_loss(logits, tokens)

    def step(master_params: Params, opt_state, tokens: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(master_params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, master_params)
        return optax.apply_updates(master_params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
