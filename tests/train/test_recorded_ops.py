"""The user's tensor code between backward() and the next forward runs as one program per step.

Run: .venv/bin/python -m pytest -q tests/train/test_recorded_ops.py -p no:cacheprovider
Why: issue 42. Ops on live tensors (torch's clip_grad_norm_, an EMA's lerp_, a hand-written
`p.data.add_(p.grad, alpha=-lr)` loop, a torch optimizer's own step) are recorded and run as
one compiled program when a value is needed (zerojax.train.deferred). These tests pin the
semantics (values as torch computes them, writes seen by later reads, host reads in the
middle) and the program counts: one program per step, and no new compilation once a schedule
changes only Python floats.

Tolerances: the recorded ops are the same lowerings as the op-at-a-time path, compiled into
one program; XLA may fuse them (an FMA where torch rounds a product first), so values agree
with plain torch to a few float32 ulps per op: 1e-6 relative after a handful of elementwise
ops on unit-scale values, 1e-5 over a multi-step loop whose losses go through a forward too
(reordered sums, ~1e-7 per step, amplified by the nonlinear loop).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP
from zerojax.bridge.dtypes import host_array
from zerojax.train import deferred

pytestmark = pytest.mark.multidevice

ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3}
ZERO0 = {"mesh": {"data": -1}, "zero_stage": 0}


def wrapped_twin(config, make_optimizer=None, seed=0):
    torch.manual_seed(seed)
    module = MLP()
    twin = copy.deepcopy(module)
    optimizer = make_optimizer(module.parameters()) if make_optimizer else None
    model, optimizer = zerojax.initialize(module, optimizer, config)
    twin_optimizer = make_optimizer(twin.parameters()) if make_optimizer else None
    return model, optimizer, twin, twin_optimizer


def batches(n, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(n)
    ]


def backward(model, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return float(loss)


def programs_per_step(model, optimizer, twin, twin_optimizer, steps=3) -> list[int]:
    """Train both sides `steps` steps; the programs each of zerojax's optimizer steps ran."""
    runs = []
    for x, y in batches(steps):
        for m, opt in ((model, optimizer), (twin, twin_optimizer)):
            opt.zero_grad()
            backward(m, x, y)
        before = deferred.programs_run()
        optimizer.step()
        twin_optimizer.step()
        deferred.flush()
        runs.append(deferred.programs_run() - before)
    return runs


def assert_params_close(model, twin, rtol):
    for (name, ours), theirs in zip(model.named_parameters(), twin.parameters(), strict=True):
        np.testing.assert_allclose(
            ours.detach().numpy(), theirs.detach().numpy(), rtol=rtol, atol=rtol, err_msg=name
        )


def float64_run(make_optimizer, steps=3) -> list[torch.Tensor]:
    """`programs_per_step`'s plain-torch side again in float64 (same initial values and
    batches): the parameters after it."""
    torch.manual_seed(0)
    exact = MLP().double()
    optimizer = make_optimizer(exact.parameters())
    for x, y in batches(steps):
        optimizer.zero_grad()
        backward(exact, x.double(), y)
        optimizer.step()
    return [p.detach() for p in exact.parameters()]


def assert_params_within_float32_rounding(model, twin, exact):
    """For Adam's kind of optimizer, which divides each update by the gradient's running
    scale: where an element's gradient is a near-cancelling sum, float32 rounding moves its
    update by far more than a few ulps, in torch's own float32 run as in ours (three Adam
    steps of this MLP: torch float32 ends up to 7.3e-6 from float64 in fc2.weight, where most
    elements agree to 1e-7). So each tensor of ours must lie, element by element, within twice
    the farthest element of torch's float32 run from the float64 run (both float32 runs that
    close to exact; the triangle inequality doubles it), plus ten float32 ulps of a unit
    value."""
    for (name, ours), theirs, truth in zip(
        model.named_parameters(), twin.parameters(), exact, strict=True
    ):
        theirs = theirs.detach().double()
        rounding = float((theirs - truth).abs().max())
        ours = torch.from_numpy(ours.detach().numpy()).double()  # (float64: torch's, on host)
        error = float((ours - theirs).abs().max())
        assert error <= 2 * rounding + 10 * 1.2e-7, (name, error, rounding)


@pytest.mark.parametrize("config", [ZERO0, ZERO3], ids=["zero0", "zero3"])
def test_a_hand_written_update_loop_is_one_program_per_step(config):
    """pytorch/examples' word_language_model updates by hand; zerojax runs each step's loop as
    one program (not one per parameter) and matches torch."""
    model, _, twin, _ = wrapped_twin(config)
    runs = []
    for step, (x, y) in enumerate(batches(4)):
        lr = 0.1 / (step + 1)
        for m in (model, twin):
            m.zero_grad()
            backward(m, x, y)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            with torch.no_grad():
                for p in m.parameters():
                    p.data.add_(p.grad, alpha=-lr)
        before = deferred.programs_run()
        deferred.flush()
        runs.append(deferred.programs_run() - before)
    # The clip and the update of one step are one recording, run by the next forward (or here).
    assert runs[1:] == [1, 1, 1]
    assert_params_close(model, twin, 1e-5)


def test_an_ema_over_all_parameters_is_one_program_per_step():
    model, optimizer, twin, twin_optimizer = wrapped_twin(
        ZERO0, lambda p: torch.optim.SGD(p, lr=0.05)
    )
    ema = [p.detach().clone() for p in model.parameters()]
    twin_ema = [p.detach().clone() for p in twin.parameters()]
    counts = []
    for x, y in batches(4):
        for m, opt in ((model, optimizer), (twin, twin_optimizer)):
            opt.zero_grad()
            backward(m, x, y)
            opt.step()
        before = deferred.programs_run()
        with torch.no_grad():
            for e, p in zip(ema, model.parameters(), strict=True):
                e.lerp_(p, 0.1)
            for e, p in zip(twin_ema, twin.parameters(), strict=True):
                e.lerp_(p, 0.1)
        deferred.flush()
        counts.append(deferred.programs_run() - before)
    assert counts == [1, 1, 1, 1]
    for ours, theirs in zip(ema, twin_ema, strict=True):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)


def test_recorded_writes_are_seen_by_later_reads_and_host_reads():
    model, _, twin, _ = wrapped_twin(ZERO3)
    x, y = batches(1)[0]
    backward(model, x, y)
    backward(twin, x, y)
    for m in (model, twin):
        first = next(m.parameters())
        first.grad.mul_(3.0)  # a write into the engine's gradient, recorded
        first.grad[0].fill_(0.25)  # a write through a view
        first.data[1:3] += first.grad[1:3]  # read after write, written through a slice
    ours, theirs = next(model.parameters()), next(twin.parameters())
    # A host read in the middle runs what was recorded and sees every write. The gradients
    # themselves differ from torch's by reordered float32 sums (a batch of 8 through 32-64
    # features: ~64 x 6e-8, 4e-6 of the gradient's scale), the rest is elementwise.
    assert ours.grad.sum().item() == pytest.approx(theirs.grad.sum().item(), rel=1e-5)
    np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.detach().numpy(), theirs.detach().numpy(), atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9),
        pytest.param(  # one recorded op (recorded_adafactor)
            lambda p: torch.optim.Adafactor(p, lr=1e-2, weight_decay=0.01),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["RMSprop", "Adafactor"],
)
@pytest.mark.long
def test_a_schedule_and_varying_clip_norms_never_recompile(make):
    """100 steps, a cosine LR schedule, a clip norm that changes every step, a torch optimizer's
    own step and torch's clip_grad_norm_: the number of compiled programs stays constant after
    step 2, and the run matches plain torch."""
    model, optimizer, twin, twin_optimizer = wrapped_twin(ZERO0, make)
    schedules = [
        torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=100)
        for o in (optimizer, twin_optimizer)
    ]
    data = batches(4)
    compiled = []
    losses = {"ours": [], "torch": []}
    for step in range(100):
        x, y = data[step % len(data)]
        max_norm = 0.5 + 0.5 * math.sin(step)
        for side, m, opt in (("ours", model, optimizer), ("torch", twin, twin_optimizer)):
            opt.zero_grad()
            losses[side].append(backward(m, x, y))
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            opt.step()
        for schedule in schedules:
            schedule.step()
        compiled.append(deferred.programs_compiled())
    assert compiled[2:] == [compiled[2]] * 98
    # The losses fall to ~1e-4 by the end: judged against the loss scale of the start (~2),
    # 1e-5 relative per the module docstring.
    np.testing.assert_allclose(losses["ours"], losses["torch"], rtol=1e-5, atol=2e-5)


def test_an_optimizer_built_after_initialize_steps_as_recorded_ops():
    """minGPT's trainer and the HF Trainer build their optimizer after the model is placed: a
    plain torch optimizer on the wrapped parameters, whose step is recorded too."""
    model, _, twin, _ = wrapped_twin(ZERO3)
    optimizer = torch.optim.Adamax(model.parameters(), lr=1e-2)
    twin_optimizer = torch.optim.Adamax(twin.parameters(), lr=1e-2)
    assert programs_per_step(model, optimizer, twin, twin_optimizer) == [1, 1, 1]
    exact = float64_run(lambda p: torch.optim.Adamax(p, lr=1e-2))
    assert_params_within_float32_rounding(model, twin, exact)


@pytest.mark.parametrize("config", [ZERO0, ZERO3], ids=["zero0", "zero3"])
def test_state_buffers_only_the_recording_holds_are_reused(config, caplog, monkeypatch):
    """An optimizer's state before its step is held by nothing but the step's recording, and
    the parameters by the engine, which the step's writes replace: their buffers are donated
    to the program (new moments and weights written where the old ones were, as the compiled
    update does), which changes no value. An array something else still holds is never
    donated: it keeps its value."""

    unheld = deferred._UNHELD

    def train(donating: bool):
        monkeypatch.setattr(deferred, "_UNHELD", unheld if donating else -1)
        model, optimizer, twin, twin_optimizer = wrapped_twin(
            config, lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5)
        )
        programs_per_step(model, optimizer, twin, twin_optimizer, steps=2)
        tensors = [t for state in optimizer.state.values() for t in state.values() if t.ndim > 0]
        held = tensors[0].array  # a reference from outside the recording
        before = np.asarray(held).copy()
        assert programs_per_step(model, optimizer, twin, twin_optimizer, steps=2) == [1, 1]
        np.testing.assert_array_equal(np.asarray(held), before)
        params = [p.detach().numpy() for p in model.parameters()]
        return params, len(tensors) + len(params)

    caplog.set_level("INFO", logger="zerojax.train.deferred")
    reference, _ = train(donating=False)
    monkeypatch.setattr(deferred, "_programs", {})  # each program compiled (and logged) anew
    caplog.clear()
    params, count = train(donating=True)
    donated = [
        int(record.getMessage().split(" of its ")[0].rsplit("; ", 1)[1])
        for record in caplog.records
        if "input arrays donated" in record.getMessage()
    ]
    # The parameters, square averages and momentum buffers; then all but the held one.
    assert donated[-2:] == [count, count - 1], donated
    for ours, theirs in zip(params, reference, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_state_built_by_the_constructor_steps_recorded_from_the_first_step(monkeypatch):
    """Adagrad builds its sums in its constructor, on the host parameters `initialize` then
    takes over: they become live before torch's first step sees them (the step is recorded,
    not run element by element on host copies)."""
    from zerojax.train import live_tensor

    def no_host_copies(func, *args):
        raise AssertionError(f"{func} ran on host copies")

    model, optimizer, twin, twin_optimizer = wrapped_twin(
        ZERO3, lambda p: torch.optim.Adagrad(p, lr=1e-2, initial_accumulator_value=0.1)
    )
    monkeypatch.setattr(live_tensor, "_on_host", no_host_copies)
    assert programs_per_step(model, optimizer, twin, twin_optimizer) == [1, 1, 1]
    assert_params_close(model, twin, 1e-5)


def test_a_failed_recording_says_so_when_its_values_are_read(monkeypatch):
    model, _, _, _ = wrapped_twin(ZERO0)
    x, y = batches(1)[0]
    backward(model, x, y)
    grad = next(model.parameters()).grad * 2.0

    def fail(*args, **kwargs):
        raise RuntimeError("compilation failed (injected)")

    monkeypatch.setattr(deferred, "_compile", fail)
    monkeypatch.setattr(deferred, "_programs", {})
    with pytest.raises(RuntimeError, match="injected"):
        deferred.flush()
    with pytest.raises(RuntimeError, match="recorded ops whose program failed"):
        grad.sum().item()


def own_class(cls: type) -> type:
    """A user's own subclass of `cls`: zerojax adopts only torch's own AdamW, Adam and SGD into
    its compiled update (`zerojax.train.late_optimizers`), so this one runs its own step."""
    return type(f"Own{cls.__name__}", (cls,), {})


@pytest.mark.parametrize(
    "make",
    [
        lambda p: own_class(torch.optim.AdamW)(p, lr=1e-2, weight_decay=0.1, fused=True),
        lambda p: own_class(torch.optim.Adam)(p, lr=1e-2, amsgrad=True, fused=True),
        lambda p: own_class(torch.optim.SGD)(p, lr=1e-2, momentum=0.9, fused=True),
        lambda p: own_class(torch.optim.SGD)(p, lr=1e-2, fused=True),
    ],
    ids=["AdamW", "Adam-amsgrad", "SGD-momentum", "SGD"],
)
def test_fused_optimizers_built_after_initialize_are_recorded(make, monkeypatch):
    """A fused optimizer of the user's own class (the HF Trainer's default, `AdamW(fused=True)`,
    subclassed) built after the model is placed: its `_fused_adamw_` op runs as torch's
    foreach step, recorded (never on host copies), and matches torch's fused kernel on the
    twin (the two agree to float32 rounding; AdamW turns ~1e-7 gradient differences into up
    to ~1e-6 relative update differences)."""
    from zerojax.train import live_tensor

    def no_host_copies(func, *args):
        raise AssertionError(f"{func} ran on host copies")

    exact = float64_run(make)  # (plain torch: before any op is made to fail on host copies)
    model, _, twin, _ = wrapped_twin(ZERO0)
    optimizer, twin_optimizer = make(model.parameters()), make(twin.parameters())
    monkeypatch.setattr(live_tensor, "_on_host", no_host_copies)
    assert programs_per_step(model, optimizer, twin, twin_optimizer) == [1, 1, 1]
    assert_params_within_float32_rounding(model, twin, exact)


def test_a_write_of_a_value_computed_earlier_reaches_the_engine():
    """A value whose recording has run (read on the host) written into a gradient afterwards:
    the engine's next read sees it (a write with no op of its own to run it)."""
    model, _, _, _ = wrapped_twin(ZERO3)
    x, y = batches(1)[0]
    backward(model, x, y)
    name, first = next(model.named_parameters())
    doubled = first.grad * 2.0
    expected = doubled.numpy()  # runs the recording
    first.grad.copy_(doubled)
    np.testing.assert_array_equal(np.asarray(model.engine.state.grads[name]), expected)


def test_a_scalar_object_is_one_program_input_however_many_ops_take_it():
    """A foreach op hands its one `value=-lr` to each element: one program input, not one
    per element (each input is a device value made at every run). Distinct scalar objects
    stay distinct inputs, equal values or not, and every op reads its own."""
    model, _, _, _ = wrapped_twin(ZERO0)
    x, y = batches(1)[0]
    backward(model, x, y)
    params = [p.detach() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    # Ordinary tensors with the same values: torch computes on them.
    host_params = [torch.from_numpy(p.numpy().copy()) for p in params]
    host_grads = [torch.from_numpy(g.numpy().copy()) for g in grads]
    lr, other = -0.125, float("-0.375")
    for ps, gs in ((params, grads), (host_params, host_grads)):
        torch._foreach_add_(ps, gs, alpha=lr)
        torch._foreach_mul_(gs, 3.0)
        ps[0].add_(gs[0], alpha=other)
    assert len(params) > 2
    # lr, 3.0 and `other`, whatever the number of parameters.
    assert len(deferred._recording.scalars) == 3
    deferred.flush()
    for ours, theirs in zip(params + grads, host_params + host_grads, strict=True):
        # Elementwise float32 ops on the same inputs: an FMA may round once where torch rounds
        # twice (1 ulp of the result per op, two ops: ~2.4e-7 relative).
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=3e-7, atol=1e-9)


def test_scalar_inputs_reach_their_ops_packed_into_a_few_arguments(monkeypatch):
    """NAdam's foreach step passes a float per parameter, Rprop 0-d host tensors per
    parameter: the program takes the floats as one vector and the 0-d host arrays as one per
    dtype (each argument is a conversion at every run), and each op still reads its own."""
    model, _, _, _ = wrapped_twin(ZERO0)
    params = [p.detach() for p in model.parameters()]
    host_params = [torch.from_numpy(p.numpy().copy()) for p in params]
    packed = []
    pack = deferred._packed_scalars
    monkeypatch.setattr(deferred, "_packed_scalars", lambda s: packed.append(pack(s)) or packed[-1])
    for ps in (params, host_params):
        for i, p in enumerate(ps):
            p.mul_(1.0 + i / 7)  # a float of its own per parameter
            p.add_(torch.tensor(1.0 + 0.25 * i))  # a 0-d float32 host tensor (> |p|: no
            p.mul_(torch.tensor(i + 2))  # cancellation); a 0-d int64 one
    deferred.flush()
    n = len(params)
    assert n > 2
    ((layout, (floats, vectors, rest)),) = packed
    assert floats.shape == (n,) and [v.shape for v in vectors] == [(n,), (n,)] and rest == []
    host_dtypes = {host_array(torch.tensor(x)).dtype.str for x in (0.5, 1)}  # int64: int32
    assert set(layout[1]) == host_dtypes and len(host_dtypes) == 2
    for ours, theirs in zip(params, host_params, strict=True):
        # Three elementwise float32 ops on the same inputs: 1 ulp of the result per op where
        # XLA fuses a product into an add that torch rounds first (~3.6e-7 relative).
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=4e-7, atol=1e-9)


@pytest.mark.parametrize(
    "options",
    [{}, {"weight_decay": 0.1, "maximize": True}],
    ids=["defaults", "weight_decay+maximize"],
)
def test_adafactor_steps_as_one_program_without_host_reads(options):
    """torch's Adafactor reads two norms per parameter on the host; recorded as one op
    (zerojax.train.recorded_adafactor) its step is one program, and its parameters and
    factors follow torch's on the same gradients, matrices and vectors alike."""
    model, optimizer, twin, twin_optimizer = wrapped_twin(
        ZERO3, lambda p: torch.optim.Adafactor(p, lr=1e-2, **options)
    )
    generator = torch.Generator().manual_seed(3)
    runs = []
    for _ in range(3):
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            grad = torch.randn(p.shape, generator=generator)
            p.grad, q.grad = grad.clone(), grad
        deferred.flush()
        before = deferred.programs_run()
        optimizer.step()
        deferred.flush()
        runs.append(deferred.programs_run() - before)
        twin_optimizer.step()
    assert runs == [1, 1, 1]
    # What differs from torch: the 2-norms' float32 sums in another order (<= 2048 terms:
    # ~1e-7 relative typically) and the step size's scalar arithmetic in float32 where torch
    # uses double (a few float32 ulps, ~3e-7). Both scale an update of lr (1e-2) relative to
    # the parameter, so over 3 steps the parameters agree to ~1e-8 relative; the factors are
    # running means of the same squared gradients (a few ulps, 1e-6).
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-6, atol=1e-7)
    theirs = twin_optimizer.state_dict()["state"]
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            np.testing.assert_allclose(
                value.numpy(), theirs[index][key].numpy(), rtol=1e-6, atol=1e-9, err_msg=key
            )
