"""The unchanged torch training loop through `zerojax.initialize`, against plain PyTorch.

Run: `.venv/bin/python -m pytest -q tests/train/test_initialize.py -p no:cacheprovider`
(`-m slow` adds ZeRO-1/2 and the SGD / Adam runs).
Why: issue 4's promise is that this loop runs unchanged, as sharded XLA, with torch's numbers:

    out = model(x)
    loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # train.patch_clip_grad_norm: true
    optimizer.step(); scheduler.step(); optimizer.zero_grad()

Each case trains the nanoGPT-style GPT-2 from bench/architectures.py (tied wte/lm_head, dropout
off so both sides are deterministic) for a few steps, wrapped and as a plain-torch deep copy,
with two param groups (no weight decay on biases and norms) and a scheduler that moves the
learning rate and the momentum/betas every step. Losses, clip norms and final parameters must
agree within 1e-5, and every sharded array must sit where the plan says. The ZeRO-3 run is
reused for the state_dict, optimizer state_dict, host-memory and `p.grad` checks.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import GPT2, MLP, GPT2Config

pytestmark = pytest.mark.multidevice

VOCAB, SEQ, BATCH, STEPS = 64, 16, 8, 5
TOL = 1e-5
"""Losses, clip norms and parameters after STEPS steps: max abs difference from torch."""

# Megatron-style tensor parallelism for bench GPT-2's own names: qkv and the MLP's first layer
# split their outputs, proj and the second layer their inputs, the tied embedding its vocab.
TENSOR_RULES = [
    {"pattern": r"^wte\.weight$", "spec": ["tensor", None]},
    {"pattern": r"attn\.qkv\.weight$", "spec": ["tensor", None]},
    {"pattern": r"attn\.qkv\.bias$", "spec": ["tensor"]},
    {"pattern": r"attn\.proj\.weight$", "spec": [None, "tensor"]},
    {"pattern": r"mlp\.0\.weight$", "spec": ["tensor", None]},
    {"pattern": r"mlp\.0\.bias$", "spec": ["tensor"]},
    {"pattern": r"mlp\.2\.weight$", "spec": [None, "tensor"]},
]


def gpt2() -> GPT2:
    config = GPT2Config(vocab_size=VOCAB, max_seq_len=SEQ, width=32, num_heads=2, dropout=0.0)
    return GPT2(config)


def param_groups(model: torch.nn.Module) -> list[dict]:
    """nanoGPT's grouping: weight decay on matrices, none on biases and norm weights."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim >= 2]},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


def adamw(model):
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-3, weight_decay=0.1)
    # One-cycle moves lr and beta1 every step: both must reach the compiled update.
    return optimizer, lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=4e-3, total_steps=STEPS + 10
    )


def adam(model):
    optimizer = torch.optim.Adam(param_groups(model), lr=1e-3, weight_decay=0.01)
    return optimizer, lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def sgd_nesterov(model):
    optimizer = torch.optim.SGD(
        param_groups(model), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4
    )
    return optimizer, lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=STEPS + 10
    )


CASES = {
    "zero0": ({"mesh": {"data": -1}, "zero_stage": 0}, adamw),
    "zero1": ({"mesh": {"data": -1}, "zero_stage": 1}, adamw),
    "zero2": ({"mesh": {"data": -1}, "zero_stage": 2}, adamw),
    "zero3": ({"mesh": {"data": -1}, "zero_stage": 3}, adamw),
    "data4xtensor2-zero3": (
        {"mesh": {"data": 4, "tensor": 2}, "zero_stage": 3, "rules": TENSOR_RULES},
        adamw,
    ),
    "zero2-sgd-nesterov": ({"mesh": {"data": -1}, "zero_stage": 2}, sgd_nesterov),
    "zero1-adam": ({"mesh": {"data": -1}, "zero_stage": 1}, adam),
}
SLOW = {"zero1", "zero2", "zero2-sgd-nesterov", "zero1-adam"}


@dataclasses.dataclass
class Run:
    """A wrapped model and its plain-torch twin after STEPS steps of the same loop."""

    model: zerojax.train.module.ZeroModule
    optimizer: zerojax.train.optimizer_shim.ZeroOptimizer
    reference: torch.nn.Module
    ref_optimizer: torch.optim.Optimizer
    losses: list[tuple[float, float]]
    norms: list[tuple[float, float]]
    final_state: dict[str, torch.Tensor]
    """`model.state_dict()` right after training (later tests move the model on)."""
    sharding_errors: list[str]


def batch():
    """Fresh tokens; the target is the next token id (a task the model can learn)."""
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    return x, (x + 1) % VOCAB


def train_step(model, optimizer, scheduler, x, y):
    """The issue's loop body, verbatim; returns (loss, clip norm)."""
    out = model(x)
    loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad()
    return loss.item(), norm.item()


def misplaced(engine) -> list[str]:
    """Arrays of the engine not placed as its plan says."""
    plan, errors = engine.plan, []

    def check(what, array, sharding):
        if not array.sharding.is_equivalent_to(sharding, array.ndim):
            errors.append(f"{what}: {array.sharding.spec} != plan {sharding.spec}")

    for name, array in engine.params.items():
        check(f"params[{name}]", array, plan.params[name])
    for name, array in (engine.grads or {}).items():
        check(f"grads[{name}]", array, plan.grads[name])
    for key, per_param in engine.opt_state.items():
        if isinstance(per_param, dict):
            for name, array in per_param.items():
                check(f"opt_state[{key}][{name}]", array, plan.opt_state[name])
    return errors


@functools.cache
def trained(case: str) -> Run:
    config, make_optimizer = CASES[case]
    torch.manual_seed(0)
    module = gpt2()
    reference = copy.deepcopy(module)
    optimizer, make_scheduler = make_optimizer(module)
    ref_optimizer, _ = make_optimizer(reference)
    # The loop is verbatim torch: its torch.nn.utils.clip_grad_norm_ clips on the shards
    # because the config opts in to the patch.
    config = {**config, "train": {"patch_clip_grad_norm": True}}
    model, optimizer = zerojax.initialize(module, optimizer, config=config)
    scheduler, ref_scheduler = make_scheduler(optimizer), make_scheduler(ref_optimizer)

    losses, norms, sharding_errors = [], [], []
    for step in range(STEPS):
        x, y = batch()
        if step == 0:  # the gradient accumulator's placement, before the step consumes it
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            sharding_errors += misplaced(model.engine)
            optimizer.zero_grad()
        loss, norm = train_step(model, optimizer, scheduler, x, y)
        ref_loss, ref_norm = train_step(reference, ref_optimizer, ref_scheduler, x, y)
        losses.append((loss, ref_loss))
        norms.append((norm, ref_norm))
    sharding_errors += misplaced(model.engine)
    return Run(
        model=model,
        optimizer=optimizer,
        reference=reference,
        ref_optimizer=ref_optimizer,
        losses=losses,
        norms=norms,
        final_state=model.state_dict(),
        sharding_errors=sharding_errors,
    )


def max_state_error(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max(float((ours[k].float() - theirs[k].float()).abs().max()) for k in theirs)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES]
)
def test_training_loop_matches_torch(case):
    run = trained(case)
    for step, ((loss, ref_loss), (norm, ref_norm)) in enumerate(
        zip(run.losses, run.norms, strict=True)
    ):
        assert abs(loss - ref_loss) <= TOL, f"step {step}: loss {loss} vs torch {ref_loss}"
        assert abs(norm - ref_norm) <= TOL * max(1.0, ref_norm), f"step {step}: clip norm"
    assert run.losses[-1][1] < run.losses[0][1]  # it trains at all
    error = max_state_error(run.final_state, run.reference.state_dict())
    assert error <= TOL, f"final params differ from torch by {error:.3g}"
    assert not run.sharding_errors, "\n".join(run.sharding_errors)


def test_plans_really_shard():
    """The parity cases above are only meaningful if their plans split things."""
    zero3 = trained("zero3").model.engine.plan
    assert (
        zero3.params["blocks.0.mlp.0.weight"].spec
        != zero3.compute_params["blocks.0.mlp.0.weight"].spec
    )
    mesh = trained("data4xtensor2-zero3").model.engine.plan
    assert dict(mesh.mesh.shape) == {"data": 4, "tensor": 2}
    for name in ("blocks.0.attn.qkv.weight", "blocks.0.mlp.2.weight", "wte.weight"):
        assert "tensor" in str(mesh.compute_params[name].spec), name
        assert "data" in str(mesh.params[name].spec), name


# --- torch-format state, memory and p.grad (on the ZeRO-3 run) -------------------------------


def test_state_dict_has_torch_keys_and_values():
    run = trained("zero3")
    ours, theirs = run.model.state_dict(), run.reference.state_dict()
    assert list(ours) == list(theirs)  # same keys, same order, tied lm_head.weight included
    for name, value in theirs.items():
        assert ours[name].shape == value.shape and ours[name].dtype == value.dtype, name
    torch.testing.assert_close(ours["lm_head.weight"], ours["wte.weight"], rtol=0, atol=0)


def test_load_state_dict_then_forward_matches_torch():
    run = trained("zero3")
    fresh = gpt2()  # a different initialisation than the run's
    result = run.model.load_state_dict(fresh.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(run.model(x), fresh(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="missing keys"):
        run.model.load_state_dict({"wte.weight": fresh.wte.weight})
    # Restore the run's own state for the tests that continue training it.
    run.model.load_state_dict(run.reference.state_dict())


def test_optimizer_state_dict_round_trips_with_torch_both_ways():
    """zerojax -> torch: a fresh torch model and AdamW loaded from the wrapped model's state
    continue exactly as the wrapped one does. torch -> zerojax: the wrapped model and optimizer
    loaded from the reference's state (three steps behind) continue exactly as torch does."""
    run = trained("zero3")
    model, optimizer = run.model, run.optimizer
    model.load_state_dict(run.reference.state_dict())
    optimizer.load_state_dict(run.ref_optimizer.state_dict())

    twin = gpt2()
    twin.load_state_dict(model.state_dict())
    twin_optimizer, _ = adamw(twin)
    twin_optimizer.load_state_dict(optimizer.state_dict())
    saved = optimizer.state_dict()
    assert saved["param_groups"][0]["lr"] == run.ref_optimizer.param_groups[0]["lr"]
    assert len(saved["state"]) == len(list(twin.parameters()))
    batches = [batch() for _ in range(3)]
    for x, y in batches:
        train_step(model, optimizer, None, x, y)
        train_step(twin, twin_optimizer, None, x, y)
    error = max_state_error(model.state_dict(), twin.state_dict())
    assert error <= TOL, f"zerojax -> torch: continued params differ by {error:.3g}"

    # torch -> zerojax, into an optimizer that has moved on: a no-op load would show.
    model.load_state_dict(run.reference.state_dict())
    optimizer.load_state_dict(run.ref_optimizer.state_dict())
    for x, y in batches:
        train_step(model, optimizer, None, x, y)
        train_step(run.reference, run.ref_optimizer, None, x, y)
    error = max_state_error(model.state_dict(), run.reference.state_dict())
    assert error <= TOL, f"torch -> zerojax: continued params differ by {error:.3g}"


def test_torch_parameters_hold_no_memory():
    run = trained("zero3")
    reference = dict(run.reference.named_parameters())
    for name, p in run.model.module.named_parameters():
        assert p.untyped_storage().nbytes() <= p.element_size(), name
        assert p.shape == reference[name].shape and p.dtype == reference[name].dtype, name
    assert run.model.module.lm_head.weight is run.model.module.wte.weight  # still tied


def test_grad_is_a_readonly_gathered_snapshot():
    run = trained("zero3")
    model, optimizer = run.model, run.optimizer
    x, y = batch()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    grad = model.module.blocks[0].mlp[0].weight.grad
    assert grad.shape == model.module.blocks[0].mlp[0].weight.shape
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    _ = grad * 2  # reading, out of place, works
    for modify in (lambda g: g.mul_(0.5), lambda g: g.zero_(), lambda g: g.clamp_(-1, 1)):
        with pytest.raises(RuntimeError, match="clip_grad_norm_"):
            modify(grad)
    optimizer.zero_grad()
    assert model.module.blocks[0].mlp[0].weight.grad is None
    with pytest.raises(RuntimeError, match="p.grad = None"):
        model.module.wte.weight.grad = torch.zeros(VOCAB, 32)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_clips_on_the_shards_like_torch(norm_type):
    """The norm returned and the clipped gradients both equal torch's."""
    module = MLP()
    reference = copy.deepcopy(module)
    config = {**CASES["zero3"][0], "train": {"patch_clip_grad_norm": True}}
    model, _ = zerojax.initialize(module, torch.optim.SGD(module.parameters(), lr=0.1), config)
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    norms = []
    for m in (model, reference):
        F.cross_entropy(m(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, norm_type)))
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    assert norms[1] > 0.1  # the clip really scaled something
    for (name, p), ref in zip(model.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-5, atol=1e-7, msg=name)
