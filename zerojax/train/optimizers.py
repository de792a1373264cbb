"""torch.optim semantics as pure, shardable JAX updates.

A torch optimizer is read once into a frozen `OptimizerSpec` (which algorithm, and per param
group its static options and parameter *names*); the update itself is the pure function
`apply_update(spec, params, grads, state, hyper)`, safe to `jax.jit` with `spec` static:

    spec = optimizer_spec_from_torch(opt, {id(p): n for n, p in model.named_parameters()})
    state = init_state(spec, params)                         # or load_state_dict_into_jax
    update = jax.jit(apply_update, static_argnums=0)
    params, state = update(spec, params, grads, state, hyper_from_torch(opt, spec))

Design points:

- **Exact torch math.** AdamW, Adam and SGD follow torch 2.13's single-tensor/foreach CPU
  kernels (which agree bit for bit on CPU) operation by operation, including where torch fuses
  a multiply-add (`lerp`, `add(alpha=)`, `addcmul`): XLA contracts `a*b + c` into an FMA too,
  so operand order is chosen to make it contract the same product, and `_rounded` stops it
  where torch rounds in between (AdamW's `p * (1 - lr*wd)`). Scalars torch computes in Python
  float64 (`1-beta`, `1-lr*wd`) are computed in float64 on the host by `hyper_from_torch`; the
  step-dependent bias corrections (`lr/(1-beta1**t)`, `sqrt(1-beta2**t)`) are computed on
  device in double-float arithmetic and round to torch's float32 values exactly. Result: SGD
  is bit-exact; Adam/AdamW differ from torch only where torch's vectorised CPU `sqrt` is not
  correctly rounded (XLA's is) and where XLA turns `x / scalar` into `x * (1/scalar)`: about
  1% of elements by 1 ulp per step; after 20 steps max |diff| <= 5e-7 on unit-scale params.
- **Hyperparameters are traced.** `hyper` is a dict of float32 arrays of shape
  `(num_groups,)` (lr, betas, momentum, weight decay, ...), so an LR scheduler that writes
  `param_groups[i]['lr']` every step (or OneCycleLR cycling betas/momentum) never recompiles.
  Only booleans (amsgrad, maximize, nesterov, momentum on/off, decoupled decay) are static.
- **Shardable.** Every per-parameter operation is elementwise and the scalars are replicated,
  so with ZeRO-sharded params/grads/state under `jax.jit` each device updates its own shard and
  the outputs keep the inputs' shardings; no collective is emitted.
- **Step count per parameter.** torch keeps `step` per parameter, advanced only on the steps
  where the parameter has a gradient; here it is one int32 vector per group (one entry per
  trainable parameter, in the group's order): a leaf per group, not per parameter.
- **Precision.** Updates compute in float32 whatever the storage dtypes; moments are stored in
  `state_dtype` (e.g. bfloat16) and parameters are written back in their own dtype (pass fp32
  master weights as `params` for a master-weight policy).

Parameters without a gradient (no entry in `grads`: the loss does not reach them, or their
`.grad` was set to None) are skipped as torch skips them: no decay, no moment update, no step
count. Which ones have gradients is static (the keys of `grads`), so each set of them is its own
compiled update. Parameters with `requires_grad=False` when the spec is built are "frozen":
never updated and without state, as in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from zerojax.distributed.arrays import host_copy
from zerojax.pallas_kernels.adamw.bias_correction import adam_bias_corrections

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "OptimizerSpec",
    "ParamGroupSpec",
    "apply_update",
    "for_hyper",
    "hyper_from_torch",
    "hyper_keys",
    "init_state",
    "load_state_dict_into_jax",
    "optimizer_spec_from_torch",
    "state_dict_from_jax",
]

# Exact classes only: a subclass may override step() with math we would silently not run.
SUPPORTED_OPTIMIZERS: Mapping[str, type[torch.optim.Optimizer]] = MappingProxyType(
    {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}
)
_FAMILY = {"AdamW": "adam", "Adam": "adam", "SGD": "sgd"}
# Per-parameter state tensors, in the order torch creates them (state_dict key order).
_STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "sgd": ("momentum_buffer",)}
# Hyperparameter arrays in `hyper`, one float32 entry per param group.
_HYPER_KEYS = {
    "adam": (
        "lr",
        "beta1",
        "beta2",
        "one_minus_beta1",
        "one_minus_beta2",
        "beta1_lo",
        "beta2_lo",
        "lr_lo",
        "eps",
        "weight_decay",
        "decay_factor",
    ),
    "sgd": ("lr", "momentum", "one_minus_dampening", "weight_decay"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamGroupSpec:
    """One torch param group: its parameters by name and the options fixed at compile time."""

    param_names: tuple[str, ...]
    """Every parameter of the group in torch's order (defines state_dict indices)."""
    frozen_names: tuple[str, ...] = ()
    """Parameters with `requires_grad=False` when the spec was built: never updated, no state."""
    amsgrad: bool = False
    """Adam/AdamW: keep the running maximum of the second moment (`max_exp_avg_sq`)."""
    maximize: bool = False
    """Ascend instead of descend (the gradient is negated first)."""
    decoupled_weight_decay: bool = False
    """Adam family: decay the weights directly (AdamW) instead of adding `wd * p` to the grad."""
    has_weight_decay: bool = True
    """`weight_decay != 0`: torch skips the decay when it is 0, and so does the update (which then
    reads no parameter to form the gradient). Not a torch option the state depends on: derived
    from each step's hyperparameters (`for_hyper`), so a decay switched on or off later only
    selects another compiled update."""
    has_momentum: bool = False
    """SGD: `momentum != 0`, so a momentum buffer exists."""
    nesterov: bool = False
    """SGD: Nesterov momentum."""
    options: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, hash=False
    )
    """The group's torch options (all keys but `params`) when the spec was built; they are
    defaults for `state_dict_from_jax`, not part of the compiled program (hence not compared)."""

    @property
    def trainable_names(self) -> tuple[str, ...]:
        frozen = set(self.frozen_names)
        return tuple(n for n in self.param_names if n not in frozen)


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """A torch optimizer described for `apply_update`; hashable, so usable as a static jit arg."""

    name: str
    """torch class name: "AdamW", "Adam" or "SGD"."""
    groups: tuple[ParamGroupSpec, ...]
    """The param groups, in torch's order."""

    def __post_init__(self) -> None:
        if self.name not in SUPPORTED_OPTIMIZERS:
            raise ValueError(f"{self.name=} is not one of {sorted(SUPPORTED_OPTIMIZERS)}")

    @property
    def family(self) -> str:
        """The update rule: "adam" (Adam, AdamW) or "sgd"."""
        return _FAMILY[self.name]

    @property
    def param_names(self) -> tuple[str, ...]:
        """All parameter names in torch's state_dict index order."""
        return tuple(n for g in self.groups for n in g.param_names)


# --------------------------------------------------------------------------- reading torch


def _check_supported_class(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    for name, supported in SUPPORTED_OPTIMIZERS.items():
        if cls is supported:
            return name
    public = getattr(torch.optim, cls.__name__, None) is cls
    qualname = f"torch.optim.{cls.__name__}" if public else f"{cls.__module__}.{cls.__qualname__}"
    hint = ""
    if isinstance(optimizer, tuple(SUPPORTED_OPTIMIZERS.values())):
        hint = (
            " It subclasses a supported optimizer, but its step() may differ, so zerojax does not"
            " guess; construct the torch.optim class itself."
        )
    raise ValueError(
        f"optimizer {qualname} is not supported by zerojax; supported: "
        f"{', '.join('torch.optim.' + n for n in SUPPORTED_OPTIMIZERS)}.{hint}"
    )


def _scalar(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _unsupported(index: int, option: str, value: Any, why: str) -> ValueError:
    return ValueError(f"param group {index}: {option}={value!r} is not supported: {why}")


def _check_group_options(name: str, index: int, group: Mapping[str, Any]) -> None:
    if group.get("differentiable", False):
        raise _unsupported(
            index,
            "differentiable",
            True,
            "zerojax updates parameters outside torch autograd; construct the optimizer with"
            " differentiable=False.",
        )
    if group.get("capturable", False):
        raise _unsupported(
            index,
            "capturable",
            True,
            "it is a CUDA-graph option whose operation order differs from the default kernels"
            " that zerojax reproduces, and zerojax compiles the step itself; construct the"
            " optimizer with capturable=False.",
        )
    if _FAMILY[name] == "sgd" and group.get("nesterov", False):
        momentum, dampening = _scalar(group["momentum"]), _scalar(group["dampening"])
        if momentum <= 0 or dampening != 0:
            raise _unsupported(
                index,
                "nesterov",
                True,
                f"Nesterov momentum needs momentum > 0 and dampening == 0 (got {momentum=},"
                f" {dampening=}); torch.optim.SGD rejects it too.",
            )


def _static_options(name: str, group: Mapping[str, Any]) -> dict[str, bool]:
    if _FAMILY[name] == "adam":
        return {
            "amsgrad": bool(group.get("amsgrad", False)),
            "maximize": bool(group.get("maximize", False)),
            "decoupled_weight_decay": bool(group.get("decoupled_weight_decay", name == "AdamW")),
        }
    return {
        "maximize": bool(group.get("maximize", False)),
        "has_momentum": _scalar(group["momentum"]) != 0,
        "nesterov": bool(group.get("nesterov", False)),
    }


def _plain_options(group: Mapping[str, Any]) -> Mapping[str, Any]:
    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            return v.item()
        if isinstance(v, tuple):
            return tuple(plain(x) for x in v)
        return v

    return MappingProxyType({k: plain(v) for k, v in group.items() if k != "params"})


def optimizer_spec_from_torch(
    optimizer: torch.optim.Optimizer, param_names: Mapping[int, str]
) -> OptimizerSpec:
    """Describe a torch AdamW/Adam/SGD and its param groups as a frozen `OptimizerSpec`.

    `param_names` maps `id(param)` to the parameter's state_dict name, e.g.
    `{id(p): n for n, p in model.named_parameters()}`. Raises ValueError for an unsupported
    optimizer class or option (naming the group index, option and value), a parameter without
    a name, or complex parameters. `foreach`/`fused` flags are ignored: zerojax compiles the
    update itself.
    """
    name = _check_supported_class(optimizer)
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        _check_group_options(name, index, group)
        names, frozen = [], []
        for position, p in enumerate(group["params"]):
            if id(p) not in param_names:
                raise ValueError(
                    f"param group {index}, parameter {position} (shape {tuple(p.shape)}, dtype"
                    f" {p.dtype}) has no entry in param_names; pass {{id(p): name}} for every"
                    " optimizer parameter, e.g. from model.named_parameters()."
                )
            if p.is_complex():
                raise _unsupported(
                    index,
                    f"parameter {param_names[id(p)]!r} dtype",
                    p.dtype,
                    "complex parameters are not supported; use real ones (e.g. view_as_real).",
                )
            names.append(param_names[id(p)])
            if not p.requires_grad:
                frozen.append(param_names[id(p)])
        groups.append(
            ParamGroupSpec(
                param_names=tuple(names),
                frozen_names=tuple(frozen),
                options=_plain_options(group),
                has_weight_decay=_scalar(group["weight_decay"]) != 0,
                **_static_options(name, group),
            )
        )
    all_names = [n for g in groups for n in g.param_names]
    if len(set(all_names)) != len(all_names):
        dupes = sorted({n for n in all_names if all_names.count(n) > 1})
        raise ValueError(f"param_names gives several optimizer parameters the same name: {dupes}")
    return OptimizerSpec(name=name, groups=tuple(groups))


def hyper_from_torch(
    optimizer: torch.optim.Optimizer, spec: OptimizerSpec | None = None
) -> dict[str, np.ndarray]:
    """Current hyperparameters of `optimizer`'s param groups as float32 arrays `(num_groups,)`.

    Read it every step: LR schedulers write `param_groups[i]['lr']` (OneCycleLR also `betas` or
    `momentum`), and these values enter `apply_update` traced, so changing them never
    recompiles. Scalars torch derives in float64 (`1 - beta`, `1 - lr * wd`, `log(beta)`) are
    derived here in float64 too. With `spec`, raises ValueError if a compiled-in option (group
    count, amsgrad, maximize, nesterov, momentum on/off) changed since the spec was built.
    """
    name = _check_supported_class(optimizer)
    if spec is not None:
        if spec.name != name:
            raise ValueError(f"the spec describes {spec.name}, the optimizer is {name}")
        if len(spec.groups) != len(optimizer.param_groups):
            raise ValueError(
                f"the optimizer has {len(optimizer.param_groups)} param groups, the spec"
                f" {len(spec.groups)}; build a new spec after add_param_group()"
            )
    columns: dict[str, list[float]] = {k: [] for k in _HYPER_KEYS[_FAMILY[name]]}
    for index, group in enumerate(optimizer.param_groups):
        _check_group_options(name, index, group)
        if spec is not None:
            compiled = spec.groups[index]
            for option, value in _static_options(name, group).items():
                if getattr(compiled, option) != value:
                    raise ValueError(
                        f"param group {index}: {option} changed from {getattr(compiled, option)}"
                        f" to {value} after the update was compiled; it is a compile-time"
                        " option, so build a new spec"
                    )
        for key, value in group_hyper(name, group).items():
            columns[key].append(value)
    return {k: np.asarray(v, dtype=np.float32) for k, v in columns.items()}


def for_hyper(spec: OptimizerSpec, hyper: Mapping[str, np.ndarray]) -> OptimizerSpec:
    """`spec` with each group's `has_weight_decay` read off this step's `hyper` (torch decides
    per step, from the group's current `weight_decay`)."""
    decays = [bool(wd != 0) for wd in np.asarray(hyper["weight_decay"])]
    if all(g.has_weight_decay == d for g, d in zip(spec.groups, decays, strict=True)):
        return spec
    groups = tuple(replace(g, has_weight_decay=d) for g, d in zip(spec.groups, decays, strict=True))
    return replace(spec, groups=groups)


def hyper_keys(name: str) -> tuple[str, ...]:
    """The keys of `group_hyper(name, ...)`, in its order."""
    return _HYPER_KEYS[_FAMILY[name]]


def group_hyper(name: str, group: Mapping[str, Any]) -> dict[str, float]:
    """One param group's `hyper_from_torch` column: its scalars as Python floats (float64)."""
    lr, wd = _scalar(group["lr"]), _scalar(group["weight_decay"])
    if _FAMILY[name] == "sgd":
        return {
            "lr": lr,
            "momentum": _scalar(group["momentum"]),
            "one_minus_dampening": 1 - _scalar(group["dampening"]),
            "weight_decay": wd,
        }
    beta1, beta2 = (_scalar(b) for b in group["betas"])

    def lo(x: float) -> float:
        # The float64 value as a float32 pair hi + lo, for the double-float bias corrections.
        return x - float(np.float32(x))

    return {
        "lr": lr,
        "beta1": beta1,
        "beta2": beta2,
        "one_minus_beta1": 1 - beta1,
        "one_minus_beta2": 1 - beta2,
        "beta1_lo": lo(beta1),
        "beta2_lo": lo(beta2),
        "lr_lo": lo(lr),
        "eps": _scalar(group["eps"]),
        "weight_decay": wd,
        "decay_factor": 1 - lr * wd,
    }


# --------------------------------------------------------------------------- state and update


def _check_params(spec: OptimizerSpec, params: Mapping[str, Any], what: str) -> None:
    missing = [n for g in spec.groups for n in g.trainable_names if n not in params]
    if missing:
        raise ValueError(
            f"{what} lacks {len(missing)} optimizer parameter(s): {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}"
        )


def _zeros_like(p: Any, dtype: Any) -> jax.Array:
    sharding = getattr(p, "sharding", None) if not isinstance(p, jax.core.Tracer) else None
    return jnp.zeros(p.shape, dtype, device=sharding)


def _state_names(spec: OptimizerSpec) -> dict[str, list[str]]:
    """Which trainable parameters carry each per-parameter state tensor."""
    names: dict[str, list[str]] = {k: [] for k in _STATE_KEYS[spec.family]}
    for g in spec.groups:
        for n in g.trainable_names:
            if spec.family == "adam":
                names["exp_avg"].append(n)
                names["exp_avg_sq"].append(n)
                if g.amsgrad:
                    names["max_exp_avg_sq"].append(n)
            elif g.has_momentum:
                names["momentum_buffer"].append(n)
    return names


def init_state(
    spec: OptimizerSpec, params: Mapping[str, jax.Array], state_dtype: Any = None
) -> dict[str, Any]:
    """Fresh optimizer state: `{"step": (int32 vector per group,), <state key>: {name: zeros}}`.

    `step[g][i]` is the step count of group g's i-th trainable parameter (torch's per-parameter
    `step`). State keys are torch's: Adam/AdamW `exp_avg`, `exp_avg_sq` (+ `max_exp_avg_sq` for
    amsgrad groups), SGD `momentum_buffer` (groups with momentum). Tensors have their
    parameter's shape and sharding and `state_dtype` (default: the parameter's dtype, as torch).
    """
    _check_params(spec, params, "params")
    state: dict[str, Any] = {
        "step": tuple(jnp.zeros((len(g.trainable_names),), jnp.int32) for g in spec.groups)
    }
    for key, names in _state_names(spec).items():
        state[key] = {n: _zeros_like(params[n], state_dtype or params[n].dtype) for n in names}
    return state


def _rounded(x: jax.Array, zero_bits: jax.Array) -> jax.Array:
    """`x`, but XLA/LLVM cannot contract the product that made it into a later add's FMA.

    torch rounds `p * (1 - lr*wd)` before adding the Adam step; a fused `p*d + u` would round
    once. OR-ing a runtime zero into the bits is free in a memory-bound kernel and opaque to
    both compilers (a literal zero, or reduce_precision, is simplified away).
    """
    bits = lax.bitcast_convert_type(x, jnp.int32) | zero_bits
    return lax.bitcast_convert_type(bits, jnp.float32)


def _lerp(start: jax.Array, end: jax.Array, weight: jax.Array) -> jax.Array:
    # torch's lerp kernel: two formulas, picked by |weight| < 0.5, for accuracy near weight=1.
    diff = end - start
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end + (weight - 1) * diff)


def adam_param_update(
    group: ParamGroupSpec, h, zero_bits, step_size_neg, bc2_sqrt, p, g, m, v, v_max
):
    """torch's Adam/AdamW arithmetic for one parameter, in float32: (p, m, v, v_max) after it."""
    if group.maximize:
        g = -g
    if group.has_weight_decay and group.decoupled_weight_decay:
        p = _rounded(p * h["decay_factor"], zero_bits)
    elif group.has_weight_decay:
        g = g + h["weight_decay"] * p
    m = _lerp(m, g, h["one_minus_beta1"])
    # torch's addcmul is fma((1-beta2)*g, g, v*beta2); XLA contracts the *first* product of
    # `a*b + c*d` into the FMA, so the operand order here is what makes the bits agree.
    v = ((h["one_minus_beta2"] * g) * g) + v * h["beta2"]
    if group.amsgrad:
        v_max = jnp.maximum(v_max, v)
        denom = jnp.sqrt(v_max) / bc2_sqrt + h["eps"]
    else:
        denom = jnp.sqrt(v) / bc2_sqrt + h["eps"]
    # torch's addcdiv: p + (value * m) / denom, in this order.
    return p + (step_size_neg * m) / denom, m, v, v_max


def _sgd_param(group: ParamGroupSpec, h, first_step, p, g, buf):
    if group.maximize:
        g = -g
    if group.has_weight_decay:
        g = g + h["weight_decay"] * p
    if group.has_momentum:
        # torch initialises the buffer to the gradient on the first step: select the scalars,
        # not the arrays (1*g + 0*0 == g exactly; buf starts at zero), which keeps the
        # expression a plain `a*g + b*m` that XLA contracts into torch's
        # fma(g, 1-dampening, buf*momentum) (operand order matters, see adam_param_update).
        alpha = jnp.where(first_step, 1.0, h["one_minus_dampening"])
        momentum = jnp.where(first_step, 0.0, h["momentum"])
        buf = alpha * g + buf * momentum
        g = g + h["momentum"] * buf if group.nesterov else buf
    return p + (-h["lr"]) * g, buf


def stepped_parameters(
    spec: OptimizerSpec, grads: Mapping[str, Any]
) -> tuple[tuple[int, int, str], ...]:
    """(group index, position among the group's trainable parameters, name) of every parameter
    this update steps: the trainable ones with a gradient, in the spec's order."""
    return tuple(
        (gi, i, n)
        for gi, group in enumerate(spec.groups)
        for i, n in enumerate(group.trainable_names)
        if n in grads
    )


def new_step_counts(spec: OptimizerSpec, steps: Sequence[Any], grads: Mapping[str, Any]):
    """Each group's step vector after an update with `grads`: +1 where a parameter has one."""
    return tuple(
        s + np.asarray([n in grads for n in g.trainable_names], np.int32)
        for g, s in zip(spec.groups, steps, strict=True)
    )


def adam_step_corrections(
    spec: OptimizerSpec, new_steps: Sequence[Any], grads: Mapping[str, Any], hyper
) -> tuple[jax.Array, jax.Array]:
    """`adam_bias_corrections` of each stepped parameter's new step count (its group's
    hyperparameters), in `stepped_parameters` order: one vectorised computation."""
    stepped = stepped_parameters(spec, grads)
    if not stepped:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32)
    groups = np.asarray([gi for gi, _, _ in stepped], np.int32)
    counts = jnp.stack([new_steps[gi][i] for gi, i, _ in stepped])
    hyper_arrays = {k: jnp.asarray(v, jnp.float32)[groups] for k, v in hyper.items()}
    return adam_bias_corrections(counts, hyper_arrays)


def apply_update(
    spec: OptimizerSpec,
    params: Mapping[str, jax.Array],
    grads: Mapping[str, jax.Array],
    state: Mapping[str, Any],
    hyper: Mapping[str, Any],
    *,
    adam_kernel: Callable | None = None,
    bias_corrections: tuple[jax.Array, jax.Array] | None = None,
    new_steps: tuple[jax.Array, ...] | None = None,
) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """One `optimizer.step()`: returns `(new_params, new_state)`; pure and jit-able.

    `adam_kernel(group, hyper, params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq)` (dicts by
    name; `hyper` holds the group's scalars and the parameter's new `step`) replaces the
    per-parameter Adam/AdamW arithmetic, e.g. with the fused kernel of
    `zerojax.pallas_kernels.adamw`; it is called once per parameter (step counts are
    per parameter) and returns the four updated dicts (the last None without amsgrad).

    `params` may hold more entries than the optimizer's (they pass through unchanged); a
    trainable parameter without an entry in `grads` is skipped as torch skips a `.grad` of
    None (no decay, no moment update, its step count kept). `state` comes from `init_state` or
    `load_state_dict_into_jax`, `hyper` from `hyper_from_torch`. Computation is float32;
    results keep the dtypes (and shardings) of `params` and `state`.

    `bias_corrections` (Adam/AdamW): `adam_step_corrections` of the new steps, computed
    elsewhere (the host-offloaded update computes these per-parameter scalars on the device:
    their loop does not trace under `compute_on("device_host")`), and `new_steps` likewise
    (`new_step_counts`: its increments are a constant in device memory).
    """
    f32 = jnp.float32
    hyper_arrays = {k: jnp.asarray(v, f32) for k, v in hyper.items()}
    new_params = dict(params)
    new_state = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in state.items()}
    if new_steps is None:
        new_steps = new_step_counts(spec, state["step"], grads)
    new_state["step"] = tuple(new_steps)
    stepped = stepped_parameters(spec, grads)
    if not stepped:
        return new_params, new_state
    if spec.family == "adam" and bias_corrections is None:
        bias_corrections = adam_step_corrections(spec, new_steps, grads, hyper_arrays)
    for k, (index, i, n) in enumerate(stepped):
        group = spec.groups[index]
        h = {key: v[index] for key, v in hyper_arrays.items()}
        step = state["step"][index][i]
        if spec.family == "adam" and adam_kernel is not None:
            results = adam_kernel(
                group,
                dict(h, step=new_steps[index][i]),
                {n: params[n]},
                {n: grads[n]},
                {n: state["exp_avg"][n]},
                {n: state["exp_avg_sq"][n]},
                {n: state["max_exp_avg_sq"][n]} if group.amsgrad else None,
            )
            new_params.update(results[0])
            for key, value in zip(_STATE_KEYS["adam"], results[1:], strict=True):
                if value is not None:
                    new_state[key].update(value)
            continue
        p, g = params[n].astype(f32), grads[n].astype(f32)
        if spec.family == "adam":
            assert bias_corrections is not None  # computed above
            step_sizes_neg, bc2_sqrts = bias_corrections
            # A zero XLA cannot prove to be zero (the step count is never negative).
            zero_bits = step >> 31
            m = state["exp_avg"][n].astype(f32)
            v = state["exp_avg_sq"][n].astype(f32)
            v_max = state["max_exp_avg_sq"][n].astype(f32) if group.amsgrad else None
            p, m, v, v_max = adam_param_update(
                group, h, zero_bits, step_sizes_neg[k], bc2_sqrts[k], p, g, m, v, v_max
            )
            updated = {"exp_avg": m, "exp_avg_sq": v, "max_exp_avg_sq": v_max}
        else:
            buf = state["momentum_buffer"][n].astype(f32) if group.has_momentum else None
            # torch creates the momentum buffer at the parameter's own first step.
            p, buf = _sgd_param(group, h, step == 0, p, g, buf)
            updated = {"momentum_buffer": buf}
        new_params[n] = p.astype(params[n].dtype)
        for key, value in updated.items():
            if value is not None:
                new_state[key][n] = value.astype(state[key][n].dtype)
    return new_params, new_state


# --------------------------------------------------------------------------- torch state_dict


def _to_torch(x: Any) -> torch.Tensor:
    # host_copy: with several processes, the shards of every process (all must call this).
    array = host_copy(x) if isinstance(x, jax.Array) else np.asarray(x)
    if array.dtype == jnp.bfloat16:
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(array.copy())


def state_dict_from_jax(
    spec: OptimizerSpec,
    state: Mapping[str, Any],
    param_groups: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Our state as torch's `optimizer.state_dict()`: `{'state': {index: {...}}, 'param_groups'}`.

    Indices number the parameters in param_groups order, as torch does. A parameter gets a
    state entry once it has stepped (torch creates state lazily), with torch's keys
    (`step` as a float32 scalar tensor for Adam/AdamW). `param_groups` (e.g. the live torch
    optimizer's, where schedulers write `lr` and `initial_lr`) supplies the group options;
    without it the options captured when the spec was built are used. Gathers sharded arrays
    to host memory.
    """
    if param_groups is not None and len(param_groups) != len(spec.groups):
        raise ValueError(
            f"param_groups has {len(param_groups)} groups, the spec {len(spec.groups)}"
        )
    torch_state: dict[int, dict[str, torch.Tensor]] = {}
    groups_out = []
    index = 0
    state_names = {k: set(v) for k, v in _state_names(spec).items()}
    for gi, group in enumerate(spec.groups):
        steps = dict(zip(group.trainable_names, np.asarray(host_copy(state["step"][gi]))))
        source = group.options if param_groups is None else param_groups[gi]
        group_out = {k: v for k, v in source.items() if k != "params"}
        group_out["params"] = list(range(index, index + len(group.param_names)))
        groups_out.append(group_out)
        for n in group.param_names:
            entry: dict[str, torch.Tensor] = {}
            step = int(steps.get(n, 0))
            if step > 0:
                if spec.family == "adam":
                    entry["step"] = torch.tensor(float(step), dtype=torch.float32)
                for key in _STATE_KEYS[spec.family]:
                    if n in state_names[key]:
                        entry[key] = _to_torch(state[key][n])
            if entry:
                torch_state[index] = entry
            index += 1
    return {"state": torch_state, "param_groups": groups_out}


def _from_torch(t: torch.Tensor, dtype: Any, like: Any) -> jax.Array:
    t = t.detach().cpu()
    # Copy: on CPU jnp.asarray may alias the numpy buffer, and torch updates its state in place.
    array = np.array((t.float() if t.dtype == torch.bfloat16 else t).numpy(), copy=True)
    sharding = getattr(like, "sharding", None) if not isinstance(like, jax.core.Tracer) else None
    return jax.device_put(jnp.asarray(array, dtype=dtype), sharding)


def load_state_dict_into_jax(
    spec: OptimizerSpec,
    state_dict: Mapping[str, Any],
    params: Mapping[str, jax.Array],
    state_dtype: Any = None,
) -> dict[str, Any]:
    """torch's `optimizer.state_dict()` format -> our state (the inverse of `state_dict_from_jax`).

    Saved indices are matched to parameters by position in param_groups order, as torch's
    `load_state_dict` does. Tensors take `state_dtype` (default: the parameter's dtype, as
    torch casts on load) and the parameter's sharding; each parameter keeps its own step
    count (torch's SGD keeps none: 1 where a momentum buffer exists, which is all SGD reads of
    it). Raises ValueError if the groups do not match the spec or a compiled-in option
    differs. The group options themselves (lr, ...) are not part of our state: load the
    state_dict into the torch optimizer too, or read them with `hyper_from_torch`.
    """
    _check_params(spec, params, "params")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(spec.groups) or any(
        len(s["params"]) != len(g.param_names) for s, g in zip(saved_groups, spec.groups)
    ):
        raise ValueError(
            "the state_dict's param groups (sizes"
            f" {[len(s['params']) for s in saved_groups]}) do not match the optimizer's (sizes"
            f" {[len(g.param_names) for g in spec.groups]})"
        )
    saved_state = state_dict["state"]
    fresh = init_state(spec, params, state_dtype)
    state: dict[str, Any] = dict(fresh)
    steps = []
    for gi, (saved, group) in enumerate(zip(saved_groups, spec.groups)):
        for option, value in _static_options(spec.name, saved).items():
            if getattr(group, option) != value:
                raise ValueError(
                    f"param group {gi}: the state_dict has {option}={value}, the optimizer"
                    f" {getattr(group, option)}; build the torch optimizer with the saved"
                    " options before creating the spec"
                )
        group_steps: dict[str, int] = {}
        for saved_index, n in zip(saved["params"], group.param_names):
            entry = saved_state.get(saved_index, {})
            if n not in group.trainable_names:
                continue
            if spec.family == "adam":
                group_steps[n] = int(_scalar(entry["step"])) if "step" in entry else 0
            else:
                # torch's SGD keeps no step; only "has it stepped" matters (buffer exists).
                group_steps[n] = 1 if entry.get("momentum_buffer") is not None else 0
            for key in _STATE_KEYS[spec.family]:
                if n in state[key] and entry.get(key) is not None:
                    like = state[key][n]
                    state[key][n] = _from_torch(entry[key], like.dtype, params[n])
                elif n in state[key] and group_steps[n] > 0:
                    raise ValueError(f"param group {gi}: parameter {n!r} has no saved {key!r}")
        counts = np.asarray([group_steps[n] for n in group.trainable_names], np.int32)
        steps.append(jax.device_put(counts, getattr(fresh["step"][gi], "sharding", None)))
    state["step"] = tuple(steps)
    return state
