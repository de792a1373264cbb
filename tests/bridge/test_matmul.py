"""Parity of the matrix-product lowerings (mm, bmm, addmm, addbmm, addmv) with torch eager.

Run: .venv/bin/python -m pytest -q tests/bridge/test_matmul.py -p no:cacheprovider

The torch calls used here reach the graph as exactly these overloads (torch.matmul on batched
operands becomes expand/view/bmm; baddbmm, mv, dot and addr decompose to mul/sum).
"""

import copy
import re

import jax
import pytest
import torch

import zerojax
from tests import tolerances
from tests.bridge.parity import check, run_both
from zerojax.bridge.dtypes import from_torch, to_torch

# fp32 on both sides: the same products summed in a different order (XLA's blocked dot vs
# torch's kernel); each order is within (K - 1) u S of the exact sum, S = sum |terms| (computed
# from |operands| below), so |zerojax - torch| <= 2 (K - 1) u S elementwise. K <= 11 here
# (addbmm: 2 batches x 5, plus the beta * self term).
FP32_K = 11
# bf16: zerojax accumulates in fp32 and rounds once; torch's bf16 kernels (oneDNN, or ATen's
# fp32-accumulating gemm) round once, except addbmm, which adds its batch products into the bf16
# result one addmm at a time (1 + batches roundings). Each rounding <= u S (u = 2^-8).
BF16_ROUNDINGS = 2
FP32 = {"rtol": 0, "atol": tolerances.reordered_sum(torch.float32, FP32_K, 11 * 4.5**2)}
"""For the scalar checks (Linear, matmul): K <= 6 products of randn values below 4.5."""
NAN = float("nan")


def check_bounded(fn, magnitude, *args, roundings_bf16=BF16_ROUNDINGS):
    """zerojax vs torch for fn(*args), elementwise within the bound for args' dtype, where
    magnitude(*|args| in float64) is S, the sum of |terms| at each output element."""
    expected, got = run_both(fn, *args)
    dtype = args[0].dtype
    magnitudes = magnitude(*(a.abs().double() for a in args))
    roundings = roundings_bf16 if dtype == torch.bfloat16 else 2 * (FP32_K - 1)
    for i, (e, g, m) in enumerate(zip(expected, got, magnitudes, strict=True)):
        assert g.dtype == e.dtype
        tolerances.assert_within(
            g, e, tolerances.rounded_intermediates(dtype, roundings, m), f"[{i}]"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_bmm(dtype):
    a, b = torch.randn(5, 7, dtype=dtype), torch.randn(7, 3, dtype=dtype)
    c, d = torch.randn(2, 5, 7, dtype=dtype), torch.randn(2, 7, 4, dtype=dtype)

    def fn(a, b, c, d):
        return torch.mm(a, b), torch.bmm(c, d)

    check_bounded(fn, fn, a, b, c, d)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8])
def test_mm_integer(dtype):
    a, b = torch.randint(-9, 10, (3, 6), dtype=dtype), torch.randint(-9, 10, (6, 4), dtype=dtype)
    check(lambda a, b: (torch.mm(a, b), torch.bmm(a[None], b[None])), a, b)


def test_mm_mixed_dtypes_promote():
    check(lambda a, b: torch.mm(a, b.float()), torch.randn(3, 4), torch.randn(4, 5).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_addmm(dtype):
    bias, a, b = (torch.randn(*s, dtype=dtype) for s in [(4,), (3, 5), (5, 4)])
    full = torch.randn(3, 4, dtype=dtype)

    def fn(bias, full, a, b, sign=-1.0):
        return (
            torch.addmm(bias, a, b),
            torch.addmm(full, a, b, beta=0.5, alpha=2.0 * sign),
            torch.addmm(full[:1], a, b, beta=3),
        )

    check_bounded(fn, lambda *xs: fn(*xs, sign=1.0), bias, full, a, b)


def test_addmm_beta_zero_ignores_nan_self():
    self = torch.full((3, 4), NAN)
    check(lambda s, a, b: torch.addmm(s, a, b, beta=0), self, torch.randn(3, 5), torch.randn(5, 4))


def test_addmm_integer():
    self, a, b = (torch.randint(-5, 6, s) for s in [(3, 4), (3, 5), (5, 4)])
    check(lambda s, a, b: torch.addmm(s, a, b, beta=2, alpha=3), self, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_addbmm_addmv(dtype):
    def fn(s, b1, b2, v_self, mat, vec, sign=-1):
        return (
            torch.addbmm(s, b1, b2),
            torch.addbmm(s, b1, b2, beta=0.5, alpha=2),
            torch.addmv(v_self, mat, vec, beta=1 * sign, alpha=0.5),
            torch.addmv(v_self[:1], mat, vec),
        )

    shapes = [(3, 4), (2, 3, 5), (2, 5, 4), (3,), (3, 6), (6,)]
    args = [torch.randn(*s, dtype=dtype) for s in shapes]
    # addbmm over 2 batches: torch rounds the beta * self term and each batch's sum, + zerojax.
    check_bounded(fn, lambda *xs: fn(*xs, sign=1), *args, roundings_bf16=1 + 2 + 1)


def test_linear_and_matmul_graphs():
    """nn.Linear (permute + addmm/mm) and batched matmul (expand/view + bmm) end to end."""
    torch.manual_seed(0)
    check(torch.nn.Linear(6, 3), torch.randn(4, 6), **FP32)
    check(torch.nn.Linear(6, 3, bias=False), torch.randn(4, 6), **FP32)
    check(torch.matmul, torch.randn(2, 3, 4, 5), torch.randn(5, 2), **FP32)


def test_integer_add_products_truncate_scalars():
    """torch casts beta/alpha to the integer dtype (0.6 -> 0) before scaling."""
    m, v = torch.randint(-9, 9, (3, 4)), torch.randint(-9, 9, (4,))
    b1, b2 = torch.randint(-9, 9, (2, 3, 4)), torch.randint(-9, 9, (2, 4, 5))
    check(
        lambda s, a, b: torch.addmv(s, a, b, beta=0.2, alpha=0.6), torch.randint(-9, 9, (3,)), m, v
    )
    check(
        lambda s, a, b: torch.addmv(s, a, b, beta=2.7, alpha=1.6), torch.randint(-9, 9, (3,)), m, v
    )
    check(
        lambda s, a, b: torch.addbmm(s, a, b, beta=0.2, alpha=0.6),
        torch.randint(-9, 9, (3, 5)),
        b1,
        b2,
    )


def test_bilinear():
    x1, x2 = torch.randn(4, 3), torch.randn(4, 5)
    w, b = torch.randn(2, 3, 5), torch.randn(2)
    check(torch.nn.functional.bilinear, x1, x2, w, b)
    check(
        lambda a, c, d: torch.nn.functional.bilinear(a, c, d),
        torch.randn(2, 4, 3),
        torch.randn(2, 4, 5),
        w,
    )


class _BroadcastBatchProducts(torch.nn.Module):
    """Products torch.matmul turns into expand -> bmm: a Linear on a transposed (not
    contiguous) input, as nn.MultiheadAttention's in-projection of its seq-first layout; a
    4-d such input (the expand's [2, 4] batch dims viewed as one); a [1, M, K] left operand
    broadcast against a [B, K, N] batch."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(24, 40)
        self.left = torch.nn.Parameter(torch.randn(1, 7, 24))

    def forward(self, x, y):
        seq_first = x.transpose(0, 1)  # (5, 3, 24)
        four_d = y.transpose(1, 2)  # (2, 4, 3, 24)
        return self.proj(seq_first), self.proj(four_d), self.left @ seq_first.transpose(1, 2)


def _float64_grads(module, cotangents, *inputs) -> dict:
    """Outputs and gradients of sum(output * cotangent) in float64 torch, by name."""
    module = copy.deepcopy(module).double()
    inputs = [t.double().requires_grad_() for t in inputs]
    outs = module(*inputs)
    total = sum((o * c.double()).sum() for o, c in zip(outs, cotangents, strict=True))
    names = [f"input {i}" for i in range(len(inputs))] + [n for n, _ in module.named_parameters()]
    grads = torch.autograd.grad(total, [*inputs, *module.parameters()])
    return {"outputs": [o.detach() for o in outs]} | dict(zip(names, grads, strict=True))


def test_batch_broadcast_operand_is_contracted_as_one_matrix():
    """A bmm operand that is an expand of one matrix over the batch is contracted as that
    matrix: XLA otherwise materializes the B copies (torch's expand is a stride-0 view), and
    the backward a [B, K, N] gradient (ViT-B/16: 120 MB per layer and device). The compiled
    forward + backward holds no buffer of an expanded shape, and outputs and gradients match
    float64 torch."""
    torch.manual_seed(0)
    module = _BroadcastBatchProducts()
    x, y = torch.randn(3, 5, 24), torch.randn(2, 3, 4, 24)
    cotangents = [torch.randn(5, 3, 40), torch.randn(2, 4, 3, 40), torch.randn(5, 7, 3)]
    converted = zerojax.convert(module, (x, y))

    def loss(params, x, y):
        outs, _ = converted.apply(params, converted.buffers, x, y)
        total = sum((o * from_torch(c)).sum() for o, c in zip(outs, cotangents, strict=True))
        return total, outs

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    jax_x, jax_y = from_torch(x), from_torch(y)
    compiled = step.lower(converted.params, jax_x, jax_y).compile().as_text()
    for expanded in ("f32[5,24,40]", "f32[2,4,24,40]", "f32[8,24,40]", "f32[5,7,24]"):
        assert expanded not in compiled, f"{expanded} is materialized"
    (_, outs), (grad_params, grad_x, grad_y) = step(converted.params, jax_x, jax_y)
    got = {"outputs": outs, "input 0": grad_x, "input 1": grad_y} | {
        name: grad_params[converted.alias[name]] for name, _ in module.named_parameters()
    }

    # Each fp32 value is one sum of n products; with S = sum of |products| it is within
    # n u S of the exact sum ((n - 1) additions and n products, each rounding <= u S). S is the
    # same graph run on absolute values. n: 25 per output (24 products + bias, 24 for `left`'s
    # product); input 0's gradient sums 40 output channels + 7 `left` rows, input 1's 40;
    # proj's weight and bias sum 5 x 3 + 2 x 4 x 3 = 39 rows, `left` 5 x 3.
    exact = _float64_grads(module, cotangents, x, y)
    absolute = copy.deepcopy(module)
    with torch.no_grad():
        for p in absolute.parameters():
            p.abs_()
    magnitude = _float64_grads(absolute, [c.abs() for c in cotangents], x.abs(), y.abs())
    terms = {"input 0": 47, "input 1": 40, "proj.weight": 39, "proj.bias": 39, "left": 15}
    for i, (g, e, m) in enumerate(zip(got["outputs"], exact["outputs"], magnitude["outputs"])):
        bound = tolerances.rounded_intermediates(torch.float32, 25, m)
        tolerances.assert_within(to_torch(g).double(), e, bound, f"output {i}")
    for name, n in terms.items():
        bound = tolerances.rounded_intermediates(torch.float32, n, magnitude[name])
        tolerances.assert_within(to_torch(got[name]).double(), exact[name], bound, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_linear_gradients_match_torch(dtype):
    """A bf16/fp16 nn.Linear's backward: each gradient is one fp32-accumulated product rounded
    once to the dtype, as torch's kernels compute it (the bias gradient a 64-term fp32 sum,
    rounded once). The two roundings differ by <= 2 u S, S the sum of |terms|: |g| @ |W| for
    the input, |g|^T @ |x| for the weight, sum |g| for the bias; plus the fp32 sums' reordering
    (<= 2 * 63 * 2^-24 S, sums of at most 64 terms)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 32).to(dtype)
    x, g = torch.randn(64, 48, dtype=dtype), torch.randn(64, 32, dtype=dtype)
    leaf = x.clone().requires_grad_()
    layer(leaf).backward(g)

    converted = zerojax.convert(layer, (x,))

    def forward(params, x):
        return converted.apply(params, converted.buffers, x)[0]

    _, pullback = jax.vjp(forward, converted.params, from_torch(x))
    d_params, d_x = jax.jit(pullback)(from_torch(g))
    magnitude = {
        "input": g.abs().double() @ layer.weight.abs().double(),
        "weight": g.abs().double().T @ x.abs().double(),
        "bias": g.abs().double().sum(0),
    }
    bound = {
        k: tolerances.rounded_intermediates(dtype, 2, m)
        + tolerances.reordered_sum(torch.float32, 64, m)
        for k, m in magnitude.items()
    }
    tolerances.assert_within(to_torch(d_x), leaf.grad, bound["input"], "input")
    tolerances.assert_within(
        to_torch(d_params["weight"]), layer.weight.grad, bound["weight"], "weight"
    )
    tolerances.assert_within(to_torch(d_params["bias"]), layer.bias.grad, bound["bias"], "bias")


def test_bf16_linear_multiplies_in_bf16_forward_and_backward():
    """nn.Linear's `addmm(b, x, t(W))` in bf16: the forward product and the input gradient are
    bf16 x bf16 -> fp32 dots in the optimized program (XLA:CPU's bf16 kernels), not dots on
    operands converted to fp32 (4x slower on the bench CPU: BENCHMARKS.md, training step).
    The weight gradient contracts over the rows, a layout XLA:CPU multiplies in fp32 either way.
    """
    layer = torch.nn.Linear(256, 512).to(torch.bfloat16)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    converted = zerojax.convert(layer, (x,))

    def forward_and_backward(params, x, cotangent):
        out, pullback = jax.vjp(
            lambda params, x: converted.apply(params, converted.buffers, x)[0], params, x
        )
        return out, pullback(cotangent)

    program = jax.jit(forward_and_backward)
    cotangent = from_torch(torch.randn(128, 512, dtype=torch.bfloat16))
    text = program.lower(converted.params, from_torch(x), cotangent).compile().as_text()
    shapes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
    dots = re.findall(r"= (\w+)\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", text)
    operand_types = {shape: (shapes[a], shapes[b]) for _, shape, a, b in dots}
    assert operand_types["128,512"] == ("bf16", "bf16"), dots  # forward
    assert operand_types["128,256"] == ("bf16", "bf16"), dots  # input gradient
