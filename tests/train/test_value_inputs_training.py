"""Training through `zerojax.initialize` with an input whose values decide shapes.

    pytest -q tests/train/test_value_inputs_training.py

Why: Qwen2-VL's `image_grid_thw` is such an input (zerojax/bridge/value_inputs.py). The wrapped
model must pass it to the jitted step as a static value, not a sharded array, and a new value
must compile a new step; the loop stays the user's own, with the tensor as they hold it.
"""

import copy

import pytest
import torch
from torch import nn

import zerojax

LR = 1e-2
# fp32 AdamW steps on a 4 -> 16 linear model: a few ulps of drift per step.
LOSS_RTOL = 1e-5


class SegmentMeans(nn.Module):
    """Per-segment means of projected features, segments sized by `grid`'s values."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 16)

    def forward(self, x, grid, target):
        lengths = (grid[:, 0] * grid[:, 1]).tolist()
        pooled = torch.stack([self.proj(p).mean(1) for p in torch.split(x, lengths, dim=1)], 1)
        return nn.functional.mse_loss(pooled, target)


@pytest.mark.multidevice
def test_zero3_step_with_a_value_input_matches_torch():
    torch.manual_seed(0)
    module = SegmentMeans().train()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    model, optimizer = zerojax.initialize(
        module, optimizer, config={"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
    )
    for grid in ([[1, 2], [2, 2]], [[1, 2], [2, 2]], [[3, 1], [1, 1]]):
        grid = torch.tensor(grid)
        x = torch.randn(8, int((grid[:, 0] * grid[:, 1]).sum()), 4)
        target = torch.randn(8, 2, 16)
        losses = []
        for m, opt in ((model, optimizer), (reference, ref_optimizer)):
            loss = m(x, grid, target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        ours, theirs = losses
        assert abs(ours - theirs) <= LOSS_RTOL * abs(theirs), f"grid {grid}: {ours} vs {theirs}"
    assert model.engine.converted(True, (), {}).value_inputs == {"args[1]"}
