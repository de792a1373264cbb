"""Precision policies through the unchanged torch loop: bf16, pure bf16, fp16 loss scaling.

Run: `.venv/bin/python -m pytest -q tests/train/test_precision.py -p no:cacheprovider`.
Why: a policy changes what the engine stores and computes in, never the user's loop. bf16
compute with fp32 master weights must follow the fp32 loss curve; pure bf16 states must still
learn; fp16 must scale the loss inside the JAX step so that a plain `loss.backward()` works,
skip an overflowing step (parameters untouched), lower the scale by DeepSpeed's rule
(hysteresis, then halving), report both, and train on afterwards. Each policy's bytes per
parameter are read off the engine's arrays and off `zerojax.memory_report`.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from tests import tolerances
from zerojax.sharding.memory import measure_memory

pytestmark = pytest.mark.multidevice

BATCH, IN, CLASSES, STEPS = 32, 16, 4, 20
MIXED = "params=bfloat16,compute=bfloat16,master=float32"
PURE_BF16 = "params=bfloat16,compute=bfloat16,optimizer_state=bfloat16,grad_reduce=bfloat16"


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 64)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, CLASSES)

    def forward(self, x):
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


def references(module: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None):
    """(float64, torch bf16) outputs of `module` on x, or their losses given labels y: the
    exact result, and torch's own run of the bf16 policy (parameters and input rounded to
    bf16, each layer's result rounded)."""
    with torch.no_grad():
        exact = copy.deepcopy(module).double()(x.double())
        low = copy.deepcopy(module).bfloat16()(x.bfloat16()).double()
    if y is None:
        return exact, low
    return F.cross_entropy(exact, y).item(), F.cross_entropy(low, y).item()


def resync(reference: nn.Module, model) -> None:
    """Load the engine's weights (fp32 master, or the bf16 params widened) into the reference."""
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})


class Task:
    """Labels from a fixed random linear map: learnable in a few AdamW steps; fresh inputs."""

    def __init__(self):
        self.teacher = torch.randn(IN, CLASSES)

    def batch(self):
        x = torch.randn(BATCH, IN)
        return x, (x @ self.teacher).argmax(-1)


def config(precision, stage=3, **extra):
    return {"mesh": {"data": -1}, "zero_stage": stage, "precision": precision, **extra}


def setup(precision, **extra):
    torch.manual_seed(0)
    module = Classifier()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=2e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=2e-2)
    model, optimizer = zerojax.initialize(module, optimizer, config=config(precision, **extra))
    return model, optimizer, reference, ref_optimizer


def step(model, optimizer, x, y, loss_factor=1.0):
    loss = F.cross_entropy(model(x), y)
    (loss * loss_factor).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def bytes_per_param(engine) -> dict[str, float]:
    report = measure_memory(
        engine.plan,
        params=engine.params,
        grads=engine.grads,
        opt_state=engine.opt_state,
        master_weights=engine.master,
    )
    return {c.name: round(c.bytes_per_param, 1) for c in report.components}


def test_bf16_compute_with_fp32_master_tracks_fp32():
    model, optimizer, reference, _ = setup(MIXED)
    engine = model.engine
    assert {str(a.dtype) for a in engine.params.values()} == {"bfloat16"}
    assert {str(a.dtype) for a in engine.master.values()} == {"float32"}
    for name, master in engine.master.items():
        assert master.sharding.is_equivalent_to(engine.plan.master_weights[name], master.ndim)
    task = Task()
    x, _ = task.batch()
    with torch.no_grad():
        out, expected = model(x), reference(x)
    assert out.dtype == torch.float32  # output_dtype
    torch.testing.assert_close(out, out.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert (out - expected).abs().max() > 1e-4  # really computed in bf16, not fp32
    # A worst-case bf16 bound exceeds these logits (LayerNorm rstd ~6, 64-wide sums): held to
    # torch's own bf16 error instead (tolerances.assert_within_torch_error).
    tolerances.assert_within_torch_error(out, *reversed(references(reference, x)), "logits")
    # Tracking: at every step, from the engine's own weights (resynced into the reference; the
    # trajectories themselves diverge, Adam turning gradient rounding into lr-sized steps), the
    # bf16 loss errs against float64 no more than torch's bf16 loss does; and the run learns.
    losses, exact, torch_bf16 = [], [], []
    for _ in range(STEPS):
        x, y = task.batch()
        resync(reference, model)
        loss64, loss16 = references(reference, x, y)
        exact.append(loss64)
        torch_bf16.append(loss16)
        losses.append(step(model, optimizer, x, y))
    tolerances.assert_within_torch_error(losses, torch_bf16, exact, "losses")
    assert losses[-1] < 0.5 * losses[0]
    # state_dict gives torch's dtypes, from the fp32 master copy.
    state = model.state_dict()
    assert state["fc1.weight"].dtype == torch.float32
    master = torch.from_numpy(np.array(engine.master["fc1.weight"]))
    torch.testing.assert_close(state["fc1.weight"], master, rtol=0, atol=0)


def test_pure_bf16_states_learn():
    model, optimizer, reference, _ = setup(PURE_BF16)
    engine = model.engine
    assert engine.master is None
    task = Task()
    x, y = task.batch()
    F.cross_entropy(model(x), y).backward()
    assert {str(g.dtype) for g in engine.grads.values()} == {"bfloat16"}
    optimizer.zero_grad()
    losses, exact, torch_bf16 = [], [], []
    for _ in range(STEPS):
        x, y = task.batch()
        resync(reference, model)  # bf16 parameters, exact in fp32
        loss64, loss16 = references(reference, x, y)
        exact.append(loss64)
        torch_bf16.append(loss16)
        losses.append(step(model, optimizer, x, y))
    tolerances.assert_within_torch_error(losses, torch_bf16, exact, "losses")
    assert {str(a.dtype) for a in engine.params.values()} == {"bfloat16"}
    assert {str(a.dtype) for a in engine.opt_state["exp_avg"].values()} == {"bfloat16"}
    assert losses[-1] < 0.5 * losses[0], losses
    assert model.state_dict()["fc1.weight"].dtype == torch.float32


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("params=float32", {"params": 4, "grads": 4, "opt_state": 8, "master_weights": 0}),
        (MIXED, {"params": 2, "grads": 4, "opt_state": 8, "master_weights": 4}),
        (PURE_BF16, {"params": 2, "grads": 2, "opt_state": 4, "master_weights": 0}),
    ],
    ids=["fp32", "bf16-fp32-master", "pure-bf16"],
)
def test_bytes_per_parameter_per_policy(precision, expected):
    """What the engine holds for AdamW: 16, 18 and 8 bytes/param; ZeRO-3 splits it."""
    model, _, _, _ = setup(precision)
    x, y = Task().batch()
    F.cross_entropy(model(x), y).backward()
    engine = model.engine
    assert bytes_per_param(engine) == expected
    report = measure_memory(
        engine.plan, params=engine.params, grads=engine.grads, opt_state=engine.opt_state
    )
    assert report["params"].measured < 0.25 * report["params"].formula * 8  # ZeRO-3 splits


@pytest.mark.parametrize(
    "precision",
    [
        "params=float32",
        MIXED,
        PURE_BF16,
    ],
    ids=["fp32", "bf16-fp32-master", "pure-bf16"],
)
def test_memory_report_agrees_with_the_engine(precision):
    model, _, _, _ = setup(precision)
    x, y = Task().batch()
    F.cross_entropy(model(x), y).backward()
    converted = zerojax.convert(Classifier(), (x,))
    planned = zerojax.memory_report(converted, (x,), config(precision), run_step=False)
    planned_bytes = {c.name: round(c.bytes_per_param, 1) for c in planned.components}
    assert planned_bytes == bytes_per_param(model.engine)


def test_fp16_overflow_skips_the_step_lowers_the_scale_and_recovers():
    """hysteresis=2: the first overflow only uses up hysteresis, the second halves the scale;
    window=3 clean steps double it again."""
    loss_scale = {"initial_scale": 1024.0, "hysteresis": 2, "window": 3}
    model, optimizer, _, _ = setup(
        {
            "param_dtype": "float16",
            "compute_dtype": "float16",
            "master_dtype": "float32",
            "loss_scale": loss_scale,
        }
    )
    assert optimizer.loss_scale == 1024.0 and optimizer.skipped_steps == 0
    task = Task()
    losses = [step(model, optimizer, *task.batch())]
    assert optimizer.loss_scale == 1024.0 and optimizer.skipped_steps == 0

    before = model.state_dict()
    master_before = {n: a.copy() for n, a in model.engine.master.items()}
    # A loss 1e8 times too large: its fp16 gradients overflow; the loop itself is unchanged.
    step(model, optimizer, *task.batch(), loss_factor=1e8)
    assert optimizer.skipped_steps == 1
    assert optimizer.loss_scale == 1024.0  # hysteresis absorbed the first overflow
    step(model, optimizer, *task.batch(), loss_factor=1e8)
    assert optimizer.skipped_steps == 2
    assert optimizer.loss_scale == 512.0
    after = model.state_dict()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    for name, master in model.engine.master.items():
        assert (master == master_before[name]).all(), name
    adam_steps = optimizer.state_dict()["state"][0]["step"]
    assert float(adam_steps) == 1.0  # skipped steps do not count

    for _ in range(3):
        losses.append(step(model, optimizer, *task.batch()))
    assert optimizer.skipped_steps == 2
    assert optimizer.loss_scale == 1024.0  # window=3 clean steps: doubled
    for _ in range(STEPS - 4):
        losses.append(step(model, optimizer, *task.batch()))
    assert optimizer.skipped_steps == 2
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def test_fp16_loss_scaling_with_an_optimizer_running_its_own_step():
    """An optimizer running its own torch step (RMSprop, recorded on live tensors) under fp16
    loss scaling: an overflow skips its step (parameters, master weights and its state
    untouched) and moves the scale by the compiled update's rule; clean steps train."""
    torch.manual_seed(0)
    module = Classifier()
    precision = {
        "param_dtype": "float16",
        "compute_dtype": "float16",
        "master_dtype": "float32",
        "loss_scale": {"initial_scale": 1024.0, "hysteresis": 1, "window": 2},
    }
    model, optimizer = zerojax.initialize(
        module, torch.optim.RMSprop(module.parameters(), lr=1e-2), config(precision)
    )
    task = Task()
    losses = [step(model, optimizer, *task.batch())]
    assert optimizer.loss_scale == 1024.0 and optimizer.skipped_steps == 0
    master_before = {n: np.asarray(a) for n, a in model.engine.master.items()}
    square_avgs = [optimizer.state[p]["square_avg"].numpy() for p in model.parameters()]
    step(model, optimizer, *task.batch(), loss_factor=1e8)  # fp16 gradients overflow
    assert optimizer.skipped_steps == 1
    assert optimizer.loss_scale == 512.0
    for name, master in model.engine.master.items():
        np.testing.assert_array_equal(np.asarray(master), master_before[name], err_msg=name)
    for p, before in zip(model.parameters(), square_avgs, strict=True):
        np.testing.assert_array_equal(optimizer.state[p]["square_avg"].numpy(), before)
    for _ in range(STEPS):
        losses.append(step(model, optimizer, *task.batch()))
    assert optimizer.skipped_steps == 1
    assert optimizer.loss_scale == 512.0 * 2 ** (STEPS // 2)  # doubled every window=2 steps
    assert all(map(math.isfinite, losses))
    assert losses[-1] < 0.5 * losses[0], losses


class KeepsItsGradients(torch.optim.Optimizer):
    """A user's SGD that keeps a copy of every gradient its step saw."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["seen"] = p.grad.clone()
                    p.add_(p.grad, alpha=-group["lr"])


FP16_GROWING = {
    "param_dtype": "float16",
    "compute_dtype": "float16",
    "master_dtype": "float32",
    # The scale doubles after every clean step.
    "loss_scale": {"initial_scale": 1024.0, "window": 1},
}


@pytest.mark.parametrize(
    "built",
    [
        "handed to initialize",
        "built after initialize",
        "two handed in a list",
        "two handed in a list, clipped by the config",
    ],
)
def test_an_own_step_sees_the_gradients_of_its_backward_when_the_scale_grows(built):
    """fp16 loss scaling with the scale doubling after every clean step: the optimizer's own
    step reads the gradients unscaled by the scale their backward used -- exactly what
    `p.grad` read before the step -- traced steps and replayed ones alike (the scale moved on
    before the step, which then saw every gradient halved). Two optimizers on one model's
    gradients (Muon's matrices beside AdamW's rest) see them alike, and the scale moves once
    a step, not once per optimizer, also where the config's clipping rewrites the gradients
    between them (a norm so large that it scales by exactly 1)."""
    torch.manual_seed(0)
    module = Classifier()
    if built == "handed to initialize":
        model, optimizer = zerojax.initialize(
            module, KeepsItsGradients(module.parameters()), config(FP16_GROWING)
        )
        optimizers = [optimizer]
    elif built == "built after initialize":
        model, _ = zerojax.initialize(module, None, config(FP16_GROWING))
        optimizers = [KeepsItsGradients(model.parameters())]
    else:
        matrices = [p for p in module.parameters() if p.ndim == 2]
        rest = [p for p in module.parameters() if p.ndim != 2]
        clipped = {"train": {"gradient_clipping": 1e30}} if "clipped" in built else {}
        model, optimizers = zerojax.initialize(
            module,
            [KeepsItsGradients(matrices), KeepsItsGradients(rest)],
            config(FP16_GROWING, **clipped),
        )
    task = Task()
    scales = []
    for _ in range(5):
        x, y = task.batch()
        F.cross_entropy(model(x), y).backward()
        expected = [p.grad.numpy().copy() for p in model.parameters()]
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()
        seen = {id(p): s["seen"] for o in optimizers for p, s in o.state.items()}
        for p, grad in zip(model.parameters(), expected, strict=True):
            np.testing.assert_array_equal(seen[id(p)].numpy(), grad)
        scales.append(float(model.engine.loss_scale["scale"]))
    assert scales == [2048.0, 4096.0, 8192.0, 16384.0, 32768.0]


@pytest.mark.parametrize(
    ("make", "moment"),
    [
        (lambda p: torch.optim.AdamW(p, lr=2e-2), "exp_avg"),
        (lambda p: torch.optim.RMSprop(p, lr=2e-3), "square_avg"),
    ],
    ids=["AdamW (adopted by the compiled update)", "RMSprop (its own step)"],
)
def test_fp16_overflow_skips_the_step_of_an_optimizer_built_after_initialize(make, moment):
    """An optimizer built after `initialize` (minGPT, the HF Trainer) under fp16 loss scaling:
    an overflow skips its step -- parameters, master weights and its state untouched, the
    skip counted, the scale lowered -- where it applied the overflowed gradients before (the
    parameters became NaN); clean steps train. AdamW's step is the compiled update's
    (`late_optimizers`), RMSprop's its own on the live tensors."""
    torch.manual_seed(0)
    precision = {**FP16_GROWING, "loss_scale": {"initial_scale": 1024.0, "hysteresis": 1}}
    model, _ = zerojax.initialize(Classifier(), None, config(precision))
    optimizer = make(model.parameters())
    task = Task()
    losses = [step(model, optimizer, *task.batch())]

    def state():  # torch's format either way
        return [
            (np.array(s[moment].numpy()), float(s["step"]))
            for s in optimizer.state_dict()["state"].values()
        ]

    master_before = {n: np.asarray(a) for n, a in model.engine.master.items()}
    state_before = state()
    step(model, optimizer, *task.batch(), loss_factor=1e8)  # fp16 gradients overflow
    assert model.engine.skipped_steps == 1
    assert float(model.engine.loss_scale["scale"]) == 512.0
    for name, master in model.engine.master.items():
        np.testing.assert_array_equal(np.asarray(master), master_before[name], err_msg=name)
    after = state()
    assert len(after) == len(list(model.parameters()))
    for (value, count), (before, before_count) in zip(after, state_before, strict=True):
        np.testing.assert_array_equal(value, before)
        assert count == before_count == 1.0  # the skipped step does not count
    for _ in range(STEPS):
        losses.append(step(model, optimizer, *task.batch()))
    assert model.engine.skipped_steps == 1
    assert all(map(math.isfinite, losses))
    assert losses[-1] < 0.5 * losses[0], losses
