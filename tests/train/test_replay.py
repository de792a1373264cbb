"""A live optimizer's step traced once and replayed (zerojax.train.replay).

Run: .venv/bin/python -m pytest -q tests/train/test_replay.py -p no:cacheprovider
Why: the replay answers torch's ATen calls from a trace instead of recording them, so every
test here trains beside a plain-torch twin and checks the numbers, and counts traces and
replays to show which path ran. Tolerances are test_torch_optimizers' (see its docstring: two
float32 runs of one loop, reordered sums, amplified over the steps by the running statistics
the updates divide by): losses 1e-5 relative, parameters 1e-4 relative normwise.
"""

from __future__ import annotations

import copy
import gc
import weakref

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP
from tests.train.test_torch_optimizers import SignMomentum, relative_errors
from zerojax.bridge.dtypes import host_array
from zerojax.train import captured_step, deferred, recorded_adam, replay

pytestmark = pytest.mark.multidevice


@pytest.fixture(autouse=True)
def _steps_not_captured():
    """Optimizer steps replayed, not captured (`captured_step`, tested in
    test_captured_step.py): the replay is what runs a step that cannot be captured."""
    with captured_step.disabled():
        yield


ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3}
BATCH = 8


class PowerMomentum(torch.optim.Optimizer):
    """A user's optimizer whose update raises a buffer to a power that is a hyperparameter:
    `pow`'s exponent is a constant of its program (its lowering needs the value), unlike the
    floats of add/mul/addcdiv, which are program inputs."""

    def __init__(self, params, lr=1e-2, power=2.0):
        super().__init__(params, {"lr": lr, "power": power})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                bufs.append(state["buf"])
            torch._foreach_mul_(bufs, 0.5)
            torch._foreach_add_(bufs, torch._foreach_abs(grads))
            powered = torch._foreach_pow(bufs, group["power"])
            torch._foreach_add_(powered, 1.0)
            torch._foreach_addcdiv_(params, grads, powered, value=-group["lr"])


class SGDThenMore(torch.optim.Optimizer):
    """A user's SGD that can do more after its update (`after_update`; here nothing: plain
    SGD)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})
        self.count = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])
            self.after_update(params)

    def after_update(self, params: list) -> None:
        """What a subclass does after the update, on the updated parameters."""


class NormEveryThirdStep(SGDThenMore):
    """Every third step, reads the updated parameters' norm on the host and shrinks them by
    it: a host read after the step's first op, in some steps only."""

    def after_update(self, params: list) -> None:
        if self.count % 3 == 0:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(params)))
            torch._foreach_mul_(params, 1.0 / (1.0 + 1e-3 * float(norm)))


class NoiseInTwoStepsOfFour(SGDThenMore):
    """In steps 2 and 3 of every four, draws noise for each parameter after its update
    (scaled by 0: the numbers stay torch's): a recording that draws random numbers is not
    traceable, in some steps only, two in a row."""

    def after_update(self, params: list) -> None:
        if self.count % 4 in (2, 3):
            for p in params:
                p.add_(torch.randn_like(p), alpha=0.0)


def train(make, steps: int, schedule=None, each_step=None, config=ZERO3, per_step=None):
    """`steps` steps wrapped and as a plain-torch twin on the same batches, an LR scheduler
    made by `schedule(optimizer)` on each; `each_step(step, optimizers)` runs before each
    step; `per_step`, a list, gets each wrapped step's (traces, replays). Returns (model,
    twin, losses, compiled-program counts after each step, (optimizer, twin's optimizer))."""
    run_what_earlier_tests_recorded()
    torch.manual_seed(0)
    module = MLP()
    twin = copy.deepcopy(module)
    model, optimizer = zerojax.initialize(module, make(module.parameters()), config)
    twin_optimizer = make(twin.parameters())
    pairs = [(model, optimizer), (twin, twin_optimizer)]
    schedulers = [schedule(o) for _, o in pairs] if schedule else []
    losses, compiled = [], []
    for step in range(steps):
        x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
        if each_step is not None:
            each_step(step, [optimizer, twin_optimizer])
        pair = []
        for m, opt in pairs:
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            before = counts()
            opt.step()
            opt.zero_grad()
            if per_step is not None and m is model:
                per_step.append(tuple(a - b for a, b in zip(counts(), before, strict=True)))
            pair.append(float(loss.detach()))
        for scheduler in schedulers:
            scheduler.step()
        losses.append(pair)
        compiled.append(deferred.programs_compiled())
    return model, twin, np.array(losses), compiled, (optimizer, twin_optimizer)


def steps_beside_torch(pairs, count: int, before_step=None, after_backward=None) -> np.ndarray:
    """`count` steps of each (model, optimizer) in `pairs` on the same batches; the losses,
    one row per step. `before_step(step)` runs before each step's batch is drawn,
    `after_backward(step, model)` between a model's backward and its optimizer's step."""
    losses = []
    for step in range(count):
        if before_step is not None:
            before_step(step)
        x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
        row = []
        for m, opt in pairs:
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            if after_backward is not None:
                after_backward(step, m)
            opt.step()
            opt.zero_grad()
            row.append(float(loss.detach()))
        losses.append(row)
    return np.array(losses)


def assert_trains_like_torch(model, twin, losses) -> None:
    np.testing.assert_allclose(losses[:, 0], losses[:, 1], rtol=1e-5)
    errors = relative_errors(model, twin)
    assert max(errors.values()) <= 1e-4, errors


def assert_state_like_torch(optimizer, twin_optimizer) -> None:
    """The optimizers' state, tensor by tensor, within the parameters' tolerance (ASGD's
    average `ax` reaches no parameter: only this sees it)."""
    ours, theirs = optimizer.state_dict()["state"], twin_optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index, state in theirs.items():
        assert ours[index].keys() == state.keys(), index
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point() and value.norm() > 0:
                error = (ours[index][key].double() - value.double()).norm() / value.double().norm()
                assert error <= 1e-4, (index, key, float(error))


def run_what_earlier_tests_recorded() -> None:
    """Run the ops an earlier test in this process recorded and never needed (its last
    step's, run when a value is next needed): else the first step here would run and count
    them."""
    deferred.flush()


def counts() -> tuple[int, int]:
    return replay.traces(), replay.replays()


# A step's (traces, replays).
TRACED, REPLAYED = (1, 0), (0, 1)


OPTIMIZERS = {
    # Bias corrections computed on the host from step counts: new floats every step.
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2, decoupled_weight_decay=True),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2, weight_decay=0.01),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, weight_decay=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.01),
    # Host tensors in the calls: Rprop's step-size factors (0-d CPU tensors torch makes per
    # call), ASGD's `eta` and `mu` (CPU state tensors it rewrites on the host every step).
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-3),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=3),
    "SignMomentum (user-defined)": lambda p: SignMomentum(p),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_replayed_steps_train_like_torch_under_a_cosine_schedule(name):
    """The first two steps are traced (the first creates the state, the second is the steady
    step: Adagrad's first); every later one is one recording, replayed with its new learning
    rate and bias corrections, and no program is compiled after the second step."""
    per_step: list = []
    model, twin, losses, compiled, optimizers = train(
        OPTIMIZERS[name],
        12,
        schedule=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12),
        per_step=per_step,
    )
    assert_trains_like_torch(model, twin, losses)
    assert_state_like_torch(optimizers[0], optimizers[1])
    # Adagrad makes its state in its constructor: its first step is already the steady one.
    traced = 1 if name == "Adagrad" else 2
    assert per_step == [TRACED] * traced + [REPLAYED] * (12 - traced), per_step
    assert compiled[-1] == compiled[1], compiled


def test_a_changed_group_structure_is_traced_again_and_trains_like_torch():
    """RMSprop without weight decay, then with it from step 5 (torch's step then issues
    another op): the replay of step 5 meets a call its trace does not have, turns what it
    replayed into its recording, and traces the new step; later steps replay the new trace."""

    def weight_decay_from_step_5(step, optimizers):
        if step == 5:
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["weight_decay"] = 0.01

    per_step: list = []
    model, twin, losses, *_ = train(
        lambda p: torch.optim.RMSprop(p, lr=1e-3),
        10,
        each_step=weight_decay_from_step_5,
        per_step=per_step,
    )
    assert_trains_like_torch(model, twin, losses)
    # Steps 0 (state made), 1 (the steady step) and 5 (weight decay) are traced.
    assert per_step == [TRACED, TRACED] + [REPLAYED] * 3 + [TRACED] + [REPLAYED] * 4, per_step


def test_a_changed_constant_is_traced_again_and_trains_like_torch():
    """`pow`'s exponent is part of the program: a new value does not replay the old program
    (which would compute the old power) but is traced, and a schedule of it still trains
    as torch does."""

    def power_schedule(step, optimizers):
        for optimizer in optimizers:
            optimizer.param_groups[0]["power"] = 2.0 if step < 4 else 1.5

    per_step: list = []
    model, twin, losses, *_ = train(PowerMomentum, 8, each_step=power_schedule, per_step=per_step)
    assert_trains_like_torch(model, twin, losses)
    # Steps 0 (state made), 1 (the steady step) and 4 (the new power) are traced.
    assert per_step == [TRACED, TRACED] + [REPLAYED] * 2 + [TRACED] + [REPLAYED] * 3, per_step


@pytest.mark.filterwarnings("ignore:zerojax. NormEveryThirdStep.step reads tensor values")
def test_a_host_read_in_a_replayed_step_ends_the_replay_with_the_same_numbers():
    """Every third step reads a norm on the host after its first op: the replay of such a
    step meets a call its trace does not have, turns the replayed op into its recording, and
    the read sees the parameters that op updates. The recording a read runs is traced too,
    and replayed in the steps after."""
    per_step: list = []
    model, twin, losses, *_ = train(NormEveryThirdStep, 9, per_step=per_step)
    assert_trains_like_torch(model, twin, losses)
    # Each step's calls are one recording; a step with a read is two (the read runs the
    # first). Traced: step 1's, step 3's up to its read, and step 3's after it. Step 3's
    # replay of step 1's trace went past its end, so it was recorded and traced; later
    # steps replay whichever of the two traces they match (they share the first call).
    plain, with_read = [REPLAYED] * 2, [(0, 2)]
    assert per_step == [TRACED, REPLAYED, (2, 0)] + (plain + with_read) * 2, per_step


def test_a_step_after_load_state_dict_is_traced_again():
    """`load_state_dict` puts new state tensors in: the trace's tensors are not the step's,
    so the step is traced again and continues torch's run exactly."""
    torch.manual_seed(0)
    module = MLP()
    twin = copy.deepcopy(module)
    model, optimizer = zerojax.initialize(
        module, torch.optim.RMSprop(module.parameters(), lr=1e-3), ZERO3
    )
    twin_optimizer = torch.optim.RMSprop(twin.parameters(), lr=1e-3)

    def before_step(step):
        if step == 4:
            optimizer.load_state_dict(copy.deepcopy(twin_optimizer.state_dict()))

    pairs = ((model, optimizer), (twin, twin_optimizer))
    assert_trains_like_torch(model, twin, steps_beside_torch(pairs, 8, before_step=before_step))


def test_a_hand_written_update_loop_is_replayed_and_trains_like_torch():
    """pytorch/examples' `p.data.add_(p.grad, alpha=-lr)` loop, with the lr decayed every
    step: the loop's calls between two forwards are one recording, replayed from the third
    step with each step's lr."""
    torch.manual_seed(0)
    module = MLP()
    twin = copy.deepcopy(module)
    model, _ = zerojax.initialize(module, None, ZERO3)
    run_what_earlier_tests_recorded()
    losses, per_step = [], []
    for step in range(8):
        lr = 0.1 * 0.8**step
        x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
        pair = []
        for m in (model, twin):
            before = counts()
            m.zero_grad()
            loss = F.cross_entropy(m(x), y)  # runs the step before's updates
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p.data.add_(p.grad, alpha=-lr)
            if m is model:
                per_step.append(tuple(a - b for a, b in zip(counts(), before, strict=True)))
            pair.append(float(loss.detach()))
        losses.append(pair)
    assert_trains_like_torch(model, twin, np.array(losses))
    # Step 0 runs no update; steps 1 and 2 run step 0's (traced) and step 1's (replayed).
    assert per_step == [(0, 0), TRACED] + [REPLAYED] * 6, per_step


def clipped_steps_after_initialize(make, steps: int, clip_norms=None, schedule=None):
    """The HF Trainer's step after `initialize` alone: torch's clip, then an optimizer made
    by `make(params)` after `initialize` on the live parameters, an LR scheduler made by
    `schedule(optimizer)`; beside a plain-torch twin. The clip norm of step k is
    `clip_norms[k]` (default 1.0). Returns (model, twin, losses, each wrapped step's (traces,
    replays), compiled-program counts after each step)."""
    torch.manual_seed(0)
    module = MLP()
    twin = copy.deepcopy(module)
    model, _ = zerojax.initialize(module, None, ZERO3)
    run_what_earlier_tests_recorded()
    pairs = [(model, make(model.parameters())), (twin, make(twin.parameters()))]
    schedulers = [schedule(o) for _, o in pairs] if schedule else []
    losses, per_step, compiled = [], [], []
    for step in range(steps):
        x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
        pair = []
        for m, optimizer in pairs:
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            norm = 1.0 if clip_norms is None else clip_norms[step]
            before = counts()
            torch.nn.utils.clip_grad_norm_(m.parameters(), norm)
            optimizer.step()
            optimizer.zero_grad()
            # Run the clip's and the step's recording now (else the next forward would), so
            # that it counts in this step.
            deferred.flush()
            if m is model:
                per_step.append(tuple(a - b for a, b in zip(counts(), before, strict=True)))
            pair.append(float(loss.detach()))
        for scheduler in schedulers:
            scheduler.step()
        losses.append(pair)
        compiled.append(deferred.programs_compiled())
    return model, twin, np.array(losses), per_step, compiled


def decay_groups(params) -> list[dict]:
    """The HF Trainer's and minGPT's two param groups: weight decay on the matrices only."""
    params = list(params)
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


class OwnAdamW(torch.optim.AdamW):
    """A user's own AdamW class: zerojax adopts only torch's own classes into its compiled
    update (`zerojax.train.late_optimizers`), so this one runs torch's step on the live
    tensors."""


class OwnAdam(torch.optim.Adam):
    """As OwnAdamW."""


@pytest.mark.parametrize(
    "make",
    [
        lambda p: OwnAdamW(decay_groups(p), lr=1e-2, fused=True),
        lambda p: OwnAdamW(decay_groups(p), lr=1e-2),
        lambda p: OwnAdam(p, lr=1e-2, amsgrad=True),
    ],
    ids=["fused AdamW", "foreach AdamW", "Adam amsgrad"],
)
def test_adam_built_after_initialize_is_replayed_under_a_schedule_and_varying_clip_norms(make):
    """An AdamW subclass built after `initialize`, fused (the HF Trainer's default) or
    foreach (minGPT's): its step is one `_fused_adamw_` call (the foreach step made one,
    `recorded_adam`), recording one op whose scalar inputs the call derives from its floats
    and host step counts (`replay.derive_scalars`), so the whole step -- clip and update --
    is replayed with each step's learning rate, clip norm and step counts. The first two
    steps are traced (the first makes the state); no program is compiled after the second,
    and the numbers are torch's (the recorded step computes torch's foreach arithmetic,
    which agrees with its fused kernel to float32 rounding)."""
    steps = 12
    norms = [0.5 + 0.25 * (step % 4) for step in range(steps)]
    model, twin, losses, per_step, compiled = clipped_steps_after_initialize(
        make,
        steps,
        clip_norms=norms,
        schedule=lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.1, total_iters=steps),
    )
    assert_trains_like_torch(model, twin, losses)
    assert per_step == [TRACED] * 2 + [REPLAYED] * (steps - 2), per_step
    assert compiled[-1] == compiled[1], compiled


def test_a_derivation_that_does_not_give_the_ops_scalars_is_not_replayed(monkeypatch):
    """A trace checks a call's derived scalars against those its ops took: a derivation
    that gives other values (here every float one ulp up) leaves the step recorded as it
    comes, each step traced (or backed off), never replayed, and the numbers torch's."""
    recorded_adam.install()  # as `initialize` does
    func = torch.ops.aten._fused_adamw_.default
    derivation = replay._derivations[func]

    def off_by_an_ulp(args, kwargs):
        key, values = derivation(args, kwargs)
        return key, [np.nextafter(v, np.inf) if type(v) is float else v for v in values]

    monkeypatch.setitem(replay._derivations, func, off_by_an_ulp)
    model, twin, losses, per_step, _ = clipped_steps_after_initialize(
        lambda p: OwnAdamW(p, lr=1e-2, fused=True), 6
    )
    assert_trains_like_torch(model, twin, losses)
    assert all(replays == 0 for _, replays in per_step), per_step


def test_recordings_that_are_not_traceable_are_traced_less_and_less_often():
    """torch's clip, then an Adafactor built after `initialize` on the live parameters, whose
    step is recorded as one op outside torch's dispatch (`recorded_adafactor`: not
    traceable). After n failures in a row the next 2**(n-1) - 1 such recordings are recorded
    without tracing: the per-call tracing work would buy nothing. The numbers are torch's
    (within its float32 step-size arithmetic: see recorded_adafactor)."""
    model, twin, losses, per_step, _ = clipped_steps_after_initialize(
        lambda p: torch.optim.Adafactor(p, lr=1e-2), 12
    )
    assert_trains_like_torch(model, twin, losses)
    untraced = (0, 0)
    # Failures 1 and 2 skip none and one; failure 3 three, failure 4 seven.
    expected = [TRACED, TRACED, untraced, TRACED] + [untraced] * 3 + [TRACED] + [untraced] * 4
    assert per_step == expected, per_step


def test_steps_that_are_not_traceable_do_not_stop_the_replay_of_those_that_are():
    """Two steps of every four draw random numbers after the update their trace has: those
    steps are not traceable, the others replay the trace. Failures in a row of a recording
    that has a trace do not make the next ones skip it (the back-off is for recordings
    without one)."""
    per_step: list = []
    model, twin, losses, *_ = train(NoiseInTwoStepsOfFour, 8, per_step=per_step)
    assert_trains_like_torch(model, twin, losses)
    assert per_step == [TRACED] * 3 + [REPLAYED] * 2 + [TRACED] * 2 + [REPLAYED], per_step


def record_into(tensor, fn, inputs: list) -> None:
    """Record `fn([the live tensor's value, *inputs])` as one op and write its result into
    the tensor: what a fused optimizer step's own recorder does."""
    value = tensor._source.value()
    (result,) = deferred.record(
        (fn.__name__, value.shape, value.dtype),
        fn,
        [value, *inputs],
        [jax.ShapeDtypeStruct(value.shape, value.dtype)],
    )
    tensor._source.write(result)


def _scaled(arrays: list, rng):
    value, factor, twice = arrays
    return value * factor * twice, None


def test_a_value_a_call_computes_from_its_float_makes_that_float_a_constant(monkeypatch):
    """A call whose recorded op takes one of its floats and a float it computed from it (a
    fused optimizer step's `lr` and `lr * weight_decay`): a replay could not compute the
    second anew, so the first is a constant of the trace, and a new value traces again
    instead of replaying with the old product. Here `mul_` on a parameter is recorded,
    through a stand-in for such a step, as one op taking `factor` and `2 * factor`."""
    torch.manual_seed(0)
    model, _ = zerojax.initialize(MLP(), None, ZERO3)
    weight = next(model.parameters())
    real_run_op = replay.run_op

    def run_op(func, args, kwargs):
        if func not in (torch.ops.aten.mul_.Scalar, torch.ops.aten.mul_.Tensor):
            return real_run_op(func, args, kwargs)
        tensor, factor = args
        record_into(tensor, _scaled, [factor, 2.0 * factor])
        return tensor

    monkeypatch.setattr(replay, "run_op", run_op)
    run_what_earlier_tests_recorded()
    expected = weight.detach().clone().numpy()
    per_step = []
    for factor in (0.5, 0.5, 0.9, 1.1, 1.1):
        before = counts()
        with torch.no_grad():
            weight.data.mul_(factor)
        got = weight.detach().clone().numpy()  # runs the recording
        per_step.append(tuple(a - b for a, b in zip(counts(), before, strict=True)))
        expected = expected * np.float32(factor) * np.float32(2.0 * factor)
        # Up to 10 float32 products on each side, each within half an ulp (6e-8) of the
        # exact one: at most 1.2e-6 apart, however XLA orders them.
        np.testing.assert_allclose(got, expected, rtol=1.2e-6)
    assert per_step == [TRACED, REPLAYED, TRACED, TRACED, REPLAYED], per_step


def _added(arrays: list, rng):
    value, count = arrays
    return value + count, None


def test_a_call_that_changes_a_host_tensor_is_not_replayed(monkeypatch):
    """A call that takes a host tensor's values and advances it (a fused optimizer step's
    host step counts): a replay does not run the call, so it is never replayed; the count
    advances at every step and every step adds it. Here `add_` of a host count to a
    parameter is recorded, through a stand-in for such a step, that way. (A call that
    advances it first and then takes its values is not replayed either: it takes values no
    argument held when it was called.)"""
    torch.manual_seed(0)
    model, _ = zerojax.initialize(MLP(), None, ZERO3)
    weight = next(model.parameters())
    real_run_op = replay.run_op

    def run_op(func, args, kwargs):
        if func is not torch.ops.aten.add_.Tensor:
            return real_run_op(func, args, kwargs)
        tensor, count = args
        record_into(tensor, _added, [host_array(count)])
        count.add_(1.0)  # a host tensor: torch runs this at once
        return tensor

    monkeypatch.setattr(replay, "run_op", run_op)
    run_what_earlier_tests_recorded()
    count = torch.zeros((), dtype=torch.float32)
    expected = weight.detach().clone().numpy()
    replays_before = replay.replays()
    for step in range(5):
        with torch.no_grad():
            weight.data.add_(count)
        got = weight.detach().clone().numpy()  # runs the recording
        assert float(count) == step + 1
        expected = expected + np.float32(step)
        np.testing.assert_array_equal(got, expected)  # the same float32 sums
    assert replay.replays() == replays_before


def test_a_trace_does_not_keep_the_tensors_it_began_with():
    """A trace finds its tensors by identity but holds them weakly: a value a recording took
    in (here an op's result the user dropped) is freed with its tensor."""
    torch.manual_seed(0)
    model, _ = zerojax.initialize(MLP(), None, ZERO3)
    weight = next(model.parameters())
    for _ in range(3):
        scaled = weight.detach() * 2.0
        assert np.isfinite(float(scaled.sum()))  # runs the recording that made `scaled`
        total = float((scaled * 3.0).sum())  # a recording that takes `scaled` in, traced
    assert np.isfinite(total)
    source = weakref.ref(scaled._source)
    del scaled
    gc.collect()
    assert source() is None
