"""A live optimizer's step captured by torch.compile on a twin and run as one recorded op
(zerojax.train.captured_step).

Run: .venv/bin/python -m pytest -q tests/train/test_captured_step.py -p no:cacheprovider
Why: issue 42 (every optimizer's step at the compiled update's cost). A captured step runs no
Python of the optimizer, so every test trains beside a plain-torch twin and checks the numbers
with test_replay's tolerances (losses 1e-5, parameters and state 1e-4 relative: two float32
runs of one loop, see test_torch_optimizers), and counts captures, dynamo traces and replays
to show which path ran.
"""

from __future__ import annotations

import copy
import functools
import logging

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP
from tests.train.test_replay import (
    BATCH,
    ZERO3,
    NormEveryThirdStep,
    assert_state_like_torch,
    assert_trains_like_torch,
    run_what_earlier_tests_recorded,
    steps_beside_torch,
    train,
)
from tests.train.test_torch_optimizers import SignMomentum, relative_errors
from zerojax.train import captured_step, deferred, replay
from zerojax.train.parameters import live_of

pytestmark = pytest.mark.multidevice

STEPS = 12

OPTIMIZERS = {
    # Bias corrections from host step counts; NAdam's `mu_product` is host state too.
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2, decoupled_weight_decay=True),
    # Its rectification switches on at step 6 (rho_t > 5): computed from the step count in
    # float64 on the host as torch does from Python floats; in float32 its cancellation
    # moved a parameter by 1.3e-3 relative.
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2, weight_decay=0.01),
    # State made in its constructor.
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.01),
    # 0-d host tensors (its step-size bounds) and `.item()` of its step count.
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "SignMomentum (user-defined)": lambda p: SignMomentum(p),
}


# torch 2.11's dynamo fails on Adagrad's step (PendingUnbackedSymbolNotFound, from the
# `.item()` of its step count in its learning-rate decay); 2.13's and 2.14's trace it.
NOT_CAPTURED_BY_THIS_TORCH = (
    {"Adagrad"} if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13) else set()
)


def counts() -> dict[str, int]:
    return {
        **captured_step.captures(),
        "replays": replay.replays(),
        "traces_replay": replay.traces(),
    }


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def cosine(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)


def handed_over_and_twin(make):
    """(model, optimizer): the MLP with `make`'s optimizer handed to `initialize` (ZeRO-3), and
    (twin, twin's optimizer): a plain-torch copy with its own."""
    run_what_earlier_tests_recorded()
    torch.manual_seed(0)
    module = MLP()
    twin = copy.deepcopy(module)
    model, optimizer = zerojax.initialize(module, make(module.parameters()), ZERO3)
    return (model, optimizer), (twin, make(twin.parameters()))


def built_after_initialize_and_twin(make):
    """(model, optimizer): the MLP wrapped (ZeRO-3) with no optimizer, and `make`'s built on
    its parameters after `initialize` (minGPT's and the Trainer's way); (twin, twin's
    optimizer): a plain-torch copy with its own."""
    run_what_earlier_tests_recorded()
    torch.manual_seed(0)
    module = MLP()
    twin = copy.deepcopy(module)
    model, _ = zerojax.initialize(module, None, ZERO3)
    return (model, make(model.parameters())), (twin, make(twin.parameters()))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_captured_steps_train_like_torch_under_a_cosine_schedule(name):
    """The first step runs as before (it makes the state), unless the state is there already;
    the next is captured
    (traced twice by dynamo: as it is, and with its learning rate moved, so that the schedule
    is a graph input), and every later step runs the captured program: no recording, no
    replay, no program compiled, whatever the learning rate."""
    before = captured_step.captures()
    per_step: list = []
    model, twin, losses, compiled, (optimizer, twin_optimizer) = train(
        OPTIMIZERS[name], STEPS, schedule=cosine, per_step=per_step
    )
    assert_trains_like_torch(model, twin, losses)
    # torch's format, the host step counts advanced as torch's were
    assert_state_like_torch(optimizer, twin_optimizer)
    after = captured_step.captures()
    assert after["captures"] - before["captures"] == 1
    if name in NOT_CAPTURED_BY_THIS_TORCH:  # refused by dynamo: replayed, as before
        assert per_step == [(1, 0)] + [(0, 1)] * (STEPS - 1), per_step
        return
    # Two traces (as it is, then with the learning rate moved), or one where dynamo already
    # took the learning rate for an input at the first.
    assert after["traces"] - before["traces"] in (1, 2)
    # (replay traces, replays) per step: the first step's recording traced, then none;
    # Adagrad has its state from its constructor: its first step is captured.
    first = 0 if name == "Adagrad" else 1
    assert per_step == [(1, 0)] * first + [(0, 0)] * (STEPS - first), per_step
    assert compiled[-1] == compiled[first], compiled  # none compiled after the captured step
    # Steps after the first captured one run its graph without dynamo (the learning rate read
    # afresh); Rprop's step never reads its learning rate: a changed one goes to dynamo once,
    # whose guards pass the same graph, and is not checked after.
    shortcuts = STEPS - first - (2 if name == "Rprop" else 1)
    assert after["shortcuts"] - before["shortcuts"] == shortcuts


def test_a_changed_hyperparameter_is_traced_again_and_trains_like_torch():
    """RMSprop's weight decay set from step 5: dynamo's guard on it fails, the twin's step is
    traced once more (a new op in its graph), and later steps run the new graph."""

    traces = []

    def weight_decay_from_step_5(step, optimizers):
        traces.append(captured_step.captures()["traces"])
        if step == 5:
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["weight_decay"] = 0.01

    before = captured_step.captures()
    model, twin, losses, *_ = train(
        lambda p: torch.optim.RMSprop(p, lr=1e-3), 10, each_step=weight_decay_from_step_5
    )
    assert_trains_like_torch(model, twin, losses)
    assert captured_step.captures()["captures"] - before["captures"] == 1
    # (traces before each step: captured in step 1, traced again in step 5 only)
    after = captured_step.captures()["traces"]
    assert traces[2:6] == [traces[2]] * 4 and traces[6:] == [after] * 4, traces
    assert after == traces[2] + 1, traces


class LargeStepsThenSigns(torch.optim.Optimizer):
    """A user's optimizer that branches on its learning rate: gradient steps while it is
    above 0.05, sign steps below (dynamo guards the branch on the float it takes as input)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["steps"] = torch.zeros_like(p)
                state["steps"].add_(1.0)
                if group["lr"] > 0.05:
                    p.add_(p.grad, alpha=-group["lr"])
                else:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def test_a_branch_on_a_scheduled_learning_rate_is_never_run_without_dynamo():
    """Its learning rate, a graph input, crosses the branch at step 5: dynamo traces the other
    branch. No step runs a graph without dynamo's guards (a shortcut past them would run the
    first branch's graph after the crossing and train differently from torch)."""

    def decay(step, optimizers):
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = 0.1 * 0.8**step  # 0.1, 0.08, 0.064, 0.051, 0.041, ...

    before = captured_step.captures()
    model, twin, losses, *_ = train(LargeStepsThenSigns, 10, each_step=decay)
    assert_trains_like_torch(model, twin, losses)
    after = captured_step.captures()
    assert after["captures"] - before["captures"] == 1
    assert after["shortcuts"] == before["shortcuts"]


def test_a_step_at_a_learning_rate_of_zero_leaves_the_parameters_as_torch_does():
    """dynamo traces an optimizer's step with `capturable` set, and Adam's capturable step
    divides by the learning rate: AdamW beside another optimizer (its step captured, not the
    compiled update) at lr 0 (a frozen model, a schedule held at 0) made every parameter NaN
    by its third step, where torch's step leaves them as they are. Such steps run as before."""
    (model, (optimizer,)), (twin, (twin_optimizer,)) = handed_over_and_twin(
        lambda p: [torch.optim.AdamW(p, lr=0.0)]
    )
    before = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    steps_beside_torch(((model, optimizer), (twin, twin_optimizer)), 4)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), before[name], err_msg=name)


def test_a_capture_learns_nothing_from_an_earlier_capture_of_its_class():
    """dynamo keeps what it learns of a function's values across its traces (which floats
    changed, and so become graph inputs) by the function's file, line and name. Adafactor
    captured with weight decay 0 and then, in the same process, with 0.1: the second capture
    inherited the first's, took its weight decay as an input with a guard on it, and ran
    every step through dynamo instead of the shortcut past it."""
    for weight_decay in (0.0, 0.1):
        before = captured_step.captures()
        model, twin, losses, *_ = train(
            lambda p, wd=weight_decay: torch.optim.Adafactor(p, lr=1e-2, weight_decay=wd), 5
        )
        assert_trains_like_torch(model, twin, losses)
        after = captured_step.captures()
        # The first step makes the state, the second is captured, the rest take the shortcut.
        assert after["shortcuts"] - before["shortcuts"] == 3, weight_decay


# NAdam: its step counts and `mu_product`, host tensors both captures read and write.
# RMSprop at lr 1e-3 here and in the tests below: at its default, 1e-2, this MLP's loss
# climbs from 2.7 to 5.1 in four steps, and a diverging loop magnifies float32 rounding
# without a bound (on an AVX-512 host zerojax's and torch's losses were 1.04e-5 apart by the
# fourth step, over the 1e-5 that `assert_trains_like_torch` derives for a loop that
# converges; with XLA and ATen capped at AVX2, 1.27e-5 by the second step).
@pytest.mark.parametrize(
    "make",
    [functools.partial(torch.optim.RMSprop, lr=1e-3), torch.optim.NAdam],
    ids=["RMSprop", "NAdam"],
)
def test_gradients_present_in_some_steps_only_keep_a_capture_each(make):
    """One parameter without a gradient every other step: two layouts (which parameters
    have gradients), each captured once and run as it comes, not captured anew each time."""
    (model, optimizer), (twin, twin_optimizer) = handed_over_and_twin(make)
    before = counts()

    def after_backward(step, m):
        # on both models: fc1.bias's gradient gone in odd steps, as after a `p.grad = None`
        # by hand (torch's optimizers skip such a parameter)
        if step % 2 == 1:
            dict(m.named_parameters())["fc1.bias"].grad = None

    pairs = ((model, optimizer), (twin, twin_optimizer))
    assert_trains_like_torch(
        model, twin, steps_beside_torch(pairs, 9, after_backward=after_backward)
    )
    assert_state_like_torch(optimizer, twin_optimizer)
    assert delta(before, counts())["captures"] == 2


def test_a_step_dynamo_cannot_take_whole_runs_as_before(caplog):
    """A step that reads a value on the host and branches on the step count (every third
    step shrinks the parameters by their norm) is not one graph: it is not captured, says
    why once, and runs replayed, as before."""
    caplog.set_level(logging.INFO, logger="zerojax.train.captured_step")
    before = counts()
    model, twin, losses, *_ = train(NormEveryThirdStep, 7)
    assert_trains_like_torch(model, twin, losses)
    assert delta(before, counts())["replays"] > 0
    why = [r.getMessage() for r in caplog.records if "runs op by op" in r.getMessage()]
    assert len(why) == 1 and why[0].startswith("zerojax: NormEveryThirdStep's step"), why


def test_an_optimizer_built_after_initialize_is_captured():
    """minGPT's and the Trainer's way: the optimizer built on the returned model's
    parameters (a class the compiled update does not adopt) takes the captured path at its
    second step, through torch's step hooks."""
    pairs = built_after_initialize_and_twin(lambda p: torch.optim.NAdam(p, lr=1e-2))
    (model, optimizer), (twin, twin_optimizer) = pairs
    before = counts()
    assert_trains_like_torch(model, twin, steps_beside_torch(pairs, 6))
    assert_state_like_torch(optimizer, twin_optimizer)
    assert delta(before, counts())["captures"] == 1
    assert delta(before, counts())["replays"] == 0


def test_step_counts_a_user_holds_keep_counting():
    """NAdam's step counts and `mu_product` (0-d host tensors) are read and written at once
    from one buffer each once captured: the same tensor objects stay in the state, and one
    taken before the capture shows every later step, as under torch."""
    pairs = handed_over_and_twin(torch.optim.NAdam)
    (_, optimizer), (_, twin_optimizer) = pairs
    steps_beside_torch(pairs, 1)  # (the state made: not captured)
    held = {(p, key): value for p, state in optimizer.state.items() for key, value in state.items()}
    steps_beside_torch(pairs, 5)
    assert_state_like_torch(optimizer, twin_optimizer)
    for (p, key), value in held.items():
        assert optimizer.state[p][key] is value, key
    steps = [v for (_, key), v in held.items() if key == "step"]
    assert steps and all(float(v) == 6.0 for v in steps)


def test_a_step_with_nothing_recorded_before_it_runs_alone_and_spares_held_arrays():
    """With nothing recorded before it (`step()` on the optimizer handed to `initialize` runs
    what is pending first), a captured step runs at once as a program of its own, with no
    recording's bookkeeping per tensor, and reuses the buffers of the parameters and the
    state it replaces -- but never one held anywhere else: an array of a state tensor and one
    of a parameter, taken before a step, keep their values."""
    # (lr 1e-3: at 1e-2 this MLP's loss climbs; see the note above the RMSprop case)
    pairs = handed_over_and_twin(lambda p: torch.optim.RMSprop(p, lr=1e-3))
    (model, optimizer), (twin, twin_optimizer) = pairs
    steps_beside_torch(pairs, 2)  # (the state made, then the step captured)
    before, runs = counts(), deferred.programs_run()
    steps_beside_torch(pairs, 3)
    assert delta(before, counts())["steps"] == delta(before, counts())["alone"] == 3
    assert deferred.programs_run() - runs == 3  # (live-tensor programs: the step's)

    parameter = next(model.parameters())
    held = [optimizer.state[parameter]["square_avg"].array, live_of(parameter).array]
    values = [np.asarray(a).copy() for a in held]
    losses = steps_beside_torch(pairs, 2)
    for array, value in zip(held, values, strict=True):
        np.testing.assert_array_equal(np.asarray(array), value)
    assert not np.array_equal(live_of(parameter).numpy(), values[1])  # (it did step)
    np.testing.assert_allclose(losses[:, 0], losses[:, 1], rtol=1e-5)
    assert max(relative_errors(model, twin).values()) <= 1e-4
    assert_state_like_torch(optimizer, twin_optimizer)


def test_a_step_after_recorded_ops_joins_their_program():
    """An optimizer built after `initialize` steps right after torch's clip (the Trainer's
    order), whose ops are still recorded: its captured step joins their recording, one
    program for both, and trains as torch does."""
    pairs = built_after_initialize_and_twin(lambda p: torch.optim.RMSprop(p, lr=1e-3))
    (model, optimizer), (twin, twin_optimizer) = pairs

    def clip(step, m):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)

    steps_beside_torch(pairs, 2, after_backward=clip)  # (the state made, the step captured)
    before, runs = counts(), deferred.programs_run()
    losses = steps_beside_torch(pairs, 4, after_backward=clip)
    assert delta(before, counts())["steps"] == 4
    assert delta(before, counts())["alone"] == 0
    assert deferred.programs_run() - runs == 4  # the clip's and the step's in one
    np.testing.assert_allclose(losses[:, 0], losses[:, 1], rtol=1e-5)
    assert max(relative_errors(model, twin).values()) <= 1e-4
    assert_state_like_torch(optimizer, twin_optimizer)


def test_host_scalars_are_computed_once_per_distinct_computation_over_the_parameters():
    """NAdam computes its bias corrections and `mu_product` from each parameter's own step
    count: the same few computations for every parameter, run once each over the vector of
    the parameters' values, with the bits of the program computing them one by one."""
    pairs = handed_over_and_twin(torch.optim.NAdam)
    (_, optimizer), (_, twin_optimizer) = pairs
    steps_beside_torch(pairs, 4)
    assert_state_like_torch(optimizer, twin_optimizer)
    inner = optimizer._optimizer
    (capture,) = [c for c in captured_step._captures[inner].values() if c]
    program = capture.shortcut.graph.program
    by_parameters = program.host_program.__wrapped__
    assert isinstance(by_parameters, captured_step._HostOverParameters)
    outputs = sum(len(nodes) for _, nodes in program.crossing_groups + program.host_written_groups)
    # (each computation is every parameter's: 8 of the MLP's; 4 leaves room for any grouping
    # that still shares them)
    assert len(by_parameters.groups) * 4 <= outputs
    state, args = inner.state, capture.shortcut.args
    host = [
        program._host_vector(g, state, capture.params, args)
        for g in range(len(program.host_sources))
    ]
    with jax.enable_x64(True):
        ours = jax.tree.leaves(program.host_program(host))
        theirs = jax.tree.leaves(jax.jit(program._host_values)(host))
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_class_captured_before_on_other_shapes_still_steps_without_dynamo():
    """A process that captured an optimizer class on a model of other shapes has dynamo take
    that class's tensor sizes as symbols, which the next trace pins to its twin's sizes: those
    guards hold for the twin itself, so its steps still run without dynamo."""
    run_what_earlier_tests_recorded()
    for hidden in (48, 64):
        torch.manual_seed(0)
        module = MLP(hidden=hidden)
        model, optimizer = zerojax.initialize(module, torch.optim.NAdam(module.parameters()), ZERO3)
        scheduler = cosine(optimizer)
        before = counts()
        for _ in range(5):
            F.cross_entropy(
                model(torch.randn(BATCH, 32)), torch.randint(0, 10, (BATCH,))
            ).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        # (the first step makes the state, the second is captured and traced)
        assert delta(before, counts())["shortcuts"] == 3, (hidden, delta(before, counts()))


def test_a_state_dict_loaded_between_steps_is_what_the_next_step_reads():
    """`load_state_dict` replaces the state tensors (a resume): the captured step reads the
    new ones, not those of its capture. Loaded from the torch twin's state after 3 steps into
    the wrapped one, the next steps match the twin's."""
    (model, optimizer), (twin, twin_optimizer) = handed_over_and_twin(
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5)  # (1e-2: the loss climbs)
    )

    def before_step(step):
        if step == 3:  # a different state than the wrapped one's: the twin's, doubled
            state = copy.deepcopy(twin_optimizer.state_dict())
            for entry in state["state"].values():
                entry["square_avg"] = entry["square_avg"] * 2
            twin_optimizer.load_state_dict(copy.deepcopy(state))
            optimizer.load_state_dict(state)

    steps_beside_torch(((model, optimizer), (twin, twin_optimizer)), 7, before_step=before_step)
    errors = relative_errors(model, twin)
    assert max(errors.values()) <= 1e-4, errors
    assert_state_like_torch(optimizer, twin_optimizer)


def test_state_replaced_between_steps_is_what_the_next_step_reads():
    """Between two steps the optimizer holds the very objects its last captured step found,
    and the next step is bound to them (`step_binding`: not looked up again) -- until one is
    replaced: a moment assigned a new tensor, a step count a new host tensor. The step after
    each reads the new one, as torch's does."""
    pairs = handed_over_and_twin(lambda p: torch.optim.NAdam(p, lr=1e-2))
    (model, optimizer), (twin, twin_optimizer) = pairs

    def before_step(step):
        for opt in (optimizer, twin_optimizer):
            states = list(opt.state.values())
            if step == 4:  # a moment replaced by a new (live, on our side) tensor
                states[1]["exp_avg"] = states[1]["exp_avg"] * -3.0
            if step == 6:  # a step count replaced by a new host tensor
                states[2]["step"] = torch.tensor(40.0)
            if step == 8:  # a moment's value written in place: the same object, bound still
                states[3]["exp_avg_sq"].mul_(4.0)

    before = counts()
    losses = steps_beside_torch(pairs, 10, before_step=before_step)
    assert_trains_like_torch(model, twin, losses)
    assert_state_like_torch(optimizer, twin_optimizer)
    assert float(list(optimizer.state.values())[2]["step"]) == 44.0
    # Steps 0 and 1 make the state and capture the step; 4 and 6 see a replaced tensor; the
    # step after a captured one that was not bound looks its tensors up under the binding
    # made then (2, 5, 7). Bound: 3, 8 and 9.
    assert delta(before, counts())["bound"] == 3, delta(before, counts())


def test_a_loaded_state_dict_frees_the_state_a_bound_step_found():
    """A binding keeps the state tensors its step found (to compare them by identity), and
    `load_state_dict` replaces them: the binding goes first, so the old state's memory goes
    with the old tensors, not at the next step."""
    import gc
    import weakref

    pairs = handed_over_and_twin(lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5))
    (_, optimizer), (_, twin_optimizer) = pairs
    steps_beside_torch(pairs, 4)
    old = [
        weakref.ref(tensor)
        for state in optimizer.state.values()
        for tensor in state.values()
        if tensor.dim() > 0  # (the step counts' buffer stays with the program, 4 bytes each)
    ]
    assert len(old) == 2 * len(optimizer.state) > 0
    optimizer.load_state_dict(copy.deepcopy(twin_optimizer.state_dict()))
    gc.collect()
    assert not [ref for ref in old if ref() is not None]
    # (and `optimizer.state` is what was loaded, as torch's is)
    for ours, theirs in zip(optimizer.state.values(), twin_optimizer.state.values(), strict=True):
        torch.testing.assert_close(ours["square_avg"].cpu(), theirs["square_avg"], rtol=0, atol=0)


# Rprop reads each previous gradient in two of its outputs (the new step sizes, the new
# previous gradient) and writes it; Adadelta's accumulated update and parameter both read
# the square roots and the quotient of its step.
@pytest.mark.parametrize("make", [torch.optim.Rprop, torch.optim.Adadelta])
def test_a_step_keeps_no_parameter_sized_temporaries(monkeypatch, make):
    """A captured step's program passes over its arrays as an update should: it writes its
    state in place (compiled as the update is: `xla_options.in_place_options`), not into
    copies of it, and computes a value two outputs share in each (`_computed_apart`) rather
    than writing it out and reading it back. Either would take parameter-sized temporaries."""
    programs = []
    compile_alone = deferred._compile_alone

    def compile_and_keep(fn, arrays, donated, key, what):
        program, spans_devices = compile_alone(fn, arrays, donated, key, what)

        def kept(given, held, rest):
            programs.append(program.lower(given, held, rest).compile())
            return program(given, held, rest)

        return kept, spans_devices

    monkeypatch.setattr(deferred, "_compile_alone", compile_and_keep)
    monkeypatch.setattr(deferred, "_alone_programs", {})
    pairs = handed_over_and_twin(lambda p: make(p, lr=1e-2))
    (model, optimizer), (twin, twin_optimizer) = pairs
    assert_trains_like_torch(model, twin, steps_beside_torch(pairs, 4))
    assert_state_like_torch(optimizer, twin_optimizer)
    # Per device (ZeRO-3 over the 8): Rprop's copies of its previous gradients took about a
    # device's share of the parameters' bytes (3,680 of 3,525 B, the biases' shards padded),
    # Adadelta's shared values written out two shares (7,392 B); an update's element-wise
    # loops need none (0 B).
    share = sum(p.numel() * 4 for p in model.parameters()) / len(jax.devices())
    temporaries = programs[0].memory_analysis().temp_size_in_bytes
    assert temporaries < share / 4, (temporaries, share)


def test_reductions_of_one_gradient_are_each_computed_from_their_own_copy():
    """Adafactor's row and column means of a matrix gradient's squares each read the gradient
    through a copy of their own (`_reductions_apart`): XLA:CPU writes out an element-wise value
    two reductions share (a pass over the gradient's size each way) rather than computing it
    in each. A reduction alone on its input (a vector's variance, the parameter's norm) and
    the update's norm (computed from more than one input) are left as they are; the step
    still trains like torch's."""
    pairs = handed_over_and_twin(lambda p: torch.optim.Adafactor(p, lr=1e-2))
    (model, optimizer), (twin, twin_optimizer) = pairs
    assert_trains_like_torch(model, twin, steps_beside_torch(pairs, 4))
    assert_state_like_torch(optimizer, twin_optimizer)
    (capture,) = [c for c in captured_step._captures[optimizer._optimizer].values() if c]
    program = capture.lowered[-1].program
    gradients = {
        node.name
        for node, (kind, _, _) in zip(program.live_nodes, program.live_inputs, strict=True)
        if kind == captured_step._GRAD
    }
    apart = {
        source.name: [node.target for node in nodes] for source, nodes in program.reductions_apart
    }
    matrices = [p for p in model.parameters() if p.dim() == 2]
    assert len(apart) == len(matrices) > 0
    assert set(apart) <= gradients
    norm = torch.ops.aten.linalg_vector_norm.default
    assert all(targets == [norm, norm] for targets in apart.values()), apart


def test_what_dynamo_keeps_of_a_capture_holds_it_weakly():
    """Dynamo keeps each traced graph, its backend and guards as long as the traced code,
    which a capture's own code object is: those hold the capture (the twin, the programs, the
    live parameters, through them the engine) weakly, so that it goes with its optimizer."""
    import gc
    import weakref

    run_what_earlier_tests_recorded()
    module = MLP()
    model, optimizer = zerojax.initialize(module, torch.optim.RMSprop(module.parameters()), ZERO3)
    for _ in range(3):
        F.cross_entropy(model(torch.randn(BATCH, 32)), torch.randint(0, 10, (BATCH,))).backward()
        optimizer.step()
        optimizer.zero_grad()
    inner = optimizer._optimizer
    (capture,) = [c for c in captured_step._captures[inner].values() if c]
    assert len(capture.lowered) >= 1 and capture.lowered[-1].program is not None
    gone = weakref.ref(capture)
    del capture
    captured_step._captures.pop(inner)  # as when the optimizer goes
    gc.collect()
    assert gone() is None
