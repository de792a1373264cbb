"""Hugging Face accelerate with `zerojax.initialize` before (order A) or after (order B)
`accelerator.prepare`, against the plain accelerate run.

Run: .venv/bin/python -m pytest -q tests/integrations/test_accelerate.py -p no:cacheprovider
Why: issue 26 names accelerate among the frameworks a zerojax model must train under unchanged,
in whichever order a script happens to call the two. One loop uses everything a user's does:
a prepared DataLoader and LR scheduler, `accumulate` (gradient accumulation 2),
`accelerator.backward`, `clip_grad_norm_` on sync steps, `gather`. Order B had its own bugs:
the AcceleratedOptimizer the accelerator saves and steps kept driving the raw torch optimizer,
and accelerate's bf16 autocast forward called the class's forward around the engine. The
several-process case (the DDP wrap zerojax prevents) is tests/distributed/
test_accelerate_torchrun.py.

Tolerances: per-step losses and clip norms within 1e-5 relative (two float32 runs of one loop
differ by reordered sums, ~1e-7 per step); final weights within 1e-4 normwise over all
parameters (AdamW turns ~1e-7 gradient differences into up to lr-sized steps on near-zero
second moments, so per-tensor bounds on small tensors are not meaningful). A run resumed from
`save_state`/`load_state` is the same zerojax program on the same values: its losses must match
the uninterrupted zerojax run to 1e-6 (only the host round trip of the state could differ, and
it is exact; the bound leaves room for nothing but reordering in a recompiled program).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zerojax
from tests.fresh_python import run_fresh_python

accelerate = pytest.importorskip("accelerate", reason="accelerate is a dev dependency")
from accelerate.state import AcceleratorState, GradientState

from tests.distributed.accelerate_script import MLP  # the torchrun test's model

pytestmark = pytest.mark.multidevice

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"mesh": {"data": -1}, "zero_stage": 3}
ACCUMULATION = 2
LOCAL_BATCH = 8
OPTIMIZER_STEPS = 4
MAX_NORM = 0.5  # below the first steps' norms: the clip really scales


def batches():
    """Fresh random rows for ACCUMULATION x OPTIMIZER_STEPS micro-batches."""
    generator = torch.Generator().manual_seed(1234)
    rows = ACCUMULATION * OPTIMIZER_STEPS * LOCAL_BATCH
    x = torch.randn(rows, 16, generator=generator)
    y = torch.randint(0, 10, (rows,), generator=generator)
    return torch.utils.data.TensorDataset(x, y)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each Accelerator starts from a clean process-wide state (its mixed precision and
    gradient accumulation settings live in singletons shared by every Accelerator)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def build(order: str | None, *, seed: int = 0, mixed_precision: str = "no"):
    """Model, optimizer, loader, scheduler and accelerator, prepared in `order` ("A": zerojax
    first, "B": accelerate first, None: no zerojax)."""
    torch.manual_seed(seed)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = torch.utils.data.DataLoader(batches(), batch_size=LOCAL_BATCH)
    accelerator = accelerate.Accelerator(
        cpu=True, gradient_accumulation_steps=ACCUMULATION, mixed_precision=mixed_precision
    )
    if order == "A":
        model, optimizer = zerojax.initialize(model, optimizer, CONFIG)
    objects = accelerator.prepare(model, optimizer, loader, scheduler)
    model, optimizer, loader, scheduler = objects
    if order == "B":
        model, optimizer = zerojax.initialize(model, optimizer, CONFIG)
    return model, optimizer, loader, scheduler, accelerator


def train(model, optimizer, loader, scheduler, accelerator, *, skip: int = 0):
    """The user's accelerate loop over `loader` (its first `skip` micro-batches left out):
    per micro-batch the gathered loss, per optimizer step the clip norm and the lr."""
    losses, norms, lrs = [], [], []
    for i, (x, y) in enumerate(loader):
        if i < skip:
            continue
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                lrs.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.gather(loss.detach()).mean()))
    return losses, norms, lrs


def weights(model, accelerator) -> torch.Tensor:
    state = accelerator.unwrap_model(model).state_dict()
    return torch.cat([state[n].double().flatten() for n in sorted(state)])


def assert_weights_close(mine: torch.Tensor, reference: torch.Tensor, bound: float = 1e-4):
    error = float((mine - reference).norm() / reference.norm())
    assert error <= bound, f"weights differ normwise by {error:.3g} > {bound}"


@pytest.fixture(scope="module")
def plain_run():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    objects = build(None)
    return (*train(*objects), weights(objects[0], objects[-1]))


@pytest.mark.parametrize("order", ["A", "B"])
def test_accelerate_loop_matches_plain_accelerate(order, plain_run):
    model, optimizer, *rest, accelerator = build(order)
    assert isinstance(model, zerojax.train.module.ZeroModule)
    assert isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer)
    # The object the accelerator saves and steps drives the zerojax update (order B too).
    assert accelerator._optimizers == [optimizer]
    assert isinstance(optimizer.optimizer, zerojax.train.optimizer_shim.ZeroOptimizer)
    assert accelerator._models == [model]
    losses, norms, lrs = train(model, optimizer, *rest, accelerator)
    their_losses, their_norms, their_lrs, their_weights = plain_run
    assert len(losses) == ACCUMULATION * OPTIMIZER_STEPS
    assert len(norms) == OPTIMIZER_STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(their_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(their_norms), rtol=1e-5, atol=0)
    assert max(norms) > MAX_NORM  # the clip was active
    assert lrs == their_lrs  # the scheduler stepped once per optimizer step
    assert_weights_close(weights(model, accelerator), their_weights)


@pytest.mark.parametrize("order", ["A", "B"])
def test_save_state_load_state_resumes_identically(order, tmp_path):
    """save_state after half the steps, load_state into a differently seeded fresh model in a
    fresh accelerator, train on: the same losses and weights as without the interruption."""
    whole = build(order)
    whole_losses, _, whole_lrs = train(*whole)
    whole_weights = weights(whole[0], whole[-1])

    half = ACCUMULATION * OPTIMIZER_STEPS // 2
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model, optimizer, loader, scheduler, accelerator = build(order)
    for i, (x, y) in enumerate(loader):
        if i == half:
            break
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    accelerator.save_state(str(tmp_path / "checkpoint"))

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    resumed = build(order, seed=1)
    assert not torch.equal(weights(resumed[0], resumed[-1]), whole_weights)
    resumed[-1].load_state(str(tmp_path / "checkpoint"))
    losses, _, lrs = train(*resumed, skip=half)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(whole_losses[half:]), rtol=1e-6, atol=0
    )
    assert lrs == whole_lrs[OPTIMIZER_STEPS // 2 :]
    assert_weights_close(weights(resumed[0], resumed[-1]), whole_weights, bound=1e-6)


def test_order_b_keeps_accelerates_bf16_autocast():
    """accelerate's bf16 autocast wraps the model's forward before initialize in order B; it
    must end up around zerojax's forward (else the class's own forward runs on the live
    tensors and nothing reaches the engine). Order B must give order A's losses (one program,
    the same values: 1e-6). Against plain accelerate in bf16: before the first update (the
    first ACCUMULATION micro-batches) within 1e-5 (the autocast casts are captured into the
    program, so both sides round the same inputs to bf16 and accumulate in fp32); after it
    within 2**-8, bf16's unit roundoff: weights that differ by ~1e-7 in fp32 can round to
    neighbouring bf16 values inside the autocast (measured up to 5e-4)."""
    results = {}
    for order in (None, "A", "B"):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        objects = build(order, mixed_precision="bf16")
        results[order] = torch.tensor(train(*objects)[0])
    torch.testing.assert_close(results["B"], results["A"], rtol=1e-6, atol=0)
    first = slice(0, ACCUMULATION)
    torch.testing.assert_close(results["A"][first], results[None][first], rtol=1e-5, atol=0)
    torch.testing.assert_close(results["A"], results[None], rtol=2**-8, atol=0)


@pytest.mark.parametrize(
    ("distributed_type", "refused"), [("MULTI_CPU", False), ("MULTI_GPU", False), ("FSDP", True)]
)
def test_prepare_model_never_wraps_a_zerojax_model(monkeypatch, distributed_type, refused):
    """The hook on Accelerator.prepare_model in one process: under accelerate's DDP types a
    zerojax model comes back itself (registered for save_state, never DDP-wrapped: the
    torchrun test shows the real wrap); accelerate's own sharding engines are refused."""
    from accelerate.utils import DistributedType

    torch.manual_seed(0)
    model, _ = zerojax.initialize(MLP(), None, CONFIG)
    accelerator = accelerate.Accelerator(cpu=True)
    kind = DistributedType(distributed_type)
    monkeypatch.setattr(type(accelerator), "distributed_type", property(lambda self: kind))
    if refused:
        with pytest.raises(ValueError, match="distributed_type=FSDP"):
            accelerator.prepare_model(model)
        return
    assert accelerator.prepare_model(model) is model
    assert accelerator._models == [model]


@pytest.mark.slow  # a fresh process (imports, compiles): make test-distributed runs it
def test_example_script_trains():
    """examples/accelerate_train.py (a tiny GPT-2, order A) runs to the end and its loss falls."""
    # The script sets its own device count (4).
    result = run_fresh_python(
        [str(REPO / "examples" / "accelerate_train.py"), "--steps", "8"], timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in result.stdout.splitlines() if "loss" in line]
    assert len(losses) == 8, result.stdout
    assert losses[-1] < losses[0], losses
