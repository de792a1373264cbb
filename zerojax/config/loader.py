"""`load_config`: a path, dict or DeepSpeed config -> one validated, frozen `Config`.

Load once, at the public entry point (`zerojax.initialize`, `memory_report`, the CLI), and
hand the `Config` down: everything below takes a `Config`, never a path.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from zerojax.config.checks import (
    ConfigError,
    ConfigWarning,
    as_int,
    check_keys,
    error,
    keys_written_as,
    written,
)
from zerojax.config.deepspeed import (
    DEEPSPEED_KEYS,
    DEEPSPEED_KEYS_WRITTEN,
    DEEPSPEED_ONLY_KEYS,
    SHARED_KEYS,
    deepspeed_to_zerojax,
    split_trainer_autos,
)
from zerojax.config.devices import apply_devices
from zerojax.config.files import read_config_file
from zerojax.config.limits import check_tree
from zerojax.config.schema import Config, DevicesConfig, file_keys
from zerojax.config.sections import parse_mesh, parse_section, parse_zero
from zerojax.distributed.launcher import read_launcher_env

__all__ = ["TOP_LEVEL_KEYS", "load_config"]

TOP_LEVEL_KEYS = tuple(
    key
    for name in file_keys(Config)
    for key in (("zero_stage", name) if name == "zero" else (name,))
)
"""The keys of a zerojax config file: `Config`'s sections, and `zero_stage` (`zero.stage`)."""


def _device_count(devices: DevicesConfig, num_devices: int | None) -> int:
    if num_devices is not None:
        return as_int("num_devices", num_devices, minimum=1)
    if devices.num_cpu_devices is not None:
        # Per process: under torchrun/SLURM the mesh spans every process's simulated devices.
        return devices.num_cpu_devices * read_launcher_env().world_size
    import jax  # initialises JAX's backends: the mesh must be checked against real devices

    apply_devices(devices)  # the platform must be chosen before JAX starts
    try:
        return len(jax.devices(devices.platform)) if devices.platform else jax.device_count()
    except RuntimeError as exc:
        raise error(
            "devices.platform", devices.platform, f"JAX has no such backend: {exc}"
        ) from exc


def _build(
    raw: Mapping,
    *,
    num_devices: int | None,
    source: str | None,
    fmt: str,
    trainer_autos: tuple[str, ...] = (),
) -> Config:
    """Each section's dataclass, built from its keys (checking itself), then the `Config`
    (checking the rules across sections); messages name the keys as the file wrote them."""
    # A DeepSpeed section misspelled in a zerojax file (zero_optimisation) gets its hint too.
    check_keys("", raw, TOP_LEVEL_KEYS, also_known=DEEPSPEED_KEYS if fmt == "zerojax" else ())
    with keys_written_as(DEEPSPEED_KEYS_WRITTEN if fmt == "deepspeed" else {}):
        devices = parse_section("devices", raw.get("devices"))
        sections = {
            "devices": devices,
            "mesh": parse_mesh(raw.get("mesh"), _device_count(devices, num_devices)),
            "zero": parse_zero(raw.get("zero_stage"), raw.get("zero")),
        }
        for name in file_keys(Config):
            if name not in sections:
                sections[name] = parse_section(name, raw.get(name))
        config = Config(**sections, source=source, format=fmt, trainer_autos=trainer_autos)
        train = raw.get("train") or {}  # a mapping: its section parsed
        given = [
            written(f"train.{key}")
            for key in ("micro_batch_size", "global_batch_size")
            if train.get(key) is not None
        ]
    if given:
        warnings.warn(
            f"{' and '.join(given)}: checked to multiply out with gradient accumulation and the "
            "data-parallel size, and otherwise without effect: zerojax does not load your data, "
            "so the batch your loader yields is the batch that trains",
            ConfigWarning,
            stacklevel=3,
        )
    return config


def load_config(
    source: str | os.PathLike | Mapping[str, Any] | Config,
    *,
    num_devices: int | None = None,
    trainer_autos: bool = False,
) -> Config:
    """Load and validate a zerojax config (YAML or JSON file, or a dict) or a DeepSpeed
    `ds_config.json`; return a frozen `Config`.

    `num_devices` is the device count the mesh must fill; by default `devices.num_cpu_devices`
    times the launcher's world size (torchrun/SLURM; 1 for a plain run) or, failing that,
    `jax.device_count()` (which starts JAX's backends: under a multi-process launcher, call
    `zerojax.distributed.initialize()` first, as `zerojax.initialize` does). Raises `ConfigError`
    for any invalid value, unknown key or non-finite number, and for input past the bounds of
    `zerojax.config.limits`; warns (`ConfigWarning`) for each DeepSpeed key zerojax ignores.
    A DeepSpeed "auto" value is refused (every one named) unless `trainer_autos` and the
    Hugging Face Trainer fills that key: then it is left out and listed in
    `Config.trainer_autos` (`zerojax.initialize` loads this way).

        >>> cfg = load_config({"mesh": {"data": -1}, "zero_stage": 3}, num_devices=8)
        >>> cfg.mesh.shape, cfg.zero_stage
        ((8,), 3)
    """
    if isinstance(source, Config):
        return source
    if isinstance(source, Mapping):
        raw, where = dict(source), None
    elif isinstance(source, (str, os.PathLike)):
        raw, where = read_config_file(source), os.fspath(source)
    else:
        raise ConfigError(
            f"load_config expects a path, a dict or a Config, got {type(source).__name__}"
        )
    deepspeed = is_deepspeed(raw)
    # Before anything walks it: bounded depth and size, finite numbers. DeepSpeed's
    # steps_per_print may be infinite: accelerate writes Infinity there for "never print".
    check_tree(raw, infinite_allowed=("steps_per_print",) if deepspeed else ())
    if deepspeed:
        ds, autos = split_trainer_autos(raw, in_trainer=trainer_autos)
        return _build(
            deepspeed_to_zerojax(ds),
            num_devices=num_devices,
            source=where,
            fmt="deepspeed",
            trainer_autos=autos,
        )
    return _build(raw, num_devices=num_devices, source=where, fmt="zerojax")


def is_deepspeed(raw: Mapping) -> bool:
    deepspeed = [key for key in DEEPSPEED_ONLY_KEYS if key in raw]
    native = [key for key in TOP_LEVEL_KEYS if key in raw and key not in SHARED_KEYS]
    if deepspeed and native:
        raise ConfigError(
            f"the config mixes DeepSpeed keys ({', '.join(deepspeed)}) with zerojax keys "
            f"({', '.join(native)}); in a DeepSpeed config put zerojax sections under a "
            "'zerojax' key, or write the whole config in zerojax form"
        )
    return bool(deepspeed)
