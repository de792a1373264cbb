"""Per-device memory measured from the sharded arrays, against the ZeRO paper's formula.

Run: .venv/bin/python -m pytest -q tests/sharding/test_memory.py
Exists because memory estimators elsewhere are off by 10x: for a model whose dims divide the
8 devices evenly, the bytes each device really holds must be the formula's (16Psi, 4Psi+12Psi/N_d,
2Psi+14Psi/N_d, 16Psi/N_d for mixed-precision Adam, here generalised to fp32 and bf16) within 5%,
and the report's compiled programs must be exactly those a training step runs: their
memory_analysis() equals that of the executables `zerojax.initialize`'s engine ran for a real
torch step.
"""

import copy
import re

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax
from bench.architectures import MLP
from zerojax.sharding import make_mesh
from zerojax.sharding.memory import (
    bytes_by_device,
    compiled_memory,
    measured_bytes_per_device,
)
from zerojax.train.memory_plan import memory_report

pytestmark = pytest.mark.multidevice

BATCH, IN, HIDDEN, CLASSES = 8, 32, 64, 16  # every dim divisible by 8: no padding, no report


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    x = torch.randn(BATCH, IN)
    return zerojax.convert(MLP(IN, HIDDEN, CLASSES), (x,)), (x,)


def test_measured_bytes_read_off_shards():
    mesh = make_mesh(zerojax.load_config({"mesh": {"data": 8}}, num_devices=8))
    split = jax.device_put(np.zeros((64, 4), np.float32), NamedSharding(mesh, P("data")))
    whole = jax.device_put(np.zeros((10,), np.float32), NamedSharding(mesh, P()))
    one = jax.device_put(np.zeros((3,), np.float32), jax.devices()[2])
    held = bytes_by_device({"split": split, "whole": whole, "one": one})
    assert held[jax.devices()[0]] == 64 * 4 * 4 // 8 + 40
    assert held[jax.devices()[2]] == 64 * 4 * 4 // 8 + 40 + 12
    assert measured_bytes_per_device([split, whole, one]) == 128 + 40 + 12


# fp32 params, grads and Adam moments: 4 + 4 + 8 bytes per parameter, no master copy.
FP32 = {"params": 4, "grads": 4, "opt_state": 8, "master_weights": 0}
SHARDED = {  # which components each stage divides by N_d
    0: set(),
    1: {"opt_state", "master_weights"},
    2: {"opt_state", "master_weights", "grads"},
    3: {"opt_state", "master_weights", "grads", "params"},
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_measured_matches_zero_formula_fp32(mlp, stage):
    converted, args = mlp
    # Only stage 3 runs the step (it is the one that must all-gather); test_train_step.py
    # checks the step's gradients land in plan.grads at every stage.
    report = memory_report(
        converted, args, {"mesh": {"data": 8}, "zero_stage": stage}, run_step=stage == 3
    )
    psi = sum(p.size for p in converted.params.values())
    assert report.num_params == psi and report.data_parallel_size == 8
    assert report.replicated == ()
    for name, per_param in FP32.items():
        component = report[name]
        formula = per_param * psi / (8 if name in SHARDED[stage] else 1)
        assert component.formula == pytest.approx(formula, rel=1e-3), name
        assert component.measured == pytest.approx(formula, rel=0.05), name
    paper = {0: 16 * psi, 1: 8 * psi + 8 * psi / 8, 2: 4 * psi + 12 * psi / 8, 3: 16 * psi / 8}
    assert report.measured_total == pytest.approx(paper[stage], rel=0.05)
    text = str(report)
    assert text.splitlines()[1].split() == [
        "component",
        "measured",
        "B/device",
        "formula",
        "B/device",
        "formula",
        "ratio",
    ]
    # Adam's int32 step count per parameter tensor (8 tensors: 32 B, replicated on every
    # device) is outside the formula: a ratio up to 1.002 on this 7,440-parameter model.
    assert re.search(r"^total +[\d,]+ +[\d,]+ +\S+Ψ +1\.00[0-2]$", text, re.MULTILINE)
    assert "replicated parameters (not split as intended): none" in text
    if stage == 3:
        # The MLP returns logits: the general path (forward with vjp, backward), then update.
        assert list(report.programs) == ["forward_vjp", "backward", "update"]
        assert report.programs["forward_vjp"].temp > 0
        update = report.programs["update"]
        # The update takes params, optimizer state and gradients, and donates the first two.
        assert update.argument >= report.measured_total
        assert update.alias >= report["params"].measured + report["opt_state"].measured
        assert "compiled programs, memory_analysis() per device:" in text
        assert re.search(r"^  update: arguments [\d,]+ B", text, re.MULTILINE)
        # 7,472 B measured: 8Ψ/N_d plus the 8 replicated step counts (1.004).
        assert re.search(r"^optimizer state +[\d,]+ +[\d,]+ +8Ψ/N_d +1\.00[0-4]$", text, re.M)
    else:
        assert report.programs == {}


def test_mixed_precision_is_the_paper_formula(mlp):
    """bf16 params and grads, fp32 master weights and Adam moments: 2 + 2 + 4 + 8 = 16 bytes,
    the paper's K = 12 case; stage 1 = 4Psi + 12Psi/N_d. (Gradients are fp32 unless
    grad_reduce says otherwise; the paper reduces them in bf16.)"""
    converted, args = mlp
    config = {
        "mesh": {"data": 8},
        "zero_stage": 1,
        "precision": "params=bfloat16,compute=bfloat16,master=float32,grad_reduce=bfloat16",
    }
    report = memory_report(converted, args, config, run_step=False)
    psi = report.num_params
    assert {c.name: round(c.bytes_per_param, 2) for c in report.components} == {
        "params": 2,
        "grads": 2,
        "opt_state": 8,
        "master_weights": 4,
    }
    assert report.measured_total == pytest.approx(4 * psi + 12 * psi / 8, rel=0.05)
    assert "master weights" in str(report)


def test_report_names_replicated_params():
    torch.manual_seed(0)
    model = MLP(IN, HIDDEN, 10)  # head.bias has 10 entries: 8 devices cannot split it
    x = torch.randn(BATCH, IN)
    report = memory_report(
        zerojax.convert(model, (x,)), (x,), {"mesh": {"data": 8}, "zero_stage": 3}, run_step=False
    )
    assert [r.name for r in report.replicated] == ["head.bias"]
    assert "  head.bias shape=(10,)" in str(report)
    assert report["params"].ratio > 1.0  # the replicated bias costs every device


def test_tensor_axis_is_explained_not_hidden(mlp):
    converted, args = mlp
    rules = [{"pattern": r"^fc2\.weight$", "spec": [None, "tensor"]}]
    config = {"mesh": {"data": 4, "tensor": 2}, "zero_stage": 0, "rules": rules}
    report = memory_report(converted, args, config, run_step=False)
    assert report.data_parallel_size == 4
    assert report["params"].ratio < 1.0  # fc2.weight is split over tensor, the formula ignores it
    assert "the formula divides by N_d=4 only; tensor=2 splits ruled params further" in str(report)


@pytest.mark.parametrize(
    ("precision", "fused"),
    [("params=float32", False), ("params=bfloat16,compute=bfloat16,master=float32", True)],
    ids=["fp32-general", "bf16-master-fused"],
)
def test_report_programs_are_the_ones_training_runs(precision, fused):
    """memory_report's programs' memory_analysis() equals that of the executables a real torch
    step compiled in an engine from zerojax.initialize: same programs (fused loss-and-grads or
    forward_vjp + backward, and the update with master weights when the policy has them), same
    bytes, to the byte."""
    torch.manual_seed(0)
    module = MLP(IN, HIDDEN, CLASSES)
    x, y = torch.randn(BATCH, IN), torch.randint(0, CLASSES, (BATCH,))
    config = {"mesh": {"data": 8}, "zero_stage": 3, "precision": precision}
    make_optimizer = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    loss_fn = F.cross_entropy if fused else None
    report = memory_report(
        copy.deepcopy(module),
        (x, y) if fused else (x,),
        config,
        loss_fn=loss_fn,
        optimizer=make_optimizer,
    )

    model, optimizer = zerojax.initialize(
        module, make_optimizer(module.parameters()), config=config, loss_fn=loss_fn, seed=0
    )
    loss = model(x, y) if fused else F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    trained = {n: compiled_memory(c) for n, c in model.engine.compiled_programs().items()}

    expected = ["loss_and_grads", "update"] if fused else ["forward_vjp", "backward", "update"]
    assert list(report.programs) == expected
    assert report.programs == trained
    assert (report["master_weights"].measured > 0) == fused


# Bytes per parameter of every DeepSpeed low-precision combination, as zerojax maps its keys
# (README "Bytes per parameter"): params, gradients, master weights, Adam moments (m and v).
DEEPSPEED_STATE_BYTES = [
    ("fp32", {}, {"params": 4, "grads": 4, "master_weights": 0, "opt_state": 8}),
    (
        "bf16",
        {"bf16": {"enabled": True}},
        {"params": 2, "grads": 4, "master_weights": 4, "opt_state": 8},
    ),
    (
        "bf16 + bf16_optimizer_states",
        {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
        {"params": 2, "grads": 4, "master_weights": 4, "opt_state": 4},
    ),
    (
        "bf16_master_weights_and_grads",
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        {"params": 2, "grads": 2, "master_weights": 0, "opt_state": 8},
    ),
    (
        "bf16_master_weights_and_grads + bf16_optimizer_states",
        {
            "bf16": {
                "enabled": True,
                "bf16_master_weights_and_grads": True,
                "bf16_optimizer_states": True,
            }
        },
        {"params": 2, "grads": 2, "master_weights": 0, "opt_state": 4},
    ),
    (
        "fp16",
        {"fp16": {"enabled": True}},
        {"params": 2, "grads": 4, "master_weights": 4, "opt_state": 8},
    ),
    (
        "fp16_master_weights_and_grads",
        {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
        {"params": 2, "grads": 2, "master_weights": 0, "opt_state": 8},
    ),
]


@pytest.mark.parametrize(
    "section, expected",
    [(ds, e) for _, ds, e in DEEPSPEED_STATE_BYTES],
    ids=[n for n, _, _ in DEEPSPEED_STATE_BYTES],
)
def test_deepspeed_low_precision_states_bytes_per_parameter(mlp, section, expected):
    """Each DeepSpeed combination, ZeRO-3 over 8 devices: every device holds exactly the table's
    bytes x Psi / 8 of each component (plus Adam's replicated int32 step counts)."""
    converted, args = mlp
    config = {"zero_optimization": {"stage": 3}, **section}
    report = memory_report(converted, args, config, run_step=False)
    psi = report.num_params
    step_count = 4 * len(converted.params)  # one int32 per parameter, on every device
    for component, bytes_per_param in expected.items():
        extra = step_count if component == "opt_state" else 0
        assert report[component].measured == bytes_per_param * psi // 8 + extra, component


def test_step_peak_adds_the_state_resident_beside_each_program():
    """A program's own peak counts its arguments; the state it does not take stays on the
    device beside it (the optimizer state during the forward, params during the backward)."""
    from zerojax.sharding.memory import CompiledMemory, ComponentMemory, MemoryReport

    held = {"params": 100, "grads": 100, "opt_state": 200, "master_weights": 50}
    components = tuple(
        ComponentMemory(name=n, measured=b, formula=b, bytes_per_param=1.0, sharded=False)
        for n, b in held.items()
    )
    programs = {
        # params + inputs in, grads out, 1000 B of activations: + opt_state + master beside it.
        "loss_and_grads": CompiledMemory(argument=120, output=100, temp=1000, alias=0),
        # everything in, params/master/opt_state donated back.
        "update": CompiledMemory(argument=450, output=350, temp=10, alias=350),
    }
    report = MemoryReport(
        stage=0, mesh_shape={"data": 1}, data_parallel_size=1, num_params=100,
        components=components, programs=programs,
    )  # fmt: skip
    assert report.step_peak == (120 + 100 + 1000) + 200 + 50
    assert report.activations == report.step_peak - 450
    assert report.as_dict()["step_peak"] == report.step_peak
    assert "training step peak per device: 1,470 B" in str(report)


class _TinyGPT2WithLoss(torch.nn.Module):
    """A Hugging Face causal LM returning its own loss (the fused program), every block
    checkpointed by the config in the test below."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config).train()

    def forward(self, tokens):
        return self.model(input_ids=tokens, labels=tokens).loss


@pytest.mark.parametrize(
    "build, precision, remat",
    [
        (lambda: (MLP(IN, HIDDEN, CLASSES), (torch.randn(BATCH, IN),)), "params=float32", {}),
        (
            lambda: (MLP(IN, HIDDEN, CLASSES), (torch.randn(BATCH, IN),)),
            "params=bfloat16,compute=bfloat16,master=float32",
            {},
        ),
        (
            lambda: (_TinyGPT2WithLoss(), (torch.randint(0, 64, (BATCH, 16)),)),
            "params=bfloat16,compute=bfloat16,master=float32",
            {r"model\.transformer\.h\.\d+": "full"},
        ),
    ],
    ids=["mlp-fp32", "mlp-bf16-master", "gpt2-fused-checkpointed"],
)
@pytest.mark.long
def test_plan_without_memory_equals_the_real_step(build, precision, remat):
    """`memory_report(abstract=True)` on the model built on the meta device (what `zerojax plan
    --devices N` runs) reports exactly what building the real state and running the real step
    on the same mesh measures: every component's bytes, every program's memory_analysis()."""
    config = {
        "mesh": {"fsdp": -1},
        "zero_stage": 3,
        "precision": precision,
        "activation_checkpointing": {"modules": remat},
    }
    torch.manual_seed(0)
    model, args = build()
    real = memory_report(model, args, config)
    with torch.device("meta"):
        meta_model, meta_args = build()
    assert next(meta_model.parameters()).is_meta
    planned = memory_report(meta_model, meta_args, config, abstract=True)
    assert planned.as_dict() == real.as_dict()
    assert planned.step_peak is not None and planned.programs
