"""ZeRO stages as shardings: (parameter names/shapes/dtypes, config, mesh) -> `ShardingPlan`.

ZeRO (Rajbhandari et al., 2020) partitions training state over the data-parallel ranks. In an
SPMD program that is nothing but a different PartitionSpec per component, so a stage is a table:

    component         stage 0   stage 1   stage 2   stage 3
    optimizer state   base      zero      zero      zero
    master weights    base      zero      zero      zero
    gradients         base      base      zero      zero
    params (stored)   base      base      base      zero
    params (compute)  base      base      base      base    (stage 3 all-gathers per step)

`base` is the tensor/expert-parallel spec from the first matching rule (replicated over the
data-parallel axes). Each component the `offload` section names (optimizer, master, grads,
params: ZeRO-Offload and ZeRO-Infinity's CPU tier) keeps its ZeRO sharding in the `pinned_host`
memory kind: each device's shard lives in the host memory next to it, and the programs move it
in and out (`zerojax.train.programs`); `on_device` gives the device-memory twin of such a
sharding. Compute params are never offloaded: they are where ops read the parameters.

`zero` adds the ZeRO axes (`ParallelPlan.zero_axes`: the data-parallel axes, and the sequence
axis under sequence parallelism; `zerojax.parallel.plan` decides them) to the largest dim that
no rule uses and that their product divides. A parameter with no such dim, or a rule dim its axes do not divide,
stays replicated and is reported by name in `plan.replicated`; if the replicated bytes exceed
`zero.max_replicated_fraction`, planning fails listing the five largest offenders (MaxText's
guard), because a ZeRO stage that silently shards nothing is the bug users hit elsewhere.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zerojax.config import Config, ConfigError, ConfigWarning
from zerojax.parallel.plan import ParallelPlan, make_parallel_plan
from zerojax.sharding.rules import match_rules, rule_partition_spec, to_partition_spec

__all__ = ["HOST_MEMORY_KIND", "ReplicatedParam", "ShardingPlan", "make_sharding_plan", "zero_dims"]

COMPONENTS = ("params", "compute_params", "grads", "opt_state", "master_weights")

HOST_MEMORY_KIND = "pinned_host"
"""The JAX memory kind offloaded state lives in: pinned host memory, which XLA transfers to and
from inside a program (an `unpinned_host` output of a program comes back in device memory)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicatedParam:
    """A parameter kept whole where the plan wanted it split, and why."""

    name: str
    shape: tuple[int, ...]
    bytes: int
    spec: PartitionSpec
    reason: str

    def __str__(self) -> str:
        return (
            f"{self.name} shape={self.shape} spec={self.spec} ({self.bytes:,} bytes): {self.reason}"
        )


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """Where every piece of training state lives. Each component maps parameter name ->
    NamedSharding; optimizer-state arrays shaped like a parameter use `opt_state[name]`
    (see `optimizer_state_shardings`). `parallel` is the run's `ParallelPlan`: the axes the
    stage shards over, the batch placement and the offloaded components are its."""

    mesh: Mesh
    stage: int
    parallel: ParallelPlan
    params: Mapping[str, NamedSharding]
    """Parameter storage between steps (ZeRO-sharded at stage 3)."""
    compute_params: Mapping[str, NamedSharding]
    """Parameters inside forward/backward: the rule spec only, ZeRO axes gathered."""
    grads: Mapping[str, NamedSharding]
    opt_state: Mapping[str, NamedSharding]
    master_weights: Mapping[str, NamedSharding]
    rule_for: Mapping[str, str | None]
    """Origin of the rule that gave each parameter its tensor/expert spec (None: no rule)."""
    shapes: Mapping[str, tuple[int, ...]]
    nbytes: Mapping[str, int]
    replicated: tuple[ReplicatedParam, ...]
    """Parameters not split as intended, largest first."""

    @property
    def data_parallel_axes(self) -> tuple[str, ...]:
        """The axes ZeRO shards over (`ParallelPlan.zero_axes`)."""
        return self.parallel.zero_axes

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return self.parallel.batch_axes

    @property
    def batch_dim(self) -> int:
        return self.parallel.batch_dim

    @property
    def offloaded(self) -> tuple[str, ...]:
        """Components (`params`, `grads`, `opt_state`, `master_weights`) whose shardings are in
        host memory (`HOST_MEMORY_KIND`); `compute_params`, where ops read the params, never
        are (`ParallelPlan.offloaded`)."""
        return self.parallel.offloaded

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    @property
    def replicated_fraction(self) -> float:
        """Bytes of reported parameters over all parameter bytes; a reported parameter counts
        whole even if some axes still split it (the guard errs on the loud side)."""
        total = self.total_bytes
        return sum(r.bytes for r in self.replicated) / total if total else 0.0

    def input_sharding(self, ndim: int) -> NamedSharding:
        """Sharding for a batch input of rank `ndim`: batch dim over the batch axes, sequence
        dim over the sequence axis (if configured and the input has that dim): the parallel
        plan's `input_sharding`."""
        return self.parallel.input_sharding(ndim)

    def optimizer_state_shardings(self, state: Any) -> Any:
        """Shardings for an optax-style state pytree: a leaf found under a parameter's name with
        that parameter's shape gets `opt_state[name]`; everything else (step counts, scalars)
        is replicated."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        if "opt_state" in self.offloaded:  # step counts go with the rest of the state
            replicated = replicated.with_memory_kind(HOST_MEMORY_KIND)

        def pick(path, leaf):
            for key in reversed(path):
                name = getattr(key, "key", None)
                if name in self.opt_state and tuple(np.shape(leaf)) == self.shapes[name]:
                    return self.opt_state[name]
            return replicated

        return jax.tree_util.tree_map_with_path(pick, state)

    @staticmethod
    def on_device(sharding: NamedSharding) -> NamedSharding:
        """`sharding` in device memory: where an offloaded array is computed on."""
        if sharding.memory_kind in (None, "device"):
            return sharding
        return sharding.with_memory_kind("device")

    def describe(self) -> str:
        """One line per parameter: shape, stored / compute / optimizer-state specs, rule."""
        rows: list[tuple[str, ...]] = [
            ("name", "shape", "params", "compute", "grads", "opt_state", "rule")
        ]
        for name in self.params:
            rows.append(
                (
                    name,
                    str(self.shapes[name]),
                    *(
                        _spec_str(getattr(self, c)[name].spec)
                        for c in ("params", "compute_params", "grads", "opt_state")
                    ),
                    self.rule_for[name] or "-",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        mesh = " x ".join(f"{a}={s}" for a, s in self.mesh.shape.items())
        header = f"ZeRO stage {self.stage} on mesh {mesh}"
        footer = [f"replicated (not split as intended): {r}" for r in self.replicated]
        return "\n".join([header, *lines, *footer])


def _spec_str(spec: PartitionSpec) -> str:
    return "(" + ", ".join("None" if e is None else repr(e) for e in spec) + ")"


def zero_dims(
    shape: tuple[int, ...],
    base: tuple[tuple[str, ...], ...],
    dp_axes: tuple[str, ...],
    axis_sizes: Mapping[str, int],
) -> tuple[tuple[tuple[str, ...], ...], str | None]:
    """Add `dp_axes` to the largest dim of `shape` that `base` leaves free and that their
    product divides. Returns (dims, None), or (base, reason) when no dim qualifies."""
    dp_axes = tuple(a for a in dp_axes if not any(a in used for used in base))
    dp_size = math.prod(axis_sizes[a] for a in dp_axes)
    if dp_size == 1:
        return base, None
    free = [d for d in range(len(shape)) if not base[d] and shape[d] % dp_size == 0]
    if not free:
        sizes = "x".join(f"{a}={axis_sizes[a]}" for a in dp_axes)
        used = [d for d in range(len(shape)) if base[d]]
        taken = f"; dims {used} are taken by a rule" if used else ""
        return base, f"no dim of {tuple(shape)} is divisible by {dp_size} ({sizes}){taken}"
    # Largest dim: the shards are the biggest contiguous blocks, and ties pick the first dim.
    dim = max(free, key=lambda d: (shape[d], -d))
    return tuple(base[d] + dp_axes if d == dim else base[d] for d in range(len(shape))), None


def _shape_dtype(name: str, value: Any) -> tuple[tuple[int, ...], int]:
    try:
        shape = tuple(int(s) for s in value.shape)
        dtype = value.dtype
    except AttributeError:
        raise TypeError(
            f"parameter {name!r}: expected an array-like with .shape and .dtype (jax.Array, "
            f"jax.ShapeDtypeStruct, torch.Tensor, numpy array), got {type(value).__name__}"
        ) from None
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        itemsize = dtype.itemsize  # torch.dtype
    return shape, itemsize * math.prod(shape)


def make_sharding_plan(
    params: Mapping[str, Any],
    config: Config,
    mesh: Mesh | None = None,
    *,
    parallel: ParallelPlan | None = None,
) -> ShardingPlan:
    """Plan where each parameter, gradient, optimizer-state array and master weight lives.

    `params` maps state_dict names to anything with `.shape` and `.dtype` (no data is read).
    `mesh` defaults to `parallel.mesh`, else `zerojax.sharding.make_mesh(config)`; its axes
    must match the config's. `parallel` (default: `make_parallel_plan(config, mesh)`) says
    which axes ZeRO shards over and which components are offloaded.
    Warns (`ConfigWarning`) for each user rule, or whole preset, that matches no parameter;
    raises `ConfigError` when a rule's spec has more dims than a parameter it matches, or when
    more than `zero.max_replicated_fraction` of parameter bytes stays replicated.

        >>> plan = make_sharding_plan(converted.params, load_config("examples/zero3.yaml"))
        >>> params = {k: jax.device_put(v, plan.params[k]) for k, v in converted.params.items()}
    """
    if not isinstance(config, Config):
        raise TypeError(
            f"make_sharding_plan takes a Config, got {type(config).__name__}; load it once "
            "with zerojax.load_config(path_or_dict) and pass the result"
        )
    if mesh is None and parallel is not None:
        mesh = parallel.mesh
    if mesh is None:
        from zerojax.sharding.mesh import make_mesh

        mesh = make_mesh(config)
    axis_sizes = dict(mesh.shape)
    if tuple(mesh.axis_names) != config.mesh.axis_names:
        raise ConfigError(
            f"mesh axes {tuple(mesh.axis_names)} differ from the config's mesh "
            f"{config.mesh.axis_names}; build the mesh with zerojax.sharding.make_mesh(config)"
        )
    if parallel is None:
        parallel = make_parallel_plan(config, mesh)
    elif parallel.mesh != mesh:
        raise ValueError(
            f"make_sharding_plan: the parallel plan's mesh {dict(parallel.mesh.shape)} is not "
            f"the mesh {dict(mesh.shape)}; make both from the same mesh"
        )
    rules = config.rules
    chosen, unmatched = match_rules(params, rules)
    _warn_unmatched(rules, unmatched)
    specs: dict[str, dict[str, PartitionSpec]] = {c: {} for c in COMPONENTS}
    shapes, nbytes, rule_for, replicated = {}, {}, {}, []
    for name, value in params.items():
        shape, size = _shape_dtype(name, value)
        shapes[name], nbytes[name] = shape, size
        index = chosen[name]
        rule = rules[index] if index is not None else None
        rule_for[name] = rule.origin if rule else None
        base: tuple[tuple[str, ...], ...] = tuple(() for _ in shape)
        reasons: list[str] = []
        if rule is not None:
            base, reason = _rule_dims(name, shape, rule, axis_sizes)
            reasons += [reason] if reason else []
        dims = base
        if config.zero.stage > 0:
            dims, reason = zero_dims(shape, base, parallel.zero_axes, axis_sizes)
            reasons += [f"ZeRO-{config.zero.stage}: {reason}"] if reason else []
        if reasons:
            replicated.append(
                ReplicatedParam(
                    name=name,
                    shape=shape,
                    bytes=size,
                    spec=to_partition_spec(dims),
                    reason="; ".join(reasons),
                )
            )
        zero_spec, base_spec = to_partition_spec(dims), to_partition_spec(base)
        stage = config.zero.stage
        specs["compute_params"][name] = base_spec
        specs["params"][name] = zero_spec if stage >= 3 else base_spec
        specs["grads"][name] = zero_spec if stage >= 2 else base_spec
        specs["opt_state"][name] = zero_spec if stage >= 1 else base_spec
        specs["master_weights"][name] = zero_spec if stage >= 1 else base_spec

    report = tuple(sorted(replicated, key=lambda r: (-r.bytes, r.name)))

    def placed(component: str, spec: PartitionSpec) -> NamedSharding:
        sharding = NamedSharding(mesh, spec)
        if component in parallel.offloaded:
            return sharding.with_memory_kind(HOST_MEMORY_KIND)
        return sharding

    plan = ShardingPlan(
        mesh=mesh,
        stage=config.zero.stage,
        parallel=parallel,
        **{c: MappingProxyType({n: placed(c, s) for n, s in specs[c].items()}) for c in COMPONENTS},
        rule_for=MappingProxyType(rule_for),
        shapes=MappingProxyType(shapes),
        nbytes=MappingProxyType(nbytes),
        replicated=report,
    )
    _check_replicated(plan, config.zero.max_replicated_fraction)
    return plan


def _rule_dims(name, shape, rule, axis_sizes):
    dims = rule_partition_spec(rule.spec, axis_sizes, drop_missing=rule.preset is not None)
    if len(dims) > len(shape):
        raise ConfigError(
            f"{rule.origin}: spec {list(rule.spec)} has {len(dims)} dims but parameter {name!r} "
            f"matched by pattern {rule.pattern!r} has shape {shape}; fix the spec or the pattern"
        )
    dims = dims + ((),) * (len(shape) - len(dims))
    reasons, kept = [], []
    for d, axes in enumerate(dims):
        split = math.prod(axis_sizes[a] for a in axes)
        if shape[d] % split:
            sizes = "x".join(f"{a}={axis_sizes[a]}" for a in axes)
            reasons.append(
                f"{rule.origin} splits dim {d} (size {shape[d]}) over {sizes}, "
                f"which does not divide it"
            )
            axes = ()
        kept.append(axes)
    return tuple(kept), "; ".join(reasons) or None


def _warn_unmatched(rules, unmatched: list[int]) -> None:
    presets: dict[str, list[int]] = {}
    for index, rule in enumerate(rules):
        if rule.preset is not None:
            presets.setdefault(rule.origin, []).append(index)
    lines = [
        f"{rules[i].origin}: pattern {rules[i].pattern!r}"
        for i in unmatched
        if rules[i].preset is None
    ]
    # A preset is a menu for a model family: parts of it missing (no biases, tied head) is
    # normal; all of it missing means the wrong preset.
    lines += [
        f"{origin}: none of its {len(idx)} patterns"
        for origin, idx in presets.items()
        if set(idx) <= set(unmatched)
    ]
    if lines:
        warnings.warn(
            "sharding rules that match no parameter (check the pattern or the preset):\n  "
            + "\n  ".join(lines),
            ConfigWarning,
            stacklevel=3,
        )


def _check_replicated(plan: ShardingPlan, limit: float) -> None:
    fraction = plan.replicated_fraction
    if fraction <= limit:
        return
    worst = "\n  ".join(str(r) for r in plan.replicated[:5])
    total = plan.total_bytes
    raise ConfigError(
        f"ZeRO stage {plan.stage}: {fraction:.1%} of parameter bytes "
        f"({total * fraction:,.0f} of {total:,}) stay replicated, more than "
        f"zero.max_replicated_fraction={limit}. Largest offenders:\n  {worst}\n"
        "Fix: make those dims divisible by the mesh axes, change the rules, or raise "
        "zero.max_replicated_fraction."
    )
