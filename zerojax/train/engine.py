"""The JAX side of a wrapped model: its sharded state and the jitted programs that touch it.

The engine owns every array of the training state, each placed where the ZeRO plan says:
params (`plan.params`, in the policy's param dtype), optional master weights, optimizer state
(`plan.opt_state`), accumulated gradients (`plan.grads`, in the grad dtype), buffers
(replicated). torch sees none of these arrays; the front end (`zerojax.train.module`) turns
`model(x)` into `forward`, `loss.backward()` into `backward`, and the optimizer shim turns
`optimizer.step()` into `step`.

Programs, each one `jax.jit` cached per input shape:

- forward with vjp: outputs plus the pullback (`jax.vjp` inside jit returns it as a pytree of
  residuals, so the backward program is compiled once and the residuals stay on device);
- fused loss: forward and backward in one program when the traced model returns its own loss
  (a scalar, `.loss` or `["loss"]`): nothing but the loss crosses into torch;
- backward: pullback of the cotangents, added into the sharded gradient accumulator;
- step: unscale (fp16), clip, torch-exact optimizer update, loss-scale bookkeeping.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax.sharding import NamedSharding, PartitionSpec

from zerojax.bridge.convert import Converted, state_arrays
from zerojax.config import Config
from zerojax.pallas_kernels.backend import auto_picks_pallas
from zerojax.runtime import effective_time
from zerojax.sharding import make_mesh, make_sharding_plan
from zerojax.train import optimizers
from zerojax.train.precision import (
    PrecisionPolicy,
    initial_loss_scale_state,
    next_loss_scale_state,
)

log = logging.getLogger("zerojax")


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def find_scalar_loss(outputs) -> Any:
    """Path to the loss in a model's outputs: () for a scalar output, 'loss' for `.loss` or
    `["loss"]`; None when the model returns no loss of its own."""
    if isinstance(outputs, jax.ShapeDtypeStruct | jax.Array):
        return () if outputs.ndim == 0 and _is_float(outputs) else None
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if isinstance(loss, jax.ShapeDtypeStruct | jax.Array) and loss.ndim == 0:
        return "loss"
    return None


def _pick_loss(outputs, path):
    if path == ():
        return outputs
    return outputs["loss"] if isinstance(outputs, dict) else outputs.loss


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
    ):
        self.module = module
        self.config = config
        self.loss_fn = loss_fn
        self.fused = fused
        self.policy = PrecisionPolicy.from_config(config.precision)
        self.mesh = make_mesh(config)
        params, buffers, self.alias = state_arrays(module)
        self.plan = make_sharding_plan(params, config, self.mesh)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        policy = self.policy

        def place(array, sharding, dtype=None):
            if dtype is not None and _is_float(array):
                array = array.astype(dtype)
            # Through host memory: device_put onto a replicated sharding may reuse the input's
            # buffer, which donation would then invalidate.
            return jax.device_put(np.asarray(array), sharding)

        self.params = {
            n: place(a, self.plan.params[n], policy.param_dtype) for n, a in params.items()
        }
        self.master = None
        if policy.master_dtype is not None and policy.master_dtype != policy.param_dtype:
            self.master = {
                n: place(a, self.plan.master_weights[n], policy.master_dtype)
                for n, a in params.items()
                if _is_float(a)
            }
        self.buffers = {n: place(a, self.replicated) for n, a in buffers.items()}
        self.grads: dict[str, jax.Array] | None = None
        self.optimizer_spec = None
        self.opt_state = None
        self.loss_scale = (
            jax.device_put(initial_loss_scale_state(policy.loss_scale), self.replicated)
            if policy.loss_scale is not None
            else None
        )
        self.skipped_steps = 0
        seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed
        self.rng = jax.random.key(seed)
        self.num_calls = 0
        self._converted: dict[bool, Converted] = {}
        self._programs: dict[tuple, Any] = {}

    # --- optimizer -------------------------------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        names = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), self.alias[name])
        self.optimizer_spec = optimizers.optimizer_spec_from_torch(optimizer, names)
        weights = self.master if self.master is not None else self.params
        state = optimizers.init_state(
            self.optimizer_spec, weights, state_dtype=self.policy.optimizer_state_dtype
        )
        self.opt_state = self._place_opt_state(state)

    def _place_opt_state(self, state):
        def place(path, leaf):
            name = path[-1].key if path and hasattr(path[-1], "key") else None
            sharding = self.plan.opt_state.get(name, self.replicated)
            if np.shape(leaf) != tuple(self.plan.shapes.get(name, ())):
                sharding = self.replicated
            return jax.device_put(leaf, sharding)

        return jax.tree_util.tree_map_with_path(place, state)

    # --- tracing ---------------------------------------------------------------------------

    def converted(self, train: bool, args: tuple, kwargs: dict) -> Converted:
        """The program for this mode, traced on first use from the torch inputs."""
        if train not in self._converted:
            # Detached: an input that requires grad (a wrapped model fed by another) would make
            # torch.export read its non-leaf .grad and warn.
            args, kwargs = torch_pytree.tree_map_only(
                torch.Tensor, torch.Tensor.detach, (args, kwargs)
            )
            with effective_time.LEDGER.measure("trace_compile", source="torch.export"):
                self._converted[train] = Converted(
                    self.traced_module, args, kwargs, train=train, read_values=False
                )
        return self._converted[train]

    @property
    def traced_module(self) -> torch.nn.Module:
        if self.loss_fn is None:
            return self.module
        return _WithLoss(self.module, self.loss_fn)

    def next_rng(self) -> jax.Array:
        self.num_calls += 1
        return jax.random.fold_in(self.rng, self.num_calls)

    def shard_input(self, array: jax.Array) -> jax.Array:
        """Batch inputs are split over the data axes when their batch dim divides evenly."""
        sharding = self.plan.input_sharding(array.ndim)
        spec = sharding.spec
        for dim, axes in enumerate(spec):
            if axes is None:
                continue
            size = int(np.prod([self.mesh.shape[a] for a in np.atleast_1d(axes)]))
            if array.shape[dim] % size:
                return jax.device_put(array, self.replicated)
        return jax.device_put(array, sharding)

    # --- the programs ----------------------------------------------------------------------

    def _apply(self, converted, params, buffers, args, kwargs, rng):
        """The converted model on compute-dtype, compute-layout params (stage 3 gathers here)."""
        compute = {}
        for name, value in params.items():
            value = jax.lax.with_sharding_constraint(value, self.plan.compute_params[name])
            if _is_float(value) and self.policy.compute_override is not None:
                value = value.astype(self.policy.compute_dtype)
            compute[name] = value
        outputs, new_buffers = converted.apply(
            compute,
            buffers,
            *args,
            rng=rng,
            float_dtype=self.policy.compute_override,
            kernels=self.config.kernels,
            batch_mesh=self._batch_mesh(),
            **kwargs,
        )
        outputs = jax.tree.map(
            lambda x: x.astype(self.policy.output_dtype) if _is_float(x) else x, outputs
        )
        return outputs, new_buffers

    def _batch_mesh(self) -> tuple | None:
        """(mesh, batch axes) for the kernels: the axes `shard_input` splits dim 0 over."""
        axes = self.plan.input_sharding(2).spec[0]
        if axes is None:
            return None
        return self.mesh, tuple(np.atleast_1d(axes).tolist())

    def _program(self, kind: str, converted: Converted, **static):
        key = (kind, id(converted), tuple(sorted(static.items())))
        if key not in self._programs:
            self._programs[key] = getattr(self, f"_build_{kind}")(converted, **static)
        return self._programs[key]

    def _build_forward(self, converted):
        def forward(params, buffers, args, kwargs, rng):
            return self._apply(converted, params, buffers, args, kwargs, rng)

        return jax.jit(forward)

    def _build_forward_vjp(self, converted, differentiable: tuple[bool, ...]):
        def forward(params, buffers, args, kwargs, rng):
            def f(params, diff_args):
                merged = iter(diff_args)
                full = [next(merged) if d else a for a, d in zip(args, differentiable)]
                return self._apply(converted, params, buffers, full, kwargs, rng)

            diff_args = [a for a, d in zip(args, differentiable) if d]
            outputs, pullback, new_buffers = jax.vjp(f, params, diff_args, has_aux=True)
            return outputs, new_buffers, pullback

        return jax.jit(forward)

    def _build_fused(self, converted, loss_path):
        def fused(params, buffers, args, kwargs, rng, scale):
            def f(params):
                outputs, new_buffers = self._apply(converted, params, buffers, args, kwargs, rng)
                loss = _pick_loss(outputs, loss_path)
                return loss.astype(jnp.float32) * scale, (outputs, new_buffers)

            (_, (outputs, new_buffers)), grads = jax.value_and_grad(f, has_aux=True)(params)
            return outputs, new_buffers, self._as_grads(grads)

        return jax.jit(fused)

    def _as_grads(self, grads):
        return {
            n: jax.lax.with_sharding_constraint(
                g.astype(self.policy.grad_dtype), self.plan.grads[n]
            )
            for n, g in grads.items()
            if _is_float(g)
        }

    def _build_backward(self, converted):
        def backward(pullback, cotangents, scale):
            cotangents = jax.tree.map(
                lambda c: None if c is None else (c * scale).astype(c.dtype), cotangents
            )
            param_grads, input_grads = pullback(cotangents)
            return self._as_grads(param_grads), input_grads

        return jax.jit(backward)

    # --- what the front end calls ----------------------------------------------------------

    @property
    def scale(self) -> jax.Array:
        return self.loss_scale["scale"] if self.loss_scale is not None else jnp.float32(1.0)

    def forward(self, converted, args, kwargs, *, differentiable=None):
        """Outputs (and, if `differentiable` is given, the pullback) of one model call."""
        rng = self.next_rng()
        if differentiable is None:
            outputs, new_buffers = self._program("forward", converted)(
                self.params, self.buffers, args, kwargs, rng
            )
            pullback = None
        else:
            program = self._program("forward_vjp", converted, differentiable=differentiable)
            outputs, new_buffers, pullback = program(self.params, self.buffers, args, kwargs, rng)
        self.buffers = new_buffers
        return outputs, pullback

    def fused_forward(self, converted, args, kwargs, loss_path):
        """Outputs and the gradients of the model's own loss, in one program."""
        program = self._program("fused", converted, loss_path=loss_path)
        outputs, new_buffers, grads = program(
            self.params, self.buffers, args, kwargs, self.next_rng(), self.scale
        )
        self.buffers = new_buffers
        return outputs, grads

    def backward(self, converted, pullback, cotangents):
        grads, input_grads = self._program("backward", converted)(pullback, cotangents, self.scale)
        self.accumulate(grads)
        return input_grads

    def accumulate(self, grads, weight=None):
        """Add one backward's gradients into the sharded accumulator (torch sums into .grad).
        Parameters with `requires_grad=False` get none, as in torch."""
        frozen = self.frozen_names()
        if frozen:
            grads = {n: g for n, g in grads.items() if n not in frozen}
        if not grads:
            return
        if weight is not None:
            grads = _scaled(grads, weight)
        self.grads = grads if self.grads is None else _add(self.grads, grads)

    def zero_grad(self) -> None:
        self.grads = None

    def drop_grad(self, name: str) -> None:
        """`p.grad = None` for one parameter."""
        if self.grads is not None and name in self.grads:
            grads = {n: g for n, g in self.grads.items() if n != name}
            self.grads = grads or None

    def frozen_names(self) -> set[str]:
        """Parameters (canonical names) whose torch stand-in has `requires_grad=False` now."""
        return {
            self.alias[n]
            for n, p in self.module.named_parameters(remove_duplicate=False)
            if not p.requires_grad
        }

    def gathered_grad(self, name: str) -> np.ndarray | None:
        """One parameter's gradient on the host (unscaled): for `p.grad`, never the hot path."""
        if self.grads is None or name not in self.grads:
            return None
        return np.asarray(self.grads[name], np.float32) / float(self.scale)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> jax.Array:
        """Scale the accumulated gradients so their global norm is at most `max_norm`, on the
        shards; returns the norm before clipping (as torch's clip_grad_norm_ does)."""
        if self.grads is None:
            return jnp.float32(0.0)
        self.grads, norm = _clip_jit(self.grads, self.scale, float(max_norm), float(norm_type))
        return norm

    def step(self, hyper) -> None:
        """One optimizer update from the accumulated gradients (skipped on fp16 overflow)."""
        if self.grads is None:
            return  # torch skips parameters without .grad; with none, nothing happens
        clip = self.config.train.gradient_clipping
        program = self._programs.get(("step",))
        if program is None:
            program = self._programs[("step",)] = self._build_step()
        result = program(
            self.params, self.master, self.opt_state, self.grads, hyper, self.loss_scale, clip
        )
        self.params, self.master, self.opt_state, new_loss_scale, finite = result
        if self.loss_scale is not None:
            if not bool(finite):  # host sync, only with fp16 loss scaling
                self.skipped_steps += 1
                log.warning(
                    "zerojax: fp16 gradients overflowed; optimizer step skipped, loss scale "
                    "%g -> %g",
                    float(self.loss_scale["scale"]),
                    float(new_loss_scale["scale"]),
                )
            self.loss_scale = new_loss_scale

    def _build_step(self):
        spec, policy = self.optimizer_spec, self.policy
        if spec is None:
            raise RuntimeError("zerojax: no optimizer attached; pass one to zerojax.initialize")
        loss_scale_config = policy.loss_scale
        param_shardings = {n: self.plan.params[n] for n in self.params}
        adam_kernel = self._fused_adam_update() if spec.family == "adam" else None

        def step(params, master, opt_state, grads, hyper, loss_scale, clip):
            scale = loss_scale["scale"] if loss_scale is not None else jnp.float32(1.0)
            grads = {n: g.astype(jnp.float32) / scale for n, g in grads.items()}
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads.values()]))
            if clip is not None:
                grads, _ = _clip(grads, jnp.float32(1.0), clip, 2.0)
            weights = master if master is not None else params
            full_grads = {
                n: grads[n] if n in grads else jnp.zeros_like(weights[n])
                for n in spec.param_names
                if n in weights
            }
            new_weights, new_state = optimizers.apply_update(
                spec, weights, full_grads, opt_state, hyper, adam_kernel=adam_kernel
            )
            # torch skips parameters whose .grad is None (frozen after initialize, or cleared
            # one by one): no decay, no moment update.
            for n in spec.param_names:
                if n in weights and n not in grads:
                    new_weights[n] = weights[n]
                    for key, value in new_state.items():
                        if isinstance(value, dict) and n in value:
                            value[n] = opt_state[key][n]
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            new_weights, new_state = keep(new_weights, weights), keep(new_state, opt_state)
            if master is not None:
                new_master = new_weights
                new_params = {
                    n: new_master[n].astype(p.dtype) if n in new_master else p
                    for n, p in params.items()
                }
            else:
                new_master, new_params = None, new_weights
            new_params = {
                n: jax.lax.with_sharding_constraint(p, param_shardings[n])
                for n, p in new_params.items()
            }
            new_loss_scale = (
                next_loss_scale_state(loss_scale_config, loss_scale, finite)
                if loss_scale is not None
                else None
            )
            return new_params, new_master, new_state, new_loss_scale, finite

        return jax.jit(step, static_argnums=(6,), donate_argnums=(0, 1, 2))

    def _fused_adam_update(self):
        """The fused AdamW kernel applied shard by shard (config `kernels.optimizer`), or None.

        Each weight, its gradient and moments are updated where the optimizer state lives
        (the ZeRO shards): the update is elementwise, so no collective is needed.
        """
        choice = self.config.kernels.choice("optimizer")
        if choice is None:
            return None
        implementation, interpret = choice
        if implementation == "auto" and not auto_picks_pallas(interpret):
            # Off GPU, "auto" means the XLA reference, which is apply_update's own arithmetic
            # (bitwise): the per-shard wrapper would only add compile time (~2.5 s here).
            return None
        from zerojax.pallas_kernels.adamw import adamw_update_sharded

        def update(group, hyper, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
            specs = {n: self.plan.opt_state.get(n, self.replicated).spec for n in weights}
            results = adamw_update_sharded(
                weights,
                grads,
                exp_avgs,
                exp_avg_sqs,
                hyper,
                mesh=self.mesh,
                specs=specs,
                implementation=implementation,
                interpret=interpret,
                max_exp_avg_sqs=max_exp_avg_sqs,
                maximize=group.maximize,
                decoupled_weight_decay=group.decoupled_weight_decay,
            )
            weights, exp_avgs, exp_avg_sqs = results[:3]
            return weights, exp_avgs, exp_avg_sqs, results[3] if len(results) > 3 else None

        return update

    # --- state_dict ------------------------------------------------------------------------

    def state_dict_arrays(self) -> dict[str, np.ndarray]:
        """Every state_dict entry on the host, torch names and the module's dtypes."""
        weights = dict(self.params)
        if self.master is not None:
            weights.update(self.master)
        out = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            canonical = self.alias.get(name, name)
            source = weights if canonical in weights else self.buffers
            out[name] = (np.asarray(source[canonical]), tensor.dtype)
        return out

    def load_state_dict_arrays(self, arrays: dict[str, jax.Array]) -> None:
        for name, value in arrays.items():
            canonical = self.alias.get(name, name)
            if canonical in self.params:
                self.params[canonical] = jax.device_put(
                    value.astype(self.params[canonical].dtype), self.plan.params[canonical]
                )
                if self.master is not None and canonical in self.master:
                    self.master[canonical] = jax.device_put(
                        value.astype(self.master[canonical].dtype),
                        self.plan.master_weights[canonical],
                    )
            elif canonical in self.buffers:
                self.buffers[canonical] = jax.device_put(
                    value.astype(self.buffers[canonical].dtype), self.replicated
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


@jax.jit
def _add(a, b):
    return jax.tree.map(lambda x, y: x + y, a, b)


@jax.jit
def _scaled(grads, weight):
    return jax.tree.map(lambda g: (g * weight).astype(g.dtype), grads)


def _clip(grads, scale, max_norm, norm_type: float):
    """torch's clip_grad_norm_: norm of the unscaled gradients, then
    `grads *= min(max_norm / (norm + 1e-6), 1)`; returns (clipped grads, norm)."""
    unscaled = [g.astype(jnp.float32) / scale for g in grads.values()]
    if norm_type == float("inf"):
        norm = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in unscaled]))
    else:
        norm = sum(jnp.sum(jnp.abs(g) ** norm_type) for g in unscaled) ** (1.0 / norm_type)
    coef = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return {n: (g * coef).astype(g.dtype) for n, g in grads.items()}, norm


_clip_jit = jax.jit(_clip, static_argnums=(3,))
