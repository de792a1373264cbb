"""Gradient accumulation (`train.gradient_accumulation_steps`) with DeepSpeed's semantics.

Run: .venv/bin/python -m pytest -q tests/train/test_accumulation.py
Exists because a loop ported from DeepSpeed calls backward, `optimizer.step()` and `zero_grad()`
every micro-batch and relies on the engine to apply the update only at the accumulation
boundary, with the gradients averaged over the micro-batches (DeepSpeed divides the loss by
gas). That loop (gas=4) must train exactly as the torch-style loop it replaces (loss / 4,
backward 4 times, step once, gas=1) -- bit for bit, since dividing by 4 is exact in binary
floating point and commutes with every linear op of the backward -- and as plain PyTorch
within fp32 error.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP
from tests import tolerances

pytestmark = pytest.mark.multidevice

GAS, UPDATES, MICRO_BATCH = 4, 3, 8  # 8 rows: one per device of the 8-way data axis
CONFIG = {"mesh": {"data": 8}, "zero_stage": 2}  # stage 2: the accumulator lives in shards


def micro_batches():
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(MICRO_BATCH, 32, generator=generator),
            torch.randint(0, 10, (MICRO_BATCH,), generator=generator),
        )
        for _ in range(GAS * UPDATES)
    ]


def setup(module, gas, fused):
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    config = {**CONFIG, "train": {"gradient_accumulation_steps": gas}}
    model, optimizer = zerojax.initialize(
        module, optimizer, config=config, seed=0, loss_fn=F.cross_entropy if fused else None
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def loss_of(model, x, y, fused):
    return model(x, y) if fused else F.cross_entropy(model(x), y)


def deepspeed_style(module, batches, fused):
    """gas=4 in the config; backward, step and zero_grad every micro-batch; the scheduler
    steps at boundaries only (DeepSpeed steps the schedulers it owns only there)."""
    model, optimizer, scheduler = setup(module, GAS, fused)
    boundaries, losses = [], []
    for i, (x, y) in enumerate(batches):
        loss = loss_of(model, x, y, fused)
        loss.backward()
        boundary = optimizer.is_gradient_accumulation_boundary()
        boundaries.append(boundary)
        optimizer.step()
        optimizer.zero_grad()  # ignored before the boundary: the gradients accumulate
        if not boundary:
            assert model.engine.state.grads is not None, f"micro-batch {i}: gradients dropped"
        else:
            assert model.engine.state.grads is None  # the boundary step cleared them
            scheduler.step()
        losses.append(loss.item())
    assert boundaries == [(i + 1) % GAS == 0 for i in range(len(batches))]
    assert model.engine.state.step == UPDATES and model.engine.state.micro_step == len(batches)
    return model, losses


def torch_style(module, batches, fused):
    """gas=1; loss / 4, backward 4 times, then one step, scheduler step and zero_grad."""
    model, optimizer, scheduler = setup(module, 1, fused)
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = loss_of(model, x, y, fused)
        (loss / GAS).backward()
        losses.append(loss.item())
        if (i + 1) % GAS == 0:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return model, losses


def plain_torch(module, batches, dtype=torch.float32):
    module = module.to(dtype)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = F.cross_entropy(module(x.to(dtype)), y)
        (loss / GAS).backward()
        losses.append(loss.item())
        if (i + 1) % GAS == 0:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return losses, {n: p.detach() for n, p in module.named_parameters()}


@pytest.mark.parametrize("fused", [True, False], ids=["fused-loss", "torch-loss"])
def test_deepspeed_loop_equals_torch_accumulation_loop(fused):
    torch.manual_seed(0)
    module = MLP()
    batches = micro_batches()
    ds_model, ds_losses = deepspeed_style(copy.deepcopy(module), batches, fused)
    torch_model, torch_losses = torch_style(copy.deepcopy(module), batches, fused)
    assert ds_losses == torch_losses  # bitwise, every micro-batch
    ds_state, torch_state = ds_model.state_dict(), torch_model.state_dict()
    for name, value in torch_state.items():
        torch.testing.assert_close(ds_state[name], value, rtol=0, atol=0, msg=name)
    # Plain PyTorch: XLA and torch reduce the float32 matmuls in different orders, which AdamW
    # turns into up to lr-sized steps: losses and parameters must err against a float64 run no
    # more than torch's float32 run does (tolerances.assert_within_torch_error), the losses
    # with their forward rounding as a floor (the MLP's 32 + 3 x 64 + batch + 10 classes
    # accumulation and ~4 library functions, per side).
    expected, params32 = plain_torch(copy.deepcopy(module), batches)
    exact, params64 = plain_torch(copy.deepcopy(module), batches, torch.float64)
    batch = batches[0][0].shape[0]
    roundings = 2 * (32 + 3 * 64 + batch + 10 + 4 * tolerances.LIBM_ULPS)
    floor = tolerances.rounded_intermediates(np.float32, roundings, np.abs(exact))
    tolerances.assert_within_torch_error(ds_losses, expected, exact, "losses", floor)
    tolerances.assert_params_within_torch_error(ds_state, params32, params64, "parameters")
    assert ds_losses[-GAS:] != ds_losses[:GAS]  # the updates really applied


def test_zero_grad_keeps_gradients_inside_the_window_only():
    """Before the boundary zero_grad() is ignored; with gas=1 (no window) it clears, as in
    torch; a scheduler stepped every micro-batch would advance gas times per update, which is
    why the loop above gates it on is_gradient_accumulation_boundary()."""
    torch.manual_seed(0)
    (x, y), *_ = micro_batches()
    model, optimizer, _ = setup(MLP(), GAS, fused=False)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # micro-step 1 of 4: no update
    optimizer.zero_grad()
    first = {n: np.asarray(g) for n, g in model.engine.state.grads.items()}
    F.cross_entropy(model(x), y).backward()
    second = model.engine.state.grads
    for name, grad in first.items():  # the same batch twice: exactly twice the gradient
        np.testing.assert_array_equal(np.asarray(second[name]), 2 * grad, err_msg=name)

    model, optimizer, _ = setup(MLP(), 1, fused=False)
    F.cross_entropy(model(x), y).backward()
    optimizer.zero_grad()
    assert model.engine.state.grads is None
