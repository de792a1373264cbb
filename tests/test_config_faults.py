"""Broken configs that used to pass silently or crash: each must now be a `ConfigError` that
names the key (or the file and position), quickly and without a memory blowup.

Run: .venv/bin/python -m pytest -q tests/test_config_faults.py
Exists because a fault probe found the 18 of 120 broken configs that did not raise one
(issue 41): typos in DeepSpeed sections that only warned (a bf16 run trained in fp32),
non-finite numbers, inconsistent loss-scale bounds, binary and over-deep files that gave raw
tracebacks, YAML merge keys refused, an alias bomb and a device count that exhausted memory.
"""

import json
import math
import re
import time
import tracemalloc
import warnings

import pytest

from tests.test_config import HF_ZERO3_AUTO
from zerojax.config import ConfigError, ConfigWarning, load_config
from zerojax.config.deepspeed import DEEPSPEED_KEYS
from zerojax.config.limits import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES
from zerojax.config.schema import MAX_CPU_DEVICES


def load(raw, num_devices=8):
    return load_config(raw, num_devices=num_devices)


def write(tmp_path, name, text):
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def refused(raw, pattern, num_devices=8):
    """The ConfigError's message, which must match `pattern` from its start."""
    with pytest.raises(ConfigError) as caught:
        load(raw, num_devices)
    message = str(caught.value)
    assert re.match(pattern, message), message
    return message


class bounded:
    """Asserts the block takes under `seconds` and allocates under `megabytes` at its peak
    (tracemalloc: Python's own allocations, which is where a bomb's expansion would go)."""

    def __init__(self, seconds=2.0, megabytes=20):
        self.seconds, self.megabytes = seconds, megabytes

    def __enter__(self):
        tracemalloc.start()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        elapsed = time.perf_counter() - self.start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert elapsed < self.seconds, f"took {elapsed:.2f} s"
        assert peak < self.megabytes * 2**20, f"peak {peak / 2**20:.1f} MB"


# ------------------------------------------------------------------ typos in DeepSpeed sections


@pytest.mark.parametrize(
    ("raw", "key", "hint"),
    [
        ({"bf16": {"enable": True}}, "bf16.enable", "enabled"),
        ({"fp16": {"enabeld": True}}, "fp16.enabeld", "enabled"),
        ({"train_batch_size": 8, "zero_optimization": {"stgae": 3}}, "zero_optimization.stgae", "stage"),
        ({"zero_optimization": {"stage": 3, "overlap_com": True}}, "zero_optimization.overlap_com", "overlap_comm"),
        ({"zero_optimization": {"stage": 2}, "data_types": {"grad_acum_dtype": "fp32"}}, "data_types.grad_acum_dtype", "grad_accum_dtype"),
        ({"train_batch_size": 8, "activation_checkpointing": {"partition_activation": True}}, "activation_checkpointing.partition_activation", "partition_activations"),
        ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "param": {"lr": 1e-3}}}, "optimizer.param", "params"),
        ({"train_batch_size": 8, "scheduler": {"typ": "WarmupLR"}}, "scheduler.typ", "type"),
    ],
)  # fmt: skip
def test_a_typo_in_a_deepspeed_section_is_an_error_with_a_hint(raw, key, hint):
    """`bf16: {enable: true}` used to train in float32 with no word, `stgae` to warn and fall
    back to stage 0."""
    message = refused(raw, rf"^{re.escape(key)}: unknown DeepSpeed key \(did you mean '{hint}'\?\)")
    assert message.startswith(f"{key}: unknown DeepSpeed key (did you mean '{hint}'?); ")


@pytest.mark.parametrize(
    "raw",
    [
        {"train_batch_size": 8, "zero_optimisation": {"stage": 3}},  # a DeepSpeed config
        {"zero_optimisation": {"stage": 3}},  # alone: read as a zerojax config
        {"zero_optimisation": {"stage": 3}, "mesh": {"data": -1}},
    ],
)
def test_a_misspelled_deepspeed_section_is_an_error_with_a_hint(raw):
    refused(raw, r"^zero_optimisation: unknown key \(did you mean 'zero_optimization'\?\); ")


def test_a_top_level_key_far_from_any_deepspeed_key_warns_as_deepspeed_ignores_it():
    """DeepSpeed ignores top-level keys it does not know (ds_configs carry their own, such as
    a run's name); only a near-miss of a real key is a typo."""
    with pytest.warns(ConfigWarning, match="'experiment_name' is not supported"):
        config = load_config(
            {"train_batch_size": 8, "experiment_name": "run-7", "zero_optimization": {"stage": 3}},
            num_devices=8,
        )
    assert config.zero_stage == 3


def test_every_deepspeed_key_zerojax_does_not_use_warns_and_loads():
    """A real DeepSpeed key is never an error: each top-level section zerojax ignores, each
    zero_optimization key it does not map, and the keys DeepSpeed added lately (super_offload,
    cpuadam_cores_perc, legacy_fusion were refused as unknown before) warn by name."""
    mapped = {"zero_optimization", "fp16", "bf16", "bfloat16", "data_types", "optimizer",
              "activation_checkpointing", "zerojax", "communication_data_type",
              "train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "gradient_clipping"}  # fmt: skip
    ignored = [key for key in DEEPSPEED_KEYS if key not in mapped]
    zero_keys = ["contiguous_gradients", "reduce_scatter", "sub_group_size", "zenflow",
                 "stage3_max_live_parameters", "max_live_parameters", "leaf_module",
                 "stage3_gather_16bit_weights_on_model_save", "zero_quantized_weights",
                 "mics_shard_size", "save_muon_momentum_buffer_in_memory"]  # fmt: skip
    raw = {
        **{key: {} for key in ignored},
        "zero_optimization": {
            "stage": 3,
            **dict.fromkeys(zero_keys, True),
            "offload_optimizer": {
                "device": "cpu",
                "super_offload": True,
                "cpuadam_cores_perc": 0.5,
            },
            "offload_param": {"device": "cpu", "buffer_size": 10**8},
        },
        "bf16": {"enabled": True, "check_grad_overflow": True},
        "data_types": {"param_dtype": "bf16"},
        "optimizer": {"type": "AdamW", "legacy_fusion": False, "params": {"lr": 1e-3}},
        "activation_checkpointing": {"profile": False},
    }
    with pytest.warns(ConfigWarning) as record:
        config = load(raw)
    warned = "\n".join(str(w.message) for w in record)
    for key in [*ignored, *(f"zero_optimization.{k}" for k in zero_keys),
                "zero_optimization.offload_optimizer.super_offload",
                "zero_optimization.offload_optimizer.cpuadam_cores_perc",
                "bf16.check_grad_overflow", "data_types.param_dtype",
                "optimizer.legacy_fusion", "activation_checkpointing.profile"]:  # fmt: skip
        assert f"DeepSpeed key '{key}' is not supported by zerojax" in warned, key
    assert config.zero_stage == 3 and config.precision.param_dtype == "bfloat16"
    assert config.offload.params == "host"


def test_deepspeeds_older_names_take_effect():
    """`bfloat16` (the section's older name) and `cpu_offload_param` are DeepSpeed's own
    spellings: they used to be ignored with a warning (a float32 run, no offload)."""
    assert load({"bfloat16": {"enabled": True}}).precision.param_dtype == "bfloat16"
    config = load(
        {"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True}}
    )
    assert config.offload.params == "host" and config.offload.optimizer == "host"


def test_generated_deepspeed_configs_still_load():
    """accelerate's DeepSpeedPlugin writes `steps_per_print: inf` ("never print"): the one
    infinity a config may hold. Hugging Face's documented ZeRO-3 config uses "auto" values."""
    accelerate = pytest.importorskip("accelerate.utils")
    plugin = accelerate.DeepSpeedPlugin(
        zero_stage=3, gradient_accumulation_steps=2, gradient_clipping=1.0,
        offload_optimizer_device="cpu", offload_param_device="cpu",
    )  # fmt: skip
    ds = plugin.deepspeed_config
    assert ds["steps_per_print"] == math.inf
    with pytest.warns(ConfigWarning, match="'steps_per_print'"):
        config = load_config(ds, num_devices=8, trainer_autos=True)
    assert config.zero_stage == 3 and config.offload.params == "host"
    assert config.trainer_autos == ("train_batch_size", "train_micro_batch_size_per_gpu")
    with pytest.warns(ConfigWarning):
        assert load_config(HF_ZERO3_AUTO, num_devices=8, trainer_autos=True).zero_stage == 3
    # Only there, only +inf: a DeepSpeed number elsewhere, or NaN there, is refused.
    refused({**ds, "steps_per_print": math.nan}, r"^steps_per_print=NaN: not a finite number")


# ----------------------------------------------------------------------- non-finite numbers


@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        ("lr.yaml", "optimizer: {type: adamw, params: {lr: .inf}}\n", "optimizer.params.lr=Infinity"),
        ("lr.json", '{"optimizer": {"type": "adamw", "params": {"lr": Infinity}}}', "optimizer.params.lr=Infinity"),
        ("lr309.yaml", "optimizer: {type: adamw, params: {lr: 1.0e+309}}\n", "optimizer.params.lr=Infinity"),
        ("lr309.json", '{"optimizer": {"type": "adamw", "params": {"lr": 1.0e+309}}}', "optimizer.params.lr=Infinity"),
        ("nan.yaml", "train: {gradient_clipping: .nan}\n", "train.gradient_clipping=NaN"),
        ("scale.yaml", "precision: {param_dtype: float16, loss_scale: .inf}\n", "precision.loss_scale=Infinity"),
        ("scale.json", '{"fp16": {"enabled": true, "loss_scale": Infinity}}', "fp16.loss_scale=Infinity"),
        ("deep.json", '{"zero_optimization": {"stage": 3}, "scheduler": {"params": {"warmup_max_lr": -Infinity}}}', "scheduler.params.warmup_max_lr=-Infinity"),
    ],
)  # fmt: skip
def test_non_finite_numbers_are_refused_naming_the_key(tmp_path, name, text, key):
    """Both parsers read 1.0e+309 as infinity; no learning rate or scale is meant to be one.
    Refused anywhere, even in a section zerojax ignores."""
    path = write(tmp_path, name, text)
    refused(path, rf"^{re.escape(key)}: not a finite number ")


def test_non_finite_numbers_built_in_code_are_refused():
    from zerojax.config import LossScaleConfig, OptimizerConfig

    with pytest.raises(
        ConfigError,
        match=r"^precision\.loss_scale\.initial_scale=Infinity: expected a finite number$",
    ):
        LossScaleConfig(initial_scale=math.inf)
    with pytest.raises(
        ConfigError, match=r"^optimizer\.params\.lr=<a 1329-bit integer>: expected a finite number$"
    ):
        OptimizerConfig(type="adamw", params={"lr": 10**400})  # float() of it overflows


# ------------------------------------------------------------------------- loss-scale bounds


def test_min_scale_above_the_initial_scale_is_refused():
    refused(
        {"precision": {"param_dtype": "float16", "loss_scale": {"initial_scale": 2.0, "min_scale": 8.0}}},
        r"^precision\.loss_scale\.min_scale=8\.0: above initial_scale=2: ",
    )  # fmt: skip
    refused(
        {"fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 8}},
        r"^fp16\.min_loss_scale=8: above the initial scale 2\*\*initial_scale_power = 4: ",
    )
    # A fixed scale has no floor to keep: DeepSpeed's default min_loss_scale 1 beside it loads.
    config = load({"fp16": {"enabled": True, "loss_scale": 0.5}})
    assert config.precision.loss_scale.initial_scale == 0.5


@pytest.mark.parametrize("power", [1024, 65, -1])
def test_initial_scale_power_out_of_range_is_refused_saying_the_range(power):
    """2**1024 overflowed float() with a raw OverflowError."""
    refused(
        {"fp16": {"enabled": True, "initial_scale_power": power}},
        rf"^fp16\.initial_scale_power={power}: expected an integer (between 0 and 64|>= 0)$",
    )
    assert (
        load(
            {"fp16": {"enabled": True, "initial_scale_power": 64}}
        ).precision.loss_scale.initial_scale
        == 2.0**64
    )


def test_loss_scale_beyond_float32_and_counts_beyond_int32_are_refused():
    """The scale is a float32 and window/hysteresis int32s in the program: larger values
    became inf or an OverflowError at the first step."""
    refused(
        {"precision": {"param_dtype": "float16", "loss_scale": 1e39}},
        r"^precision\.loss_scale=1e\+39: the loss scale is a float32 in the program: at most 3\.402823e\+38$",
    )
    refused(
        {"fp16": {"enabled": True, "loss_scale_window": 2**40}},
        r"^fp16\.loss_scale_window=1099511627776: expected an integer between 1 and 2147483647$",
    )


# ------------------------------------------------------------------- hostile and broken input


def test_a_binary_file_names_the_file_and_byte_offset(tmp_path):
    path = write(tmp_path, "model.yaml", b"mesh: {data: 8}\n" + bytes(range(128, 256)))
    with bounded():
        message = refused(path, re.escape(f"{path}: byte 16 (0x80) is not UTF-8 text"))
    assert "binary" in message


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000, "1:65"),
        ("deep.yaml", "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "x: 1\n", "64:"),
        ("deep_flow.yaml", "mesh: " + "[" * 500 + "]" * 500 + "\n", "1:70"),
    ],
)  # fmt: skip
def test_deep_nesting_is_refused_before_any_recursion(tmp_path, name, text, where):
    """Used to be a RecursionError from json's and PyYAML's recursive readers."""
    path = write(tmp_path, name, text)
    with bounded():
        refused(path, rf"^{re.escape(str(path))}:{where}\S*: nested deeper than {MAX_DEPTH} levels")


ALIAS_BOMB = """\
zero_stage:
  - &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
  - &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
  - &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
  - &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
  - &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
  - &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
  - &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
  - &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
  - &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    """A billion "lol"s in 363 bytes; the error message used to json.dumps the expansion."""
    path = write(tmp_path, "bomb.yaml", ALIAS_BOMB)
    with bounded():
        refused(
            path,
            rf"^{re.escape(str(path))}:7:5: this value expands to more than {MAX_VALUES:,} values",
        )


def test_a_yaml_merge_bomb_and_a_recursive_alias_are_refused(tmp_path):
    levels = ["l0: &l0 {" + ", ".join(f"k{i}: {i}" for i in range(9)) + "}"]
    levels += [f"l{n}: &l{n} {{<<: [{', '.join([f'*l{n - 1}'] * 9)}]}}" for n in range(1, 9)]
    path = write(tmp_path, "merge_bomb.yaml", "\n".join(levels) + "\n")
    with bounded():
        refused(path, rf"^{re.escape(str(path))}:\d+:\d+: this value expands to more than")
    path = write(tmp_path, "loop.yaml", "zero: &z {stage: [*z]}\n")
    with bounded():
        refused(
            path, rf"^{re.escape(str(path))}:1:7: a YAML alias refers to a value that contains it"
        )


def test_a_reference_bomb_built_in_code_is_refused_and_its_message_is_short():
    """A dict given in code can share references too: 10**10 leaves in a few KB."""
    bomb = ["lol"] * 10
    for _ in range(9):
        bomb = [bomb] * 10
    with bounded():
        refused(
            {"zero_stage": bomb},
            rf"^zero_stage(\[0\])+: expands to more than {MAX_VALUES:,} values",
        )
    # Under the count, a bad value is rendered cut short, not whole.
    with bounded():
        message = refused({"zero_stage": [["x" * 10**6] * 1000] * 90}, r"^zero_stage=\[\[")
    assert len(message) < 400 and "..." in message


@pytest.mark.parametrize(
    "raw",
    [
        {"precision": "params=" + "x" * 10**6},  # the one-string form
        {"precision": "y" * 10**6},
        {"rules": [{"pattern": "(" * 10**6, "spec": [None]}]},  # re's complaint
        {"activation_checkpointing": {"modules": {"(" * 10**6: "full"}}},
        {"mesh": {"data": "z" * 10**6}},
    ],
    ids=["precision-value", "precision-part", "rule-pattern", "remat-pattern", "mesh-size"],
)
def test_messages_are_short_whatever_the_value(raw):
    """A message shows at most ~200 characters of a value (they showed all of it)."""
    with pytest.raises(ConfigError) as caught:
        load(raw)
    assert len(str(caught.value)) < 1000, len(str(caught.value))


def test_an_oversized_file_and_a_huge_integer_literal_are_refused(tmp_path):
    path = write(tmp_path, "big.yaml", "# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    with bounded():
        refused(path, rf"^{re.escape(str(path))}: larger than {MAX_FILE_BYTES:,} bytes")
    for name in ("int.yaml", "int.json"):
        text = (
            "zero_stage: " + "9" * 5000
            if name.endswith("yaml")
            else '{"zero_stage": ' + "9" * 5000 + "}"
        )
        path = write(tmp_path, name, text)
        refused(
            path, rf"^{re.escape(str(path))}: (YAML|JSON) error: Exceeds the limit \(4300 digits\)"
        )


def test_num_cpu_devices_is_bounded_before_jax_sees_it():
    """100,000 simulated devices grew past 6 GB and hung; refused before JAX starts."""
    with bounded(seconds=2.0):
        refused(
            {"devices": {"num_cpu_devices": 100_000}},
            rf"^devices\.num_cpu_devices=100000: expected an integer between 1 and {MAX_CPU_DEVICES}$",
            num_devices=None,
        )


# ------------------------------------------------------------------------------ merge keys


def test_yaml_merge_keys_merge_and_own_keys_win(tmp_path):
    """`<<: *base` is YAML (1.1 merge keys): it used to be refused as an unknown tag."""
    path = write(
        tmp_path,
        "merge.yaml",
        "base: &base {param_dtype: bfloat16, compute_dtype: bfloat16, master_dtype: float32}\n"
        "precision:\n  <<: *base\n  compute_dtype: float32\n",
    )
    with pytest.raises(ConfigError, match=r"^base: unknown key"):
        load(path)  # the anchor's own key is still checked like any other
    path = write(
        tmp_path,
        "merge.yaml",
        "precision:\n  <<: &base {param_dtype: bfloat16, compute_dtype: bfloat16,"
        " master_dtype: float32}\n  compute_dtype: float32\n"
        "train:\n  <<: [{gradient_accumulation_steps: 4}, {gradient_clipping: 1.0}]\n",
    )
    config = load(path)
    assert config.precision.param_dtype == "bfloat16" and config.precision.master_dtype == "float32"
    assert config.precision.compute_dtype == "float32"  # the mapping's own key wins
    assert (config.train.gradient_accumulation_steps, config.train.gradient_clipping) == (4, 1.0)


def test_duplicate_keys_stay_refused_beside_merge_keys(tmp_path):
    path = write(
        tmp_path, "dup.yaml", "train:\n  <<: {gradient_clipping: 1.0}\n  gradient_clipping: 0.5\n"
        "  gradient_clipping: 2.0\n",
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}:4:3: duplicate key 'gradient_clipping'$"
    ):
        load(path)
    path = write(tmp_path, "dup.json", json.dumps({"a": 1})[:-1] + ', "a": 2}')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: duplicate key 'a'$"):
        load(path)


def test_nothing_here_warns_about_a_valid_config():
    """The checks add no warning to a plain zerojax config."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(
            {
                "mesh": {"data": -1},
                "zero_stage": 3,
                "precision": "params=bfloat16,compute=bfloat16,master=float32",
            }
        )
