"""`TrainState`: every array and counter of one wrapped model's training, as one frozen pytree.

The engine holds exactly one `TrainState` and replaces it as training runs; nothing else keeps
training arrays. Everything outside the engine (checkpoints, the optimizer shim, the memory
planner) reads it as `engine.state` and hands a changed copy back through `engine.load(state)`,
which validates it against the current one and places it on the plan's shardings.

    >>> state = engine.state                     # a snapshot: the next step donates its arrays
    >>> engine.load(state.replace(rng=jax.random.key(1)))

Fields holding `None` are components the run does not have (no master weights without a
master dtype, no optimizer state before one is attached, no gradients between `zero_grad()`
and the next backward, no loss scale without fp16 scaling).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def weights_of(params: dict[str, Any], master: dict[str, Any] | None) -> dict[str, Any]:
    """Name -> the authoritative value of each parameter: its master weight where the policy
    keeps one, else the param itself. The optimizer updates these (inside the update program
    too), checkpoints store them, `state_dict()` returns them: the one place that decides
    'master weights if present, else params'."""
    if master is None:
        return dict(params)
    return {name: master.get(name, value) for name, value in params.items()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainState:
    params: dict[str, jax.Array]
    """Canonical parameter name -> the array the model computes with (`plan.params`,
    `precision.param_dtype`)."""
    master: dict[str, jax.Array] | None
    """Float parameter name -> master weight (`plan.master_weights`, `precision.master_dtype`),
    or None when the params are what the optimizer updates."""
    buffers: dict[str, jax.Array]
    """Buffer name -> value (replicated), updated by every training-mode forward."""
    opt_state: Any
    """The optimizer state (`zerojax.train.optimizers.init_state` layout, `plan.opt_state`),
    None until an optimizer is attached."""
    grads: dict[str, jax.Array] | None
    """Parameter name -> gradients summed since the last `zero_grad()` (`plan.grads`,
    the policy's grad dtype, multiplied by the loss scale), None when there are none."""
    rng: jax.Array
    """The base key; call `num_calls` draws `fold_in(rng, num_calls)`."""
    loss_scale: dict[str, jax.Array] | None
    """fp16 dynamic loss-scale state (`zerojax.train.precision`), None without loss scaling."""
    num_calls: int = 0
    """Model calls so far (the rng stream position)."""
    micro_step: int = 0
    """`optimizer.step()` calls so far; an update applies when it reaches a multiple of
    `gradient_accumulation_steps`."""
    step: int = 0
    """Optimizer updates applied (or skipped for fp16 overflow) so far."""
    skipped_steps: int = 0
    """Updates skipped because fp16 gradients overflowed."""

    @property
    def weights(self) -> dict[str, jax.Array]:
        """Name -> the authoritative value of each parameter (`weights_of`)."""
        return weights_of(self.params, self.master)

    def with_weights(self, values: dict[str, jax.Array]) -> TrainState:
        """A copy whose parameters take `values` (name -> array, any float dtype): the master
        weight is set and the param becomes the master cast to the param dtype, exactly what the
        optimizer update does; without a master the param is set directly. Not yet placed:
        `engine.load` places it."""
        params, master = dict(self.params), None if self.master is None else dict(self.master)
        for name, value in values.items():
            if master is not None and name in master:
                master[name] = jnp.asarray(value).astype(master[name].dtype)
                params[name] = master[name].astype(params[name].dtype)
            else:
                params[name] = jnp.asarray(value).astype(params[name].dtype)
        return self.replace(params=params, master=master)

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)
