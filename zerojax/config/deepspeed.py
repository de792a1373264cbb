"""A DeepSpeed `ds_config.json` mapped onto the zerojax schema, one function per section.

`deepspeed_to_zerojax` returns a raw dict in zerojax form, which `load_config` then validates
like any other. Understood:

    zero_optimization   stage; offload_optimizer {device: none|cpu, pin_memory, ratio: 1}
                        (optimizer state, master weights and gradients in host memory,
                        stage >= 1); offload_param {device: none|cpu} (parameter shards in
                        host memory, stage 3 with offload_optimizer); device nvme refused;
                        cpu_offload, cpu_offload_param (the older spellings; zerojax's own
                        cpu_offload_params too)
    bf16 (bfloat16)     enabled, bf16_master_weights_and_grads, bf16_optimizer_states
    fp16                enabled, loss_scale, initial_scale_power, loss_scale_window,
                        hysteresis, min_loss_scale, fp16_master_weights_and_grads
                        (initial_scale_power 0 to 64, min_loss_scale at most the initial
                        scale)
    data_types          grad_accum_dtype;  communication_data_type
    batch and step      gradient_accumulation_steps, gradient_clipping,
                        train_micro_batch_size_per_gpu, train_batch_size
    optimizer           type, params (Adam means AdamW unless params.adam_w_mode is false)
    activation_checkpointing
                        cpu_checkpointing (the model's checkpoint calls save to host memory)
    zerojax             native sections: every zerojax section but those the DeepSpeed
                        keys give (zero, precision, optimizer): mesh, rules, inputs,
                        kernels, moe, sequence_parallel, offload, checkpoint,
                        activation_checkpointing, train, devices, runtime

Every other key DeepSpeed itself reads (`DEEPSPEED_KEYS` and the per-section tables, taken
from DeepSpeed's config schema) is named in a `ConfigWarning` saying it is ignored, and why
where there is a reason to give. A key DeepSpeed does not read in a section zerojax maps, or
one at the top level close to a real key, is a typo: a `ConfigError` with a did-you-mean (a warning would leave
the default in place: `bf16: {enable: true}` would train in float32). The inside of a
section zerojax ignores as a whole (scheduler params, flops_profiler, ...) is not checked.
The mesh defaults to {data: -1}: DeepSpeed data parallelism over every device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from zerojax.config.checks import (
    INT32_MAX,
    ConfigError,
    ConfigWarning,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_mapping,
    as_stage,
    check_keys,
    did_you_mean,
    error,
    key_path,
)
from zerojax.config.schema import FLOAT_DTYPES, Config, TrainConfig, file_keys

__all__ = [
    "DEEPSPEED_KEYS",
    "DEEPSPEED_KEYS_WRITTEN",
    "DEEPSPEED_ONLY_KEYS",
    "SHARED_KEYS",
    "TRAINER_AUTOS",
    "auto_paths",
    "autos_error",
    "deepspeed_to_zerojax",
    "split_trainer_autos",
]

_GIVEN_BY_DEEPSPEED = ("zero", "precision", "optimizer")
"""zerojax sections the DeepSpeed keys give (zero_optimization, bf16/fp16/data_types,
optimizer), so a DeepSpeed config's `zerojax` key may not carry them."""

NATIVE_SECTIONS = tuple(name for name in file_keys(Config) if name not in _GIVEN_BY_DEEPSPEED)
"""zerojax sections a DeepSpeed config may carry under its `zerojax` key."""

TRAIN_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "train_batch_size": "global_batch_size",
}
"""DeepSpeed's top-level batch and step keys -> the `TrainConfig` field each sets."""
assert set(TRAIN_KEYS.values()) <= set(file_keys(TrainConfig)), TRAIN_KEYS

DEEPSPEED_KEYS_WRITTEN = {
    **{f"train.{name}": key for key, name in TRAIN_KEYS.items()},
    "train.patch_clip_grad_norm": "zerojax.train.patch_clip_grad_norm",
}
"""Field path -> the DeepSpeed key a ds_config.json wrote it as, for messages (see
`checks.keys_written_as`)."""

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
        "build a torch.optim.lr_scheduler on the optimizer zerojax.initialize returns (its "
        "param_groups drive every step); inside a Hugging Face Trainer its own schedule "
        "(lr_scheduler_type, warmup_steps) applies"
    ),
    "steps_per_print": "zerojax does not log steps; print in your loop",
    "wall_clock_breakdown": "see zerojax.effective_time() and runtime.report_effective_time",
}

# DeepSpeed activation_checkpointing keys with no effect in zerojax, and why.
_ACTIVATION_CHECKPOINTING_NO_EFFECT = {
    "partition_activations": (
        "saved activations keep the sharding of the computation that made them"
    ),
    "contiguous_memory_optimization": "XLA lays out the saved activations in its own buffers",
    "number_checkpoints": "not needed: XLA allocates the saved activations up front",
    "synchronize_checkpoint_boundary": "there is no stream to synchronise in one XLA program",
    "profile": "see zerojax.memory_report for what the saved activations cost",
}


def _ignored(key: str, why: str = "") -> None:
    warnings.warn(
        f"DeepSpeed key {key!r} is not supported by zerojax and is ignored"
        + (f" ({why})" if why else ""),
        ConfigWarning,
        stacklevel=5,
    )


# DeepSpeed's own keys, from its config schema (deepspeedai/DeepSpeed at edaa722, 2026-08-22:
# deepspeed/runtime/config.py, constants.py, zero/config.py, zero/offload_config.py,
# precision_config.py, activation_checkpointing/config.py). A key in these tables is real:
# zerojax maps it or names it in a ConfigWarning; any other key in a DeepSpeed section is a
# typo and an error with a did-you-mean, never a warning that leaves a default in place.
DEEPSPEED_KEYS = (
    # batch and step
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation", "gradient_clipping", "dataloader_drop_last",
    # precision
    "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "data_types",
    "communication_data_type", "seq_parallel_communication_data_type",
    # ZeRO and communication
    "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "allgather_size", "disable_allgather", "prescale_gradients", "gradient_predivide_factor",
    "gradient_allreduce_op", "sparse_gradients", "use_data_before_expert_parallelism",
    "tensor_parallel", "expert_parallel", "sequence_parallel_size", "pipeline",
    # optimizer, schedule, memory
    "optimizer", "scheduler", "activation_checkpointing", "aio", "checkpoint",
    "nebula", "datastates_ckpt", "elasticity", "compile", "graph_harvesting",
    # logging and profiling
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "log_level",
    "flops_profiler", "comms_logger", "timers", "tensorboard", "wandb", "csv_monitor", "comet",
    "autotuning", "model_info",
    # training techniques
    "sparse_attention", "progressive_layer_drop", "curriculum_learning", "data_efficiency",
    "compression_training", "weight_quantization", "quantize_training", "eigenvalue",
    "hybrid_engine", "vocabulary_size",
    # zerojax's own sections in a DeepSpeed config
    "zerojax",
)  # fmt: skip
"""Every top-level key of a DeepSpeed config (and `zerojax`); any other is refused when it is
close to one of these (a typo), else named in a `ConfigWarning` (DeepSpeed ignores it)."""

SHARED_KEYS = ("optimizer", "activation_checkpointing", "checkpoint")
"""Top-level keys of both formats; in a DeepSpeed config each has DeepSpeed's meaning."""

DEEPSPEED_ONLY_KEYS = tuple(key for key in DEEPSPEED_KEYS if key not in (*SHARED_KEYS, "zerojax"))
"""Top-level keys that mark a config as DeepSpeed's (none is a zerojax key; `optimizer` and
`activation_checkpointing` are both, and DeepSpeed's forms are translated)."""

_ZERO_OPTIMIZATION_KEYS = (
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
    "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
    "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload",
    # each ZeRO-3 field under its name and its stage3_ alias
    "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold",
    "model_persistence_threshold", "stage3_model_persistence_threshold",
    "max_live_parameters", "stage3_max_live_parameters",
    "max_reuse_distance", "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential", "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param",
    "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
    # zerojax's earlier spelling of cpu_offload_param, still read
    "cpu_offload_params",
)  # fmt: skip

_BF16_KEYS = (
    "enabled", "immediate_grad_update", "check_grad_overflow",
    "bf16_master_weights_and_grads", "bf16_optimizer_states",
)  # fmt: skip
_BF16_USED = ("enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states")

_FP16_KEYS = (
    "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
    "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads",
)  # fmt: skip
_FP16_USED = (
    "enabled", "fp16_master_weights_and_grads", "loss_scale", "initial_scale_power",
    "loss_scale_window", "hysteresis", "min_loss_scale",
)  # fmt: skip

_DATA_TYPES_KEYS = ("grad_accum_dtype", "param_dtype", "buffer_dtype")
_OPTIMIZER_KEYS = ("type", "params", "legacy_fusion")
_SCHEDULER_KEYS = ("type", "params")

# The fp16 loss scale starts at 2**initial_scale_power and is held in float32 in the program.
# Megatron's default start, 2**32, is the largest in common use (DeepSpeed's is 2**16); each
# power above what fp16 gradients hold costs a skipped step while dynamic scaling halves it
# down, so 64 is already ~48 wasted steps, and float32 overflows at 2**128.
MAX_INITIAL_SCALE_POWER = 64


def _check_section_keys(path: str, section: Mapping[str, Any], known: tuple[str, ...]) -> None:
    """A DeepSpeed section's keys are DeepSpeed's: anything else is a typo (an error with a
    did-you-mean), whether zerojax uses the section or not."""
    for key in section:
        if key not in known:
            close = did_you_mean(key, known)
            hint = f" (did you mean {close!r}?)" if close else ""
            listed = (
                f"DeepSpeed's {path} keys: {', '.join(known)}"
                if len(known) <= 12
                else f"it is none of DeepSpeed's {len(known)} {path} keys"
            )
            raise ConfigError(f"{key_path(path, key)}: unknown DeepSpeed key{hint}; {listed}")


TRAINER_AUTOS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "world_size x per_device_train_batch_size x gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1, adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_min_lr": "0",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": "warmup_steps, warmup_ratio",
    "scheduler.params.total_num_steps": "max_steps, num_train_epochs",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "zero_optimization.reduce_bucket_size": "the model's hidden size",
    "zero_optimization.stage3_prefetch_bucket_size": "the model's hidden size",
    "zero_optimization.stage3_param_persistence_threshold": "the model's hidden size",
}
"""DeepSpeed keys the Hugging Face Trainer fills where they say "auto", and from what
(transformers' `HfTrainerDeepSpeedConfig`). Inside a Trainer each is the Trainer's own doing:
its batch size, accumulation, clipping (`max_grad_norm`), AdamW and schedule, and its bf16
autocast, which zerojax traces into the program; DeepSpeed's bucket sizes mean nothing here."""


def auto_paths(ds: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every key (dotted path) whose value is "auto", in the config's order."""
    paths = []
    for key, value in ds.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            paths += auto_paths(value, prefix=f"{path}.")
        elif isinstance(value, str) and value == "auto":
            paths.append(path)
    return paths


def split_trainer_autos(
    ds: Mapping[str, Any], *, in_trainer: bool
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(the config without its "auto" keys, their paths). With `in_trainer`, "auto" is allowed
    where the Hugging Face Trainer fills it (TRAINER_AUTOS): the Trainer does those things
    itself, so zerojax leaves them out. Otherwise, or for any other "auto", every "auto" key is
    named in one ConfigError, each with what would fill it."""
    autos = auto_paths(ds)
    if not autos:
        return dict(ds), ()
    if not in_trainer or any(path not in TRAINER_AUTOS for path in autos):
        raise autos_error(autos, in_trainer=in_trainer)
    return _without(ds, autos), tuple(autos)


def autos_error(autos: list[str] | tuple[str, ...], *, in_trainer: bool) -> ConfigError:
    """One error naming every "auto" key, each with what fills it (if anything does)."""
    listed = "\n".join(
        f"  {path}: "
        + (
            f"the Trainer fills it ({TRAINER_AUTOS[path]})"
            if path in TRAINER_AUTOS
            else "no Trainer fills it: give the value"
        )
        for path in autos
    )
    fix = (
        "give these values"
        if in_trainer
        else "give these values, or train the model zerojax.initialize returns with the "
        "Hugging Face Trainer, which fills them from its arguments"
    )
    return ConfigError(
        f'the DeepSpeed config leaves {len(autos)} value(s) "auto":\n{listed}\n{fix}'
    )


def _without(ds: Mapping[str, Any], paths: list[str]) -> dict[str, Any]:
    out = {key: _without(v, []) if isinstance(v, Mapping) else v for key, v in ds.items()}
    for path in paths:
        *parents, last = path.split(".")
        node = out
        for key in parents:
            node = node[key]
        del node[last]
    # An optimizer whose parameters the Trainer fills is the Trainer's own optimizer.
    if any(path.startswith("optimizer.params.") for path in paths):
        out.pop("optimizer", None)
    return out


_NVME_ONLY = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "fast_init")
_PIPELINE = ("pipeline", "pipeline_read", "pipeline_write")
# super_offload and cpuadam_cores_perc tune DeepSpeed's CPU Adam (zerojax compiles its own).
_CPU_ADAM = ("super_offload", "cpuadam_cores_perc")
_OFFLOAD_OPTIMIZER_KEYS = ("device", "pin_memory", "ratio", *_NVME_ONLY, *_PIPELINE, *_CPU_ADAM)
_WHY_NO_NVME = (
    "NVMe offload (ZeRO-Infinity) is not supported: JAX places arrays in device or host "
    "memory only, so NVMe would mean swapping files outside the one XLA program; use "
    "device: cpu (host memory)"
)


def _zero_optimization(ds: Mapping[str, Any], raw: dict[str, Any]) -> None:
    section = as_mapping("zero_optimization", ds.get("zero_optimization"))
    _check_section_keys("zero_optimization", section, _ZERO_OPTIMIZATION_KEYS)
    stage = as_stage("zero_optimization.stage", section.get("stage", 0))
    if "stage" in section:
        raw["zero"] = {"stage": stage}
    for key, value in section.items():
        path = f"zero_optimization.{key}"
        if key == "stage":
            continue
        if key == "offload_optimizer":
            _offload_optimizer(path, value, stage, _keeps_master(ds), raw)
        elif key == "cpu_offload":  # DeepSpeed's older spelling of offload_optimizer: cpu
            if as_bool(path, value):
                _offload_optimizer(path, {"device": "cpu"}, stage, _keeps_master(ds), raw)
        elif key == "cpu_offload_use_pin_memory":
            as_bool(path, value)  # host state is always pinned (see _offload_optimizer)
        elif key in ("offload_param", "cpu_offload_param", "cpu_offload_params"):
            _offload_param(path, value, stage, section, raw)
        else:
            communication = "bucket" in key or "overlap" in key or "contiguous" in key
            _ignored(
                path, "XLA schedules and buckets communication itself" if communication else ""
            )


def _keeps_master(ds: Mapping[str, Any]) -> bool:
    """Whether the precision sections give float32 master weights (`_bf16`, `_fp16`)."""
    for name, section in (("bf16", ds.get("bf16", ds.get("bfloat16"))), ("fp16", ds.get("fp16"))):
        if isinstance(section, Mapping) and section.get("enabled") is True:
            return section.get(f"{name}_master_weights_and_grads") is not True
    return False


def _offload_optimizer(
    path: str, value: Any, stage: int, keeps_master: bool, raw: dict[str, Any]
) -> None:
    """`offload_optimizer: {device: cpu}`: optimizer state, gradients and (where kept) master
    weights in host memory, `offload: {optimizer: host, grads: host, master: host}`."""
    section = as_mapping(path, value)
    check_keys(path, section, _OFFLOAD_OPTIMIZER_KEYS)
    device = as_choice(f"{path}.device", section.get("device", "none"), ("none", "cpu", "nvme"))
    if device == "nvme":
        raise error(f"{path}.device", device, _WHY_NO_NVME)
    if device == "none":
        return  # nothing is offloaded; the other keys configure an offload that is not there
    if stage == 0:
        raise error(
            f"{path}.device",
            device,
            "needs zero_optimization.stage 1, 2 or 3 (DeepSpeed's rule: each rank offloads its "
            "own partition of the optimizer state); stage is 0",
        )
    ratio = as_float(f"{path}.ratio", section.get("ratio", 1.0))
    if ratio != 1.0:
        raise error(
            f"{path}.ratio",
            section["ratio"],
            "partial optimizer offload is not supported; allowed: 1.0 (all of it)",
        )
    _pinned_and_nvme_keys(path, section)
    # The master weights go with the optimizer state (DeepSpeed keeps its fp32 partition on
    # the CPU), where the precision keeps them (fp32 training and *_master_weights_and_grads
    # have none), and so do the gradients (ZeRO-Offload copies each to the CPU as the
    # backward pass produces it, for the CPU optimizer).
    raw.setdefault("offload", {}).update(
        {"optimizer": "host", "grads": "host", **({"master": "host"} if keeps_master else {})}
    )


def _pinned_and_nvme_keys(path: str, section: Mapping[str, Any]) -> None:
    """Warn for the keys of an offload section that have no effect with device: cpu."""
    pinned = as_bool(f"{path}.pin_memory", section.get("pin_memory", False))
    if "pin_memory" in section and not pinned:
        warnings.warn(
            f"DeepSpeed key '{path}.pin_memory' = false has no effect: zerojax keeps "
            "offloaded state in pinned host memory (JAX's pinned_host memory kind), the "
            "host memory XLA can transfer to and from inside the training program",
            ConfigWarning,
            stacklevel=6,
        )
    for key in (*_NVME_ONLY, *_PIPELINE):
        if key in section:
            _ignored(f"{path}.{key}", "it applies to device: nvme only")
    for key in _CPU_ADAM:
        if key in section:
            _ignored(f"{path}.{key}", "it tunes DeepSpeed's CPU Adam; zerojax compiles its own")


def _offloads_optimizer(section: Mapping[str, Any]) -> bool:
    optimizer = section.get("offload_optimizer")
    if isinstance(optimizer, Mapping):
        return optimizer.get("device") == "cpu"
    return section.get("cpu_offload") is True


def _offload_param(
    path: str, value: Any, stage: int, section: Mapping[str, Any], raw: dict[str, Any]
) -> None:
    """`offload_param: {device: cpu}`: ZeRO-3's parameter shards in host memory,
    `offload: {params: host}`."""
    if isinstance(value, bool):  # cpu_offload_param, the older spelling
        device, where, written = ("cpu" if value else "none"), path, value
    else:
        options = as_mapping(path, value)
        check_keys(path, options, ("device", "pin_memory", *_NVME_ONLY))
        device = as_choice(f"{path}.device", options.get("device", "none"), ("none", "cpu", "nvme"))
        where, written = f"{path}.device", device
    if device == "nvme":
        raise error(where, device, _WHY_NO_NVME)
    if device != "cpu":
        return
    if not isinstance(value, bool):
        _pinned_and_nvme_keys(path, options)
    if stage != 3:
        raise error(
            where,
            written,
            "parameter offload needs zero_optimization.stage 3 (DeepSpeed's rule: only "
            f"stage 3 partitions the parameters); stage is {stage}",
        )
    if not _offloads_optimizer(section):
        raise error(
            where,
            written,
            "zerojax runs the optimizer update where the parameter shards live, on the host: "
            "add offload_optimizer: {device: cpu} as well",
        )
    raw.setdefault("offload", {})["params"] = "host"


def _bf16(section: Mapping[str, Any]) -> dict[str, Any]:
    pure = as_bool(
        "bf16.bf16_master_weights_and_grads", section.get("bf16_master_weights_and_grads", False)
    )
    states16 = as_bool("bf16.bf16_optimizer_states", section.get("bf16_optimizer_states", False))
    for key in section:
        if key not in _BF16_USED:
            _ignored(f"bf16.{key}")
    return {
        "param_dtype": "bfloat16",
        "compute_dtype": "bfloat16",
        "master_dtype": None if pure else "float32",
        "grad_reduce_dtype": "bfloat16" if pure else "float32",
        "optimizer_state_dtype": "bfloat16" if states16 else "float32",
    }


def _fp16(section: Mapping[str, Any]) -> dict[str, Any]:
    pure = as_bool(
        "fp16.fp16_master_weights_and_grads", section.get("fp16_master_weights_and_grads", False)
    )
    loss_scale = as_float("fp16.loss_scale", section.get("loss_scale", 0))
    if loss_scale < 0:
        raise error("fp16.loss_scale", loss_scale, "allowed: 0 (dynamic) or a scale > 0")
    power = as_int(
        "fp16.initial_scale_power",
        section.get("initial_scale_power", 16),
        minimum=0,
        maximum=MAX_INITIAL_SCALE_POWER,
    )
    dynamic = loss_scale == 0
    initial = float(2**power) if dynamic else loss_scale
    min_scale = as_float("fp16.min_loss_scale", section.get("min_loss_scale", 1.0), positive=True)
    if dynamic and min_scale > initial:
        raise error(
            "fp16.min_loss_scale",
            section["min_loss_scale"],
            f"above the initial scale 2**initial_scale_power = {initial:g}: the dynamic scale "
            "never goes below min_loss_scale, so it must start at or above it",
        )
    for key in section:
        if key not in _FP16_USED:
            _ignored(f"fp16.{key}")
    return {
        "param_dtype": "float16",
        "compute_dtype": "float16",
        "master_dtype": None if pure else "float32",
        "grad_reduce_dtype": "float16" if pure else "float32",
        "loss_scale": {
            "dynamic": dynamic,
            "initial_scale": initial,
            "window": as_int(
                "fp16.loss_scale_window",
                section.get("loss_scale_window", 1000),
                minimum=1,
                maximum=INT32_MAX,
            ),
            "hysteresis": as_int(
                "fp16.hysteresis", section.get("hysteresis", 2), minimum=1, maximum=INT32_MAX
            ),
            "min_scale": min_scale,
        },
    }


def _precision(ds: Mapping[str, Any], raw: dict[str, Any]) -> None:
    """bf16 / fp16 sections, then data_types and communication_data_type on top."""
    # `bfloat16` is DeepSpeed's older name for the section, read where `bf16` is absent.
    bf16_name = "bfloat16" if "bf16" not in ds and "bfloat16" in ds else "bf16"
    if "bf16" in ds and "bfloat16" in ds:
        _ignored("bfloat16", "DeepSpeed reads bf16 where both are given")
    bf16 = as_mapping(bf16_name, ds.get(bf16_name))
    fp16 = as_mapping("fp16", ds.get("fp16"))
    _check_section_keys(bf16_name, bf16, _BF16_KEYS)
    _check_section_keys("fp16", fp16, _FP16_KEYS)
    bf16_on = as_bool(f"{bf16_name}.enabled", bf16.get("enabled", False))
    fp16_on = as_bool("fp16.enabled", fp16.get("enabled", False))
    if bf16_on and fp16_on:
        raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")
    precision = _bf16(bf16) if bf16_on else _fp16(fp16) if fp16_on else {}
    data_types = as_mapping("data_types", ds.get("data_types"))
    _check_section_keys("data_types", data_types, _DATA_TYPES_KEYS)
    for key, value in data_types.items():
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
    for ds_key, key in TRAIN_KEYS.items():
        disabled = (None, 0, 0.0) if ds_key == "gradient_clipping" else (None,)
        if ds.get(ds_key) not in disabled:  # DeepSpeed: gradient_clipping 0 disables clipping
            train[key] = ds[ds_key]
    if train:
        raw["train"] = train


def _optimizer(ds: Mapping[str, Any], raw: dict[str, Any]) -> None:
    if ds.get("optimizer") is None:
        return
    opt = as_mapping("optimizer", ds["optimizer"])
    _check_section_keys("optimizer", opt, _OPTIMIZER_KEYS)
    if "legacy_fusion" in opt:
        _ignored("optimizer.legacy_fusion", "zerojax compiles its own update")
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


def _activation_checkpointing(ds: Mapping[str, Any], raw: dict[str, Any]) -> None:
    """DeepSpeed checkpoints what the model wraps in (deepspeed or torch) `checkpoint` calls;
    zerojax honours the model's torch.utils.checkpoint calls, and `cpu_checkpointing` moves
    their saved activations to host memory (policy `offload`)."""
    section = as_mapping("activation_checkpointing", ds.get("activation_checkpointing"))
    for key, value in section.items():
        if key == "cpu_checkpointing":
            path = "activation_checkpointing.cpu_checkpointing"
            if as_bool(path, value):
                raw["activation_checkpointing"] = {"torch_checkpoint": "offload"}
        elif key in _ACTIVATION_CHECKPOINTING_NO_EFFECT:
            _ignored(f"activation_checkpointing.{key}", _ACTIVATION_CHECKPOINTING_NO_EFFECT[key])
        else:
            known = ("cpu_checkpointing", *_ACTIVATION_CHECKPOINTING_NO_EFFECT)
            _check_section_keys("activation_checkpointing", {key: value}, known)


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
    ("bf16", "bfloat16", "fp16", "data_types", "communication_data_type"): _precision,
    tuple(TRAIN_KEYS): _train,
    ("optimizer",): _optimizer,
    ("activation_checkpointing",): _activation_checkpointing,
    ("zerojax",): _native,
}
_HANDLED = tuple(key for keys in _SECTIONS for key in keys)


def deepspeed_to_zerojax(ds: Mapping[str, Any]) -> dict[str, Any]:
    """Map a DeepSpeed config onto the zerojax schema (a raw dict for `load_config`); see the
    module docstring for the keys understood. Each other key raises a `ConfigWarning`; an
    "auto" value raises a `ConfigError` naming every one (see `split_trainer_autos`)."""
    ds, _ = split_trainer_autos(ds, in_trainer=False)
    for key in ds:
        if key not in DEEPSPEED_KEYS:
            # DeepSpeed itself ignores a top-level key it does not know (ds_configs carry the
            # user's own keys); only a near-miss of a real key (one or two letters: ratio >=
            # 0.8; 'experiment_name' is 0.67 from 'expert_parallel') is surely a typo.
            close = did_you_mean(key, DEEPSPEED_KEYS, cutoff=0.8)
            if close is None:
                _ignored(key, "not a DeepSpeed config key")
                continue
            raise ConfigError(
                f"{key_path('', key)}: unknown key (did you mean {close!r}?); it is neither a "
                "DeepSpeed config key nor 'zerojax' (the zerojax sections of a DeepSpeed config "
                "go under it)"
            )
        if key not in _HANDLED:
            _ignored(key, _WHY_IGNORED.get(key, ""))
    if isinstance(ds.get("scheduler"), Mapping):
        _check_section_keys("scheduler", ds["scheduler"], _SCHEDULER_KEYS)
    raw: dict[str, Any] = {}
    for section in _SECTIONS.values():
        section(ds, raw)
    return raw
