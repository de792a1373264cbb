"""A forward patched on a zerojax model's instance is traced into the engine's program.

Run: .venv/bin/python -m pytest -q tests/train/test_instance_forward.py -p no:cacheprovider
Why: libraries patch `model.forward` on the instance, wrapping what they read there (TRL's
SFTTrainer: a fused LM head; accelerate: autocast and fp32 outputs). Run eagerly around the
engine, TRL's patch called the model's submodules on live tensors and failed in the backward;
traced, the patch is part of the one program. Tracing accelerate's autocast decorator left
autocast enabled in the whole process (torch.export), which every later op then ran under.

Tolerances: a float32 program against the same float32 computation in torch: 32 float32 eps of
the largest magnitude (a 16-wide contraction and a tanh, reordered); bfloat16 autocast against torch's eager autocast: 2**-8
(bf16's unit roundoff: the two round the same products to bf16, then may accumulate apart).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import zerojax

pytestmark = pytest.mark.multidevice


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, **kwargs):
        return self.head(torch.tanh(self.body(x)))


def close(expected: torch.Tensor) -> float:
    """float32 rounding of a 16-wide contraction and a tanh, reordered: 32 eps of the largest
    magnitude (elementwise relative bounds fail on values near zero)."""
    return 32 * torch.finfo(torch.float32).eps * float(expected.abs().max())


def patch_with_scale(model):
    """Like TRL's fused head: a patch with a keyword of its own that calls the submodules
    itself, and the forward it replaced otherwise."""
    replaced = model.forward

    def forward(self, x, scale=None, **kwargs):
        if scale is None:
            return replaced(x, **kwargs)
        return self.head(torch.tanh(self.body(x))) * scale

    model.forward = types.MethodType(forward, model)


def test_patched_forward_runs_in_the_engine_and_trains_like_torch():
    torch.manual_seed(0)
    reference = Scaled()
    model, _ = zerojax.initialize(copy.deepcopy(reference))
    patch_with_scale(reference)
    patch_with_scale(model)
    assert model.forward.__func__.__name__ == "forward"  # reading gives the patch, as in torch
    x = torch.randn(8, 16)
    for m in (model, reference):
        (m(x, scale=3.0).square().mean() + m(x).mean()).backward()
    expected = reference(x, scale=3.0)
    torch.testing.assert_close(model(x, scale=3.0), expected, rtol=0, atol=close(expected))
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=close(theirs.grad))
    assert "forward_vjp" in model.engine.compiled_programs()

    # Setting the engine's own forward back removes the patch.
    model.forward = types.MethodType(type(model).forward, model)
    expected = reference(x)
    # `scale` goes to the class forward's **kwargs, which ignore it.
    torch.testing.assert_close(model(x, scale=3.0), expected, rtol=0, atol=close(expected))


def test_accelerate_style_autocast_patch_is_traced_and_does_not_leak():
    torch.manual_seed(0)
    reference = Scaled()
    model, _ = zerojax.initialize(copy.deepcopy(reference))
    for m in (model, reference):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        m.forward = types.MethodType(autocast(type(m).forward), m)
    x = torch.randn(8, 16)
    ours = model(x)
    assert not torch.is_autocast_enabled("cpu")
    theirs = reference(x)
    # The values are bfloat16's; their dtype is the dtype policy's output dtype (float32).
    assert theirs.dtype == torch.bfloat16 and ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs.float(), rtol=2**-8, atol=2**-8)
    float32 = Scaled.forward(reference, x)  # the class's forward: no autocast
    assert (ours - float32).abs().max() > 1e-4  # autocast did round
