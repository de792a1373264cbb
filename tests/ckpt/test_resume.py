"""Resuming from a checkpoint continues training exactly where it stopped.

Run: `.venv/bin/python -m pytest -q tests/ckpt/test_resume.py -p no:cacheprovider`
Why: issue 5 promises that save -> kill -> restore in a *new process* gives the same losses and
parameters, bit for bit (fp32 on CPU), as never stopping -- dropout RNG, AdamW moments, the LR
scheduler and the data order included -- and that a run saved on 8-way ZeRO-3 resumes on a
4x2 data x fsdp ZeRO-1 mesh with its arrays placed by the new plan.

The model is tiny (dropout, BatchNorm buffers, ~1K params); data comes from a seeded
torch.Generator whose state travels in the checkpoint's `extra` dict, as a user would do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from zerojax.ckpt.checkpointer import Checkpointer

pytestmark = pytest.mark.multidevice

REPO = Path(__file__).resolve().parents[2]
ZERO3 = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
DATA4_FSDP2_ZERO1 = {"mesh": {"data": 4, "fsdp": 2}, "zero": {"stage": 1}}
HALF = 3
"""Steps before the checkpoint; the straight run trains 2 * HALF."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.drop(F.relu(self.norm(self.fc1(x)))))


def make(config: dict, seed: int = 0):
    """Wrapped model, AdamW and a warmup LambdaLR; `seed` changes the initial weights and the
    dropout key, which a restore must overwrite."""
    torch.manual_seed(seed)
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.05)
    model, optimizer = zerojax.initialize(net, optimizer, config=config, seed=seed + 7)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, generator: torch.Generator, steps: int) -> list[float]:
    """The unchanged torch loop; each batch drawn from `generator`."""
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 16, generator=generator)
        y = torch.randint(0, 8, (16,), generator=generator)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(model, optimizer, scheduler, losses) -> dict:
    state = optimizer.state_dict()["state"]
    return {
        "losses": losses,
        "params": {k: v.numpy().copy() for k, v in model.state_dict().items()},
        "exp_avg": {i: s["exp_avg"].numpy().copy() for i, s in state.items()},
        "exp_avg_sq": {i: s["exp_avg_sq"].numpy().copy() for i, s in state.items()},
        "lr": [g["lr"] for g in optimizer.param_groups],
        "last_lr": scheduler.get_last_lr(),
    }


def resume_and_train(directory: str, config: dict, steps: int, out: str) -> None:
    """Entry point of the resumed process: fresh weights, restore, `steps` more steps."""
    model, optimizer, scheduler = make(config, seed=123)
    with Checkpointer(directory, model, optimizer, scheduler=scheduler) as ckpt:
        state = ckpt.restore()
    generator = torch.Generator()
    generator.set_state(torch.tensor(state.extra["data_rng"], dtype=torch.uint8))
    losses = train(model, optimizer, scheduler, generator, steps)
    torch.save({"step": state.step, **snapshot(model, optimizer, scheduler, losses)}, out)


def straight_run(config: dict) -> dict:
    model, optimizer, scheduler = make(config)
    losses = train(model, optimizer, scheduler, torch.Generator().manual_seed(5), 2 * HALF)
    return snapshot(model, optimizer, scheduler, losses)


def first_half(config: dict, directory: Path) -> list[float]:
    model, optimizer, scheduler = make(config)
    generator = torch.Generator().manual_seed(5)
    losses = train(model, optimizer, scheduler, generator, HALF)
    with Checkpointer(directory, model, optimizer, scheduler=scheduler) as ckpt:
        assert ckpt.save(HALF, extra={"data_rng": generator.get_state()})
    return losses


def assert_same(resumed: dict, straight: dict, *, exact: bool, tol: float = 1e-6) -> None:
    check = (
        np.testing.assert_array_equal
        if exact
        else lambda a, b, err_msg="": np.testing.assert_allclose(
            a, b, rtol=0, atol=tol, err_msg=err_msg
        )
    )
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert resumed[key].keys() == straight[key].keys()
        for name in straight[key]:
            check(resumed[key][name], straight[key][name], err_msg=f"{key}[{name}]")
    assert resumed["lr"] == straight["lr"]
    assert resumed["last_lr"] == straight["last_lr"]


def test_exact_resume_in_a_new_process(tmp_path):
    straight = straight_run(ZERO3)
    first = first_half(ZERO3, tmp_path / "ckpt")
    out = tmp_path / "resumed.pt"
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import json;"
        "from tests.ckpt.test_resume import resume_and_train;"
        "resume_and_train(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5])"
    )
    env = dict(os.environ)  # conftest's XLA_FLAGS: the same 8 simulated devices
    assert "xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(REPO),
            str(tmp_path / "ckpt"),
            json.dumps(ZERO3),
            str(HALF),
            str(out),
        ],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = torch.load(out, weights_only=False)
    assert resumed["step"] == HALF
    assert first + resumed["losses"] == straight["losses"]  # exact float equality
    assert_same(resumed, straight, exact=True)
    # Not vacuous: training moved the weights and dropout made the steps differ.
    assert len(set(straight["losses"])) == 2 * HALF


def test_resume_on_a_different_mesh_and_zero_stage(tmp_path):
    straight = straight_run(ZERO3)
    first = first_half(ZERO3, tmp_path / "ckpt")
    model, optimizer, scheduler = make(DATA4_FSDP2_ZERO1, seed=123)
    with Checkpointer(tmp_path / "ckpt", model, optimizer, scheduler=scheduler) as ckpt:
        state = ckpt.restore()
    engine = model.engine
    assert dict(engine.mesh.shape) == {"data": 4, "fsdp": 2} and engine.plan.stage == 1
    for name, array in engine.params.items():
        assert array.sharding == engine.plan.params[name], name
    for key in ("exp_avg", "exp_avg_sq"):
        for name, array in engine.opt_state[key].items():
            assert array.sharding.is_equivalent_to(engine.plan.opt_state[name], array.ndim)
            assert array.sharding.spec == engine.plan.opt_state[name].spec, (key, name)
    # ZeRO-1 over 8 devices really splits the moments the 8-way ZeRO-3 run saved.
    assert any(
        a.sharding.spec != engine.plan.params[n].spec
        for n, a in engine.opt_state["exp_avg"].items()
    )
    generator = torch.Generator()
    generator.set_state(torch.tensor(state.extra["data_rng"], dtype=torch.uint8))
    losses = train(model, optimizer, scheduler, generator, HALF)
    resumed = snapshot(model, optimizer, scheduler, losses)
    np.testing.assert_allclose(first + losses, straight["losses"], rtol=0, atol=1e-6)
    assert_same(resumed, straight, exact=False)
    assert state.config_at_save["zero"]["stage"] == 3
