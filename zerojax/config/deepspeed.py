"""A DeepSpeed `ds_config.json` mapped onto the zerojax schema, one function per section.

`deepspeed_to_zerojax` returns a raw dict in zerojax form, which `load_config` then validates
like any other. Understood:

    zero_optimization   stage
    bf16                enabled, bf16_master_weights_and_grads, bf16_optimizer_states
    fp16                enabled, loss_scale, initial_scale_power, loss_scale_window,
                        hysteresis, min_loss_scale, fp16_master_weights_and_grads
    data_types          grad_accum_dtype;  communication_data_type
    batch and step      gradient_accumulation_steps, gradient_clipping,
                        train_micro_batch_size_per_gpu, train_batch_size
    optimizer           type, params (Adam means AdamW unless params.adam_w_mode is false)
    zerojax             native sections: mesh, rules, inputs, kernels, checkpoint, devices,
                        runtime, train

Every other key, at any level, is named in a `ConfigWarning` saying it is ignored, and why
where there is a reason to give. The mesh defaults to {data: -1}: DeepSpeed data parallelism
over every device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from zerojax.config.checks import (
    ConfigError,
    ConfigWarning,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_mapping,
    as_stage,
    check_keys,
    error,
)
from zerojax.config.schema import FLOAT_DTYPES

__all__ = ["DEEPSPEED_ONLY_KEYS", "deepspeed_to_zerojax"]

DEEPSPEED_ONLY_KEYS = (
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
"""Top-level keys that mark a config as DeepSpeed's (none is a zerojax key)."""

NATIVE_SECTIONS = (
    "mesh",
    "rules",
    "inputs",
    "kernels",
    "checkpoint",
    "devices",
    "runtime",
    "train",
)
"""zerojax sections a DeepSpeed config may carry under its `zerojax` key."""

_DS_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}

# Why a DeepSpeed key has no zerojax counterpart, where there is more to say than "ignored".
_WHY_IGNORED = {
    "scheduler": (
        "build a torch.optim.lr_scheduler on the optimizer zerojax.initialize returns: its "
        "param_groups drive every step"
    ),
    "steps_per_print": "zerojax does not log steps; print in your loop",
    "wall_clock_breakdown": "see zerojax.effective_time() and runtime.report_effective_time",
    "activation_checkpointing": "XLA decides rematerialisation inside the compiled step",
}


def _ignored(key: str, why: str = "") -> None:
    warnings.warn(
        f"DeepSpeed key {key!r} is not supported by zerojax and is ignored"
        + (f" ({why})" if why else ""),
        ConfigWarning,
        stacklevel=5,
    )


def _ds_value(path: str, value: Any) -> Any:
    if value == "auto":
        raise error(path, value, "'auto' is filled in by the Hugging Face Trainer; give the value")
    return value


def _zero_optimization(ds: Mapping[str, Any], raw: dict[str, Any]) -> None:
    for key, value in as_mapping("zero_optimization", ds.get("zero_optimization")).items():
        if key == "stage":
            path = "zero_optimization.stage"
            raw["zero"] = {"stage": as_stage(path, _ds_value(path, value))}
        else:
            communication = "bucket" in key or "overlap" in key or "contiguous" in key
            _ignored(
                f"zero_optimization.{key}",
                "XLA schedules and buckets communication itself" if communication else "",
            )


def _bf16(section: Mapping[str, Any]) -> dict[str, Any]:
    pure = as_bool(
        "bf16.bf16_master_weights_and_grads", section.get("bf16_master_weights_and_grads", False)
    )
    states16 = as_bool("bf16.bf16_optimizer_states", section.get("bf16_optimizer_states", False))
    for key in section:
        if key not in ("enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states"):
            _ignored(f"bf16.{key}")
    return {
        "param_dtype": "bfloat16",
        "compute_dtype": "bfloat16",
        "master_dtype": None if pure else "float32",
        "grad_reduce_dtype": "bfloat16" if pure else "float32",
        "optimizer_state_dtype": "bfloat16" if states16 else "float32",
    }


_FP16_KEYS = (
    "enabled",
    "fp16_master_weights_and_grads",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)


def _fp16(section: Mapping[str, Any]) -> dict[str, Any]:
    pure = as_bool(
        "fp16.fp16_master_weights_and_grads", section.get("fp16_master_weights_and_grads", False)
    )
    loss_scale = as_float(
        "fp16.loss_scale", _ds_value("fp16.loss_scale", section.get("loss_scale", 0))
    )
    if loss_scale < 0:
        raise error("fp16.loss_scale", loss_scale, "allowed: 0 (dynamic) or a scale > 0")
    power = as_int("fp16.initial_scale_power", section.get("initial_scale_power", 16), minimum=0)
    for key in section:
        if key not in _FP16_KEYS:
            _ignored(f"fp16.{key}")
    return {
        "param_dtype": "float16",
        "compute_dtype": "float16",
        "master_dtype": None if pure else "float32",
        "grad_reduce_dtype": "float16" if pure else "float32",
        "loss_scale": {
            "dynamic": loss_scale == 0,
            "initial_scale": float(2**power) if loss_scale == 0 else loss_scale,
            "window": as_int(
                "fp16.loss_scale_window", section.get("loss_scale_window", 1000), minimum=1
            ),
            "hysteresis": as_int("fp16.hysteresis", section.get("hysteresis", 2), minimum=1),
            "min_scale": as_float(
                "fp16.min_loss_scale", section.get("min_loss_scale", 1.0), positive=True
            ),
        },
    }


def _precision(ds: Mapping[str, Any], raw: dict[str, Any]) -> None:
    """bf16 / fp16 sections, then data_types and communication_data_type on top."""
    bf16 = as_mapping("bf16", ds.get("bf16"))
    fp16 = as_mapping("fp16", ds.get("fp16"))
    bf16_on = as_bool("bf16.enabled", _ds_value("bf16.enabled", bf16.get("enabled", False)))
    fp16_on = as_bool("fp16.enabled", _ds_value("fp16.enabled", fp16.get("enabled", False)))
    if bf16_on and fp16_on:
        raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")
    precision = _bf16(bf16) if bf16_on else _fp16(fp16) if fp16_on else {}
    for key, value in as_mapping("data_types", ds.get("data_types")).items():
        if key == "grad_accum_dtype" and value is not None:
            precision["grad_reduce_dtype"] = as_choice(
                "data_types.grad_accum_dtype", _DS_DTYPES.get(value, value), FLOAT_DTYPES
            )
        else:
            _ignored(f"data_types.{key}")
    if ds.get("communication_data_type") is not None:
        value = ds["communication_data_type"]
        precision["grad_reduce_dtype"] = as_choice(
            "communication_data_type", _DS_DTYPES.get(value, value), FLOAT_DTYPES
        )
    if precision:
        raw["precision"] = precision


def _train(ds: Mapping[str, Any], raw: dict[str, Any]) -> None:
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


def _optimizer(ds: Mapping[str, Any], raw: dict[str, Any]) -> None:
    if ds.get("optimizer") is None:
        return
    opt = as_mapping("optimizer", ds["optimizer"])
    check_keys("optimizer", opt, ("type", "params"))
    params = dict(as_mapping("optimizer.params", opt.get("params")))
    kind = opt.get("type")
    # DeepSpeed's Adam is AdamW unless adam_w_mode is false (deepspeed.ops.adam.FusedAdam).
    adam_w_mode = as_bool("optimizer.params.adam_w_mode", params.pop("adam_w_mode", True))
    if isinstance(kind, str) and kind.lower() == "adam" and adam_w_mode:
        kind = "adamw"
    if not as_bool("optimizer.params.bias_correction", params.pop("bias_correction", True)):
        raise error(
            "optimizer.params.bias_correction",
            False,
            "zerojax runs torch's Adam/AdamW, which always correct the bias; remove the key",
        )
    for key in ("torch_adam", "fused"):
        if key in params:
            params.pop(key)
            _ignored(f"optimizer.params.{key}", "zerojax compiles its own update")
    raw["optimizer"] = {"type": kind, "params": params}


def _native(ds: Mapping[str, Any], raw: dict[str, Any]) -> None:
    """The `zerojax` section: native sections, merged over what the DeepSpeed keys gave."""
    native = as_mapping("zerojax", ds.get("zerojax"))
    check_keys("zerojax", native, NATIVE_SECTIONS)
    for key, value in native.items():
        if key == "train":  # DeepSpeed's batch keys also fill `train`: one dict, checked later
            raw["train"] = {**raw.get("train", {}), **as_mapping("zerojax.train", value)}
        else:
            raw[key] = value


_SECTIONS: dict[tuple[str, ...], Callable[[Mapping[str, Any], dict[str, Any]], None]] = {
    ("zero_optimization",): _zero_optimization,
    ("bf16", "fp16", "data_types", "communication_data_type"): _precision,
    (
        "gradient_accumulation_steps",
        "gradient_clipping",
        "train_micro_batch_size_per_gpu",
        "train_batch_size",
    ): _train,
    ("optimizer",): _optimizer,
    ("zerojax",): _native,
}
_HANDLED = tuple(key for keys in _SECTIONS for key in keys)


def deepspeed_to_zerojax(ds: Mapping[str, Any]) -> dict[str, Any]:
    """Map a DeepSpeed config onto the zerojax schema (a raw dict for `load_config`); see the
    module docstring for the keys understood. Each other key raises a `ConfigWarning`."""
    for key in ds:
        if key not in _HANDLED:
            _ignored(key, _WHY_IGNORED.get(key, ""))
    raw: dict[str, Any] = {}
    for section in _SECTIONS.values():
        section(ds, raw)
    return raw
