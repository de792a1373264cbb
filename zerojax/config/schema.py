"""The config schema: one frozen dataclass per section, a docstring under every field.

This is the one source of the config: each section checks its own values when it is built
(`__post_init__`), and `Config` checks the rules that span sections, so a config built in code
is held to the same rules, with the same messages, as one read from a file. `load_config` only
turns the file's mapping into these constructor calls (`sections`); the keys a file section
allows are the fields here (`file_keys`). Constructors normalise as the file form does (lists
become tuples, a float16 policy gets dynamic loss scaling), so a config built in code equals
the one loaded from the same values, and `dataclasses.replace` re-checks what it changes.

Nothing here reads files; these classes are what the rest of zerojax receives, always through
a `Config` (usually one `load_config` built once).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from zerojax.config.checks import (
    INT32_MAX,
    ConfigError,
    as_axes,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_path,
    as_regex,
    as_stage,
    as_unit_interval,
    check_keys,
    error,
    render,
    written,
)

MESH_AXES = ("data", "fsdp", "tensor", "expert", "sequence")
"""The mesh axis names zerojax knows; any other name is a typo until proven otherwise."""

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
PLATFORMS = ("cpu", "gpu", "tpu")
KERNEL_IMPLEMENTATIONS = ("auto", "pallas", "xla", "off")
REMAT_POLICIES = ("none", "full", "save_dots", "offload")
"""Activation checkpointing policies: keep everything (none), recompute everything in the
backward pass (full), keep matmul outputs and recompute the rest (save_dots), or move matmul
outputs to host memory and back (offload, where the backend has host memory spaces)."""
SEQUENCE_PARALLEL_ATTENTION = ("ulysses", "ring", "auto")
"""How attention runs on a sequence-split mesh: Ulysses (all-to-all sequence <-> heads), ring
attention (K/V passed around the axis), or auto (Ulysses when the heads split over the axis,
else ring)."""
COMPILED_OPTIMIZER_TYPES = ("adam", "adamw", "sgd")
"""Optimizers zerojax's own update program runs (torch.optim.Adam, AdamW, SGD, reproduced
exactly in JAX)."""
OPTIMIZER_TYPES = (
    *COMPILED_OPTIMIZER_TYPES,
    *("adadelta", "adafactor", "adagrad", "adamax", "asgd", "nadam", "radam", "rmsprop", "rprop"),
)
"""Optimizers a config can name: the compiled ones, and the torch.optim classes that run their
own step on zerojax's live tensors (`zerojax.train.optimizer_shim`)."""

OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "adadelta": ("lr", "rho", "eps", "weight_decay", "maximize"),
    "adafactor": ("lr", "beta2_decay", "d", "weight_decay", "maximize"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize"),
    "adamax": ("lr", "betas", "eps", "weight_decay", "maximize"),
    "asgd": ("lr", "lambd", "alpha", "t0", "weight_decay", "maximize"),
    "nadam": (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "momentum_decay",
        "decoupled_weight_decay",
        "maximize",
    ),
    "radam": ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "maximize"),
    "rmsprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
    "rprop": ("lr", "etas", "step_sizes", "maximize"),
}
"""`optimizer.params` keys per type: the torch constructor's keyword arguments zerojax runs
(torch's foreach/fused/capturable/differentiable choose torch kernels, which zerojax replaces)."""

OFFLOAD_PLACES = ("device", "host")
"""Where a model state lives between steps: accelerator memory, or host memory (JAX's
`pinned_host` memory kind on the state's ZeRO sharding; see `OffloadConfig`)."""

# Default 0.1: past that, the per-device memory the ZeRO stage promises is off by more than 10%.
DEFAULT_MAX_REPLICATED_FRACTION = 0.1

MAX_CPU_DEVICES = 4096
"""Most simulated CPU devices per process. JAX builds each one up front, and the cost grows
faster than the count (measured here: 1,024 in 1 s and 0.28 GB, 4,096 in 8.5 s and 0.59 GB,
100,000 past 6 GB without finishing); 4,096 covers rehearsing or planning any single job's
mesh (the largest GPU and TPU slices), more only hangs the machine."""

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: the loss scale is a float32 in the program."""

NOT_IN_FILE = {"in_file": False}
"""Field metadata: the field is set by the loader or by code, never a key of the config file."""


def file_keys(cls: type) -> tuple[str, ...]:
    """The keys a config file's section for dataclass `cls` may have: its fields, in order,
    but those marked NOT_IN_FILE."""
    return tuple(f.name for f in fields(cls) if f.metadata.get("in_file", True))


def _set(instance: Any, name: str, value: Any) -> None:
    """Normalise a field of a frozen dataclass in its `__post_init__`."""
    object.__setattr__(instance, name, value)


def _optional(check, path: str, value: Any, **kwargs: Any) -> Any:
    return None if value is None else check(path, value, **kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshConfig:
    """The device mesh (`mesh:`): named axes, outermost first, resolved against a device count."""

    axes: tuple[tuple[str, int], ...] = (("data", -1),)
    """Mesh axes in order (outermost first), as written: name -> size, where -1 fills the
    devices the other axes leave."""

    num_devices: int = 1
    """Device count the mesh is resolved against (the -1 axis fills it, the sizes must
    multiply to it): `load_config` sets it from `num_devices=`, `devices.num_cpu_devices` or
    the running JAX; an integer >= 1. Not a file key: the file's mesh section is the axes."""

    def __post_init__(self) -> None:
        num_devices = as_int("num_devices", self.num_devices, minimum=1)
        if not isinstance(self.axes, (list, tuple)) or not all(
            isinstance(axis, (list, tuple)) and len(axis) == 2 for axis in self.axes
        ):
            raise error("mesh.axes", self.axes, "expected (axis name, size) pairs")
        axes = tuple((name, size) for name, size in self.axes) or (("data", -1),)
        names = [name for name, _ in axes]
        check_keys("mesh", dict(axes), MESH_AXES)
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f"mesh.{name}: the axis is given twice; give each axis once")
        for name, size in axes:
            if size != -1:
                as_int(f"mesh.{name}", size, minimum=1)
        fill = [name for name, size in axes if size == -1]
        if len(fill) > 1:
            raise ConfigError(
                f"{' and '.join(f'mesh.{n}=-1' for n in fill)}: at most one axis may be -1"
            )
        known = 1
        for name, size in axes:
            if size == -1:
                continue
            known *= size
            if num_devices % known:
                raise ConfigError(f"mesh.{name}={size} does not divide {num_devices} devices")
        if not fill and known != num_devices:
            product = " x ".join(f"{n}={s}" for n, s in axes)
            raise ConfigError(
                f"mesh: {product} = {known} devices, but there are {num_devices}; make the "
                f"product {num_devices} or set one axis to -1 to fill the remaining devices"
            )
        _set(self, "axes", axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names, outermost first."""
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes with -1 resolved."""
        known = math.prod(size for _, size in self.axes if size != -1)
        return tuple(self.num_devices // known if size == -1 else size for _, size in self.axes)

    def size(self, axis: str) -> int:
        """Size of `axis`; 1 for an axis the mesh does not have."""
        return dict(zip(self.axis_names, self.shape)).get(axis, 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """ZeRO partitioning (`zero:`, or the top-level `zero_stage`): the stage and the axes it shards over."""

    stage: int = 0
    """ZeRO stage, 0, 1, 2 or 3: 0 (the default) replicates everything over the data-parallel
    axes; 1 shards optimizer state and master weights; 2 also gradients; 3 also parameters
    (gathered for compute). A file may give it as the top-level `zero_stage`."""

    data_parallel_axes: tuple[str, ...] = ("data", "fsdp", "expert")
    """Mesh axes that count as data-parallel: ZeRO shards over their product and the batch is
    split over them. Axes the mesh does not have are ignored. `expert` is one by default, as
    in DeepSpeed-MoE and Megatron, where the expert-parallel ranks are data-parallel ranks for
    everything but the experts: each holds its own tokens, and an axis a rule already uses on a
    parameter (the experts' dim 0) is not added to it again."""

    max_replicated_fraction: float = DEFAULT_MAX_REPLICATED_FRACTION
    """Largest fraction of parameter bytes allowed to stay replicated because no dim divides
    evenly; more fails the plan, listing the five largest offenders. A number between 0 and
    1.0; 1.0 disables the guard; the default 0.1 keeps the memory the stage promises within
    10%."""

    def __post_init__(self) -> None:
        _set(self, "stage", as_stage("zero.stage", self.stage))
        _set(
            self,
            "data_parallel_axes",
            as_axes("zero.data_parallel_axes", self.data_parallel_axes, MESH_AXES),
        )
        _set(
            self,
            "max_replicated_fraction",
            as_float("zero.max_replicated_fraction", self.max_replicated_fraction, at_most=1.0),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """One sharding rule (`rules[i]`): parameters whose name matches get this PartitionSpec."""

    pattern: str
    """Regex searched (`re.search`) in the parameter's state_dict name; anchor with ^/$."""

    spec: tuple[str | tuple[str, ...] | None, ...]
    """Per-dimension mesh axes (a PartitionSpec), one entry per dim: None (not split), an
    axis, or a tuple of axes; no axis twice. A user rule's axes must be in the mesh (checked by
    `Config`)."""

    origin: str = field(metadata=NOT_IN_FILE)
    """Where the rule came from, for messages: "rules[2]" or "rules[0] (preset 'gpt2')"."""

    preset: str | None = field(default=None, metadata=NOT_IN_FILE)
    """The preset this rule was expanded from; None for a rule written out. Preset rules drop
    axes the mesh does not have (a gpt2 preset on a mesh without `tensor` does no tensor
    parallelism); user rules may not name such axes."""

    def __post_init__(self) -> None:
        where = self.origin
        if not isinstance(self.pattern, str):
            raise error(f"{where}.pattern", self.pattern, "expected a regex string")
        as_regex(f"{where}.pattern", self.pattern)
        path = f"{where}.spec"
        if not isinstance(self.spec, (list, tuple)):
            raise error(
                path,
                self.spec,
                "expected a list with one entry per dim: null, an axis, or a list of axes",
            )
        spec: list[Any] = []
        used: set[str] = set()
        for i, entry in enumerate(self.spec):
            if entry is None:
                spec.append(None)
                continue
            axes = as_axes(f"{path}[{i}]", entry, MESH_AXES)
            for axis in axes:
                if axis in used:
                    raise error(path, list(self.spec), f"axis {axis!r} is used by two dims")
                used.add(axis)
            spec.append(axes[0] if isinstance(entry, str) else axes)
        _set(self, "spec", tuple(spec))

    def user_axes(self) -> tuple[tuple[str, str | tuple[str, ...]], ...]:
        """(path, entry) of each spec entry naming an axis (a user rule's must be in the mesh)."""
        return tuple(
            (f"{self.origin}.spec[{i}]", entry)
            for i, entry in enumerate(self.spec)
            if entry is not None
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class InputsConfig:
    """How batch inputs are split over the mesh (`inputs:`)."""

    batch_axes: tuple[str, ...] | None = None
    """Mesh axes the batch dim is split over (each in the mesh, none twice); None means the
    data-parallel axes of the mesh."""

    sequence_axis: str | None = None
    """Mesh axis the sequence dim is split over (sequence parallelism), one of the mesh's axes
    and not a batch axis; None keeps it whole. `sequence_parallel.axis` sets it."""

    batch_dim: int = 0
    """Which input dim is the batch: an integer >= 0, by default 0."""

    sequence_dim: int = 1
    """Which input dim is the sequence (used only with `sequence_axis`): an integer >= 0 other
    than `batch_dim`, by default 1."""

    pad_to_multiple_of: tuple[tuple[str, int], ...] = ()
    """Opt-in bucketing of varying input shapes (`zerojax.train.shape_buckets`): each call's
    inputs padded, along `sequence` (dim 1) and/or `batch` (dim 0), up to a multiple of the
    size given, so that batches of many lengths compile one program per bucket; outputs are
    sliced back. A mapping such as {sequence: 64, batch: 8}, or an integer for the sequence
    alone. Only where padding provably changes nothing: keyword inputs `input_ids` (padded
    with the model's pad token), `attention_mask` (0) and `labels` (-100, which the loss
    ignores); any other call is refused, saying why. Empty (the default): no padding."""

    def __post_init__(self) -> None:
        batch_axes = _optional(as_axes, "inputs.batch_axes", self.batch_axes, allowed=MESH_AXES)
        _set(self, "batch_axes", batch_axes)
        # Whether `sequence_axis` names a mesh axis is `Config`'s check: it knows the mesh.
        if self.sequence_axis is not None and self.sequence_axis in (batch_axes or ()):
            raise error(
                "inputs.sequence_axis", self.sequence_axis, "already used by inputs.batch_axes"
            )
        for name in ("batch_dim", "sequence_dim"):
            as_int(f"inputs.{name}", getattr(self, name), minimum=0)
        padding: Any = self.pad_to_multiple_of
        if isinstance(padding, int) and not isinstance(padding, bool):
            padding = {"sequence": padding}
        elif not isinstance(padding, Mapping):
            if isinstance(padding, str) or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in padding
            ):
                raise error(
                    "inputs.pad_to_multiple_of", padding, "expected {sequence: n, batch: m} or n"
                )
            padding = dict(padding)
        check_keys("inputs.pad_to_multiple_of", padding, ("sequence", "batch"))
        _set(
            self,
            "pad_to_multiple_of",
            tuple(
                (dim, as_int(f"inputs.pad_to_multiple_of.{dim}", size, minimum=1))
                for dim, size in padding.items()
            ),
        )
        if self.sequence_axis and self.batch_dim == self.sequence_dim:
            raise error("inputs.sequence_dim", self.sequence_dim, "must differ from batch_dim")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaleConfig:
    """float16 loss scaling (`precision.loss_scale`)."""

    dynamic: bool = True
    """Dynamic loss scaling: grow the scale after `window` clean steps, halve it on overflow
    (the overflowing step is skipped). False keeps `initial_scale` fixed."""

    initial_scale: float = 2.0**16
    """Starting (or, if not dynamic, fixed) loss scale: a number > 0 that float32 holds (at
    most FLOAT32_MAX, ~3.4e38: the program keeps the scale in float32), by default 2**16."""

    window: int = 1000
    """Clean steps before the dynamic scale doubles: an integer from 1 to 2**31 - 1 (an int32
    in the program), by default 1000."""

    hysteresis: int = 2
    """Overflows tolerated before the scale is lowered (DeepSpeed's `hysteresis`): an integer
    from 1 to 2**31 - 1, by default 2."""

    min_scale: float = 1.0
    """The dynamic scale never goes below this: a number > 0, by default 1.0, and (dynamic)
    at most `initial_scale`, where the scale starts."""

    def __post_init__(self) -> None:
        path = "precision.loss_scale"
        as_bool(f"{path}.dynamic", self.dynamic)
        for name in ("initial_scale", "min_scale"):
            value = as_float(f"{path}.{name}", getattr(self, name), positive=True)
            if value > FLOAT32_MAX:
                raise error(
                    f"{path}.{name}",
                    getattr(self, name),
                    f"the loss scale is a float32 in the program: at most {FLOAT32_MAX:.7g}",
                )
            _set(self, name, value)
        for name in ("window", "hysteresis"):
            as_int(f"{path}.{name}", getattr(self, name), minimum=1, maximum=INT32_MAX)
        if self.dynamic and self.min_scale > self.initial_scale:
            raise error(
                f"{path}.min_scale",
                self.min_scale,
                f"above initial_scale={self.initial_scale:g}: the dynamic scale starts at "
                "initial_scale and never goes below min_scale; make min_scale <= initial_scale",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionConfig:
    """The dtype policy (`precision:`, or one string such as
    "params=bfloat16,compute=bfloat16,master=float32")."""

    param_dtype: str = "float32"
    """Dtype parameters are stored in between steps: float32 (the default), bfloat16 or
    float16 (FLOAT_DTYPES), as every dtype of the policy."""

    compute_dtype: str = "float32"
    """Dtype of forward/backward arithmetic (matmuls accumulate in float32 regardless)."""

    output_dtype: str = "float32"
    """Dtype of the model outputs handed back to torch (the loss, logits)."""

    master_dtype: str | None = None
    """float32 keeps a float32 master copy of 16-bit params for the update (not allowed with
    float32 params, which are their own masters); None (the default) updates the params in
    their own dtype."""

    optimizer_state_dtype: str = "float32"
    """Dtype of optimizer moments (Adam m and v)."""

    grad_reduce_dtype: str = "float32"
    """Dtype gradients are reduced (all-reduce / reduce-scatter) and accumulated in."""

    loss_scale: LossScaleConfig | None = None
    """float16 loss scaling, only where the param, compute or grad_reduce dtype is float16;
    None there becomes dynamic scaling (`LossScaleConfig()`). A file may give "dynamic", a
    number (a fixed scale) or the section's keys."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "master_dtype":
                as_choice("precision.master_dtype", self.master_dtype, ("float32",), optional=True)
            elif f.name.endswith("_dtype"):
                as_choice(f"precision.{f.name}", getattr(self, f.name), FLOAT_DTYPES)
        if self.loss_scale is not None and not isinstance(self.loss_scale, LossScaleConfig):
            raise error(
                "precision.loss_scale", self.loss_scale, "expected a LossScaleConfig or null"
            )
        uses_fp16 = "float16" in (self.param_dtype, self.compute_dtype, self.grad_reduce_dtype)
        if self.loss_scale is None and uses_fp16:
            _set(self, "loss_scale", LossScaleConfig())
        if self.loss_scale is not None and not uses_fp16:
            raise ConfigError(
                "precision.loss_scale is set but no param/compute/grad_reduce dtype is float16; "
                "loss scaling is only for float16 (remove it, or use float16)"
            )
        if self.master_dtype == "float32" and self.param_dtype == "float32":
            raise ConfigError(
                "precision.master_dtype='float32' with param_dtype='float32': the params "
                "already are float32 masters; set master_dtype to null or use a 16-bit "
                "param_dtype"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelsConfig:
    """Which Pallas kernels the bridge substitutes for hot ops (`kernels:`)."""

    attention: str = "auto"
    """Scaled-dot-product attention, one of KERNEL_IMPLEMENTATIONS: auto (the default: the
    Pallas kernel on GPU, its XLA reference elsewhere), pallas, xla, or off (no substitution:
    the bridge's plain lowering)."""

    norm: str = "auto"
    """LayerNorm and the RMSNorm pattern (same choices and default)."""

    optimizer: str = "auto"
    """Fused AdamW update on each shard (same choices and default)."""

    loss: str = "auto"
    """Fused linear + cross-entropy, vocabulary-chunked (same choices and default)."""

    interpret: bool = False
    """Run Pallas kernels in interpret mode (for CPU tests); false (the default) compiles
    them."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "interpret":
                as_bool("kernels.interpret", self.interpret)
            else:
                as_choice(f"kernels.{f.name}", getattr(self, f.name), KERNEL_IMPLEMENTATIONS)

    def choice(self, family: str) -> tuple[str, bool] | None:
        """(implementation, interpret) for a kernel family ("attention", "norm", "optimizer",
        "loss"); None when the config turns it off."""
        implementation = getattr(self, family)
        return None if implementation == "off" else (implementation, self.interpret)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeConfig:
    """Mixture-of-experts dispatch under expert parallelism (`moe:`)."""

    capacity_factor: float | None = None
    """Expert-parallel dispatch (mesh axis `expert` > 1): None is dropless, every routed token
    reaches its expert. A number f > 0 caps what one device sends one expert-axis peer at
    f x its balanced share; tokens past the cap are dropped (their expert output is zero) and
    counted (`zerojax.parallel.expert_parallel`)."""

    def __post_init__(self) -> None:
        factor = _optional(as_float, "moe.capacity_factor", self.capacity_factor, positive=True)
        _set(self, "capacity_factor", factor)


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceParallelConfig:
    """Sequence parallelism (`sequence_parallel:`): the split axis, the attention
    algorithm, the modules it applies to."""

    axis: str | None = None
    """Mesh axis the sequence is split over, one of the mesh's axes; None (the default): no
    sequence parallelism (a file's section, once written, defaults it to `sequence`). Setting
    it also splits the inputs' sequence dim over it (`inputs.sequence_axis`) and adds it to the
    axes ZeRO shards over (DeepSpeed-Ulysses' data x sequence group); the batch is not split on
    it."""

    attention: str = "auto"
    """ulysses, ring or auto (SEQUENCE_PARALLEL_ATTENTION; auto is the default): how attention
    crosses the split (`zerojax.parallel.sequence_parallel`)."""

    modules: tuple[str, ...] = ()
    """Module path regexes (full match against a path as in `named_modules()`, e.g.
    `model\\.vision_tower`): only attention inside a matching module runs sequence-parallel,
    the rest runs whole (per-module layouts: a vision tower split over `sequence` beside a
    tensor-parallel language model). Empty: every attention, and the inputs' sequence dim is
    split; with modules the inputs are not split (the split starts inside those modules)."""

    def __post_init__(self) -> None:
        # Whether `axis` is a mesh axis is `Config`'s check: it knows the mesh.
        as_choice("sequence_parallel.attention", self.attention, SEQUENCE_PARALLEL_ATTENTION)
        modules = self.modules
        if isinstance(modules, str) or not isinstance(modules, (list, tuple)):
            raise error(
                "sequence_parallel.modules", modules, "expected a list of module path regexes"
            )
        for i, pattern in enumerate(modules):
            as_regex(f"sequence_parallel.modules[{i}]", pattern, "module path regex")
        _set(self, "modules", tuple(modules))


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointingConfig:
    """Which activations are recomputed in the backward pass
    (`activation_checkpointing:`)."""

    modules: tuple[tuple[str, str], ...] = ()
    """(module path regex, policy) in the order written (a mapping is taken in its order): each
    submodule whose path (as in `named_modules()`, e.g. `transformer.h.3`) fully matches a regex
    has its forward rematerialised with that policy (REMAT_POLICIES; the first matching rule,
    outermost module first). Empty (the default): only the model's own checkpoint calls."""

    torch_checkpoint: str = "full"
    """Policy (REMAT_POLICIES) for the model's own `torch.utils.checkpoint.checkpoint` calls
    (and Hugging Face's `gradient_checkpointing_enable()`, which makes them): full, the
    default, is torch's semantics; offload is DeepSpeed's `cpu_checkpointing`."""

    def __post_init__(self) -> None:
        path = "activation_checkpointing.modules"
        modules = self.modules.items() if isinstance(self.modules, Mapping) else self.modules
        if isinstance(modules, str) or not all(
            isinstance(rule, (list, tuple)) and len(rule) == 2 for rule in modules
        ):
            raise error(path, self.modules, "expected (module path regex, policy) pairs")
        for pattern, policy in modules:
            where = f"{path}[{render(pattern)}]"
            as_regex(where, pattern, "module path regex", show=False)
            as_choice(where, policy, REMAT_POLICIES)
        _set(self, "modules", tuple(tuple(rule) for rule in modules))
        as_choice(
            "activation_checkpointing.torch_checkpoint", self.torch_checkpoint, REMAT_POLICIES
        )

    def policy_for(self, module_path: str) -> str | None:
        """The policy of the first rule matching `module_path`, None if none matches."""
        for pattern, policy in self.modules:
            if re.fullmatch(pattern, module_path):
                return policy
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """Which model states live in host memory between steps (`offload:`); the rules
    tying them to the ZeRO stage and the precision are `Config`'s."""

    optimizer: str = "device"
    """Where the optimizer state (Adam's moments, SGD's momentum, step counts) lives: device
    (the default, as for every state here), or host (ZeRO-Offload; needs ZeRO stage >= 1). Host state stays on its ZeRO shard, in the host
    memory of the device that owns the shard; the update program moves it in and back out."""

    master: str = "device"
    """Where the float32 master weights live (only where the precision policy keeps them):
    device or host, as `optimizer`."""

    params: str = "device"
    """Where the parameter shards live between uses: device, or host (ZeRO-Infinity's CPU tier;
    needs ZeRO stage 3 and `grads: host`): each op that reads a parameter brings its shard in
    and gathers it there, inside the checkpointed region that op is (so the backward pass
    brings it in again), and the new parameters stay on the host after the update."""

    grads: str = "device"
    """Where the accumulated gradients live: device, or host (ZeRO-Offload; needs `optimizer:
    host`): each gradient leaves the device as the backward pass produces it, accumulation
    adds on the host, and the update computes there."""

    def __post_init__(self) -> None:
        # Which placements go together (and with the ZeRO stage, the precision) is `Config`'s
        # check: the rules span sections.
        for f in fields(self):
            as_choice(f"offload.{f.name}", getattr(self, f.name), OFFLOAD_PLACES)

    @property
    def host_states(self) -> tuple[str, ...]:
        """The states placed in host memory, in field order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) == "host")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Orbax checkpointing (`checkpoint:`)."""

    directory: str | None = None
    """Where Orbax writes checkpoints (a non-empty path); None (the default) disables
    checkpointing."""

    save_interval_steps: int = 0
    """Save every N optimizer steps (an integer >= 0); 0, the default, saves only when asked."""

    max_to_keep: int | None = 3
    """Checkpoints kept on disk (oldest deleted first), an integer >= 1, by default 3; None
    keeps all."""

    async_save: bool = True
    """Write in the background (the default); the step blocks only to copy arrays off the
    device. False writes before the save call returns."""

    def __post_init__(self) -> None:
        as_path("checkpoint.directory", self.directory, optional=True)
        as_int("checkpoint.save_interval_steps", self.save_interval_steps, minimum=0)
        _optional(as_int, "checkpoint.max_to_keep", self.max_to_keep, minimum=1)
        as_bool("checkpoint.async_save", self.async_save)


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    """Compilation cache and effective-training-time reporting (`runtime:`)."""

    compilation_cache_dir: str | None = "~/.cache/zerojax/jax"
    """Directory of JAX's persistent compilation cache, so a restarted job skips recompiling
    (by default ~/.cache/zerojax/jax); None disables it. It holds compiled executables (code)
    and zerojax's capture cache: a directory another user can write is refused, and one
    zerojax creates is made 0700 (see "What the caches and checkpoints are trusted with" in
    docs/checkpoints.md)."""

    effective_time_log: str | None = None
    """Append effective-training-time events as JSON lines to this file; None: no file."""

    report_effective_time: bool = False
    """Print where the run's time went (init, compile, checkpoints, steps) at exit. Off by
    default: only when on does zerojax register an exit hook."""

    def __post_init__(self) -> None:
        for name in ("compilation_cache_dir", "effective_time_log"):
            as_path(f"runtime.{name}", getattr(self, name), optional=True)
        as_bool("runtime.report_effective_time", self.report_effective_time)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Gradient accumulation, clipping and batch sizes (`train:`)."""

    gradient_accumulation_steps: int = 1
    """Backward passes summed before each optimizer step: an integer >= 1, by default 1 (no
    accumulation)."""

    gradient_clipping: float | None = None
    """Clip the global gradient norm to this value (a number > 0) before the update; None (the
    default) disables."""

    micro_batch_size: int | None = None
    """Examples per data-parallel rank per backward pass (DeepSpeed's
    train_micro_batch_size_per_gpu), an integer >= 1; None: derived from global_batch_size, or
    unknown. Only checked (zerojax does not load data)."""

    global_batch_size: int | None = None
    """Examples per optimizer step over all ranks: micro_batch_size x
    gradient_accumulation_steps x data-parallel size (DeepSpeed's train_batch_size), an integer
    >= 1; None: derived from micro_batch_size, or unknown. `Config` checks the product and
    fills in the one left out."""

    check_index_bounds: bool = True
    """Raise torch's error when an op reads an index out of range (an embedding, gather,
    scatter, advanced index, cross_entropy target or one_hot class), as torch does, instead of
    computing with a clamped index: checked inside the compiled step, raised when the step's
    results are read (`zerojax.bridge.index_bounds`; about 1% of the GPT-2 bench step or less,
    BENCHMARKS.md). By default true; false skips the check."""

    def __post_init__(self) -> None:
        as_int("train.gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1)
        as_bool("train.check_index_bounds", self.check_index_bounds)
        clipping = _optional(
            as_float, "train.gradient_clipping", self.gradient_clipping, positive=True
        )
        _set(self, "gradient_clipping", clipping)
        for name in ("micro_batch_size", "global_batch_size"):
            _optional(as_int, f"train.{name}", getattr(self, name), minimum=1)

    def resolved(self, data_parallel_size: int) -> TrainConfig:
        """Checks global = micro x accumulation x data-parallel size; derives the one left
        out."""
        micro, accum = self.micro_batch_size, self.gradient_accumulation_steps
        total, dp = self.global_batch_size, data_parallel_size
        g, m, a = (
            written(f"train.{name}")
            for name in ("global_batch_size", "micro_batch_size", "gradient_accumulation_steps")
        )
        if micro is not None and total is not None:
            if micro * accum * dp != total:
                raise ConfigError(
                    f"{g}={total} != {m}={micro} x {a}={accum} x data-parallel size {dp} "
                    f"(= {micro * accum * dp}); batch sizes must multiply out"
                )
            return self
        if total is not None:
            if total % (accum * dp):
                raise ConfigError(
                    f"{g}={total} is not divisible by {a}={accum} x data-parallel size {dp} "
                    f"(= {accum * dp}); batch sizes must multiply out"
                )
            return replace(self, micro_batch_size=total // (accum * dp))
        if micro is not None:
            return replace(self, global_batch_size=micro * accum * dp)
        return self


@dataclass(frozen=True, kw_only=True, slots=True)
class DevicesConfig:
    """Platform and simulated CPU devices (`devices:`), applied before JAX starts."""

    platform: str | None = None
    """JAX platform (cpu, gpu, tpu); None (the default) lets JAX pick."""

    num_cpu_devices: int | None = None
    """Simulated CPU devices, an integer from 1 to MAX_CPU_DEVICES (4096) per process (sets
    platform to cpu; any other platform is an error); must be applied before JAX starts, see
    `zerojax.sharding.configure_devices`. None (the default): the real devices."""

    def __post_init__(self) -> None:
        platform = as_choice("devices.platform", self.platform, PLATFORMS, optional=True)
        num = _optional(
            as_int,
            "devices.num_cpu_devices",
            self.num_cpu_devices,
            minimum=1,
            maximum=MAX_CPU_DEVICES,
        )
        if num is not None:
            if platform not in (None, "cpu"):
                raise error(
                    "devices.num_cpu_devices",
                    num,
                    f"only applies to platform 'cpu', not {platform!r}",
                )
            _set(self, "platform", "cpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer the config names (`optimizer:`, DeepSpeed's `optimizer`)."""

    type: str
    """Optimizer name, one of OPTIMIZER_TYPES in any case (stored lower-case): `zerojax.initialize`
    builds the torch optimizer from it when given none, and checks a given one against it."""

    params: tuple[tuple[str, Any], ...] = ()
    """torch constructor keyword arguments as (name, value) pairs (or a mapping), in the order
    given (lists become tuples); the keys OPTIMIZER_PARAMS allows for `type`: numbers >= 0,
    betas two numbers in [0, 1), flags true or false. Empty (the default): torch's defaults."""

    def __post_init__(self) -> None:
        if not isinstance(self.type, str):
            raise error("optimizer.type", self.type, f"allowed: {', '.join(OPTIMIZER_TYPES)}")
        kind = as_choice("optimizer.type", self.type.lower(), OPTIMIZER_TYPES)
        params: Any = self.params
        if not isinstance(params, Mapping):
            if isinstance(params, str) or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in params
            ):
                raise error("optimizer.params", params, "expected (name, value) pairs")
            params = dict(params)
        check_keys("optimizer.params", params, OPTIMIZER_PARAMS[kind])
        checked: dict[str, Any] = {}
        for key, value in params.items():
            where = f"optimizer.params.{key}"
            if key in ("amsgrad", "maximize", "nesterov", "centered", "decoupled_weight_decay"):
                checked[key] = as_bool(where, value)
            elif key in ("etas", "step_sizes"):  # Rprop's (low, high) pairs
                if not isinstance(value, (list, tuple)) or len(value) != 2:
                    raise error(where, value, "expected two numbers [low, high], each >= 0")
                checked[key] = tuple(as_float(f"{where}[{i}]", v) for i, v in enumerate(value))
                if min(checked[key]) < 0:
                    raise error(where, value, "expected two numbers [low, high], each >= 0")
            elif key == "beta2_decay":  # Adafactor's decay exponent: negative (default -0.8)
                checked[key] = as_float(where, value)
            elif key == "betas":
                if not isinstance(value, (list, tuple)) or len(value) != 2:
                    raise error(where, value, "expected [beta1, beta2], each in [0, 1)")
                checked[key] = tuple(
                    as_unit_interval(f"{where}[{i}]", beta) for i, beta in enumerate(value)
                )
            else:  # lr, eps, weight_decay, momentum, dampening, alpha, rho, ...
                checked[key] = as_float(where, value)
                if checked[key] < 0:
                    raise error(where, value, "expected a number >= 0")
        _set(self, "type", kind)
        _set(self, "params", tuple(checked.items()))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The params as torch constructor keyword arguments."""
        return dict(self.params)


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A whole zerojax config: one field per section (each a key of the config file), and
    what the loader records. Building one checks the rules that span sections."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh: named axes and their sizes."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage and which axes it shards over."""

    rules: tuple[Rule, ...] = ()
    """Parameter-name -> PartitionSpec rules, presets expanded, first match wins."""

    inputs: InputsConfig = field(default_factory=InputsConfig)
    """How batch inputs are sharded."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Dtype policy."""

    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Pallas kernel selection."""

    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture-of-experts dispatch under expert parallelism."""

    sequence_parallel: SequenceParallelConfig = field(default_factory=SequenceParallelConfig)
    """Sequence parallelism: the split axis and the attention algorithm."""

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Which model states live in host memory instead of device memory (ZeRO-Offload)."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Orbax checkpointing."""

    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    """Which modules' activations are recomputed in the backward pass (`jax.checkpoint`)."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Gradient accumulation, clipping and batch sizes."""

    devices: DevicesConfig = field(default_factory=DevicesConfig)
    """Platform and simulated CPU device count."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Compilation cache and effective-training-time reporting."""

    optimizer: OptimizerConfig | None = None
    """Optimizer named by the config (DeepSpeed `optimizer`): built when `initialize` gets
    none, checked against the torch optimizer when it gets one; None: the torch optimizer."""

    trainer_autos: tuple[str, ...] = field(default=(), metadata=NOT_IN_FILE)
    """DeepSpeed keys the config left "auto" for the Hugging Face Trainer to fill
    (`zerojax.config.deepspeed.TRAINER_AUTOS`): the Trainer training the model does those
    things itself (`zerojax.integrations.hf_trainer`); a model trained without one refuses to
    run, naming them."""

    source: str | None = field(default=None, metadata=NOT_IN_FILE)
    """File the config was read from, for messages; None for a dict or a config built in
    code."""

    format: str = field(default="zerojax", metadata=NOT_IN_FILE)
    """"zerojax" (the default) or "deepspeed": which schema the source was written in."""

    def __post_init__(self) -> None:
        """The rules that span sections; each section checked its own values when built."""
        for f in fields(self):
            value = getattr(self, f.name)
            expected = f.default_factory if isinstance(f.default_factory, type) else None
            if expected is not None and not isinstance(value, expected):
                raise ConfigError(
                    f"Config.{f.name}: expected a {expected.__name__}, got {type(value).__name__}"
                )
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError(
                f"Config.optimizer: expected an OptimizerConfig or None, got "
                f"{type(self.optimizer).__name__}"
            )
        as_choice("format", self.format, ("zerojax", "deepspeed"))
        _set(self, "rules", tuple(self.rules))
        _set(self, "trainer_autos", tuple(self.trainer_autos))
        mesh_axes = self.mesh.axis_names
        self._check_rules(mesh_axes)
        self._check_inputs(mesh_axes)
        self._check_sequence_parallel(mesh_axes)
        self._check_offload()
        _set(self, "train", self.train.resolved(self.data_parallel_size))

    def _check_rules(self, mesh_axes: tuple[str, ...]) -> None:
        for rule in self.rules:
            if not isinstance(rule, Rule):
                raise ConfigError(f"Config.rules: expected Rules, got {type(rule).__name__}")
            if rule.preset is not None:  # presets drop the axes the mesh lacks
                continue
            for where, entry in rule.user_axes():
                for axis in (entry,) if isinstance(entry, str) else entry:
                    if axis not in mesh_axes:
                        raise error(
                            where,
                            entry,
                            f"axis {axis!r} is not in the mesh; mesh axes: {', '.join(mesh_axes)}",
                        )

    def _check_inputs(self, mesh_axes: tuple[str, ...]) -> None:
        inputs = self.inputs
        for axis in inputs.batch_axes or ():
            if axis not in mesh_axes:
                raise error(
                    "inputs.batch_axes",
                    inputs.batch_axes,
                    f"axis {axis!r} is not in the mesh; mesh axes: {', '.join(mesh_axes)}",
                )
        as_choice("inputs.sequence_axis", inputs.sequence_axis, mesh_axes, optional=True)

    def _check_sequence_parallel(self, mesh_axes: tuple[str, ...]) -> None:
        """The section's axis is a mesh axis, agrees with the inputs' split, and (without
        `modules`) splits the inputs' sequence dim."""
        axis, inputs = self.sequence_parallel.axis, self.inputs
        if axis is None:
            return
        if axis not in mesh_axes:
            raise error(
                "sequence_parallel.axis",
                axis,
                f"not in the mesh; mesh axes: {', '.join(mesh_axes)} (add it to mesh:, e.g. "
                "mesh: {data: 2, sequence: 4})",
            )
        if inputs.sequence_axis not in (None, axis):
            raise error(
                "inputs.sequence_axis",
                inputs.sequence_axis,
                f"differs from sequence_parallel.axis={axis!r}; drop it (the section sets it)",
            )
        if inputs.batch_axes is not None and axis in inputs.batch_axes:
            raise error(
                "inputs.batch_axes",
                list(inputs.batch_axes),
                f"contains the sequence-parallel axis {axis!r}; it splits the sequence, not "
                "the batch",
            )
        if not self.sequence_parallel.modules:  # with modules the split starts inside them
            _set(self, "inputs", replace(inputs, sequence_axis=axis))

    def _check_offload(self) -> None:
        """Host placement needs ZeRO stage >= 1 (as DeepSpeed's offload_optimizer does: what
        moves to the host is each rank's ZeRO shard) and master weights to move; host gradients
        feed the host update (so need the optimizer state there), host parameters need stage 3
        and host gradients."""
        offload, stage = self.offload, self.zero.stage
        if offload.host_states and stage == 0:
            raise error(
                f"offload.{offload.host_states[0]}",
                "host",
                "needs ZeRO stage 1, 2 or 3 (as DeepSpeed's offload_optimizer does: each rank "
                "offloads its own shard of the state); set zero_stage to 1 or more",
            )
        keeps_master = self.precision.master_dtype is not None
        if offload.grads == "host" and (
            offload.optimizer != "host" or (keeps_master and offload.master != "host")
        ):
            raise error(
                "offload.grads",
                "host",
                "gradients go to the host for the host-side update (ZeRO-Offload): it needs "
                "offload.optimizer: host (and master: host where the precision keeps masters)",
            )
        if offload.params == "host" and (stage < 3 or offload.grads != "host"):
            raise error(
                "offload.params",
                "host",
                "parameter offload (ZeRO-Infinity's CPU tier) keeps ZeRO-3's parameter shards "
                "on the host and brings each in where an op reads it; it needs zero_stage 3 and "
                "the update on the host: offload.optimizer, offload.grads (and offload.master "
                "where the precision keeps masters) set to host",
            )
        if offload.master == "host" and not keeps_master:
            raise error(
                "offload.master",
                "host",
                "the precision policy keeps no master weights (precision.master_dtype is null: "
                "the params are what the optimizer updates); remove the key, or keep float32 "
                "masters (precision master=float32 with 16-bit params)",
            )

    @property
    def zero_stage(self) -> int:
        """`zero.stage`."""
        return self.zero.stage

    @property
    def data_parallel_axes(self) -> tuple[str, ...]:
        """The ZeRO axes this mesh has, in mesh order."""
        return tuple(a for a in self.mesh.axis_names if a in self.zero.data_parallel_axes)

    @property
    def data_parallel_size(self) -> int:
        """Product of the data-parallel axes' sizes: the ZeRO partition count N_d."""
        return math.prod(self.mesh.size(a) for a in self.data_parallel_axes)
