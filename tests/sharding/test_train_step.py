"""The sharded train step: same loss on every mesh and ZeRO stage, state where the plan says.

Run: .venv/bin/python -m pytest -q tests/sharding/test_train_step.py
Exists because ZeRO and tensor parallelism must change where arrays live, never the numbers: five
AdamW steps of a converted torch MLP give the same loss (1e-6) at stages 0-3 on 8 devices, on a
4x2 data x tensor mesh and on one device, and afterwards every param, gradient and optimizer-state
array has exactly the sharding of the plan (read off the arrays, not the plan).
"""

import jax
import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P

import zerojax
from bench.architectures import MLP
from zerojax.config import load_config
from zerojax.sharding import make_mesh, make_sharding_plan
from zerojax.sharding.step import make_train_step, model_scalar_loss

pytestmark = pytest.mark.multidevice

NUM_STEPS = 5
BATCH, IN, HIDDEN, CLASSES = 16, 32, 64, 16
# Megatron-style tensor parallelism for the MLP: fc1 column-wise, fc2 row-wise.
TENSOR_RULES = [
    {"pattern": r"^fc1\.weight$", "spec": ["tensor", None]},
    {"pattern": r"^fc1\.bias$", "spec": ["tensor"]},
    {"pattern": r"^fc2\.weight$", "spec": [None, "tensor"]},
]
OPTIMIZER = optax.adamw(1e-2, weight_decay=0.1)


def adamw_update(params, grads, state):
    updates, state = OPTIMIZER.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def cross_entropy(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    x = torch.randn(BATCH, IN)
    y = torch.randint(0, CLASSES, (BATCH,))
    converted = zerojax.convert(MLP(IN, HIDDEN, CLASSES), (x,))
    return converted, (x.numpy(), y.numpy())


def train(converted, batch, raw_config, devices=None):
    """Five steps; returns (losses, step, params, opt_state)."""
    config = load_config(raw_config, num_devices=len(devices or jax.devices()))
    plan = make_sharding_plan(converted.params, config, make_mesh(config, devices=devices))
    step = make_train_step(converted, plan, adamw_update, loss_fn=cross_entropy, num_model_inputs=1)
    params = step.shard_params(converted.params)
    opt_state = step.init_opt_state(OPTIMIZER.init, params)
    buffers, batch = converted.buffers, step.shard_batch(batch)
    initial, losses = params, []
    for _ in range(NUM_STEPS):
        params, opt_state, buffers, loss = step(params, opt_state, buffers, batch)
        losses.append(float(loss))
    # Params are donated to the step; shard_params copied, so the converted ones survive.
    assert all(a.is_deleted() for a in initial.values())
    assert not any(a.is_deleted() for a in converted.params.values())
    return losses, step, params, opt_state


def assert_placed_per_plan(step, params, opt_state):
    plan = step.plan
    for name, array in params.items():
        assert array.sharding.spec == plan.params[name].spec, name
        assert array.sharding.mesh == plan.mesh, name
    expected = plan.optimizer_state_shardings(opt_state)
    for (path, array), sharding in zip(
        jax.tree_util.tree_leaves_with_path(opt_state), jax.tree.leaves(expected)
    ):
        assert array.sharding.is_equivalent_to(sharding, array.ndim), path


@pytest.fixture(scope="module")
def reference_losses(mlp):
    """One device, no sharding at all: the losses every layout must reproduce."""
    converted, batch = mlp
    losses, step, params, _ = train(
        converted, batch, {"mesh": {"data": -1}}, devices=jax.devices()[:1]
    )
    assert step.plan.mesh.size == 1
    assert all(a.sharding.device_set == {jax.devices()[0]} for a in params.values())
    assert losses[-1] < losses[0]  # it trains
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_match_one_device(mlp, reference_losses, stage):
    converted, batch = mlp
    losses, step, params, opt_state = train(
        converted, batch, {"mesh": {"data": 8}, "zero_stage": stage}
    )
    np.testing.assert_allclose(losses, reference_losses, rtol=0, atol=1e-6)
    assert_placed_per_plan(step, params, opt_state)
    # fc2.weight is (64, 64): ZeRO splits dim 0 over the 8 data ranks where the stage says.
    mu = opt_state[0].mu["fc2.weight"]
    assert mu.addressable_shards[0].data.shape == ((8, 64) if stage >= 1 else (64, 64))
    assert params["fc2.weight"].sharding.spec == (P("data", None) if stage == 3 else P(None, None))
    assert params["fc2.weight"].addressable_shards[0].data.shape == (
        (8, 64) if stage == 3 else (64, 64)
    )
    if stage >= 2:  # gradients as the step produces them, before the update
        _, grads, _ = step.loss_and_grads(params, converted.buffers, step.shard_batch(batch))
        for name, grad in grads.items():
            assert grad.sharding.spec == step.plan.grads[name].spec, name
        assert grads["fc2.weight"].addressable_shards[0].data.shape == (8, 64)
    if stage == 3:
        compiled = step.compile(params, opt_state, converted.buffers, step.shard_batch(batch))
        assert "all-gather" in compiled.as_text()  # params gathered for compute
        assert compiled.memory_analysis().alias_size_in_bytes > 0  # params/opt state donated


def test_tensor_parallel_4x2_matches_one_device(mlp, reference_losses):
    converted, batch = mlp
    raw = {"mesh": {"data": 4, "tensor": 2}, "zero_stage": 3, "rules": TENSOR_RULES}
    losses, step, params, opt_state = train(converted, batch, raw)
    np.testing.assert_allclose(losses, reference_losses, rtol=0, atol=1e-6)
    assert_placed_per_plan(step, params, opt_state)
    # fc1.weight (64, 32): the rule splits dim 0 over tensor, ZeRO-3 the free dim 1 over data.
    fc1 = params["fc1.weight"]
    assert fc1.sharding.spec == P("tensor", "data")
    assert fc1.addressable_shards[0].data.shape == (32, 8)
    assert params["fc2.weight"].sharding.spec == P("data", "tensor")
    # The bias's only dim belongs to the tensor rule: ZeRO cannot split it, and says so.
    assert [r.name for r in step.plan.replicated] == ["fc1.bias"]
    assert params["fc1.bias"].addressable_shards[0].data.shape == (32,)


def test_model_scalar_loss():
    loss = jax.numpy.float32(2.0)
    assert model_scalar_loss(loss) is loss
    assert model_scalar_loss({"loss": loss, "logits": jax.numpy.ones((2, 3))}) is loss
    assert model_scalar_loss((loss, jax.numpy.ones(3))) is loss
    with pytest.raises(ValueError, match=r"no scalar loss .*pass loss_fn="):
        model_scalar_loss(jax.numpy.ones((2, 3)))


def test_uneven_batch_is_an_error(mlp):
    converted, (x, y) = mlp
    config = load_config({"mesh": {"data": 8}}, num_devices=8)
    step = make_train_step(converted, make_sharding_plan(converted.params, config), adamw_update)
    with pytest.raises(ValueError, match=r"dim 0 \(size 12\) does not split over data=8"):
        step.shard_batch((x[:12], y[:12]))
