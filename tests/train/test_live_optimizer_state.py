"""The state of optimizers that run their own step, held as the engine's TrainState.

Run: .venv/bin/python -m pytest -q tests/train/test_live_optimizer_state.py -p no:cacheprovider
Why: an optimizer zerojax does not compile (RMSprop, Adafactor, NAdam, a user's own class)
keeps its state in `optimizer.state[p]`, where torch's own step reads it. These tests show that
state is the engine's too (`zerojax.train.live_optimizer_state`): `engine.state.opt_state` on
the ZeRO stage's shardings; Orbax checkpoints that round-trip it bitwise, into an optimizer that
has not stepped yet and onto another mesh; the memory plan counting it; and
`offload.optimizer: host` keeping it in host memory between steps with the same numbers. An
optimizer built after `initialize` on the model's parameters (minGPT, the HF Trainer) gets the
same placement (`zerojax.train.late_optimizers`).
"""

from __future__ import annotations

import copy
import io

import jax
import numpy as np
import pytest
import torch
from torch import nn

import zerojax
from tests.train.test_torch_optimizers import SignMomentum

pytestmark = pytest.mark.multidevice

ZERO3 = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
# Another mesh and stage: the optimizer state splits 8 ways over two axes instead of one.
ZERO1_4X2 = {"mesh": {"fsdp": 4, "data": 2}, "zero": {"stage": 1}}

OPTIMIZERS = {
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, weight_decay=0.01),
    # Factored second moments (row/column vectors: not parameter-shaped) and `.item()` reads.
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    # `mu_product`: a second host scalar beside the step count.
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "SignMomentum (user-defined)": lambda p: SignMomentum(p),
}


def make(config, make_optimizer):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    return zerojax.initialize(module, make_optimizer(module.parameters()), config)


def train(model, optimizer, steps: int, seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def host(tree) -> dict:
    return jax.tree.map(np.asarray, tree)


def assert_bitwise(a: dict, b: dict) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def test_state_is_the_train_state_on_the_zero_shardings():
    model, optimizer = make(ZERO3, OPTIMIZERS["RMSprop"])
    assert model.engine.state.opt_state == {}  # torch makes state at the first step
    train(model, optimizer, 2, seed=0)
    engine, torch_state = model.engine, optimizer.torch_optimizer.state
    opt_state = engine.state.opt_state
    assert sorted(opt_state) == ["momentum_buffer", "square_avg", "step"]
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in torch_state.items():
        name = names[id(param)]
        for key, value in state.items():
            array = opt_state[key][name]
            np.testing.assert_array_equal(np.asarray(array), value.numpy(force=True))
            if value.ndim:  # ZeRO-3: the parameter's optimizer-state shards, 1/8 per device
                assert array.sharding == engine.plan.opt_state[name]
                assert array.addressable_shards[0].data.size * 8 == array.size
            else:  # the step count, as torch keeps it (a host tensor), replicated here
                assert type(value) is torch.Tensor and array.sharding.is_fully_replicated


def saved_then_continued(tmp_path, name: str):
    """ZeRO-3 with optimizer `name`: 3 steps, a checkpoint in tmp_path/run, 2 more steps.
    (The model, its optimizer state at the save, the last 2 steps' losses.)"""
    model, optimizer = make(ZERO3, OPTIMIZERS[name])
    train(model, optimizer, 3, seed=0)
    saved = host(model.engine.state.opt_state)
    with zerojax.Checkpointer(tmp_path / "run", model, optimizer, async_save=False) as ckpt:
        ckpt.save(3, force=True)
    return model, saved, train(model, optimizer, 2, seed=1)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_checkpoint_round_trips_bitwise_into_an_optimizer_that_has_not_stepped(tmp_path, name):
    """Saved after 3 steps and restored into a fresh model and optimizer (no state yet): the
    state is bitwise the saved one, and the next 2 steps are bitwise those of the run that
    went on."""
    model, saved, expected = saved_then_continued(tmp_path, name)
    other, other_optimizer = make(ZERO3, OPTIMIZERS[name])
    assert zerojax.Checkpointer(tmp_path / "run", other, other_optimizer).restore().step == 3
    assert_bitwise(host(other.engine.state.opt_state), saved)
    assert train(other, other_optimizer, 2, seed=1) == expected
    assert_bitwise(host(other.engine.state.opt_state), host(model.engine.state.opt_state))
    assert_bitwise(host(other.engine.state.params), host(model.engine.state.params))


@pytest.mark.parametrize("name", ["RMSprop", "Adafactor"])
def test_checkpoint_resumes_onto_another_mesh(tmp_path, name):
    _, saved, expected = saved_then_continued(tmp_path, name)
    other, other_optimizer = make(ZERO1_4X2, OPTIMIZERS[name])
    zerojax.Checkpointer(tmp_path / "run", other, other_optimizer).restore()
    restored = other.engine.state.opt_state
    assert_bitwise(host(restored), saved)
    for values in restored.values():
        for param, array in values.items():
            if array.ndim and array.shape == other.engine.state.params[param].shape:
                assert array.sharding == other.engine.plan.opt_state[param]
    # Another mesh sums each gradient's 16 rows in another order: float32 rounding, 16 ulp at
    # most per gradient, then two steps of an update that divides by a root of the moments.
    np.testing.assert_allclose(train(other, other_optimizer, 2, seed=1), expected, rtol=1e-5)


def test_memory_plan_counts_the_state():
    """`zerojax.memory_report` (what `zerojax plan` prints) counts the state each optimizer's
    own step makes: RMSprop with momentum two parameter-sized moments split 8 ways, Adafactor
    its factored row and column vectors, replicated."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    x = torch.randn(8, 64)

    def opt_state_bytes(make_optimizer) -> int:
        report = zerojax.memory_report(module, (x,), ZERO3, optimizer=make_optimizer)
        (component,) = [c for c in report.components if c.name == "opt_state"]
        return component.measured

    params = sum(p.numel() for p in module.parameters())
    steps = 4 * 4  # four float32 step counts, replicated
    assert opt_state_bytes(OPTIMIZERS["RMSprop"]) == 2 * 4 * params // 8 + steps
    factored = (128 + 64) * 4 + (64 + 128) * 4  # each weight's row and column means
    variances = 4 * (128 + 64) // 8  # the biases' full second moments, split
    assert opt_state_bytes(OPTIMIZERS["Adafactor"]) == factored + variances + steps


# Adafactor: its step is one recorded op whose results include vectors shaped like parameters
# (a donated device buffer must not be handed to a result bound for host memory).
@pytest.mark.parametrize("name", ["RMSprop", "Adafactor"])
def test_offloaded_state_lives_on_the_host_with_the_same_numbers(name):
    config = {"mesh": {"fsdp": 8}, "zero": {"stage": 1}}
    on_device = make(config, OPTIMIZERS[name])
    offloaded = make({**config, "offload": {"optimizer": "host"}}, OPTIMIZERS[name])
    assert train(*offloaded, 3, seed=0) == train(*on_device, 3, seed=0)
    state = offloaded[0].engine.state.opt_state
    kinds = {a.sharding.memory_kind for values in state.values() for a in values.values()}
    assert kinds == {"pinned_host"}
    # and the parameter-shaped live tensors the next step reads, which the last (captured)
    # step wrote (Adafactor's row and column means stay on the devices between steps)
    live = [
        value
        for param, values in offloaded[1].state.items()
        for value in values.values()
        if value.shape == param.shape
    ]
    assert live and {v.array.sharding.memory_kind for v in live} == {"pinned_host"}
    assert_bitwise(host(state), host(on_device[0].engine.state.opt_state))


class HoldsAFloat(torch.optim.Optimizer):
    """A user's optimizer keeping a Python number in its state."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-2})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["scale"] = 0.5
                p.add_(p.grad, alpha=-group["lr"])


def test_state_a_checkpoint_cannot_hold_is_named(tmp_path):
    model, optimizer = make(ZERO3, HoldsAFloat)
    train(model, optimizer, 1, seed=0)  # training itself is unaffected
    with pytest.raises(ValueError, match=r"optimizer state 'scale' of parameter '0\.weight'"):
        zerojax.Checkpointer(tmp_path / "run", model, optimizer).save(1, force=True)
    assert not list((tmp_path / "run").glob("1*"))  # nothing half-written


def test_an_optimizer_built_after_initialize_checkpoints_the_same(tmp_path):
    """minGPT's trainer and the HF Trainer build their optimizer on the returned model's
    parameters: handed to the Checkpointer, its state joins the TrainState and round-trips."""

    def built_after(config):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        model, _ = zerojax.initialize(module, None, config)
        return model, OPTIMIZERS["RMSprop"](model.parameters())

    model, optimizer = built_after(ZERO3)
    train(model, optimizer, 3, seed=0)
    with zerojax.Checkpointer(tmp_path / "run", model, optimizer, async_save=False) as ckpt:
        ckpt.save(3, force=True)
    saved = host(model.engine.state.opt_state)
    assert sorted(saved) == ["momentum_buffer", "square_avg", "step"]
    expected = train(model, optimizer, 2, seed=1)

    other, other_optimizer = built_after(ZERO3)
    zerojax.Checkpointer(tmp_path / "run", other, other_optimizer).restore()
    assert_bitwise(host(other.engine.state.opt_state), saved)
    assert train(other, other_optimizer, 2, seed=1) == expected

    stranger = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0, parameter 0 \(shape \(2, 2\)\) is not"):
        zerojax.Checkpointer(tmp_path / "other", other, stranger)


# Built after `initialize` on the model's parameters.
LATE = {
    "fused AdamW (the HF Trainer's)": lambda p: torch.optim.AdamW(
        p, lr=1e-2, weight_decay=0.1, fused=True
    ),
    "foreach AdamW (minGPT's)": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "RMSprop": OPTIMIZERS["RMSprop"],
}
ZERO1 = {"mesh": {"fsdp": 8}, "zero": {"stage": 1}}


def built_after_initialize(config, make_optimizer):
    """(model, the optimizer built on its parameters after `initialize`, a plain-torch twin of
    both)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    twin = copy.deepcopy(module)
    model, _ = zerojax.initialize(module, None, config)
    return model, make_optimizer(model.parameters()), twin, make_optimizer(twin.parameters())


def state_arrays(model, optimizer):
    """(parameter name, state key, array) of each non-scalar state tensor of an optimizer built
    after `initialize`: the engine's TrainState where the compiled update adopted it (torch's
    own AdamW), its live tensors where it runs its own step (RMSprop)."""
    adopted = model.engine.optimizer_spec is not None
    assert adopted == isinstance(optimizer, torch.optim.AdamW)
    if adopted:
        assert not optimizer.state  # held once: in the TrainState
        state = model.engine.state.opt_state
        for key in ("exp_avg", "exp_avg_sq"):  # the step counts: one vector per param group
            for name, array in state[key].items():
                yield name, key, array
        return
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if value.ndim:
                yield names[id(param)], key, value.array


@pytest.mark.parametrize("name", list(LATE))
def test_an_optimizer_built_after_initialize_keeps_its_state_on_the_zero_shardings(name):
    """ZeRO-1 replicates the parameters and partitions the optimizer state: the moments of an
    optimizer built after `initialize` are 1/8 per device as the plan says (they took their
    parameter's replicated sharding before), also after a resume through torch's
    `load_state_dict`, and the numbers are torch's (1e-5 relative: see
    tests/train/test_torch_optimizers.py)."""
    model, optimizer, twin, twin_optimizer = built_after_initialize(ZERO1, LATE[name])
    losses = train(model, optimizer, 3, seed=0)
    np.testing.assert_allclose(losses, train(twin, twin_optimizer, 3, seed=0), rtol=1e-5)
    # A resume (the HF Trainer's): the state comes back as host tensors, placed at the step.
    for o in (optimizer, twin_optimizer):
        saved = io.BytesIO()
        torch.save(o.state_dict(), saved)
        o.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    losses = train(model, optimizer, 2, seed=1)
    np.testing.assert_allclose(losses, train(twin, twin_optimizer, 2, seed=1), rtol=1e-5)
    plan = model.engine.plan
    placed = 0
    for param_name, key, array in state_arrays(model, optimizer):
        assert array.sharding.is_equivalent_to(plan.opt_state[param_name], array.ndim), key
        assert array.addressable_shards[0].data.size * 8 == array.size, (param_name, key)
        placed += 1
    assert placed >= 2 * len(list(model.parameters()))  # two moments each


@pytest.mark.parametrize("name", ["fused AdamW (the HF Trainer's)", "RMSprop"])
def test_an_optimizer_built_after_initialize_has_its_state_offloaded(name):
    """`offload.optimizer: host`: the state of an optimizer built after `initialize` lives in
    host memory between steps (it stayed on the devices before), with the same numbers as
    on the devices."""
    on_device = built_after_initialize(ZERO1, LATE[name])
    offloaded = built_after_initialize({**ZERO1, "offload": {"optimizer": "host"}}, LATE[name])
    assert train(*offloaded[:2], 3, seed=0) == train(*on_device[:2], 3, seed=0)
    kinds = {array.sharding.memory_kind for *_, array in state_arrays(*offloaded[:2])}
    assert kinds == {"pinned_host"}
