"""ZeRO stages 0-3 as shardings: the plan, and the arrays placed with it.

Run: .venv/bin/python -m pytest -q tests/sharding/test_zero_plan.py
Exists because a ZeRO stage is only real if the arrays are split: every test places real arrays
with the plan's shardings and checks `array.sharding` and the per-device shard bytes.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import zerojax
from tests import tolerances
from zerojax.config import ConfigError, ConfigWarning, load_config
from zerojax.sharding import make_mesh, make_sharding_plan, zero_dims

pytestmark = pytest.mark.multidevice

EMBED, VOCAB, POSITIONS, LAYERS = 64, 256, 32, 2


def gpt2_shapes(vocab=VOCAB):
    """Hugging Face GPT-2 state_dict names and shapes (Conv1D weights are [in, out])."""
    shapes = {
        "transformer.wte.weight": (vocab, EMBED),
        "transformer.wpe.weight": (POSITIONS, EMBED),
    }
    for i in range(LAYERS):
        h = f"transformer.h.{i}"
        shapes |= {
            f"{h}.ln_1.weight": (EMBED,),
            f"{h}.ln_1.bias": (EMBED,),
            f"{h}.attn.c_attn.weight": (EMBED, 3 * EMBED),
            f"{h}.attn.c_attn.bias": (3 * EMBED,),
            f"{h}.attn.c_proj.weight": (EMBED, EMBED),
            f"{h}.attn.c_proj.bias": (EMBED,),
            f"{h}.ln_2.weight": (EMBED,),
            f"{h}.ln_2.bias": (EMBED,),
            f"{h}.mlp.c_fc.weight": (EMBED, 4 * EMBED),
            f"{h}.mlp.c_fc.bias": (4 * EMBED,),
            f"{h}.mlp.c_proj.weight": (4 * EMBED, EMBED),
            f"{h}.mlp.c_proj.bias": (EMBED,),
        }
    return shapes | {"transformer.ln_f.weight": (EMBED,), "transformer.ln_f.bias": (EMBED,)}


def structs(shapes, dtype=jnp.float32):
    return {n: jax.ShapeDtypeStruct(s, dtype) for n, s in shapes.items()}


def place(shapes, shardings):
    return {n: jax.device_put(np.zeros(s, np.float32), shardings[n]) for n, s in shapes.items()}


def device0_bytes(arrays) -> int:
    """Bytes device 0 holds for these arrays, read off the actual shards."""
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for a in arrays.values()
        for shard in a.addressable_shards
        if shard.device == device
    )


def plan_for(raw, shapes, **kwargs):
    config = load_config(raw, num_devices=8)
    return make_sharding_plan(structs(shapes, **kwargs), config, make_mesh(config))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_shardings_on_8_devices(stage):
    shapes = gpt2_shapes()
    plan = plan_for({"mesh": {"data": -1}, "zero_stage": stage}, shapes)
    assert plan.replicated == ()
    psi = sum(math.prod(s) for s in shapes.values())
    split = {
        c: 8 if on else 1
        for c, on in {
            "params": stage >= 3,
            "grads": stage >= 2,
            "opt_state": stage >= 1,
            "master_weights": stage >= 1,
            "compute_params": False,
        }.items()
    }
    for component, divisor in split.items():
        shardings = getattr(plan, component)
        arrays = place(shapes, shardings)
        for name, array in arrays.items():
            assert array.sharding == shardings[name], (component, name)
        # fp32: 4 bytes per parameter, split 8 ways exactly when the stage shards it.
        assert device0_bytes(arrays) == 4 * psi // divisor, component
    # The ZeRO paper's per-device bytes, fp32 Adam (K = 8: two moments), measured from arrays.
    adam = optax.adam(1e-3).init({n: jnp.zeros(s) for n, s in shapes.items()})
    adam = jax.tree.map(
        lambda x, s: jax.device_put(x, s), adam, plan.optimizer_state_shardings(adam)
    )
    measured = (
        device0_bytes(place(shapes, plan.params))
        + device0_bytes(place(shapes, plan.grads))
        + device0_bytes({str(i): a for i, a in enumerate(jax.tree.leaves(adam))})
    )
    formula = {
        0: 16 * psi,
        1: 8 * psi + 8 * psi // 8,
        2: 4 * psi + 12 * psi // 8,
        3: 16 * psi // 8,
    }[stage]
    assert measured == formula + 4  # + the replicated int32 step count


def test_stage3_shard_shapes_and_largest_dim():
    plan = plan_for({"mesh": {"data": 8}, "zero_stage": 3}, gpt2_shapes())
    arrays = place(gpt2_shapes(), plan.params)
    fc = arrays["transformer.h.0.mlp.c_fc.weight"]  # (64, 256): the 256 dim is split
    assert fc.sharding.spec == P(None, "data")
    assert fc.addressable_shards[0].data.shape == (64, 32)
    assert arrays["transformer.wte.weight"].addressable_shards[0].data.shape == (32, 64)
    assert arrays["transformer.ln_f.bias"].addressable_shards[0].data.shape == (8,)
    # Compute-time params drop the ZeRO axes: gathered whole on every device.
    compute = place(gpt2_shapes(), plan.compute_params)
    assert compute["transformer.h.0.mlp.c_fc.weight"].addressable_shards[0].data.shape == (64, 256)


def test_data_and_fsdp_axes_combine():
    plan = plan_for({"mesh": {"data": 4, "fsdp": 2}, "zero_stage": 3}, gpt2_shapes())
    assert plan.data_parallel_axes == ("data", "fsdp")
    fc = place(gpt2_shapes(), plan.params)["transformer.h.0.mlp.c_fc.weight"]
    assert fc.sharding.spec == P(None, ("data", "fsdp"))
    assert fc.addressable_shards[0].data.shape == (64, 32)
    assert plan.input_sharding(2).spec == P(("data", "fsdp"), None)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tensor_parallel_gpt2_preset_composes_with_zero(stage):
    shapes = gpt2_shapes()
    plan = plan_for(
        {"mesh": {"data": 4, "tensor": 2}, "zero_stage": stage, "rules": ["gpt2"]}, shapes
    )
    # Column-wise biases have one dim and the tensor rule takes it: ZeRO cannot split them too,
    # and says so (they are 0.6% of the bytes, well under the guard).
    assert (
        [(r.name, r.reason) for r in plan.replicated] == []
        if stage == 0
        else [
            (
                f"transformer.h.{i}.{b}",
                (
                    f"ZeRO-{stage}: no dim of ({n},) is divisible by 4 (data=4); "
                    "dims [0] are taken by a rule"
                ),
            )
            for i in (0, 1)
            for b, n in (("mlp.c_fc.bias", 256), ("attn.c_attn.bias", 192))
        ]
    )
    compute = place(shapes, plan.compute_params)
    params = place(shapes, plan.params)
    opt = place(shapes, plan.opt_state)
    qkv = "transformer.h.1.attn.c_attn.weight"  # Conv1D (64, 192): column-wise = dim 1
    proj = "transformer.h.1.attn.c_proj.weight"  # row-wise = dim 0
    assert compute[qkv].sharding.spec == P(None, "tensor")
    assert compute[qkv].addressable_shards[0].data.shape == (64, 96)
    assert compute[proj].sharding.spec == P("tensor", None)
    assert compute["transformer.wte.weight"].addressable_shards[0].data.shape == (128, 64)
    assert compute["transformer.h.1.attn.c_attn.bias"].sharding.spec == P("tensor")
    assert compute["transformer.h.1.attn.c_proj.bias"].sharding.spec == P(None)
    # ZeRO takes the largest dim the rule left free, never the tensor dim.
    assert opt[qkv].sharding.spec == (P("data", "tensor") if stage >= 1 else P(None, "tensor"))
    assert opt[qkv].addressable_shards[0].data.shape == ((16, 96) if stage >= 1 else (64, 96))
    expected = (16, 96) if stage == 3 else (64, 96)
    assert params[qkv].addressable_shards[0].data.shape == expected
    assert params["transformer.wte.weight"].sharding.spec == (
        P("tensor", "data") if stage == 3 else P("tensor", None)
    )
    assert plan.rule_for[qkv] == "rules[0] (preset 'gpt2')"
    assert plan.rule_for["transformer.h.1.ln_1.weight"] is None


def test_preset_on_mesh_without_tensor_axis_is_pure_zero():
    plan = plan_for({"mesh": {"fsdp": 8}, "zero_stage": 3, "rules": ["gpt2"]}, gpt2_shapes())
    qkv = plan.params["transformer.h.0.attn.c_attn.weight"]
    assert qkv.spec == P(None, "fsdp") and plan.compute_params["transformer.wte.weight"].spec == P(
        None, None
    )


def test_uneven_dims_are_reported_not_silently_replicated():
    shapes = gpt2_shapes() | {"odd.weight": (7, 3), "odd.scale": (5,)}
    plan = plan_for({"mesh": {"data": 8}, "zero_stage": 1}, shapes)
    assert [(r.name, r.shape, r.bytes) for r in plan.replicated] == [
        ("odd.weight", (7, 3), 84),
        ("odd.scale", (5,), 20),
    ]
    assert plan.replicated[0].reason == "ZeRO-1: no dim of (7, 3) is divisible by 8 (data=8)"
    assert plan.replicated[0].spec == P(None, None)
    opt = place(shapes, plan.opt_state)
    assert opt["odd.weight"].addressable_shards[0].data.shape == (7, 3)
    assert 0 < plan.replicated_fraction < 0.001


def test_rule_dim_that_does_not_divide_is_reported():
    shapes = gpt2_shapes(vocab=255)  # a vocabulary tensor=2 cannot split
    plan = plan_for(
        {
            "mesh": {"data": 4, "tensor": 2},
            "zero_stage": 3,
            "rules": ["gpt2"],
            "zero": {"max_replicated_fraction": 1.0},
        },
        shapes,
    )
    entry = plan.replicated[0]
    assert entry.name == "transformer.wte.weight" and entry.spec == P(None, "data")
    assert entry.reason == (
        "rules[0] (preset 'gpt2') splits dim 0 (size 255) over tensor=2, which does not divide it"
    )
    wte = place(shapes, plan.params)["transformer.wte.weight"]
    assert wte.addressable_shards[0].data.shape == (255, 16)  # still ZeRO-split on dim 1


def test_guard_fails_listing_five_largest():
    shapes = {f"odd{i}.weight": (7, 101 + 2 * i) for i in range(7)} | {"ok.weight": (8, 8)}
    with pytest.raises(ConfigError) as info:
        plan_for({"mesh": {"data": 8}, "zero_stage": 3}, shapes)
    message = str(info.value)
    # 7 x (101 + ... + 113) x 4 bytes = 20,972 replicated of 20,972 + 8 x 8 x 4 = 21,228.
    assert message.startswith(
        "ZeRO stage 3: 98.8% of parameter bytes (20,972 of 21,228) stay "
        "replicated, more than zero.max_replicated_fraction=0.1. Largest "
        "offenders:\n  odd6.weight shape=(7, 113) spec=P(None, None) "
        "(3,164 bytes): ZeRO-3: no dim of (7, 113) is divisible by 8 "
        "(data=8)\n"
    )
    assert message.endswith(
        "Fix: make those dims divisible by the mesh axes, change the rules, "
        "or raise zero.max_replicated_fraction."
    )
    listed = re.findall(r"^  (odd\d)\.weight", message, re.MULTILINE)
    assert listed == ["odd6", "odd5", "odd4", "odd3", "odd2"]
    # The fraction is configurable: raising it turns the failure into a report.
    plan = plan_for(
        {"mesh": {"data": 8}, "zero_stage": 3, "zero": {"max_replicated_fraction": 1.0}}, shapes
    )
    assert len(plan.replicated) == 7


def test_stage0_has_nothing_to_report():
    plan = plan_for({"mesh": {"data": 8}, "zero_stage": 0}, {"odd": (7,)})
    assert plan.replicated == () and plan.params["odd"].spec == P(None)


def test_unmatched_rules_warn():
    rules = [
        {"pattern": r"^nothing\.here$", "spec": [None]},
        "llama",
        "gpt2",
        {"pattern": r"wte", "spec": [None, None]},
    ]
    with pytest.warns(ConfigWarning) as record:
        plan_for({"mesh": {"data": 4, "tensor": 2}, "rules": rules}, gpt2_shapes())
    (warning,) = record
    assert str(warning.message) == (
        "sharding rules that match no parameter (check the pattern or the preset):\n"
        "  rules[0]: pattern '^nothing\\\\.here$'\n"
        "  rules[1] (preset 'llama'): none of its 7 patterns"
    )


def test_rule_with_too_many_dims():
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "rules[0]: spec ['tensor', None] has 2 dims but parameter 'transformer.ln_f.bias' "
            "matched by pattern 'ln_f\\\\.bias' has shape (64,); fix the spec or the pattern"
        ),
    ):
        plan_for(
            {
                "mesh": {"data": 4, "tensor": 2},
                "rules": [{"pattern": r"ln_f\.bias", "spec": ["tensor", None]}],
            },
            gpt2_shapes(),
        )


def test_expert_preset():
    shapes = {"moe.experts.w1": (4, 64, 128), "moe.experts.0.w1.weight": (128, 64)}
    plan = plan_for(
        {"mesh": {"data": 2, "expert": 4}, "zero_stage": 3, "rules": ["expert"]}, shapes
    )
    w1 = place(shapes, plan.params)["moe.experts.w1"]
    assert w1.sharding.spec == P("expert", None, "data")
    assert w1.addressable_shards[0].data.shape == (1, 64, 64)
    assert plan.rule_for["moe.experts.0.w1.weight"] is None


def test_zero_dims_is_pure():
    sizes = {"data": 4, "tensor": 2}
    assert zero_dims((64, 256), ((), ()), ("data",), sizes) == (((), ("data",)), None)
    assert zero_dims((64, 64), ((), ()), ("data",), sizes) == ((("data",), ()), None)
    assert zero_dims((64, 256), ((), ("tensor",)), ("data",), sizes) == (
        (("data",), ("tensor",)),
        None,
    )
    assert (
        zero_dims((6,), ((),), ("data",), sizes)[1] == "no dim of (6,) is divisible by 4 (data=4)"
    )


def test_mesh_from_config():
    config = load_config({"mesh": {"data": -1, "tensor": 2}}, num_devices=8)
    mesh = make_mesh(config)
    assert dict(mesh.shape) == {"data": 4, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    with pytest.raises(ConfigError, match="^mesh axes"):
        make_sharding_plan({}, config, make_mesh(load_config({"mesh": {"fsdp": 8}}, num_devices=8)))


def test_input_sharding_with_sequence_axis():
    plan = plan_for(
        {"mesh": {"data": 4, "sequence": 2}, "inputs": {"sequence_axis": "sequence"}}, {"w": (8, 8)}
    )
    x = jax.device_put(np.zeros((8, 16), np.int32), plan.input_sharding(2))
    assert x.sharding.spec == P("data", "sequence") and x.addressable_shards[0].data.shape == (2, 8)
    assert plan.input_sharding(1).spec == P("data")


def test_sequence_parallel_shards_zero_over_data_and_sequence_but_the_batch_over_data():
    """DeepSpeed-Ulysses' layout: every device along `sequence` holds the whole model for its
    own tokens, so ZeRO partitions over data x sequence; the batch is split over data only."""
    plan = plan_for(
        {"mesh": {"data": 2, "sequence": 4}, "zero_stage": 3, "sequence_parallel": {}},
        {"w": (64, 8)},
    )
    assert plan.data_parallel_axes == ("data", "sequence")
    assert plan.params["w"].spec == P(("data", "sequence"), None)
    assert plan.compute_params["w"].spec == P(None, None)
    assert plan.batch_axes == ("data",)
    assert plan.input_sharding(2).spec == P("data", "sequence")


def test_stage3_step_all_gathers_params():
    """Stage 3 stores params split and the compiled step gathers them for compute."""
    shapes = {"w1": (64, 256), "w2": (256, 8)}
    plan = plan_for({"mesh": {"data": 8}, "zero_stage": 3}, shapes)
    params = {n: jax.device_put(jnp.ones(s) / 64, plan.params[n]) for n, s in shapes.items()}
    x = jax.device_put(jnp.ones((16, 64)), plan.input_sharding(2))

    def loss(params, x):
        params = jax.lax.with_sharding_constraint(params, dict(plan.compute_params))
        return jnp.mean((jax.nn.relu(x @ params["w1"]) @ params["w2"]) ** 2)

    step = jax.jit(jax.grad(loss), out_shardings=dict(plan.grads))
    assert "all-gather" in step.lower(params, x).compile().as_text()
    grads = step(params, x)
    assert grads["w1"].sharding == plan.grads["w1"]
    assert grads["w1"].addressable_shards[0].data.shape == (64, 32)


def test_plan_from_converted_torch_mlp():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(8, 16)
    converted = zerojax.convert(model, (x,))
    config = load_config({"mesh": {"data": 8}, "zero_stage": 3}, num_devices=8)
    plan = make_sharding_plan(converted.params, config)
    assert set(plan.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    params = {n: jax.device_put(v, plan.params[n]) for n, v in converted.params.items()}
    assert params["0.weight"].sharding.spec == P("data", None)  # (64, 16): dim 0 is largest
    assert params["0.weight"].addressable_shards[0].data.shape == (8, 16)
    assert params["2.bias"].addressable_shards[0].data.shape == (1,)
    out, _ = jax.jit(converted.apply)(
        params, converted.buffers, jax.device_put(x.numpy(), plan.input_sharding(2))
    )
    # Running-error bound (tolerances.absolute: the MLP on |x| and |params|): 16 + 1 roundings
    # in the first layer, 64 + 1 in the second, per side (ReLU is exact and 1-Lipschitz).
    bound = tolerances.rounded_intermediates(
        torch.float32, 2 * (17 + 65), tolerances.absolute(model)(x.abs().double())
    )
    tolerances.assert_within(torch.tensor(np.asarray(out)), model(x).detach(), bound)


def test_device_settings_checked_against_running_jax():
    from zerojax.config import DevicesConfig
    from zerojax.sharding import configure_devices

    jax.devices()  # backends are up with the 8 devices tests/conftest.py asked for
    configure_devices(DevicesConfig(platform="cpu", num_cpu_devices=8))  # agrees: a no-op
    with pytest.raises(
        ConfigError, match=r"^devices.num_cpu_devices=4: JAX already started with 8"
    ):
        configure_devices(DevicesConfig(num_cpu_devices=4))
    with pytest.raises(ConfigError, match=r"resolved for 4 devices, but 8 are available"):
        make_mesh(load_config({"mesh": {"data": -1}}, num_devices=4))
