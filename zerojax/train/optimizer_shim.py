"""The optimizer handed back by `zerojax.initialize`: torch's interface, a sharded JAX update.

`ZeroOptimizer` is a `torch.optim.Optimizer` (built through `Optimizer.__init__`: step hooks
fire, `step(closure)` works) whose `param_groups` *are* the original optimizer's (the same
list), so an LR scheduler attached to either object drives the update.

Two ways to update, chosen by the optimizer's class:

- **Compiled** (`torch.optim.AdamW`, `Adam`, `SGD` themselves): the engine's update program
  (`zerojax.train.optimizers`), proven equal to torch's kernels, one jitted program over the
  ZeRO-partitioned `TrainState`; every `step()` reads the current lr/betas/momentum/weight
  decay from the param groups as traced values (no recompilation).
- **torch's own step on live tensors** (every other `torch.optim` class -- Adafactor, Muon,
  RMSprop, NAdam, RAdam, Adagrad, Adamax, Adadelta, ASGD, Rprop -- a user's own `Optimizer`
  subclass, and any optimizer given in a list of several): the optimizer's own `step()` runs
  unchanged; its parameters and gradients are live views of the engine's arrays
  (`zerojax.train.parameters`), and its ATen ops are recorded and run as one compiled program
  per step (`zerojax.train.deferred`; torch's `foreach` implementations are its default for
  live parameters, `zerojax.train.foreach_default`); from its second step that program is
  captured once by torch.compile on a twin, and the step's Python no longer runs
  (`zerojax.train.captured_step`). The state it creates (`zeros_like(p)`:
  live tensors) is placed on the plan's optimizer-state sharding of its parameter after each
  step, so state memory follows the ZeRO stage; scalar state (step counts) stays as torch made
  it, on the host. The math is torch's own. LBFGS (many closure evaluations per step) and
  SparseAdam (sparse gradients) are refused. With fp16 loss scaling the gradients are checked
  before the step (a host sync, as DeepSpeed's check is): an overflow skips it and moves the
  scale by the compiled update's rule.

`state_dict()` / `load_state_dict()` speak torch's format either way. A torch AdamW, Adam or
SGD built after `initialize` gets a compiled ZeroOptimizer of its own at its first step
(`zerojax.train.late_optimizers`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import warnings
import weakref
from pathlib import Path

import torch

from zerojax.runtime import effective_time
from zerojax.train import captured_step, optimizers, step_binding
from zerojax.train.engine import Engine
from zerojax.train.live_optimizer_state import place_state, unhooked_step
from zerojax.train.live_tensor import watching_host_reads

# Refused on the live path, with why.
_REFUSED = {
    torch.optim.LBFGS: "it re-evaluates the closure many times per step with its own line "
    "search; use another optimizer",
    torch.optim.SparseAdam: "it needs sparse gradients, which zerojax does not produce; use "
    "torch.optim.Adam",
}


def is_compiled(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` updates through the engine's compiled program (its exact class is
    one zerojax reproduces) rather than its own step on live tensors."""
    return type(optimizer) in optimizers.SUPPORTED_OPTIMIZERS.values()


class ZeroOptimizer(torch.optim.Optimizer):
    """torch.optim interface over the engine's ZeRO-partitioned optimizer state."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: Engine,
        *,
        compiled: bool | None = None,
        reports_steps: bool = True,
    ):
        """`compiled`: None chooses by class (`is_compiled`); False runs torch's own step
        (several optimizers on one model do). `reports_steps`: this optimizer's updates count
        as the job's steps (the first of several optimizers)."""
        self._optimizer = optimizer
        self._engine = engine
        self._held_state = None  # see holding_state_dict
        self._compiled = is_compiled(optimizer) if compiled is None else compiled
        self._reports_steps = reports_steps
        if not self._compiled:
            _check_runs_on_live_tensors(optimizer, engine)
        # Optimizer.__init__ sets up the hooks (register_step_pre_hook/post_hook fire around
        # step()) and the state; the groups it builds are then replaced by the original's own
        # list, so an LR scheduler attached to either object drives the update.
        self._adopting_groups = True
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._adopting_groups = False
        self.param_groups = optimizer.param_groups
        # The step hooks are the original's own (the same dicts, as the groups): hooks
        # registered on it before `initialize` fire, and hooks registered on either after. They
        # fire once per step, around this step(); the live path's inner step skips them.
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        # The engine's names of this optimizer's parameters (zero_grad drops only theirs).
        names = {id(p): n for n, p in engine.module.named_parameters(remove_duplicate=False)}
        # (parameter name, state key) -> the state tensor `_place_state` put on its sharding.
        self._placed: dict[tuple[str, str], weakref.ref] = {}
        self._param_names = {
            id(p): engine.alias[names[id(p)]] for g in self.param_groups for p in g["params"]
        }
        if self._compiled:
            engine.attach_optimizer(optimizer)
        else:
            engine.adopt_live_optimizer(optimizer, self._param_names)

    @property
    def state(self):
        """Where the torch optimizer's own step runs (on live tensors), its state: the object
        it holds now (`load_state_dict` replaces it), so `optimizer.state[p]` reads what its
        step reads. Else this object's own (torch's `Optimizer` makes it; the engine holds the
        compiled update's)."""
        return self.__dict__["_own_state"] if self._compiled else self._optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.__dict__["_own_state"] = value

    @property
    def compiled(self) -> bool:
        """Whether updates run the engine's compiled program rather than the torch optimizer's
        own step (its state kept in `optimizer.state`, which the TrainState's `opt_state`
        reflects: `zerojax.train.live_optimizer_state`)."""
        return self._compiled

    @property
    def engine(self) -> Engine:
        """The engine whose TrainState holds this optimizer's state."""
        return self._engine

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The user's torch optimizer (its param_groups are this object's)."""
        return self._optimizer

    @property
    def loss_scale(self) -> float | None:
        """Current fp16 loss scale (None without loss scaling)."""
        scale = self._engine.loss_scale
        return None if scale is None else float(scale["scale"])

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return self._engine.skipped_steps

    def step(self, closure=None):
        """One update (see `Engine.step`). `closure`, as torch's optimizers take it (Lightning
        passes one), is called first with gradients enabled; its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update()
        return loss

    def update(self) -> None:
        """The update of one `step()` whose closure has run (`step` without the closure and
        the step hooks; `zerojax.train.late_optimizers` calls it around a torch optimizer's
        own hooked step)."""
        # An LR scheduler built on the original optimizer watches its step() for this flag.
        self._optimizer._opt_called = True
        engine = self._engine
        if self._compiled:
            hyper = optimizers.hyper_from_torch(self._optimizer, engine.optimizer_spec)
            applied = engine.step(lambda: engine.update(hyper))
        else:
            applied = engine.step(self._torch_step)
        if applied and self._reports_steps:
            effective_time.LEDGER.step_done(engine.updates_applied)

    def _torch_step(self) -> None:
        """The torch optimizer's own step on the live parameters and gradients."""
        engine = self._engine
        # fp16 loss scaling: an overflowed step is skipped (and counted), as in `update`.
        if engine.loss_scale_allows_update():
            clipping = engine.config.train.gradient_clipping
            if clipping is not None:
                engine.clip_grad_norm(clipping)
            # Host state tensors (Adagrad builds its sums in its constructor, `load_state_dict`
            # puts host tensors in) become live before torch's step sees them, and offloaded
            # state is brought in for the step.
            binding = step_binding.held(self._optimizer)
            self._place_state(on_device=True, all_placed=binding is not None)
            with watching_host_reads(functools.partial(_note_host_read, self._optimizer)):
                captured = captured_step.run(self._optimizer, binding)
                if not captured:
                    unhooked_step(self._optimizer)()
            self._place_state(all_placed=captured)
        if self._reports_steps:
            engine.count_update()

    def _place_state(self, on_device: bool = False, all_placed: bool = False) -> None:
        """The state on the plan's optimizer-state shardings (`live_optimizer_state.place_state`;
        `on_device`: in device memory, for the step, where it is offloaded; `all_placed`: every
        state tensor was placed before)."""
        place_state(
            self._optimizer,
            self._param_names,
            self._engine.plan,
            self._placed,
            on_device,
            all_placed,
        )

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` applies the update: always without gradient accumulation,
        every `gradient_accumulation_steps`-th call with it (DeepSpeed's name and meaning).
        Step an LR scheduler only when this was True before `step()` to keep its schedule in
        optimizer updates rather than micro-batches."""
        return self._engine.is_gradient_accumulation_boundary()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients, or with `set_to_none=False` set those that exist to
        zeros, which the next `step()` uses as torch does (ignored between the micro-steps of
        a gradient accumulation, as DeepSpeed does); on the live path, of this optimizer's
        parameters only (another optimizer may own the rest)."""
        if self._compiled:
            self._engine.zero_grad(set_to_none=set_to_none)
        else:
            self._engine.zero_grad(frozenset(self._param_names.values()), set_to_none=set_to_none)

    def state_dict(self):
        if self._held_state is not None:
            return self._held_state
        if not self._compiled:
            return self._optimizer.state_dict()
        engine = self._engine
        return optimizers.state_dict_from_jax(
            engine.optimizer_spec, engine.state.opt_state, self.param_groups
        )

    @contextlib.contextmanager
    def holding_state_dict(self):
        """Within: `state_dict()` returns the copy gathered on entry, as
        `ZeroModule.holding_state_dict` does for the model (every process must enter)."""
        if self._held_state is not None:
            yield
            return
        self._held_state = self.state_dict()
        try:
            yield
        finally:
            self._held_state = None

    def load_state_dict(self, state_dict) -> None:
        if not self._compiled:
            self._optimizer.load_state_dict(state_dict)
            self._place_state()
            return
        engine = self._engine
        opt_state = engine.optimizer_state_from_torch(state_dict)
        engine.load(engine.state.replace(opt_state=opt_state))
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def add_param_group(self, param_group) -> None:
        if getattr(self, "_adopting_groups", False):  # Optimizer.__init__, adopting the groups
            super().add_param_group(param_group)
            return
        raise ValueError(
            "zerojax: add_param_group is not supported once zerojax holds the optimizer (from "
            "initialize, or from the first step of one built after it); build the optimizer "
            "with all its groups first"
        )

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self._optimizer!r}, zero_stage={self._engine.plan.stage})"


# Optimizer classes whose host reads were reported (once each).
_reported_host_reads: set[type] = set()
# Frames between a host read and the code that asked for it: zerojax's, and torch's tensor
# methods and dispatch.
_ZEROJAX = str(Path(__file__).resolve().parents[1]) + os.sep
_PLUMBING = ("torch/_tensor.py", "torch/overrides.py", "torch/_ops.py", "torch/utils/")


def _note_host_read(optimizer: torch.optim.Optimizer) -> None:
    """Warn, once per optimizer class, that its step reads values on the host, naming the
    line: each read runs what was recorded before it, so the step is several programs."""
    kind = type(optimizer)
    if kind in _reported_host_reads:
        return
    _reported_host_reads.add(kind)
    where = "an unknown line"
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if path.startswith(_ZEROJAX) or any(p in path.replace("\\", "/") for p in _PLUMBING):
            continue
        where = f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
        break
    warnings.warn(
        f"zerojax: {kind.__name__}.step reads tensor values on the host at {where}; each read "
        f"runs the ops recorded before it, so this optimizer's step runs as several compiled "
        f"programs instead of one (same numbers, slower)",
        stacklevel=2,
    )


def _check_runs_on_live_tensors(optimizer: torch.optim.Optimizer, engine: Engine) -> None:
    for refused, why in _REFUSED.items():
        if isinstance(optimizer, refused):
            raise ValueError(  # noqa: TRY004 (a value the user chose, not a wrong type)
                f"zerojax: torch.optim.{refused.__name__} is not supported: {why}"
            )
    # Its state can live on the host between steps (`ZeroOptimizer._torch_step` brings it in);
    # the other states' offload is the compiled update's way of computing on the host.
    others = [s for s in engine.config.offload.host_states if s != "optimizer"]
    if others:
        raise ValueError(
            f"zerojax: offload.{others[0]}=host moves state to host memory around the "
            f"compiled update, which {type(optimizer).__name__} does not use (it runs its own "
            f"step on live tensors; offload.optimizer=host works with it); use "
            f"torch.optim.AdamW/Adam/SGD, or remove that offload"
        )
