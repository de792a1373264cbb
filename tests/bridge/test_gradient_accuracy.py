"""Gradient accuracy of reductions, scans and softmax against float64, relative to torch fp32.

Run: .venv/bin/python -m pytest -q tests/bridge/test_gradient_accuracy.py -p no:cacheprovider
Table: .venv/bin/python -m tests.bridge.test_gradient_accuracy (prints zerojax's and torch's
normwise gradient error against float64 for every case).

Why (issue 25): zerojax's gradients come from JAX autodiff of each op's lowering, which may
evaluate a different formula from torch's hand-written backward and round worse (e.g. the terms
of a variance's gradient that cancel only in their sum). Each case draws a float32 input and a
float32 cotangent c, and compares the gradient of sum(fn(x) * c) from zerojax (float32) and torch
(float32) with torch's in float64 on the same values; zerojax's normwise error must be within
tolerances.TORCH_ERROR_FACTOR of torch's own (tests/tolerances.py derives the factor).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zerojax
from tests import tolerances
from tests.bridge.parity import Lambda, run_both
from zerojax.bridge.dtypes import from_torch

F32 = torch.float32


def gradients(fn, x: torch.Tensor, cotangent: torch.Tensor):
    """(float64 torch, float32 torch, float32 zerojax) gradients of sum(fn(x) * cotangent) with
    respect to the float32 input `x`, all as float64 tensors."""

    def torch_grad(dtype):
        leaf = x.detach().to(dtype).requires_grad_()
        (out := fn(leaf)).backward(cotangent.to(out.dtype))
        return leaf.grad.double()

    converted = zerojax.convert(Lambda(fn), (x.detach(),))
    c = from_torch(cotangent)

    def loss(value):
        out, _ = converted.apply(converted.params, converted.buffers, value)
        return jnp.sum(out * c.astype(out.dtype))

    ours = jax.jit(jax.grad(loss))(from_torch(x.detach()))
    ours = torch.from_numpy(np.asarray(ours, np.float64))
    return torch_grad(torch.float64), torch_grad(F32), ours


def gradient_errors(fn, x: torch.Tensor, seed: int = 0) -> tuple[float, float]:
    """(zerojax, torch fp32) normwise relative gradient error against float64 for one draw of a
    randn cotangent (float32 values, so every side weights by the same numbers)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        shape = fn(x.detach()).shape
    cotangent = torch.randn(shape, generator=generator, dtype=F32)
    exact, theirs, ours = gradients(fn, x, cotangent)
    scale = max(float(exact.norm()), np.finfo(np.float64).tiny)
    return float((ours - exact).norm()) / scale, float((theirs - exact).norm()) / scale


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F32)


def _norm(ord, dim=None):
    return lambda x: torch.linalg.vector_norm(x, ord=ord, dim=dim)


# (name, fn, shape): long reduction dims (4096+) are where cancellation in a gradient shows.
CASES = [
    ("var dim=-1", lambda x: x.var(-1), (8, 4096)),
    ("var all", lambda x: x.var(), (16384,)),
    ("var offset mean", lambda x: (x + 30).var(-1), (8, 4096)),
    ("var correction=0", lambda x: x.var(0, correction=0), (4096, 8)),
    ("var_mean", lambda x: sum(torch.var_mean(x, -1)), (8, 4096)),
    ("std dim=-1", lambda x: x.std(-1), (8, 4096)),
    ("std short", lambda x: x.std(-1), (64, 16)),
    ("log_softmax", lambda x: x.log_softmax(-1), (8, 4096)),
    ("log_softmax x8", lambda x: (8 * x).log_softmax(-1), (8, 4096)),
    ("softmax", lambda x: x.softmax(-1), (8, 4096)),
    ("softmax x8", lambda x: (8 * x).softmax(-1), (8, 4096)),
    ("logsumexp", lambda x: x.logsumexp(-1), (8, 4096)),
    ("norm 2", _norm(2, -1), (8, 4096)),
    ("norm 2 all", _norm(2), (16384,)),
    ("norm 1", _norm(1, -1), (8, 4096)),
    ("norm 3", _norm(3, -1), (8, 4096)),
    ("norm 0.5", _norm(0.5, -1), (8, 4096)),
    ("norm inf", _norm(float("inf"), -1), (8, 4096)),
    ("cumsum", lambda x: x.cumsum(-1), (8, 4096)),
    ("cumsum dim0", lambda x: x.cumsum(0), (4096, 8)),
    ("cumprod", lambda x: x.cumprod(-1), (64, 16)),
    ("cumprod ~1", lambda x: (1 + x / 64).cumprod(-1), (8, 4096)),
    ("logcumsumexp", lambda x: x.logcumsumexp(-1), (8, 4096)),
    ("logcumsumexp x8", lambda x: (8 * x).logcumsumexp(-1), (8, 4096)),
]


# Without the fixes in reduction.py these fail: the cumsum cases (autodiff's float32 reverse
# scan: 4-7x torch's error); logsumexp decomposed by capture (its amax shift differentiated:
# 3-14x); with jax's abs derivative (1 at 0) norm 1/inf/-inf/-1 and 0.5 at zero below (checked
# by reverting each fix).
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "name, fn, shape",
    CASES,
    ids=[case[0] for case in CASES],
)
def test_gradient_within_torch_error(name, fn, shape, seed):
    """zerojax's float32 gradient is within TORCH_ERROR_FACTOR of torch's float32 error against
    float64 (normwise, over >= 1024 elements, where the error norm concentrates). Where torch's
    gradient is exact (norm 1 and inf: sgn(x) c) the bound would be 0; there the floor is one
    rounding of each exact gradient element, u |g|, the error of a correctly rounded float32
    gradient. Elsewhere no floor: torch's CPU scans accumulate in double, so its error can be
    below u, and a floor of u would hide a zerojax error several times torch's."""
    x = randn(*shape, seed=seed)
    with torch.no_grad():
        cotangent = randn(*fn(x).shape, seed=seed + 100)
    exact, theirs, ours = gradients(fn, x, cotangent)
    exact_in_torch = torch.equal(theirs, exact)
    floor = tolerances.unit_roundoff(F32) * exact.abs() if exact_in_torch else 0.0
    tolerances.assert_within_torch_error(ours, theirs, exact, f"{name} {shape}", floor=floor)


def test_cumprod_gradient_with_zeros_within_torch_error():
    """torch's cumprod backward special-cases zeros (no division by the input there); autodiff
    of the scan multiplies without dividing, so it must stay finite and as accurate. Normwise
    over 1024 elements, the bound of test_gradient_within_torch_error."""
    x = randn(64, 16, seed=7)
    x[torch.rand(64, 16, generator=torch.Generator().manual_seed(8)) < 0.1] = 0.0
    x[3] = 0.0
    fn = lambda t: t.cumprod(-1)
    exact, theirs, ours = gradients(fn, x, randn(64, 16, seed=9))
    assert ours.isfinite().all()
    tolerances.assert_within_torch_error(ours, theirs, exact, "cumprod with zeros")


ORDS = [2, 1, 3, 1.5, 0.5, -1, float("inf"), float("-inf")]


@pytest.mark.parametrize("ord", ORDS)
def test_vector_norm_gradient_at_zero_is_torchs(ord):
    """At an element that is 0, and for a slice whose norm is 0, torch's norm backward gives
    exactly 0 (it masks), where autodiff of |x| (derivative 1 at 0 in JAX), |x|^ord (inf at 0
    for ord < 1) or the root (inf at 0) gives 1 or NaN. Exact equality: both sides write a 0.
    Before the fix ord 1 gave sgn-less gradients (1 c) at zeros and ord 0.5 NaN and inf."""
    x = randn(6, 8, seed=3)
    x[1] = 0.0  # a zero row: its norm is 0
    x[2, ::2] = 0.0  # zero elements in a row of nonzero norm
    for what, value, dim in [("all zero", torch.zeros(6, 8), None), ("zero rows", x, -1)]:
        fn = lambda t, dim=dim: torch.linalg.vector_norm(t, ord=ord, dim=dim)
        with torch.no_grad():
            cotangent = randn(*fn(value).shape, seed=4)
        _, theirs, ours = gradients(fn, value, cotangent)
        zero = value == 0
        assert torch.equal(theirs[zero], torch.zeros_like(theirs[zero])), "torch's contract"
        assert torch.equal(ours[zero], theirs[zero]), f"ord {ord}, {what}: {ours[zero]}"
        assert ours.isfinite().all(), f"ord {ord}, {what}: {ours}"


def _table(seeds=(0, 1, 2)):
    print(f"{'op':<20} {'shape':<12} {'zerojax':>9} {'torch':>9} {'ratio':>7}")
    for name, fn, shape in CASES:
        for seed in seeds:
            ours, theirs = gradient_errors(fn, randn(*shape, seed=seed), seed)
            ratio = ours / theirs if theirs else float("inf")
            print(f"{name:<20} {shape!s:<12} {ours:9.2e} {theirs:9.2e} {ratio:7.2f}")


if __name__ == "__main__":
    _table()


def test_abs_gradient_at_zero_is_torchs():
    """aten.abs has derivative sgn(x), 0 at 0, in torch (jax.grad(jnp.abs)(0.0) is 1): an L1
    loss at an exact match gets no gradient. Exact: both sides write 0 or +-c. Fails without
    pointwise.torch_abs."""
    x = torch.tensor([0.0, -0.0, 1.5, -2.0, 0.0])
    target = torch.tensor([0.0, 0.0, 1.0, 1.0, 3.0])
    fn = lambda t: (t - target).abs()
    _, theirs, ours = gradients(fn, x, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert torch.equal(ours, theirs), f"{ours} vs torch {theirs}"


@pytest.mark.parametrize("ord", [2, 3, 0.5])
def test_vector_norm_of_nan_is_nan(ord):
    """The zero-norm guard of the gradient fix must not catch NaN (torch's norm of a slice with
    a NaN is NaN; a `total > 0` guard gave 0). Exact: NaN and the other slice's value agree."""
    x = torch.tensor([[float("nan"), 1.0, 2.0], [0.0, 0.0, 0.0]])
    fn = lambda t: torch.linalg.vector_norm(t, ord=ord, dim=-1)
    expected, got = run_both(fn, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
