"""The deferred optimizer update: `optimizer.step()` on one process runs its update inside the
next fused model call's program (`Engine.update`, `StepPrograms.update_then`).

Run: .venv/bin/python -m pytest -q tests/train/test_deferred_update.py
Why: deferring must never be visible. Whatever reads the state after `step()` (a parameter, a
state_dict, the optimizer's state, the next general-path call) sees the update applied, the
folded program computes what the two programs computed, bit for bit, and gradients something
else still holds are not donated to it.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP

pytestmark = pytest.mark.multidevice

CONFIG = {"mesh": {"data": 8}, "zero_stage": 3}


def build(optimizer_class=torch.optim.SGD, **options):
    torch.manual_seed(0)
    module = MLP()
    options = options or {"lr": 0.1, "momentum": 0.9}
    optimizer = optimizer_class(module.parameters(), **options)
    return zerojax.initialize(module, optimizer, config=CONFIG, seed=0, loss_fn=F.cross_entropy)


def batches(num_steps: int):
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(num_steps)
    ]


def weights(model) -> dict[str, np.ndarray]:
    return {n: np.asarray(v) for n, v in model.engine.state.weights.items()}


def test_folded_steps_compute_what_separate_programs_compute():
    """The same loop twice: once folding each update into the next call's program, once with
    a parameter read after every step (which applies the update as a program of its own)."""
    data = batches(5)
    folded_model, folded_opt = build(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    separate_model, separate_opt = build(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    losses = {"folded": [], "separate": []}
    for x, y in data:
        for name, model, opt in (
            ("folded", folded_model, folded_opt),
            ("separate", separate_model, separate_opt),
        ):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
            if name == "separate":
                _ = next(model.parameters()).detach().clone()  # a read applies the update
    assert "update+loss_and_grads" in folded_model.engine.compiled_programs()
    assert "update+loss_and_grads" not in separate_model.engine.compiled_programs()
    assert losses["folded"] == losses["separate"]
    folded, separate = weights(folded_model), weights(separate_model)
    for name in folded:
        np.testing.assert_array_equal(folded[name], separate[name], err_msg=name)


def test_general_path_folds_the_update_into_its_forward():
    """A loss computed in torch: the update runs at the start of the forward-with-vjp program,
    and the steps compute what separate programs compute."""
    data = batches(4)
    runs = {}
    for read_between in (False, True):
        torch.manual_seed(0)
        module = MLP()
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        model, optimizer = zerojax.initialize(module, optimizer, config=CONFIG, seed=0)
        losses = []
        for x, y in data:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if read_between:
                _ = model.engine.state
        programs = model.engine.compiled_programs()
        assert ("update+forward_vjp" in programs) == (not read_between)
        runs[read_between] = losses, weights(model)
    assert runs[False][0] == runs[True][0]
    for name, value in runs[False][1].items():
        np.testing.assert_array_equal(value, runs[True][1][name], err_msg=name)


def test_every_reader_after_step_sees_the_update():
    model, optimizer = build()
    x, y = batches(1)[0]
    loss = model(x, y)
    loss.backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    # SGD with momentum, first step: p - lr * g (torch's buffer starts at the gradient), one
    # fused multiply-add in the update: within 1 ulp of this unfused reference. Without the
    # update the difference would be lr * g itself.
    expected = {n: torch.addcmul(before[n], grads[n], torch.tensor(-0.1)) for n in before}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1.2e-7, atol=1e-8, msg=name)
    state = model.state_dict()
    for name in before:
        torch.testing.assert_close(state[name], expected[name], rtol=1.2e-7, atol=1e-8, msg=name)
    buffer = optimizer.state_dict()["state"][0]["momentum_buffer"]
    first = next(iter(grads))
    torch.testing.assert_close(buffer, grads[first], rtol=0, atol=0)


def test_gradients_still_held_are_not_donated():
    """Without `zero_grad()` the step's gradients stay readable (torch keeps `.grad` after
    `step()`); the next call must not donate them, and they keep their values."""
    model, optimizer = build()
    data = batches(2)
    x, y = data[0]
    model(x, y).backward()
    optimizer.step()
    held = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    x, y = data[1]
    loss = model(x, y)  # no zero_grad: the new gradients add to the held ones
    loss.backward()
    assert "update+loss_and_grads" not in model.engine.compiled_programs()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert any(not torch.equal(p.grad, held[n]) for n, p in model.named_parameters())
