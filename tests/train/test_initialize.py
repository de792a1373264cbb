"""The unchanged torch training loop through `zerojax.initialize`, against plain PyTorch.

Run: `.venv/bin/python -m pytest -q tests/train/test_initialize.py -p no:cacheprovider`
(`-m slow` adds ZeRO-1/2 and the SGD / Adam runs).
Why: issue 4's promise is that this loop runs unchanged, as sharded XLA, with torch's numbers:

    out = model(x)
    loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # torch's own, on the shards
    optimizer.step(); scheduler.step(); optimizer.zero_grad()

Each case trains the nanoGPT-style GPT-2 from bench/architectures.py (tied wte/lm_head, dropout
off so both sides are deterministic) for a few steps, wrapped and as a plain-torch deep copy,
with two param groups (no weight decay on biases and norms) and a scheduler that moves the
learning rate and the momentum/betas every step. A float64 twin runs the same loop: losses,
clip norms and final parameters must err against it no more than torch's float32 run does
(tolerances.assert_within_torch_error; parameters normwise, all at once: AdamW turns rounding
differences into up to lr-sized steps, so no elementwise bound between two runs is useful),
and every sharded array must sit where the plan says. The ZeRO-3 run is
reused for the state_dict, optimizer state_dict, host-memory and `p.grad` checks.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import GPT2, MLP, GPT2Config
from tests import tolerances

pytestmark = pytest.mark.multidevice

VOCAB, SEQ, BATCH, STEPS = 64, 16, 8, 5
# A float32 forward's own rounding per loss, to first order at this model's scale: the
# accumulation lengths along it (width 32, head_dim 16, 16 keys, MLP 128, norms 32, vocabulary
# 64, BATCH * SEQ = 128 tokens) and ~10 library functions, per side; the floor under a handful
# of scalars whose error norm cannot concentrate. The clip norm (a sum over every parameter's
# gradient squares, ~30k terms) gets its own: the gradient's relative error at the loss's
# rounding count plus the 30k-term sum.
LOSS_ROUNDINGS = 2 * (32 + 16 + 16 + 128 + 32 + 64 + 128 + 10 * tolerances.LIBM_ULPS)

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
    losses: list[tuple[float, float, float]]
    """(zerojax, torch float32, torch float64) per step; norms likewise."""
    norms: list[tuple[float, float, float]]
    exact: torch.nn.Module
    """The float64 twin."""
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
    exact = copy.deepcopy(module).double()
    optimizer, make_scheduler = make_optimizer(module)
    ref_optimizer, _ = make_optimizer(reference)
    exact_optimizer, _ = make_optimizer(exact)
    exact_scheduler = make_scheduler(exact_optimizer)
    # The loop is verbatim torch: its torch.nn.utils.clip_grad_norm_ (unpatched) clips the
    # live gradients on the shards.
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
        exact_loss, exact_norm = train_step(exact, exact_optimizer, exact_scheduler, x, y)
        losses.append((loss, ref_loss, exact_loss))
        norms.append((norm, ref_norm, exact_norm))
    sharding_errors += misplaced(model.engine)
    return Run(
        model=model,
        optimizer=optimizer,
        reference=reference,
        ref_optimizer=ref_optimizer,
        losses=losses,
        norms=norms,
        exact=exact,
        final_state=model.state_dict(),
        sharding_errors=sharding_errors,
    )


def assert_scalars_close(triples, what: str, roundings: int) -> None:
    """(zerojax, torch, float64) scalars per step, normwise, with the rounding floor."""
    ours, theirs, exact = (torch.tensor(column, dtype=torch.float64) for column in zip(*triples))
    floor = tolerances.rounded_intermediates(torch.float32, roundings, exact.abs())
    tolerances.assert_within_torch_error(ours, theirs, exact, what, floor)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES]
)
def test_training_loop_matches_torch(case):
    run = trained(case)
    assert_scalars_close(run.losses, "losses", LOSS_ROUNDINGS)
    count = sum(p.numel() for p in run.reference.parameters())
    assert_scalars_close(run.norms, "clip norms", LOSS_ROUNDINGS + 2 * count)
    assert run.losses[-1][1] < run.losses[0][1]  # it trains at all
    tolerances.assert_params_within_torch_error(
        run.final_state, run.reference.state_dict(), run.exact.state_dict(), "final params"
    )
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
        exact = copy.deepcopy(fresh).double()(x)
        tolerances.assert_within_torch_error(run.model(x), fresh(x), exact, "logits")
    with pytest.raises(RuntimeError, match="missing keys"):
        run.model.load_state_dict({"wte.weight": fresh.wte.weight})
    # Restore the run's own state for the tests that continue training it.
    run.model.load_state_dict(run.reference.state_dict())


def float64_twin(state: dict, optimizer_state: dict):
    """A float64 GPT-2 and AdamW continuing from `state` / `optimizer_state` (torch casts the
    loaded moments to the parameters' dtype)."""
    exact = gpt2().double()
    exact.load_state_dict({k: v.double() for k, v in state.items()})
    exact_optimizer, _ = adamw(exact)
    exact_optimizer.load_state_dict(optimizer_state)
    return exact, exact_optimizer


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
    exact, exact_optimizer = float64_twin(model.state_dict(), optimizer.state_dict())
    for x, y in batches:
        for m, opt in ((model, optimizer), (twin, twin_optimizer), (exact, exact_optimizer)):
            train_step(m, opt, None, x, y)
    tolerances.assert_params_within_torch_error(
        model.state_dict(), twin.state_dict(), exact.state_dict(), "zerojax -> torch"
    )

    # torch -> zerojax, into an optimizer that has moved on: a no-op load would show.
    model.load_state_dict(run.reference.state_dict())
    optimizer.load_state_dict(run.ref_optimizer.state_dict())
    exact, exact_optimizer = float64_twin(
        run.reference.state_dict(), run.ref_optimizer.state_dict()
    )
    pairs = ((model, optimizer), (run.reference, run.ref_optimizer), (exact, exact_optimizer))
    for x, y in batches:
        for m, opt in pairs:
            train_step(m, opt, None, x, y)
    tolerances.assert_params_within_torch_error(
        model.state_dict(), run.reference.state_dict(), exact.state_dict(), "torch -> zerojax"
    )


def test_torch_parameters_hold_no_memory_and_read_the_engine():
    """The original module's parameters are the same objects, without memory of their own, and
    every read of them (`state_dict()`, `p.data`, `p.detach()`) gives the engine's values --
    the DDP idiom `raw_model = model.module; torch.save(raw_model.state_dict())` saves the
    trained model, never unallocated memory."""
    run = trained("zero3")
    reference = dict(run.reference.named_parameters())
    gathered = run.model.state_dict()
    raw = run.model.module.state_dict()
    assert set(raw) == set(gathered)
    for name, p in run.model.module.named_parameters():
        assert p.untyped_storage().nbytes() <= p.element_size(), name
        assert p.shape == reference[name].shape and p.dtype == reference[name].dtype, name
        for value in (raw[name], p.data, p.detach()):
            assert torch.equal(torch.as_tensor(value.numpy()), gathered[name]), name
    assert run.model.module.lm_head.weight is run.model.module.wte.weight  # still tied


def test_grad_is_live_and_writes_reach_the_engine():
    run = trained("zero3")
    model, optimizer = run.model, run.optimizer
    x, y = batch()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    weight = model.module.blocks[0].mlp[0].weight
    name = weight._zerojax_name
    grad = weight.grad
    assert grad.shape == weight.shape
    before = grad.numpy().copy()
    assert np.isfinite(before).all() and np.abs(before).sum() > 0
    doubled = grad * 2  # out of place: a new tensor, the gradient unchanged
    np.testing.assert_array_equal(doubled.numpy(), before * 2)
    grad.mul_(0.5)  # in place: the engine's sharded gradient, on its plan sharding
    stored = model.engine.grads[name]
    assert stored.sharding == model.engine.plan.grads[name]
    np.testing.assert_array_equal(np.asarray(stored), before * 0.5)
    weight.grad.zero_()
    assert not np.asarray(model.engine.grads[name]).any()
    optimizer.zero_grad()
    assert weight.grad is None


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_clips_on_the_shards_like_torch(norm_type):
    """The norm returned and the clipped gradients both equal torch's."""
    module = MLP()
    reference = copy.deepcopy(module)
    exact = copy.deepcopy(module).double()
    config = CASES["zero3"][0]
    model, _ = zerojax.initialize(module, torch.optim.SGD(module.parameters(), lr=0.1), config)
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    norms = []
    for m, inputs in ((model, x), (reference, x), (exact, x.double())):
        F.cross_entropy(m(inputs), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, norm_type)))
    # The norm: the gradient's own error (the MLP forward's rounding: 32 + 3 * 64 + 8 + 10
    # accumulation, ~4 library functions) plus its sum over every gradient element, per side.
    count = sum(p.numel() for p in reference.parameters())
    roundings = 2 * (32 + 3 * 64 + 8 + 10 + 4 * tolerances.LIBM_ULPS) + 2 * count
    assert_scalars_close([norms], "clip norm", roundings)
    assert norms[1] > 0.1  # the clip really scaled something
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (model.module, reference, exact)]
    tolerances.assert_params_within_torch_error(*grads, "clipped gradients")
