"""Parity of the pointwise lowerings (zerojax/bridge/lowerings/pointwise.py) with torch eager.

Run: .venv/bin/python -m pytest -q tests/bridge/test_pointwise.py -p no:cacheprovider

Each test exports a small torch callable, converts it, runs it jitted and compares dtype, shape
and values with torch (tests.bridge.parity.check); the gradient tests compare jax.grad of the
converted sum with torch autograd. Inputs are fresh random tensors in each op's domain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

import zerojax
from tests.bridge.parity import Lambda, assert_close, check
from zerojax.bridge.dtypes import from_torch, to_torch

NAN, INF = float("nan"), float("inf")


def real(*shape):
    return torch.randn(shape)


def unit(*shape):
    """Open interval (-0.9, 0.9): asin, atanh, erfinv."""
    return torch.rand(shape) * 1.8 - 0.9


def positive(*shape):
    return torch.rand(shape) * 3 + 0.1


def above_one(*shape):
    return torch.rand(shape) * 3 + 1.05


def probability(*shape):
    return torch.rand(shape) * 0.98 + 0.01


def ints(*shape, low=-9, high=10):
    return torch.randint(low, high, shape)


def nonzero_ints(*shape):
    x = ints(*shape)
    return torch.where(x == 0, 3, x)


# (name, torch function, input maker, rtol) for float32 ops with one tensor operand.
UNARY = [
    ("abs", torch.abs, real, None),
    ("acos", torch.acos, unit, None),
    ("acosh", torch.acosh, above_one, None),
    ("asin", torch.asin, unit, None),
    ("asinh", torch.asinh, real, None),
    ("atan", torch.atan, real, None),
    ("atanh", torch.atanh, unit, None),
    ("cos", torch.cos, real, None),
    ("cosh", torch.cosh, real, None),
    ("sin", torch.sin, real, None),
    ("sinh", torch.sinh, real, None),
    ("tan", torch.tan, unit, None),
    ("tanh", torch.tanh, real, None),
    ("exp", torch.exp, real, None),
    ("exp2", torch.exp2, real, None),
    ("expm1", torch.expm1, real, None),
    ("log", torch.log, positive, None),
    ("log10", torch.log10, positive, None),
    ("log1p", torch.log1p, positive, None),
    ("log2", torch.log2, positive, None),
    ("sqrt", torch.sqrt, positive, None),
    ("rsqrt", torch.rsqrt, positive, None),
    ("reciprocal", torch.reciprocal, positive, None),
    ("neg", torch.neg, real, None),
    ("sign", torch.sign, real, None),
    ("sgn", torch.sgn, real, None),
    ("signbit", torch.signbit, real, None),
    ("ceil", torch.ceil, lambda *s: real(*s) * 5, None),
    ("floor", torch.floor, lambda *s: real(*s) * 5, None),
    ("round", torch.round, lambda *s: real(*s) * 5, None),
    ("trunc", torch.trunc, lambda *s: real(*s) * 5, None),
    ("frac", torch.frac, lambda *s: real(*s) * 5, None),
    ("erf", torch.erf, real, None),
    ("erfc", torch.erfc, real, 1e-5),
    ("erfinv", torch.erfinv, unit, 1e-5),
    ("sigmoid", torch.sigmoid, real, None),
    ("relu", torch.relu, real, None),
    ("isinf", torch.isinf, real, None),
    ("isnan", torch.isnan, real, None),
    ("lgamma", torch.lgamma, positive, 1e-5),
    ("digamma", torch.digamma, positive, 1e-5),
    ("trigamma", lambda x: torch.polygamma(1, x), positive, 1e-5),
    ("i0", torch.i0, real, 1e-5),
    ("i0e", torch.special.i0e, real, 1e-5),
    ("i1", torch.special.i1, real, 1e-5),
    ("i1e", torch.special.i1e, real, 1e-5),
    ("ndtri", torch.special.ndtri, probability, 1e-5),
    ("erfcx", torch.special.erfcx, real, 1e-5),
    ("spherical_j0", torch.special.spherical_bessel_j0, real, 1e-5),
    ("angle", torch.angle, real, None),
    ("square", torch.square, real, None),
    ("bitwise_not_bool", lambda x: ~(x > 0), real, None),
    ("logical_not", torch.logical_not, real, None),
    ("silu", F.silu, real, None),
    ("mish", F.mish, real, None),
    ("softplus", F.softplus, real, None),
    ("hardswish", F.hardswish, real, None),
    ("hardsigmoid", F.hardsigmoid, real, None),
    ("logit", torch.logit, probability, 1e-5),
    ("sinc", torch.sinc, real, 1e-5),
    ("nan_to_num", torch.nan_to_num, real, None),
]


@pytest.mark.parametrize("fn, make, rtol", [u[1:] for u in UNARY], ids=[u[0] for u in UNARY])
def test_unary_float32(fn, make, rtol):
    check(fn, make(3, 4), rtol=rtol or 1.3e-6)


@pytest.mark.parametrize(
    "fn",
    [
        torch.exp,
        torch.sin,
        torch.sqrt,
        torch.sigmoid,
        torch.abs,
        torch.floor,
        torch.round,
        torch.sign,
        torch.neg,
        torch.relu,
    ],
)
def test_unary_zero_dim(fn):
    check(fn, positive())


@pytest.mark.parametrize(
    "fn",
    [
        torch.exp,
        torch.sqrt,
        torch.sin,
        torch.reciprocal,
        torch.abs,
        torch.neg,
        torch.sign,
        torch.floor,
        torch.ceil,
        torch.round,
        torch.trunc,
        torch.relu,
        torch.signbit,
        torch.isnan,
        torch.bitwise_not,
        torch.square,
        lambda x: torch.round(x, decimals=1),
    ],
)
def test_unary_int(fn):
    check(fn, ints(3, 4))


def test_special_values():
    """torch's sign(NaN) == 0, digamma(+-0) == -+inf, round half to even, inf/nan tests."""
    x = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 0.5, 1.5, 2.5, -2.5, -3.0])
    check(lambda x: (torch.sign(x), torch.isinf(x), torch.isnan(x), torch.round(x)), x)
    check(lambda x: (torch.signbit(x), torch.angle(x), torch.abs(x)), x)
    check(torch.digamma, torch.tensor([0.0, -0.0, 2.5, -2.5]), rtol=1e-5)


@pytest.mark.parametrize("decimals", [-2, 0, 1, 3])
def test_round_decimals(decimals):
    check(lambda x: torch.round(x, decimals=decimals), torch.randn(10) * 300)


@pytest.mark.parametrize(
    "fn",
    [
        torch.exp,
        torch.tanh,
        torch.sigmoid,
        torch.log1p,
        torch.erf,
        torch.rsqrt,
        F.gelu,
        lambda x: x * 3 + 1,
        lambda x, y=None: x / 7,
        lambda x: torch.clamp(x, 0.5, 1.5),
    ],
)
def test_bf16(fn):
    check(fn, positive(4, 5).bfloat16(), rtol=1e-2, atol=1e-2)


def test_fp16():
    check(lambda x: (torch.exp(x), x * x + 1, torch.log(x)), positive(4, 5).half(), rtol=1e-3)


# --- activations ----------------------------------------------------------------------------


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    check(lambda x: F.gelu(x, approximate=approximate), real(4, 5) * 3)


def test_gelu_exact_differs_from_tanh():
    """Guards against both modes being lowered to one formula."""
    x = torch.linspace(-3, 3, 50)
    exact = check(lambda x: F.gelu(x), x)
    tanh = check(lambda x: F.gelu(x, approximate="tanh"), x)
    assert (exact - tanh).abs().max() > 1e-5


@pytest.mark.parametrize(
    "fn",
    [
        F.elu,
        lambda x: F.elu(x, alpha=0.7),
        F.selu,
        F.celu,
        lambda x: torch.ops.aten.elu(x, 1.3, 0.8, 1.7),
        F.hardtanh,
        F.relu6,
        lambda x: F.hardtanh(x, -0.3, 0.4),
        F.leaky_relu,
        lambda x: F.leaky_relu(x, 0.2),
    ],
)
def test_activations(fn):
    check(fn, real(4, 5) * 3)


# --- arithmetic -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, args",
    [
        (lambda x, y: x + y, (real(3, 4), real(4))),
        (lambda x, y: torch.add(x, y, alpha=2), (real(3, 4), real(3, 1))),
        (lambda x, y: torch.sub(x, y, alpha=0.5), (real(3, 4), real(4))),
        (lambda x, y: x * y, (real(2, 1, 4), real(3, 1))),
        (lambda x, y: x + y, (ints(3, 4), real(4))),
        (lambda x, y: x * y, (ints(3, 4), ints(3, 4))),
        (lambda x, y: torch.add(x, y, alpha=3), (ints(3, 4), ints(4))),
        (lambda x, y: x + y, (real(3, 4), real())),  # 0-d tensor operand
        (lambda x, y: x * y, (ints(3, 4), real())),  # 0-d float * int tensor -> float
        (lambda x, y: x * y, (real(3, 4).bfloat16(), real(3, 4))),
        (lambda x, y: x + y, (real(3) > 0, real(3) > 0)),  # bool + bool: logical or
        (lambda x, y: x * y, (real(3) > 0, ints(3))),
    ],
)
def test_add_sub_mul(fn, args):
    check(fn, *args, rtol=1e-2 if args[0].dtype == torch.bfloat16 else 1.3e-6)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x * 2.5,
        lambda x: x + 1,
        lambda x: 3 - x,
        lambda x: x - 0.25,
        lambda x: torch.ops.aten.add.Scalar(x, 3, 2),
        lambda x: torch.ops.aten.sub.Scalar(x, 2.5, 2),
        lambda x: torch.ops.aten.mul.Scalar(x, 0.1),
    ],
)
@pytest.mark.parametrize("make", [real, ints], ids=["float", "int"])
def test_python_scalar_operands(fn, make):
    check(fn, make(3, 4))


def test_int_tensor_times_float_scalar_is_float():
    got = check(lambda x: x * 1.5, ints(5))
    assert got.dtype == torch.float32


@pytest.mark.parametrize("mode", [None, "trunc", "floor"])
@pytest.mark.parametrize(
    "make_a, make_b",
    [(ints, nonzero_ints), (real, real), (ints, real), (lambda *s: real(*s) * 10, real)],
    ids=["int", "float", "int_float", "float_wide"],
)
def test_div_rounding_modes(mode, make_a, make_b):
    check(lambda a, b: torch.div(a, b, rounding_mode=mode), make_a(4, 5), make_b(4, 5))


@pytest.mark.parametrize("mode", [None, "trunc", "floor"])
@pytest.mark.parametrize("divisor", [3, -3, 2.5, -0.75])
def test_div_by_scalar(mode, divisor):
    check(lambda a: torch.div(a, divisor, rounding_mode=mode), ints(4, 5))
    check(lambda a: torch.div(a, divisor, rounding_mode=mode), real(4, 5) * 10)


def test_div_int_by_int_is_float():
    got = check(lambda a, b: a / b, ints(6), nonzero_ints(6))
    assert got.dtype == torch.float32


def test_floor_divide_edge_cases():
    """Exact multiples, signed zeros and division by zero follow torch's div_floor_floating."""
    a = torch.tensor([7.0, -7.0, 6.0, -6.0, 0.0, -0.0, 1.0, -1.0, 0.0, 5.5])
    b = torch.tensor([2.0, 2.0, -3.0, 3.0, 3.0, 3.0, 0.0, 0.0, -2.0, -0.5])
    check(lambda a, b: torch.div(a, b, rounding_mode="floor"), a, b)
    check(lambda a, b: torch.div(a, b, rounding_mode="trunc"), a, b)
    check(torch.floor_divide, ints(20), nonzero_ints(20))


@pytest.mark.parametrize("op", [torch.fmod, torch.remainder])
@pytest.mark.parametrize(
    "make_a, make_b",
    [(ints, nonzero_ints), (lambda *s: real(*s) * 10, real)],
    ids=["int", "float"],
)
def test_fmod_remainder_signs(op, make_a, make_b):
    check(op, make_a(4, 5), make_b(4, 5))
    check(lambda a: op(a, -3), make_a(4, 5))
    check(lambda a: op(a, 2.5), make_a(4, 5))


def test_remainder_scalar_tensor():
    check(lambda b: torch.remainder(7.5, b), real(6))
    check(lambda b: torch.remainder(-7, b), nonzero_ints(6))


@pytest.mark.parametrize(
    "fn, args",
    [
        (lambda x, y: torch.pow(x, y), (positive(3, 4), real(3, 4))),
        (lambda x, y: torch.pow(x, y), (ints(3, 4), torch.randint(0, 5, (3, 4)))),
        (lambda x, y: torch.pow(x, y), (ints(12), torch.randint(-3, 3, (12,)))),
        (lambda x, y: torch.pow(x, y), (real(3, 4), torch.randint(0, 4, (4,)))),
        (lambda x: x**2, (real(3, 4),)),
        (lambda x: x**3, (real(3, 4),)),
        (lambda x: x**-1, (positive(3, 4),)),
        (lambda x: x**-2.0, (positive(3, 4),)),
        (lambda x: x**0.5, (positive(3, 4),)),
        (lambda x: x**-0.5, (positive(3, 4),)),
        (lambda x: x**1.7, (positive(3, 4),)),
        (lambda x: x**0, (torch.tensor([NAN, 2.0, -1.0]),)),
        (lambda x: x**3, (ints(3, 4),)),
        (lambda x: x**2.5, (torch.randint(0, 9, (3, 4)),)),
        (lambda x: 2**x, (ints(3, 4, low=0),)),
        (lambda x: 2.5**x, (real(3, 4),)),
        (lambda x: torch.float_power(x, 2), (real(3, 4),)),
    ],
)
def test_pow(fn, args):
    check(fn, *args, rtol=1e-5)


def test_integer_pow_stays_integer():
    got = check(lambda x, y: x**y, ints(5), torch.randint(0, 4, (5,)))
    assert got.dtype in (torch.int32, torch.int64)


@pytest.mark.parametrize("op", [torch.maximum, torch.minimum, torch.fmax, torch.fmin])
def test_maximum_minimum_nan(op):
    a = torch.tensor([1.0, NAN, 3.0, NAN, -INF])
    b = torch.tensor([NAN, 2.0, 1.0, NAN, 0.0])
    check(op, a, b)
    check(op, real(3, 4), real(4))
    check(op, ints(3, 4), real(4))


def test_binary_float_specials():
    a, b = real(3, 4), real(3, 4)
    check(torch.atan2, a, b)
    check(torch.hypot, a, b)
    check(torch.copysign, a, b)
    check(lambda a: torch.copysign(a, -1.0), a)
    check(torch.nextafter, a, b)
    check(torch.xlogy, positive(3, 4), positive(3, 4))
    check(torch.logaddexp, a, b)
    check(torch.heaviside, a, b)
    check(torch.ldexp, a, ints(3, 4))
    check(torch.frexp, a * 100)
    check(torch.igamma, positive(3, 4), positive(3, 4), rtol=1e-5)
    check(torch.igammac, positive(3, 4), positive(3, 4), rtol=1e-5)
    check(torch.special.zeta, above_one(3, 4), positive(3, 4), rtol=1e-5)
    check(lambda q: torch.special.zeta(3.0, q), positive(3, 4), rtol=1e-5)


def test_gcd_lcm():
    check(torch.gcd, ints(3, 4, low=-30, high=30), ints(3, 4, low=-30, high=30))
    check(torch.lcm, ints(3, 4, low=-30, high=30), ints(3, 4, low=-30, high=30))


# --- comparisons, bitwise, logical ----------------------------------------------------------


@pytest.mark.parametrize("op", [torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge])
def test_comparisons(op):
    a = torch.randint(-2, 3, (3, 4)).float()
    check(op, a, torch.randint(-2, 3, (4,)).float())
    check(op, ints(3, 4, low=-2, high=3), torch.randint(-2, 3, (4,)).float())
    check(lambda x: op(x, 0.5), ints(3, 4, low=-2, high=3))
    check(lambda x: op(x, 1), a)
    check(op, torch.tensor([NAN, 1.0, INF]), torch.tensor([NAN, NAN, INF]))


@pytest.mark.parametrize("op", [torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor])
def test_bitwise(op):
    check(op, ints(3, 4, low=-50, high=50), ints(4, low=-50, high=50))
    check(op, real(3, 4) > 0, real(3, 4) > 0)
    check(lambda x: op(x, 6), ints(3, 4, low=-50, high=50))
    check(lambda x: op(x, True), real(3, 4) > 0)
    check(lambda x: op(5, x), ints(3, 4, low=-50, high=50))


def test_bitwise_not_and_shifts():
    x = ints(3, 4, low=-50, high=50)
    check(torch.bitwise_not, x)
    check(torch.bitwise_not, real(3, 4) > 0)
    check(lambda x, s: x << s, x, torch.randint(0, 5, (3, 4)))
    check(lambda x, s: x >> s, x, torch.randint(0, 5, (3, 4)))
    check(lambda x: torch.bitwise_left_shift(x, 3), x)
    check(lambda x: torch.bitwise_right_shift(x, 2), x)
    check(lambda s: torch.bitwise_left_shift(3, s), torch.randint(0, 5, (3, 4)))


@pytest.mark.parametrize("op", [torch.logical_and, torch.logical_or, torch.logical_xor])
def test_logical(op):
    a = torch.tensor([0.0, 1.0, NAN, -0.0, 2.0, 0.0])
    b = torch.tensor([0.0, 0.0, 0.0, 3.0, -1.0, NAN])
    check(op, a, b)
    check(op, ints(3, 4, low=-1, high=2), real(4) > 0)


# --- selection and clamping -----------------------------------------------------------------


def test_where():
    x, y = real(3, 4), real(4)
    check(lambda c, x, y: torch.where(c, x, y), x > 0, x, y)
    check(lambda c, x, y: torch.where(c, x, y), x > 0, ints(3, 4), y)
    check(lambda x: torch.where(x > 0.5, x, 0.0), x)
    check(lambda x: torch.where(x > 0, x, -1), ints(3, 4))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.clamp(x, -0.5, 0.5),
        lambda x: torch.clamp(x, min=0.1),
        lambda x: torch.clamp(x, max=0.1),
        lambda x: torch.clamp(x, 1.0, -1.0),  # min > max: everything becomes max
        lambda x: torch.clamp(x, min=NAN),
        lambda x: torch.clamp_min(x, 0.0),
        lambda x: torch.clamp_max(x, 0.0),
    ],
)
def test_clamp_scalar(fn):
    check(fn, torch.cat([real(10), torch.tensor([NAN, INF, -INF])]))


def test_clamp_int_and_tensor_bounds():
    check(lambda x: torch.clamp(x, -3, 4), ints(3, 4))
    check(lambda x: torch.clamp(x, -2.5, 4.5), ints(3, 4))
    x, lo, hi = real(3, 4), real(4) - 1, real(3, 1) + 1
    check(lambda x, lo, hi: torch.clamp(x, lo, hi), x, lo, hi)
    check(lambda x, lo: torch.clamp(x, min=lo), x, lo)
    check(lambda x, hi: torch.clamp(x, max=hi), x, hi)
    check(lambda x, lo: torch.clamp(x, min=lo), x, torch.tensor([NAN, 0.0, 0.0, 0.0]))


# --- copies, casts, fills -------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.int32, torch.int64, torch.bool, torch.bfloat16, torch.float16]
)
def test_to_copy(dtype):
    x = torch.cat([real(8) * 5, torch.tensor([0.0, -0.0, 2.5, -2.5])])
    check(lambda x: x.to(dtype) * 1, x, rtol=1e-2 if dtype.itemsize == 2 else 1.3e-6)
    check(lambda x: x.to(dtype) * 1, ints(6))


def test_clone_copy_fill():
    x, y = real(3, 4), real(4)
    check(lambda x: x.clone() + 1, x)
    check(lambda x, y: x.clone().copy_(y), x, y)  # src broadcast into self's shape
    check(lambda x, y: x.clone().copy_(y), ints(3, 4), y)  # and cast to self's dtype
    check(lambda x: x.clone().fill_(2.5), x)
    check(lambda x: torch.ops.aten.fill.Scalar(x, 7), ints(3, 4))
    check(lambda x: torch.ops.aten.fill.Tensor(x, x[0, 0]), x)
    check(lambda x: x * torch.tensor([1.0, 2.0, 3.0, 4.0]), x)  # lifted constant


# --- gradients ------------------------------------------------------------------------------


def _grad_parity(fn, *args, rtol=1e-5, atol=1e-5):
    """jax.grad of sum(converted fn) w.r.t. every input vs torch autograd."""
    module = Lambda(fn)
    converted = zerojax.convert(module, args)

    def loss(*xs):
        (out, _) = converted.apply(converted.params, converted.buffers, *xs)
        return jnp.sum(out.astype(jnp.float32))

    got = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*map(from_torch, args))
    leaves = [a.detach().clone().requires_grad_(True) for a in args]
    fn(*leaves).float().sum().backward()
    assert_close([a.grad for a in leaves], [to_torch(g) for g in got], rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "fn, make",
    [
        (torch.tanh, real),
        (torch.sigmoid, real),
        (torch.log, positive),
        (torch.sqrt, positive),
        (torch.rsqrt, positive),
        (torch.erf, real),
        (F.gelu, real),
        (lambda x: F.gelu(x, approximate="tanh"), real),
        (F.elu, lambda *s: real(*s) * 50),  # large inputs: no NaN from the masked branch
        (F.leaky_relu, real),
        (lambda x: x**3, real),
        (lambda x: torch.atan2(x, x.flip(0)), real),
        (torch.lgamma, positive),
    ],
)
def test_gradient_unary(fn, make):
    _grad_parity(fn, make(4, 5))


def test_gradient_kinks():
    """relu / hardtanh / clamp at exactly their kinks: torch's masks, not a 0.5 tie split."""
    x = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0, -0.5])
    _grad_parity(torch.relu, x)
    _grad_parity(F.hardtanh, x)
    _grad_parity(F.relu6, x)
    _grad_parity(lambda x: torch.clamp(x, 0.0, 1.0), x)


def test_gradient_binary():
    a, b = real(3, 4), positive(3, 4)
    _grad_parity(lambda a, b: a * b + a / b - torch.sub(a, b, alpha=2), a, b)
    _grad_parity(lambda a, b: torch.pow(b, a), a, b)
    _grad_parity(lambda a, b: torch.maximum(a, b) + torch.minimum(a, b), a, b)
    _grad_parity(lambda a, b: torch.where(a > 0, a, b), a, b)
    _grad_parity(lambda a, lo: torch.clamp(a, min=lo), a, real(4))
    _grad_parity(lambda a, b: torch.div(a, b, rounding_mode="floor") + a, a, b)
