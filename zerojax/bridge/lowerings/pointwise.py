"""Lowerings: pointwise ops (unary math, arithmetic, comparisons, bitwise/logical, activations).

Dtypes follow torch, not numpy: operands are promoted with `dtypes.result_type` (a Python scalar
or 0-d tensor does not widen a tensor; int tensor with float scalar gives the default float) and
float16/bfloat16 math runs in float32, as torch's CPU kernels do (their "opmath" type); the
interpreter rounds each result back to the dtype torch recorded. Ops whose result is always
floating (exp, true division, ...) compute integer and bool inputs in float32, torch's default.

Torch semantics that differ from jnp and are reproduced here: sign(NaN) == 0, clamp with a NaN
bound gives NaN, integer pow with a negative exponent truncates to 0 (or +-1), floor division of
floats uses torch's fmod-based formula, digamma(+-0) == -+inf, and gradients at kinks (relu,
clamp, hardtanh boundaries) follow torch's backward formulas rather than JAX's 0.5 tie split
(clamp's changed in torch 2.14: `_torch_clamp_gradient_at_bound` measures the installed one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import ml_dtypes
import numpy as np
import torch
from jax import lax

from zerojax.bridge.dtypes import is_bool, is_floating, is_integer, result_type
from zerojax.bridge.registry import lowering

aten = torch.ops.aten

_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_DEFAULT_FLOAT = np.dtype(np.float32)  # torch.get_default_dtype(): int -> float promotion


# --- promotion helpers --------------------------------------------------------------------------


def _opmath(dtype) -> np.dtype:
    """The dtype torch's CPU kernels do `dtype` math in: fp16/bf16 widen to float32."""
    dtype = np.dtype(dtype)
    return _DEFAULT_FLOAT if dtype in _HALF else dtype


def _promoted(*operands) -> list[jax.Array]:
    """Operands cast to torch's promoted dtype (fp16/bf16 widened to float32 for the math)."""
    dtype = _opmath(result_type(*operands))
    return [jnp.asarray(x, dtype) for x in operands]


def _floating(*operands) -> list[jax.Array]:
    """Operands cast for an op with a floating result: integer/bool promote to float32."""
    dtype = result_type(*operands)
    dtype = _opmath(dtype) if is_floating(dtype) else _DEFAULT_FLOAT
    return [jnp.asarray(x, dtype) for x in operands]


def _float_arg(x) -> jax.Array:
    return _floating(x)[0]


def _keeps_integers(x) -> bool:
    """Rounding ops (floor, round, ...) return integer and bool tensors unchanged."""
    return not is_floating(jnp.result_type(x))


# --- unary float math ---------------------------------------------------------------------------


@lowering(aten.acos.default)
def lower_acos(ctx, self):
    return jnp.arccos(_float_arg(self))


@lowering(aten.acosh.default)
def lower_acosh(ctx, self):
    return jnp.arccosh(_float_arg(self))


@lowering(aten.asin.default)
def lower_asin(ctx, self):
    return jnp.arcsin(_float_arg(self))


@lowering(aten.asinh.default)
def lower_asinh(ctx, self):
    return jnp.arcsinh(_float_arg(self))


@lowering(aten.atan.default)
def lower_atan(ctx, self):
    return jnp.arctan(_float_arg(self))


@lowering(aten.atanh.default)
def lower_atanh(ctx, self):
    return jnp.arctanh(_float_arg(self))


@lowering(aten.atan2.default, aten.atan2.out)
def lower_atan2(ctx, self, other, *, out=None):
    """atan2.out never carries a live `out` in a functional graph: same value as .default."""
    y, x = _floating(self, other)
    return jnp.arctan2(y, x)


@lowering(aten.cos.default)
def lower_cos(ctx, self):
    return jnp.cos(_float_arg(self))


@lowering(aten.cosh.default)
def lower_cosh(ctx, self):
    return jnp.cosh(_float_arg(self))


@lowering(aten.sin.default)
def lower_sin(ctx, self):
    return jnp.sin(_float_arg(self))


@lowering(aten.sinh.default)
def lower_sinh(ctx, self):
    return jnp.sinh(_float_arg(self))


@lowering(aten.tan.default)
def lower_tan(ctx, self):
    return jnp.tan(_float_arg(self))


@lowering(aten.tanh.default)
def lower_tanh(ctx, self):
    return jnp.tanh(_float_arg(self))


@lowering(aten.exp.default)
def lower_exp(ctx, self):
    return jnp.exp(_float_arg(self))


@lowering(aten.exp2.default)
def lower_exp2(ctx, self):
    return jnp.exp2(_float_arg(self))


@lowering(aten.expm1.default)
def lower_expm1(ctx, self):
    return jnp.expm1(_float_arg(self))


@lowering(aten.log.default)
def lower_log(ctx, self):
    return jnp.log(_float_arg(self))


@lowering(aten.log10.default)
def lower_log10(ctx, self):
    return jnp.log10(_float_arg(self))


@lowering(aten.log1p.default)
def lower_log1p(ctx, self):
    return jnp.log1p(_float_arg(self))


@lowering(aten.log2.default)
def lower_log2(ctx, self):
    return jnp.log2(_float_arg(self))


@lowering(aten.sqrt.default)
def lower_sqrt(ctx, self):
    return jnp.sqrt(_float_arg(self))


@lowering(aten.rsqrt.default)
def lower_rsqrt(ctx, self):
    return lax.rsqrt(_float_arg(self))


@lowering(aten.reciprocal.default)
def lower_reciprocal(ctx, self):
    return 1 / _float_arg(self)


@lowering(aten.sigmoid.default)
def lower_sigmoid(ctx, self):
    return jax.nn.sigmoid(_float_arg(self))


@lowering(aten.erf.default)
def lower_erf(ctx, self):
    return jss.erf(_float_arg(self))


@lowering(aten.erfc.default)
def lower_erfc(ctx, self):
    return jss.erfc(_float_arg(self))


@lowering(aten.erfinv.default)
def lower_erfinv(ctx, self):
    return jss.erfinv(_float_arg(self))


@lowering(aten.special_erfcx.default)
def lower_special_erfcx(ctx, self):
    return jss.erfcx(_float_arg(self))


@lowering(aten.special_ndtri.default)
def lower_special_ndtri(ctx, self):
    return jss.ndtri(_float_arg(self))


@lowering(aten.lgamma.default)
def lower_lgamma(ctx, self):
    return jss.gammaln(_float_arg(self))


def _digamma(x):
    # torch: digamma(+-0) = -+inf (the pole's one-sided limits); jax gives NaN there.
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jss.digamma(x))


@lowering(aten.digamma.default)
def lower_digamma(ctx, self):
    return _digamma(_float_arg(self))


@lowering(aten.polygamma.default)
def lower_polygamma(ctx, n, self):
    x = _float_arg(self)
    return _digamma(x) if n == 0 else _polygamma(n, x)


def _polygamma(n: int, x):
    """psi^(n)(x) for n >= 1, with torch's values at the poles (x = 0, -1, -2, ...).

    jax.scipy.special.polygamma loses accuracy for x < 0 (psi1(-8.5) = 6.79, not 9.76), so
    negative x goes through the reflection formula
    psi^(n)(x) = (-1)^n psi^(n)(1 - x) - pi d^n/dx^n cot(pi x).
    """
    reflect = x < 0
    mirrored = jss.polygamma(n, jnp.where(reflect, 1 - x, x))
    if n == 1:
        # torch's trigamma reflects with the unreduced sin(pi x): at negative integers it returns
        # a large finite value (pi^2 / sin(float32(pi) * x)^2), and +inf at 0.
        sin = jnp.sin(jnp.pi * jnp.where(reflect, x, 0.5))
        return jnp.where(reflect, jnp.pi**2 / (sin * sin) - mirrored, mirrored)
    # cot(pi x) has period 1; reducing x first keeps pi * x small and exact enough in float32.
    r = jnp.where(reflect, x - jnp.round(x), 0.25)
    # cos(pi r) written as sin(pi (1/2 - |r|)) is exactly 0 at r = +-1/2 (half-integer x).
    c = jnp.sin(jnp.pi * (0.5 - jnp.abs(r))) / jnp.sin(jnp.pi * r)
    # d^n/dx^n cot(pi x) = pi^n P_n(c) with P_0 = c and P_{k+1} = -(1 + c^2) P_k'(c).
    poly = np.array([1.0, 0.0])
    for _ in range(n):
        poly = np.polymul([-1.0, 0.0, -1.0], np.polyder(poly))
    cot = jnp.pi**n * jnp.polyval(jnp.asarray(poly, x.dtype), c)
    value = jnp.where(reflect, (-1) ** n * mirrored - jnp.pi * cot, mirrored)
    # torch computes n >= 2 as (-1)^(n+1) n! zeta(n+1, x), which is +-inf at the poles.
    pole = (x <= 0) & (x == jnp.floor(x))
    return jnp.where(pole, jnp.inf if n % 2 == 1 else -jnp.inf, value)


@lowering(aten.i0.default, aten.special_modified_bessel_i0.default)
def lower_i0(ctx, self):
    return jss.i0(_float_arg(self))


@lowering(aten.special_i0e.default)
def lower_special_i0e(ctx, self):
    return jss.i0e(_float_arg(self))


@lowering(aten.special_i1.default, aten.special_modified_bessel_i1.default)
def lower_special_i1(ctx, self):
    return jss.i1(_float_arg(self))


@lowering(aten.special_i1e.default)
def lower_special_i1e(ctx, self):
    return jss.i1e(_float_arg(self))


@lowering(aten.special_spherical_bessel_j0.default)
def lower_special_spherical_bessel_j0(ctx, self):
    """j0(x) = sin(x) / x, with its limit 1 at x == 0."""
    x = _float_arg(self)
    safe = jnp.where(x == 0, 1, x)
    return jnp.where(x == 0, 1, jnp.sin(safe) / safe)


@lowering(aten.igamma.default)
def lower_igamma(ctx, self, other):
    a, x = _floating(self, other)
    return jss.gammainc(a, x)


@lowering(aten.igammac.default)
def lower_igammac(ctx, self, other):
    a, x = _floating(self, other)
    return jss.gammaincc(a, x)


@lowering(aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar)
def lower_special_zeta(ctx, self, other):
    """Hurwitz zeta(self, other); either operand may be a Python scalar."""
    x, q = _floating(self, other)
    # torch (Cephes): NaN for x < 1, else +inf at the poles q = 0, -1, ...; jax differs there.
    pole = (q <= 0) & (q == jnp.floor(q))
    return jnp.where(x < 1, jnp.nan, jnp.where(pole, jnp.inf, jss.zeta(x, q)))


@lowering(aten.angle.default)
def lower_angle(ctx, self):
    """angle of a real tensor: pi where negative, 0 elsewhere (-0.0 included), NaN kept."""
    x = _float_arg(self)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0).astype(x.dtype))


# --- unary ops that keep the input dtype --------------------------------------------------------


@jax.custom_jvp
def torch_abs(x):
    """|x| of a real float with torch's derivative sgn(x): 0 at x = 0 (jax.grad(jnp.abs)(0.0)
    is 1, which gave an L1 loss or 1-norm a gradient at an exact match that torch does not)."""
    return jnp.abs(x)


@torch_abs.defjvp
def _torch_abs_jvp(primals, tangents):
    (x,), (tangent,) = primals, tangents
    # torch's sign: 0 at 0 and at NaN.
    sign = (x > 0).astype(tangent.dtype) - (x < 0).astype(tangent.dtype)
    return jnp.abs(x), sign * tangent


@lowering(aten.abs.default)
def lower_abs(ctx, self):
    if is_bool(self.dtype):
        return self
    return torch_abs(self) if is_floating(self.dtype) else jnp.abs(self)


@lowering(aten.neg.default)
def lower_neg(ctx, self):
    return jnp.negative(self)


@lowering(aten.sign.default)
def lower_sign(ctx, self):
    """sign, with torch's sign(NaN) == 0 (jnp.sign gives NaN); bool is returned unchanged."""
    if is_bool(self.dtype):
        return self
    return (self > 0).astype(self.dtype) - (self < 0).astype(self.dtype)


@lowering(aten.signbit.default)
def lower_signbit(ctx, self):
    if is_floating(self.dtype):
        return jnp.signbit(self)
    return self < 0 if is_integer(self.dtype) else jnp.zeros(self.shape, bool)


@lowering(aten.ceil.default)
def lower_ceil(ctx, self):
    return self if _keeps_integers(self) else jnp.ceil(self)


@lowering(aten.floor.default)
def lower_floor(ctx, self):
    return self if _keeps_integers(self) else jnp.floor(self)


@lowering(aten.trunc.default)
def lower_trunc(ctx, self):
    return self if _keeps_integers(self) else jnp.trunc(self)


@lowering(aten.round.default)
def lower_round(ctx, self):
    """Round half to even, like torch (std::nearbyint) and jnp.round."""
    return self if _keeps_integers(self) else jnp.round(_float_arg(self))


@lowering(aten.round.decimals)
def lower_round_decimals(ctx, self, *, decimals):
    """torch scales by 10**|decimals|, rounds half to even, then scales back."""
    if _keeps_integers(self):
        return self
    x = _float_arg(self)
    if decimals == 0:
        return jnp.round(x)
    scale = jnp.asarray(10.0 ** abs(decimals), x.dtype)
    if decimals > 0:
        return jnp.round(x * scale) / scale
    return jnp.round(x / scale) * scale


@lowering(aten.isinf.default)
def lower_isinf(ctx, self):
    return jnp.isinf(self)


@lowering(aten.isnan.default)
def lower_isnan(ctx, self):
    return jnp.isnan(self)


@lowering(aten.frexp.Tensor)
def lower_frexp_tensor(ctx, self):
    """(mantissa in [0.5, 1), int32 exponent) with self == mantissa * 2**exponent."""
    mantissa, exponent = jnp.frexp(_float_arg(self))
    return mantissa, exponent.astype(jnp.int32)


# --- activations --------------------------------------------------------------------------------


@jax.custom_vjp
def _relu(x):
    """max(x, 0) with torch's gradient: the incoming one where x is not <= 0 (NaN included),
    zero elsewhere (at 0 too; jnp.maximum's own splits it 0.5 / 0.5). jax.nn.relu's derivative
    selects between the gradient and a zeros array that, depending on no gradient, autodiff
    computes in the forward: on the general path a forward program output the size of every
    ReLU's input, written and kept for the backward (ResNet-18: 6 MB of its 23 MB of
    residuals; bench/cnn_step.py's step, interleaved A/B: 118.3 -> 115.3 ms). Here the
    backward makes its zeros, and the forward keeps a boolean mask."""
    return jnp.maximum(x, 0)


def _relu_forward(x):
    return jnp.maximum(x, 0), jnp.logical_not(x <= 0)


def _relu_backward(passes, grad):
    return (jnp.where(passes, grad, jnp.zeros((), grad.dtype)),)


_relu.defvjp(_relu_forward, _relu_backward)


@lowering(aten.relu.default)
def lower_relu(ctx, self):
    return _relu(self) if is_floating(self.dtype) else jnp.maximum(self, 0)


@lowering(aten.gelu.default)
def lower_gelu(ctx, self, *, approximate="none"):
    """approximate='none': x * Phi(x) with the exact erf; 'tanh': the tanh approximation."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return jax.nn.gelu(_float_arg(self), approximate=approximate == "tanh")


@lowering(aten.elu.default)
def lower_elu(ctx, self, alpha=1, scale=1, input_scale=1):
    """x > 0 ? scale * x : alpha * scale * (exp(input_scale * x) - 1)."""
    x = _float_arg(self)
    # expm1 only sees non-positive values, so the unselected branch cannot overflow to inf and
    # turn the masked gradient into NaN.
    negative = jnp.expm1(jnp.where(x > 0, 0, x) * input_scale) * (alpha * scale)
    return jnp.where(x > 0, x * scale, negative)


@lowering(aten.hardtanh.default)
def lower_hardtanh(ctx, self, min_val=-1, max_val=1):
    """clamp to [min_val, max_val]; the gradient is zero at the bounds, as torch's backward."""
    (x,) = _promoted(self)
    return jnp.where(x <= min_val, min_val, jnp.where(x >= max_val, max_val, x)).astype(x.dtype)


@lowering(aten.leaky_relu.default)
def lower_leaky_relu(ctx, self, negative_slope=0.01):
    (x,) = _promoted(self)
    return jnp.where(x > 0, x, x * negative_slope)


# --- arithmetic ---------------------------------------------------------------------------------


def _is_one(alpha) -> bool:
    """Whether `alpha` is the constant 1 (a traced scalar, `zerojax.bridge.eager`, is not)."""
    return isinstance(alpha, (bool, int, float)) and alpha == 1


@lowering(aten.add.Tensor, aten.add.Scalar)
def lower_add(ctx, self, other, alpha=1):
    """self + alpha * other (bool + bool is logical or)."""
    a, b = _promoted(self, other)
    return a + (b if _is_one(alpha) else b * jnp.asarray(alpha, b.dtype))


@lowering(aten.sub.Tensor, aten.sub.Scalar)
def lower_sub(ctx, self, other, alpha=1):
    """self - alpha * other."""
    a, b = _promoted(self, other)
    return a - (b if _is_one(alpha) else b * jnp.asarray(alpha, b.dtype))


@lowering(aten.mul.Tensor, aten.mul.Scalar)
def lower_mul(ctx, self, other):
    a, b = _promoted(self, other)
    return a * b


@lowering(aten.lerp.Scalar, aten.lerp.Tensor)
def lower_lerp(ctx, self, end, weight):
    """torch's CPU kernel: coeff * (end - self) + base, with (coeff, base) = (weight, self) for
    |weight| < 0.5 and (weight - 1, end) otherwise, so weight 1 gives `end` exactly.
    (Captured graphs decompose lerp; this serves live tensors: EMAs, optimizer moments.)"""
    start, end, weight = _promoted(self, end, weight)
    small = jnp.abs(weight) < 0.5
    return jnp.where(small, weight, weight - 1) * (end - start) + jnp.where(small, start, end)


@lowering(aten.addcmul.default)
def lower_addcmul(ctx, self, tensor1, tensor2, *, value=1):
    """self + value * tensor1 * tensor2, multiplied left to right as torch's CPU kernel does."""
    a, t1, t2 = _promoted(self, tensor1, tensor2)
    return a + jnp.asarray(value, t1.dtype) * t1 * t2


@lowering(aten.addcdiv.default)
def lower_addcdiv(ctx, self, tensor1, tensor2, *, value=1):
    """self + value * tensor1 / tensor2, left to right as torch's CPU kernel does."""
    a, t1, t2 = _floating(self, tensor1, tensor2)
    return a + jnp.asarray(value, t1.dtype) * t1 / t2


@lowering(aten.div.Tensor, aten.div.Scalar)
def lower_div(ctx, self, other):
    """True division; integer operands divide as floats (int / int -> float32)."""
    a, b = _floating(self, other)
    return a / b


@lowering(aten.div.Tensor_mode, aten.div.Scalar_mode)
def lower_div_mode(ctx, self, other, *, rounding_mode=None):
    """Division rounded per `rounding_mode`: None (true division), 'trunc' or 'floor'."""
    if rounding_mode is None:
        return lower_div(ctx, self, other)
    if rounding_mode not in ("trunc", "floor"):
        raise ValueError(
            f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}"
        )
    # lax.div/lax.rem (here and in _floor_divide_float) do not broadcast.
    a, b = jnp.broadcast_arrays(*_promoted(self, other))
    if not is_floating(a.dtype):
        # lax.div truncates toward zero; jnp.floor_divide rounds toward -inf (Python's //).
        return lax.div(a, b) if rounding_mode == "trunc" else jnp.floor_divide(a, b)
    quotient = jnp.trunc(a / b) if rounding_mode == "trunc" else _floor_divide_float(a, b)
    # torch defines a zero gradient for rounded division.
    return lax.stop_gradient(quotient)


def _floor_divide_float(a, b):
    """torch's div_floor_floating: the floor of the exact quotient, computed via fmod."""
    mod = lax.rem(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floor = jnp.floor(div)
    floor = jnp.where(div - floor > 0.5, floor + 1, floor)
    quotient = jnp.where(div != 0, floor, jnp.copysign(jnp.zeros_like(div), a / b))
    return jnp.where(b == 0, a / b, quotient)


@lowering(aten.fmod.Tensor, aten.fmod.Scalar)
def lower_fmod(ctx, self, other):
    """C fmod: the remainder has the sign of the dividend."""
    a, b = jnp.broadcast_arrays(*_promoted(self, other))  # lax.rem does not broadcast
    return lax.rem(a, b)


@lowering(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def lower_remainder(ctx, self, other):
    """Python-style modulo: the remainder has the sign of the divisor."""
    a, b = _promoted(self, other)
    return jnp.remainder(a, b)


@lowering(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def lower_pow(ctx, self, exponent):
    """self ** exponent elementwise; pow.Scalar has a Python scalar base."""
    base, exponent = _promoted(self, exponent)
    if is_integer(base.dtype):
        return _integer_pow(base, exponent)
    return jnp.power(base, exponent)


def _integer_pow(base, exponent):
    # torch truncates integer powers with negative exponents: 1/base**n is 0 unless |base| == 1.
    positive = jnp.power(base, jnp.maximum(exponent, 0))
    odd = (exponent % 2) != 0
    tiny = jnp.where(base == 1, 1, jnp.where(base == -1, jnp.where(odd, -1, 1), 0))
    return jnp.where(exponent < 0, tiny.astype(base.dtype), positive)


@lowering(aten.pow.Tensor_Scalar)
def lower_pow_tensor_scalar(ctx, self, exponent):
    """self ** exponent for a Python scalar exponent; torch special-cases small ones."""
    base = _promoted(self, exponent)[0]
    if is_integer(base.dtype):
        if exponent < 0:
            return _integer_pow(base, jnp.asarray(exponent, base.dtype))
        return lax.integer_pow(base, int(exponent))
    if float(exponent).is_integer() and abs(exponent) <= 32:
        # Repeated multiplication, as torch does for 2, 3, -1, -2 (exact, and x**0 == 1 for NaN).
        return lax.integer_pow(base, int(exponent))
    if exponent == 0.5:
        return jnp.sqrt(base)
    if exponent == -0.5:
        return lax.rsqrt(base)
    return jnp.power(base, jnp.asarray(exponent, base.dtype))


@lowering(aten.maximum.default)
def lower_maximum(ctx, self, other):
    """Elementwise max; NaN in either operand gives NaN."""
    a, b = _promoted(self, other)
    return jnp.maximum(a, b)


@lowering(aten.minimum.default)
def lower_minimum(ctx, self, other):
    """Elementwise min; NaN in either operand gives NaN."""
    a, b = _promoted(self, other)
    return jnp.minimum(a, b)


@lowering(aten.fmax.default)
def lower_fmax(ctx, self, other):
    """Elementwise max ignoring NaN (NaN only where both are NaN)."""
    a, b = _promoted(self, other)
    return jnp.fmax(a, b)


@lowering(aten.fmin.default)
def lower_fmin(ctx, self, other):
    """Elementwise min ignoring NaN (NaN only where both are NaN)."""
    a, b = _promoted(self, other)
    return jnp.fmin(a, b)


@lowering(aten.hypot.default)
def lower_hypot(ctx, self, other):
    a, b = _floating(self, other)
    return jnp.hypot(a, b)


@lowering(aten.copysign.Tensor, aten.copysign.Scalar)
def lower_copysign(ctx, self, other):
    a, b = _floating(self, other)
    return jnp.copysign(a, b)


@lowering(aten.nextafter.default)
def lower_nextafter(ctx, self, other):
    # No opmath widening: the next representable value is a property of the dtype itself.
    dtype = result_type(self, other)
    return jnp.nextafter(jnp.asarray(self, dtype), jnp.asarray(other, dtype))


@lowering(aten.ldexp.Tensor)
def lower_ldexp_tensor(ctx, self, other):
    """self * 2**other."""
    if is_integer(jnp.result_type(other)) or is_bool(jnp.result_type(other)):
        (x,) = _floating(self)
        # Exact scaling by a power of two for integer exponents (what torch's pow(2, n) gives).
        return jnp.ldexp(x, other.astype(jnp.int32))
    x, exponent = _floating(self, other)
    return x * jnp.power(jnp.asarray(2, x.dtype), exponent)


@lowering(aten.gcd.default)
def lower_gcd(ctx, self, other):
    a, b = _promoted(self, other)
    return jnp.gcd(a, b)


@lowering(aten.lcm.default)
def lower_lcm(ctx, self, other):
    a, b = _promoted(self, other)
    return jnp.lcm(a, b)


# --- comparisons --------------------------------------------------------------------------------


@lowering(aten.eq.Tensor, aten.eq.Scalar)
def lower_eq(ctx, self, other):
    a, b = _promoted(self, other)
    return a == b


@lowering(aten.ne.Tensor, aten.ne.Scalar)
def lower_ne(ctx, self, other):
    a, b = _promoted(self, other)
    return a != b


@lowering(aten.lt.Tensor, aten.lt.Scalar)
def lower_lt(ctx, self, other):
    a, b = _promoted(self, other)
    return a < b


@lowering(aten.le.Tensor, aten.le.Scalar)
def lower_le(ctx, self, other):
    a, b = _promoted(self, other)
    return a <= b


@lowering(aten.gt.Tensor, aten.gt.Scalar)
def lower_gt(ctx, self, other):
    a, b = _promoted(self, other)
    return a > b


@lowering(aten.ge.Tensor, aten.ge.Scalar)
def lower_ge(ctx, self, other):
    a, b = _promoted(self, other)
    return a >= b


# --- bitwise and logical ------------------------------------------------------------------------


@lowering(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_and.Scalar_Tensor)
def lower_bitwise_and(ctx, self, other):
    a, b = _promoted(self, other)
    return jnp.bitwise_and(a, b)


@lowering(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, aten.bitwise_or.Scalar_Tensor)
def lower_bitwise_or(ctx, self, other):
    a, b = _promoted(self, other)
    return jnp.bitwise_or(a, b)


@lowering(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.bitwise_xor.Scalar_Tensor)
def lower_bitwise_xor(ctx, self, other):
    a, b = _promoted(self, other)
    return jnp.bitwise_xor(a, b)


@lowering(aten.bitwise_not.default)
def lower_bitwise_not(ctx, self):
    """~x; logical not for bool."""
    return jnp.bitwise_not(self)


@lowering(
    aten.bitwise_left_shift.Tensor,
    aten.bitwise_left_shift.Tensor_Scalar,
    aten.bitwise_left_shift.Scalar_Tensor,
    aten.__lshift__.Tensor,
    aten.__lshift__.Scalar,
)
def lower_bitwise_left_shift(ctx, self, other):
    """self << other; shifting by the bit width or more gives 0, as in torch."""
    a, b = _promoted(self, other)
    return jnp.left_shift(a, b)


@lowering(
    aten.bitwise_right_shift.Tensor,
    aten.bitwise_right_shift.Tensor_Scalar,
    aten.bitwise_right_shift.Scalar_Tensor,
    aten.__rshift__.Tensor,
    aten.__rshift__.Scalar,
)
def lower_bitwise_right_shift(ctx, self, other):
    """Arithmetic self >> other for signed integers (sign fill past the bit width)."""
    a, b = _promoted(self, other)
    return jnp.right_shift(a, b)


@lowering(aten.logical_and.default)
def lower_logical_and(ctx, self, other):
    # Any nonzero value (NaN included) is true.
    return self.astype(bool) & other.astype(bool)


@lowering(aten.logical_or.default)
def lower_logical_or(ctx, self, other):
    return self.astype(bool) | other.astype(bool)


@lowering(aten.logical_xor.default)
def lower_logical_xor(ctx, self, other):
    return self.astype(bool) ^ other.astype(bool)


@lowering(aten.logical_not.default)
def lower_logical_not(ctx, self):
    return ~self.astype(bool)


# --- selection and clamping ---------------------------------------------------------------------


@lowering(aten.where.self)
def lower_where_self(ctx, condition, self, other):
    a, b = _promoted(self, other)
    return jnp.where(condition.astype(bool), a, b)


def _torch_clamp_gradient_at_bound() -> tuple[float, float]:
    """The gradient torch's clamp backward gives x where x equals a bound: (Python-scalar
    bounds, tensor bounds). Measured, not looked up by version, since the contract changed:
    torch 2.13 gives (1, 1), all of it to x (masks with >= / <=); torch 2.14 gives (0, 0.5),
    none for a scalar bound (as hardtanh) and a tie split with a tensor bound (as maximum).

    Measured once, at import: a lowering can run inside a torch dispatch mode (live tensors,
    train/live_tensor.py), below autograd, where a backward cannot run."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros(1, requires_grad=True)
        torch.clamp(x, 0.0, 1.0).sum().backward()
        scalar = float(x.grad[0])
        x = torch.zeros(1, requires_grad=True)
        torch.clamp(x, torch.zeros(1), torch.ones(1)).sum().backward()
        tensor = float(x.grad[0])
    return scalar, tensor


_CLAMP_TIE_GRADIENT = _torch_clamp_gradient_at_bound()


def _clamp(x, lower, upper, *, tie_gradient):
    """min(max(x, lower), upper) with torch's NaN and gradient rules.

    A NaN bound gives NaN. Where x equals a bound its gradient is `tie_gradient`, what torch's
    clamp backward gives (`_torch_clamp_gradient_at_bound`): 1 (all to x, where jnp.clip would
    split it with the bound), 0 (none: the bound wins the tie) or 0.5 (the even split of
    lax.max / lax.min's derivative).
    """
    if tie_gradient not in (0.0, 0.5, 1.0):
        raise NotImplementedError(
            f"torch's clamp backward gives {tie_gradient} at a bound; zerojax reproduces 1, 0 "
            "or 0.5 (zerojax/bridge/lowerings/pointwise.py, _clamp)"
        )
    operands = [b for b in (lower, upper) if b is not None]
    x, *bounds = _promoted(x, *operands)
    if lower is not None:
        lower = bounds.pop(0)
        if tie_gradient == 0.5:
            x = jnp.where(jnp.isnan(lower), lower, jnp.maximum(x, lower))
        else:
            below = x <= lower if tie_gradient == 0.0 else x < lower
            x = jnp.where(below | jnp.isnan(lower), lower, x)
    if upper is not None:
        upper = bounds.pop(0)
        if tie_gradient == 0.5:
            x = jnp.where(jnp.isnan(upper), upper, jnp.minimum(x, upper))
        else:
            above = x >= upper if tie_gradient == 0.0 else x > upper
            x = jnp.where(above | jnp.isnan(upper), upper, x)
    return x


@lowering(aten.clamp.default)
def lower_clamp(ctx, self, min=None, max=None):
    """clamp to optional Python-scalar bounds; with min > max every value becomes max."""
    return _clamp(self, min, max, tie_gradient=_CLAMP_TIE_GRADIENT[0])


@lowering(aten.clamp.Tensor)
def lower_clamp_tensor(ctx, self, min=None, max=None):
    """clamp to optional tensor bounds, broadcast against self."""
    return _clamp(self, min, max, tie_gradient=_CLAMP_TIE_GRADIENT[1])


# --- copies, casts and fills --------------------------------------------------------------------


@lowering(aten._to_copy.default)
def lower_to_copy(ctx, self, *, dtype=None):
    """A cast to `dtype` (None keeps self's dtype); device and layout mean nothing here."""
    return self if dtype is None else self.astype(ctx.jax_dtype(dtype))


@lowering(aten.clone.default)
def lower_clone(ctx, self):
    return self


@lowering(aten.lift_fresh_copy.default)
def lower_lift_fresh_copy(ctx, self):
    return self


@lowering(aten.copy.default)
def lower_copy(ctx, self, src):
    """The functional copy_: src broadcast to self's shape and cast to self's dtype."""
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


@lowering(aten.fill.Scalar)
def lower_fill_scalar(ctx, self, value):
    return lax.full(self.shape, value, self.dtype)


@lowering(aten.fill.Tensor)
def lower_fill_tensor(ctx, self, value):
    """self's shape and dtype filled with the 0-d tensor `value` (differentiable in value)."""
    return jnp.broadcast_to(value.astype(self.dtype), self.shape)


# --- complex numbers (torch.fft's inverse transforms go through these) ------------------------


@lowering(aten._conj.default, aten.conj_physical.default, aten._conj_physical.default)
def lower_conj(ctx, self):
    """Complex conjugate; the identity on real tensors."""
    return jnp.conj(self) if jnp.iscomplexobj(self) else self


@lowering(aten.complex.default)
def lower_complex(ctx, real, imag):
    return jax.lax.complex(real, imag)


@lowering(aten.view_as_real.default)
def lower_view_as_real(ctx, self):
    """(..., 2) float tensor of real and imaginary parts."""
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@lowering(aten.view_as_complex.default)
def lower_view_as_complex(ctx, self):
    return jax.lax.complex(self[..., 0], self[..., 1])


@lowering(aten.polar.default)
def lower_polar(ctx, abs, angle):
    """abs * exp(i * angle), complex of abs's float dtype."""
    return lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle))
