"""`load_config`: a path, dict or DeepSpeed config -> one validated, frozen `Config`.

Load once, at the public entry point (`zerojax.initialize`, `memory_report`, the CLI), and
hand the `Config` down: everything below takes a `Config`, never a path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from zerojax.config.checks import ConfigError, as_int, check_keys, error
from zerojax.config.deepspeed import (
    DEEPSPEED_ONLY_KEYS,
    deepspeed_to_zerojax,
    split_trainer_autos,
)
from zerojax.config.devices import apply_devices
from zerojax.config.files import read_config_file
from zerojax.config.schema import Config, DevicesConfig
from zerojax.config.sections import (
    parse_activation_checkpointing,
    parse_checkpoint,
    parse_devices,
    parse_inputs,
    parse_kernels,
    parse_mesh,
    parse_moe,
    parse_offload,
    parse_optimizer,
    parse_precision_section,
    parse_rules,
    parse_runtime,
    parse_sequence_parallel,
    parse_train,
    parse_zero,
)
from zerojax.distributed.launcher import read_launcher_env

__all__ = ["TOP_LEVEL_KEYS", "load_config"]

TOP_LEVEL_KEYS = (
    "mesh",
    "zero_stage",
    "zero",
    "rules",
    "inputs",
    "precision",
    "kernels",
    "moe",
    "sequence_parallel",
    "offload",
    "checkpoint",
    "activation_checkpointing",
    "train",
    "devices",
    "runtime",
    "optimizer",
)


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


def _build(raw: Mapping, *, num_devices: int | None, source: str | None, fmt: str) -> Config:
    check_keys("", raw, TOP_LEVEL_KEYS)
    devices = parse_devices(raw.get("devices"))
    mesh = parse_mesh(raw.get("mesh"), _device_count(devices, num_devices))
    zero = parse_zero(raw.get("zero_stage"), raw.get("zero"))
    config = Config(mesh=mesh, zero=zero, devices=devices, source=source, format=fmt)
    sequence_parallel, inputs = parse_sequence_parallel(
        raw.get("sequence_parallel"),
        mesh.axis_names,
        parse_inputs(raw.get("inputs"), mesh.axis_names),
    )
    precision = parse_precision_section(raw.get("precision"))
    return replace(
        config,
        rules=parse_rules(raw.get("rules"), mesh.axis_names),
        inputs=inputs,
        sequence_parallel=sequence_parallel,
        precision=precision,
        offload=parse_offload(raw.get("offload"), zero.stage, precision),
        kernels=parse_kernels(raw.get("kernels")),
        moe=parse_moe(raw.get("moe")),
        checkpoint=parse_checkpoint(raw.get("checkpoint")),
        activation_checkpointing=parse_activation_checkpointing(
            raw.get("activation_checkpointing")
        ),
        train=parse_train(
            raw.get("train"), config.data_parallel_size, deepspeed=fmt == "deepspeed"
        ),
        runtime=parse_runtime(raw.get("runtime")),
        optimizer=parse_optimizer(raw.get("optimizer")),
    )


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
    for any invalid value; warns (`ConfigWarning`) for each DeepSpeed key zerojax ignores.
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
    if is_deepspeed(raw):
        ds, autos = split_trainer_autos(raw, in_trainer=trainer_autos)
        config = _build(
            deepspeed_to_zerojax(ds), num_devices=num_devices, source=where, fmt="deepspeed"
        )
        return replace(config, trainer_autos=autos)
    return _build(raw, num_devices=num_devices, source=where, fmt="zerojax")


def is_deepspeed(raw: Mapping) -> bool:
    deepspeed = [key for key in DEEPSPEED_ONLY_KEYS if key in raw]
    shared = ("optimizer", "activation_checkpointing")  # keys of both formats
    native = [key for key in TOP_LEVEL_KEYS if key in raw and key not in shared]
    if deepspeed and native:
        raise ConfigError(
            f"the config mixes DeepSpeed keys ({', '.join(deepspeed)}) with zerojax keys "
            f"({', '.join(native)}); in a DeepSpeed config put zerojax sections under a "
            "'zerojax' key, or write the whole config in zerojax form"
        )
    return bool(deepspeed)
