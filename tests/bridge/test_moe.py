"""Mixture-of-experts: grouped GEMM as `ragged_dot`, routing's counting ops, HF MoE models.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_moe.py` (add `-m slow` for the HF models
and the ZeRO training runs)

transformers runs every modern MoE's experts as sort -> histc -> cumsum -> grouped GEMM
(`transformers::grouped_mm_fallback` under export in fp32, `aten._grouped_mm` otherwise). These
tests check each lowering against torch (forward, and gradients where torch has them), that the
grouped GEMM really becomes `ragged_dot` (the form expert parallelism shards), and that HF
Mixtral converts and trains through `zerojax.initialize` like plain PyTorch, at ZeRO-0 and 3.
"""

from __future__ import annotations

import copy
import functools

import jax
import numpy as np
import pytest
import torch

import zerojax
from tests.bridge.test_models import gradient_errors, relative_error
from zerojax.bridge.dtypes import from_torch
from zerojax.bridge.errors import DataDependentShapeError

transformers = pytest.importorskip("transformers")

# fp32 products of length K <= 64 on O(1) values: each output is a dot product whose rounding
# error grows like sqrt(K) * eps32 (6e-8) typically, K * eps32 (4e-6) at worst; torch and XLA
# sum in different orders, so they differ by up to about twice that. 1e-5 bounds it.
MATMUL_RTOL = 1e-5
# torch's `_grouped_mm` runs only in bf16 (its meta function rejects fp32, so export needs
# bf16): both sides accumulate in fp32 and round each output once to bf16. Each rounding moves
# a value by at most the bf16 unit roundoff u = 2^-8 of itself (half the bf16 eps / ulp at 1,
# 2^-7), so two sides differ by <= 2 u = 2^-7 relative (normwise too), plus their fp32 sums'
# reorder bound, 2 K u32 times the magnitude ratio || |A||B| || / ||AB|| (about sqrt(K) for
# random operands): 2 K^1.5 u32 < 1.0e-4 for K <= 64, under 1% of the bf16 term, so its
# precise value does not matter. Against a float64 reference only our
# rounding counts: u + the same fp32 term. Gradients also round the cotangent path (the
# cotangent to bf16, then the result) on each side: 4 u plus the fp32 term.
_FP32_SUMS = 2 * 64**1.5 * 2.0**-24
BF16_RTOL = 2 * 2.0**-8 + _FP32_SUMS
BF16_ONE_SIDE_RTOL = 2.0**-8 + _FP32_SUMS
BF16_GRAD_RTOL = 4 * 2.0**-8 + 2 * _FP32_SUMS
# Whole models (as tests/bridge/test_hf_models.py): logits/loss through a few layers of such
# products stay within FORWARD_RTOL; gradients pass through twice as many products and softmax
# / RMSNorm backward, which amplify relative error by a small factor: 1e-4.
FORWARD_RTOL = 1e-5
GRAD_RTOL = 1e-4

# torch's CPU _grouped_mm wants 16-byte aligned rows: K, N multiples of 8 in bf16.
EXPERTS, K, N = 4, 16, 24
BF16 = torch.bfloat16


def grouped_reference(x: np.ndarray, w: np.ndarray, offs) -> np.ndarray:
    """The grouped GEMM's definition in float64: rows of group g times w[g]; later rows zero."""
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, end in enumerate(offs):
        out[start:end] = x[start:end].astype(np.float64) @ w[g].astype(np.float64)
        start = end
    return out


class GroupedLinear(torch.nn.Module):
    """One grouped GEMM with per-expert weights, rows of `x` grouped by cumulative `offs`."""

    def __init__(self, grouped_mm=torch._grouped_mm, dtype=BF16):
        super().__init__()
        self.grouped_mm = grouped_mm
        self.weight = torch.nn.Parameter((torch.randn(EXPERTS, K, N) / K**0.5).to(dtype))

    def forward(self, x, offs):
        return self.grouped_mm(x, self.weight, offs=offs)


def _apply(converted, *args):
    out, _ = jax.jit(converted.apply)(converted.params, converted.buffers, *map(from_torch, args))
    return out


def _float(array) -> np.ndarray:
    return np.asarray(array, dtype=np.float32)


def _input_grad_and_weight_grad(converted, x, offs, cotangent):
    def loss(params, x):
        out, _ = converted.apply(params, converted.buffers, x, from_torch(offs))
        return (out.astype(np.float32) * from_torch(cotangent)).sum()

    grad_params, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(converted.params, from_torch(x))
    return _float(grad_x), _float(grad_params["weight"])


def _has_ragged_dot(converted, *args) -> bool:
    inputs = (converted.params, converted.buffers, *map(from_torch, args))
    return "ragged_dot" in str(jax.make_jaxpr(converted.apply)(*inputs))


# --- grouped GEMM -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "offs", [[2, 5, 5, 9], [0, 4, 7, 9]], ids=["empty-middle-group", "empty-first-group"]
)
def test_grouped_mm_matches_torch_forward_and_backward_and_is_ragged_dot(offs):
    model = GroupedLinear()
    x, offs = torch.randn(9, K, dtype=BF16), torch.tensor(offs, dtype=torch.int32)
    converted = zerojax.convert(model, (x, offs))
    assert _has_ragged_dot(converted, x, offs)

    x.requires_grad_(True)
    expected = model(x, offs)
    # torch's CPU backward rejects the stride-0 gradient of .sum(): use a dense cotangent.
    cotangent = torch.randn(expected.shape)
    (expected.float() * cotangent).sum().backward()
    got = _apply(converted, x.detach(), offs)
    assert got.dtype == np.dtype(jax.numpy.bfloat16)
    assert relative_error(_float(got), expected.detach().float()) <= BF16_RTOL
    grad_x, grad_w = _input_grad_and_weight_grad(converted, x.detach(), offs, cotangent)
    assert relative_error(grad_x, x.grad.float()) <= BF16_GRAD_RTOL
    assert relative_error(grad_w, model.weight.grad.float()) <= BF16_GRAD_RTOL


def test_grouped_mm_rows_past_the_last_offset_are_zero():
    """torch leaves them uninitialised; transformers' fallback (and zerojax) gives zeros."""
    model = GroupedLinear()
    x, offs = torch.randn(9, K, dtype=BF16), torch.tensor([1, 3, 3, 6], dtype=torch.int32)
    got = _float(_apply(zerojax.convert(model, (x, offs)), x, offs))
    weight = model.weight.detach().float().numpy()
    expected = grouped_reference(x.float().numpy(), weight, offs.tolist())
    # float64 reference of the same bf16 inputs: ours rounds each output once to bf16.
    assert relative_error(got, expected) <= BF16_ONE_SIDE_RTOL
    assert not got[6:].any()


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "offs"),
    [
        ((8, 32), (32, 24), [8, 8, 24, 32]),  # 2D x 2D: groups split the contracted dim
        ((4, 8, 16), (16, 32), [8, 8, 24, 32]),  # 3D x 2D: groups split mat2's columns
        ((4, 8, 16), (4, 16, 24), None),  # 3D x 3D: batched
    ],
    ids=["2dx2d", "3dx2d", "3dx3d"],
)
def test_grouped_mm_other_layouts_match_torch(a_shape, b_shape, offs):
    class Product(torch.nn.Module):
        def forward(self, a, b, offs=None):
            return torch._grouped_mm(a, b, offs=offs)

    a, b = torch.randn(a_shape, dtype=BF16), torch.randn(b_shape, dtype=BF16)
    args = (a, b) if offs is None else (a, b, torch.tensor(offs, dtype=torch.int32))
    expected = Product()(*args)
    got = _apply(zerojax.convert(Product(), args), *args)
    assert relative_error(_float(got), expected.float()) <= BF16_RTOL


def test_transformers_grouped_mm_fallback_lowers_to_ragged_dot_with_torch_gradients():
    from transformers.integrations import moe  # defines transformers::grouped_mm_fallback

    fallback = torch.ops.transformers.grouped_mm_fallback
    model = GroupedLinear(fallback, dtype=torch.float32)  # as transformers' fp32 experts call it
    x, offs = torch.randn(9, K), torch.tensor([2, 2, 6, 8], dtype=torch.int32)
    converted = zerojax.convert(model, (x, offs))
    (program, _, _), *_ = converted._programs.values()
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "transformers.grouped_mm_fallback.default" in targets
    assert _has_ragged_dot(converted, x, offs)
    assert moe._grouped_mm is not None  # the dispatcher that picks this op under export

    # Eager reference: the custom op itself, with transformers' registered backward.
    x.requires_grad_(True)
    expected = fallback(x, model.weight, offs)
    cotangent = torch.randn_like(expected)
    (expected * cotangent).sum().backward()
    got = _apply(converted, x.detach(), offs)
    assert relative_error(got, expected.detach()) <= MATMUL_RTOL
    grad_x, grad_w = _input_grad_and_weight_grad(converted, x.detach(), offs, cotangent)
    assert relative_error(grad_x, x.grad) <= MATMUL_RTOL
    assert relative_error(grad_w, model.weight.grad) <= MATMUL_RTOL


def test_transformers_grouped_mm_fallback_backward_op_matches_torch():
    """The backward op appears in joint graphs; its lowering must agree with transformers'."""
    from transformers.integrations import moe  # noqa: F401  (defines the ops)

    from zerojax.bridge.registry import get_lowering

    op = torch.ops.transformers.grouped_mm_fallback_backward.default
    x, w = torch.randn(9, K), torch.randn(EXPERTS, K, N)
    offs, grad_out = torch.tensor([3, 3, 5, 7], dtype=torch.int32), torch.randn(9, N)
    grad_x, grad_w = op(x, w, offs, grad_out)
    got_x, got_w = get_lowering(op)(None, *map(from_torch, (x, w, offs, grad_out)))
    assert relative_error(got_x, grad_x) <= MATMUL_RTOL
    assert relative_error(got_w, grad_w) <= MATMUL_RTOL


# --- routing's counting ops ----------------------------------------------------------------------


class Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _converted_matches(fn, *args):
    expected = fn(*args)
    got = _apply(zerojax.convert(Call(fn), args), *args)
    return np.asarray(got), expected.numpy()


@pytest.mark.parametrize(
    ("bins", "lo", "hi"),
    [(7, -1.0, 1.0), (5, -0.3, 0.9), (5, 0.0, 0.0), (EXPERTS, 0, EXPERTS - 1)],
    ids=["explicit-range", "odd-range", "data-range", "expert-ids"],
)
def test_histc_counts_match_torch_exactly(bins, lo, hi):
    if lo == 0 and hi == EXPERTS - 1:  # transformers' use: integer expert ids as floats
        x = torch.randint(0, EXPERTS, (64,)).float()
    else:  # values outside the range, on the bin edges, and at min and max exactly
        edges = torch.linspace(lo, hi, bins + 1) if lo != hi else torch.linspace(-1, 1, bins)
        below = edges.nextafter(torch.full_like(edges, -2.0))
        above = edges.nextafter(torch.full_like(edges, 2.0))
        x = torch.cat([torch.rand(200) * 3 - 1.5, edges, below, above])
    got, expected = _converted_matches(lambda t: torch.histc(t, bins=bins, min=lo, max=hi), x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_bincount_with_minlength_matches_torch():
    ids = torch.randint(0, EXPERTS, (50,))
    weights = torch.rand(50)
    got, expected = _converted_matches(lambda t: torch.bincount(t, minlength=EXPERTS), ids)
    np.testing.assert_array_equal(got, expected)
    got, expected = _converted_matches(
        lambda t, w: torch.bincount(t, weights=w, minlength=EXPERTS), ids, weights
    )
    # 50 fp32 additions of values in [0, 1): n * eps32 relative at worst.
    assert relative_error(got, expected) <= 50 * np.finfo(np.float32).eps


def test_bincount_without_minlength_raises_a_data_dependent_shape_error():
    ids = torch.randint(0, EXPERTS, (10,))
    converted = zerojax.convert(Call(lambda t: torch.bincount(t)), (ids,))
    with pytest.raises(DataDependentShapeError, match="minlength"):
        converted.apply(converted.params, converted.buffers, from_torch(ids))


class Router(torch.nn.Module):
    """Top-k routing as MoE layers write it: softmax, topk, one_hot, sort, cumsum, scatter_add."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(K, EXPERTS)

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        weights, experts = probs.topk(2, dim=-1)
        mask = torch.nn.functional.one_hot(experts, EXPERTS).sum(1)  # (tokens, experts)
        ids, order = experts.flatten().sort(stable=True)
        counts = torch.histc(ids.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offsets = counts.cumsum(0)
        load = torch.zeros(EXPERTS).scatter_add(0, experts.flatten(), weights.flatten())
        aux = (probs.mean(0) * mask.float().mean(0)).sum() * EXPERTS  # Switch-style balance
        return load, offsets, order, aux


def test_routing_ops_match_torch_forward_and_router_gradient():
    model = Router()
    x = torch.randn(16, K)
    expected = model(x)
    converted = zerojax.convert(model, (x,))
    got = _apply(converted, x)
    for name, g, e in zip(("load", "offsets", "order", "aux"), got, expected, strict=True):
        if e.dtype.is_floating_point:
            assert relative_error(g, e.detach().numpy()) <= FORWARD_RTOL, name
        else:
            np.testing.assert_array_equal(np.asarray(g), e.numpy(), err_msg=name)

    load, _, _, aux = expected
    (load.square().sum() + aux).backward()

    def loss(params):
        load, _, _, aux = converted.apply(params, converted.buffers, from_torch(x))[0]
        return (load**2).sum() + aux

    grads = jax.jit(jax.grad(loss))(converted.params)
    errors = gradient_errors(grads, dict(model.named_parameters()))
    assert max(errors.values()) <= GRAD_RTOL, errors


# --- Hugging Face MoE models ------------------------------------------------------------------

VOCAB, BATCH, SEQ = 64, 2, 8
# Shared by every tiny MoE config: 2 layers, 4 heads, 4 experts, top-2.
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "attn_implementation": "sdpa",  # use_cache stays at its default (True)
}


def mixtral(**overrides):
    config = transformers.MixtralConfig(
        **_COMMON,
        num_key_value_heads=2,
        intermediate_size=48,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        **overrides,
    )
    return transformers.MixtralForCausalLM(config)


def qwen2_moe():
    config = transformers.Qwen2MoeConfig(
        **_COMMON,
        num_key_value_heads=2,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
    )
    return transformers.Qwen2MoeForCausalLM(config)


def qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        **_COMMON,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
    )
    return transformers.Qwen3MoeForCausalLM(config)


def olmoe():
    config = transformers.OlmoeConfig(
        **_COMMON,
        num_key_value_heads=2,
        intermediate_size=16,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        eos_token_id=VOCAB - 1,  # the default (50279) lies outside the tiny vocabulary
    )
    return transformers.OlmoeForCausalLM(config)


def deepseek_v3():
    config = transformers.DeepseekV3Config(
        **_COMMON,
        num_key_value_heads=4,  # multi-head latent attention: one KV head per query head
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    )
    return transformers.DeepseekV3ForCausalLM(config)


def gpt_oss():
    config = transformers.GptOssConfig(
        **{**_COMMON, "attn_implementation": "eager"},  # GPT-OSS has no SDPA path (sinks)
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        sliding_window=4,
    )
    return transformers.GptOssForCausalLM(config)


MODELS = {
    "mixtral": mixtral,
    "mixtral-router-logits": functools.partial(mixtral, output_router_logits=True),
    "qwen2-moe": qwen2_moe,
    "qwen3-moe": qwen3_moe,
    "olmoe": olmoe,
    "deepseek-v3": deepseek_v3,
    "gpt-oss": gpt_oss,
}
FAST = {"mixtral"}  # the default run's representative; each model costs ~10 s on 2 cores


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in MODELS]
)
def test_hf_moe_forward_and_gradients_match_torch(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    kwargs = {"input_ids": tokens, "labels": tokens}
    converted = zerojax.convert(model, (), kwargs)
    jax_kwargs = {k: from_torch(v) for k, v in kwargs.items()}

    expected = model(**kwargs)
    expected.loss.backward()

    def loss(params):  # one program for the outputs and the gradients: one compilation
        out = converted.apply(params, converted.buffers, **jax_kwargs)[0]
        return out.loss, out

    # The experts' grouped GEMM really is ragged_dot (what expert parallelism will shard).
    assert "ragged_dot" in str(jax.make_jaxpr(loss)(converted.params))
    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(converted.params)
    assert relative_error(out.logits, expected.logits.detach().numpy()) <= FORWARD_RTOL
    assert relative_error(out.loss, expected.loss.detach().numpy()) <= FORWARD_RTOL
    if getattr(expected, "aux_loss", None) is not None:  # output_router_logits=True
        assert relative_error(out.aux_loss, expected.aux_loss.detach().numpy()) <= FORWARD_RTOL

    errors = gradient_errors(grads, dict(model.named_parameters()))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{name}: gradient of {worst}: {errors[worst]:.2e}"


# After STEPS AdamW steps both sides' losses are fp32 numbers computed in different reduction
# orders (~1e-7 relative per step, measured); Adam's normalised update m / sqrt(v) keeps a
# relative gradient difference from growing across steps, so 1e-5 is ~100x fp32 eps of headroom.
# Top-2 routing is discontinuous, but a flip needs two router logits within ~1e-7 of each other.
TRAIN_RTOL = 1e-5
STEPS = 4


@pytest.mark.slow  # ~20 s each: export, then compiling the sharded train step
@pytest.mark.multidevice
@pytest.mark.parametrize("stage", [0, 3])
def test_mixtral_trains_like_torch_through_initialize(stage):
    torch.manual_seed(0)
    module = mixtral(output_router_logits=True)  # loss includes the router's balance term
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    config = {"mesh": {"fsdp": 8}, "zero": {"stage": stage}}
    model, optimizer = zerojax.initialize(module, optimizer, config)

    losses = []
    tokens = torch.randint(0, VOCAB, (8, SEQ))  # batch 8: one sequence per device
    for _ in range(STEPS):  # one batch, fitted: the loss must fall
        for m, opt in ((model, optimizer), (reference, ref_optimizer)):
            loss = m(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    ours, theirs = losses[0::2], losses[1::2]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= TRAIN_RTOL * abs(b), f"step {step}: loss {a} vs torch {b}"
    assert theirs[-1] < theirs[0]  # it trains at all
