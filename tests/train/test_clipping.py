"""Gradient clipping on a wrapped model: `model.clip_grad_norm_`, and torch's own functions
(`clip_grad_norm_`, `clip_grad_value_`, `get_total_norm`, `_foreach_*`) on the live gradients.

Run: .venv/bin/python -m pytest -q tests/train/test_clipping.py -p no:cacheprovider
Why: issue 24 item 2. The most common line of training scripts,
`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`, must work unpatched and with no
config key, on the shards (no gradient gathered to the host), and in-place changes to `p.grad`
must reach the gradient the optimizer uses, never a silently discarded host copy.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP
from tests import tolerances
from zerojax.train import engine as engine_module
from zerojax.train import live_tensor
from zerojax.train.live_tensor import LiveTensor

pytestmark = pytest.mark.multidevice

BATCH = 8
ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3}


def wrapped_and_reference(config=ZERO3, *, with_exact=False):
    """(wrapped, plain torch[, float64 twin]) after one backward on the same batch."""
    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    exact = copy.deepcopy(module).double()
    model, _ = zerojax.initialize(module, torch.optim.SGD(module.parameters(), lr=0.1), config)
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    for m, inputs in ((model, x), (reference, x), (exact, x.double())):
        F.cross_entropy(m(inputs), y).backward()
    return (model, reference, exact) if with_exact else (model, reference)


def assert_clip_matches(model, reference, exact, ours, theirs, norm_type):
    """The norm and the clipped gradients err against the float64 twin no more than torch's
    float32 does (tolerances.assert_within_torch_error); the norm, a single number, with its own
    float32 rounding as a floor: the gradients' (the MLP's 32 + 3 x 64 + 8 + 10 accumulation
    and ~4 library functions) plus a sum over every gradient element, per side."""
    exact_norm = torch.nn.utils.clip_grad_norm_(exact.parameters(), 0.1, norm_type)
    count = sum(p.numel() for p in reference.parameters())
    roundings = 2 * (32 + 3 * 64 + 8 + 10 + 4 * tolerances.LIBM_ULPS + count)
    floor = tolerances.rounded_intermediates(torch.float32, roundings, float(exact_norm))
    tolerances.assert_within_torch_error(
        [float(ours)], [float(theirs)], [float(exact_norm)], "norm", floor
    )
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (model.module, reference, exact)]
    tolerances.assert_params_within_torch_error(*grads, "clipped gradients")


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_model_clip_grad_norm_matches_torch(norm_type):
    model, reference, exact = wrapped_and_reference(with_exact=True)
    ours = model.clip_grad_norm_(0.1, norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type)
    assert_clip_matches(model, reference, exact, ours, theirs, norm_type)
    assert float(theirs) > 0.1  # the clip really scaled something


def refuse_host_copies(monkeypatch):
    """Make every way zerojax copies an array to the host raise (XLA:CPU's transfer guard does
    not count CPU arrays read by NumPy, so the copy functions themselves are replaced)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a gradient was copied to the host")

    monkeypatch.setattr(live_tensor, "host_copy", refuse)
    monkeypatch.setattr(engine_module, "host_copy", refuse)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_torch_clip_grad_norm_runs_on_the_shards(norm_type, monkeypatch):
    """torch's own function, unpatched, on the live gradients: the same norm and clipped
    gradients as torch's, with nothing copied to the host on the way."""
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"
    model, reference, exact = wrapped_and_reference(with_exact=True)
    with monkeypatch.context() as patch:
        refuse_host_copies(patch)
        ours = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type)
    assert isinstance(ours, LiveTensor)
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type)
    assert_clip_matches(model, reference, exact, ours, theirs, norm_type)
    assert float(theirs) > 0.1


def test_clip_grad_value_and_get_total_norm_match_torch():
    model, reference, exact = wrapped_and_reference(with_exact=True)
    for m in (model, reference, exact):
        torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
    # Clamping is exact: the clipped gradients differ as the unclipped ones did.
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (model.module, reference, exact)]
    tolerances.assert_params_within_torch_error(*grads, "value-clipped gradients")
    assert max(float(p.grad.abs().max()) for p in model.parameters()) == pytest.approx(0.01)
    norms = [
        float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
        for m in (model, reference, exact)
    ]
    count = sum(p.numel() for p in reference.parameters())
    floor = tolerances.rounded_intermediates(torch.float32, 2 * count, norms[2])
    tolerances.assert_within_torch_error([norms[0]], [norms[1]], [norms[2]], "total norm", floor)


def test_grad_in_place_ops_write_the_engine_gradients():
    """`p.grad.data.mul_`, `torch._foreach_mul_`, writes through views (`p.grad[0] = ...`,
    `p.grad.view(-1)[:5].mul_`) and `p.grad = t` change the gradient the optimizer uses (a host
    copy would silently lose them)."""
    model, reference = wrapped_and_reference()
    params, ref_params = list(model.parameters()), list(reference.parameters())
    replacement = torch.randn_like(ref_params[-1])
    for ps, is_ref in ((params, False), (ref_params, True)):
        with torch.no_grad():
            for p in ps:
                p.grad.data.mul_(0.5)
            torch._foreach_mul_([p.grad for p in ps[1:]], 3.0)
            ps[0].grad[0] = 0.25
            ps[0].grad.view(-1)[-5:].mul_(2.0)
            ps[1].grad.t()[1:3].zero_()
            ps[-1].grad = replacement.clone() if is_ref else replacement
    for (name, p), q in zip(model.named_parameters(), ref_params, strict=True):
        # Multiplying by 0.5 or 2 is exact and by 3.0 rounds once, alike on both sides: the
        # gradients differ only as they did before, by the forward's and backward's reordered
        # sums (<= 64 terms each, 2 * 63 * 2^-24 ~ 7.5e-6 relative to the terms' magnitudes).
        # Compared normwise per tensor: one element that is a near-cancelling sum can differ by
        # many of its own ulps (2.0e-7 on a value of 8.5e-3 with XLA and ATen at AVX2, torch
        # without oneDNN; normwise 1.3e-7 to 3.7e-7 relative), where a lost write moves its
        # tensor by far more (not doubling 5 of fc1.weight's 2,048: 0.024 apart normwise).
        ours, theirs = torch.from_numpy(p.grad.numpy()).double(), q.grad.double()
        difference = float((ours - theirs).norm())
        assert difference <= 1e-5 * float(theirs.norm()), (name, difference)
    assert params[0].grad.data_ptr() == 0  # a live tensor: no host storage behind it
