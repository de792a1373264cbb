"""A config file's sections -> the schema dataclasses: the file's shape turned into constructor
calls, nothing more.

The dataclasses check their own values (and `Config` the rules that span sections), so a parser
here only reads what a file writes differently from the dataclass: a mesh as a mapping, rules
with presets, the one-string precision, a loss scale given as "dynamic" or a number, obsolete
keys. Every key a section accepts is a field of its dataclass (`schema.file_keys`); unknown
keys are errors with a did-you-mean hint.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from zerojax.config.checks import (
    ConfigError,
    ConfigWarning,
    as_bool,
    as_mapping,
    check_keys,
    error,
    keys_written_as,
    render,
    written,
)
from zerojax.config.presets import PRESETS
from zerojax.config.schema import (
    ActivationCheckpointingConfig,
    Config,
    LossScaleConfig,
    MeshConfig,
    OptimizerConfig,
    PrecisionConfig,
    Rule,
    SequenceParallelConfig,
    TrainConfig,
    ZeroConfig,
    file_keys,
)

OBSOLETE_TRAIN_KEYS = ("patch_clip_grad_norm",)
"""`train` keys that still load (checked, with a warning) but no longer do anything."""


def _keys(path: str, raw: Any, cls: type, *, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The section's mapping, each key a file key of `cls` (or one of `extra`)."""
    raw = as_mapping(path, raw)
    check_keys(path, raw, (*file_keys(cls), *extra))
    return dict(raw)


def section_class(name: str) -> type:
    """The dataclass of `Config`'s section `name` ("kernels" -> KernelsConfig)."""
    for f in fields(Config):
        if f.name == name and isinstance(f.default_factory, type):
            return f.default_factory
    raise KeyError(name)


def parse_section(name: str, raw: Any) -> Any:
    """Section `name` of a file: its own parser (`PARSERS`), else its keys as the dataclass's
    keyword arguments."""
    if name in PARSERS:
        return PARSERS[name](raw)
    cls = section_class(name)
    return cls(**_keys(name, raw, cls))


def parse_mesh(raw: Any, num_devices: int) -> MeshConfig:
    """`mesh: {axis: size, ...}` in order, -1 filling the devices left; {} is {data: -1}."""
    return MeshConfig(axes=tuple(as_mapping("mesh", raw).items()), num_devices=num_devices)


def parse_zero(raw_stage: Any, raw_zero: Any) -> ZeroConfig:
    """The `zero` section, its stage also given as the top-level `zero_stage`."""
    zero = _keys("zero", raw_zero, ZeroConfig)
    if raw_stage is None:
        return ZeroConfig(**zero)
    if "stage" in zero:
        raise ConfigError("zero_stage and zero.stage are both set; keep one")
    with keys_written_as({"zero.stage": "zero_stage"}):
        return ZeroConfig(**zero, stage=raw_stage)


def parse_rules(raw: Any) -> tuple[Rule, ...]:
    """`rules:`, a list of {pattern, spec} and preset names, presets expanded in place."""
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
            origin = f"{where} (preset {item!r})"
            rules += [
                Rule(pattern=pattern, spec=spec, origin=origin, preset=item)
                for pattern, spec in PRESETS[item]
            ]
            continue
        if not isinstance(item, Mapping):
            raise error(
                where,
                item,
                f"expected {{pattern: REGEX, spec: [...]}} or a preset name ({', '.join(PRESETS)})",
            )
        check_keys(where, item, file_keys(Rule))
        for key in file_keys(Rule):
            if key not in item:
                raise ConfigError(
                    f"{where}: missing key {key!r}; a rule is "
                    "{pattern: REGEX, spec: [per-dim axes]}"
                )
        rules.append(Rule(**item, origin=where))
    return tuple(rules)


_DTYPE_FIELDS = tuple(f.name for f in fields(PrecisionConfig) if f.name.endswith("_dtype"))
_PRECISION_SHORT = {
    ("params" if name == "param_dtype" else name.removesuffix("_dtype")): name
    for name in _DTYPE_FIELDS
}
"""The one-string form's keys: each dtype field without `_dtype` (`params` for param_dtype)."""


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
                path, text, f"{render(part)} is not KEY=DTYPE; keys: {', '.join(_PRECISION_SHORT)}"
            )
        name = _PRECISION_SHORT.get(key, key if key in _DTYPE_FIELDS else None)
        if name is None:
            raise error(
                path, text, f"unknown key {render(key)}; allowed: {', '.join(_PRECISION_SHORT)}"
            )
        if name in values:
            raise error(path, text, f"{render(key)} is given twice")
        values[name] = None if value.lower() in ("none", "null") else value
    return values


def parse_loss_scale(path: str, raw: Any) -> LossScaleConfig | None:
    """`loss_scale:` null, "dynamic", a number (a fixed scale) or the section's keys."""
    if raw is None:
        return None
    if raw == "dynamic":
        return LossScaleConfig()
    if not isinstance(raw, bool) and isinstance(raw, (int, float)):
        with keys_written_as({f"{path}.initial_scale": path}):
            return LossScaleConfig(dynamic=False, initial_scale=raw)
    return LossScaleConfig(**_keys(path, raw, LossScaleConfig))


def parse_precision_section(raw: Any) -> PrecisionConfig:
    """`precision:` as the one string (`parse_precision`) or the section's keys."""
    if isinstance(raw, str):
        raw = parse_precision(raw)
    precision = _keys("precision", raw, PrecisionConfig)
    precision["loss_scale"] = parse_loss_scale("precision.loss_scale", precision.get("loss_scale"))
    return PrecisionConfig(**precision)


def parse_sequence_parallel(raw: Any) -> SequenceParallelConfig:
    """The section; written at all, its axis defaults to `sequence`."""
    if raw is None:
        return SequenceParallelConfig()
    section = _keys("sequence_parallel", raw, SequenceParallelConfig)
    if section.get("modules", ()) is None:
        del section["modules"]
    return SequenceParallelConfig(**{"axis": "sequence", **section})


def parse_activation_checkpointing(raw: Any) -> ActivationCheckpointingConfig:
    """`modules:` is a mapping, module path regex -> policy, in order."""
    section = _keys("activation_checkpointing", raw, ActivationCheckpointingConfig)
    modules = as_mapping("activation_checkpointing.modules", section.pop("modules", None))
    return ActivationCheckpointingConfig(modules=modules, **section)


def parse_train(raw: Any) -> TrainConfig:
    """The section, and its obsolete keys (checked, then a warning that they do nothing)."""
    section = _keys("train", raw, TrainConfig, extra=OBSOLETE_TRAIN_KEYS)
    if "patch_clip_grad_norm" in section:
        # Checked as before, so an old config still loads; it no longer does anything.
        as_bool("train.patch_clip_grad_norm", section.pop("patch_clip_grad_norm"))
        warnings.warn(
            f"{written('train.patch_clip_grad_norm')}: no longer needed and without effect: "
            "torch.nn.utils.clip_grad_norm_ runs on the shards as it is (gradients are live "
            "tensors); remove the key",
            ConfigWarning,
            stacklevel=2,
        )
    return TrainConfig(**section)


def parse_optimizer(raw: Any) -> OptimizerConfig | None:
    """`{type, params}`: a torch optimizer class (case-insensitive) and its constructor's
    keyword arguments. Keys torch accepts but zerojax does not run are errors here, not at the
    first step."""
    if raw is None:
        return None
    section = _keys("optimizer", raw, OptimizerConfig)
    params = as_mapping("optimizer.params", section.get("params"))
    return OptimizerConfig(type=section.get("type"), params=params)


PARSERS: dict[str, Callable[[Any], Any]] = {
    "rules": parse_rules,
    "precision": parse_precision_section,
    "sequence_parallel": parse_sequence_parallel,
    "activation_checkpointing": parse_activation_checkpointing,
    "train": parse_train,
    "optimizer": parse_optimizer,
}
"""The sections a file writes differently from their dataclass; `mesh` and `zero` need more
than the section (`parse_mesh`, `parse_zero`)."""
