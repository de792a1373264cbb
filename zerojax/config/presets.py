"""Built-in tensor-/expert-parallel rule presets: parameter-name regex -> per-dim mesh axes.

Presets are plain tables (torchtitan style) that a config's `rules` list names and
`sections.parse_rules` expands in place. Tensor parallelism follows Megatron: column-wise
(output dim split) for q/k/v, up and gate projections, row-wise (input dim split) for the
attention output and down projections, so each block needs one all-reduce; embeddings and LM
heads are split by vocabulary. Biases of column-wise layers are split with their outputs;
row-wise biases stay whole.

Weight layouts differ by module type, and the names alone cannot tell: `nn.Linear.weight` is
[out, in], Hugging Face GPT-2's `Conv1D.weight` is [in, out]. Hence two GPT-2 presets.
"""

from __future__ import annotations

__all__ = ["PRESETS"]

_COL = ("tensor", None)  # nn.Linear [out, in]: split the output features
_ROW = (None, "tensor")  # nn.Linear [out, in]: split the input features
_VOCAB = ("tensor", None)  # [vocab, embed]
_BIAS = ("tensor",)

PRESETS: dict[str, tuple[tuple[str, tuple], ...]] = {
    # Hugging Face transformers GPT2LMHeadModel: Conv1D weights are [in, out].
    "gpt2": (
        (r"(^|\.)wte\.weight$", _VOCAB),
        (r"(^|\.)attn\.c_attn\.weight$", (None, "tensor")),
        (r"(^|\.)attn\.c_attn\.bias$", _BIAS),
        (r"(^|\.)attn\.c_proj\.weight$", ("tensor", None)),
        (r"(^|\.)mlp\.c_fc\.weight$", (None, "tensor")),
        (r"(^|\.)mlp\.c_fc\.bias$", _BIAS),
        (r"(^|\.)mlp\.c_proj\.weight$", ("tensor", None)),
        (r"(^|\.)lm_head\.weight$", _VOCAB),
    ),
    # nanoGPT-style GPT-2 built from nn.Linear (same names as Hugging Face, [out, in] weights).
    "nanogpt": (
        (r"(^|\.)wte\.weight$", _VOCAB),
        (r"(^|\.)attn\.c_attn\.weight$", _COL),
        (r"(^|\.)attn\.c_attn\.bias$", _BIAS),
        (r"(^|\.)attn\.c_proj\.weight$", _ROW),
        (r"(^|\.)mlp\.c_fc\.weight$", _COL),
        (r"(^|\.)mlp\.c_fc\.bias$", _BIAS),
        (r"(^|\.)mlp\.c_proj\.weight$", _ROW),
        (r"(^|\.)lm_head\.weight$", _VOCAB),
    ),
    # Hugging Face Llama / Mistral / Qwen2 naming.
    "llama": (
        (r"(^|\.)embed_tokens\.weight$", _VOCAB),
        (r"(^|\.)self_attn\.(q|k|v)_proj\.weight$", _COL),
        (r"(^|\.)self_attn\.(q|k|v)_proj\.bias$", _BIAS),
        (r"(^|\.)self_attn\.o_proj\.weight$", _ROW),
        (r"(^|\.)mlp\.(gate|up)_proj\.weight$", _COL),
        (r"(^|\.)mlp\.down_proj\.weight$", _ROW),
        (r"(^|\.)lm_head\.weight$", _VOCAB),
    ),
    # Hugging Face BERT naming.
    "bert": (
        (r"(^|\.)embeddings\.word_embeddings\.weight$", _VOCAB),
        (r"(^|\.)attention\.self\.(query|key|value)\.weight$", _COL),
        (r"(^|\.)attention\.self\.(query|key|value)\.bias$", _BIAS),
        (r"(^|\.)attention\.output\.dense\.weight$", _ROW),
        (r"(^|\.)intermediate\.dense\.weight$", _COL),
        (r"(^|\.)intermediate\.dense\.bias$", _BIAS),
        (r"(^|\.)layer\.\d+\.output\.dense\.weight$", _ROW),
        (r"(^|\.)predictions\.decoder\.weight$", _VOCAB),
    ),
    # Stacked MoE expert weights ([num_experts, ...]) owned directly by an `experts` module,
    # e.g. `mlp.experts.gate_up_proj`, `moe.experts.w1`: split the expert dim. Per-expert
    # modules (`experts.3.w1.weight`) are not stacked and do not match.
    "expert": ((r"(^|\.)experts\.(?!\d+\.)[^.]+$", ("expert",)),),
}
