"""Comparison tolerances derived from floating-point precision, shared by the tests.

Why: a tolerance fitted to what one CPU happens to produce turns red on another CPU (a different
ISA changes XLA's and oneDNN's summation order and which kernels round where). Every tolerance in
the suite is one of the bounds below, with the reason in a comment where it is used.

Notation (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 2-4):

* `eps(dtype)`: the spacing of the dtype's floats at 1.0, i.e. one ulp relative to the value:
  float32 2^-23, bfloat16 2^-7 (8 significand bits), float16 2^-10.
* `unit_roundoff(dtype)` u = eps / 2: the largest relative error of one round-to-nearest.
* A sum of n terms accumulated in a dtype, in any order, is within (n - 1) u sum|x_i| of the
  exact sum (to first order; Higham (4.4)); two different orders therefore differ by at most
  2 (n - 1) u sum|x_i|. A dot product / contraction of length K is such a sum of K products.
* A value rounded r times on its way (each intermediate rounded to the dtype, each intermediate
  at most M in magnitude) is within r u M of the exactly computed value.
"""

from __future__ import annotations

import math
from copy import deepcopy

import numpy as np
import torch

_EPS = {
    "float64": 2.0**-52,
    "float32": 2.0**-23,
    "bfloat16": 2.0**-7,
    "float16": 2.0**-10,
}


def _name(dtype) -> str:
    """'float32', 'bfloat16', ... for a torch, numpy or jax dtype (or its name)."""
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    return np.dtype(dtype).name


def eps(dtype) -> float:
    """One ulp relative to the value: the spacing of `dtype`'s floats at 1.0."""
    name = _name(dtype)
    if name not in _EPS:
        raise ValueError(f"no float precision known for dtype {name!r}; known: {sorted(_EPS)}")
    return _EPS[name]


def unit_roundoff(dtype) -> float:
    """The largest relative error of rounding a real number to `dtype` (round to nearest)."""
    return eps(dtype) / 2


def ulps(dtype, count: float = 1) -> float:
    """`count` ulps as a relative tolerance: two values that are each a correct rounding of
    (nearly) the same real number differ by at most one ulp, i.e. eps |value|."""
    return count * eps(dtype)


def reordered_sum(dtype, terms: int, abs_sum: float) -> float:
    """Largest difference between two evaluations of one `terms`-term sum accumulated in `dtype`
    in different orders, where `abs_sum` bounds sum |x_i|: each is within (n - 1) u sum|x_i| of
    the exact sum, so they differ by <= 2 (n - 1) u sum|x_i|."""
    return 2 * max(terms - 1, 0) * unit_roundoff(dtype) * abs_sum


def rounded_intermediates(dtype, roundings: int, magnitude) -> float:
    """Largest error of a result computed through `roundings` roundings to `dtype` of
    intermediates bounded by `magnitude` in absolute value (each adds <= u |intermediate|).
    `magnitude` may be an array (an elementwise bound)."""
    return roundings * unit_roundoff(dtype) * magnitude


def adam_step_bound(step: int, beta1: float, beta2: float) -> float:
    """Largest |m_hat / sqrt(v_hat)| Adam can reach at `step` (1-based), for ANY gradients.

    m_hat = sum_s a_s g_s and v_hat = sum_s b_s g_s^2 with the bias-corrected EMA weights
    a_s = (1 - beta1) beta1^(t-s) / (1 - beta1^t), b_s = (1 - beta2) beta2^(t-s) / (1 - beta2^t);
    by Cauchy-Schwarz |m_hat| <= sqrt(sum_s a_s^2 / b_s) sqrt(v_hat). At step 1 this is 1 (a
    sign step); it grows with t when (1 - beta1)^2 > (1 - beta2) (Kingma & Ba, section 2.1).
    So Adam moves a parameter by at most lr * bound per step, whatever the gradient's size: a
    gradient that is pure rounding noise still moves it by up to that much, in the noise's sign.
    """
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    total = 0.0
    for s in range(1, step + 1):
        a = (1 - beta1) * beta1 ** (step - s) / (1 - beta1**step)
        b = (1 - beta2) * beta2 ** (step - s) / (1 - beta2**step)
        total += a * a / b
    return math.sqrt(total)


def absolute(module: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of `module` with every parameter and buffer replaced by its absolute
    value: run on |inputs|, it gives S = op(|inputs|), which bounds every partial sum and
    intermediate of a contraction (matmul, conv) at each output element."""
    copy = deepcopy(module).double()
    with torch.no_grad():
        for tensor in [*copy.parameters(), *copy.buffers()]:
            if tensor.is_floating_point():
                tensor.abs_()
    return copy


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound, what: str = "") -> None:
    """|got - expected| <= bound elementwise (`bound` a number or a tensor broadcastable to
    them), compared in float64, NaN equal to NaN; names the worst element on failure."""
    assert tuple(got.shape) == tuple(expected.shape), (
        f"{what}: shape {got.shape} vs {expected.shape}"
    )
    got, expected = got.double(), expected.double()
    error = (got - expected).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(error)
    # Equal values (infinities too) and NaN in both (torch.testing's equal_nan) agree whatever
    # the bound (which is NaN where an input is NaN or infinite).
    bad = ~((got == expected) | (got.isnan() & expected.isnan()) | (error <= bound))
    if bad.any():
        worst = int(torch.where(bad, error.nan_to_num(nan=float("inf")), -1.0).argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of bound; worst "
            f"|got - expected| = {float(error.flatten()[worst]):.3g} at flat index {worst}, "
            f"bound {float(bound.flatten()[worst]):.3g} (got {float(got.flatten()[worst]):.6g}, "
            f"expected {float(expected.flatten()[worst]):.6g})"
        )


# Accuracy assumed of one library's float32 elementary function (exp, log, tanh, erf, rsqrt,
# ...), in ulps of the result: torch's CPU kernels use Sleef's u10 (1.0 ulp) and u20 (2.0 ulps)
# variants (exp_u20 in the CPU flash-attention kernel) and glibc (1-2 ulps); XLA:CPU uses its
# own polynomial approximations. Measured against float64 on 2^20 random points per function,
# with default and --xla_cpu_max_isa=AVX2 codegen alike: XLA exp 1.0, log 1.06, rsqrt 1.0,
# logistic 1.9, log1p 2.5, tanh 4.4, erf 5.4, expm1 5.7 ulps; torch <= 1.9 ulps. So each side is
# within LIBM_ULPS ulps, and two libraries' results of one function within 2 * LIBM_ULPS.
LIBM_ULPS = 6


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    weights_dtype=torch.float32,
    out_dtype=torch.float32,
) -> torch.Tensor:
    """Elementwise bound on |o1 - o2| between two evaluations of scaled dot-product attention
    o = softmax(q k^T scale + mask) v, each accumulating in float32 with exact (already rounded)
    inputs, rounding the softmax weights to `weights_dtype` before P @ V and the output to
    `out_dtype`. q [..., L, d], k [..., S, d], v [..., S, dv] (kv heads already repeated).

    Per side, to first order (u = float32 unit roundoff, e = exact weights, p = normalized):
    * score s_ij: a d-term dot, the scale multiply and the mask add, |ds_ij| <= (d + 2) u A_ij
      with A = |q| |k|^T scale + |mask|;
    * weight e_ij = exp(s_ij - m_i) has relative error eta_ij <= |ds_ij| + u |s_ij - m_i|
      (the rounded subtraction) + LIBM_ULPS ulps (exp);
    * o_i = sum_j e_ij v_j / sum_j e_ij: the numerator is within sum_j e_ij |v_j| (eta_ij +
      (S + 1) u + u_w) (product and S-term sum, weight rounding u_w), the denominator within
      sum_j e_ij (eta_ij + S u), the division adds u |o_i| and the output rounding u_out |o_i|.
    Two evaluations differ by at most twice that. Fully masked rows (torch gives 0) bound 0.
    """
    q, k, v = (t.detach().double() for t in (q, k, v))
    u = unit_roundoff(torch.float32)
    d, num_keys = q.shape[-1], k.shape[-2]
    scale = d**-0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    a = q.abs() @ k.abs().transpose(-1, -2) * scale
    allowed = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    allowed = allowed.expand_as(s)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask.expand_as(s)
        else:
            s = s + mask.double()
            a = a + mask.double().abs()
            allowed = allowed & torch.isfinite(mask).expand_as(s)
    s = s.masked_fill(~allowed, -torch.inf)
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    p = torch.exp(s - m).nan_to_num(0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    eta = (d + 2) * u * a + u * (s - m).abs() + LIBM_ULPS * eps(torch.float32)
    eta = eta.masked_fill(~allowed, 0.0)
    o = p @ v
    u_w = unit_roundoff(weights_dtype) if weights_dtype != torch.float32 else 0.0
    numerator = (p * (eta + (num_keys + 1) * u + u_w)) @ v.abs()
    denominator = (p * (eta + num_keys * u)).sum(-1, keepdim=True) * o.abs()
    u_out = unit_roundoff(out_dtype) if out_dtype != torch.float32 else 0.0
    per_side = numerator + denominator + (u + u_out) * o.abs()
    return 2 * per_side
