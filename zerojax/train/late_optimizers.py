"""Optimizers built after `initialize` on a zerojax model's parameters: their state follows the
ZeRO plan, as the state of an optimizer handed to `initialize` does.

minGPT's trainer, the Hugging Face Trainer and Lightning's `configure_optimizers` build their
optimizer on the returned model's parameters: a plain torch optimizer, whose step runs on the
live tensors (`zerojax.train.recorded_adam`, `zerojax.train.replay`). The state it makes
(`zeros_like(p)`) takes its parameter's sharding, which under ZeRO-1 is replicated where the
plan partitions optimizer state. torch's global optimizer step hooks place it as
`ZeroOptimizer` places the state of the optimizers it wraps
(`live_optimizer_state.place_state`): on the plan's optimizer-state sharding of its
parameter (a state tensor made by the step's recording leaves that program there), and where
the plan offloads optimizer state, on the host between steps and in device memory for the
step.

Under fp16 loss scaling a step whose gradients overflowed is skipped, as DeepSpeed skips it:
the pre-step hook drops the optimizer's gradients, so torch's step updates nothing (torch's
optimizers skip a parameter without `.grad`), and the scale moves on by the compiled update's
rule (`Engine.loss_scale_allows_update`). An optimizer `initialize` wrapped does all this
itself (`optimizer_shim`); parameters of no zerojax model are left alone.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from zerojax.train.live_optimizer_state import place_state
from zerojax.train.optimizer_shim import ZeroOptimizer
from zerojax.train.parameters import ShardedParameter

__all__ = ["install"]

# optimizer -> {engine: {(parameter name, state key): weak reference to the tensor placed}}
_placed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_installed: list[bool] = [False]


def install() -> None:
    """Place the state of optimizers built on zerojax parameters around every step from now on
    (idempotent)."""
    if _installed[0]:
        return
    register_optimizer_step_pre_hook(_before_step)
    register_optimizer_step_post_hook(_after_step)
    _installed[0] = True


def _engines(optimizer: torch.optim.Optimizer) -> dict:
    """{engine: {id(param): its name}} for the optimizer's zerojax parameters."""
    engines: dict = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, ShardedParameter):
                names = engines.setdefault(param._zerojax_engine, {})
                names[id(param)] = param._zerojax_name
    return engines


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if isinstance(optimizer, ZeroOptimizer):
        return
    placed = _placed.setdefault(optimizer, {})
    for engine, names in _engines(optimizer).items():
        if not engine.loss_scale_allows_update():  # fp16 gradients overflowed: no step
            for name in names.values():
                engine.drop_grad(name)
        # Host tensors of a parameter's shape (`load_state_dict`: the Trainer resuming) become
        # live ones, and offloaded state comes to device memory, where the step computes.
        place_state(optimizer, names, engine.plan, placed.setdefault(engine, {}), on_device=True)


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if isinstance(optimizer, ZeroOptimizer):
        return
    placed = _placed.setdefault(optimizer, {})
    for engine, names in _engines(optimizer).items():
        place_state(optimizer, names, engine.plan, placed.setdefault(engine, {}))
