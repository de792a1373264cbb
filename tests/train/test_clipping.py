"""Gradient clipping on a wrapped model: `model.clip_grad_norm_`, and torch's function only
when the config opts in to the patch.

Run: .venv/bin/python -m pytest -q tests/train/test_clipping.py -p no:cacheprovider
Why: issue 14 item 3. zerojax must not replace `torch.nn.utils.clip_grad_norm_` for the whole
process by default, and a torch user calling it on zerojax parameters must get an error that
says what to do, never a silent clip of a host copy. (The patch's lifetime, restored when the
last engine that asked is collected, is checked in a fresh process in test_initialize_config.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP
from tests import tolerances
from zerojax.train import clipping

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


def test_initialize_does_not_patch_torch_by_default():
    model, _ = wrapped_and_reference()
    # Another test's live engine may hold the opt-in patch; this engine must not have added it.
    if clipping._num_patching_engines == 0:
        assert torch.nn.utils.clip_grad_norm_ is clipping.torch_clip_grad_norm_
    assert model.engine.config.train.patch_clip_grad_norm is False


def test_unpatched_torch_clip_on_sharded_params_is_a_clear_error():
    """torch's own function (what an unpatched process calls) reads host copies of the
    gradients; its in-place scaling must fail and name the two fixes."""
    model, _ = wrapped_and_reference()
    with pytest.raises(RuntimeError) as info:
        clipping.torch_clip_grad_norm_(model.parameters(), 0.1)
    message = str(info.value)
    assert "model.clip_grad_norm_(max_norm)" in message
    assert "train.patch_clip_grad_norm: true" in message
    # Nothing was clipped: the next clip sees the unclipped norm.
    assert float(model.clip_grad_norm_(0.1)) > 0.1


def test_patched_torch_clip_runs_on_the_shards():
    model, reference, exact = wrapped_and_reference(
        {**ZERO3, "train": {"patch_clip_grad_norm": True}}, with_exact=True
    )
    assert torch.nn.utils.clip_grad_norm_ is clipping.clip_grad_norm_
    ours = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)  # torch's path
    assert_clip_matches(model, reference, exact, ours, theirs, 2.0)
