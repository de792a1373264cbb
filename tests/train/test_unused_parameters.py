"""Gradients as torch has them: `None` for a parameter the loss does not reach, zeros kept by
`zero_grad(set_to_none=False)`, and every optimizer skipping exactly what torch's skip.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/train/test_unused_parameters.py
Why (issue 41): zerojax gave a parameter outside the loss's graph a zero gradient, so AdamW
decayed it and moved its moments (a multi-task head, a layer a branch skips, a GAN's other
network, an adapter switched off); and `zero_grad(set_to_none=False)` dropped the gradients, so
the next step skipped the update torch makes with zero gradients. Each test runs the same
seeded model and inputs through plain torch eager and through zerojax (8 simulated devices)
and compares `p.grad is None` and the parameters after every step.

Tolerance (`PARAM_TOL`, absolute, per parameter element after each step): both sides evaluate
the same float32 sums in different orders. A gradient element is a sum of at most
TERMS = BATCH * HIDDEN = 128 products (the trunk's weight: batch rows times the heads' fan-in),
so the two sides' gradients differ by at most reordered_sum = 2 (TERMS - 1) u sum|terms|
(1.5e-5 relative to sum|terms|, Higham (4.4)). Every optimizer here moves a parameter by a
map of its gradient whose relative sensitivity is at most 1 per step (SGD: lr * g; Adam:
m / sqrt(v), homogeneous of degree 0, so a relative change of g changes it by at most as much),
except where a gradient element cancels to near zero; we allow a cancellation factor of 8, so
per step lr * 1.5e-5 * 8 * |update| with |update| <= 1 (Adam's first steps, and SGD's
gradients here are < 1), summed over the steps. The differences these tests exist for are
far above that: weight decay 0.5 at lr 1e-2 moves a weight by 0.5 % of itself (~1e-3), a
momentum step by ~lr (1e-2).
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from tests import tolerances

pytestmark = pytest.mark.multidevice

IN, HIDDEN, CLASSES, BATCH = 12, 16, 6, 8
LR = 1e-2
TERMS = BATCH * HIDDEN
CANCELLATION = 8
PER_STEP_TOL = LR * CANCELLATION * tolerances.reordered_sum(torch.float32, TERMS, 1.0)


def param_tol(steps: int) -> float:
    return steps * PER_STEP_TOL


OPTIMIZERS = {
    # The compiled updates (zerojax.train.optimizers) and one that runs torch's own step.
    "AdamW": lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.5),
    "Adam": lambda p: torch.optim.Adam(p, lr=LR, weight_decay=0.5),
    "SGD": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, dampening=0.1, weight_decay=0.5),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=LR, momentum=0.5, weight_decay=0.5),
}


class Heads(nn.Module):
    """A trunk and two heads, both computed every call (which one the loss reads is the
    training loop's choice: multi-task, GAN-style alternation), and a layer the forward never
    calls (a branch not taken, an adapter switched off)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(IN, HIDDEN)
        self.head_a = nn.Linear(HIDDEN, CLASSES)
        self.head_b = nn.Linear(HIDDEN, CLASSES)
        self.unused = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.head_a(h), self.head_b(h)


def loss_of(outputs, y, heads: str):
    out_a, out_b = outputs
    loss = 0.0
    if "a" in heads:
        loss = loss + F.cross_entropy(out_a, y)
    if "b" in heads:
        loss = loss + F.cross_entropy(out_b, y)
    return loss


def fused_loss(outputs, y):
    """The fused path's loss (`initialize(loss_fn=)`): head A's only."""
    return F.cross_entropy(outputs[0], y)


def batches(count: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, IN, generator=generator), torch.randint(0, CLASSES, (BATCH,)))
        for _ in range(count)
    ]


def config_for(stage: int, **extra) -> dict:
    return {"mesh": {"data": 8}, "zero_stage": stage, **extra}


def pair(make_optimizer, config, **initialize_kwargs):
    """(zerojax model, its optimizer, torch twin, twin's optimizer) from one seeded module."""
    torch.manual_seed(0)
    module = Heads()
    twin = copy.deepcopy(module)
    twin_optimizer = make_optimizer(twin.parameters())
    model, optimizer = zerojax.initialize(
        module, make_optimizer(module.parameters()), config=config, seed=0, **initialize_kwargs
    )
    return model, optimizer, twin, twin_optimizer


def assert_grads_like_torch(model, twin, when: str, steps: int = 1) -> None:
    """`p.grad is None` exactly where torch's is; present gradients equal within the bound on
    two float32 evaluations of the same sums (see the module docstring)."""
    ours = dict(model.named_parameters())
    for name, p in twin.named_parameters():
        got = ours[name].grad
        if p.grad is None:
            assert got is None, f"{when}: {name}.grad should be None (torch's is), got a tensor"
            continue
        assert got is not None, f"{when}: {name}.grad is None, torch has a gradient"
        bound = steps * CANCELLATION * tolerances.reordered_sum(torch.float32, TERMS, 1.0)
        tolerances.assert_within(torch.as_tensor(got.detach().cpu()), p.grad, bound, name)


def assert_params_like_torch(model, twin, steps: int, when: str) -> None:
    ours = model.state_dict()
    for name, expected in twin.state_dict().items():
        tolerances.assert_within(ours[name], expected, param_tol(steps), f"{when}: {name}")


def run_both(model, optimizer, twin, twin_optimizer, schedule, *, fused=False, start=0):
    """One step per entry of `schedule` (which heads the loss reads), on both sides, checking
    the gradients before each update and the parameters after it (`start` steps were taken
    before: the tolerance grows with every step)."""
    initial = {n: p.detach().clone() for n, p in twin.named_parameters()}
    for step, ((x, y), heads) in enumerate(zip(batches(len(schedule)), schedule, strict=True)):
        loss = model(x, y) if fused else loss_of(model(x), y, heads)
        loss.backward()
        loss_of(twin(x), y, heads).backward()
        assert_grads_like_torch(model, twin, f"step {step}", steps=start + step + 1)
        optimizer.step()
        twin_optimizer.step()
        optimizer.zero_grad()
        twin_optimizer.zero_grad()
        assert_params_like_torch(model, twin, start + step + 1, f"after step {step}")
    # Never reached: bitwise untouched, as torch leaves it.
    ours = model.state_dict()
    for name in ("unused.weight", "unused.bias"):
        assert torch.equal(ours[name], initial[name]), f"{name} changed"


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_unreached_parameter_has_no_grad_and_is_not_stepped(name, stage):
    """The loss reads head A only: head B and `unused` get `grad is None` and keep their values
    (torch skips them: no weight decay, no momentum)."""
    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS[name], config_for(stage))
    run_both(model, optimizer, twin, twin_optimizer, ["a"] * 3)
    ours = model.state_dict()
    assert torch.equal(ours["head_b.weight"], twin.state_dict()["head_b.weight"])


@pytest.mark.parametrize("name", ["AdamW", "SGD", "RMSprop"])
def test_alternating_heads_step_each_as_torch(name):
    """GAN-style: the loss reads head A on even steps and head B on odd ones. Each head's
    optimizer state advances only on its own steps (Adam's per-parameter step count, SGD's
    momentum buffer created on the parameter's first step), so the bias corrections and the
    first momentum step are torch's."""
    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS[name], config_for(3))
    run_both(model, optimizer, twin, twin_optimizer, ["a", "b", "a", "b", "a"])
    if name == "AdamW":  # the optimizer's state as torch's: per-parameter steps, no unused entry
        ours, theirs = optimizer.state_dict()["state"], twin_optimizer.state_dict()["state"]
        assert sorted(ours) == sorted(theirs)
        for index, entry in theirs.items():
            assert float(ours[index]["step"]) == float(entry["step"]), index


def test_state_dict_has_no_entry_for_never_stepped_parameters():
    """torch creates a parameter's optimizer state on its first step; a parameter never stepped
    has no entry in `state_dict()["state"]`. Loading torch's state_dict with per-parameter
    step counts that differ continues as torch does."""
    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS["AdamW"], config_for(3))
    run_both(model, optimizer, twin, twin_optimizer, ["a", "ab"])
    ours, theirs = optimizer.state_dict(), twin_optimizer.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for index, entry in theirs["state"].items():
        assert sorted(ours["state"][index]) == sorted(entry), index
        for key, value in entry.items():
            tolerances.assert_within(ours["state"][index][key], value, 1e-5, f"{index}/{key}")
    # Round trip through torch's format: head A at step 2, head B at step 1, unused absent.
    optimizer.load_state_dict(theirs)
    model.load_state_dict(twin.state_dict())
    run_both(model, optimizer, twin, twin_optimizer, ["b", "a"], start=2)


def test_micro_batches_accumulate_only_where_reached():
    """gas=2: micro-batch 1 reads head A, micro-batch 2 head B; each head gets the gradient of
    the micro-batch it was used in, `unused` none, and the boundary step skips only it."""
    gas = 2
    config = config_for(3, train={"gradient_accumulation_steps": gas})
    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS["AdamW"], config)
    initial = {n: p.detach().clone() for n, p in twin.named_parameters()}
    data = batches(2 * gas)
    for update in range(2):
        for micro, heads in enumerate(["a", "b"]):
            x, y = data[update * gas + micro]
            loss_of(model(x), y, heads).backward()
            (loss_of(twin(x), y, heads) / gas).backward()  # DeepSpeed's loss / gas
            assert_grads_like_torch(model, twin, f"update {update}, micro-batch {micro}")
            optimizer.step()
            optimizer.zero_grad()
        twin_optimizer.step()
        twin_optimizer.zero_grad()
        assert_params_like_torch(model, twin, update + 1, f"after update {update}")
    ours = model.state_dict()
    assert torch.equal(ours["unused.weight"], initial["unused.weight"])


@pytest.mark.parametrize("offload", ["optimizer", "grads"])
def test_offloaded_update_skips_unreached(offload):
    """Optimizer state (and gradients) in host memory: the host update skips what torch skips."""
    hosted = {"optimizer": "host", **({"grads": "host"} if offload == "grads" else {})}
    model, optimizer, twin, twin_optimizer = pair(
        OPTIMIZERS["AdamW"], config_for(3, offload=hosted)
    )
    run_both(model, optimizer, twin, twin_optimizer, ["a", "b", "a"])


def test_pallas_adamw_kernel_skips_unreached():
    """The fused AdamW kernel (config `kernels.optimizer`, interpreted on CPU), alternating
    heads: each parameter is updated with its own step count, unreached ones not at all."""
    config = config_for(3, kernels={"optimizer": "pallas", "interpret": True})
    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS["AdamW"], config)
    run_both(model, optimizer, twin, twin_optimizer, ["a", "b", "a"])


@pytest.mark.parametrize("stage", [0, 3])
def test_fused_loss_path_skips_unreached(stage):
    """`initialize(loss_fn=)`: forward, loss and backward in one program (engine.fused_forward);
    the loss reads head A, so head B and `unused` get no gradient there either."""
    model, optimizer, twin, twin_optimizer = pair(
        OPTIMIZERS["AdamW"], config_for(stage), loss_fn=fused_loss
    )
    run_both(model, optimizer, twin, twin_optimizer, ["a"] * 3, fused=True)
    assert "loss_and_grads" in model.engine.compiled_programs()


@pytest.mark.parametrize("name", ["AdamW", "SGD", "RMSprop"])
def test_zero_grad_set_to_none_false_keeps_zero_gradients(name):
    """`zero_grad(set_to_none=False)` zeroes the gradients that exist and keeps them: the
    next step decays and moves the momentum of a parameter whose gradient is zero (torch's
    AdamW/SGD/RMSprop do), while a parameter that never had a gradient stays None."""
    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS[name], config_for(3))
    initial_unused = twin.unused.weight.detach().clone()
    for step, ((x, y), heads) in enumerate(zip(batches(3), ["ab", "a", "a"], strict=True)):
        loss_of(model(x), y, heads).backward()
        loss_of(twin(x), y, heads).backward()
        assert_grads_like_torch(model, twin, f"step {step}", steps=step + 1)
        optimizer.step()
        twin_optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        twin_optimizer.zero_grad(set_to_none=False)
        assert model.head_b.weight.grad is not None
        assert not model.head_b.weight.grad.detach().cpu().any()
        assert model.unused.weight.grad is None
        assert_params_like_torch(model, twin, step + 1, f"after step {step}")
    assert torch.equal(model.state_dict()["unused.weight"], initial_unused)


def test_module_zero_grad_set_to_none_false():
    """`model.zero_grad(set_to_none=False)` as torch's nn.Module does it, followed by a step
    with no backward at all: every parameter that had a gradient steps with zeros."""
    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS["AdamW"], config_for(0))
    ((x, y),) = batches(1)
    loss_of(model(x), y, "a").backward()
    loss_of(twin(x), y, "a").backward()
    optimizer.step()
    twin_optimizer.step()
    model.zero_grad(set_to_none=False)
    twin.zero_grad(set_to_none=False)
    assert_grads_like_torch(model, twin, "after zero_grad")
    optimizer.step()
    twin_optimizer.step()
    assert_params_like_torch(model, twin, 2, "after the zero-gradient step")


def test_clipping_over_the_present_gradients():
    """`clip_grad_norm_` (the engine's and torch's own over live gradients) takes the norm of
    the gradients that exist, as torch's skips None; the unreached head stays None."""
    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS["SGD"], config_for(3))
    ((x, y),) = batches(1)
    loss_of(model(x), y, "a").backward()
    loss_of(twin(x), y, "a").backward()
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    got = model.clip_grad_norm_(0.1)
    np.testing.assert_allclose(float(got), float(expected), rtol=1e-5)
    assert model.head_b.weight.grad is None and model.unused.weight.grad is None
    again = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    np.testing.assert_allclose(float(again), min(float(expected), 0.1), rtol=1e-5)
    optimizer.step()
    twin_optimizer.step()
    assert_params_like_torch(model, twin, 1, "after the clipped step")


def test_update_compiles_once_per_parameter_subset():
    """A new set of parameters with gradients is a new update program; the same set again
    reuses it (no compile per step)."""
    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS["AdamW"], config_for(0))
    run_both(model, optimizer, twin, twin_optimizer, ["a", "b", "a", "b", "ab", "a"])
    updates = [p for key, p in model.engine.programs._programs.items() if key[0] == "update"]
    assert sum(p.num_compiled() for p in updates) == 3  # {A}, {B}, {A, B} (with the trunk)


def test_checkpoint_restores_per_parameter_steps(tmp_path):
    """Saved after head A stepped twice and head B once, restored into a fresh engine: the
    training continues as torch's (head B's next Adam step is its second)."""
    from zerojax.ckpt import Checkpointer

    model, optimizer, twin, twin_optimizer = pair(OPTIMIZERS["AdamW"], config_for(3))
    run_both(model, optimizer, twin, twin_optimizer, ["a", "ab"])
    with Checkpointer(tmp_path / "ckpt", model, optimizer) as ckpt:
        assert ckpt.save(2, force=True)
    restored, restored_optimizer, _, _ = pair(OPTIMIZERS["AdamW"], config_for(3))
    with Checkpointer(tmp_path / "ckpt", restored, restored_optimizer) as ckpt:
        assert ckpt.restore().step == 2
    run_both(restored, restored_optimizer, twin, twin_optimizer, ["b", "ab"], start=2)
