"""The jitted, sharded train step: one XLA program per (plan, optimizer-state layout, batch shape).

ZeRO is nothing but where arrays live, so the step is an ordinary `value_and_grad` + update with
sharding constraints at the three places the stage decides:

    params (plan.params)  --constrain to plan.compute_params-->  forward/backward
                                                                 (stage 3: all-gather per step)
    grads  --constrain to plan.grads-->  update_fn               (stage 2+: reduced into shards)
    new params / opt state  --out_shardings-->  plan.params / plan.opt_state

The gathered compute params are an intermediate of the step, never an output, so XLA frees them
after use: stage 3 stores 1/N_d of the params between steps. Params and optimizer state are
donated: the caller's old arrays are invalid after a step (pass the returned ones back in).

    >>> step = make_train_step(converted, plan, adamw_update, loss_fn=cross_entropy)
    >>> params = step.shard_params(converted.params)
    >>> opt_state = step.init_opt_state(optax.adamw(3e-4).init, params)
    >>> params, opt_state, buffers, loss = step(params, opt_state, converted.buffers, (x, y))

`batch` is a tuple of arrays; the model is called on its first `num_model_inputs` entries (all by
default) and `loss_fn(outputs, batch)` sees all of it, so targets ride along after the inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from zerojax.sharding.zero import ShardingPlan

__all__ = ["TrainStep", "make_train_step", "model_scalar_loss"]

UpdateFn = Callable[[Any, Any, Any], tuple[Any, Any]]
"""update_fn(params, grads, opt_state) -> (new_params, new_opt_state)."""


def model_scalar_loss(outputs: Any, batch: Any = None) -> jax.Array:
    """The loss the model computes itself: a scalar output, `outputs.loss` (Hugging Face),
    `outputs["loss"]`, or a scalar first element of a tuple output."""
    candidates = [outputs, getattr(outputs, "loss", None)]
    if isinstance(outputs, dict):
        candidates.append(outputs.get("loss"))
    if isinstance(outputs, (tuple, list)) and outputs:
        candidates.append(outputs[0])
    for value in candidates:
        if isinstance(value, jax.Array) and value.ndim == 0:
            return value
    shapes = jax.tree.map(lambda x: tuple(getattr(x, "shape", ())), outputs)
    raise ValueError(
        f"the model returns no scalar loss (outputs have shapes {shapes}); pass "
        "loss_fn=lambda outputs, batch: ... to make_train_step"
    )


class TrainStep:
    """A sharded train step for one converted module and plan; see the module docstring.

    Call it as `step(params, opt_state, buffers, batch, rng=None)` ->
    `(params, opt_state, buffers, loss)`. `lower(...)`/`compile(...)` take the same arguments and
    give the XLA program (`compiled.memory_analysis()`, `compiled.as_text()`).
    """

    def __init__(
        self,
        converted,
        plan: ShardingPlan,
        update_fn: UpdateFn,
        *,
        loss_fn: Callable[[Any, tuple], jax.Array] | None = None,
        num_model_inputs: int | None = None,
        donate: bool = True,
    ):
        self.converted = converted
        self.plan = plan
        self.update_fn = update_fn
        self.loss_fn = loss_fn or model_scalar_loss
        self.num_model_inputs = num_model_inputs
        self.donate = donate
        self.replicated = NamedSharding(plan.mesh, PartitionSpec())
        self._jitted: dict[Any, Any] = {}

    # ------------------------------------------------------------------ placement

    def shard_params(self, params: dict[str, Any]) -> dict[str, jax.Array]:
        """Copies of `params` placed per `plan.params`. Never the input's buffers: the step
        donates what it is given (device_put may reuse a buffer even with may_alias=False, so
        the copy goes through host memory)."""
        return {
            name: jax.device_put(np.asarray(value), self.plan.params[name])
            for name, value in params.items()
        }

    def shard_batch(self, batch: tuple) -> tuple:
        """The batch placed per `plan.input_sharding(ndim)`; its batch dim must split evenly."""
        split = math.prod(self.plan.mesh.shape[a] for a in self.plan.batch_axes)
        dim = self.plan.batch_dim
        for x in jax.tree.leaves(batch):
            if np.ndim(x) > dim and np.shape(x)[dim] % split:
                raise ValueError(
                    f"batch input of shape {np.shape(x)}: dim {dim} (size {np.shape(x)[dim]}) "
                    f"does not split over {'x'.join(self.plan.batch_axes)}={split}; use a batch "
                    f"size that is a multiple of {split}"
                )
        return jax.tree.map(lambda x, s: jax.device_put(x, s), batch, self._batch_shardings(batch))

    def init_opt_state(self, init_fn: Callable[[Any], Any], params: dict[str, jax.Array]) -> Any:
        """`init_fn(params)` (e.g. `optax.adamw(...).init`) computed straight into
        `plan.opt_state` shardings: the full state never exists on one device."""
        shapes = jax.eval_shape(init_fn, params)
        shardings = self.plan.optimizer_state_shardings(shapes)
        return jax.jit(init_fn, out_shardings=shardings)(params)

    # ------------------------------------------------------------------ the step

    def loss_and_grads(self, params, buffers, batch, rng=None):
        """(loss, grads, new_buffers) with grads placed per `plan.grads`; no update."""
        key = ("grads", *self._key(None, batch, rng))
        if key not in self._jitted:
            params_in, buffers_in, batch_in, rng_in = self._in_shardings(buffers, batch, rng)
            self._jitted[key] = jax.jit(
                self._loss_and_grads,
                in_shardings=(params_in, buffers_in, batch_in, rng_in),
                out_shardings=(self.replicated, dict(self.plan.grads), buffers_in),
            )
        return self._jitted[key](params, buffers, batch, rng)

    def __call__(self, params, opt_state, buffers, batch, rng=None):
        return self._jit(opt_state, buffers, batch, rng)(params, opt_state, buffers, batch, rng)

    def lower(self, params, opt_state, buffers, batch, rng=None):
        return self._jit(opt_state, buffers, batch, rng).lower(
            params, opt_state, buffers, batch, rng
        )

    def compile(self, params, opt_state, buffers, batch, rng=None):
        """The compiled XLA executable: `.memory_analysis()`, `.as_text()` (post-SPMD HLO)."""
        return self.lower(params, opt_state, buffers, batch, rng).compile()

    def _loss_and_grads(self, params, buffers, batch, rng):
        def loss(params):
            # Stage 3: params arrive sharded over the data axes; this constraint is where XLA
            # all-gathers them (per step, freed after use).
            params = jax.lax.with_sharding_constraint(params, dict(self.plan.compute_params))
            inputs = batch if self.num_model_inputs is None else batch[: self.num_model_inputs]
            outputs, new_buffers = self.converted.apply(params, buffers, *inputs, rng=rng)
            return self.loss_fn(outputs, batch), new_buffers

        (value, new_buffers), grads = jax.value_and_grad(loss, has_aux=True)(params)
        # Stage 2+: grads land in shards (reduce-scatter, or all-reduce + slice on CPU).
        grads = jax.lax.with_sharding_constraint(grads, dict(self.plan.grads))
        return value, grads, new_buffers

    def _step(self, params, opt_state, buffers, batch, rng):
        value, grads, new_buffers = self._loss_and_grads(params, buffers, batch, rng)
        params, opt_state = self.update_fn(params, grads, opt_state)
        return params, opt_state, new_buffers, value

    def _jit(self, opt_state, buffers, batch, rng):
        key = ("step", jax.tree.structure(opt_state), *self._key(buffers, batch, rng))
        if key not in self._jitted:
            params_in, buffers_in, batch_in, rng_in = self._in_shardings(buffers, batch, rng)
            opt_in = self.plan.optimizer_state_shardings(opt_state)
            self._jitted[key] = jax.jit(
                self._step,
                in_shardings=(params_in, opt_in, buffers_in, batch_in, rng_in),
                out_shardings=(params_in, opt_in, buffers_in, self.replicated),
                donate_argnums=(0, 1) if self.donate else (),
            )
        return self._jitted[key]

    def _key(self, buffers, batch, rng):
        shapes = tuple((np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(batch))
        return jax.tree.structure(batch), shapes, rng is None

    def _batch_shardings(self, batch):
        def pick(x):
            ndim = np.ndim(x)
            return self.plan.input_sharding(ndim) if ndim else self.replicated

        return jax.tree.map(pick, batch)

    def _in_shardings(self, buffers, batch, rng):
        buffers = jax.tree.map(lambda _: self.replicated, buffers)
        rng_in = None if rng is None else self.replicated
        return dict(self.plan.params), buffers, self._batch_shardings(batch), rng_in


def make_train_step(
    converted,
    plan: ShardingPlan,
    update_fn: UpdateFn,
    *,
    loss_fn: Callable[[Any, tuple], jax.Array] | None = None,
    num_model_inputs: int | None = None,
    donate: bool = True,
) -> TrainStep:
    """A jitted train step for `converted` (from `zerojax.convert`) sharded per `plan`.

    `update_fn(params, grads, opt_state) -> (params, opt_state)` applies the optimizer, e.g.

        opt = optax.adamw(1e-3)
        def update_fn(params, grads, state):
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

    `loss_fn(outputs, batch) -> scalar` defaults to the model's own scalar output
    (`model_scalar_loss`). The model is called on `batch[:num_model_inputs]` (all of `batch`
    when None). With `donate`, params and optimizer state passed to the step are consumed.
    """
    return TrainStep(
        converted,
        plan,
        update_fn,
        loss_fn=loss_fn,
        num_model_inputs=num_model_inputs,
        donate=donate,
    )
