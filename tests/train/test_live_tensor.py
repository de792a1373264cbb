"""Live tensors on their own: torch ops on a `LiveTensor` against the same ops in torch.

Run: .venv/bin/python -m pytest -q tests/train/test_live_tensor.py -p no:cacheprovider
Why: issue 24 item 2. Every torch op a script applies to `p.grad` or `p.data` runs through
`zerojax.train.live_tensor` (lowered per op, in-place ops written back, views aliasing their
base, foreach ops per element, float64 on the host); these check each path against torch on
fresh random values. Elementwise results must be equal, or within one float32 rounding where
XLA and torch's vectorised kernels may round differently (division, fused multiply-adds).
"""

from __future__ import annotations

import copy
import io

import jax.numpy as jnp
import pytest
import torch

from zerojax.bridge import eager
from zerojax.train.live_tensor import LiveTensor

# One float32 rounding of unit-scale values (XLA turns x / c into x * (1 / c) and contracts
# a * b + c into an FMA where torch's kernels round in between): 2 ulp of values up to ~4.
ONE_ROUNDING = {"rtol": 2.4e-7, "atol": 1e-6}


def live(tensor: torch.Tensor) -> LiveTensor:
    return LiveTensor.owning(jnp.asarray(tensor.numpy()), tensor.dtype)


def host(tensor: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(tensor.numpy())


IN_PLACE = {
    "mul_ scalar": lambda x: x.mul_(0.7),
    "add_ alpha": lambda x: x.add_(x * 2, alpha=0.3),
    "lerp_": lambda x: x.lerp_(torch.ones_like(x), 0.25),
    "clamp_": lambda x: x.clamp_(-0.5, 0.5),
    "square_ (decomposed)": lambda x: x.square_(),
    "pow_ scalar": lambda x: x.pow_(3),
    "setitem": lambda x: x.__setitem__(0, 5.0),
    "slice mul_": lambda x: x[:, 1:3].mul_(2),
    "transpose div_": lambda x: x.t().div_(3),
    "view chain zero_": lambda x: x.view(-1)[2:7].zero_(),
    "select fill_": lambda x: x[1][2].fill_(-1),
    "split add_": lambda x: torch.split(x, 2, dim=0)[1].add_(10),
    "boolean mask setitem": lambda x: x.__setitem__(x > 0.5, 0.0),
    "diagonal add_": lambda x: x.diagonal().add_(100),
    "copy_ from plain": lambda x: x.copy_(torch.arange(20.0).reshape(4, 5)),
    "addcmul_": lambda x: x.addcmul_(x * 2, x + 1, value=0.3),
    "addcdiv_": lambda x: x.addcdiv_(x * 2, x.abs() + 1, value=-0.3),
    "lerp_ tensor weight": lambda x: x.lerp_(x * 3, torch.full_like(x, 0.75)),
}


@pytest.mark.parametrize("name", list(IN_PLACE))
def test_in_place_ops_and_views_write_like_torch(name):
    expected = torch.randn(4, 5)
    got = live(expected)
    IN_PLACE[name](expected)
    IN_PLACE[name](got)
    torch.testing.assert_close(host(got), expected, **ONE_ROUNDING)


def test_a_view_reads_its_base_afresh():
    base = torch.randn(4, 5)
    ours = live(base)
    view = ours.t()
    ours.mul_(2)
    torch.testing.assert_close(host(view), (base * 2).t(), rtol=0, atol=0)


FOREACH = {
    "mul_ scalar": lambda t, o: torch._foreach_mul_(t, 0.7),
    "mul_ list": lambda t, o: torch._foreach_mul_(t, o),
    "mul_ scalar list": lambda t, o: torch._foreach_mul_(t, [0.5, 2.0]),
    "add_ list alpha": lambda t, o: torch._foreach_add_(t, o, alpha=0.3),
    "lerp_": lambda t, o: torch._foreach_lerp_(t, o, 0.25),
    "addcmul_ value": lambda t, o: torch._foreach_addcmul_(t, o, o, value=0.5),
    "addcmul_ scalars tensor": lambda t, o: torch._foreach_addcmul_(
        t, o, o, torch.tensor([0.5, 2.0])
    ),
}


@pytest.mark.parametrize("name", list(FOREACH))
def test_foreach_ops_run_per_element_like_torch(name):
    expected = [torch.randn(3, 4), torch.randn(5)]
    others = [torch.randn(3, 4), torch.randn(5)]
    got = [live(t) for t in expected]
    FOREACH[name](expected, [o.clone() for o in others])
    FOREACH[name](got, [live(o) for o in others])
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(host(mine), theirs, **ONE_ROUNDING)
    norms = torch._foreach_norm(got)
    # A 12- or 5-term sum of squares, reordered: a few float32 roundings of the norm.
    torch.testing.assert_close(
        torch.stack([host(n) for n in norms]), torch.stack(torch._foreach_norm(expected))
    )


def test_a_foreach_call_repeated_with_new_values_records_them():
    """The second call of a foreach op with the same shapes records from the plan kept at the
    first (`live_tensor._ForeachPlan`): its new scalars and tensor values are the ones used."""
    expected = [torch.randn(3, 4), torch.randn(5)]
    got = [live(t) for t in expected]
    for alpha, scales in ((0.3, [0.5, 2.0]), (-1.7, [3.0, -0.25])):
        others = [torch.randn(3, 4), torch.randn(5)]
        torch._foreach_add_(expected, others, alpha=alpha)
        torch._foreach_add_(got, [live(o) for o in others], alpha=alpha)
        torch._foreach_mul_(expected, scales)
        torch._foreach_mul_(got, scales)
        for mine, theirs in zip(got, expected, strict=True):
            torch.testing.assert_close(host(mine), theirs, **ONE_ROUNDING)


def test_stack_of_live_tensors_promotes_like_torch():
    a, b = torch.randn(3, 4), torch.randint(-5, 5, (3, 4))
    for dim in (0, 1, -1):
        expected = torch.stack([a, b], dim=dim)
        got = torch.stack([live(a), live(b)], dim=dim)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(host(got), expected, rtol=0, atol=0)


def test_host_values_where_torch_semantics_want_them():
    """float64 runs in torch on the host (JAX holds 32 bits here), and printing, .item(),
    .tolist(), pickling and deepcopy give ordinary values."""
    plain = torch.randn(3, 4)
    ours = live(plain)
    wide = ours.double()
    assert type(wide) is torch.Tensor and wide.dtype == torch.float64
    torch.testing.assert_close(wide, plain.double(), rtol=0, atol=0)
    assert repr(ours) == repr(plain)
    assert ours.sum().item() == pytest.approx(plain.sum().item(), rel=1e-6)
    assert ours.tolist() == plain.tolist()
    assert f"{ours.max():.4f}" == f"{plain.max():.4f}"
    assert ours.argmax().dtype == torch.int64 and int(ours.argmax()) == int(plain.argmax())
    buffer = io.BytesIO()
    torch.save({"x": ours}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["x"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, plain)
    copied = copy.deepcopy(ours)
    assert type(copied) is torch.Tensor and torch.equal(copied, plain)


def test_a_new_step_size_compiles_no_new_program():
    """Optimizers compute step sizes, bias corrections and 1 - decay as Python floats, new
    every step: they are inputs of the op's program, not constants compiled into it (a
    program per value made Adafactor's step 1 s instead of 85 ms on the bench model)."""
    ours = live(torch.randn(4, 5))
    expected = host(ours).clone()
    compiled = None
    for step in range(1, 6):
        value = 1 - 0.9**step
        ours.mul_(value).add_(ours, alpha=-value / 3).lerp_(ours * 0, value / 2)
        expected.mul_(value).add_(expected, alpha=-value / 3).lerp_(expected * 0, value / 2)
        if compiled is None:  # the first step compiles what it needs
            compiled = set(eager._calls)
    assert set(eager._calls) <= compiled  # steps 2-5, new values each: no new program
    # 15 ops, each at most one float32 rounding apart from torch's (values below ~4).
    torch.testing.assert_close(host(ours), expected, rtol=15 * 1.2e-7, atol=15 * 4.8e-7)
