"""Activation checkpointing: config rules and the model's own torch.utils.checkpoint calls become
`jax.checkpoint` regions of the converted program, with torch's gradients.

Why: a user who turns on checkpointing (DeepSpeed's `activation_checkpointing`, HF's
`gradient_checkpointing_enable()`, `torch.utils.checkpoint` in their model) expects it to be
honoured, never dropped without a word, and never to change a gradient.

XLA:CPU would remove `jax.checkpoint`'s optimization barriers and merge each recomputation
with the forward value; zerojax compiles its programs with that pass off (bridge/remat.py).
The tests check the program JAX hands to XLA (barriers, recomputed matmuls), the compiled one
(barriers kept, 3x fewer temporary bytes for 8 checkpointed blocks) and gradients against torch.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import zerojax
from tests import tolerances
from zerojax.config import ActivationCheckpointingConfig, ConfigError, load_config
from zerojax.config.checks import ConfigWarning
from zerojax.pallas_kernels.layer_norm.reference import STATISTICS as LAYER_NORM_STATISTICS

WIDTH, BLOCKS, BATCH = 16, 3, 8


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc1 = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    """Blocks, each optionally under torch.utils.checkpoint (use_reentrant as given)."""

    def __init__(self, use_reentrant: bool | None = None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 1)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for block in self.blocks:
            if self.use_reentrant is None:
                x = block(x)
            else:
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x).square().mean()


def rules(**modules) -> ActivationCheckpointingConfig:
    return ActivationCheckpointingConfig(modules=tuple(modules.items()))


BLOCK_RULE = r"blocks\.\d+"


def converted(model, x):
    return zerojax.convert(model, (x.detach(),))


def program(conv):
    (entry,) = conv._programs.values()
    return entry[0]


def origins(conv, remat) -> list[str]:
    graph_function = program(conv)
    return [r.origin for r in graph_function.regions_for(graph_function.graph, remat).values()]


def loss_fn(conv, x, remat):
    inputs = jnp.asarray(x.detach().numpy())
    return lambda params: conv.apply(params, conv.buffers, inputs, remat=remat)[0]


def torch_grads(model, x) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(x).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_torch_gradients(conv, model, x, remat):
    grads = jax.grad(loss_fn(conv, x, remat))(conv.params)
    expected = torch_grads(model, x)
    for name, want in expected.items():
        # The same fp32 arithmetic as torch in another order: each gradient entry is a sum of
        # at most BATCH * 4 * WIDTH products through three blocks; a reordered fp32 sum of n
        # terms is within 2 (n - 1) u sum|x| (tolerances.reordered_sum), taken with a magnitude
        # of 4x the largest entry per chained block.
        bound = tolerances.reordered_sum(
            "float32", BATCH * 4 * WIDTH, 4.0 * BLOCKS * float(want.abs().max())
        )
        tolerances.assert_within(torch.from_numpy(np.array(grads[name])), want, bound, name)


def test_module_rules_make_one_region_per_outermost_matching_module():
    torch.manual_seed(0)
    conv = converted(Net(), torch.randn(BATCH, WIDTH))
    assert origins(conv, rules(**{BLOCK_RULE: "full"})) == [f"module blocks.{i}" for i in range(3)]
    # The outermost matching module wins; a rule for an inner one adds nothing inside it.
    both = rules(**{BLOCK_RULE: "full", r"blocks\.\d+\.fc1": "save_dots"})
    assert origins(conv, both) == [f"module blocks.{i}" for i in range(3)]
    assert origins(conv, rules(**{r"blocks\.1\.fc1": "save_dots"})) == ["module blocks.1.fc1"]
    assert origins(conv, rules(**{BLOCK_RULE: "none"})) == []
    assert origins(conv, None) == []  # no rule, no torch checkpoint call


@pytest.mark.parametrize("policy", ["full", "save_dots"])
def test_module_rules_keep_torch_gradients_and_recompute(policy):
    torch.manual_seed(1)
    model = Net()
    x = torch.randn(BATCH, WIDTH)
    conv = converted(model, x)
    remat = rules(**{BLOCK_RULE: policy})
    assert_torch_gradients(conv, model, x, remat)
    grad = jax.grad(loss_fn(conv, x, remat))
    # One region per block, beside each LayerNorm's own (off GPU its jnp form is rematerialized
    # but for its statistics, zerojax/pallas_kernels/layer_norm/api.py), in the plain program too.
    regions = [
        eqn
        for eqn in jax.make_jaxpr(grad)(conv.params).jaxpr.eqns
        if eqn.primitive.name == "remat2"
        and LAYER_NORM_STATISTICS not in getattr(eqn.params["policy"], "saveable_names", ())
    ]
    assert len(regions) == BLOCKS
    plain = jax.jit(jax.grad(loss_fn(conv, x, None))).lower(conv.params).as_text()
    text = jax.jit(grad).lower(conv.params).as_text()
    assert text.count("optimization_barrier") - plain.count("optimization_barrier") == BLOCKS
    # full recomputes fc1's matmul in each block's backward pass (tanh's output, which fc2's
    # gradient needs, comes from it; fc2's own output is not needed); save_dots keeps it.
    extra = text.count("dot_general") - plain.count("dot_general")
    assert extra == (BLOCKS if policy == "full" else 0)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_checkpoint_calls_become_regions(use_reentrant):
    torch.manual_seed(2)
    model = Net(use_reentrant=use_reentrant)
    # torch's reentrant checkpoint only differentiates when an input requires grad.
    x = torch.randn(BATCH, WIDTH, requires_grad=use_reentrant)
    conv = converted(model, x)
    calls = [f"torch.utils.checkpoint call {i}" for i in range(BLOCKS)]
    assert origins(conv, None) == calls
    assert_torch_gradients(conv, model, x, None)
    # A config rule over the same modules takes precedence (and can turn them off).
    assert origins(conv, rules(**{BLOCK_RULE: "save_dots"}))[0] == "module blocks.0"
    assert origins(conv, rules(**{BLOCK_RULE: "none"})) == []
    # The capture put torch's checkpoint machinery back as it was.
    assert torch_checkpoint.CheckpointFunction.__module__ == "torch.utils.checkpoint"


def test_hugging_face_gradient_checkpointing_is_honoured():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).train()
    model.gradient_checkpointing_enable()
    tokens = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF: use_cache is turned off under checkpointing
        conv = zerojax.convert(model, (), {"input_ids": tokens, "labels": tokens})
        expected = model(input_ids=tokens, labels=tokens).loss.detach()
    graph_function = program(conv)
    regions = graph_function.regions_for(graph_function.graph, None)
    assert [r.origin for r in regions.values()] == [
        "torch.utils.checkpoint call 0",
        "torch.utils.checkpoint call 1",
    ]
    ids = jnp.asarray(tokens.numpy())
    outputs, _ = conv.apply(conv.params, conv.buffers, input_ids=ids, labels=ids)
    # Mean cross-entropy over 14 tokens of a 64-way softmax after two layers: a few fp32
    # roundings per op on values of order log(64); 16 ulps of the loss covers them.
    bound = tolerances.ulps("float32", 16) * float(expected.abs())
    tolerances.assert_within(torch.tensor(float(outputs.loss)), expected, bound, "loss")


def test_offload_policy_saves_to_host_or_says_why():
    torch.manual_seed(4)
    model = Net()
    x = torch.randn(BATCH, WIDTH)
    conv = converted(model, x)
    remat = rules(**{BLOCK_RULE: "offload"})
    memories = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in memories:
        with pytest.raises(ValueError, match="pinned_host"):
            jax.grad(loss_fn(conv, x, remat))(conv.params)
        return
    assert_torch_gradients(conv, model, x, remat)


def test_config_section_and_its_errors():
    config = load_config(
        {
            "activation_checkpointing": {
                "modules": {BLOCK_RULE: "full", "head": "save_dots"},
                "torch_checkpoint": "none",
            }
        },
        num_devices=1,
    )
    section = config.activation_checkpointing
    assert section.modules == ((BLOCK_RULE, "full"), ("head", "save_dots"))
    assert section.policy_for("blocks.2") == "full" and section.policy_for("blocks.2.fc1") is None
    assert section.torch_checkpoint == "none"
    with pytest.raises(ConfigError, match="allowed: none, full, save_dots, offload"):
        load_config({"activation_checkpointing": {"modules": {"x": "some"}}}, num_devices=1)
    with pytest.raises(ConfigError, match=r"modules\['\('\]: invalid module path regex"):
        load_config({"activation_checkpointing": {"modules": {"(": "full"}}}, num_devices=1)
    with pytest.raises(ConfigError, match="policy"):
        load_config({"activation_checkpointing": {"policy": "full"}}, num_devices=1)


def test_deepspeed_activation_checkpointing_keys():
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "activation_checkpointing": {"cpu_checkpointing": True, "partition_activations": True},
    }
    with pytest.warns(ConfigWarning) as record:
        config = load_config(raw, num_devices=1)
    assert config.activation_checkpointing.torch_checkpoint == "offload"
    assert any(
        "'activation_checkpointing.partition_activations'" in str(w.message)
        and "keep the sharding" in str(w.message)
        for w in record
    )


def test_initialize_applies_the_config_with_torch_gradients(monkeypatch):
    """ZeRO-3 on 8 devices with every block checkpointed: the gradients of `loss.backward()`
    are torch's, and the training program really holds the regions (on CPU too: remat.py)."""
    from zerojax.bridge import remat as remat_module

    regions_traced = []
    policy_of = remat_module.checkpoint_policy

    def recording(policy, origin):
        regions_traced.append(origin)
        return policy_of(policy, origin)

    monkeypatch.setattr(remat_module, "checkpoint_policy", recording)
    torch.manual_seed(5)
    model = Net()
    x = torch.randn(BATCH, WIDTH)
    expected = torch_grads(model, x)
    config = {
        "mesh": {"fsdp": -1},
        "zero_stage": 3,
        "activation_checkpointing": {"modules": {BLOCK_RULE: "full"}},
    }
    wrapped, _ = zerojax.initialize(model, torch.optim.AdamW(model.parameters()), config=config)
    wrapped(x).backward()
    configured = sorted({o for o in regions_traced if not o.startswith("ZeRO-3 gather")})
    assert configured == [f"module blocks.{i}" for i in range(BLOCKS)]
    # Outside the blocks, the head's matmul reads a stage-3 weight: a gather region of its own
    # (find_gather_regions); inside them the block's region already regathers.
    assert sorted(set(regions_traced) - set(configured)) == [
        "ZeRO-3 gather for transposed_product_6"  # addmm(b, x, t(W)), bridge/fusion.py
    ]
    grads = {name: torch.as_tensor(p.grad) for name, p in model.named_parameters()}
    (program,) = [p for n, p in wrapped.engine.programs.compiled().items() if n != "update"]
    assert "opt-barrier" in program.as_text()  # kept through XLA:CPU's pipeline
    for name, want in expected.items():
        # As in assert_torch_gradients: fp32 sums of BATCH * 4 * WIDTH products, reordered.
        bound = tolerances.reordered_sum(
            "float32", BATCH * 4 * WIDTH, 4.0 * BLOCKS * float(want.abs().max())
        )
        tolerances.assert_within(grads[name], want, bound, name)


def test_full_checkpointing_cuts_the_planned_activations_of_8_blocks_3x():
    """memory_report compiles the step training runs: with every one of 8 blocks under `full`,
    the loss-and-gradients program's temporaries (the activations kept for the backward pass
    plus scratch) fall at least 3x; `save_dots` keeps the matmul outputs, so it lands between."""

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(8))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x.square().mean()

    x = torch.randn(4096, WIDTH)

    def temp_bytes(policy: str) -> int:
        torch.manual_seed(6)
        config = {
            "mesh": {"data": -1},
            "activation_checkpointing": {"modules": {BLOCK_RULE: policy}},
        }
        report = zerojax.memory_report(Deep(), (x,), config)
        return report.programs["loss_and_grads"].temp

    kept, full, save_dots = temp_bytes("none"), temp_bytes("full"), temp_bytes("save_dots")
    # jax 0.11's scheduler holds one layer norm's per-row statistics (mean and reciprocal
    # standard deviation, 2 x 4096 fp32: 32 KiB) as scratch beside the checkpointed inputs,
    # which jax 0.10's does not; the 3x is of the rest.
    row_statistics = 2 * x.shape[0] * 4
    assert kept >= 3 * (full - row_statistics), (kept, full)
    assert full < save_dots < kept, (full, save_dots, kept)


class _WideBlock(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width)
        self.fc2 = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _WideStack(torch.nn.Module):
    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_WideBlock(width) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.multidevice
def test_zero3_checkpointed_step_gathers_one_block_at_a_time():
    """ZeRO-3 with every block checkpointed is FSDP's schedule: a block's weights are gathered
    when it runs (forward and recompute) and its gradients reduced as they are made, so the
    step's temporaries do not grow with depth. Without the order the engine imposes, XLA:CPU
    starts every block's all-gather at the top of the program and reduces all gradients in one
    combined all-reduce at the end, and each extra block adds its gathered weights and full
    gradients (here 4 MiB per block) to the peak."""
    width = 512  # a block's weights: 2 x 512 x 512 fp32 = 2 MiB gathered, 2 MiB of gradients
    block_bytes = 2 * width * width * 4
    x = torch.randn(8, width)

    def temp_bytes(blocks: int) -> int:
        torch.manual_seed(0)
        config = {
            "mesh": {"fsdp": -1},
            "zero_stage": 3,
            "activation_checkpointing": {"modules": {r"blocks\.\d+": "full"}},
        }
        report = zerojax.memory_report(_WideStack(blocks, width), (x,), config)
        return report.programs["loss_and_grads"].temp

    shallow, deep = temp_bytes(2), temp_bytes(8)
    # Six more blocks may add scratch, but less than one block's gathered weights: the
    # unordered schedule adds 6 x (2 + 2) MiB.
    assert deep - shallow < block_bytes, (shallow, deep)
