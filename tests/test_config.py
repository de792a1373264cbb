"""Config loading and validation: YAML/JSON/dict, DeepSpeed mapping, and the exact messages
users see for bad input.

Run: .venv/bin/python -m pytest -q tests/test_config.py
Exists because a config typo must be an error that names the key, never a silent default.
"""

import json
import re
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from zerojax.config import (
    Config,
    ConfigError,
    ConfigWarning,
    LossScaleConfig,
    load_config,
    parse_precision,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

NO_EFFECT = (
    "checked to multiply out with gradient accumulation and the data-parallel size, and otherwise "
    "without effect: zerojax does not load your data, so the batch your loader yields is the batch "
    "that trains"
)


def load(raw, num_devices=8):
    return load_config(raw, num_devices=num_devices)


# Each bad config and the exact message it must produce (matched in full, as a literal).
BAD_CONFIGS = [
    ({"mesh": {"data": -1, "tensor": 3}}, "mesh.tensor=3 does not divide 8 devices"),
    (
        {"mesh": {"data": 2, "tensor": 2}},
        (
            "mesh: data=2 x tensor=2 = 4 devices, but there are 8; make the product 8 or set one axis "
            "to -1 to fill the remaining devices"
        ),
    ),
    (
        {"mesh": {"data": -1, "fsdp": -1}},
        "mesh.data=-1 and mesh.fsdp=-1: at most one axis may be -1",
    ),
    ({"mesh": {"data": 0}}, "mesh.data=0: expected an integer >= 1"),
    ({"mesh": {"data": True}}, "mesh.data=true: expected an integer >= 1"),
    (
        {"mesh": {"tensr": 8}},
        (
            "mesh.tensr: unknown key (did you mean 'tensor'?); allowed keys: data, fsdp, tensor, "
            "expert, sequence"
        ),
    ),
    ({"mesh": [8]}, "mesh=[8]: expected a mapping of keys to values"),
    ({"zero_stage": 4}, "zero_stage=4: allowed: 0, 1, 2, 3"),
    ({"zero": {"stage": "3"}}, "zero.stage='3': allowed: 0, 1, 2, 3"),
    ({"zero_stage": 1, "zero": {"stage": 2}}, "zero_stage and zero.stage are both set; keep one"),
    (
        {"zero": {"data_parallel_axes": ["data", "batch"]}},
        "zero.data_parallel_axes[1]='batch': allowed: data, fsdp, tensor, expert, sequence",
    ),
    (
        {"zero": {"max_replicated_fraction": 1.5}},
        "zero.max_replicated_fraction=1.5: expected a number between 0 and 1.0",
    ),
    (
        {"zero": {"max_replicated": 0.5}},
        (
            "zero.max_replicated: unknown key (did you mean 'max_replicated_fraction'?); allowed keys: "
            "stage, data_parallel_axes, max_replicated_fraction"
        ),
    ),
    (
        {"zero_sage": 3},
        (
            "zero_sage: unknown key (did you mean 'zero_stage'?); allowed keys: mesh, zero_stage, "
            "zero, rules, inputs, precision, kernels, moe, sequence_parallel, offload, checkpoint, "
            "activation_checkpointing, train, devices, runtime, optimizer"
        ),
    ),
    (
        {"moe": {"capacity_factor": 0}},
        "moe.capacity_factor=0: expected a number > 0",
    ),
    (
        {"moe": {"capacity": 1.25}},
        (
            "moe.capacity: unknown key (did you mean 'capacity_factor'?); allowed keys: "
            "capacity_factor"
        ),
    ),
    (
        {"rules": [{"pattern": "a", "spec": [None]}, "gpt2", {"pattern": "(", "spec": [None]}]},
        "rules[2].pattern: invalid regex '(': missing ), unterminated subpattern at position 0",
    ),
    (
        {"rules": ["gpt3"]},
        "rules[0]='gpt3': unknown preset; allowed: gpt2, nanogpt, llama, bert, expert",
    ),
    (
        {"mesh": {"data": 4, "tensor": 2}, "rules": [{"pattern": "w", "spec": ["expert"]}]},
        "rules[0].spec[0]='expert': axis 'expert' is not in the mesh; mesh axes: data, tensor",
    ),
    (
        {
            "mesh": {"data": 4, "tensor": 2},
            "rules": [{"pattern": "w", "spec": ["tensor", "tensor"]}],
        },
        'rules[0].spec=["tensor", "tensor"]: axis \'tensor\' is used by two dims',
    ),
    (
        {"rules": [{"pattern": "w"}]},
        "rules[0]: missing key 'spec'; a rule is {pattern: REGEX, spec: [per-dim axes]}",
    ),
    (
        {"rules": [{"pattern": "w", "spec": "data", "axes": 1}]},
        "rules[0].axes: unknown key; allowed keys: pattern, spec",
    ),
    (
        {"rules": [{"pattern": "w", "spec": "data"}]},
        (
            "rules[0].spec='data': expected a list with one entry per dim: null, an axis, or a list "
            "of axes"
        ),
    ),
    (
        {"inputs": {"sequence_axis": "sequence"}},
        "inputs.sequence_axis='sequence': allowed: data, null",
    ),
    (
        {"mesh": {"data": 8}, "sequence_parallel": {"axis": "sequence"}},
        (
            "sequence_parallel.axis='sequence': not in the mesh; mesh axes: data (add it to "
            "mesh:, e.g. mesh: {data: 2, sequence: 4})"
        ),
    ),
    (
        {"mesh": {"data": 2, "sequence": 4}, "sequence_parallel": {"attention": "flash"}},
        "sequence_parallel.attention='flash': allowed: ulysses, ring, auto",
    ),
    (
        {
            "mesh": {"data": 2, "sequence": 2, "tensor": 2},
            "inputs": {"sequence_axis": "tensor"},
            "sequence_parallel": {},
        },
        (
            "inputs.sequence_axis='tensor': differs from sequence_parallel.axis='sequence'; "
            "drop it (the section sets it)"
        ),
    ),
    (
        {"mesh": {"data": 2, "sequence": 4}, "sequence_parallel": {"modules": "vision"}},
        "sequence_parallel.modules='vision': expected a list of module path regexes",
    ),
    (
        {
            "mesh": {"data": 2, "sequence": 4},
            "inputs": {"batch_axes": ["data", "sequence"]},
            "sequence_parallel": {},
        },
        (
            'inputs.batch_axes=["data", "sequence"]: contains the sequence-parallel axis '
            "'sequence'; it splits the sequence, not the batch"
        ),
    ),
    (
        {"precision": {"param_dtype": "fp8"}},
        "precision.param_dtype='fp8': allowed: float32, bfloat16, float16",
    ),
    (
        {"precision": "params=bfloat16,master=float16"},
        "precision.master_dtype='float16': allowed: float32, null",
    ),
    (
        {"precision": "params=bfloat16,moment=float32"},
        (
            "precision='params=bfloat16,moment=float32': unknown key 'moment'; allowed: params, "
            "compute, output, master, optimizer_state, grad_reduce"
        ),
    ),
    (
        {"precision": "params=float32,master=float32"},
        (
            "precision.master_dtype='float32' with param_dtype='float32': the params already are "
            "float32 masters; set master_dtype to null or use a 16-bit param_dtype"
        ),
    ),
    (
        {"precision": {"param_dtype": "bfloat16", "loss_scale": "dynamic"}},
        (
            "precision.loss_scale is set but no param/compute/grad_reduce dtype is float16; loss "
            "scaling is only for float16 (remove it, or use float16)"
        ),
    ),
    (
        {"kernels": {"attention": "flash"}},
        "kernels.attention='flash': allowed: auto, pallas, xla, off",
    ),
    ({"checkpoint": {"max_to_keep": 0}}, "checkpoint.max_to_keep=0: expected an integer >= 1"),
    ({"train": {"gradient_clipping": -1.0}}, "train.gradient_clipping=-1.0: expected a number > 0"),
    (
        {"train": {"micro_batch_size": 4, "global_batch_size": 30}},
        (
            "train.global_batch_size=30 != train.micro_batch_size=4 x "
            "train.gradient_accumulation_steps=1 x data-parallel size 8 (= 32); batch sizes must "
            "multiply out"
        ),
    ),
    (
        {"train": {"global_batch_size": 12, "gradient_accumulation_steps": 2}},
        (
            "train.global_batch_size=12 is not divisible by train.gradient_accumulation_steps=2 x "
            "data-parallel size 8 (= 16); batch sizes must multiply out"
        ),
    ),
    (
        {"devices": {"platform": "gpu", "num_cpu_devices": 8}},
        "devices.num_cpu_devices=8: only applies to platform 'cpu', not 'gpu'",
    ),
    ({"devices": {"platform": "mps"}}, "devices.platform='mps': allowed: cpu, gpu, tpu, null"),
    (
        {"optimizer": {"type": "Lion"}},
        "optimizer.type='lion': allowed: adam, adamw, sgd, adadelta, adafactor, adagrad, adamax, "
        "asgd, nadam, radam, rmsprop, rprop",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}},
        (
            "optimizer.params.momentum: unknown key; allowed keys: lr, betas, eps, weight_decay, "
            "amsgrad, maximize"
        ),
    ),
    (
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": 1}}},
        "optimizer.params.nesterov=1: expected true or false",
    ),
    (
        {"optimizer": {"type": "adam", "params": {"betas": [0.9]}}},
        "optimizer.params.betas=[0.9]: expected [beta1, beta2], each in [0, 1)",
    ),
    (
        {"optimizer": {"type": "adam", "params": {"betas": [0.9, 1.0]}}},
        "optimizer.params.betas[1]=1.0: expected a number in [0, 1)",
    ),
    (
        {"optimizer": {"type": "sgd", "params": {"lr": -0.1}}},
        "optimizer.params.lr=-0.1: expected a number >= 0",
    ),
    (
        {"train": {"patch_clip_grad_norm": "yes"}},
        "train.patch_clip_grad_norm='yes': expected true or false",
    ),
]


@pytest.mark.parametrize("raw, message", BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
def test_bad_config_message(raw, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load(raw)


def test_sequence_parallel_section_splits_the_inputs_sequence_not_the_batch():
    config = load({"mesh": {"data": 2, "sequence": 4}, "sequence_parallel": {"attention": "ring"}})
    assert (config.sequence_parallel.axis, config.sequence_parallel.attention) == (
        "sequence",
        "ring",
    )
    assert config.inputs.sequence_axis == "sequence"
    # The batch (and DeepSpeed's batch-size arithmetic) counts the data axis only.
    assert (config.data_parallel_axes, config.data_parallel_size) == (("data",), 2)
    assert load({"mesh": {"data": 8}}).sequence_parallel.axis is None
    # Per-module: only attention inside the modules is split, so the inputs are not.
    vision = load(
        {
            "mesh": {"data": 2, "sequence": 4},
            "sequence_parallel": {"modules": [r"model\.vision_tower"]},
        }
    )
    assert vision.sequence_parallel.modules == (r"model\.vision_tower",)
    assert vision.inputs.sequence_axis is None


def test_long_context_example_splits_sequences_with_ring_attention():
    config = load(EXAMPLES / "long_context.yaml")
    assert dict(zip(config.mesh.axis_names, config.mesh.shape)) == {"data": 2, "sequence": 4}
    assert (config.sequence_parallel.axis, config.sequence_parallel.attention) == (
        "sequence",
        "ring",
    )
    assert config.inputs.sequence_axis == "sequence"
    assert config.activation_checkpointing.policy_for("lm.model.layers.1") == "full"


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_defaults_and_frozen():
    config = load({})
    assert config.mesh.axes == (("data", -1),) and config.mesh.shape == (8,)
    assert config.zero_stage == 0 and config.data_parallel_size == 8
    assert config.rules == () and config.optimizer is None and config.format == "zerojax"
    with pytest.raises(FrozenInstanceError):
        config.zero = None
    assert hash(config) == hash(load({}))  # frozen all the way down: usable as a static arg


def test_mesh_fill_and_order():
    config = load({"mesh": {"tensor": 2, "data": -1}})
    assert config.mesh.axis_names == ("tensor", "data") and config.mesh.shape == (2, 4)
    assert config.mesh.size("data") == 4 and config.mesh.size("expert") == 1
    assert load({"mesh": {"data": 2, "fsdp": 2, "tensor": 2}}).data_parallel_size == 4
    dp = load({"mesh": {"data": 4, "expert": 2}, "zero": {"data_parallel_axes": ["expert"]}})
    assert dp.data_parallel_axes == ("expert",) and dp.data_parallel_size == 2


def test_num_cpu_devices_sets_device_count():
    config = load_config({"devices": {"num_cpu_devices": 4}, "mesh": {"data": -1}})
    assert config.mesh.shape == (4,) and config.devices.platform == "cpu"


def test_rules_presets_expand_in_order():
    config = load(
        {
            "mesh": {"data": 4, "tensor": 2},
            "rules": [
                {"pattern": r"wte\.weight$", "spec": [None, "tensor"]},
                "gpt2",
                {"pattern": "x", "spec": [["data", "tensor"]]},
            ],
        }
    )
    assert config.rules[0].spec == (None, "tensor") and config.rules[0].origin == "rules[0]"
    assert all(r.preset == "gpt2" for r in config.rules[1:-1])
    assert config.rules[-1].spec == (("data", "tensor"),) and config.rules[-1].origin == "rules[2]"


def test_precision_string_and_loss_scale():
    assert parse_precision("params=bfloat16, compute=bfloat16 ,master=float32") == {
        "param_dtype": "bfloat16",
        "compute_dtype": "bfloat16",
        "master_dtype": "float32",
    }
    p = load({"precision": "params=bfloat16,compute=bfloat16,master=float32"}).precision
    assert (p.param_dtype, p.compute_dtype, p.master_dtype, p.output_dtype) == (
        "bfloat16",
        "bfloat16",
        "float32",
        "float32",
    )
    fp16 = load({"precision": "params=float16,compute=float16,master=float32"}).precision
    assert fp16.loss_scale == LossScaleConfig()  # float16 turns on dynamic loss scaling
    static = load({"precision": {"compute_dtype": "float16", "loss_scale": 128}}).precision
    assert static.loss_scale == LossScaleConfig(dynamic=False, initial_scale=128.0)


def test_batch_sizes_are_derived_and_said_to_have_no_other_effect():
    with pytest.warns(ConfigWarning, match=re.escape(f"train.global_batch_size: {NO_EFFECT}")):
        train = load({"train": {"global_batch_size": 64, "gradient_accumulation_steps": 2}}).train
    assert train.micro_batch_size == 4
    with pytest.warns(ConfigWarning, match=re.escape(f"train.micro_batch_size: {NO_EFFECT}")):
        assert load({"train": {"micro_batch_size": 2}}).train.global_batch_size == 16


def test_yaml_file_and_example(tmp_path):
    config = load_config(EXAMPLES / "zero3.yaml")
    assert config.mesh.axes == (("fsdp", -1),) and config.mesh.shape == (8,)
    assert config.zero_stage == 3 and config.rules[0].preset == "gpt2"
    assert config.source.endswith("zero3.yaml")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"mesh": {"fsdp": 8}, "zero_stage": 2}))
    assert load_config(path).zero_stage == 2


def test_yaml_syntax_error_shows_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("mesh:\n  data: 4\n  tensor: [2\nzero_stage: 3\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:4:11: YAML syntax error: "):
        load(path)


def test_json_syntax_error_shows_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "mesh": {"data": 8},\n  "zero_stage": 3,\n}\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:4:1: JSON syntax error: "):
        load(path)


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("zero_stage: 1\nmesh: {data: 8}\nzero_stage: 3\n")
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}:3:1: duplicate key 'zero_stage'$"
    ):
        load(path)


def test_missing_file():
    with pytest.raises(ConfigError, match="^cannot read config file /nonexistent.yaml: "):
        load("/nonexistent.yaml")


# ----------------------------------------------------------------------------- DeepSpeed


def test_deepspeed_example_maps_every_key():
    # The example uses only supported keys: the one warning says the batch sizes do nothing
    # beyond the consistency check.
    with pytest.warns(ConfigWarning) as record:
        config = load(EXAMPLES / "ds_config.json")
    assert [str(w.message) for w in record] == [
        f"train_micro_batch_size_per_gpu and train_batch_size: {NO_EFFECT}"
    ]
    assert config.format == "deepspeed" and config.zero_stage == 2
    assert config.mesh.axes == (("data", -1),)
    p = config.precision
    assert (
        p.param_dtype,
        p.compute_dtype,
        p.master_dtype,
        p.optimizer_state_dtype,
        p.grad_reduce_dtype,
    ) == ("bfloat16", "bfloat16", "float32", "float32", "float32")
    assert config.train.micro_batch_size == 4 and config.train.global_batch_size == 32
    assert config.train.gradient_clipping == 1.0
    assert config.optimizer.type == "adamw"
    assert config.optimizer.kwargs == {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.1,
    }


def test_deepspeed_pure_bf16_states():
    config = load(
        {
            "bf16": {
                "enabled": True,
                "bf16_master_weights_and_grads": True,
                "bf16_optimizer_states": True,
            },
            "zero_optimization": {"stage": 3},
        }
    )
    p = config.precision
    assert (p.master_dtype, p.grad_reduce_dtype, p.optimizer_state_dtype) == (
        None,
        "bfloat16",
        "bfloat16",
    )


def test_deepspeed_fp16_loss_scale():
    dynamic = load(
        {
            "fp16": {
                "enabled": True,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "hysteresis": 1,
                "min_loss_scale": 2,
            }
        }
    ).precision
    assert dynamic.param_dtype == "float16" and dynamic.master_dtype == "float32"
    assert dynamic.loss_scale == LossScaleConfig(
        dynamic=True, initial_scale=4096.0, window=500, hysteresis=1, min_scale=2.0
    )
    static = load({"fp16": {"enabled": True, "loss_scale": 1024}}).precision
    assert static.loss_scale == LossScaleConfig(dynamic=False, initial_scale=1024.0)


def test_deepspeed_adam_is_adamw_unless_told():
    assert (
        load(
            {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {}}
        ).optimizer.type
        == "adamw"
    )
    config = load(
        {
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}},
            "zero_optimization": {},
        }
    )
    assert config.optimizer.type == "adam" and config.optimizer.kwargs == {"lr": 1e-3}


def test_deepspeed_unsupported_keys_each_warn():
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10,
        "scheduler": {"type": "WarmupLR"},
        "zero_optimization": {"stage": 3, "overlap_comm": True},
        "bf16": {"enabled": True, "immediate_grad_update": True},
    }
    with pytest.warns(ConfigWarning) as record:
        config = load(raw)
    messages = sorted(str(w.message) for w in record)
    assert messages == sorted(
        [
            (
                "DeepSpeed key 'scheduler' is not supported by zerojax and is ignored (build a "
                "torch.optim.lr_scheduler on the optimizer zerojax.initialize returns (its "
                "param_groups drive every step); inside a Hugging Face Trainer its own schedule "
                "(lr_scheduler_type, warmup_steps) applies)"
            ),
            (
                "DeepSpeed key 'steps_per_print' is not supported by zerojax and is ignored "
                "(zerojax does not log steps; print in your loop)"
            ),
            f"train_micro_batch_size_per_gpu: {NO_EFFECT}",
            (
                "DeepSpeed key 'zero_optimization.overlap_comm' is not supported by zerojax and is "
                "ignored (XLA schedules and buckets communication itself)"
            ),
            "DeepSpeed key 'bf16.immediate_grad_update' is not supported by zerojax and is ignored",
        ]
    )
    assert config.zero_stage == 3 and config.train.global_batch_size == 16


def test_deepspeed_native_train_merges_with_deepspeed_keys():
    config = load(
        {
            "gradient_accumulation_steps": 2,
            "zerojax": {"train": {"gradient_clipping": 0.5}},
        }
    )
    train = config.train
    assert (train.gradient_accumulation_steps, train.gradient_clipping) == (2, 0.5)


def test_obsolete_clip_patch_key_loads_with_a_warning():
    """`train.patch_clip_grad_norm` (torch's clip_grad_norm_ needed it before gradients were
    live) still loads, so old configs keep working, and says it does nothing now."""
    with pytest.warns(ConfigWarning, match="patch_clip_grad_norm: no longer needed"):
        config = load({"train": {"patch_clip_grad_norm": True}})
    assert not hasattr(config.train, "patch_clip_grad_norm")


def test_deepspeed_optimizer_kernel_choices_warn():
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    with pytest.warns(ConfigWarning) as record:
        config = load({**raw, "zero_optimization": {"stage": 1}})
    assert [str(w.message) for w in record] == [
        (
            "DeepSpeed key 'optimizer.params.torch_adam' is not supported by zerojax and is "
            "ignored (zerojax compiles its own update)"
        )
    ]
    assert config.optimizer.kwargs == {"lr": 1e-3}


def test_deepspeed_native_section():
    config = load(
        {
            "zero_optimization": {"stage": 3},
            "zerojax": {"mesh": {"fsdp": 4, "tensor": 2}, "rules": ["llama"]},
        }
    )
    assert config.mesh.shape == (4, 2) and config.rules[0].preset == "llama"


DEEPSPEED_BAD = [
    (
        {"fp16": {"enabled": True}, "mesh": {"data": 8}},
        (
            "the config mixes DeepSpeed keys (fp16) with zerojax keys (mesh); in a DeepSpeed config "
            "put zerojax sections under a 'zerojax' key, or write the whole config in zerojax form"
        ),
    ),
    (
        {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
        "bf16.enabled and fp16.enabled are both true; enable at most one",
    ),
    (
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
        (
            "train_batch_size=30 != train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps=1 x "
            "data-parallel size 8 (= 32); batch sizes must multiply out"
        ),
    ),
    (
        {"train_batch_size": 12},
        (
            "train_batch_size=12 is not divisible by gradient_accumulation_steps=1 x data-parallel "
            "size 8 (= 8); batch sizes must multiply out"
        ),
    ),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4: allowed: 0, 1, 2, 3"),
    (
        {"train_micro_batch_size_per_gpu": "auto"},
        (
            'the DeepSpeed config leaves 1 value(s) "auto":\n'
            "  train_micro_batch_size_per_gpu: the Trainer fills it (per_device_train_batch_size)\n"
            "give these values, or train the model zerojax.initialize returns with the Hugging "
            "Face Trainer, which fills them from its arguments"
        ),
    ),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled='yes': expected true or false"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0: expected an integer >= 1"),
    (
        {"fp16": {"enabled": True, "loss_scale": -1}},
        "fp16.loss_scale=-1.0: allowed: 0 (dynamic) or a scale > 0",
    ),
    (
        {"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {}},
        "optimizer.type='onebitadam': allowed: "
        "adam, adamw, sgd, adadelta, adafactor, adagrad, adamax, asgd, nadam, radam, rmsprop, rprop",
    ),
    (
        {
            "optimizer": {"type": "Adam", "params": {"bias_correction": False}},
            "train_batch_size": 8,
        },
        (
            "optimizer.params.bias_correction=false: zerojax runs torch's Adam/AdamW, which always "
            "correct the bias; remove the key"
        ),
    ),
    (
        {"gradient_clipping": 1.0, "zerojax": {"train": {"patch_clip_grad_norm": 1}}},
        "zerojax.train.patch_clip_grad_norm=1: expected true or false",
    ),
    (
        {"train_batch_size": 8, "zerojax": {"zero_stage": 3}},
        (
            "zerojax.zero_stage: unknown key; allowed keys: mesh, rules, inputs, kernels, moe, "
            "sequence_parallel, offload, checkpoint, activation_checkpointing, train, devices, "
            "runtime"
        ),
    ),
]


@pytest.mark.parametrize("raw, message", DEEPSPEED_BAD, ids=[m[:40] for _, m in DEEPSPEED_BAD])
def test_bad_deepspeed_config_message(raw, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load(raw)


# transformers' documented ZeRO-3 config: "auto" wherever the Trainer fills a value.
HF_ZERO3_AUTO = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def test_every_deepspeed_auto_is_named_at_once():
    raw = {**HF_ZERO3_AUTO, "zerojax": {"devices": {"num_cpu_devices": "auto"}}}
    with pytest.raises(ConfigError) as caught:
        load(raw)
    lines = str(caught.value).splitlines()
    assert lines[0] == 'the DeepSpeed config leaves 14 value(s) "auto":'
    named = [line.split(":")[0].strip() for line in lines[1:-1]]
    assert named == [
        "fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
        "optimizer.params.eps", "optimizer.params.weight_decay",
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold", "gradient_accumulation_steps",
        "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu",
        "zerojax.devices.num_cpu_devices",
    ]  # fmt: skip
    assert "  gradient_clipping: the Trainer fills it (max_grad_norm)" in lines
    assert "  zerojax.devices.num_cpu_devices: no Trainer fills it: give the value" in lines
    # For a Trainer: the Trainer's keys are left to it; one it cannot fill is still refused.
    with pytest.raises(ConfigError, match="14 value"):
        load_config(raw, num_devices=8, trainer_autos=True)


def test_trainer_autos_are_left_to_the_trainer():
    with pytest.warns(ConfigWarning):  # overlap_comm: XLA schedules communication itself
        config = load_config(HF_ZERO3_AUTO, num_devices=8, trainer_autos=True)
    assert config.trainer_autos[:2] == ("fp16.enabled", "bf16.enabled")
    assert len(config.trainer_autos) == 13
    assert config.zero_stage == 3
    # The Trainer's own: its optimizer, accumulation and clipping; its autocast.
    assert config.optimizer is None
    assert config.train.gradient_accumulation_steps == 1
    assert config.train.gradient_clipping is None
    assert config.precision.param_dtype == "float32"


def test_load_config_passes_config_through():
    config = load({})
    assert load_config(config) is config and isinstance(config, Config)


def test_mesh_and_plan_take_a_loaded_config():
    """Loaded once, at the public entry point: below it a path or dict is a mistake."""
    from zerojax.sharding import make_mesh, make_sharding_plan

    with pytest.raises(TypeError, match=r"^make_mesh takes a Config, got dict; load it once"):
        make_mesh({"mesh": {"data": -1}})
    with pytest.raises(TypeError, match=r"^make_sharding_plan takes a Config, got str; load it"):
        make_sharding_plan({}, str(EXAMPLES / "zero3.yaml"))


# --- offload (issue 27) -------------------------------------------------------------------------

BF16_MASTER = "params=bfloat16,compute=bfloat16,master=float32"


def test_offload_section_defaults_to_device_and_names_host_states():
    assert load({}).offload.host_states == ()
    config = load(
        {
            "zero_stage": 2,
            "precision": BF16_MASTER,
            "offload": {"optimizer": "host", "master": "host"},
        }
    )
    assert (config.offload.optimizer, config.offload.master) == ("host", "host")
    assert config.offload.host_states == ("optimizer", "master")
    assert (config.offload.params, config.offload.grads) == ("device", "device")


OFFLOAD_BAD = [
    (
        {"zero_stage": 1, "offload": {"optimizer": "cpu"}},
        "offload.optimizer='cpu': allowed: device, host",
    ),
    (
        {"zero_stage": 1, "offload": {"optimiser": "host"}},
        (
            "offload.optimiser: unknown key (did you mean 'optimizer'?); allowed keys: optimizer, "
            "master, params, grads"
        ),
    ),
    (
        {"offload": {"optimizer": "host"}},
        (
            "offload.optimizer='host': needs ZeRO stage 1, 2 or 3 (as DeepSpeed's "
            "offload_optimizer does: each rank offloads its own shard of the state); set "
            "zero_stage to 1 or more"
        ),
    ),
    (
        {"zero_stage": 2, "offload": {"master": "host"}},
        (
            "offload.master='host': the precision policy keeps no master weights "
            "(precision.master_dtype is null: the params are what the optimizer updates); remove "
            "the key, or keep float32 masters (precision master=float32 with 16-bit params)"
        ),
    ),
    (
        {"zero_stage": 3, "offload": {"params": "host"}},
        (
            "offload.params='host': parameter offload (ZeRO-Infinity's CPU tier) keeps ZeRO-3's "
            "parameter shards on the host and brings each in where an op reads it; it needs "
            "zero_stage 3 and the update on the host: offload.optimizer, offload.grads (and "
            "offload.master where the precision keeps masters) set to host"
        ),
    ),
    (
        {"zero_stage": 2, "offload": {"params": "host", "grads": "host", "optimizer": "host"}},
        (
            "offload.params='host': parameter offload (ZeRO-Infinity's CPU tier) keeps ZeRO-3's "
            "parameter shards on the host and brings each in where an op reads it; it needs "
            "zero_stage 3 and the update on the host: offload.optimizer, offload.grads (and "
            "offload.master where the precision keeps masters) set to host"
        ),
    ),
    (
        {"zero_stage": 3, "offload": {"grads": "host"}},
        (
            "offload.grads='host': gradients go to the host for the host-side update "
            "(ZeRO-Offload): it needs offload.optimizer: host (and master: host where the "
            "precision keeps masters)"
        ),
    ),
    (
        {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        (
            "zero_optimization.offload_optimizer.device='cpu': needs zero_optimization.stage 1, 2 "
            "or 3 (DeepSpeed's rule: each rank offloads its own partition of the optimizer "
            "state); stage is 0"
        ),
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
        (
            "zero_optimization.offload_optimizer.device='nvme': NVMe offload (ZeRO-Infinity) is "
            "not supported: JAX places arrays in device or host memory only, so NVMe would mean "
            "swapping files outside the one XLA program; use device: cpu (host memory)"
        ),
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}},
        "zero_optimization.offload_optimizer.device='gpu': allowed: none, cpu, nvme",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
        (
            "zero_optimization.offload_optimizer.ratio=0.3: partial optimizer offload is not "
            "supported; allowed: 1.0 (all of it)"
        ),
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}},
        (
            "zero_optimization.offload_param.device='cpu': zerojax runs the optimizer update "
            "where the parameter shards live, on the host: add offload_optimizer: {device: cpu} "
            "as well"
        ),
    ),
    (
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            }
        },
        (
            "zero_optimization.offload_param.device='cpu': parameter offload needs "
            "zero_optimization.stage 3 (DeepSpeed's rule: only stage 3 partitions the "
            "parameters); stage is 2"
        ),
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        (
            "zero_optimization.offload_param.device='nvme': NVMe offload (ZeRO-Infinity) is not "
            "supported: JAX places arrays in device or host memory only, so NVMe would mean "
            "swapping files outside the one XLA program; use device: cpu (host memory)"
        ),
    ),
    (
        {"zero_optimization": {"stage": 3, "cpu_offload_params": True}},
        (
            "zero_optimization.cpu_offload_params=true: zerojax runs the optimizer update where "
            "the parameter shards live, on the host: add offload_optimizer: {device: cpu} as well"
        ),
    ),
]


@pytest.mark.parametrize("raw, message", OFFLOAD_BAD, ids=[m[:48] for _, m in OFFLOAD_BAD])
def test_bad_offload_config_message(raw, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load(raw)


def test_deepspeed_offload_optimizer_moves_optimizer_state_masters_and_grads_to_host():
    """DeepSpeed keeps the fp32 partition (masters) with the optimizer state on the CPU and
    copies the gradients there for its CPU optimizer; with no master copy (fp32, or
    *_master_weights_and_grads) the optimizer state and gradients move."""
    offload = {"device": "cpu", "pin_memory": True}
    config = load(
        {"zero_optimization": {"stage": 2, "offload_optimizer": offload}, "bf16": {"enabled": True}}
    )
    assert config.offload.host_states == ("optimizer", "master", "grads")
    assert load(
        {"zero_optimization": {"stage": 3, "offload_optimizer": offload}}
    ).offload.host_states == ("optimizer", "grads")
    pure = {"enabled": True, "bf16_master_weights_and_grads": True}
    assert load(
        {"zero_optimization": {"stage": 1, "offload_optimizer": offload}, "bf16": pure}
    ).offload.host_states == ("optimizer", "grads")
    legacy = load(
        {"zero_optimization": {"stage": 2, "cpu_offload": True}, "fp16": {"enabled": True}}
    )
    assert legacy.offload.host_states == ("optimizer", "master", "grads")


@pytest.mark.parametrize("order", ["param_first", "optimizer_first"])
def test_deepspeed_offload_param_moves_parameter_shards_to_host(order):
    """ZeRO-Infinity's CPU tier: offload_param with offload_optimizer under stage 3 puts every
    model state on the host, whichever key comes first."""
    keys = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    if order == "optimizer_first":
        keys = dict(reversed(keys.items()))
    config = load({"zero_optimization": {"stage": 3, **keys}, "bf16": {"enabled": True}})
    assert config.offload.host_states == ("optimizer", "master", "params", "grads")
    legacy = load(
        {"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True}}
    )
    assert legacy.offload.host_states == ("optimizer", "params", "grads")


def test_deepspeed_offload_param_keys_warn_or_fail_by_name():
    """No offload_param key is passed over: those without effect warn, unknown ones fail."""
    raw = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu", "pin_memory": False, "max_in_cpu": 10**9},
        }
    }
    with pytest.warns(ConfigWarning) as record:
        load(raw)
    assert [str(w.message) for w in record] == [
        (
            "DeepSpeed key 'zero_optimization.offload_param.pin_memory' = false has no effect: "
            "zerojax keeps offloaded state in pinned host memory (JAX's pinned_host memory "
            "kind), the host memory XLA can transfer to and from inside the training program"
        ),
        (
            "DeepSpeed key 'zero_optimization.offload_param.max_in_cpu' is not supported by "
            "zerojax and is ignored (it applies to device: nvme only)"
        ),
    ]
    raw["zero_optimization"]["offload_param"] = {"device": "cpu", "ratio": 0.5}
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_param\.ratio: unknown key"):
        load(raw)


def test_deepspeed_offload_device_none_offloads_nothing():
    off = {"device": "none", "pin_memory": True}
    config = load(
        {"zero_optimization": {"stage": 3, "offload_optimizer": off, "offload_param": off}}
    )
    assert config.offload.host_states == ()


def test_deepspeed_offload_keys_without_effect_warn_with_the_reason():
    raw = {
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": False, "buffer_count": 4},
        }
    }
    with pytest.warns(ConfigWarning) as record:
        config = load(raw)
    assert [str(w.message) for w in record] == [
        (
            "DeepSpeed key 'zero_optimization.offload_optimizer.pin_memory' = false has no "
            "effect: zerojax keeps offloaded state in pinned host memory (JAX's pinned_host "
            "memory kind), the host memory XLA can transfer to and from inside the training "
            "program"
        ),
        (
            "DeepSpeed key 'zero_optimization.offload_optimizer.buffer_count' is not supported "
            "by zerojax and is ignored (it applies to device: nvme only)"
        ),
    ]
    assert config.offload.host_states == ("optimizer", "grads")
