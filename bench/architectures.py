"""The eight reference architectures zerojax must convert, as small self-contained torch modules.

Each factory in `ARCHITECTURES` returns `(module, example_args)`: a freshly initialised module
(in torch's default train mode; call `.eval()` to switch dropout off) and fresh random inputs.
Sizes are tiny (width 32-64, 2 layers, sequence 16, batch 2-4) so that a parity test of forward
and gradients runs in seconds on a CPU. `scalar_loss` turns any of their outputs into one scalar,
on torch tensors and on the JAX arrays `zerojax` returns alike, so the same loss is
differentiated by torch autograd and by `jax.grad`.

The models are written the way their originals are, because the ops they lower to are the point:
GPT-2 ties wte/lm_head and uses causal SDPA; Llama writes RMSNorm as x * rsqrt(mean(x^2) + eps),
applies rotary embeddings and repeats grouped K/V heads before SDPA; BERT passes a boolean
padding mask to SDPA; the MoE computes every expert densely and combines the top-2 with a
scatter-built weight matrix, so its shapes stay static for torch.export.

`gpt2_bench_model()` is the larger GPT-2 the benchmark times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from torch import nn

# ---------------------------------------------------------------------------------------------
# Loss shared by torch and JAX
# ---------------------------------------------------------------------------------------------


def _is_float_leaf(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return False
    if isinstance(dtype, torch.dtype):
        return dtype.is_floating_point
    return np.issubdtype(dtype, np.floating)


def scalar_loss(output):
    """Sum over the output's float leaves of mean(x^2) + mean(x): one scalar, torch or JAX.

    Uses only operators torch tensors and jax arrays share, so one definition serves both sides
    of a gradient parity test. The linear term keeps the gradient nonzero where x^2's vanishes.
    """
    leaves = [leaf for leaf in torch_pytree.tree_leaves(output) if _is_float_leaf(leaf)]
    if not leaves:
        raise ValueError("scalar_loss: the output has no floating-point tensors")
    total = 0.0
    for leaf in leaves:
        total = total + (leaf * leaf).mean() + leaf.mean()
    return total


# ---------------------------------------------------------------------------------------------
# MLP and CNN
# ---------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, in_features: int = 32, hidden: int = 64, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = F.gelu(self.fc1(x))
        x = self.norm(F.relu(self.fc2(x)))
        return self.head(x)


def mlp() -> tuple[nn.Module, tuple]:
    return MLP(), (torch.randn(4, 32),)


class CNN(nn.Module):
    """Two conv -> BatchNorm2d -> ReLU -> MaxPool stages, then dropout and a linear head."""

    def __init__(self, channels: int = 3, width: int = 16, num_classes: int = 10, size: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.dropout = nn.Dropout(0.25)
        self.head = nn.Linear(2 * width * (size // 4) ** 2, num_classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.head(self.dropout(torch.flatten(x, 1)))


def cnn() -> tuple[nn.Module, tuple]:
    return CNN(), (torch.randn(4, 3, 16, 16),)


# ---------------------------------------------------------------------------------------------
# GPT-2
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class GPT2Config:
    vocab_size: int = 128
    """Token vocabulary; wte and lm_head share one (vocab_size, width) matrix."""
    max_seq_len: int = 64
    """Rows of the learned position embedding."""
    width: int = 64
    num_layers: int = 2
    num_heads: int = 4
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config.width, config.num_heads, config.dropout)
        self.ln_2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * config.width, config.width),
            nn.Dropout(config.dropout),
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """nanoGPT-style GPT-2: learned positions, pre-LN blocks, lm_head tied to wte."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.width)
        self.wpe = nn.Embedding(config.max_seq_len, config.width)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two uses
        for module in self.modules():  # GPT-2's initialisation: N(0, 0.02), zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2() -> tuple[nn.Module, tuple]:
    config = GPT2Config()
    return GPT2(config), (torch.randint(0, config.vocab_size, (2, 16)),)


def gpt2_bench_model(
    *, batch: int = 8, seq_len: int = 256, width: int = 256, num_layers: int = 4
) -> tuple[nn.Module, tuple]:
    """The GPT-2 the benchmark times: 4 layers, width 256, 8 x 256 tokens, vocabulary 1024."""
    config = GPT2Config(
        vocab_size=1024, max_seq_len=seq_len, width=width, num_layers=num_layers, num_heads=8
    )
    return GPT2(config), (torch.randint(0, config.vocab_size, (batch, seq_len)),)


# ---------------------------------------------------------------------------------------------
# Llama
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class LlamaConfig:
    vocab_size: int = 128
    width: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    """Grouped-query attention: each K/V head serves num_heads // num_kv_heads query heads."""
    hidden: int = 128
    """SwiGLU inner width."""
    rope_theta: float = 10000.0
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.width // config.num_heads
        self.q_proj = nn.Linear(config.width, config.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.width, config.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.width, config.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * self.head_dim, config.width, bias=False)

    def forward(self, x, cos, sin):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Grouped-query attention: repeat each K/V head for its group of query heads.
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_norm = RMSNorm(config.width, config.eps)
        self.attn = LlamaAttention(config)
        self.post_attn_norm = RMSNorm(config.width, config.eps)
        self.mlp = SwiGLU(config.width, config.hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        head_dim = config.width // config.num_heads
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.width, config.eps)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def llama() -> tuple[nn.Module, tuple]:
    config = LlamaConfig()
    return Llama(config), (torch.randint(0, config.vocab_size, (2, 16)),)


# ---------------------------------------------------------------------------------------------
# BERT
# ---------------------------------------------------------------------------------------------


class BertLayer(nn.Module):
    def __init__(self, width: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.attn_norm = nn.LayerNorm(width, eps=1e-12)
        self.ffn = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.ffn_norm = nn.LayerNorm(width, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, keep):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        x = self.attn_norm(x + self.dropout(self.out(y)))  # post-LN, as in BERT
        return self.ffn_norm(x + self.dropout(self.ffn(x)))


class Bert(nn.Module):
    """BERT encoder: word + position + token-type embeddings, post-LN layers, tanh pooler."""

    def __init__(
        self,
        vocab_size: int = 128,
        width: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        max_seq_len: int = 64,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.word = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(max_seq_len, width)
        self.token_type = nn.Embedding(2, width)
        self.embed_norm = nn.LayerNorm(width, eps=1e-12)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(BertLayer(width, num_heads, dropout) for _ in range(num_layers))
        self.pooler = nn.Linear(width, width)

    def forward(self, input_ids, attention_mask, token_type_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        x = self.dropout(self.embed_norm(x))
        # (batch, 1, 1, keys) boolean: True where a key may be attended to (not padding).
        keep = attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            x = layer(x, keep)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return {"last_hidden_state": x, "pooler_output": pooled}


def bert() -> tuple[nn.Module, tuple]:
    batch, seq = 2, 16
    input_ids = torch.randint(0, 128, (batch, seq))
    # Random lengths in [seq // 2, seq]; the first row stays full so one row has no padding.
    lengths = torch.randint(seq // 2, seq + 1, (batch,))
    lengths[0] = seq
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    token_type_ids = torch.randint(0, 2, (batch, seq))
    return Bert(), (input_ids, attention_mask, token_type_ids)


# ---------------------------------------------------------------------------------------------
# ViT
# ---------------------------------------------------------------------------------------------


class ViTBlock(nn.Module):
    def __init__(self, width: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * width, width)
        )

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch-embedding conv, class token, learned positions, pre-LN blocks, linear head."""

    def __init__(
        self,
        image_size: int = 16,
        patch_size: int = 4,
        channels: int = 3,
        width: int = 32,
        num_layers: int = 2,
        num_heads: int = 4,
        num_classes: int = 10,
        dropout: float = 0.1,
    ):
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(channels, width, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, width) * 0.02)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(ViTBlock(width, num_heads, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (batch, patches, width)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = self.dropout(torch.cat((cls, x), dim=1) + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def vit() -> tuple[nn.Module, tuple]:
    return ViT(), (torch.randn(2, 3, 16, 16),)


# ---------------------------------------------------------------------------------------------
# Top-2 mixture of experts
# ---------------------------------------------------------------------------------------------


class Top2MoE(nn.Module):
    """Softmax router, top-2 gating; experts run densely and are combined by scattered weights.

    Running every expert on every token keeps all shapes static (torch.export cannot capture
    the data-dependent token counts of a sparse dispatch); the combine weights are a
    (tokens, experts) matrix that is zero except at each token's two chosen experts.
    """

    def __init__(self, width: int, hidden: int, num_experts: int):
        super().__init__()
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(num_experts)
        )

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1)
        top_probs, top_experts = probs.topk(2, dim=-1)
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        combine = torch.zeros_like(probs).scatter(1, top_experts, top_probs)
        expert_out = torch.stack([expert(tokens) for expert in self.experts], dim=1)
        out = (combine.unsqueeze(-1) * expert_out).sum(dim=1)
        return out.reshape(x.shape)


class MoEModel(nn.Module):
    def __init__(
        self, width: int = 32, hidden: int = 64, num_experts: int = 4, num_layers: int = 2
    ):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(num_layers))
        self.moes = nn.ModuleList(Top2MoE(width, hidden, num_experts) for _ in range(num_layers))

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x


def moe() -> tuple[nn.Module, tuple]:
    return MoEModel(), (torch.randn(2, 16, 32),)


# ---------------------------------------------------------------------------------------------
# Causal attention block alone
# ---------------------------------------------------------------------------------------------


class CausalAttentionBlock(nn.Module):
    """Projections around one causal scaled_dot_product_attention: the kernel's unit of work."""

    def __init__(self, width: int = 64, num_heads: int = 4):
        super().__init__()
        self.attn = CausalSelfAttention(width, num_heads, dropout=0.0)

    def forward(self, x):
        return self.attn(x)


def causal_attention() -> tuple[nn.Module, tuple]:
    return CausalAttentionBlock(), (torch.randn(2, 16, 64),)


ARCHITECTURES: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "mlp": mlp,
    "cnn": cnn,
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "vit": vit,
    "moe": moe,
    "causal_attention": causal_attention,
}
"""Name -> factory returning (module in train mode, fresh random example args)."""

__all__ = ["ARCHITECTURES", "gpt2_bench_model", "scalar_loss"]
