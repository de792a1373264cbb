"""Optimizers built after `initialize` on a zerojax model's parameters take the path of one
handed to `initialize`.

minGPT's trainer, the Hugging Face Trainer and `configure_optimizers` in many scripts build
their optimizer on the returned model's parameters. torch's global optimizer step hooks
(installed by `initialize`) find such an optimizer at its first `step()`:

- **torch.optim.AdamW, Adam or SGD** (exactly these classes, with options the compiled update
  supports, on every trainable parameter of one model whose engine has no optimizer yet):
  adopted (`compiled_for`). The engine attaches it as `initialize` attaches one handed to it
  (`ZeroOptimizer`, compiled), and from then on each `step()` is the engine's compiled update
  over the ZeRO-partitioned `TrainState`, with its gradient clipping, accumulation, fp16 loss
  scaling and offload. torch's own step still runs, for its closure and hooks only: the
  pre-step hook hands it a stand-in of the optimizer without param groups, and the update runs
  as the first post-step hook, before the user's. `state_dict()`, `load_state_dict()`,
  `zero_grad()` and `add_param_group()` of the optimizer object become the wrapped one's
  (torch's format, the engine's state); state loaded into it before its first step (the
  Trainer resuming) is taken over. torch's GradScaler unscales its gradients before the step
  (as for any optimizer): a fused one's first step already handed the scaler's scale
  (`grad_scale`) is not adopted, torch's step applies it.
- **Any other** (another class, a subclass, one of several optimizers on one model): a plain
  torch optimizer whose step runs on the live tensors (`zerojax.train.recorded_adam`,
  `zerojax.train.replay`); from its second step the pre-step hook runs it as its captured
  program (`zerojax.train.captured_step`) and torch's step then runs on a stand-in without
  param groups, as for an adopted one. The state it makes (`zeros_like(p)`) takes its parameter's
  sharding, which under ZeRO-1 is replicated where the plan partitions optimizer state, so the
  hooks place it as `ZeroOptimizer` places the state of the optimizers it wraps
  (`live_optimizer_state.place_state`): on the plan's optimizer-state sharding of its
  parameter (a state tensor made by the step's recording leaves that program there), and where
  the plan offloads optimizer state, on the host between steps and in device memory for the
  step. Under fp16 loss scaling a step whose gradients overflowed is skipped, as DeepSpeed
  skips it: the pre-step hook drops the optimizer's gradients, so torch's step updates nothing
  (torch's optimizers skip a parameter without `.grad`), and the scale moves on by the
  compiled update's rule (`Engine.loss_scale_allows_update`).

An optimizer `initialize` wrapped does all this itself (`optimizer_shim`); parameters of no
zerojax model are left alone.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from zerojax.train import captured_step, optimizers, step_binding
from zerojax.train.live_optimizer_state import place_state
from zerojax.train.optimizer_shim import ZeroOptimizer, is_compiled
from zerojax.train.parameters import ShardedParameter

__all__ = ["compiled_for", "install"]

# optimizer -> {engine: {(parameter name, state key): weak reference to the tensor placed}}
_placed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Optimizers looked at and left to run their own step (each is looked at once).
_not_adopted: weakref.WeakSet = weakref.WeakSet()
# The attribute holding an adopted optimizer's ZeroOptimizer (on the optimizer, not in a
# table here: the two refer to each other, and go together when the script drops them).
_ADOPTED = "_zerojax_adopted_by"
# The methods of an adopted optimizer that become its ZeroOptimizer's.
_ADOPTED_METHODS = ("state_dict", "load_state_dict", "zero_grad", "add_param_group")
_installed: list[bool] = [False]


def install() -> None:
    """Adopt, or place the state of, optimizers built on zerojax parameters around every step
    from now on (idempotent)."""
    if _installed[0]:
        return
    register_optimizer_step_pre_hook(_before_step)
    register_optimizer_step_post_hook(_after_step)
    _installed[0] = True


def compiled_for(optimizer: torch.optim.Optimizer) -> ZeroOptimizer | None:
    """The ZeroOptimizer that updates `optimizer` through its engine's compiled program,
    adopting it now if it qualifies (see the module docstring); None if it runs its own step.
    Looks once: an optimizer not adopted now never is."""
    adopted = optimizer.__dict__.get(_ADOPTED)
    if adopted is not None or optimizer in _not_adopted:
        return adopted
    engine = _adoptable_by(optimizer)
    if engine is None:
        _not_adopted.add(optimizer)
        return None
    # State loaded before the first step (the Trainer resuming): torch's format, host tensors.
    loaded = torch.optim.Optimizer.state_dict(optimizer) if optimizer.state else None
    adopted = ZeroOptimizer(optimizer, engine, compiled=True)
    if loaded is not None:
        adopted.load_state_dict(loaded)
        optimizer.state.clear()  # the engine's TrainState holds it now
    for method in _ADOPTED_METHODS:
        setattr(optimizer, method, getattr(adopted, method))
    # torch's GradScaler hands a fused optimizer's step its scale instead of unscaling the
    # gradients; the compiled update takes no scale, so the scaler must unscale them and skip
    # an overflowed step itself, as it does for any other optimizer (and a handed-over one).
    optimizer._step_supports_amp_scaling = False
    optimizer.__dict__[_ADOPTED] = adopted
    # The update runs after torch's step (which ran the closure, on the stand-in), before any
    # post-step hook of the user's: those see the updated parameters, as after torch's step.
    handle = optimizer.register_step_post_hook(_update)
    optimizer._optimizer_step_post_hooks.move_to_end(handle.id, last=False)
    return adopted


def _adoptable_by(optimizer: torch.optim.Optimizer):
    """The engine that can take `optimizer` as its compiled update, or None."""
    if not is_compiled(optimizer) or _scaled_by_grad_scaler(optimizer):
        return None  # (a fused step already given GradScaler's scale: torch's step applies it)
    engines = _engines(optimizer)
    if len(engines) != 1:
        return None
    ((engine, names),) = engines.items()
    if len(names) != sum(len(group["params"]) for group in optimizer.param_groups):
        return None  # a parameter of no zerojax model
    if engine.optimizer_spec is not None or engine.has_live_optimizers:
        return None  # the engine holds another optimizer's state: this one runs its own step
    if any(p.requires_grad and id(p) not in names for p in engine.module.parameters()):
        return None  # another optimizer may train the rest (Muon beside AdamW): none adopted
    try:
        optimizers.optimizer_spec_from_torch(optimizer, names)
    except ValueError:  # an option the compiled update does not have: torch's step does it
        return None
    return engine


def _scaled_by_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch's GradScaler gave this step its scale (`grad_scale`, `found_inf`: its way
    with fused optimizers, whose step unscales the gradients and skips on overflow)."""
    return (
        getattr(optimizer, "grad_scale", None) is not None
        or getattr(optimizer, "found_inf", None) is not None
    )


def _update(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    optimizer.__dict__[_ADOPTED].update()


def _without_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A stand-in for `optimizer` with no param groups: torch's step on it runs the closure
    and updates nothing."""
    stand_in = object.__new__(type(optimizer))
    stand_in.__dict__.update(optimizer.__dict__)
    stand_in.param_groups = []
    return stand_in


def _engines(optimizer: torch.optim.Optimizer) -> dict:
    """{engine: {id(param): its name}} for the optimizer's zerojax parameters."""
    engines: dict = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, ShardedParameter):
                names = engines.setdefault(param._zerojax_engine, {})
                names[id(param)] = param._zerojax_name
    return engines


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs):
    if isinstance(optimizer, ZeroOptimizer):
        return None
    if compiled_for(optimizer) is not None:
        return (_without_groups(optimizer), *args[1:]), kwargs
    placed = _placed.setdefault(optimizer, {})
    engines = _engines(optimizer)
    binding = step_binding.held(optimizer)
    skipped = False
    for engine, names in engines.items():
        if not engine.loss_scale_allows_update():  # fp16 gradients overflowed: no step
            skipped = True
            for name in names.values():
                engine.drop_grad(name)
        # Host tensors of a parameter's shape (`load_state_dict`: the Trainer resuming) become
        # live ones, and offloaded state comes to device memory, where the step computes.
        place_state(
            optimizer,
            names,
            engine.plan,
            placed.setdefault(engine, {}),
            on_device=True,
            all_placed=binding is not None,
        )
    # Its step as its captured program, torch's step then running on a stand-in without param
    # groups; not with a closure (the update must follow it), nor on a skipped step.
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if engines and not skipped and closure is None and captured_step.run(optimizer, binding):
        return (_without_groups(optimizer), *args[1:]), kwargs
    return None


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if isinstance(optimizer, ZeroOptimizer) or _ADOPTED in optimizer.__dict__:
        return
    # (a captured step: torch's then ran on a stand-in, `_before_step`)
    captured = bool(args) and args[0] is not optimizer
    placed = _placed.setdefault(optimizer, {})
    for engine, names in _engines(optimizer).items():
        place_state(
            optimizer, names, engine.plan, placed.setdefault(engine, {}), all_placed=captured
        )
