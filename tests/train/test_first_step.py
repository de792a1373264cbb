"""The first training step's one-time work: each program traced and compiled once, some early.

Run: .venv/bin/python -m pytest -q tests/train/test_first_step.py
Exists for issue 14's first-step goal (bench/train_step.py, "First step"): the fused path
compiles the update program while its forward-backward program runs, and finds the model's
loss from the captured graph rather than by tracing the model. Neither may change what a step
computes, and a prepared update whose signature the step does not match must not be used.
"""

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP
from zerojax.train.engine import Engine

pytestmark = pytest.mark.multidevice

CONFIGS = {
    "fp32, ZeRO-0": {"mesh": {"data": 8}},
    "bf16 + fp32 master, ZeRO-3": {
        "mesh": {"data": 8},
        "zero_stage": 3,
        "precision": "params=bfloat16,compute=bfloat16,master=float32",
    },
}


def fused_mlp(config):
    torch.manual_seed(0)
    module = MLP()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    model, optimizer = zerojax.initialize(
        module, optimizer, config=config, seed=0, loss_fn=F.cross_entropy
    )
    return module, model, optimizer


def batches(num_steps: int):
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(num_steps)
    ]


def train(model, optimizer, data, before_backward=None):
    losses = []
    for x, y in data:
        loss = model(x, y)
        if before_backward is not None:
            before_backward()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: np.asarray(v) for n, v in model.engine.state.weights.items()}


def update_program(model):
    return model.engine.programs.update(model.engine.optimizer_spec)


def without_preparation(monkeypatch):
    monkeypatch.setattr(Engine, "_prepare_update", lambda self, grads: None)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fused_forward_compiles_the_update_the_step_then_runs(config, monkeypatch):
    _, model, optimizer = fused_mlp(CONFIGS[config])
    data = batches(3)
    x, y = data[0]
    loss = model(x, y)
    assert update_program(model).num_compiled() == 1  # before loss.backward()/step()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses, weights = train(model, optimizer, data[1:])
    assert update_program(model).num_compiled() == 1  # the step ran the prepared executable

    with monkeypatch.context() as patch:
        without_preparation(patch)
        _, reference, reference_optimizer = fused_mlp(CONFIGS[config])
        reference_losses, reference_weights = train(reference, reference_optimizer, data)
    assert [loss.item()] + losses == reference_losses
    for name, value in reference_weights.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_a_step_that_differs_from_the_prepared_update_compiles_its_own(monkeypatch):
    """A parameter frozen between the forward and the backward: its gradient leaves the
    update's inputs, so the prepared signature does not match; the step compiles its own."""
    config = CONFIGS["fp32, ZeRO-0"]
    module, model, optimizer = fused_mlp(config)
    data = batches(2)

    def freeze():
        module.fc1.weight.requires_grad_(False)

    losses, weights = train(model, optimizer, data, before_backward=freeze)
    assert update_program(model).num_compiled() == 2

    without_preparation(monkeypatch)
    reference_module, reference, reference_optimizer = fused_mlp(config)
    reference_losses, reference_weights = train(
        reference,
        reference_optimizer,
        data,
        before_backward=lambda: reference_module.fc1.weight.requires_grad_(False),
    )
    assert update_program(reference).num_compiled() == 1
    assert losses == reference_losses
    for name, value in reference_weights.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_fused_loss_is_found_without_tracing_the_model(monkeypatch):
    def no_trace(*args, **kwargs):
        raise AssertionError("the model was traced to find its loss")

    _, model, optimizer = fused_mlp(CONFIGS["fp32, ZeRO-0"])
    monkeypatch.setattr(jax, "eval_shape", no_trace)
    x, y = batches(1)[0]
    loss = model(x, y)
    assert loss.shape == () and "loss_and_grads" in model.engine.compiled_programs()
    loss.backward()
    optimizer.step()
