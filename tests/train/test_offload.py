"""Optimizer offload (ZeRO-Offload, issue 27): optimizer state and master weights in host memory.

Run: `.venv/bin/python -m pytest -q tests/train/test_offload.py -p no:cacheprovider`
Why: `offload: {optimizer: host, master: host}` (DeepSpeed's `offload_optimizer: {device:
cpu}`) only changes where those arrays live: on their ZeRO shardings in the `pinned_host`
memory kind, moved to the device and back inside the update program. The update's arithmetic is
the same program's, so on CPU an offloaded run must equal the run without offload bit for bit
(losses, parameters, optimizer state), under ZeRO-1/2/3 on 8 devices, in fp32 and with bf16
params and fp32 masters; and a checkpoint saved with one setting resumes under the other.
"""

from __future__ import annotations

import jax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from zerojax.ckpt.checkpointer import Checkpointer

pytestmark = pytest.mark.multidevice

BF16_MASTER = "params=bfloat16,compute=bfloat16,master=float32"
STEPS = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(F.relu(self.fc1(x)))


def config_for(stage: int, precision: str | None, offload: bool) -> dict:
    config: dict = {"mesh": {"data": 8}, "zero_stage": stage}
    if precision is not None:
        config["precision"] = precision
    if offload:
        config["offload"] = {"optimizer": "host", **({"master": "host"} if precision else {})}
    return config


def make(config: dict):
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.05)
    return zerojax.initialize(net, optimizer, config=config, seed=7)


def train(model, optimizer, generator: torch.Generator, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 16, generator=generator)
        y = torch.randint(0, 8, (16,), generator=generator)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def memory_kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def assert_same_state(model_a, opt_a, model_b, opt_b) -> None:
    weights_a, weights_b = model_a.state_dict(), model_b.state_dict()
    for name, value in weights_a.items():
        assert torch.equal(value, weights_b[name]), name
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for index, entries in state_a.items():
        for key, value in entries.items():
            assert torch.equal(value, state_b[index][key]), (index, key)


@pytest.mark.parametrize("precision", [None, BF16_MASTER], ids=["fp32", "bf16-master"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_training_is_bitwise_the_device_run(stage, precision):
    model, optimizer = make(config_for(stage, precision, offload=False))
    losses = train(model, optimizer, torch.Generator().manual_seed(5), STEPS)
    hosted_model, hosted_optimizer = make(config_for(stage, precision, offload=True))
    hosted_losses = train(hosted_model, hosted_optimizer, torch.Generator().manual_seed(5), STEPS)

    assert hosted_losses == losses
    assert_same_state(model, optimizer, hosted_model, hosted_optimizer)
    engine = hosted_model.engine
    assert memory_kinds(engine.opt_state) == {"pinned_host"}  # moments and step counts
    assert memory_kinds(engine.params) == {"device"}  # the update brings new params back
    if precision is not None:
        assert memory_kinds(engine.master) == {"pinned_host"}
    # On their ZeRO shardings, only in another memory: the same layout as without offload.
    for name, sharding in model.engine.plan.opt_state.items():
        hosted = engine.plan.opt_state[name]
        assert hosted == sharding.with_memory_kind("pinned_host")
        moment = engine.opt_state["exp_avg"][name]
        assert moment.sharding.is_equivalent_to(hosted, moment.ndim)
    # torch ops on a parameter read its (offloaded) master weight on the device.
    x = torch.randn(4, 16)
    weight, hosted_weight = model.fc1.weight, hosted_model.fc1.weight
    assert torch.equal(F.linear(x, hosted_weight), F.linear(x, weight))


def save_and_resume(save_config: dict, resume_config: dict, directory) -> list[float]:
    """Train STEPS, save; a fresh model under `resume_config` restores and trains STEPS more."""
    model, optimizer = make(save_config)
    generator = torch.Generator().manual_seed(5)
    train(model, optimizer, generator, STEPS)
    with Checkpointer(directory, model, optimizer) as checkpointer:
        assert checkpointer.save(STEPS, extra={"data_rng": generator.get_state()})
    resumed, resumed_optimizer = make(resume_config)
    with Checkpointer(directory, resumed, resumed_optimizer) as checkpointer:
        state = checkpointer.restore()
    generator.set_state(torch.tensor(state.extra["data_rng"], dtype=torch.uint8))
    engine = resumed.engine
    offloaded = "offload" in resume_config
    assert memory_kinds(engine.opt_state) == {"pinned_host" if offloaded else "device"}
    assert memory_kinds(engine.master) == {"pinned_host" if offloaded else "device"}
    return train(resumed, resumed_optimizer, generator, STEPS)


@pytest.mark.parametrize("saved_offloaded", [False, True], ids=["device-to-host", "host-to-device"])
def test_resume_across_offload_settings(saved_offloaded, tmp_path):
    """ZeRO-2, bf16 params with fp32 masters: a checkpoint is the same whichever memory the
    state lived in, and restores into either."""
    device = config_for(2, BF16_MASTER, offload=False)
    hosted = config_for(2, BF16_MASTER, offload=True)
    model, optimizer = make(device)
    straight = train(model, optimizer, torch.Generator().manual_seed(5), 2 * STEPS)
    save, resume = (hosted, device) if saved_offloaded else (device, hosted)
    assert save_and_resume(save, resume, tmp_path) == straight[STEPS:]


def test_optimizer_running_its_own_step_is_refused_with_offload():
    """Optimizers other than Adam/AdamW/SGD run torch's step on live tensors, outside the
    compiled update that moves the state in and out of host memory."""
    torch.manual_seed(0)
    net = Net()
    with pytest.raises(ValueError, match=r"^zerojax: offload.optimizer=host moves state"):
        zerojax.initialize(
            net, torch.optim.RMSprop(net.parameters()), config=config_for(1, None, offload=True)
        )


def test_memory_report_splits_device_and_host_bytes():
    """The planner counts offloaded state in host memory: not beside forward and backward."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    args = (torch.randn(16, 64),)
    device = zerojax.memory_report(net, args, config_for(2, BF16_MASTER, offload=False))
    hosted = zerojax.memory_report(net, args, config_for(2, BF16_MASTER, offload=True))
    assert [c.host for c in hosted.components] == [False, False, True, True]
    assert [c.measured for c in hosted.components] == [c.measured for c in device.components]
    assert hosted.host_total == hosted["opt_state"].measured + hosted["master_weights"].measured
    assert hosted.device_total == hosted.measured_total - hosted.host_total
    assert device.host_total == 0
    # Here the backward pass sets the peak: its resident state loses the offloaded bytes.
    backward = hosted.programs["backward"].peak_estimate
    assert hosted.step_peak == backward + hosted["params"].measured
    assert device.step_peak == backward + device.measured_total - device["grads"].measured
