"""The config schema: one frozen dataclass per section, a docstring under every field.

Nothing here reads files or validates raw values (`sections` does); these classes are what
the rest of zerojax receives, always through a `Config` that `load_config` built once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

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
OPTIMIZER_TYPES = ("adam", "adamw", "sgd")
"""Optimizers zerojax runs (torch.optim.Adam, AdamW, SGD, reproduced exactly in JAX)."""

OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
}
"""`optimizer.params` keys per type: the torch constructor's keyword arguments zerojax runs
(torch's foreach/fused/capturable/differentiable choose torch kernels, which zerojax replaces)."""

OFFLOAD_PLACES = ("device", "host")
"""Where a model state lives between steps: accelerator memory, or host memory (JAX's
`pinned_host` memory kind on the state's ZeRO sharding; see `OffloadConfig`)."""

# Default 0.1: past that, the per-device memory the ZeRO stage promises is off by more than 10%.
DEFAULT_MAX_REPLICATED_FRACTION = 0.1


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshConfig:
    axes: tuple[tuple[str, int], ...] = (("data", -1),)
    """Mesh axes in order (outermost first), as written: name -> size, where -1 fills the
    devices the other axes leave."""

    num_devices: int = 1
    """Device count the mesh was resolved against at load time."""

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
    stage: int = 0
    """ZeRO stage: 0 replicates everything over the data-parallel axes; 1 shards optimizer state
    and master weights; 2 also gradients; 3 also parameters (gathered for compute)."""

    data_parallel_axes: tuple[str, ...] = ("data", "fsdp", "expert")
    """Mesh axes that count as data-parallel: ZeRO shards over their product and the batch is
    split over them. Axes the mesh does not have are ignored. `expert` is one by default, as
    in DeepSpeed-MoE and Megatron, where the expert-parallel ranks are data-parallel ranks for
    everything but the experts: each holds its own tokens, and an axis a rule already uses on a
    parameter (the experts' dim 0) is not added to it again."""

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
class MoeConfig:
    capacity_factor: float | None = None
    """Expert-parallel dispatch (mesh axis `expert` > 1): None is dropless, every routed token
    reaches its expert. A number f > 0 caps what one device sends one expert-axis peer at
    f x its balanced share; tokens past the cap are dropped (their expert output is zero) and
    counted (`zerojax.bridge.expert_parallel`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceParallelConfig:
    axis: str | None = None
    """Mesh axis the sequence is split over; None: no sequence parallelism. Setting it also
    splits the inputs' sequence dim over it (`inputs.sequence_axis`) and adds it to the axes
    ZeRO shards over (DeepSpeed-Ulysses' data x sequence group); the batch is not split on it."""

    attention: str = "auto"
    """ulysses, ring or auto (SEQUENCE_PARALLEL_ATTENTION): how attention crosses the split
    (`zerojax.bridge.sequence_parallel`)."""

    modules: tuple[str, ...] = ()
    """Module path regexes (full match against a path as in `named_modules()`, e.g.
    `model\\.vision_tower`): only attention inside a matching module runs sequence-parallel,
    the rest runs whole (per-module layouts: a vision tower split over `sequence` beside a
    tensor-parallel language model). Empty: every attention, and the inputs' sequence dim is
    split; with modules the inputs are not split (the split starts inside those modules)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointingConfig:
    modules: tuple[tuple[str, str], ...] = ()
    """(module path regex, policy) in the order written: each submodule whose path (as in
    `named_modules()`, e.g. `transformer.h.3`) fully matches a regex has its forward
    rematerialised with that policy (the first matching rule, outermost module first)."""

    torch_checkpoint: str = "full"
    """Policy for the model's own `torch.utils.checkpoint.checkpoint` calls (and Hugging Face's
    `gradient_checkpointing_enable()`, which makes them): full is torch's semantics."""

    def policy_for(self, module_path: str) -> str | None:
        """The policy of the first rule matching `module_path`, None if none matches."""
        for pattern, policy in self.modules:
            if re.fullmatch(pattern, module_path):
                return policy
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    optimizer: str = "device"
    """Where the optimizer state (Adam's moments, SGD's momentum, step counts) lives: device, or
    host (ZeRO-Offload; needs ZeRO stage >= 1). Host state stays on its ZeRO shard, in the host
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

    @property
    def host_states(self) -> tuple[str, ...]:
        """The states placed in host memory, in field order."""
        return tuple(
            name
            for name in ("optimizer", "master", "params", "grads")
            if getattr(self, name) == "host"
        )


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

    report_effective_time: bool = False
    """Print where the run's time went (init, compile, checkpoints, steps) at exit. Off by
    default: only then does zerojax register an exit hook."""


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
    """Lower-case optimizer name, one of OPTIMIZER_TYPES: `zerojax.initialize` builds the torch
    optimizer from it when given none, and checks a given one against it."""

    params: tuple[tuple[str, Any], ...] = ()
    """torch constructor keyword arguments as (name, value) pairs, in the order given (lists
    become tuples); the keys OPTIMIZER_PARAMS allows for `type`."""

    @property
    def kwargs(self) -> dict[str, Any]:
        """The params as torch constructor keyword arguments."""
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

    trainer_autos: tuple[str, ...] = ()
    """DeepSpeed keys the config left "auto" for the Hugging Face Trainer to fill
    (`zerojax.config.deepspeed.TRAINER_AUTOS`): the Trainer training the model does those
    things itself (`zerojax.integrations.hf_trainer`); a model trained without one refuses to
    run, naming them."""

    source: str | None = None
    """File the config was read from, for messages."""

    format: str = "zerojax"
    """"zerojax" or "deepspeed": which schema the source was written in."""

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
