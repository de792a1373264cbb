"""The training step on every layout: same loss on every mesh and ZeRO stage, state where the plan
says.

Run: .venv/bin/python -m pytest -q tests/sharding/test_train_step.py
Exists because ZeRO and tensor parallelism must change where arrays live, never the numbers: five
AdamW steps of a torch MLP through the engine's programs (`zerojax.train.programs`, the ones
`zerojax.initialize` runs) give the same numbers at stages 0-3 on 8 devices, on a 4x2
data x tensor mesh and on one device, and afterwards every param, gradient and optimizer-state
array has exactly the sharding of the plan (read off the arrays, not the plan).

"The same numbers": a layout changes only the order of float32 reductions, which AdamW (eps
1e-8) turns into up to lr-sized steps for any gradient near its rounding noise, so no useful
elementwise bound between two layouts exists. Every layout is held instead to torch's own
float32 error against a float64 run of the same five steps (tolerances.
assert_params_within_torch_error: all parameters normwise; the losses within that factor plus
their own forward rounding floor).
"""

import copy
import logging
import re

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec as P

from bench.architectures import MLP
from tests import tolerances
from zerojax.bridge.dtypes import from_torch
from zerojax.config import load_config
from zerojax.sharding import make_mesh
from zerojax.train.engine import Engine
from zerojax.train.module import zero_module
from zerojax.train.optimizer_shim import ZeroOptimizer
from zerojax.train.parameters import release_parameters
from zerojax.train.programs import find_scalar_loss

pytestmark = pytest.mark.multidevice

NUM_STEPS = 5
BATCH, IN, HIDDEN, CLASSES = 16, 32, 64, 16
# Megatron-style tensor parallelism for the MLP: fc1 column-wise, fc2 row-wise.
TENSOR_RULES = [
    {"pattern": r"^fc1\.weight$", "spec": ["tensor", None]},
    {"pattern": r"^fc1\.bias$", "spec": ["tensor"]},
    {"pattern": r"^fc2\.weight$", "spec": [None, "tensor"]},
]


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    x = torch.randn(BATCH, IN)
    y = torch.randint(0, CLASSES, (BATCH,))
    return MLP(IN, HIDDEN, CLASSES), (x, y)


def wrap(module, raw_config, devices=None):
    """What zerojax.initialize does, on `devices` (default: all 8)."""
    devices = devices or jax.devices()
    module = copy.deepcopy(module)
    config = load_config(raw_config, num_devices=len(devices))
    engine = Engine(module, config, seed=0, mesh=make_mesh(config, devices=devices))
    optimizer = ZeroOptimizer(
        torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1), engine
    )
    model = zero_module(module, engine)
    release_parameters(module, engine)
    return model, optimizer


def train(module, batch, raw_config, devices=None):
    """Five steps; returns (losses, engine, gradients of the last backward); the final
    parameters are engine.state.params."""
    model, optimizer = wrap(module, raw_config, devices)
    x, y = batch
    losses = []
    for _ in range(NUM_STEPS):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = model.engine.state.grads
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.engine, grads


def assert_placed_per_plan(engine):
    plan, state = engine.plan, engine.state
    for name, array in state.params.items():
        assert array.sharding.is_equivalent_to(plan.params[name], array.ndim), name
    expected = plan.optimizer_state_shardings(state.opt_state)
    for (path, array), sharding in zip(
        jax.tree_util.tree_leaves_with_path(state.opt_state), jax.tree.leaves(expected)
    ):
        assert array.sharding.is_equivalent_to(sharding, array.ndim), path


def torch_run(module, batch, dtype):
    """torch eager AdamW, five steps in `dtype`: (losses, final parameters by name)."""
    reference = copy.deepcopy(module).to(dtype)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = batch
    losses = []
    for _ in range(NUM_STEPS):
        loss = F.cross_entropy(reference(x.to(dtype)), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return np.array(losses), {n: p.detach().double() for n, p in reference.named_parameters()}


# A float32 forward's own rounding, per loss: accumulation lengths fc1 32, fc2 64, head 64, the
# LayerNorm's 64-term statistics, the batch mean 16, the softmax over 16 classes, and a few
# library functions (gelu's erf, exp, log, rsqrt), each contributing <= u |loss| to first
# order at this model's scale; twice for two sides.
LOSS_ROUNDINGS = 2 * (IN + 3 * HIDDEN + BATCH + CLASSES + 4 * tolerances.LIBM_ULPS)


@pytest.fixture(scope="module")
def reference(mlp):
    """torch eager in float32 and in float64 over the same five steps: the yardstick."""
    module, batch = mlp
    return torch_run(module, batch, torch.float32), torch_run(module, batch, torch.float64)


def assert_matches_float64(losses, engine, reference, what):
    """The run's losses and final parameters err against float64 no more than torch's float32
    run does (tolerances.TORCH_ERROR_FACTOR)."""
    (losses32, params32), (losses64, params64) = reference
    floor = tolerances.rounded_intermediates(np.float32, LOSS_ROUNDINGS, np.abs(losses64))
    tolerances.assert_within_torch_error(losses, losses32, losses64, f"{what} losses", floor)
    tolerances.assert_params_within_torch_error(
        engine.state.params, params32, params64, f"{what} params"
    )


@pytest.fixture(scope="module")
def reference_losses(mlp, reference):
    """One device, no sharding at all; within torch's own float32 error of float64."""
    module, batch = mlp
    losses, engine, _ = train(module, batch, {"mesh": {"data": -1}}, devices=jax.devices()[:1])
    assert engine.plan.mesh.size == 1
    assert all(a.sharding.device_set == {jax.devices()[0]} for a in engine.state.params.values())
    assert losses[-1] < losses[0]  # it trains
    assert_matches_float64(losses, engine, reference, "one device")
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_match_one_device(mlp, reference, reference_losses, stage):
    module, batch = mlp
    losses, engine, grads = train(module, batch, {"mesh": {"data": 8}, "zero_stage": stage})
    assert_matches_float64(losses, engine, reference, f"stage {stage}")
    assert_placed_per_plan(engine)
    state = engine.state
    # fc2.weight is (64, 64): ZeRO splits dim 0 over the 8 data ranks where the stage says.
    exp_avg = state.opt_state["exp_avg"]["fc2.weight"]
    assert exp_avg.addressable_shards[0].data.shape == ((8, 64) if stage >= 1 else (64, 64))
    fc2 = state.params["fc2.weight"]
    assert fc2.sharding.is_equivalent_to(
        engine.plan.params["fc2.weight"], 2
    ) and engine.plan.params["fc2.weight"].spec == (
        P("data", None) if stage == 3 else P(None, None)
    )
    assert fc2.addressable_shards[0].data.shape == ((8, 64) if stage == 3 else (64, 64))
    for name, grad in grads.items():  # as the backward program produced them
        assert grad.sharding.is_equivalent_to(engine.plan.grads[name], grad.ndim), name
    assert grads["fc2.weight"].addressable_shards[0].data.shape == (
        (8, 64) if stage >= 2 else (64, 64)
    )
    programs = engine.compiled_programs()
    assert list(programs) == ["forward_vjp", "backward", "update"]
    assert programs["update"].memory_analysis().alias_size_in_bytes > 0  # state donated
    if stage == 3:
        assert "all-gather" in programs["forward_vjp"].as_text()  # params gathered for compute


def test_tensor_parallel_4x2_matches_one_device(mlp, reference, reference_losses):
    module, batch = mlp
    raw = {"mesh": {"data": 4, "tensor": 2}, "zero_stage": 3, "rules": TENSOR_RULES}
    losses, engine, _ = train(module, batch, raw)
    assert_matches_float64(losses, engine, reference, "data 4 x tensor 2")
    assert_placed_per_plan(engine)
    params = engine.state.params
    # fc1.weight (64, 32): the rule splits dim 0 over tensor, ZeRO-3 the free dim 1 over data.
    fc1 = params["fc1.weight"]
    assert fc1.sharding.spec == P("tensor", "data")
    assert fc1.addressable_shards[0].data.shape == (32, 8)
    assert params["fc2.weight"].sharding.spec == P("data", "tensor")
    # The bias's only dim belongs to the tensor rule: ZeRO cannot split it, and says so.
    assert [r.name for r in engine.plan.replicated] == ["fc1.bias"]
    assert params["fc1.bias"].addressable_shards[0].data.shape == (32,)


def test_find_scalar_loss():
    loss = jax.ShapeDtypeStruct((), jax.numpy.float32)
    logits = jax.ShapeDtypeStruct((2, 3), jax.numpy.float32)
    assert find_scalar_loss(loss) == ()
    assert find_scalar_loss({"loss": loss, "logits": logits}) == "loss"
    # A tuple's first scalar is not taken for the loss: such models run the general path.
    assert find_scalar_loss((loss, logits)) is None
    assert find_scalar_loss(logits) is None
    assert find_scalar_loss(jax.ShapeDtypeStruct((), jax.numpy.int32)) is None


def test_uneven_batch_is_replicated_with_a_warning(mlp, reference_losses, caplog):
    """A batch of 12 cannot split over 8 devices: it runs replicated (the same numbers as a
    one-device run of the same 12 rows, up to their float32 forward rounding), and the log says
    why it is slower."""
    module, (x, y) = mlp
    model, _ = wrap(module, {"mesh": {"data": 8}, "zero_stage": 3})
    one, _ = wrap(module, {"mesh": {"data": -1}}, devices=jax.devices()[:1])
    with caplog.at_level(logging.WARNING, logger="zerojax"):
        loss = F.cross_entropy(model(x[:12]), y[:12])
    assert "dim 0 (size 12) does not split over data=8; it is replicated" in caplog.text
    expected = F.cross_entropy(one(x[:12]), y[:12])
    bound = tolerances.rounded_intermediates(np.float32, LOSS_ROUNDINGS, abs(expected.item()))
    assert abs(loss.item() - expected.item()) <= bound


def test_zero3_forward_keeps_no_gathered_weight_for_the_backward():
    """FSDP's reshard after forward: what the forward pass keeps for the backward pass holds
    each stage-3 weight as its shard, never gathered (the backward pass gathers it again).
    Without that every op that differentiates through a weight (a matmul, a convolution) kept
    the whole gathered weight on every device until the backward pass: RegNet-Y-128GF's 2.55 GB
    eight times over on 8 CPU devices, the model coverage matrix's step killed for memory."""
    torch.manual_seed(0)
    # Sizes chosen so that no activation has a weight's shape (nor its transpose's).
    module = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 56))
    model, _ = wrap(module, {"mesh": {"fsdp": 8}, "zero": {"stage": 3}})
    engine = model.engine
    x = torch.randn(16, 24)
    converted = engine.converted(True, (x,), {})
    args = (engine.shard_input(from_torch(x)),)
    _, (residuals, _) = engine.forward(converted, args, {}, differentiable=(False,))

    def shard_bytes(array):
        return array.addressable_shards[0].data.nbytes

    weights = {n: w for n, w in engine.state.params.items() if w.ndim == 2}
    assert all(shard_bytes(w) * 8 == w.nbytes for w in weights.values())  # really sharded
    kept = [leaf for leaf in jax.tree.leaves(residuals) if isinstance(leaf, jax.Array)]
    for name, weight in weights.items():
        for leaf in kept:
            if leaf.shape in (weight.shape, weight.shape[::-1]):
                assert shard_bytes(leaf) <= shard_bytes(weight), (name, leaf.sharding)
    # (That the gradients are unchanged: test_zero_stages_match_one_device, stage 3.)


def test_zero3_grouped_convolution_runs_per_batch_shard():
    """A convolution whose groups hold several channels each (ResNeXt, RegNet) computes each
    device's own examples: XLA's partitioner gathered its batch-split input onto every device
    and convolved the whole batch there, every device doing the whole batch's work. The
    gradients are the one-device ones: within torch float32's own error of float64
    (zerojax.bridge.lowerings.conv runs it per batch shard; the kernel's gradient is summed over
    the shards)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(6, 24, 1),
        torch.nn.Conv2d(24, 24, 3, padding=1, groups=3),
        torch.nn.Conv2d(24, 24, 3, padding=1, groups=4, bias=False),
        torch.nn.Conv2d(24, 10, 1),
    )
    x, probe = torch.randn(16, 6, 5, 5), torch.randn(16, 10, 5, 5)

    def torch_grads(dtype):
        reference = copy.deepcopy(module).to(dtype)
        (reference(x.to(dtype)) * probe.to(dtype)).sum().backward()
        return {n: p.grad.double() for n, p in reference.named_parameters()}

    model, _ = wrap(module, {"mesh": {"fsdp": 8}, "zero": {"stage": 3}})
    engine = model.engine
    (model(x) * probe).sum().backward()
    tolerances.assert_params_within_torch_error(
        engine.state.grads, torch_grads(torch.float32), torch_grads(torch.float64), "grads"
    )

    # Each device convolves its 2 examples: every convolution of the forward program (NHWC
    # once XLA has assigned layouts, batch first) has 2 rows, none the batch's 16.
    forward = engine.compiled_programs()["forward_vjp"].as_text()
    rows = [int(r) for r in re.findall(r"= f32\[(\d+),[\d,]*\]\{[\d,]*\} convolution\(", forward)]
    assert len(rows) == 4 and set(rows) == {2}, rows


def forward_residuals(module, x) -> tuple[list[jax.Array], dict]:
    """The general path's forward on one device: (the arrays it hands its backward, the params
    it read)."""
    model, _ = wrap(module, {"mesh": {"data": 1}}, devices=jax.devices()[:1])
    engine = model.engine
    converted = engine.converted(True, (x,), {})
    args = (engine.shard_input(from_torch(x)),)
    _, (residuals, params) = engine.forward(converted, args, {}, differentiable=(False,))
    return [leaf for leaf in jax.tree.leaves(residuals) if isinstance(leaf, jax.Array)], params


def test_forward_keeps_no_copy_of_a_weight_for_the_backward():
    """The general path (`forward_vjp`, then `backward`): what the forward program hands the
    backward holds no weight, transposed, reshaped or as it is: a jitted program copies each
    output, so every such residual was a copy of a weight written by every forward (all of
    ResNet-18's 45 MB; nn.Linear's `t(W)`, a small-input convolution's reshaped kernel). The
    backward program reads the forward's own params instead. Nor does it hold a small-input
    convolution's stacked input views (one input copy per kernel offset), which its backward
    stacks again, nor a zeros array per ReLU."""
    torch.manual_seed(0)
    # A 3x3 pad-1 convolution on 2x2 (the patch form, bridge/lowerings/conv.py), then a Linear.
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 6),
    )
    kept, params = forward_residuals(module, torch.randn(4, 3, 2, 2))
    weights = {w.shape for w in params.values()} | {w.shape[::-1] for w in params.values()}
    weights |= {(1, 8, 3, 9), (8, 27)}  # the conv kernel's reshapes
    assert not [leaf.shape for leaf in kept if leaf.shape in weights]
    largest_activation = 4 * 8 * 2 * 2  # the patches would be 4 * 3 * 9 * 2 * 2
    assert max(leaf.size for leaf in kept) <= largest_activation, [leaf.shape for leaf in kept]
    # The ReLU keeps where its input passed (bool), not a zeros array for its derivative.
    at_relu = [leaf.dtype for leaf in kept if leaf.shape == (4, 8, 2, 2)]
    assert at_relu == [np.dtype(bool)], at_relu


def test_forward_keeps_one_input_sized_array_per_batch_norm():
    """A train-mode batch norm hands its backward what torch's keeps: its input and per-channel
    statistics, not also autodiff's `x - mean` (the backward forms it again). Conv -> BN ->
    ReLU -> Conv on fresh inputs: the float32 activation-sized residuals are the BN's input
    and the second conv's input (the ReLU's output), beside the ReLU's boolean mask."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
    )
    kept, _ = forward_residuals(module, torch.randn(4, 3, 6, 6))
    activations = [leaf.dtype for leaf in kept if leaf.shape == (4, 8, 6, 6)]
    assert sorted(map(str, activations)) == ["bool", "float32", "float32"], activations


def _llama_rms_norm(width):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(width)


@pytest.mark.parametrize("norm", [torch.nn.LayerNorm, _llama_rms_norm], ids=["layer", "rms"])
def test_forward_keeps_one_input_sized_array_per_row_norm(norm):
    """Likewise a layer norm or Llama's RMSNorm (their jnp forms, off GPU): the input and
    per-row statistics, not also autodiff's centred or normalized rows. Linear -> norm ->
    Linear: the activation-sized residuals are the first Linear's input, the norm's input and
    the second Linear's input (the norm's output)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), norm(16), torch.nn.Linear(16, 16))
    x = torch.randn(4, 5, 16)
    kept, _ = forward_residuals(module, x)
    activations = [leaf.shape for leaf in kept if leaf.size == x.numel()]
    assert len(activations) == 3, activations
