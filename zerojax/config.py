"""The zerojax config file: schema, YAML/JSON/DeepSpeed-JSON loading and validation.

One call, `load_config(path_or_dict)`, returns a frozen `Config`. Every validation problem raises
`ConfigError` naming the key path, the bad value and what is allowed; unknown keys are errors
(a typo must never be a silent default). A DeepSpeed `ds_config.json` is recognised by its keys
and mapped onto the same schema; DeepSpeed keys zerojax does not implement are each named in a
`ConfigWarning`.

Example (YAML; every section is optional)::

    devices: {platform: cpu, num_cpu_devices: 8}   # rehearse an 8-way mesh on a laptop
    mesh: {data: -1, tensor: 2}                    # -1 fills the remaining devices
    zero_stage: 3                                  # or zero: {stage: 3, data_parallel_axes: [data]}
    rules:                                         # first match wins
      - {pattern: 'wte\\.weight$', spec: [tensor, null]}
      - gpt2                                       # a built-in preset, expanded in place
    inputs: {sequence_axis: null}
    precision: "params=bfloat16,compute=bfloat16,master=float32"
    train: {gradient_accumulation_steps: 4, gradient_clipping: 1.0}

The mesh is resolved against a device count at load time (`num_devices=`, else
`devices.num_cpu_devices`, else `jax.device_count()`), so a config that loads is one whose mesh
fits the machine.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MESH_AXES",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "DevicesConfig",
    "InputsConfig",
    "KernelsConfig",
    "LossScaleConfig",
    "MeshConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "Rule",
    "TrainConfig",
    "ZeroConfig",
    "deepspeed_to_zerojax",
    "load_config",
    "parse_precision",
]

MESH_AXES = ("data", "fsdp", "tensor", "expert", "sequence")
"""The mesh axis names zerojax knows; any other name is a typo until proven otherwise."""

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
PLATFORMS = ("cpu", "gpu", "tpu")
KERNEL_IMPLEMENTATIONS = ("auto", "pallas", "xla", "off")
OPTIMIZER_TYPES = ("adam", "adamw", "sgd", "adagrad", "lamb", "lion")

# Default 0.1: past that, the per-device memory the ZeRO stage promises is off by more than 10%.
DEFAULT_MAX_REPLICATED_FRACTION = 0.1


class ConfigError(ValueError):
    """A config (or a sharding plan built from it) is invalid; the message says where and why."""


class ConfigWarning(UserWarning):
    """A config key is accepted but ignored (DeepSpeed keys zerojax does not implement), or a
    sharding rule matched no parameter."""


# ----------------------------------------------------------------------------- schema


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshConfig:
    axes: tuple[tuple[str, int], ...] = (("data", -1),)
    """Mesh axes in order (outermost first), as written: name -> size, where -1 fills the
    devices the other axes leave."""

    num_devices: int = 1
    """Device count the mesh was resolved against at load time."""

    @property
    def axis_names(self) -> tuple[str, ...]:
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
    stage: int = 0
    """ZeRO stage: 0 replicates everything over the data-parallel axes; 1 shards optimizer state
    and master weights; 2 also gradients; 3 also parameters (gathered for compute)."""

    data_parallel_axes: tuple[str, ...] = ("data", "fsdp")
    """Mesh axes that count as data-parallel: ZeRO shards over their product. Axes the mesh
    does not have are ignored."""

    max_replicated_fraction: float = DEFAULT_MAX_REPLICATED_FRACTION
    """Largest fraction of parameter bytes allowed to stay replicated because no dim divides
    evenly; more fails the plan, listing the five largest offenders. 1.0 disables the guard."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    pattern: str
    """Regex searched (`re.search`) in the parameter's state_dict name; anchor with ^/$."""

    spec: tuple[str | tuple[str, ...] | None, ...]
    """Per-dimension mesh axes (a PartitionSpec): None, an axis, or a tuple of axes."""

    origin: str
    """Where the rule came from, for messages: "rules[2]" or "rules[0] (preset 'gpt2')"."""

    preset: str | None = None
    """The preset this rule was expanded from. Preset rules drop axes the mesh does not have
    (a gpt2 preset on a mesh without `tensor` does no tensor parallelism); user rules may not
    name such axes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InputsConfig:
    batch_axes: tuple[str, ...] | None = None
    """Mesh axes the batch dim is split over; None means the data-parallel axes of the mesh."""

    sequence_axis: str | None = None
    """Mesh axis the sequence dim is split over (sequence parallelism); None keeps it whole."""

    batch_dim: int = 0
    """Which input dim is the batch."""

    sequence_dim: int = 1
    """Which input dim is the sequence (used only with `sequence_axis`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaleConfig:
    dynamic: bool = True
    """Dynamic loss scaling: grow the scale after `window` clean steps, halve it on overflow
    (the overflowing step is skipped). False keeps `initial_scale` fixed."""

    initial_scale: float = 2.0**16
    """Starting (or, if not dynamic, fixed) loss scale."""

    window: int = 1000
    """Clean steps before the dynamic scale doubles."""

    hysteresis: int = 2
    """Overflows tolerated before the scale is lowered (DeepSpeed's `hysteresis`)."""

    min_scale: float = 1.0
    """The dynamic scale never goes below this."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionConfig:
    param_dtype: str = "float32"
    """Dtype parameters are stored in between steps."""

    compute_dtype: str = "float32"
    """Dtype of forward/backward arithmetic (matmuls accumulate in float32 regardless)."""

    output_dtype: str = "float32"
    """Dtype of the model outputs handed back to torch (the loss, logits)."""

    master_dtype: str | None = None
    """float32 keeps a float32 master copy of low-precision params for the update; None updates
    the params in their own dtype."""

    optimizer_state_dtype: str = "float32"
    """Dtype of optimizer moments (Adam m and v)."""

    grad_reduce_dtype: str = "float32"
    """Dtype gradients are reduced (all-reduce / reduce-scatter) and accumulated in."""

    loss_scale: LossScaleConfig | None = None
    """float16 loss scaling; set automatically (dynamic) when any dtype is float16."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelsConfig:
    attention: str = "auto"
    """Scaled-dot-product attention: auto (the Pallas kernel on GPU, its XLA reference
    elsewhere), pallas, xla, or off (no substitution: the bridge's plain lowering)."""

    norm: str = "auto"
    """LayerNorm and the RMSNorm pattern (same choices)."""

    optimizer: str = "auto"
    """Fused AdamW update on each shard (same choices)."""

    loss: str = "auto"
    """Fused linear + cross-entropy, vocabulary-chunked (same choices)."""

    interpret: bool = False
    """Run Pallas kernels in interpret mode (for CPU tests)."""

    def choice(self, family: str) -> tuple[str, bool] | None:
        """(implementation, interpret) for a kernel family ("attention", "norm", "optimizer",
        "loss"); None when the config turns it off."""
        implementation = getattr(self, family)
        return None if implementation == "off" else (implementation, self.interpret)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    directory: str | None = None
    """Where Orbax writes checkpoints; None disables checkpointing."""

    save_interval_steps: int = 0
    """Save every N optimizer steps; 0 saves only when asked."""

    max_to_keep: int | None = 3
    """Checkpoints kept on disk (oldest deleted first); None keeps all."""

    async_save: bool = True
    """Write in the background; the step blocks only to copy arrays off the device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    compilation_cache_dir: str | None = "~/.cache/zerojax/jax"
    """JAX's persistent compilation cache, so a restarted job skips recompiling; None
    disables it."""

    effective_time_log: str | None = None
    """Append effective-training-time events as JSON lines to this file; None: no file."""

    report_effective_time: bool = True
    """Print where the run's time went (init, compile, checkpoints, steps) at exit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    gradient_accumulation_steps: int = 1
    """Backward passes summed before each optimizer step."""

    gradient_clipping: float | None = None
    """Clip the global gradient norm to this value before the update; None disables."""

    micro_batch_size: int | None = None
    """Examples per data-parallel rank per backward pass (DeepSpeed's
    train_micro_batch_size_per_gpu)."""

    global_batch_size: int | None = None
    """Examples per optimizer step over all ranks: micro_batch_size x
    gradient_accumulation_steps x data-parallel size (DeepSpeed's train_batch_size)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DevicesConfig:
    platform: str | None = None
    """JAX platform (cpu, gpu, tpu); None lets JAX pick."""

    num_cpu_devices: int | None = None
    """Simulated CPU devices (implies platform cpu); must be applied before JAX starts, see
    `zerojax.sharding.configure_devices`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    type: str
    """Lower-case optimizer name, one of OPTIMIZER_TYPES."""

    params: tuple[tuple[str, Any], ...] = ()
    """Hyperparameters as (name, value) pairs, in the order given (lists become tuples)."""

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
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

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Orbax checkpointing."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Gradient accumulation, clipping and batch sizes."""

    devices: DevicesConfig = field(default_factory=DevicesConfig)
    """Platform and simulated CPU device count."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Compilation cache and effective-training-time reporting."""

    optimizer: OptimizerConfig | None = None
    """Optimizer named by the config (DeepSpeed `optimizer`); None: use the torch optimizer."""

    source: str | None = None
    """File the config was read from, for messages."""

    format: str = "zerojax"
    """"zerojax" or "deepspeed": which schema the source was written in."""

    @property
    def zero_stage(self) -> int:
        return self.zero.stage

    @property
    def data_parallel_axes(self) -> tuple[str, ...]:
        """The ZeRO axes this mesh has, in mesh order."""
        return tuple(a for a in self.mesh.axis_names if a in self.zero.data_parallel_axes)

    @property
    def data_parallel_size(self) -> int:
        return math.prod(self.mesh.size(a) for a in self.data_parallel_axes)


# ----------------------------------------------------------------------------- helpers


def _fmt(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value, default=str)


def _error(path: str, value: Any, problem: str) -> ConfigError:
    return ConfigError(f"{path}={_fmt(value)}: {problem}")


def _check_keys(path: str, mapping: Mapping, allowed: tuple[str, ...]) -> None:
    for key in mapping:
        if key not in allowed:
            where = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key{hint}; allowed keys: {', '.join(allowed)}")


def _mapping(path: str, value: Any) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _error(path, value, "expected a mapping of keys to values")
    return value


def _int(path: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(path, value, "expected an integer" + (f" >= {minimum}" if minimum else ""))
    if minimum is not None and value < minimum:
        raise _error(path, value, f"expected an integer >= {minimum}")
    return value


def _float(path: str, value: Any, *, positive: bool = False, at_most: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise _error(path, value, "expected a number")
    if positive and value <= 0:
        raise _error(path, value, "expected a number > 0")
    if at_most is not None and not 0 <= value <= at_most:
        raise _error(path, value, f"expected a number between 0 and {at_most}")
    return float(value)


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _error(path, value, "expected true or false")
    return value


def _choice(path: str, value: Any, allowed: tuple, *, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if value not in allowed:
        choices = ", ".join(map(str, allowed)) + (", null" if optional else "")
        raise _error(path, value, f"allowed: {choices}")
    return value


def _axes_list(path: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(a, str) for a in items):
        raise _error(path, value, "expected a mesh axis name or a list of them")
    for i, axis in enumerate(items):
        _choice(f"{path}[{i}]", axis, MESH_AXES)
    if len(set(items)) != len(items):
        raise _error(path, value, "an axis may appear only once")
    return tuple(items)


def _read(source: str | os.PathLike) -> dict:
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    if path.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_json_pairs(path))
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{path}:{exc.lineno}:{exc.colno}: JSON syntax error: {exc.msg}"
            ) from exc
    else:
        try:
            loader = _StrictYamlLoader(text)
            loader.name = str(path)  # marks (and so duplicate-key errors) name the file
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            problem = exc.problem or "invalid YAML"
            if exc.context and exc.context_mark and exc.context_mark is not mark:
                cm = exc.context_mark
                problem += f" ({exc.context} at line {cm.line + 1}, column {cm.column + 1})"
            raise ConfigError(f"{where}: YAML syntax error: {problem}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: YAML error: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return dict(data)


def _json_pairs(path: Path):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"{path}: duplicate key {key!r}")
            seen[key] = value
        return seen

    return hook


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            mark = key_node.start_mark
            raise ConfigError(
                f"{mark.name}:{mark.line + 1}:{mark.column + 1}: duplicate key {key!r}"
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictYamlLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


# ----------------------------------------------------------------------------- sections


def _parse_mesh(raw: Any, num_devices: int) -> MeshConfig:
    raw = _mapping("mesh", raw)
    if not raw:
        raw = {"data": -1}
    _check_keys("mesh", raw, MESH_AXES)
    axes = []
    for name, size in raw.items():
        if size != -1:
            _int(f"mesh.{name}", size, minimum=1)
        axes.append((name, size))
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
            f"mesh: {product} = {known} devices, but there are {num_devices}; make the product "
            f"{num_devices} or set one axis to -1 to fill the remaining devices"
        )
    return MeshConfig(axes=tuple(axes), num_devices=num_devices)


def _stage(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise _error(path, value, "allowed: 0, 1, 2, 3")
    return value


def _parse_zero(raw_stage: Any, raw_zero: Any) -> ZeroConfig:
    zero = dict(_mapping("zero", raw_zero))
    _check_keys("zero", zero, ("stage", "data_parallel_axes", "max_replicated_fraction"))
    if raw_stage is not None:
        if "stage" in zero:
            raise ConfigError("zero_stage and zero.stage are both set; keep one")
        zero["stage"] = raw_stage
        path = "zero_stage"
    else:
        path = "zero.stage"
    kwargs = {}
    if "stage" in zero:
        kwargs["stage"] = _stage(path, zero["stage"])
    if "data_parallel_axes" in zero:
        kwargs["data_parallel_axes"] = _axes_list(
            "zero.data_parallel_axes", zero["data_parallel_axes"]
        )
    if "max_replicated_fraction" in zero:
        kwargs["max_replicated_fraction"] = _float(
            "zero.max_replicated_fraction", zero["max_replicated_fraction"], at_most=1.0
        )
    return ZeroConfig(**kwargs)


def _parse_spec(path: str, value: Any, mesh_axes: tuple[str, ...]) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise _error(
            path, value, "expected a list with one entry per dim: null, an axis, or a list of axes"
        )
    spec, used = [], set()
    for i, entry in enumerate(value):
        where = f"{path}[{i}]"
        if entry is None:
            spec.append(None)
            continue
        axes = _axes_list(where, entry)
        for axis in axes:
            if axis not in mesh_axes:
                raise _error(
                    where,
                    entry,
                    f"axis {axis!r} is not in the mesh; mesh axes: {', '.join(mesh_axes)}",
                )
            if axis in used:
                raise _error(path, list(value), f"axis {axis!r} is used by two dims")
            used.add(axis)
        spec.append(axes[0] if isinstance(entry, str) else axes)
    return tuple(spec)


def _parse_rules(raw: Any, mesh_axes: tuple[str, ...]) -> tuple[Rule, ...]:
    from zerojax.sharding.rules import PRESETS  # the sharding package imports this module

    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise _error("rules", raw, "expected a list of rules ({pattern, spec}) and preset names")
    rules = []
    for i, item in enumerate(raw):
        where = f"rules[{i}]"
        if isinstance(item, str):
            if item not in PRESETS:
                raise _error(where, item, f"unknown preset; allowed: {', '.join(PRESETS)}")
            for pattern, spec in PRESETS[item]:
                rules.append(
                    Rule(
                        pattern=pattern, spec=spec, origin=f"{where} (preset {item!r})", preset=item
                    )
                )
            continue
        if not isinstance(item, Mapping):
            raise _error(
                where,
                item,
                f"expected {{pattern: REGEX, spec: [...]}} or a preset name ({', '.join(PRESETS)})",
            )
        _check_keys(where, item, ("pattern", "spec"))
        for key in ("pattern", "spec"):
            if key not in item:
                raise ConfigError(
                    f"{where}: missing key {key!r}; a rule is "
                    "{pattern: REGEX, spec: [per-dim axes]}"
                )
        pattern = item["pattern"]
        if not isinstance(pattern, str):
            raise _error(f"{where}.pattern", pattern, "expected a regex string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"{where}.pattern: invalid regex {pattern!r}: {exc}") from exc
        spec = _parse_spec(f"{where}.spec", item["spec"], mesh_axes)
        rules.append(Rule(pattern=pattern, spec=spec, origin=where))
    return tuple(rules)


def _parse_inputs(raw: Any, mesh_axes: tuple[str, ...]) -> InputsConfig:
    raw = _mapping("inputs", raw)
    _check_keys("inputs", raw, ("batch_axes", "sequence_axis", "batch_dim", "sequence_dim"))
    kwargs = {}
    if raw.get("batch_axes") is not None:
        axes = _axes_list("inputs.batch_axes", raw["batch_axes"])
        for axis in axes:
            if axis not in mesh_axes:
                raise _error(
                    "inputs.batch_axes",
                    raw["batch_axes"],
                    f"axis {axis!r} is not in the mesh; mesh axes: {', '.join(mesh_axes)}",
                )
        kwargs["batch_axes"] = axes
    if raw.get("sequence_axis") is not None:
        kwargs["sequence_axis"] = _choice(
            "inputs.sequence_axis", raw["sequence_axis"], mesh_axes, optional=True
        )
        if kwargs["sequence_axis"] in kwargs.get("batch_axes", ()):
            raise _error(
                "inputs.sequence_axis", raw["sequence_axis"], "already used by inputs.batch_axes"
            )
    for key in ("batch_dim", "sequence_dim"):
        if key in raw:
            kwargs[key] = _int(f"inputs.{key}", raw[key], minimum=0)
    inputs = InputsConfig(**kwargs)
    if inputs.sequence_axis and inputs.batch_dim == inputs.sequence_dim:
        raise _error("inputs.sequence_dim", inputs.sequence_dim, "must differ from batch_dim")
    return inputs


_PRECISION_SHORT = {
    "params": "param_dtype",
    "compute": "compute_dtype",
    "output": "output_dtype",
    "master": "master_dtype",
    "optimizer_state": "optimizer_state_dtype",
    "grad_reduce": "grad_reduce_dtype",
}
_PRECISION_FIELDS = tuple(_PRECISION_SHORT.values())


def parse_precision(text: str, path: str = "precision") -> dict[str, str | None]:
    """Parse the one-string form "params=bfloat16,compute=bfloat16,master=float32" into
    PrecisionConfig field values (short names as above, or the full field names)."""
    values: dict[str, str | None] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise _error(
                path, text, f"{part!r} is not KEY=DTYPE; keys: {', '.join(_PRECISION_SHORT)}"
            )
        name = _PRECISION_SHORT.get(key, key if key in _PRECISION_FIELDS else None)
        if name is None:
            raise _error(path, text, f"unknown key {key!r}; allowed: {', '.join(_PRECISION_SHORT)}")
        if name in values:
            raise _error(path, text, f"{key!r} is given twice")
        values[name] = None if value.lower() in ("none", "null") else value
    return values


def _parse_loss_scale(path: str, raw: Any) -> LossScaleConfig | None:
    if raw is None:
        return None
    if raw == "dynamic":
        return LossScaleConfig()
    if not isinstance(raw, bool) and isinstance(raw, (int, float)):
        return LossScaleConfig(dynamic=False, initial_scale=_float(path, raw, positive=True))
    raw = _mapping(path, raw)
    _check_keys(path, raw, ("dynamic", "initial_scale", "window", "hysteresis", "min_scale"))
    kwargs = {}
    if "dynamic" in raw:
        kwargs["dynamic"] = _bool(f"{path}.dynamic", raw["dynamic"])
    for key in ("initial_scale", "min_scale"):
        if key in raw:
            kwargs[key] = _float(f"{path}.{key}", raw[key], positive=True)
    for key in ("window", "hysteresis"):
        if key in raw:
            kwargs[key] = _int(f"{path}.{key}", raw[key], minimum=1)
    return LossScaleConfig(**kwargs)


def _parse_precision(raw: Any) -> PrecisionConfig:
    if isinstance(raw, str):
        raw = parse_precision(raw)
    raw = _mapping("precision", raw)
    _check_keys("precision", raw, (*_PRECISION_FIELDS, "loss_scale"))
    kwargs = {}
    for key in _PRECISION_FIELDS:
        if key not in raw:
            continue
        if key == "master_dtype":
            kwargs[key] = _choice(f"precision.{key}", raw[key], ("float32",), optional=True)
        else:
            kwargs[key] = _choice(f"precision.{key}", raw[key], FLOAT_DTYPES)
    kwargs["loss_scale"] = _parse_loss_scale("precision.loss_scale", raw.get("loss_scale"))
    precision = PrecisionConfig(**kwargs)
    uses_fp16 = "float16" in (
        precision.param_dtype,
        precision.compute_dtype,
        precision.grad_reduce_dtype,
    )
    if precision.loss_scale is None and uses_fp16:
        precision = replace(precision, loss_scale=LossScaleConfig())
    if precision.loss_scale is not None and not uses_fp16:
        raise ConfigError(
            "precision.loss_scale is set but no param/compute/grad_reduce dtype is float16; "
            "loss scaling is only for float16 (remove it, or use float16)"
        )
    if precision.master_dtype == "float32" and precision.param_dtype == "float32":
        raise ConfigError(
            "precision.master_dtype='float32' with param_dtype='float32': the params already "
            "are float32 masters; set master_dtype to null or use a 16-bit param_dtype"
        )
    return precision


def _parse_kernels(raw: Any) -> KernelsConfig:
    raw = _mapping("kernels", raw)
    names = ("attention", "norm", "optimizer", "loss")
    _check_keys("kernels", raw, (*names, "interpret"))
    kwargs = {k: _choice(f"kernels.{k}", raw[k], KERNEL_IMPLEMENTATIONS) for k in names if k in raw}
    if "interpret" in raw:
        kwargs["interpret"] = _bool("kernels.interpret", raw["interpret"])
    return KernelsConfig(**kwargs)


def _parse_checkpoint(raw: Any) -> CheckpointConfig:
    raw = _mapping("checkpoint", raw)
    _check_keys(
        "checkpoint", raw, ("directory", "save_interval_steps", "max_to_keep", "async_save")
    )
    kwargs = {}
    if raw.get("directory") is not None:
        if not isinstance(raw["directory"], str) or not raw["directory"]:
            raise _error("checkpoint.directory", raw["directory"], "expected a path string")
        kwargs["directory"] = raw["directory"]
    if "save_interval_steps" in raw:
        kwargs["save_interval_steps"] = _int(
            "checkpoint.save_interval_steps", raw["save_interval_steps"], minimum=0
        )
    if "max_to_keep" in raw:
        kwargs["max_to_keep"] = (
            None
            if raw["max_to_keep"] is None
            else _int("checkpoint.max_to_keep", raw["max_to_keep"], minimum=1)
        )
    if "async_save" in raw:
        kwargs["async_save"] = _bool("checkpoint.async_save", raw["async_save"])
    return CheckpointConfig(**kwargs)


def _parse_runtime(raw: Any) -> RuntimeConfig:
    raw = _mapping("runtime", raw)
    _check_keys(
        "runtime", raw, ("compilation_cache_dir", "effective_time_log", "report_effective_time")
    )
    kwargs = {}
    for key in ("compilation_cache_dir", "effective_time_log"):
        if key in raw:
            value = raw[key]
            if value is not None and (not isinstance(value, str) or not value):
                raise _error(f"runtime.{key}", value, "expected a path string or null")
            kwargs[key] = value
    if "report_effective_time" in raw:
        kwargs["report_effective_time"] = _bool(
            "runtime.report_effective_time", raw["report_effective_time"]
        )
    return RuntimeConfig(**kwargs)


_TRAIN_KEYS = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "micro_batch_size",
    "global_batch_size",
)
_DEEPSPEED_TRAIN_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "global_batch_size": "train_batch_size",
}


def _parse_train(raw: Any, data_parallel_size: int, *, deepspeed: bool = False) -> TrainConfig:
    raw = _mapping("train", raw)
    _check_keys("train", raw, _TRAIN_KEYS)
    # Messages use the key names the user wrote: DeepSpeed's for a ds_config.json.
    path = {k: _DEEPSPEED_TRAIN_KEYS[k] if deepspeed else f"train.{k}" for k in _TRAIN_KEYS}
    kwargs = {}
    if "gradient_accumulation_steps" in raw:
        kwargs["gradient_accumulation_steps"] = _int(
            path["gradient_accumulation_steps"], raw["gradient_accumulation_steps"], minimum=1
        )
    if raw.get("gradient_clipping") is not None:
        kwargs["gradient_clipping"] = _float(
            path["gradient_clipping"], raw["gradient_clipping"], positive=True
        )
    for key in ("micro_batch_size", "global_batch_size"):
        if raw.get(key) is not None:
            kwargs[key] = _int(path[key], raw[key], minimum=1)
    train = TrainConfig(**kwargs)
    return _resolve_batch_sizes(train, data_parallel_size, path)


def _resolve_batch_sizes(train: TrainConfig, dp: int, path: dict[str, str]) -> TrainConfig:
    """Check global = micro x accumulation x data-parallel size; derive the one left out."""
    micro, accum = train.micro_batch_size, train.gradient_accumulation_steps
    total = train.global_batch_size
    g, m, a = (
        path["global_batch_size"],
        path["micro_batch_size"],
        path["gradient_accumulation_steps"],
    )
    if micro is not None and total is not None:
        if micro * accum * dp != total:
            raise ConfigError(
                f"{g}={total} != {m}={micro} x {a}={accum} x data-parallel size {dp} "
                f"(= {micro * accum * dp}); batch sizes must multiply out"
            )
    elif total is not None:
        if total % (accum * dp):
            raise ConfigError(
                f"{g}={total} is not divisible by {a}={accum} x data-parallel size {dp} "
                f"(= {accum * dp}); batch sizes must multiply out"
            )
        train = replace(train, micro_batch_size=total // (accum * dp))
    elif micro is not None:
        train = replace(train, global_batch_size=micro * accum * dp)
    return train


def _parse_devices(raw: Any) -> DevicesConfig:
    raw = _mapping("devices", raw)
    _check_keys("devices", raw, ("platform", "num_cpu_devices"))
    platform = _choice("devices.platform", raw.get("platform"), PLATFORMS, optional=True)
    num = raw.get("num_cpu_devices")
    if num is not None:
        num = _int("devices.num_cpu_devices", num, minimum=1)
        if platform not in (None, "cpu"):
            raise _error(
                "devices.num_cpu_devices", num, f"only applies to platform 'cpu', not {platform!r}"
            )
        platform = "cpu"
    return DevicesConfig(platform=platform, num_cpu_devices=num)


def _parse_optimizer(raw: Any, path: str = "optimizer") -> OptimizerConfig | None:
    if raw is None:
        return None
    raw = _mapping(path, raw)
    _check_keys(path, raw, ("type", "params"))
    if not isinstance(raw.get("type"), str):
        raise _error(f"{path}.type", raw.get("type"), f"allowed: {', '.join(OPTIMIZER_TYPES)}")
    kind = _choice(f"{path}.type", raw["type"].lower(), OPTIMIZER_TYPES)
    params = dict(_mapping(f"{path}.params", raw.get("params")))
    for key, value in params.items():
        if not isinstance(value, (int, float, bool, str, list, tuple)) or (
            isinstance(value, (list, tuple)) and not all(isinstance(v, (int, float)) for v in value)
        ):
            raise _error(
                f"{path}.params.{key}",
                value,
                "expected a number, bool, string or a list of numbers",
            )
    return OptimizerConfig(
        type=kind,
        params=tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()),
    )


# ----------------------------------------------------------------------------- loading

_TOP_LEVEL = (
    "mesh",
    "zero_stage",
    "zero",
    "rules",
    "inputs",
    "precision",
    "kernels",
    "checkpoint",
    "train",
    "devices",
    "runtime",
    "optimizer",
)


def _device_count(devices: DevicesConfig, num_devices: int | None) -> int:
    if num_devices is not None:
        return _int("num_devices", num_devices, minimum=1)
    if devices.num_cpu_devices is not None:
        return devices.num_cpu_devices
    import jax  # initialises JAX's backends: the mesh must be checked against real devices

    try:
        return len(jax.devices(devices.platform)) if devices.platform else jax.device_count()
    except RuntimeError as exc:
        raise _error(
            "devices.platform", devices.platform, f"JAX has no such backend: {exc}"
        ) from exc


def _build(raw: Mapping, *, num_devices: int | None, source: str | None, fmt: str) -> Config:
    _check_keys("", raw, _TOP_LEVEL)
    devices = _parse_devices(raw.get("devices"))
    mesh = _parse_mesh(raw.get("mesh"), _device_count(devices, num_devices))
    zero = _parse_zero(raw.get("zero_stage"), raw.get("zero"))
    config = Config(mesh=mesh, zero=zero, devices=devices, source=source, format=fmt)
    return replace(
        config,
        rules=_parse_rules(raw.get("rules"), mesh.axis_names),
        inputs=_parse_inputs(raw.get("inputs"), mesh.axis_names),
        precision=_parse_precision(raw.get("precision")),
        kernels=_parse_kernels(raw.get("kernels")),
        checkpoint=_parse_checkpoint(raw.get("checkpoint")),
        train=_parse_train(
            raw.get("train"), config.data_parallel_size, deepspeed=fmt == "deepspeed"
        ),
        runtime=_parse_runtime(raw.get("runtime")),
        optimizer=_parse_optimizer(raw.get("optimizer")),
    )


def load_config(
    source: str | os.PathLike | Mapping[str, Any] | Config,
    *,
    num_devices: int | None = None,
) -> Config:
    """Load and validate a zerojax config (YAML or JSON file, or a dict) or a DeepSpeed
    `ds_config.json`; return a frozen `Config`.

    `num_devices` is the device count the mesh must fill; by default `devices.num_cpu_devices`
    or, failing that, `jax.device_count()` (which starts JAX's backends). Raises `ConfigError`
    for any invalid value; warns (`ConfigWarning`) for each DeepSpeed key zerojax ignores.

        >>> cfg = load_config({"mesh": {"data": -1}, "zero_stage": 3}, num_devices=8)
        >>> cfg.mesh.shape, cfg.zero_stage
        ((8,), 3)
    """
    if isinstance(source, Config):
        return source
    if isinstance(source, Mapping):
        raw, where = dict(source), None
    elif isinstance(source, (str, os.PathLike)):
        raw, where = _read(source), os.fspath(source)
    else:
        raise ConfigError(
            f"load_config expects a path, a dict or a Config, got {type(source).__name__}"
        )
    if _is_deepspeed(raw):
        return _build(
            deepspeed_to_zerojax(raw), num_devices=num_devices, source=where, fmt="deepspeed"
        )
    return _build(raw, num_devices=num_devices, source=where, fmt="zerojax")


_DEEPSPEED_ONLY_KEYS = (
    "zero_optimization",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "fp16",
    "bf16",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "steps_per_print",
    "wall_clock_breakdown",
    "scheduler",
    "amp",
    "activation_checkpointing",
    "zero_allow_untested_optimizer",
)


def _is_deepspeed(raw: Mapping) -> bool:
    deepspeed = [key for key in _DEEPSPEED_ONLY_KEYS if key in raw]
    native = [key for key in _TOP_LEVEL if key in raw and key != "optimizer"]
    if deepspeed and native:
        raise ConfigError(
            f"the config mixes DeepSpeed keys ({', '.join(deepspeed)}) with zerojax keys "
            f"({', '.join(native)}); in a DeepSpeed config put zerojax sections under a "
            "'zerojax' key, or write the whole config in zerojax form"
        )
    return bool(deepspeed)


# ----------------------------------------------------------------------------- DeepSpeed

_DS_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def _ignored(key: str, why: str = "") -> None:
    warnings.warn(
        f"DeepSpeed key {key!r} is not supported by zerojax and is ignored"
        + (f" ({why})" if why else ""),
        ConfigWarning,
        stacklevel=4,
    )


def _ds_value(path: str, value: Any) -> Any:
    if value == "auto":
        raise _error(path, value, "'auto' is filled in by the Hugging Face Trainer; give the value")
    return value


def deepspeed_to_zerojax(ds: Mapping[str, Any]) -> dict[str, Any]:
    """Map a DeepSpeed config onto the zerojax schema (a raw dict for `load_config`).

    Understood: zero_optimization.stage, bf16 {enabled, bf16_master_weights_and_grads,
    bf16_optimizer_states}, fp16 {enabled, loss_scale, initial_scale_power, loss_scale_window,
    hysteresis, min_loss_scale, fp16_master_weights_and_grads}, data_types.grad_accum_dtype,
    communication_data_type, gradient_accumulation_steps, gradient_clipping,
    train_micro_batch_size_per_gpu, train_batch_size, optimizer {type, params}, and a `zerojax`
    section holding native sections (mesh, rules, inputs, kernels, checkpoint, devices). Each
    other key raises a `ConfigWarning` naming it. The mesh defaults to {data: -1}: DeepSpeed
    data parallelism over every device.
    """
    raw: dict[str, Any] = {}
    for key in ds:
        if key not in _DS_HANDLED:
            _ignored(key)

    zero_opt = _mapping("zero_optimization", ds.get("zero_optimization"))
    for key, value in zero_opt.items():
        if key == "stage":
            stage = _stage("zero_optimization.stage", _ds_value("zero_optimization.stage", value))
            raw["zero"] = {"stage": stage}
        else:
            _ignored(
                f"zero_optimization.{key}",
                "XLA schedules and buckets communication itself"
                if "bucket" in key or "overlap" in key or "contiguous" in key
                else "",
            )

    bf16 = _mapping("bf16", ds.get("bf16"))
    fp16 = _mapping("fp16", ds.get("fp16"))
    bf16_on = _bool("bf16.enabled", _ds_value("bf16.enabled", bf16.get("enabled", False)))
    fp16_on = _bool("fp16.enabled", _ds_value("fp16.enabled", fp16.get("enabled", False)))
    if bf16_on and fp16_on:
        raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")
    precision: dict[str, Any] = {}
    if bf16_on:
        pure = _bool(
            "bf16.bf16_master_weights_and_grads", bf16.get("bf16_master_weights_and_grads", False)
        )
        states16 = _bool("bf16.bf16_optimizer_states", bf16.get("bf16_optimizer_states", False))
        precision = {
            "param_dtype": "bfloat16",
            "compute_dtype": "bfloat16",
            "master_dtype": None if pure else "float32",
            "grad_reduce_dtype": "bfloat16" if pure else "float32",
            "optimizer_state_dtype": "bfloat16" if states16 else "float32",
        }
        for key in bf16:
            if key not in ("enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states"):
                _ignored(f"bf16.{key}")
    elif fp16_on:
        pure = _bool(
            "fp16.fp16_master_weights_and_grads", fp16.get("fp16_master_weights_and_grads", False)
        )
        loss_scale = _float(
            "fp16.loss_scale", _ds_value("fp16.loss_scale", fp16.get("loss_scale", 0))
        )
        if loss_scale < 0:
            raise _error("fp16.loss_scale", loss_scale, "allowed: 0 (dynamic) or a scale > 0")
        power = _int("fp16.initial_scale_power", fp16.get("initial_scale_power", 16), minimum=0)
        precision = {
            "param_dtype": "float16",
            "compute_dtype": "float16",
            "master_dtype": None if pure else "float32",
            "grad_reduce_dtype": "float16" if pure else "float32",
            "loss_scale": {
                "dynamic": loss_scale == 0,
                "initial_scale": float(2**power) if loss_scale == 0 else loss_scale,
                "window": _int(
                    "fp16.loss_scale_window", fp16.get("loss_scale_window", 1000), minimum=1
                ),
                "hysteresis": _int("fp16.hysteresis", fp16.get("hysteresis", 2), minimum=1),
                "min_scale": _float(
                    "fp16.min_loss_scale", fp16.get("min_loss_scale", 1.0), positive=True
                ),
            },
        }
        for key in fp16:
            if key not in (
                "enabled",
                "fp16_master_weights_and_grads",
                "loss_scale",
                "initial_scale_power",
                "loss_scale_window",
                "hysteresis",
                "min_loss_scale",
            ):
                _ignored(f"fp16.{key}")
    for key, value in _mapping("data_types", ds.get("data_types")).items():
        if key == "grad_accum_dtype" and value is not None:
            precision["grad_reduce_dtype"] = _choice(
                "data_types.grad_accum_dtype", _DS_DTYPES.get(value, value), FLOAT_DTYPES
            )
        else:
            _ignored(f"data_types.{key}")
    if ds.get("communication_data_type") is not None:
        value = ds["communication_data_type"]
        precision["grad_reduce_dtype"] = _choice(
            "communication_data_type", _DS_DTYPES.get(value, value), FLOAT_DTYPES
        )
    if precision:
        if precision.get("master_dtype") is None and precision.get("param_dtype") is None:
            precision.pop("master_dtype", None)
        raw["precision"] = precision

    train: dict[str, Any] = {}
    for ds_key, key in (
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
        ("train_micro_batch_size_per_gpu", "micro_batch_size"),
        ("train_batch_size", "global_batch_size"),
    ):
        if ds.get(ds_key) is not None:
            train[key] = _ds_value(ds_key, ds[ds_key])
    if ds.get("gradient_clipping") not in (None, 0, 0.0):  # DeepSpeed: 0 disables clipping
        train["gradient_clipping"] = _ds_value("gradient_clipping", ds["gradient_clipping"])
    if train:
        raw["train"] = train

    if ds.get("optimizer") is not None:
        opt = _mapping("optimizer", ds["optimizer"])
        _check_keys("optimizer", opt, ("type", "params"))
        params = dict(_mapping("optimizer.params", opt.get("params")))
        kind = opt.get("type")
        # DeepSpeed's Adam is AdamW unless adam_w_mode is false (deepspeed.ops.adam.FusedAdam).
        adam_w_mode = params.pop("adam_w_mode", True)
        if isinstance(kind, str) and kind.lower() == "adam" and adam_w_mode:
            kind = "adamw"
        for key in ("torch_adam", "fused"):
            if key in params:
                params.pop(key)
                _ignored(f"optimizer.params.{key}")
        raw["optimizer"] = {"type": kind, "params": params}

    native = _mapping("zerojax", ds.get("zerojax"))
    _check_keys(
        "zerojax",
        native,
        ("mesh", "rules", "inputs", "kernels", "checkpoint", "devices", "runtime"),
    )
    raw.update(native)
    return raw


_DS_HANDLED = (
    "zero_optimization",
    "bf16",
    "fp16",
    "data_types",
    "communication_data_type",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "optimizer",
    "zerojax",
)
