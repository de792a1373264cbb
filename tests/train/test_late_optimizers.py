"""torch's AdamW, Adam and SGD built after `initialize` take the compiled update's path.

Run: .venv/bin/python -m pytest -q tests/train/test_late_optimizers.py -p no:cacheprovider
Why: minGPT's trainer and the Hugging Face Trainer build their optimizer on the model
`initialize` returned. `zerojax.train.late_optimizers` adopts such an optimizer at its first
step (or when a Checkpointer is handed it) as the engine's compiled update, so it must step
bitwise as the same optimizer handed to `initialize` does, under an LR schedule, with a
closure and the user's step hooks, after a resume through `load_state_dict`, and through a
checkpoint; and every optimizer it does not adopt must still train as torch does. Against
plain torch the tolerance is test_torch_optimizers' (two float32 runs of one loop with
reordered sums: losses 1e-5 relative).
"""

from __future__ import annotations

import copy
import io

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax._src import dispatch
from torch import nn

import zerojax
from zerojax.train import late_optimizers

pytestmark = pytest.mark.multidevice

ZERO3 = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}, "train": {"gradient_clipping": 0.5}}
STEPS = 6


def decay_groups(params) -> list[dict]:
    """The HF Trainer's and minGPT's two param groups: weight decay on the matrices only."""
    params = list(params)
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


ADOPTED = {
    "fused AdamW (the HF Trainer's)": lambda p: torch.optim.AdamW(
        decay_groups(p), lr=1e-2, fused=True
    ),
    "foreach AdamW (minGPT's)": lambda p: torch.optim.AdamW(decay_groups(p), lr=1e-2),
    "Adam amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "SGD Nesterov": lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, nesterov=True),
}


def module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 10))


def batches(seed: int, steps: int = STEPS):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 8, generator=generator), torch.randint(0, 10, (16,), generator=generator))
        for _ in range(steps)
    ]


def train(model, optimizer, data, scheduler=None) -> list[float]:
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.detach()))
    return losses


def cosine(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)


def host_params(model) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def assert_same_state_dicts(a: dict, b: dict) -> None:
    flat_a, tree_a = torch.utils._pytree.tree_flatten(a)
    flat_b, tree_b = torch.utils._pytree.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(flat_a, flat_b, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


class Compiles:
    """XLA compilations while listening."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, secs, **_):
        self.count += event == dispatch.BACKEND_COMPILE_EVENT

    def close(self):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


@pytest.mark.parametrize("name", list(ADOPTED))
def test_built_after_initialize_it_steps_as_if_handed_to_initialize(name):
    """The same optimizer and cosine schedule, built after `initialize` or handed to it: the
    same losses, parameters and `state_dict()` bit for bit (one compiled update, the config's
    clipping included), its state in the TrainState only; torch's numbers; and no
    compilation after the second step."""
    handed_module = module()
    handed_optimizer = ADOPTED[name](handed_module.parameters())
    handed_scheduler = cosine(handed_optimizer)
    handed, handed_optimizer = zerojax.initialize(handed_module, handed_optimizer, ZERO3)
    twin = module()
    twin_optimizer = ADOPTED[name](twin.parameters())
    model, _ = zerojax.initialize(module(), None, ZERO3)
    optimizer = ADOPTED[name](model.parameters())
    scheduler = cosine(optimizer)

    data = batches(seed=1)
    compiles = Compiles()
    try:
        losses, after_two = [], None
        for step, batch in enumerate(data):
            losses += train(model, optimizer, [batch], scheduler)
            after_two = compiles.count if step == 1 else after_two
        assert compiles.count == after_two
    finally:
        compiles.close()
    assert losses == train(handed, handed_optimizer, data, handed_scheduler)
    handed_weights = host_params(handed)
    for param_name, weight in host_params(model).items():
        np.testing.assert_array_equal(weight, handed_weights[param_name], err_msg=param_name)
    assert_same_state_dicts(optimizer.state_dict(), handed_optimizer.state_dict())
    assert late_optimizers.compiled_for(optimizer) is not None and not optimizer.state
    assert model.engine.updates_applied == STEPS

    twin_losses = []
    twin_scheduler = cosine(twin_optimizer)
    for x, y in data:
        loss = F.cross_entropy(twin(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)  # the config's clipping
        twin_optimizer.step()
        twin_optimizer.zero_grad()
        twin_scheduler.step()
        twin_losses.append(float(loss.detach()))
    np.testing.assert_allclose(losses, twin_losses, rtol=1e-5)


def test_a_closure_runs_before_the_update_and_the_users_hooks_around_it():
    """`step(closure)` (Lightning's way) returns the closure's loss, computed before the
    update; the user's pre-step hook sees the parameters before it and the post-step hook
    (registered before the first step) after it, each once per step."""
    model, _ = zerojax.initialize(module(), None, ZERO3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = next(model.parameters())
    seen = {"pre": [], "post": []}
    optimizer.register_step_pre_hook(
        lambda o, a, k: seen["pre"].append(first.detach().numpy().copy())
    )
    optimizer.register_step_post_hook(
        lambda o, a, k: seen["post"].append(first.detach().numpy().copy())
    )
    for x, y in batches(seed=2, steps=3):
        before = first.detach().numpy().copy()

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        loss = optimizer.step(closure)
        after = first.detach().numpy().copy()
        assert not np.array_equal(before, after)
        np.testing.assert_array_equal(seen["pre"][-1], before)
        np.testing.assert_array_equal(seen["post"][-1], after)
        assert loss is not None and np.isfinite(float(loss.detach()))
    assert len(seen["pre"]) == len(seen["post"]) == 3
    assert model.engine.updates_applied == 3


def test_state_loaded_before_the_first_step_is_taken_over():
    """The HF Trainer resuming: a fresh optimizer built after `initialize` gets torch's
    `state_dict` (host tensors, through torch.save) before its first step; the engine takes
    it over, and training continues bit for bit as the run that saved it."""
    data = batches(seed=3, steps=2 * STEPS)
    model, _ = zerojax.initialize(module(), None, ZERO3)
    optimizer = ADOPTED["fused AdamW (the HF Trainer's)"](model.parameters())
    train(model, optimizer, data[:STEPS])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    expected = train(model, optimizer, data[STEPS:])

    resumed, _ = zerojax.initialize(module(), None, ZERO3)
    resumed_optimizer = ADOPTED["fused AdamW (the HF Trainer's)"](resumed.parameters())
    checkpoint = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    assert train(resumed, resumed_optimizer, data[STEPS:]) == expected
    assert not resumed_optimizer.state  # held once: in the TrainState


def test_a_checkpointer_takes_it_before_its_first_step(tmp_path):
    """Handed to a Checkpointer before it has stepped (a script restoring at start-up), the
    optimizer is adopted then: its state round-trips bitwise through Orbax, and the restored
    run continues as the saved one."""
    data = batches(seed=4, steps=2 * STEPS)
    model, _ = zerojax.initialize(module(), None, ZERO3)
    optimizer = ADOPTED["foreach AdamW (minGPT's)"](model.parameters())
    with zerojax.Checkpointer(tmp_path / "run", model, optimizer, async_save=False) as saver:
        train(model, optimizer, data[:STEPS])
        saver.save(STEPS, force=True)
    saved = jax.tree.map(np.asarray, model.engine.state.opt_state)
    expected = train(model, optimizer, data[STEPS:])

    other, _ = zerojax.initialize(module(), None, ZERO3)
    other_optimizer = ADOPTED["foreach AdamW (minGPT's)"](other.parameters())
    zerojax.Checkpointer(tmp_path / "run", other, other_optimizer).restore()
    assert late_optimizers.compiled_for(other_optimizer) is not None
    restored = jax.tree.map(np.asarray, other.engine.state.opt_state)
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert train(other, other_optimizer, data[STEPS:]) == expected


@pytest.mark.parametrize(
    "adopted_first", [False, True], ids=["stepped first under the scaler", "adopted before"]
)
def test_torch_s_grad_scaler_scale_is_taken_out_once(tmp_path, adopted_first):
    """torch's GradScaler hands a fused optimizer's step its scale instead of unscaling the
    gradients (SGD shows it: its update, unlike Adam's, scales with the gradients). An
    optimizer whose first step comes with that scale is left to torch's step, which takes it
    out; one adopted before its first step (a Checkpointer handed it) no longer asks for it,
    so the scaler unscales the gradients itself, as for a handed-over optimizer. Either way
    torch's numbers (a power-of-two scale: unscaling is exact; 1e-5 as above)."""
    config = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
    model, _ = zerojax.initialize(module(), None, config)
    twin = module()
    make = lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9, fused=True)
    optimizer, twin_optimizer = make(model.parameters()), make(twin.parameters())
    if adopted_first:
        zerojax.Checkpointer(tmp_path / "run", model, optimizer)
    losses = {id(model): [], id(twin): []}
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for x, y in batches(seed=7):
            loss = F.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
            losses[id(m)].append(float(loss.detach()))
    assert (late_optimizers.compiled_for(optimizer) is not None) == adopted_first
    np.testing.assert_allclose(losses[id(model)], losses[id(twin)], rtol=1e-5)
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        np.testing.assert_allclose(
            ours.detach().numpy(), theirs.detach().numpy(), rtol=1e-5, atol=1e-7
        )


class OwnAdamW(torch.optim.AdamW):
    """A user's own class: only torch's exact classes are the compiled update's."""


NOT_ADOPTED = {
    "a subclass": lambda model: [OwnAdamW(model.parameters(), lr=1e-2)],
    "two optimizers, each on part of the model": lambda model: [
        torch.optim.AdamW(list(model.parameters())[:2], lr=1e-2),
        torch.optim.SGD(list(model.parameters())[2:], lr=5e-2, momentum=0.9),
    ],
}


@pytest.mark.parametrize("name", list(NOT_ADOPTED))
def test_other_optimizers_run_their_own_step_as_torch_does(name):
    """A subclass, or one of several optimizers that each train part of the model (Muon
    beside AdamW): none is adopted (the engine holds no optimizer), each runs torch's step on
    the live tensors, with torch's numbers."""
    no_clipping = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
    model, _ = zerojax.initialize(module(), None, no_clipping)
    twin = module()
    ours, theirs = NOT_ADOPTED[name](model), NOT_ADOPTED[name](twin)
    losses = {id(model): [], id(twin): []}
    for x, y in batches(seed=5):
        for m, optimizers in ((model, ours), (twin, theirs)):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            losses[id(m)].append(float(loss.detach()))
    assert all(late_optimizers.compiled_for(o) is None for o in ours)
    assert model.engine.optimizer_spec is None
    np.testing.assert_allclose(losses[id(model)], losses[id(twin)], rtol=1e-5)


def test_an_adopted_optimizer_saves_torch_tensors_and_takes_no_new_groups():
    """An adopted optimizer's `state_dict()` is torch's format with plain tensors (what
    `torch.save` writes for the Trainer's checkpoint), and a param group added after its
    update was compiled is refused, naming why (the compiled update has a fixed set)."""
    model, _ = zerojax.initialize(module(), None, ZERO3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, batches(seed=6, steps=1))
    state = copy.deepcopy(optimizer.state_dict())
    tensors = [v for s in state["state"].values() for v in s.values()]
    assert tensors and all(type(t) is torch.Tensor for t in tensors)
    assert state["param_groups"][0]["lr"] == 1e-2
    extra = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="add_param_group is not supported once zerojax"):
        optimizer.add_param_group({"params": [extra]})
    assert len(optimizer.param_groups) == 1
