"""A config built in code is held to the rules of one read from a file, with the same messages.

Run: .venv/bin/python -m pytest -q tests/test_config_construction.py
Exists because the schema dataclasses are the one source of the config (issue 28): each checks
itself when built, `Config` checks the rules across sections, and `load_config` only turns a
file's mapping into those constructor calls. So `Config(zero=ZeroConfig(stage=7))` must fail
as `zero: {stage: 7}` does, `dataclasses.replace` must re-check, and a valid config built in code
must equal the one loaded from the same values.
"""

import re
from dataclasses import fields, replace

import pytest

from zerojax.config import (
    ActivationCheckpointingConfig,
    CheckpointConfig,
    Config,
    ConfigError,
    ConfigWarning,
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
    load_config,
)
from zerojax.config.schema import MESH_AXES, file_keys

MESH8 = MeshConfig(num_devices=8)  # what load_config(..., num_devices=8) resolves {} to


def load(raw):
    return load_config(raw, num_devices=8)


# (file form, the same values built in code): each must raise the same ConfigError message.
# Every section has at least one row; the rules across sections are `Config`'s.
SAME_ERROR = [
    pytest.param(
        {"mesh": {"data": -1, "tensor": 3}},
        lambda: MeshConfig(axes=(("data", -1), ("tensor", 3)), num_devices=8),
        id="mesh-divides",
    ),
    pytest.param(
        {"mesh": {"tensr": 8}},
        lambda: MeshConfig(axes=(("tensr", 8),), num_devices=8),
        id="mesh-unknown-axis",
    ),
    pytest.param({"zero": {"stage": 7}}, lambda: ZeroConfig(stage=7), id="zero-stage"),
    pytest.param(
        {"zero": {"max_replicated_fraction": 1.5}},
        lambda: ZeroConfig(max_replicated_fraction=1.5),
        id="zero-fraction",
    ),
    pytest.param(
        {"zero": {"data_parallel_axes": ["data", "batch"]}},
        lambda: ZeroConfig(data_parallel_axes=("data", "batch")),
        id="zero-axes",
    ),
    pytest.param(
        {"rules": [{"pattern": "(", "spec": [None]}]},
        lambda: Rule(pattern="(", spec=(None,), origin="rules[0]"),
        id="rule-regex",
    ),
    pytest.param(
        {
            "mesh": {"data": 4, "tensor": 2},
            "rules": [{"pattern": "w", "spec": ["tensor", "tensor"]}],
        },
        lambda: Rule(pattern="w", spec=("tensor", "tensor"), origin="rules[0]"),
        id="rule-axis-twice",
    ),
    pytest.param(
        {"mesh": {"data": 4, "tensor": 2}, "rules": [{"pattern": "w", "spec": ["expert"]}]},
        lambda: Config(
            mesh=MeshConfig(axes=(("data", 4), ("tensor", 2)), num_devices=8),
            rules=(Rule(pattern="w", spec=("expert",), origin="rules[0]"),),
        ),
        id="config-rule-axis-not-in-mesh",
    ),
    pytest.param(
        {"inputs": {"batch_dim": -1}}, lambda: InputsConfig(batch_dim=-1), id="inputs-dim"
    ),
    pytest.param(
        {"inputs": {"sequence_axis": "sequence"}},
        lambda: Config(mesh=MESH8, inputs=InputsConfig(sequence_axis="sequence")),
        id="config-inputs-axis-not-in-mesh",
    ),
    pytest.param(
        {"precision": {"param_dtype": "fp8"}},
        lambda: PrecisionConfig(param_dtype="fp8"),
        id="precision-dtype",
    ),
    pytest.param(
        {"precision": "params=float32,master=float32"},
        lambda: PrecisionConfig(master_dtype="float32"),
        id="precision-master",
    ),
    pytest.param(
        {"precision": {"param_dtype": "bfloat16", "loss_scale": "dynamic"}},
        lambda: PrecisionConfig(param_dtype="bfloat16", loss_scale=LossScaleConfig()),
        id="precision-loss-scale-without-fp16",
    ),
    pytest.param(
        {"precision": {"compute_dtype": "float16", "loss_scale": {"window": 0}}},
        lambda: LossScaleConfig(window=0),
        id="loss-scale-window",
    ),
    pytest.param(
        {"kernels": {"attention": "flash"}},
        lambda: KernelsConfig(attention="flash"),
        id="kernels",
    ),
    pytest.param({"moe": {"capacity_factor": 0}}, lambda: MoeConfig(capacity_factor=0), id="moe"),
    pytest.param(
        {"mesh": {"data": 2, "sequence": 4}, "sequence_parallel": {"attention": "flash"}},
        lambda: SequenceParallelConfig(axis="sequence", attention="flash"),
        id="sequence-parallel-attention",
    ),
    pytest.param(
        {"mesh": {"data": 8}, "sequence_parallel": {"axis": "sequence"}},
        lambda: Config(
            mesh=MeshConfig(axes=(("data", 8),), num_devices=8),
            sequence_parallel=SequenceParallelConfig(axis="sequence"),
        ),
        id="config-sequence-parallel-axis-not-in-mesh",
    ),
    pytest.param(
        {"zero_stage": 1, "offload": {"optimizer": "cpu"}},
        lambda: OffloadConfig(optimizer="cpu"),
        id="offload-place",
    ),
    pytest.param(
        {"offload": {"optimizer": "host"}},
        lambda: Config(mesh=MESH8, offload=OffloadConfig(optimizer="host")),
        id="config-offload-needs-zero",
    ),
    pytest.param(
        {"zero": {"stage": 2}, "offload": {"master": "host"}},
        lambda: Config(mesh=MESH8, zero=ZeroConfig(stage=2), offload=OffloadConfig(master="host")),
        id="config-offload-master-needs-masters",
    ),
    pytest.param(
        {"zero": {"stage": 3}, "offload": {"grads": "host"}},
        lambda: Config(mesh=MESH8, zero=ZeroConfig(stage=3), offload=OffloadConfig(grads="host")),
        id="config-offload-grads-need-optimizer",
    ),
    pytest.param(
        {"zero": {"stage": 2}, "offload": {"params": "host", "grads": "host", "optimizer": "host"}},
        lambda: Config(
            mesh=MESH8,
            zero=ZeroConfig(stage=2),
            offload=OffloadConfig(params="host", grads="host", optimizer="host"),
        ),
        id="config-offload-params-need-stage-3",
    ),
    pytest.param(
        {"checkpoint": {"max_to_keep": 0}},
        lambda: CheckpointConfig(max_to_keep=0),
        id="checkpoint",
    ),
    pytest.param(
        {"activation_checkpointing": {"modules": {r"h\.\d+": "sometimes"}}},
        lambda: ActivationCheckpointingConfig(modules=((r"h\.\d+", "sometimes"),)),
        id="activation-checkpointing-policy",
    ),
    pytest.param(
        {"activation_checkpointing": {"modules": {"(": "full"}}},
        lambda: ActivationCheckpointingConfig(modules={"(": "full"}),
        id="activation-checkpointing-regex",
    ),
    pytest.param(
        {"train": {"gradient_clipping": -1.0}},
        lambda: TrainConfig(gradient_clipping=-1.0),
        id="train-clipping",
    ),
    pytest.param(
        {"train": {"micro_batch_size": 4, "global_batch_size": 30}},
        lambda: Config(mesh=MESH8, train=TrainConfig(micro_batch_size=4, global_batch_size=30)),
        id="config-train-batch-sizes",
    ),
    pytest.param(
        {"devices": {"platform": "gpu", "num_cpu_devices": 8}},
        lambda: DevicesConfig(platform="gpu", num_cpu_devices=8),
        id="devices",
    ),
    pytest.param(
        {"runtime": {"effective_time_log": ""}},
        lambda: RuntimeConfig(effective_time_log=""),
        id="runtime",
    ),
    pytest.param(
        {"optimizer": {"type": "adam", "params": {"betas": [0.9, 1.0]}}},
        lambda: OptimizerConfig(type="adam", params=(("betas", (0.9, 1.0)),)),
        id="optimizer-betas",
    ),
    pytest.param(
        {"optimizer": {"type": "Lion"}},
        lambda: OptimizerConfig(type="Lion"),
        id="optimizer-type",
    ),
]


@pytest.mark.parametrize("raw, build", SAME_ERROR)
def test_built_in_code_fails_as_the_file_form(raw, build):
    with pytest.raises(ConfigError) as from_file:
        load(raw)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(from_file.value))}$"):
        build()


def test_messages_name_the_key_the_file_wrote():
    """`zero_stage` is the file's other spelling of `zero.stage`; DeepSpeed's batch keys are
    `train`'s fields: the message names what was written, in code the field."""
    with pytest.raises(ConfigError, match=r"^zero_stage=7: allowed: 0, 1, 2, 3$"):
        load({"zero_stage": 7})
    with pytest.raises(ConfigError, match=r"^zero\.stage=7: allowed: 0, 1, 2, 3$"):
        Config(zero=ZeroConfig(stage=7))
    with pytest.raises(ConfigError, match=r"^train_batch_size=12 is not divisible by"):
        load({"train_batch_size": 12})
    with pytest.raises(ConfigError, match=r"^train\.global_batch_size=12 is not divisible by"):
        Config(mesh=MESH8, train=TrainConfig(global_batch_size=12))


def test_replace_rechecks():
    config = load({"zero_stage": 2, "offload": {"optimizer": "host"}})
    with pytest.raises(ConfigError, match=r"^zero\.stage=7: allowed: 0, 1, 2, 3$"):
        replace(config, zero=replace(config.zero, stage=7))
    with pytest.raises(ConfigError, match=r"^offload\.optimizer='host': needs ZeRO stage 1, 2"):
        replace(config, zero=replace(config.zero, stage=0))
    with pytest.raises(ConfigError, match=r"^kernels\.attention='flash': allowed: "):
        replace(config.kernels, attention="flash")
    with pytest.raises(ConfigError, match=r"^Config\.kernels: expected a KernelsConfig, got str$"):
        replace(config, kernels="off")
    # What the code base builds this way stays valid: cli.py's stages and simulated devices.
    assert replace(config, zero=replace(config.zero, stage=3)).zero_stage == 3
    simulated = replace(config, devices=DevicesConfig(platform="cpu", num_cpu_devices=8))
    assert simulated.devices.num_cpu_devices == 8


def test_valid_config_built_in_code_equals_the_loaded_one():
    raw = {
        "devices": {"num_cpu_devices": 8},
        "mesh": {"data": 2, "sequence": 4},
        "zero_stage": 3,
        "inputs": {"batch_axes": "data"},
        "sequence_parallel": {"attention": "ring"},
        "precision": "params=float16,compute=float16,master=float32",
        "offload": {"optimizer": "host", "master": "host", "grads": "host"},
        "kernels": {"attention": "xla", "interpret": True},
        "moe": {"capacity_factor": 2},
        "checkpoint": {"directory": "/tmp/ckpt", "max_to_keep": None},
        "activation_checkpointing": {"modules": {r"h\.\d+": "save_dots"}},
        "train": {"micro_batch_size": 2, "gradient_clipping": 1},
        "runtime": {"compilation_cache_dir": None},
        "optimizer": {"type": "AdamW", "params": {"lr": 1, "betas": [0.9, 0.95]}},
    }
    with pytest.warns(ConfigWarning, match="train.micro_batch_size: checked to multiply out"):
        loaded = load(raw)
    built = Config(
        devices=DevicesConfig(num_cpu_devices=8),
        mesh=MeshConfig(axes=(("data", 2), ("sequence", 4)), num_devices=8),
        zero=ZeroConfig(stage=3),
        inputs=InputsConfig(batch_axes=["data"]),
        sequence_parallel=SequenceParallelConfig(axis="sequence", attention="ring"),
        precision=PrecisionConfig(
            param_dtype="float16", compute_dtype="float16", master_dtype="float32"
        ),
        offload=OffloadConfig(optimizer="host", master="host", grads="host"),
        kernels=KernelsConfig(attention="xla", interpret=True),
        moe=MoeConfig(capacity_factor=2),
        checkpoint=CheckpointConfig(directory="/tmp/ckpt", max_to_keep=None),
        activation_checkpointing=ActivationCheckpointingConfig(modules={r"h\.\d+": "save_dots"}),
        train=TrainConfig(micro_batch_size=2, gradient_clipping=1),
        runtime=RuntimeConfig(compilation_cache_dir=None),
        optimizer=OptimizerConfig(type="AdamW", params={"lr": 1, "betas": [0.9, 0.95]}),
    )
    assert built == loaded and hash(built) == hash(loaded)
    # Normalised as the file form is: derived values filled in, lists made tuples.
    assert built.devices.platform == "cpu"
    assert built.inputs.sequence_axis == "sequence"  # the section splits the inputs' sequence
    assert built.precision.loss_scale == LossScaleConfig()  # float16: dynamic loss scaling
    assert built.train.global_batch_size == 2 * 2  # micro x accumulation x data-parallel size
    assert built.optimizer.type == "adamw" and built.optimizer.kwargs["betas"] == (0.9, 0.95)
    assert load({}) == Config(mesh=MESH8)


SECTIONS = [f.name for f in fields(Config) if isinstance(f.default_factory, type)]


@pytest.mark.parametrize("section", SECTIONS)
def test_a_sections_allowed_keys_are_its_fields(section):
    cls = next(f.default_factory for f in fields(Config) if f.name == section)
    allowed = file_keys(cls)
    if section == "mesh":
        allowed = MESH_AXES  # the mesh's keys are axis names
    if section == "train":
        allowed += ("patch_clip_grad_norm",)  # obsolete: still loads, with a warning
    message = f"{section}.no_such_key: unknown key; allowed keys: {', '.join(allowed)}"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load({section: {"no_such_key": 1}})
