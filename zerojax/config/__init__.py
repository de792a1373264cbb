"""The zerojax config file: schema, YAML/JSON/DeepSpeed-JSON loading and validation.

Modules: `schema` (the frozen dataclasses: the one source of the config, each checking itself
when built), `checks` (value checks, ConfigError), `limits` (bounds on size, nesting and
numbers, so any input ends quickly in a config or a ConfigError), `files` (YAML/JSON
reading), `sections` (a file's sections -> the dataclasses), `deepspeed` (one mapping per
DeepSpeed section), `presets` (built-in sharding rules), `devices` (applying `devices:` to
JAX), `loader` (`load_config`).

One call, `load_config(path_or_dict)`, returns a frozen `Config`; a `Config` built in code (or
changed with `dataclasses.replace`) is checked by the same rules. Every validation problem raises
`ConfigError` naming the key path, the bad value and what is allowed; unknown keys are errors
(a typo must never be a silent default). A DeepSpeed `ds_config.json` is recognised by its keys
and mapped onto the same schema; DeepSpeed keys zerojax does not implement are each named in a
`ConfigWarning`, and a key DeepSpeed itself does not read is an error. Non-finite numbers
are refused wherever they appear.

Example (YAML; every section is optional)::

    devices: {platform: cpu, num_cpu_devices: 8}   # rehearse an 8-way mesh on a laptop
    mesh: {data: -1, tensor: 2}                    # -1 fills the remaining devices
    zero_stage: 3                                  # or zero: {stage: 3, data_parallel_axes: [data]}
    rules:                                         # first match wins
      - {pattern: 'wte\\.weight$', spec: [tensor, null]}
      - gpt2                                       # a built-in preset, expanded in place
    inputs: {sequence_axis: null}
    sequence_parallel: {axis: sequence, attention: auto}  # needs a `sequence` mesh axis
    offload: {optimizer: host, master: host}       # ZeRO-Offload: those states in host memory
    precision: "params=bfloat16,compute=bfloat16,master=float32"
    train: {gradient_accumulation_steps: 4, gradient_clipping: 1.0}
    optimizer: {type: AdamW, params: {lr: 3.0e-4, weight_decay: 0.1}}  # built if none given

The mesh is resolved against a device count at load time (`num_devices=`, else
`devices.num_cpu_devices`, else `jax.device_count()`), so a config that loads is one whose mesh
fits the machine.
"""

from zerojax.config.checks import ConfigError, ConfigWarning
from zerojax.config.deepspeed import deepspeed_to_zerojax
from zerojax.config.devices import apply_devices
from zerojax.config.loader import load_config
from zerojax.config.presets import PRESETS
from zerojax.config.schema import (
    FLOAT_DTYPES,
    MESH_AXES,
    OPTIMIZER_PARAMS,
    OPTIMIZER_TYPES,
    REMAT_POLICIES,
    ActivationCheckpointingConfig,
    CheckpointConfig,
    Config,
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
from zerojax.config.sections import parse_precision

__all__ = [
    "FLOAT_DTYPES",
    "MESH_AXES",
    "OPTIMIZER_PARAMS",
    "OPTIMIZER_TYPES",
    "PRESETS",
    "REMAT_POLICIES",
    "ActivationCheckpointingConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "DevicesConfig",
    "InputsConfig",
    "KernelsConfig",
    "LossScaleConfig",
    "MeshConfig",
    "MoeConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "Rule",
    "RuntimeConfig",
    "SequenceParallelConfig",
    "TrainConfig",
    "ZeroConfig",
    "apply_devices",
    "deepspeed_to_zerojax",
    "load_config",
    "parse_precision",
]
