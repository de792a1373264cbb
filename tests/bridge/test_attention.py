"""Parity of the whole-SDPA lowering with torch eager: masks, causal, GQA, scale, dropout.

Run: .venv/bin/python -m pytest tests/bridge/test_attention.py -q
"""

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from tests import tolerances
from tests.bridge.parity import (
    Lambda,
    assert_no_vanished_gradients,
    run_both,
    vanished_gradients,
)
from zerojax.bridge.capture import capture
from zerojax.bridge.dtypes import from_torch, to_torch
from zerojax.config import KernelsConfig

aten = torch.ops.aten


def qkv(batch=2, heads=4, length=8, source=8, dim=16, kv_heads=None, dtype=torch.float32):
    kv_heads = kv_heads or heads
    return (
        torch.randn(batch, heads, length, dim, dtype=dtype),
        torch.randn(batch, kv_heads, source, dim, dtype=dtype),
        torch.randn(batch, kv_heads, source, dim, dtype=dtype),
    )


def test_sdpa_stays_whole_in_the_captured_graph():
    graph = capture(Lambda(F.scaled_dot_product_attention), qkv(), {}, train=False).graph
    targets = {n.target for n in graph.nodes if n.op == "call_function"}
    assert aten.scaled_dot_product_attention.default in targets
    assert aten._softmax.default not in targets


def check_sdpa(q, k, v, mask=None, **kwargs):
    """zerojax's SDPA equals torch's within tolerances.attention's bound (both float32)."""
    extra = () if mask is None else (mask,)

    def fn(q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, *mask, **kwargs)

    expected, got = run_both(fn, q, k, v, *extra)
    group = q.shape[-3] // k.shape[-3] if q.ndim > 3 else 1
    k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    bound = tolerances.attention(
        q, k, v, mask=mask, scale=kwargs.get("scale"), causal=kwargs.get("is_causal", False)
    )
    tolerances.assert_within(got, expected, bound, "sdpa")
    return got


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_plain_and_causal(is_causal, scale):
    check_sdpa(*qkv(), is_causal=is_causal, scale=scale)


def test_sdpa_causal_rectangular_is_top_left_aligned():
    check_sdpa(*qkv(length=4), is_causal=True)


def test_sdpa_boolean_padding_mask():
    q, k, v = qkv()
    mask = torch.rand(2, 1, 8, 8) > 0.3
    mask[..., 0] = True  # every row attends somewhere
    check_sdpa(q, k, v, mask)


def test_sdpa_fully_masked_rows_give_zeros_like_torch():
    q, k, v = qkv()
    mask = torch.rand(2, 1, 8, 8) > 0.5
    mask[:, :, 3] = False
    got = check_sdpa(q, k, v, mask)
    assert not got[:, :, 3].any()


def test_sdpa_additive_float_mask():
    q, k, v = qkv()
    check_sdpa(q, k, v, torch.randn(1, 4, 8, 8))


def test_sdpa_grouped_query_heads():
    check_sdpa(*qkv(heads=8, kv_heads=2), is_causal=True, enable_gqa=True)


def test_sdpa_value_dim_differs_and_three_dims():
    q, k, _ = qkv()
    check_sdpa(q, k, torch.randn(2, 4, 8, 24))
    check_sdpa(*(t[0] for t in qkv()))


def test_sdpa_bf16_tracks_torch():
    """bf16 inputs: both sides take fp32 scores and accumulate P @ V in fp32, round the softmax
    weights to bf16 before P @ V (torch's CPU flash kernel the unnormalized ones, zerojax the
    normalized ones) and the output to bf16: tolerances.attention's bound with u_w = u_out =
    u_bf16 (scale 1/4 = 1/sqrt(16) is a power of two, so scaling q or k first is exact)."""
    q, k, v = qkv(dtype=torch.bfloat16)
    expected, got = run_both(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v
    )
    assert got.dtype == torch.bfloat16
    bound = tolerances.attention(
        q, k, v, causal=True, weights_dtype=torch.bfloat16, out_dtype=torch.bfloat16
    )
    tolerances.assert_within(got, expected, bound, "bf16 sdpa")


def test_sdpa_gradients_match_torch():
    """fp32 gradients under a random cotangent, within tolerances.attention_gradients (float32
    rounding along scores, softmax, P @ V and the dq/dk/dv contractions, on these inputs). The
    causal mask is folded into the additive one: torch >= 2.14 refuses `attn_mask` with
    `is_causal=True` (2.13 applied both, which is this)."""
    q, k, v = (t.requires_grad_() for t in qkv())
    mask = torch.randn(1, 1, 8, 8)
    causal_mask = mask.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    cotangent = torch.randn(2, 4, 8, 16)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask)
    (out * cotangent).sum().backward()

    fn = Lambda(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))
    args = (q.detach(), k.detach(), v.detach(), causal_mask)
    converted = zerojax.convert(fn, args)

    def loss(q, k, v):
        out, _ = converted.apply({}, {}, q, k, v, args[3])
        return (out * from_torch(cotangent)).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(
        *(zerojax.bridge.dtypes.from_torch(a) for a in args[:3])
    )
    bounds = tolerances.attention_gradients(*args[:3], cotangent, mask=mask, causal=True)
    for got, want, name in zip(grads, (q.grad, k.grad, v.grad), ("dq", "dk", "dv")):
        tolerances.assert_within(to_torch(got), want, bounds[name], name)


def test_sdpa_dropout_follows_the_key():
    fn = Lambda(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
    args = qkv()
    converted = zerojax.convert(fn, args)
    run = jax.jit(lambda key: converted.apply({}, {}, *args, rng=key)[0])
    a, b, c = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c))
    with pytest.raises(ValueError, match="rng"):
        converted.apply({}, {}, *args)


class LearnedBiasAttention(torch.nn.Module):
    """A learned additive bias passed as SDPA's attn_mask (Swin's relative position table, T5's
    relative attention bias, MaxViT, TinyViT's attention_biases, in five lines)."""

    def __init__(self, heads=2, length=16):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(heads, length, length))

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


@pytest.mark.parametrize(
    "kernels",
    [
        pytest.param(None, id="default"),  # attention "auto": flash_attention's XLA path on CPU
        pytest.param(KernelsConfig(attention="pallas", interpret=True), id="pallas-interpret"),
        pytest.param(KernelsConfig(attention="off"), id="off"),
    ],
)
def test_sdpa_learned_bias_mask_gets_torch_gradient(kernels):
    """Regression (issue 15): the flash-attention path stopped the mask's gradient, so every
    learned bias passed as attn_mask trained with a zero gradient. Tolerance as in
    test_sdpa_gradients_match_torch: the score gradient's bound summed over the batch (the
    bias's broadcast dim, a 2-term sum)."""
    torch.manual_seed(0)
    module = LearnedBiasAttention()
    q, k, v = qkv(batch=2, heads=2, length=16, source=16, dim=16)
    cotangent = torch.randn(2, 2, 16, 16)
    (module(q, k, v) * cotangent).sum().backward()

    converted = zerojax.convert(module, (q, k, v))
    jax_args = [from_torch(a) for a in (q, k, v)]

    def loss(params):
        out, _ = converted.apply(params, converted.buffers, *jax_args, kernels=kernels)
        return (out * from_torch(cotangent)).sum()

    grads = jax.jit(jax.grad(loss))(converted.params)
    got = to_torch(grads[converted.alias["bias"]])
    assert got.abs().max() > 0.01, "the bias gradient vanished"
    ds = tolerances.attention_gradients(q, k, v, cotangent, mask=module.bias.detach())["ds"]
    bound = ds.sum(0) * (1 + 2 * tolerances.unit_roundoff(torch.float32))
    tolerances.assert_within(got, module.bias.grad, bound, "bias gradient")


def test_parity_harness_names_parameters_whose_gradient_vanished():
    """The harness check that would have caught issue 15: a parameter torch trains but zerojax
    gives an all-zero gradient is named; float noise of an analytically zero gradient is not."""
    expected = {
        "qkv.weight": torch.ones(4, 4),
        "relative_position_bias_table": torch.full((3, 2), 0.1),
        "key_bias_noise": torch.full((4,), 1e-9),  # analytically zero, torch's rounding noise
    }
    got = {
        "qkv.weight": np.ones((4, 4), np.float32),
        "relative_position_bias_table": np.zeros((3, 2), np.float32),
        "key_bias_noise": np.zeros(4, np.float32),
    }
    assert vanished_gradients(got, expected) == ["relative_position_bias_table"]
    with pytest.raises(AssertionError, match="relative_position_bias_table"):
        assert_no_vanished_gradients(got, expected, what="swin")
    got["relative_position_bias_table"] = np.full((3, 2), 0.1, np.float32)
    assert_no_vanished_gradients(got, expected, what="swin")
