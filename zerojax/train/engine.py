"""The JAX side of a wrapped model: one `TrainState`, and the step programs that advance it.

The engine holds the training state as one frozen `TrainState` pytree (`zerojax.train.state`):
params (`plan.params`, in the policy's param dtype), optional master weights, optimizer state
(`plan.opt_state`), accumulated gradients (`plan.grads`, in the grad dtype), buffers
(replicated), the rng, the loss-scale state and the step counters. torch sees none of these
arrays; the front end (`zerojax.train.module`) turns `model(x)` into `forward`,
`loss.backward()` into `backward`, and the optimizer shim turns `optimizer.step()` into `step`.
Code outside the engine reads the state as `engine.state` and replaces it with
`engine.load(state)` (validated, placed on the plan's shardings); nothing writes the engine's
fields directly.

The programs themselves are pure functions in `zerojax.train.programs`; this class only feeds
them the state's arrays and stores what they return.

Where the arrays live and how torch's values cross into them is the engine's `placement`
(`zerojax.parallel.placement`), chosen once here: one process, several processes (torchrun:
DDP's per-process batches), or *abstract* (`abstract=True`, for planning: `zerojax plan
--devices N`), which holds `jax.ShapeDtypeStruct`s with their shardings instead of arrays, built
from the module's tensor shapes (a model on the `meta` device has no values): its programs are
compiled, never run, and return the shapes and shardings of their results, so a step of a
model that does not fit in memory can be compiled and measured.

Gradient accumulation (`train.gradient_accumulation_steps` = gas) follows DeepSpeed: each
backward's gradients are multiplied by 1/gas (DeepSpeed divides the loss by gas) and summed;
`step()` is called after every micro-batch and applies the update only on every gas-th call (the
accumulation boundary), after which the engine clears the gradients itself; `zero_grad()` before
the boundary is ignored, so a loop written for DeepSpeed (backward, step, zero_grad every
micro-batch) accumulates.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax.sharding import NamedSharding, PartitionSpec

from zerojax.bridge.convert import Converted, narrows_inputs
from zerojax.bridge.index_bounds import raise_if_out_of_range
from zerojax.config import Config
from zerojax.distributed.arrays import host_copy
from zerojax.parallel.placement import placement_kind
from zerojax.runtime import effective_time, gc_pause
from zerojax.sharding import make_mesh, make_sharding_plan
from zerojax.train import deferred, live_optimizer_state, optimizers
from zerojax.train.parameters import plain_parameters
from zerojax.train.precision import (
    PrecisionPolicy,
    initial_loss_scale_state,
    next_loss_scale_state,
)
from zerojax.train.programs import (
    DEVICE_GRADIENT_OPS,
    HOST_GRADIENT_OPS,
    StepPrograms,
    all_finite,
    clip_by_global_norm_jit,
    clip_host_grads,
    find_scalar_loss,
    is_float,
    zeros_like_grads,
)
from zerojax.train.state import TrainState

log = logging.getLogger("zerojax")

__all__ = ["Engine", "find_scalar_loss"]


def _capturing(method):
    """`method` may capture the module (a new input signature): torch.export must see its
    parameters as the ordinary ones they stand in for (`plain_parameters`)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with plain_parameters():
            return method(*args, **kwargs)

    return run


class Engine:
    """Sharded training state of one model plus the programs that run on it."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: Config,
        *,
        loss_fn=None,
        fused: bool | None = None,
        seed: int | None = None,
        mesh=None,
        abstract: bool = False,
    ):
        self.module = module
        self.config = config
        # A Hugging Face Trainer took the model (zerojax.integrations.hf_trainer): it fills the
        # DeepSpeed "auto" values in `config.trainer_autos` by doing those things itself.
        self.in_trainer = False
        self.loss_fn = loss_fn
        self.fused = fused
        self.policy = PrecisionPolicy.from_config(config.precision)
        self.mesh = make_mesh(config) if mesh is None else mesh
        # The one choice of placement (one process, several, or abstract): the rest of the
        # engine and the front end call its methods.
        kind = placement_kind(abstract=abstract)
        params, buffers, self.alias = kind.module_state(module)
        self.plan = make_sharding_plan(params, config, self.mesh)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.programs = StepPrograms(self.plan, self.policy, config)
        self.placement = kind(self.plan)
        self.optimizer_spec: optimizers.OptimizerSpec | None = None
        policy = self.policy

        master_dtype = policy.master_dtype
        has_master = master_dtype is not None and master_dtype != policy.param_dtype
        float_params = {n: a for n, a in params.items() if is_float(a)}
        # (field, arrays, dtype, shardings) of each placed part of the state.
        parts = [
            ("params", params, policy.param_dtype, self.plan.params),
            ("buffers", buffers, None, dict.fromkeys(buffers, self.replicated)),
        ]
        if has_master:
            parts.append(("master", float_params, master_dtype, self.plan.master_weights))
        # One call for the whole state: with several processes it is checked equal on every
        # process in one collective.
        placed = self.placement.place_state(
            {(f, n): a for f, arrays, _, _ in parts for n, a in arrays.items()},
            {(f, n): shardings[n] for f, arrays, _, shardings in parts for n in arrays},
            {(f, n): dtype for f, arrays, dtype, _ in parts for n in arrays},
        )

        def field(name):
            return {n: a for (f, n), a in placed.items() if f == name}

        if seed is None:
            # Drawn from torch's generator without advancing it: the script's own draws after
            # initialize (data order, its sampling) stay those of the same script without us.
            with torch.random.fork_rng(devices=[]):
                seed = int(torch.randint(0, 2**31 - 1, ()).item())
        seed = self.placement.job_seed(seed)  # one dropout stream for the job
        rng = self.placement.place_rng(jax.random.key(seed))
        self._state = TrainState(
            params=field("params"),
            master=field("master") if has_master else None,
            buffers=field("buffers"),
            opt_state=None,
            grads=None,
            rng=rng,
            loss_scale=(
                jax.device_put(
                    jax.tree.map(np.asarray, initial_loss_scale_state(policy.loss_scale)),
                    self.replicated,
                )
                if policy.loss_scale is not None
                else None
            ),
        )
        # The scale without fp16 loss scaling: placed once (`jnp.float32(1.0)` compiled a
        # conversion program in every process).
        self._unit_scale = jax.device_put(np.float32(1.0))
        # Counts the gradients made anew (a backward, a write from torch); with
        # `loss_scale_allows_update`'s last answer, which holds for the gradients it counted.
        self._grads_made = 0
        self._loss_scale_checked: tuple[int, bool] | None = None
        self._converted: dict[bool, Converted] = {}
        self._before_donation: list[Callable[[], None]] = []
        self._torch_optimizer: torch.optim.Optimizer | None = None
        # Optimizers that run their own step (`adopt_live_optimizer`): their state is the
        # TrainState's `opt_state` (`zerojax.train.live_optimizer_state`).
        self._live_optimizers: list[live_optimizer_state.LiveOptimizer] = []
        self._update_prepared = False
        # Index flag vectors of program calls whose results torch has not read yet
        # (`zerojax.bridge.index_bounds`): read when they are, at the latest at the next call.
        self._index_flags: list[jax.Array] = []

    # --- the state -------------------------------------------------------------------------

    @property
    def _state(self) -> TrainState:
        # Recorded live-tensor ops (torch's clip_grad_norm_, an EMA, an optimizer's own step)
        # run before anything reads the state: the engine never sees a value they will change.
        deferred.flush()
        return self._current

    @_state.setter
    def _state(self, state: TrainState) -> None:
        self._current = state

    def before_next_update(self, wait: Callable[[], None]) -> None:
        """Have the next optimizer update call `wait()` before it is dispatched.

        The update is the one program that donates the state's arrays (params, master
        weights, optimizer state: `zerojax.train.programs`); a reader on another thread that
        has not yet enqueued its reads of them (an asynchronous checkpoint's snapshot) blocks
        the update here until it has, after which the runtime orders the donation after those
        reads. Called once, then forgotten."""
        self._before_donation.append(wait)

    @property
    def state(self) -> TrainState:
        """The current training state. A snapshot: the next update donates its params, master
        weights and optimizer state, so read (or copy) its arrays before stepping again. With
        optimizers that run their own step, `opt_state` is their state
        (`zerojax.train.live_optimizer_state`: `{key: {parameter name: array}}`)."""
        state = self._state
        if self._live_optimizers:
            state = state.replace(opt_state=self.live_optimizer_state())
        return state

    def adopt_live_optimizer(self, optimizer: torch.optim.Optimizer, names) -> None:
        """Hold `optimizer` (one that runs its own step; `names`: id(param) -> the engine's
        name) as this engine's optimizer: its state becomes the TrainState's `opt_state`."""
        if self.optimizer_spec is not None:
            raise ValueError(
                "zerojax: this model's optimizer state is the compiled update's; an optimizer "
                "running its own step cannot join it"
            )
        self._live_optimizers.append((optimizer, names))

    def adopt_built_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """`adopt_live_optimizer` for a torch optimizer built on this model's parameters after
        initialize (it runs its own step on them); raises ValueError naming a parameter of
        another model."""
        if any(held is optimizer for held, _ in self._live_optimizers):
            return
        names: dict[int, str] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), self.alias[name])
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in names:
                    raise ValueError(
                        f"zerojax: {type(optimizer).__name__}'s param group {g}, parameter {i} "
                        f"(shape {tuple(param.shape)}) is not a parameter of this model; build "
                        f"the optimizer on model.parameters() of the model zerojax returned"
                    )
        self.adopt_live_optimizer(optimizer, names)

    @property
    def has_live_optimizers(self) -> bool:
        """Whether the optimizer state is held by optimizers running their own step."""
        return bool(self._live_optimizers)

    def live_optimizer_state(self) -> dict[str, dict[str, jax.Array]]:
        """The live optimizers' state in the engine's layout (`live_optimizer_state.gather`)."""
        deferred.flush()
        return live_optimizer_state.gather(self._live_optimizers, self.placement.put, self.plan)

    def load(self, state: TrainState) -> None:
        """Replace the training state with `state`, which must have the current state's tree
        structure, shapes and dtypes (gradients: any subset of the float params, in the grad
        dtype). Arrays are placed on the plan's shardings. Raises ValueError naming the first
        component that does not fit."""
        if not isinstance(state, TrainState):
            raise TypeError(f"engine.load takes a TrainState, got {type(state).__name__}")
        current = self._state
        live_state = state.opt_state if self._live_optimizers else None
        if live_state is not None:  # the live optimizers' state: written into them below
            state = state.replace(opt_state=None)
        for field in ("params", "master", "buffers", "opt_state", "loss_scale"):
            _check_same_layout(field, getattr(current, field), getattr(state, field))
        if state.grads is not None:
            expected = {
                n: jax.ShapeDtypeStruct(p.shape, self.policy.grad_dtype)
                for n, p in current.params.items()
                if is_float(p)
            }
            unknown = sorted(set(state.grads) - set(expected))
            if unknown:
                raise ValueError(f"state.grads: {unknown} are not float parameters of the model")
            _check_same_layout("grads", {n: expected[n] for n in state.grads}, state.grads)
        rng = state.rng
        if not (
            isinstance(rng, jax.Array)
            and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
            and rng.shape == current.rng.shape
        ):
            raise ValueError(
                f"state.rng must be a jax.random.key array of shape {current.rng.shape}, got "
                f"{getattr(rng, 'dtype', type(rng).__name__)} {getattr(rng, 'shape', '')}"
            )
        for counter in ("num_calls", "micro_step", "step", "skipped_steps"):
            value = getattr(state, counter)
            # 0-d integer arrays too: jax.tree.map(np.asarray, state) makes the ints those.
            is_int = np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.integer)
            if not is_int or value < 0:
                raise ValueError(f"state.{counter} must be a non-negative int, got {value!r}")
        plan, put = self.plan, self.placement.put
        self._state = state.replace(
            params={n: put(a, plan.params[n]) for n, a in state.params.items()},
            master=(
                None
                if state.master is None
                else {n: put(a, plan.master_weights[n]) for n, a in state.master.items()}
            ),
            buffers={n: put(a, self.replicated) for n, a in state.buffers.items()},
            opt_state=(
                None
                if state.opt_state is None
                else jax.tree.map(
                    put, state.opt_state, plan.optimizer_state_shardings(state.opt_state)
                )
            ),
            grads=(
                None
                if state.grads is None
                else {n: put(g, plan.grads[n]) for n, g in state.grads.items()}
            ),
            loss_scale=(
                None
                if state.loss_scale is None
                else {k: put(v, self.replicated) for k, v in state.loss_scale.items()}
            ),
            rng=self.placement.place_rng(state.rng),
            num_calls=int(state.num_calls),
            micro_step=int(state.micro_step),
            step=int(state.step),
            skipped_steps=int(state.skipped_steps),
        )
        if live_state is not None:
            live_optimizer_state.scatter(live_state, self._live_optimizers, put, plan)

    # Read-only views of the state's fields (tests, reports and every forward read them; nothing
    # writes them; unlike `state`, they never gather the live optimizers' state).
    params = property(lambda self: self._state.params)
    master = property(lambda self: self._state.master)
    buffers = property(lambda self: self._state.buffers)
    opt_state = property(lambda self: self._state.opt_state)
    grads = property(lambda self: self._state.grads)
    rng = property(lambda self: self._state.rng)
    loss_scale = property(lambda self: self._state.loss_scale)
    num_calls = property(lambda self: self._state.num_calls)
    skipped_steps = property(lambda self: self._state.skipped_steps)
    updates_applied = property(lambda self: self._state.step)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.train.gradient_accumulation_steps

    # --- optimizer -------------------------------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._torch_optimizer = optimizer
        names: dict[int, str] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), self.alias[name])
        spec = self.optimizer_spec = optimizers.optimizer_spec_from_torch(optimizer, names)
        dtype = self.policy.optimizer_state_dtype

        def initial_state(weights):  # named: compile logs say `jit(initial_state)`
            return optimizers.init_state(spec, weights, state_dtype=dtype)

        # One program makes every moment, in its optimizer-state sharding: eager zeros were a
        # compiled program per shape and sharding (12 for a 5-layer MLP, 0.41 s of a 0.85 s
        # initialize), made in the parameter's layout and then moved.
        shardings = self.plan.optimizer_state_shardings(
            jax.eval_shape(initial_state, self._state.weights)
        )
        make = jax.jit(initial_state, out_shardings=shardings)
        weights = self._state.weights
        state = self.placement.make_state(make, weights)
        self._state = self._state.replace(opt_state=state)

    def optimizer_state_from_torch(self, state_dict) -> Any:
        """torch's `optimizer.state_dict()` as this engine's optimizer-state tree (unplaced)."""
        if self.optimizer_spec is None:
            raise RuntimeError("zerojax: no optimizer attached; pass one to zerojax.initialize")
        return optimizers.load_state_dict_into_jax(
            self.optimizer_spec,
            state_dict,
            self._state.weights,
            state_dtype=self.policy.optimizer_state_dtype,
        )

    # --- tracing ---------------------------------------------------------------------------

    @_capturing
    def converted(self, train: bool, args: tuple, kwargs: dict) -> Converted:
        """The program for this mode, traced on first use from the torch inputs."""
        if train not in self._converted:
            # Detached: an input that requires grad (a wrapped model fed by another) would make
            # torch.export read its non-leaf .grad and warn.
            args, kwargs = torch_pytree.tree_map_only(
                torch.Tensor, torch.Tensor.detach, (args, kwargs)
            )
            args, kwargs = self.placement.trace_example(args, kwargs)
            with (
                effective_time.LEDGER.measure("trace_compile", source="torch.export"),
                gc_pause.collection_paused(),  # runtime/gc_pause.py
            ):
                self._converted[train] = Converted(
                    self.traced_module, args, kwargs, train=train, read_values=False
                )
        if narrows_inputs(args, kwargs):
            # A float64 input runs as float32: torch's dtype checks are read off a capture
            # with the real dtype (Converted.check_input_dtypes, once per signature).
            args, kwargs = self.placement.trace_example(
                *torch_pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs))
            )
            self._converted[train].check_input_dtypes(args, kwargs, self.policy.compute_override)
        return self._converted[train]

    def forget_programs(self) -> None:
        """Trace again on the next call: the module's forward was replaced (see
        `ZeroModule.__setattr__`)."""
        for converted in self._converted.values():
            self.programs.forget(converted)
        self._converted.clear()

    @property
    def traced_module(self) -> torch.nn.Module:
        if self.loss_fn is None:
            return self.module
        return _WithLoss(self.module, self.loss_fn)

    def next_rng(self) -> tuple[jax.Array, np.uint32]:
        """(base key, call number): the programs draw `fold_in(key, number)` themselves. An
        eager fold_in is a program of its own, and with several processes one on the global
        mesh, which cost 0.16 s per model call with 2 processes; inside the step it is free,
        and bitwise the same key (threefry is integer arithmetic)."""
        num_calls = self._state.num_calls + 1
        self._state = self._state.replace(num_calls=num_calls)
        return self._state.rng, np.uint32(num_calls)

    def shard_input(self, array: jax.Array) -> jax.Array:
        """One model input placed for the program: split over the data axes when its batch dim
        divides evenly, else replicated (logged once per shape); with several processes
        `array` is this process's rows and the result the global batch
        (`zerojax.parallel.placement`)."""
        return self.placement.shard_input(array)

    # --- what the front end calls ----------------------------------------------------------

    @property
    def scale(self) -> jax.Array:
        loss_scale = self._current.loss_scale
        return loss_scale["scale"] if loss_scale is not None else self._unit_scale

    @_capturing
    def forward(self, converted, args, kwargs, *, differentiable=None, replay=None):
        """Outputs (and, if `differentiable` is given, the pullback) of one model call.

        `replay` (from `fused_forward`) runs that call again, with its random draws and the
        buffers it read, and leaves the buffers as they are (its call already updated them)."""
        self.raise_index_errors()
        rng, buffers = replay if replay is not None else (self.next_rng(), self._state.buffers)
        params = self._state.params
        if differentiable is None:
            program = self.programs.forward(converted)
            outputs, new_buffers, flags = program(params, buffers, args, kwargs, rng)
            pullback = None
        else:
            program = self.programs.forward_vjp(converted, differentiable)
            outputs, new_buffers, residuals, flags = program(params, buffers, args, kwargs, rng)
            pullback = (residuals, params)
        self._note_index_flags(flags)
        if replay is None:
            self._state = self._state.replace(buffers=new_buffers)
        return outputs, pullback

    @_capturing
    def fused_forward(self, converted, args, kwargs, loss_path):
        """Outputs and the gradients of the model's own loss, in one program; and what
        `forward(..., replay=)` needs to run the same call again (random draws, buffers)."""
        self.raise_index_errors()
        rng = self.next_rng()
        state = self._state
        program = self.programs.loss_and_grads(converted, loss_path)
        outputs, new_buffers, grads, flags = program(
            state.params, state.buffers, args, kwargs, rng, self.scale
        )
        self._note_index_flags(flags)
        grads = _reached_only(grads, program.last_reached[2])
        self._state = self._state.replace(buffers=new_buffers)
        self._prepare_update(grads)
        return outputs, grads, (rng, state.buffers)

    def _prepare_update(self, grads) -> None:
        """Once: compile the update program for the call `optimizer.step()` will make after
        these gradients, while the program computing them runs.

        The first fused step waits for its loss (torch reads it) before `loss.backward()` and
        `optimizer.step()`, which would then trace, lower and compile (or load) the update
        with the CPU idle; here that work overlaps the forward-backward program instead. Only
        the signature is predicted (shapes, dtypes, shardings: `Program.prepare`); should the
        step's call differ (a parameter frozen before it, say), the update compiles then, as
        it always did."""
        if self._update_prepared or self.optimizer_spec is None or self._torch_optimizer is None:
            return
        self._update_prepared = True
        state, frozen = self._state, self.frozen_names()
        if state.grads is not None:  # gradients accumulate: the step's tree is not this one
            return
        try:
            hyper = optimizers.hyper_from_torch(self._torch_optimizer, self.optimizer_spec)
        except ValueError:  # the optimizer changed since attach: `step()` says how, not here
            return
        self.programs.update(optimizers.for_hyper(self.optimizer_spec, hyper)).prepare(
            state.params,
            state.master,
            state.opt_state,
            {n: g for n, g in grads.items() if n not in frozen},
            hyper,
            state.loss_scale,
        )

    def backward(self, converted, pullback, cotangents, absent: tuple[bool, ...] = ()):
        """The pullback of `cotangents` into the gradient accumulator; returns the input
        gradients. `absent[i]`: output leaf i got no gradient from torch (its cotangent is
        zeros); parameters the loss reaches through such outputs only get no gradient."""
        self.raise_index_errors()
        residuals, params = pullback
        updated = [
            name
            for name, array in params.items()
            if isinstance(array, jax.Array) and array.is_deleted()  # (not an abstract engine's)
        ]
        if updated:
            # The update donated the params this forward read (the backward program reads them
            # as they were, `programs.Residuals`); torch refuses the same order, its saved
            # weights modified in place by `optimizer.step()`.
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: the parameters ({updated[0]!r} among them) were updated "
                "by optimizer.step() after the forward pass this backward belongs to. Call "
                "backward() before the step that follows its forward pass."
            )
        program = self.programs.backward(converted, absent)
        grads, input_grads = program(residuals, params, cotangents, self.scale)
        assert program.last_reached is not None  # set by the call
        self.accumulate(_reached_only(grads, program.last_reached[0]))
        return input_grads

    def accumulate(self, grads, weight=None):
        """Add one backward's gradients into the sharded accumulator (torch sums into .grad),
        times `weight` (the loss's cotangent) and 1/gradient_accumulation_steps. Parameters
        with `requires_grad=False` get none, as in torch; `grads` holds only the parameters
        this loss reached, so a parameter another backward reached keeps what it has, and one
        no backward reached has no entry (torch's None)."""
        self.raise_index_errors()
        self._grads_made += 1
        frozen = self.frozen_names()
        if frozen:
            grads = {n: g for n, g in grads.items() if n not in frozen}
        if not grads:
            return
        gas = self.gradient_accumulation_steps
        if gas > 1:  # DeepSpeed's loss / gas, as one multiply on the gradients
            weight = jnp.float32(1.0 / gas) * (jnp.float32(1.0) if weight is None else weight)
        # One pass over the gradients at most: `loss.backward()`'s cotangent is 1, which
        # needs no multiply (x * 1.0 == x exactly), and a weight is folded into the add.
        ops = HOST_GRADIENT_OPS if self.grads_offloaded else DEVICE_GRADIENT_OPS
        current = self._state.grads or {}
        kept = {n: g for n, g in current.items() if n not in grads}
        new = {n: g for n, g in grads.items() if n not in current}
        summed = {}
        if len(new) < len(grads):  # some already have a gradient: add into it
            ours = {n: g for n, g in grads.items() if n in current}
            theirs = {n: current[n] for n in ours}
            summed = (
                ops.add(theirs, ours) if weight is None else ops.add_scaled(theirs, ours, weight)
            )
        if new and weight is not None:
            new = ops.scale(new, weight)
        self._state = self._state.replace(grads={**kept, **summed, **new})

    @property
    def grads_offloaded(self) -> bool:
        """Whether the accumulated gradients live in host memory (config `offload.grads`)."""
        return "grads" in self.plan.offloaded

    def in_accumulation_window(self) -> bool:
        """True between the micro-steps of one accumulation (after a step() that did not reach
        the boundary): gradients must survive `zero_grad()` there."""
        return self._state.micro_step % self.gradient_accumulation_steps != 0

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` applies the update (DeepSpeed's name and meaning)."""
        return (self._state.micro_step + 1) % self.gradient_accumulation_steps == 0

    def zero_grad(self, names: frozenset[str] | None = None, *, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients (of `names` only, when given: one of several
        optimizers), or with `set_to_none=False` set those that exist to zeros, which the next
        update steps with as torch does (a parameter without one stays without); ignored
        inside an accumulation window (as DeepSpeed ignores it before the boundary), where the
        boundary step clears them instead."""
        if self.in_accumulation_window():
            return
        grads = self._state.grads
        if grads is None:
            return
        chosen = {n: g for n, g in grads.items() if names is None or n in names}
        rest = {n: g for n, g in grads.items() if n not in chosen}
        if set_to_none:
            self._state = self._state.replace(grads=rest or None)
        elif chosen:
            self._state = self._state.replace(grads={**rest, **zeros_like_grads(chosen)})

    def drop_grad(self, name: str) -> None:
        """`p.grad = None` for one parameter."""
        grads = self._state.grads
        if grads is not None and name in grads:
            grads = {n: g for n, g in grads.items() if n != name}
            self._state = self._state.replace(grads=grads or None)

    def frozen_names(self) -> set[str]:
        """Parameters (canonical names) whose torch stand-in has `requires_grad=False` now."""
        # Read at every backward and update: the flag is torch's own, read without the
        # stand-ins' torch-function dispatch, over the module's parameters listed once (they
        # keep their identity after initialize; the walk over the module tree was ~1 ms of a
        # ConvNeXt step).
        with torch._C.DisableTorchFunctionSubclass():
            return {name for name, p in self._named_parameters if not p.requires_grad}

    @functools.cached_property
    def _named_parameters(self) -> tuple[tuple[str, torch.nn.Parameter], ...]:
        """(canonical name, parameter) of every name the module registers one under."""
        return tuple(
            (self.alias[n], p) for n, p in self.module.named_parameters(remove_duplicate=False)
        )

    # --- single entries, for live tensors (zerojax.train.live_tensor) ------------------------

    # The readers read the state as it is, recorded ops pending: a recording reads through them
    # (`zerojax.train.parameters.EngineEntry` overlays what it has written).

    def has_grad(self, name: str) -> bool:
        grads = self._current.grads
        return grads is not None and name in grads

    def grads_present(self, names: list[str]) -> list[bool]:
        """For each of `names`, whether it has an accumulated gradient (`has_grad`, at once)."""
        grads = self._current.grads
        return [False] * len(names) if grads is None else list(map(grads.__contains__, names))

    def grad_value(self, name: str, dtype) -> jax.Array | None:
        """One parameter's accumulated gradient as torch shows it: unscaled, in `dtype`; None
        when it has none. On the shards: nothing is gathered."""
        grads = self._current.grads
        if grads is None or name not in grads:
            return None
        # An offloaded gradient: torch's ops on it meet device arrays (see weight_value).
        grad = _in_device_memory(grads[name], self.plan)
        if self._current.loss_scale is not None:
            return _unscaled(grad, self.scale, dtype)
        return grad if grad.dtype == dtype else grad.astype(dtype)

    def write_grads(self, values: dict[str, jax.Array]) -> None:
        """Set parameters' accumulated gradients (name -> value as torch shows it: unscaled),
        stored times the loss scale, in the grad dtype, on the plan's shardings."""
        self._grads_made += 1
        for name in values:
            if name not in self.plan.grads:
                raise ValueError(f"zerojax: '{name}' is not a float parameter; it has no gradient")
        dtype, scaled = self.policy.grad_dtype, self._current.loss_scale is not None
        grads = {}
        for name, value in values.items():
            if scaled:
                value = value.astype(jnp.float32) * self.scale
            grads[name] = value if value.dtype == dtype else value.astype(dtype)
        placed = self._placed(grads, self.plan.grads)
        self._state = self._state.replace(grads={**(self._state.grads or {}), **placed})

    def weight_value(self, name: str, dtype) -> jax.Array:
        """One parameter's authoritative value (its master weight where kept), in `dtype`."""
        weights = self._current.master if self._current.master is not None else {}
        # An offloaded weight: torch's ops on it meet device arrays (inputs, gradients), and
        # JAX computes only on operands in one memory space.
        weight = _in_device_memory(weights.get(name, self._current.params[name]), self.plan)
        return weight if weight.dtype == dtype else weight.astype(dtype)

    def buffer_value(self, name: str, dtype) -> jax.Array:
        buffer = self._current.buffers[name]
        return buffer if buffer.dtype == dtype else buffer.astype(dtype)

    def write_buffers(self, values: dict[str, jax.Array]) -> None:
        current = self._state.buffers
        cast = {
            n: v if v.dtype == current[n].dtype else v.astype(current[n].dtype)
            for n, v in values.items()
        }
        placed = self._placed(cast, dict.fromkeys(cast, self.replicated))
        self._state = self._state.replace(buffers={**current, **placed})

    def entry_sharding(self, writer: str, name: str):
        """The sharding a value written through `writer` ("write_weights", "write_grads",
        "write_buffers") into entry `name` is stored on, if a program can leave it there;
        None where the writer must place it (offloaded to host memory)."""
        plan = self.plan
        if writer == "write_buffers":
            return self.replicated
        if writer == "write_grads":
            sharding = plan.grads.get(name)
        elif self._current.master is not None and name in self._current.master:
            sharding = plan.master_weights[name]
        else:
            sharding = plan.params[name]
        if sharding is None or sharding.memory_kind not in (None, "device"):
            return None
        return sharding

    def write_weights(self, values: dict[str, jax.Array]) -> None:
        """Set parameters (their master weights, and the params cast from them, where the
        policy keeps them: what the optimizer update does), on the plan's shardings."""
        state, plan = self._state, self.plan
        params, master = dict(state.params), None if state.master is None else dict(state.master)
        for name, value in values.items():
            if master is not None and name in master:
                kept = master[name] = _as_dtype(value, master[name].dtype)
                params[name] = _as_dtype(kept, params[name].dtype)
            else:
                params[name] = _as_dtype(value, params[name].dtype)
        params.update(self._placed({n: params[n] for n in values}, plan.params))
        if master is not None:
            written = {n: master[n] for n in values if n in master}
            master.update(self._placed(written, plan.master_weights))
        self._state = state.replace(params=params, master=master)

    def _placed(self, arrays: dict[str, jax.Array], shardings) -> dict[str, jax.Array]:
        """`arrays`, each on `shardings[name]`."""
        put = self.placement.put
        return {n: put(a, shardings[n]) for n, a in arrays.items()}

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> jax.Array:
        """Scale the accumulated gradients so their global norm is at most `max_norm`, on the
        shards; returns the norm before clipping (as torch's clip_grad_norm_ does)."""
        grads = self._state.grads
        if grads is None:
            return jnp.float32(0.0)
        if self.grads_offloaded:
            on_device = tuple((n, self.plan.on_device(self.plan.grads[n])) for n in grads)
            grads, norm = clip_host_grads(
                grads, self.scale, float(max_norm), float(norm_type), on_device
            )
        else:
            grads, norm = clip_by_global_norm_jit(
                grads, self.scale, float(max_norm), float(norm_type)
            )
        self._state = self._state.replace(grads=grads)
        return norm

    def step(self, update: Callable[[], None]) -> bool:
        """`optimizer.step()`: one micro-step; `update()` (this engine's `update(hyper)`, or a
        torch optimizer's own step on live tensors) runs on every
        gradient_accumulation_steps-th call (every call without accumulation), after which
        the accumulated gradients are cleared when accumulating. Returns whether it applied."""
        self.raise_index_errors()  # never an update from a step that read a bad index
        boundary = self.is_gradient_accumulation_boundary()
        self._state = self._state.replace(micro_step=self._state.micro_step + 1)
        if not boundary:
            return False
        update()
        if self.gradient_accumulation_steps > 1:  # DeepSpeed zeroes them after the boundary
            self._state = self._state.replace(grads=None)
        return True

    def loss_scale_allows_update(self) -> bool:
        """fp16 loss scaling around an update made outside `update` (a torch optimizer's own
        step on live tensors): whether the accumulated gradients are all finite -- a host sync,
        as DeepSpeed's overflow check is -- with the loss scale moved on by the same rule as the
        compiled update's, and an update it skips counted. True without loss scaling.

        The gradients are stored times the scale: where a clean step grows it, they are scaled
        with it, so the step reads them as their backward made them (read unscaled by the new
        scale, every gradient was halved). Several optimizers stepping on the same gradients
        (Muon beside AdamW; the same backward's, clipped by `clip_grad_norm` or not) get one
        answer, and the scale moves once, as torch's GradScaler updates once after all of
        them."""
        if self._current.loss_scale is None:  # without running recorded work (`_state`)
            return True
        state = self._state
        scale, grads = state.loss_scale, state.grads
        if scale is None or grads is None:
            return True
        checked = self._loss_scale_checked
        if checked is not None and checked[0] == self._grads_made:
            return checked[1]
        finite = _all_finite(grads)
        loss_scale = _next_loss_scale(self.policy.loss_scale, scale, finite)
        applies = self.placement.all_finite(finite)
        if not applies:
            log.warning(
                "zerojax: fp16 gradients overflowed; optimizer step skipped, loss scale %g -> %g",
                float(scale["scale"]),
                float(loss_scale["scale"]),
            )
        elif bool(loss_scale["scale"] != scale["scale"]):  # a host read
            factor = loss_scale["scale"] / scale["scale"]  # a power of two: exact
            grads = self._placed(
                {n: _rescaled(_in_device_memory(g, self.plan), factor) for n, g in grads.items()},
                self.plan.grads,
            )
        self._state = state.replace(
            loss_scale=loss_scale, grads=grads, skipped_steps=state.skipped_steps + (not applies)
        )
        self._loss_scale_checked = (self._grads_made, applies)
        return applies

    def count_update(self) -> None:
        """Count an optimizer update made outside `update` (a torch optimizer's own step)."""
        self._state = self._state.replace(step=self._state.step + 1)

    def update(self, hyper) -> None:
        """One optimizer update from the accumulated gradients now (skipped on fp16 overflow),
        whatever the micro-step."""
        state = self._state
        if state.grads is None:
            return  # torch skips parameters without .grad; with none, nothing happens
        if self.optimizer_spec is None:
            raise RuntimeError("zerojax: no optimizer attached; pass one to zerojax.initialize")
        waits, self._before_donation = self._before_donation, []
        for wait in waits:
            wait()
        program = self.programs.update(optimizers.for_hyper(self.optimizer_spec, hyper))
        compiled = program.num_compiled()
        params, master, opt_state, loss_scale, finite = program(
            state.params, state.master, state.opt_state, state.grads, hyper, state.loss_scale
        )
        if compiled and program.num_compiled() > compiled:
            self._log_new_update(state.grads)
        skipped = state.skipped_steps
        # Reading `finite` is a host sync: only with fp16 loss scaling (and values).
        if state.loss_scale is not None and not self.placement.all_finite(finite):
            skipped += 1
            log.warning(
                "zerojax: fp16 gradients overflowed; optimizer step skipped, loss scale %g -> %g",
                float(state.loss_scale["scale"]),
                float(loss_scale["scale"]),
            )
        self._state = self._state.replace(
            params=params,
            master=master,
            opt_state=opt_state,
            loss_scale=loss_scale,
            step=state.step + 1,
            skipped_steps=skipped,
        )

    def _log_new_update(self, grads) -> None:
        """Say why the update compiled again when the set of parameters with a gradient is
        what changed (each set is its own program, compiled once)."""
        assert self.optimizer_spec is not None  # an update is compiled for one
        without = sorted(n for n in self.optimizer_spec.param_names if n not in grads)
        log.info(
            "zerojax: a new optimizer update program is compiled for %d parameters with "
            "gradients (without: %s%s); cached for later steps with the same set",
            len(grads),
            ", ".join(without[:5]) or "none",
            " ..." if len(without) > 5 else "",
        )

    # --- out-of-range indices (zerojax.bridge.index_bounds) ---------------------------------

    def _note_index_flags(self, flags) -> None:
        """Keep a program call's index flag vector until its results are read."""
        if isinstance(flags, jax.Array):  # (an abstract engine's programs return shapes)
            # One device's copy of the replicated vector: it is ready when that device's part
            # of the program is (the one whose copy of a replicated loss torch has read), and
            # holds every shard's minimum and maximum (an all-reduce computed it).
            self._index_flags.append(flags.addressable_shards[0].data)

    def raise_index_errors(self, *, wait: bool = True) -> None:
        """Raise torch's error (IndexError, RuntimeError) for an index out of range in an
        earlier program call, naming the op and module path.

        With `wait=False` only the flags already computed are read: no host sync. That is how
        `model(x)` reads them after handing its outputs to torch, which waited for the program
        anyway. Every other entry into the engine (the next forward, `backward`, the gradient
        accumulation, `optimizer.step()`) waits for those still pending, so an error surfaces
        at the latest one call after its step, and never after an update that used it."""
        pending = self._index_flags
        if not pending:
            return
        # (`is_ready` is ArrayImpl's, missing from jax.Array's stubs)
        if not wait and not all(flags.is_ready() for flags in pending):  # type: ignore[attr-defined]
            return
        self._index_flags = []
        for flags in pending:
            raise_if_out_of_range(flags)

    def moe_stats(self) -> dict[str, dict[str, Any]]:
        """Routing of the latest model call under expert parallelism (mesh axis `expert` > 1),
        per grouped GEMM ("<module path>:<node>"): `rows_per_expert`, the token-expert pairs
        each expert received (the load histogram: hot experts show here), and `dropped`, the
        pairs capacity-factor dispatch dropped (0 when dropless). Empty without expert
        parallelism. Waits for the step's host callbacks (`jax.effects_barrier`)."""
        jax.effects_barrier()
        return dict(self.programs.expert_load_log.latest)

    def compiled_programs(self) -> dict[str, Any]:
        """Program name (`zerojax.train.programs.PROGRAM_NAMES`) -> the compiled executable its
        latest call ran (`.memory_analysis()`, `.as_text()`), for the programs run so far."""
        return self.programs.compiled()

    # --- state_dict ------------------------------------------------------------------------

    def state_dict_arrays(self) -> dict[str, tuple[np.ndarray, torch.dtype]]:
        """Every parameter and persistent buffer on the host, torch names and the module's
        dtypes. (Not through nn.Module.state_dict: the user's state_dict hooks, which may
        rename or add entries, run once, in `ZeroModule.state_dict`.)"""
        weights, buffers = self._state.weights, self._state.buffers
        out = {}
        for name, tensor in named_state_tensors(self.module):
            canonical = self.alias.get(name, name)
            source = weights if canonical in weights else buffers
            out[name] = (host_copy(source[canonical]), tensor.dtype)
        return out

    def load_state_dict_arrays(self, arrays: dict[str, jax.Array]) -> None:
        state = self._state
        weights, buffers = {}, dict(state.buffers)
        for name, value in arrays.items():
            canonical = self.alias.get(name, name)
            if canonical in state.params:
                weights[canonical] = value
            elif canonical in buffers:
                buffers[canonical] = jnp.asarray(value).astype(buffers[canonical].dtype)
        self.load(state.with_weights(weights).replace(buffers=buffers))


def named_state_tensors(module: torch.nn.Module):
    """(name, tensor) of what `module.state_dict()` holds before its hooks and extra state:
    every parameter (tied ones under each name) and persistent buffer, in its order."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        dotted = f"{prefix}." if prefix else ""
        for name, param in owner._parameters.items():
            if param is not None:
                yield dotted + name, param
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                yield dotted + name, buffer


def _reached_only(grads: dict, reached: dict) -> dict:
    """The gradients the loss reached (`Program.last_reached`): the others are torch's None."""
    return {n: g for n, g in grads.items() if reached[n]}


_all_finite = jax.jit(all_finite)
_next_loss_scale = jax.jit(next_loss_scale_state, static_argnums=0)


def _as_dtype(array, dtype):
    array = jnp.asarray(array) if not isinstance(array, jax.Array) else array
    return array if array.dtype == dtype else array.astype(dtype)


@functools.partial(jax.jit, static_argnames="dtype")
def _unscaled(grad, scale, dtype):
    return (grad.astype(jnp.float32) / scale).astype(dtype)


@jax.jit
def _rescaled(grad, factor):
    return (grad.astype(jnp.float32) * factor).astype(grad.dtype)


def _in_device_memory(array: jax.Array, plan) -> jax.Array:
    """`array`, moved to device memory if it is offloaded to the host."""
    if array.sharding.memory_kind in (None, "device"):
        return array
    return jax.device_put(array, plan.on_device(array.sharding))


def _check_same_layout(field: str, current: Any, new: Any) -> None:
    """Raise ValueError unless `new` has `current`'s tree structure, shapes and dtypes."""
    current_leaves, current_tree = jax.tree_util.tree_flatten_with_path(current)
    new_leaves, new_tree = jax.tree_util.tree_flatten_with_path(new)
    if current_tree != new_tree:  # type: ignore[operator]  # PyTreeDefs compare
        missing = {jax.tree_util.keystr(p) for p, _ in current_leaves} - {
            jax.tree_util.keystr(p) for p, _ in new_leaves
        }
        extra = {jax.tree_util.keystr(p) for p, _ in new_leaves} - {
            jax.tree_util.keystr(p) for p, _ in current_leaves
        }
        raise ValueError(
            f"state.{field} does not have the engine's structure: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(extra)[:5]} (current: {current_tree}, given: {new_tree})"
        )
    for (path, old), (_, value) in zip(current_leaves, new_leaves, strict=True):
        shape, dtype = np.shape(value), getattr(value, "dtype", None)
        if tuple(shape) != tuple(np.shape(old)) or (
            dtype is not None and np.dtype(dtype) != np.dtype(old.dtype)
        ):
            raise ValueError(
                f"state.{field}{jax.tree_util.keystr(path)}: {dtype} {tuple(shape)}, the engine "
                f"holds {old.dtype} {tuple(np.shape(old))}"
            )


class _WithLoss(torch.nn.Module):
    """`loss_fn(module(*inputs), target)`: the model and its loss traced as one program, so the
    fused path applies. Called as `model(*inputs, target)`.

    It shares the module's own parameter, buffer and submodule tables instead of holding the
    module as a child: a child would prefix every traced name with `module.`, and the engine's
    arrays are keyed by the module's own names."""

    def __init__(self, module, loss_fn):
        super().__init__()
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self._modules = module._modules
        self.training = module.training
        # Plain attributes: assigning through nn.Module would register a module-valued
        # loss_fn (nn.CrossEntropyLoss()) in the shared submodule table.
        object.__setattr__(self, "_wrapped_forward", module.forward)
        object.__setattr__(self, "_loss_fn", loss_fn)

    def forward(self, *args, **kwargs):
        *inputs, target = args
        return self._loss_fn(self._wrapped_forward(*inputs, **kwargs), target)
