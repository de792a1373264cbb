"""One parser per section of the zerojax schema: raw (YAML/JSON) values -> schema dataclasses.

Every key a parser accepts is a field of its dataclass; unknown keys are errors with a
did-you-mean hint.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from zerojax.config.checks import (
    ConfigError,
    ConfigWarning,
    as_axes,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_mapping,
    as_stage,
    check_keys,
    error,
)
from zerojax.config.presets import PRESETS
from zerojax.config.schema import (
    FLOAT_DTYPES,
    KERNEL_IMPLEMENTATIONS,
    MESH_AXES,
    OFFLOAD_PLACES,
    OPTIMIZER_PARAMS,
    OPTIMIZER_TYPES,
    PLATFORMS,
    REMAT_POLICIES,
    SEQUENCE_PARALLEL_ATTENTION,
    ActivationCheckpointingConfig,
    CheckpointConfig,
    DevicesConfig,
    InputsConfig,
    KernelsConfig,
    LossScaleConfig,
    MeshConfig,
    MoeConfig,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    Rule,
    RuntimeConfig,
    SequenceParallelConfig,
    TrainConfig,
    ZeroConfig,
)


def parse_mesh(raw: Any, num_devices: int) -> MeshConfig:
    raw = as_mapping("mesh", raw)
    if not raw:
        raw = {"data": -1}
    check_keys("mesh", raw, MESH_AXES)
    axes = []
    for name, size in raw.items():
        if size != -1:
            as_int(f"mesh.{name}", size, minimum=1)
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


def parse_zero(raw_stage: Any, raw_zero: Any) -> ZeroConfig:
    zero = dict(as_mapping("zero", raw_zero))
    check_keys("zero", zero, ("stage", "data_parallel_axes", "max_replicated_fraction"))
    if raw_stage is not None:
        if "stage" in zero:
            raise ConfigError("zero_stage and zero.stage are both set; keep one")
        zero["stage"] = raw_stage
        path = "zero_stage"
    else:
        path = "zero.stage"
    kwargs = {}
    if "stage" in zero:
        kwargs["stage"] = as_stage(path, zero["stage"])
    if "data_parallel_axes" in zero:
        kwargs["data_parallel_axes"] = as_axes(
            "zero.data_parallel_axes", zero["data_parallel_axes"]
        )
    if "max_replicated_fraction" in zero:
        kwargs["max_replicated_fraction"] = as_float(
            "zero.max_replicated_fraction", zero["max_replicated_fraction"], at_most=1.0
        )
    return ZeroConfig(**kwargs)


def parse_spec(path: str, value: Any, mesh_axes: tuple[str, ...]) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise error(
            path, value, "expected a list with one entry per dim: null, an axis, or a list of axes"
        )
    spec, used = [], set()
    for i, entry in enumerate(value):
        where = f"{path}[{i}]"
        if entry is None:
            spec.append(None)
            continue
        axes = as_axes(where, entry)
        for axis in axes:
            if axis not in mesh_axes:
                raise error(
                    where,
                    entry,
                    f"axis {axis!r} is not in the mesh; mesh axes: {', '.join(mesh_axes)}",
                )
            if axis in used:
                raise error(path, list(value), f"axis {axis!r} is used by two dims")
            used.add(axis)
        spec.append(axes[0] if isinstance(entry, str) else axes)
    return tuple(spec)


def parse_rules(raw: Any, mesh_axes: tuple[str, ...]) -> tuple[Rule, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise error("rules", raw, "expected a list of rules ({pattern, spec}) and preset names")
    rules = []
    for i, item in enumerate(raw):
        where = f"rules[{i}]"
        if isinstance(item, str):
            if item not in PRESETS:
                raise error(where, item, f"unknown preset; allowed: {', '.join(PRESETS)}")
            for pattern, spec in PRESETS[item]:
                rules.append(
                    Rule(
                        pattern=pattern, spec=spec, origin=f"{where} (preset {item!r})", preset=item
                    )
                )
            continue
        if not isinstance(item, Mapping):
            raise error(
                where,
                item,
                f"expected {{pattern: REGEX, spec: [...]}} or a preset name ({', '.join(PRESETS)})",
            )
        check_keys(where, item, ("pattern", "spec"))
        for key in ("pattern", "spec"):
            if key not in item:
                raise ConfigError(
                    f"{where}: missing key {key!r}; a rule is "
                    "{pattern: REGEX, spec: [per-dim axes]}"
                )
        pattern = item["pattern"]
        if not isinstance(pattern, str):
            raise error(f"{where}.pattern", pattern, "expected a regex string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"{where}.pattern: invalid regex {pattern!r}: {exc}") from exc
        spec = parse_spec(f"{where}.spec", item["spec"], mesh_axes)
        rules.append(Rule(pattern=pattern, spec=spec, origin=where))
    return tuple(rules)


def parse_inputs(raw: Any, mesh_axes: tuple[str, ...]) -> InputsConfig:
    raw = as_mapping("inputs", raw)
    check_keys("inputs", raw, ("batch_axes", "sequence_axis", "batch_dim", "sequence_dim"))
    kwargs = {}
    if raw.get("batch_axes") is not None:
        axes = as_axes("inputs.batch_axes", raw["batch_axes"])
        for axis in axes:
            if axis not in mesh_axes:
                raise error(
                    "inputs.batch_axes",
                    raw["batch_axes"],
                    f"axis {axis!r} is not in the mesh; mesh axes: {', '.join(mesh_axes)}",
                )
        kwargs["batch_axes"] = axes
    if raw.get("sequence_axis") is not None:
        kwargs["sequence_axis"] = as_choice(
            "inputs.sequence_axis", raw["sequence_axis"], mesh_axes, optional=True
        )
        if kwargs["sequence_axis"] in kwargs.get("batch_axes", ()):
            raise error(
                "inputs.sequence_axis", raw["sequence_axis"], "already used by inputs.batch_axes"
            )
    for key in ("batch_dim", "sequence_dim"):
        if key in raw:
            kwargs[key] = as_int(f"inputs.{key}", raw[key], minimum=0)
    inputs = InputsConfig(**kwargs)
    if inputs.sequence_axis and inputs.batch_dim == inputs.sequence_dim:
        raise error("inputs.sequence_dim", inputs.sequence_dim, "must differ from batch_dim")
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
            raise error(
                path, text, f"{part!r} is not KEY=DTYPE; keys: {', '.join(_PRECISION_SHORT)}"
            )
        name = _PRECISION_SHORT.get(key, key if key in _PRECISION_FIELDS else None)
        if name is None:
            raise error(path, text, f"unknown key {key!r}; allowed: {', '.join(_PRECISION_SHORT)}")
        if name in values:
            raise error(path, text, f"{key!r} is given twice")
        values[name] = None if value.lower() in ("none", "null") else value
    return values


def parse_loss_scale(path: str, raw: Any) -> LossScaleConfig | None:
    if raw is None:
        return None
    if raw == "dynamic":
        return LossScaleConfig()
    if not isinstance(raw, bool) and isinstance(raw, (int, float)):
        return LossScaleConfig(dynamic=False, initial_scale=as_float(path, raw, positive=True))
    raw = as_mapping(path, raw)
    check_keys(path, raw, ("dynamic", "initial_scale", "window", "hysteresis", "min_scale"))
    kwargs = {}
    if "dynamic" in raw:
        kwargs["dynamic"] = as_bool(f"{path}.dynamic", raw["dynamic"])
    for key in ("initial_scale", "min_scale"):
        if key in raw:
            kwargs[key] = as_float(f"{path}.{key}", raw[key], positive=True)
    for key in ("window", "hysteresis"):
        if key in raw:
            kwargs[key] = as_int(f"{path}.{key}", raw[key], minimum=1)
    return LossScaleConfig(**kwargs)


def parse_precision_section(raw: Any) -> PrecisionConfig:
    if isinstance(raw, str):
        raw = parse_precision(raw)
    raw = as_mapping("precision", raw)
    check_keys("precision", raw, (*_PRECISION_FIELDS, "loss_scale"))
    kwargs = {}
    for key in _PRECISION_FIELDS:
        if key not in raw:
            continue
        if key == "master_dtype":
            kwargs[key] = as_choice(f"precision.{key}", raw[key], ("float32",), optional=True)
        else:
            kwargs[key] = as_choice(f"precision.{key}", raw[key], FLOAT_DTYPES)
    kwargs["loss_scale"] = parse_loss_scale("precision.loss_scale", raw.get("loss_scale"))
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


def parse_kernels(raw: Any) -> KernelsConfig:
    raw = as_mapping("kernels", raw)
    names = ("attention", "norm", "optimizer", "loss")
    check_keys("kernels", raw, (*names, "interpret"))
    kwargs = {
        k: as_choice(f"kernels.{k}", raw[k], KERNEL_IMPLEMENTATIONS) for k in names if k in raw
    }
    if "interpret" in raw:
        kwargs["interpret"] = as_bool("kernels.interpret", raw["interpret"])
    return KernelsConfig(**kwargs)


def parse_moe(raw: Any) -> MoeConfig:
    raw = as_mapping("moe", raw)
    check_keys("moe", raw, ("capacity_factor",))
    factor = raw.get("capacity_factor")
    if factor is not None:
        factor = as_float("moe.capacity_factor", factor, positive=True)
    return MoeConfig(capacity_factor=factor)


def parse_sequence_parallel(
    raw: Any, mesh_axes: tuple[str, ...], inputs: InputsConfig
) -> tuple[SequenceParallelConfig, InputsConfig]:
    """The section, and `inputs` with its sequence dim split over the section's axis."""
    if raw is None:
        return SequenceParallelConfig(), inputs
    raw = as_mapping("sequence_parallel", raw)
    check_keys("sequence_parallel", raw, ("axis", "attention", "modules"))
    axis = raw.get("axis", "sequence")
    if axis not in mesh_axes:
        raise error(
            "sequence_parallel.axis",
            axis,
            f"not in the mesh; mesh axes: {', '.join(mesh_axes)} (add it to mesh:, e.g. "
            "mesh: {data: 2, sequence: 4})",
        )
    attention = as_choice(
        "sequence_parallel.attention", raw.get("attention", "auto"), SEQUENCE_PARALLEL_ATTENTION
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
            f"contains the sequence-parallel axis {axis!r}; it splits the sequence, not the batch",
        )
    modules = raw.get("modules") or ()
    if isinstance(modules, str) or not isinstance(modules, (list, tuple)):
        raise error("sequence_parallel.modules", modules, "expected a list of module path regexes")
    for i, pattern in enumerate(modules):
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ConfigError(
                f"sequence_parallel.modules[{i}]: invalid module path regex {pattern!r}: {exc}"
            ) from exc
    section = SequenceParallelConfig(axis=axis, attention=attention, modules=tuple(modules))
    if modules:
        return section, inputs  # the split starts inside the modules, not at the inputs
    return section, replace(inputs, sequence_axis=axis)


def parse_activation_checkpointing(raw: Any) -> ActivationCheckpointingConfig:
    raw = as_mapping("activation_checkpointing", raw)
    check_keys("activation_checkpointing", raw, ("modules", "torch_checkpoint"))
    modules = []
    for pattern, policy in as_mapping(
        "activation_checkpointing.modules", raw.get("modules")
    ).items():
        where = f"activation_checkpointing.modules[{pattern!r}]"
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ConfigError(f"{where}: invalid module path regex: {exc}") from exc
        modules.append((pattern, as_choice(where, policy, REMAT_POLICIES)))
    kwargs = {"modules": tuple(modules)}
    if "torch_checkpoint" in raw:
        kwargs["torch_checkpoint"] = as_choice(
            "activation_checkpointing.torch_checkpoint", raw["torch_checkpoint"], REMAT_POLICIES
        )
    return ActivationCheckpointingConfig(**kwargs)


def parse_offload(raw: Any, zero_stage: int, precision: PrecisionConfig) -> OffloadConfig:
    """`offload: {optimizer, master, params, grads}`, each device or host. Host placement needs
    ZeRO stage >= 1 (as DeepSpeed's offload_optimizer does: what moves to the host is each
    rank's ZeRO shard) and master weights to move; host gradients feed the host update (so
    need the optimizer state there), host parameters need stage 3 and host gradients."""
    raw = as_mapping("offload", raw)
    check_keys("offload", raw, ("optimizer", "master", "params", "grads"))
    kwargs = {key: as_choice(f"offload.{key}", value, OFFLOAD_PLACES) for key, value in raw.items()}
    offload = OffloadConfig(**kwargs)
    if offload.host_states and zero_stage == 0:
        raise error(
            f"offload.{offload.host_states[0]}",
            "host",
            "needs ZeRO stage 1, 2 or 3 (as DeepSpeed's offload_optimizer does: each rank "
            "offloads its own shard of the state); set zero_stage to 1 or more",
        )
    keeps_master = precision.master_dtype is not None
    if offload.grads == "host" and (
        offload.optimizer != "host" or (keeps_master and offload.master != "host")
    ):
        raise error(
            "offload.grads",
            "host",
            "gradients go to the host for the host-side update (ZeRO-Offload): it needs "
            "offload.optimizer: host (and master: host where the precision keeps masters)",
        )
    if offload.params == "host" and (zero_stage < 3 or offload.grads != "host"):
        raise error(
            "offload.params",
            "host",
            "parameter offload (ZeRO-Infinity's CPU tier) keeps ZeRO-3's parameter shards on "
            "the host and brings each in where an op reads it; it needs zero_stage 3 and the "
            "update on the host: offload.optimizer, offload.grads (and offload.master where "
            "the precision keeps masters) set to host",
        )
    if offload.master == "host" and not keeps_master:
        raise error(
            "offload.master",
            "host",
            "the precision policy keeps no master weights (precision.master_dtype is null: "
            "the params are what the optimizer updates); remove the key, or keep float32 "
            "masters (precision master=float32 with 16-bit params)",
        )
    return offload


def parse_checkpoint(raw: Any) -> CheckpointConfig:
    raw = as_mapping("checkpoint", raw)
    check_keys("checkpoint", raw, ("directory", "save_interval_steps", "max_to_keep", "async_save"))
    kwargs = {}
    if raw.get("directory") is not None:
        if not isinstance(raw["directory"], str) or not raw["directory"]:
            raise error("checkpoint.directory", raw["directory"], "expected a path string")
        kwargs["directory"] = raw["directory"]
    if "save_interval_steps" in raw:
        kwargs["save_interval_steps"] = as_int(
            "checkpoint.save_interval_steps", raw["save_interval_steps"], minimum=0
        )
    if "max_to_keep" in raw:
        kwargs["max_to_keep"] = (
            None
            if raw["max_to_keep"] is None
            else as_int("checkpoint.max_to_keep", raw["max_to_keep"], minimum=1)
        )
    if "async_save" in raw:
        kwargs["async_save"] = as_bool("checkpoint.async_save", raw["async_save"])
    return CheckpointConfig(**kwargs)


def parse_runtime(raw: Any) -> RuntimeConfig:
    raw = as_mapping("runtime", raw)
    check_keys(
        "runtime", raw, ("compilation_cache_dir", "effective_time_log", "report_effective_time")
    )
    kwargs = {}
    for key in ("compilation_cache_dir", "effective_time_log"):
        if key in raw:
            value = raw[key]
            if value is not None and (not isinstance(value, str) or not value):
                raise error(f"runtime.{key}", value, "expected a path string or null")
            kwargs[key] = value
    if "report_effective_time" in raw:
        kwargs["report_effective_time"] = as_bool(
            "runtime.report_effective_time", raw["report_effective_time"]
        )
    return RuntimeConfig(**kwargs)


_TRAIN_KEYS = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "micro_batch_size",
    "global_batch_size",
    "patch_clip_grad_norm",
)
_DEEPSPEED_TRAIN_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "global_batch_size": "train_batch_size",
    "patch_clip_grad_norm": "zerojax.train.patch_clip_grad_norm",
}


def parse_train(raw: Any, data_parallel_size: int, *, deepspeed: bool = False) -> TrainConfig:
    raw = as_mapping("train", raw)
    check_keys("train", raw, _TRAIN_KEYS)
    # Messages use the key names the user wrote: DeepSpeed's for a ds_config.json.
    path = {k: _DEEPSPEED_TRAIN_KEYS[k] if deepspeed else f"train.{k}" for k in _TRAIN_KEYS}
    kwargs = {}
    if "gradient_accumulation_steps" in raw:
        kwargs["gradient_accumulation_steps"] = as_int(
            path["gradient_accumulation_steps"], raw["gradient_accumulation_steps"], minimum=1
        )
    if raw.get("gradient_clipping") is not None:
        kwargs["gradient_clipping"] = as_float(
            path["gradient_clipping"], raw["gradient_clipping"], positive=True
        )
    for key in ("micro_batch_size", "global_batch_size"):
        if raw.get(key) is not None:
            kwargs[key] = as_int(path[key], raw[key], minimum=1)
    if "patch_clip_grad_norm" in raw:
        # Checked as before, so an old config still loads; it no longer does anything.
        as_bool(path["patch_clip_grad_norm"], raw["patch_clip_grad_norm"])
        warnings.warn(
            f"{path['patch_clip_grad_norm']}: no longer needed and without effect: "
            "torch.nn.utils.clip_grad_norm_ runs on the shards as it is (gradients are live "
            "tensors); remove the key",
            ConfigWarning,
            stacklevel=2,
        )
    train = TrainConfig(**kwargs)
    train = _resolve_batch_sizes(train, data_parallel_size, path)
    given = [path[k] for k in ("micro_batch_size", "global_batch_size") if raw.get(k) is not None]
    if given:
        warnings.warn(
            f"{' and '.join(given)}: checked to multiply out with gradient accumulation and the "
            "data-parallel size, and otherwise without effect: zerojax does not load your data, "
            "so the batch your loader yields is the batch that trains",
            ConfigWarning,
            stacklevel=4,
        )
    return train


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


def parse_devices(raw: Any) -> DevicesConfig:
    raw = as_mapping("devices", raw)
    check_keys("devices", raw, ("platform", "num_cpu_devices"))
    platform = as_choice("devices.platform", raw.get("platform"), PLATFORMS, optional=True)
    num = raw.get("num_cpu_devices")
    if num is not None:
        num = as_int("devices.num_cpu_devices", num, minimum=1)
        if platform not in (None, "cpu"):
            raise error(
                "devices.num_cpu_devices", num, f"only applies to platform 'cpu', not {platform!r}"
            )
        platform = "cpu"
    return DevicesConfig(platform=platform, num_cpu_devices=num)


def parse_optimizer(raw: Any, path: str = "optimizer") -> OptimizerConfig | None:
    """`{type, params}`: a torch optimizer class (case-insensitive) and its constructor's
    keyword arguments. Keys torch accepts but zerojax does not run are errors here, not at the
    first step."""
    if raw is None:
        return None
    raw = as_mapping(path, raw)
    check_keys(path, raw, ("type", "params"))
    if not isinstance(raw.get("type"), str):
        raise error(f"{path}.type", raw.get("type"), f"allowed: {', '.join(OPTIMIZER_TYPES)}")
    kind = as_choice(f"{path}.type", raw["type"].lower(), OPTIMIZER_TYPES)
    params = as_mapping(f"{path}.params", raw.get("params"))
    check_keys(f"{path}.params", params, OPTIMIZER_PARAMS[kind])
    checked = {}
    for key, value in params.items():
        where = f"{path}.params.{key}"
        if key in ("amsgrad", "maximize", "nesterov"):
            checked[key] = as_bool(where, value)
        elif key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise error(where, value, "expected [beta1, beta2], each in [0, 1)")
            checked[key] = tuple(_unit_interval(f"{where}[{i}]", b) for i, b in enumerate(value))
        else:  # lr, eps, weight_decay, momentum, dampening
            checked[key] = as_float(where, value)
            if checked[key] < 0:
                raise error(where, value, "expected a number >= 0")
    return OptimizerConfig(type=kind, params=tuple(checked.items()))


def _unit_interval(path: str, value: Any) -> float:
    value = as_float(path, value)
    if not 0 <= value < 1:
        raise error(path, value, "expected a number in [0, 1)")
    return value
