"""Per-device memory of training state, measured from the sharded arrays, beside the ZeRO formula.

Users elsewhere report memory estimators off by 10x; here the measured column is read off the
arrays themselves (`shard.data.nbytes` of every shard a device holds, the worst device), and the
formula column is the ZeRO paper's (Rajbhandari et al., 2020, section 5) generalised to the
actual dtypes: each component costs (its bytes per parameter) x Psi, divided by N_d (the
data-parallel size) from the stage that partitions it:

    component         bytes/param (mixed-precision Adam)   divided by N_d from stage
    params            2                                     3
    gradients         2                                     2
    optimizer state   8   (Adam m and v)                    1
    master weights    4                                     1

so 16 Psi, 4 Psi + 12 Psi/N_d, 2 Psi + 14 Psi/N_d and 16 Psi/N_d for stages 0-3 (fp32 without
master weights: 16 Psi at stage 0). The formula ignores tensor/expert splits and padding, so a
ratio away from 1.00 points at exactly those (or at parameters the plan reports as replicated).
The `memory_analysis()` of each compiled program training runs (forward and backward, fused
or not, and the optimizer update) adds what the formula leaves out: activations and gathered
stage-3 params (temp), and donated buffers (alias). `zerojax.memory_report`
(`zerojax.train.memory_plan`) builds the training engine and fills in both; this module only
measures and formats, so it needs nothing from the training side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from zerojax.sharding.zero import HOST_MEMORY_KIND, ReplicatedParam, ShardingPlan

__all__ = [
    "COMPONENTS",
    "CompiledMemory",
    "ComponentMemory",
    "MemoryReport",
    "bytes_by_device",
    "measure_memory",
    "measured_bytes_per_device",
]

COMPONENTS = ("params", "grads", "opt_state", "master_weights")
LABELS = {
    "params": "params",
    "grads": "gradients",
    "opt_state": "optimizer state",
    "master_weights": "master weights",
}
SHARDED_FROM_STAGE = {"params": 3, "grads": 2, "opt_state": 1, "master_weights": 1}
"""The ZeRO stage from which each component is partitioned over the data-parallel ranks."""

RESIDENT_BESIDE = {
    "forward": ("opt_state", "master_weights"),
    "forward_vjp": ("opt_state", "master_weights"),
    "loss_and_grads": ("opt_state", "master_weights"),
    "backward": ("params", "opt_state", "master_weights"),
    "update": (),
}
"""State components held while a program runs without being its arguments: the forward
programs take the params (and output the gradients), the backward program takes the forward's
residuals and outputs the gradients, the update takes every component."""


def bytes_by_device(tree: Any) -> dict[Any, int]:
    """Bytes each device holds for the arrays in `tree`, read off their addressable shards; for
    a `jax.ShapeDtypeStruct` with a sharding (an abstract engine), off the shard each device
    would hold."""
    held: dict[Any, int] = {}
    for array in jax.tree.leaves(tree):
        if isinstance(array, jax.ShapeDtypeStruct):
            itemsize = np.dtype(array.dtype).itemsize
            for device, index in array.sharding.devices_indices_map(array.shape).items():
                shard = [len(range(*s.indices(n))) for s, n in zip(index, array.shape)]
                held[device] = held.get(device, 0) + math.prod(shard) * itemsize
            continue
        for shard in array.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def measured_bytes_per_device(tree: Any, devices=None) -> int:
    """The most bytes any one device holds for `tree` (the device that runs out first)."""
    held = bytes_by_device(tree)
    if devices is not None:
        held = {d: held.get(d, 0) for d in devices}
    return max(held.values(), default=0)


def _global_bytes(tree: Any) -> int:
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@dataclass(frozen=True, kw_only=True, slots=True)
class ComponentMemory:
    name: str
    """One of COMPONENTS."""
    measured: int
    """Bytes on the fullest device, from the arrays' shards."""
    formula: float
    """ZeRO formula: bytes_per_param x Psi, / N_d if the stage partitions this component."""
    bytes_per_param: float
    """Global bytes of the component over Psi (4 for fp32 params, 8 for fp32 Adam moments)."""
    sharded: bool
    """Whether the stage partitions this component over the data-parallel ranks."""
    host: bool = False
    """Whether it lives in host memory (config `offload`): bytes each device's host holds for
    it, not the device."""

    @property
    def ratio(self) -> float | None:
        return self.measured / self.formula if self.formula else None


@dataclass(frozen=True, kw_only=True, slots=True)
class CompiledMemory:
    """`compiled.memory_analysis()` of one compiled program, per device, with the part of it
    that offload places in host memory.

    XLA:CPU has one memory: its `memory_analysis()` counts host-placed arrays with the rest and
    reports every `host_*` figure as 0. So the host part is read off the program's own argument
    and output shardings (their `pinned_host` memory kind), and a program that computes on the
    host (the offloaded update) has its temporaries there too. What a device still holds of
    offloaded arrays is what is crossing it: `in_flight`."""

    argument: int
    output: int
    temp: int
    alias: int
    """Output bytes that reuse donated argument buffers (params, optimizer state)."""
    host_argument: int = 0
    host_output: int = 0
    host_alias: int = 0
    """Of `alias`, donated host arguments (offloaded state the update writes in place)."""
    host_temp: bool = False
    """Whether the program computes on the host, so its temporaries are host memory."""
    in_flight: int = 0
    """Device bytes of host arrays crossing at once. A program computing on the device: the two
    largest host argument shards (the one an op reads now and the next, brought in ahead) and
    the largest host output shard (a gradient on its way out). One computing on the host: the
    largest host argument shard (a gradient copied in for the clipping norm or overflow
    check; its new params are device outputs already)."""

    @property
    def peak_estimate(self) -> int:
        """Arguments + outputs + temporaries, minus outputs written into donated buffers: in
        device memory, with offload's host part left out and what crosses added."""
        temp = 0 if self.host_temp else self.temp
        return (
            self.argument
            - self.host_argument
            + self.output
            - self.host_output
            + temp
            - (self.alias - self.host_alias)
            + self.in_flight
        )

    @property
    def host_peak(self) -> int:
        """The host memory the program holds per device: its host arguments and outputs (less
        the donated ones written in place), and its temporaries when it computes there."""
        temp = self.temp if self.host_temp else 0
        return self.host_argument + self.host_output - self.host_alias + temp


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    stage: int
    mesh_shape: Mapping[str, int]
    data_parallel_size: int
    num_params: int
    """Psi: parameter elements (tied parameters counted once)."""
    components: tuple[ComponentMemory, ...]
    programs: Mapping[str, CompiledMemory] = field(default_factory=dict)
    """Program name (forward_vjp, backward, loss_and_grads, update, ...) -> its compiled
    executable's memory_analysis(), for the programs that ran."""
    replicated: tuple[ReplicatedParam, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def step_peak(self) -> int | None:
        """Peak bytes on a device during the training step: the largest over its programs of
        the program's own device peak (arguments + outputs + temporaries - donated, offload's
        host part left out: `CompiledMemory.peak_estimate`) plus the state it leaves resident
        in device memory beside it (RESIDENT_BESIDE; offloaded state sits on the host). None
        when no program ran."""
        return self._peak(host=False)

    @property
    def host_step_peak(self) -> int | None:
        """Peak host bytes per device during the step (offload): the offloaded state, plus the
        host part of the program holding the most beside it."""
        return self._peak(host=True)

    def _peak(self, *, host: bool) -> int | None:
        if not self.programs:
            return None
        held = {c.name: c.measured if c.host == host else 0 for c in self.components}
        return max(
            (memory.host_peak if host else memory.peak_estimate)
            + sum(held[c] for c in RESIDENT_BESIDE.get(name, ()))
            for name, memory in self.programs.items()
        )

    @property
    def activations(self) -> int | None:
        """`step_peak` minus the training state: activations, residuals, gathered stage-3
        parameters and scratch, the part activation checkpointing shrinks."""
        peak = self.step_peak
        return None if peak is None else peak - self.device_total

    @property
    def device_total(self) -> int:
        """Training-state bytes in a device's own memory."""
        return sum(c.measured for c in self.components if not c.host)

    @property
    def host_total(self) -> int:
        """Training-state bytes a device's host holds for it (offloaded components)."""
        return sum(c.measured for c in self.components if c.host)

    def as_dict(self) -> dict:
        """The report as JSON-able values (`zerojax plan --json`): bytes per device."""
        return {
            "stage": self.stage,
            "mesh": dict(self.mesh_shape),
            "data_parallel_size": self.data_parallel_size,
            "num_params": self.num_params,
            "components": {
                c.name: {
                    "measured": c.measured,
                    "formula": c.formula,
                    "bytes_per_param": c.bytes_per_param,
                    "sharded": c.sharded,
                    "host": c.host,
                }
                for c in self.components
            },
            "states": self.measured_total,
            "device_states": self.device_total,
            "host_states": self.host_total,
            "programs": {
                name: {
                    "argument": m.argument,
                    "output": m.output,
                    "temp": m.temp,
                    "alias": m.alias,
                    "host_argument": m.host_argument,
                    "host_output": m.host_output,
                    "host_temp": m.host_temp,
                    "in_flight": m.in_flight,
                    "peak_estimate": m.peak_estimate,
                    "host_peak": m.host_peak,
                }
                for name, m in self.programs.items()
            },
            "step_peak": self.step_peak,
            "host_step_peak": self.host_step_peak,
            "activations": self.activations,
            "replicated": [str(r) for r in self.replicated],
            "notes": list(self.notes),
        }

    def __getitem__(self, name: str) -> ComponentMemory:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(f"{name!r}; components: {', '.join(c.name for c in self.components)}")

    @property
    def measured_total(self) -> int:
        return sum(c.measured for c in self.components)

    @property
    def formula_total(self) -> float:
        return sum(c.formula for c in self.components)

    def __str__(self) -> str:
        nd = self.data_parallel_size
        mesh = " x ".join(f"{a}={s}" for a, s in self.mesh_shape.items())
        rows = [("component", "measured B/device", "formula B/device", "formula", "ratio")]
        for c in self.components:
            rows.append(
                (
                    LABELS[c.name] + (" (host)" if c.host else ""),
                    f"{c.measured:,}",
                    f"{c.formula:,.0f}",
                    _formula_text(c.bytes_per_param, c.sharded),
                    "-" if c.ratio is None else f"{c.ratio:.3f}",
                )
            )
        total_ratio = self.measured_total / self.formula_total if self.formula_total else None
        per_param = sum(c.bytes_per_param / (nd if c.sharded else 1) for c in self.components)
        rows.append(
            (
                "total",
                f"{self.measured_total:,}",
                f"{self.formula_total:,.0f}",
                f"{per_param:.3g}Ψ",
                "-" if total_ratio is None else f"{total_ratio:.3f}",
            )
        )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        aligned = [
            "  ".join(
                cell.ljust(w) if i in (0, 3) else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
            for row in rows
        ]
        rule = "-" * len(aligned[0])
        header = f"ZeRO stage {self.stage} on mesh {mesh} (N_d={nd}), Ψ={self.num_params:,}"
        lines = [
            f"{header} parameters",
            aligned[0],
            rule,
            *aligned[1:-1],
            rule,
            aligned[-1],
        ]
        if self.programs:
            lines.append("compiled programs, memory_analysis() per device:")
        for name, m in self.programs.items():
            lines.append(
                f"  {name}: arguments {m.argument:,} B, outputs {m.output:,} B, temp "
                f"{m.temp:,} B, aliased (donated) {m.alias:,} B; peak estimate "
                f"{m.peak_estimate:,} B"
                + (f" in device memory, {m.host_peak:,} B in host memory" if m.host_peak else "")
            )
        if self.host_total:
            lines.append(
                f"states per device: {self.device_total:,} B in device memory, "
                f"{self.host_total:,} B in host memory (offload)"
            )
        if self.step_peak is not None:
            lines.append(
                f"training step peak per device: {self.step_peak:,} B = states "
                f"{self.device_total:,} B + activations and scratch {self.activations:,} B"
            )
        if self.host_total and self.host_step_peak is not None:
            lines.append(f"training step peak in host memory per device: {self.host_step_peak:,} B")
        if self.replicated:
            lines.append(f"replicated parameters (not split as intended): {len(self.replicated)}")
            lines += [f"  {r}" for r in self.replicated]
        else:
            lines.append("replicated parameters (not split as intended): none")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _formula_text(bytes_per_param: float, sharded: bool) -> str:
    if not bytes_per_param:
        return "0"
    # 3 significant digits: fp32 Adam is "8Ψ", the replicated int32 step count is noise.
    coefficient = f"{bytes_per_param:.3g}Ψ"
    return f"{coefficient}/N_d" if sharded else coefficient


def measure_memory(
    plan: ShardingPlan,
    *,
    params: Any,
    grads: Any,
    opt_state: Any,
    master_weights: Any = None,
    programs: Mapping[str, Any] | None = None,
    host_computed: tuple[str, ...] = (),
    notes: tuple[str, ...] = (),
) -> MemoryReport:
    """A `MemoryReport` for live training state: measured per-device bytes of each component
    beside the ZeRO formula for `plan.stage`, plus `memory_analysis()` of each compiled
    program in `programs` (name -> compiled executable), if given; `host_computed` names the
    programs that compute on the host (the offloaded update)."""
    devices = list(plan.mesh.devices.flat)
    nd = math.prod(plan.mesh.shape[a] for a in plan.data_parallel_axes)
    num_params = sum(math.prod(s) for s in plan.shapes.values())
    trees = {
        "params": params,
        "grads": grads,
        "opt_state": opt_state,
        "master_weights": master_weights if master_weights is not None else {},
    }
    components = []
    for name in COMPONENTS:
        total = _global_bytes(trees[name])
        sharded = plan.stage >= SHARDED_FROM_STAGE[name] and nd > 1
        components.append(
            ComponentMemory(
                name=name,
                measured=measured_bytes_per_device(trees[name], devices),
                formula=total / nd if sharded else float(total),
                bytes_per_param=total / num_params if num_params else 0.0,
                sharded=sharded,
                host=name in plan.offloaded,
            )
        )
    model_axes = [
        f"{a}={n}" for a, n in plan.mesh.shape.items() if a not in plan.data_parallel_axes and n > 1
    ]
    if plan.offloaded:
        notes = (
            *notes,
            (
                f"{', '.join(LABELS[c] for c in plan.offloaded)} live in host memory: the "
                "device peak leaves them out but for the shards crossing the device (two "
                "arriving, one leaving); XLA:CPU has one memory, so the host part of each "
                "program is read off its argument and output shardings"
            ),
        )
    if model_axes:
        notes = (
            *notes,
            (
                f"the formula divides by N_d={nd} only; {', '.join(model_axes)} splits ruled "
                "params further, so ratios below 1 are expected"
            ),
        )
    return MemoryReport(
        stage=plan.stage,
        mesh_shape=dict(plan.mesh.shape),
        data_parallel_size=nd,
        num_params=num_params,
        components=tuple(components),
        programs={
            name: memory
            for name, compiled in (programs or {}).items()
            if (memory := compiled_memory(compiled, host_temp=name in host_computed)) is not None
        },
        replicated=plan.replicated,
        notes=tuple(notes),
    )


def compiled_memory(compiled, *, host_temp: bool = False) -> CompiledMemory | None:
    """`compiled.memory_analysis()` with the host part of offloaded programs (see
    `CompiledMemory`); `host_temp`: the program computes on the host."""
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not report
        return None
    arguments, outputs = _host_shard_bytes(compiled)
    largest_in = sorted((b for b, _ in arguments), reverse=True)[: 1 if host_temp else 2]
    largest_out = 0 if host_temp else max((b for b, _ in outputs), default=0)
    return CompiledMemory(
        argument=stats.argument_size_in_bytes,
        output=stats.output_size_in_bytes,
        temp=stats.temp_size_in_bytes,
        alias=stats.alias_size_in_bytes,
        host_argument=sum(b for b, _ in arguments),
        host_output=sum(b for b, _ in outputs),
        host_alias=min(stats.alias_size_in_bytes, sum(b for b, donated in arguments if donated)),
        host_temp=host_temp,
        in_flight=sum(largest_in) + largest_out,
    )


def _host_shard_bytes(compiled) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """(bytes of the fullest device's shard, donated) of each host-placed argument and output
    of a compiled program, read off its shardings."""
    # Paired on the arguments' tree; an argument the program does not read has sharding None.
    is_info = lambda x: isinstance(x, jax.stages.ArgInfo)
    paired = jax.tree.map(
        lambda info, sharding: (info, sharding),
        compiled.args_info,
        compiled.input_shardings,
        is_leaf=is_info,
    )
    arguments = [
        (_shard_bytes(info.shape, info.dtype, sharding), info.donated)
        for info, sharding in jax.tree.leaves(
            paired, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and is_info(x[0])
        )
        if sharding is not None and sharding.memory_kind == HOST_MEMORY_KIND
    ]
    outputs = [
        (_shard_bytes(out.shape, out.dtype, out.sharding), False)
        for out in jax.tree.leaves(compiled.out_info)
        if getattr(out.sharding, "memory_kind", None) == HOST_MEMORY_KIND
    ]
    return arguments, outputs


def _shard_bytes(shape, dtype, sharding) -> int:
    return max(
        bytes_by_device(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)).values(),
        default=0,
    )
