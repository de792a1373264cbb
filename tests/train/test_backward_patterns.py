"""Every way a torch training loop calls backward, through a zerojax-wrapped model.

Run: `.venv/bin/python -m pytest -q tests/train/test_backward_patterns.py -p no:cacheprovider`.
Why: `loss.backward()` on a wrapped model's output runs a JAX pullback (or, on the fused path,
adds gradients computed in the forward program) and accumulates into sharded buffers. Each test
runs one backward pattern (issue 4) on a wrapped model, on a deep copy in plain torch and on a
float64 copy, and requires every `p.grad` (read through the lazy gather), input gradient and
output to err against float64 no more than torch's float32 does (tolerances.
assert_within_torch_error: normwise, all parameters at once).
The models sit on 8 simulated devices at ZeRO-3 with the batch split over `data`, so the
gathers, the sharded accumulation and the batch-sharded inputs are all on the path.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from bench.architectures import CNN, MLP
from tests import tolerances

pytestmark = pytest.mark.multidevice

ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3}
BATCH = 8  # divisible by the 8-way data axis: inputs really are batch-sharded


class Float64(nn.Module):
    """A float64 copy of a module that takes and gives the loop's float32 tensors' places:
    floating inputs are widened on the way in (outputs stay float64, so the loss is float64
    too, except where torch narrows, e.g. binary_cross_entropy_with_logits)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = copy.deepcopy(module).double()

    def forward(self, *args, **kwargs):
        def widen(x):
            return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return self.module(*map(widen, args), **{k: widen(v) for k, v in kwargs.items()})


EXACT: dict[int, Float64] = {}
"""id(plain-torch reference) -> its float64 twin, made from the same initial module."""


def twin(reference: nn.Module) -> Float64:
    EXACT[id(reference)] = Float64(reference)
    return EXACT[id(reference)]


def exact_of(reference: nn.Module) -> Float64:
    return EXACT[id(reference)]


def wrap(module: nn.Module, config=ZERO3, **kwargs) -> tuple[nn.Module, nn.Module]:
    """(wrapped model, plain-torch deep copy taken before zerojax releases the parameters); the
    copy's float64 twin is exact_of(copy)."""
    reference = copy.deepcopy(module)
    twin(reference)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    wrapped, _ = zerojax.initialize(module, optimizer, config=config, **kwargs)
    return wrapped, reference


def assert_close_to_exact(ours, theirs, exact, what: str = "") -> None:
    """ours errs against float64 no more than torch's float32 does (tolerances)."""
    tolerances.assert_within_torch_error(ours.detach(), theirs.detach(), exact.detach(), what)


def assert_grads_match(wrapped: nn.Module, reference: nn.Module) -> None:
    """Every parameter gradient, all at once, within torch's own float32 error of float64."""
    ours = dict(wrapped.module.named_parameters())
    theirs = dict(reference.named_parameters())
    exact = dict(exact_of(reference).module.named_parameters())
    assert ours.keys() == theirs.keys() == exact.keys()
    graded = {}
    for name, ref in theirs.items():
        grad = ours[name].grad
        if ref.grad is None:
            assert grad is None or not grad.abs().any(), name
            continue
        assert grad is not None, f"{name}: no gradient"
        graded[name] = (grad, ref.grad, exact[name].grad)
    tolerances.assert_params_within_torch_error(
        *({n: g[i].detach() for n, g in graded.items()} for i in range(3)), what="gradients"
    )


class TwoHeads(nn.Module):
    """Several outputs (a tuple and a dict) from one trunk."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.cls = nn.Linear(32, 5)
        self.reg = nn.Linear(32, 3)
        self.aux = nn.Linear(32, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.cls(h), {"reg": self.reg(h), "aux": self.aux(h)}


def test_scalar_loss_backward():
    model, reference = wrap(MLP())
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    for m in (model, reference, exact_of(reference)):
        F.cross_entropy(m(x), y).backward()
    assert_grads_match(model, reference)


def test_nonscalar_backward_with_gradient():
    model, reference = wrap(MLP())
    x, grad = torch.randn(BATCH, 32), torch.randn(BATCH, 10)
    for m in (model, reference, exact_of(reference)):
        out = m(x)
        assert out.requires_grad and out.shape == (BATCH, 10)
        out.backward(grad.to(out.dtype))
    assert_grads_match(model, reference)


def test_several_outputs_feed_one_loss():
    model, reference = wrap(TwoHeads())
    x = torch.randn(BATCH, 16)
    y, target = torch.randint(0, 5, (BATCH,)), torch.randn(BATCH, 3)
    for m in (model, reference, exact_of(reference)):
        logits, rest = m(x)
        # "aux" is returned but unused by the loss: its cotangent is None on the torch side.
        # The target in the output's dtype: the float64 judge's mse_loss backward with a float32
        # target raises on torch 2.11 ("Found dtype Float but expected Double").
        reg = rest["reg"]
        loss = F.cross_entropy(logits, y) + F.mse_loss(reg, target.to(reg.dtype))
        loss.backward()
    assert_grads_match(model, reference)


def test_input_gradients_flow_back_to_torch():
    model, reference = wrap(MLP())
    x = torch.randn(BATCH, 32)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    x_exact = x.double().requires_grad_()
    model(x_ours).pow(2).sum().backward()
    reference(x_ref).pow(2).sum().backward()
    exact_of(reference)(x_exact).pow(2).sum().backward()
    assert_close_to_exact(x_ours.grad, x_ref.grad, x_exact.grad, "input gradient")
    assert_grads_match(model, reference)


def test_two_wrapped_models_combined_loss():
    """Distillation / GAN generator step: A's output feeds B, the loss is on B's output, and
    A's gradients arrive through B's input gradient; B's own loss term adds to B."""
    a, a_ref = wrap(MLP(in_features=16, hidden=32, num_classes=32))
    b, b_ref = wrap(MLP(in_features=32, hidden=32, num_classes=4))
    z, y = torch.randn(BATCH, 16), torch.randint(0, 4, (BATCH,))
    real = torch.randn(BATCH, 32)
    for ma, mb in ((a, b), (a_ref, b_ref), (exact_of(a_ref), exact_of(b_ref))):
        fake = ma(z)
        loss = F.cross_entropy(mb(fake), y) + 0.5 * mb(real).square().mean()
        loss.backward()
    assert_grads_match(a, a_ref)
    assert_grads_match(b, b_ref)


def test_gan_discriminator_step_on_detached_fake():
    """D's step uses G(z).detach(): no gradient may reach G."""
    g, g_ref = wrap(MLP(in_features=16, hidden=32, num_classes=32))
    d, d_ref = wrap(MLP(in_features=32, hidden=32, num_classes=1))
    z, real = torch.randn(BATCH, 16), torch.randn(BATCH, 32)
    for mg, md in ((g, d), (g_ref, d_ref), (exact_of(g_ref), exact_of(d_ref))):
        fake = mg(z).detach()
        ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
        loss = F.binary_cross_entropy_with_logits(
            md(real), ones
        ) + F.binary_cross_entropy_with_logits(md(fake), zeros)
        loss.backward()
    assert all(p.grad is None for p in g.module.parameters())
    assert_grads_match(d, d_ref)


def test_frozen_model_still_passes_input_gradients():
    """A frozen wrapped model (perceptual loss, frozen teacher) in front of a torch loss: its
    parameters get no gradient, but the gradient must still reach what feeds it."""
    a, a_ref = wrap(MLP(in_features=16, hidden=32, num_classes=32))
    frozen, frozen_ref = wrap(MLP(in_features=32, hidden=32, num_classes=4))
    for p in (*frozen.parameters(), *frozen_ref.parameters(), *exact_of(frozen_ref).parameters()):
        p.requires_grad_(False)
    z = torch.randn(BATCH, 16)
    for ma, mf in ((a, frozen), (a_ref, frozen_ref), (exact_of(a_ref), exact_of(frozen_ref))):
        mf(ma(z)).square().mean().backward()
    assert_grads_match(a, a_ref)
    assert all(p.grad is None for p in frozen.module.parameters())


def test_same_model_called_twice_before_one_backward():
    model, reference = wrap(MLP(in_features=32, hidden=32, num_classes=32))
    x1, x2 = torch.randn(BATCH, 32), torch.randn(BATCH, 32)
    for m in (model, reference, exact_of(reference)):
        # Two independent calls and one composed call (the output fed back in).
        loss = m(x1).square().mean() + m(m(x2)).abs().mean()
        loss.backward()
    assert_grads_match(model, reference)


def test_gradient_accumulation_sums_over_backward_calls():
    model, reference = wrap(MLP())
    batches = [(torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))) for _ in range(3)]
    for m in (model, reference, exact_of(reference)):
        for x, y in batches:
            (F.cross_entropy(m(x), y) / len(batches)).backward()
    assert_grads_match(model, reference)


def test_retain_graph_then_second_backward():
    model, reference = wrap(MLP())
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    for m in (model, reference, exact_of(reference)):
        out = m(x)
        F.cross_entropy(out, y).backward(retain_graph=True)
        out.square().mean().backward()  # the same graph again, another loss
    assert_grads_match(model, reference)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pullback"])
def test_second_backward_through_a_freed_graph_raises_torchs_error(fused):
    """As in torch: a second backward without `retain_graph=True` names the cause."""
    module = MLPWithLoss() if fused else MLP()
    model, _ = zerojax.initialize(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    loss = model(x, y) if fused else model(x).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_step_between_a_forward_and_its_backward_raises_torchs_error():
    """torch refuses a backward whose saved weights `optimizer.step()` changed in place since
    the forward; so does zerojax (its backward reads the forward's params, which the update
    replaced), instead of differentiating with other weights than the forward used."""
    module = MLP()
    reference = copy.deepcopy(module)
    model, optimizer = zerojax.initialize(module, torch.optim.SGD(module.parameters(), lr=0.1))
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    for m, opt in ((reference, torch_optimizer), (model, optimizer)):
        F.cross_entropy(m(x), y).backward()
        loss = F.cross_entropy(m(x), y)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_backward_where_saved_tensor_hooks_are_disabled():
    """Code that disables saved-tensor hooks (torch.compile's regions do) still trains: the
    node keeps the step's arrays until it goes, instead of releasing them early."""
    model, reference = wrap(MLP())
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    for m in (model, reference, exact_of(reference)):
        with torch.autograd.graph.disable_saved_tensors_hooks("zerojax test"):
            F.cross_entropy(m(x), y).backward()
    assert_grads_match(model, reference)


def test_zero_grad_then_fresh_backward():
    """optimizer.zero_grad() (p.grad = None) drops what earlier backwards accumulated."""
    module = MLP()
    reference = copy.deepcopy(module)
    twin(reference)
    model, optimizer = zerojax.initialize(
        module, torch.optim.SGD(module.parameters(), lr=0.1), config=ZERO3
    )
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    model(x).sum().backward()
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.module.parameters())
    model(x).sum().backward()
    for p in model.module.parameters():
        p.grad = None  # torch's own zero_grad(set_to_none=True) spelling
    assert all(p.grad is None for p in model.module.parameters())
    for m in (model, reference, exact_of(reference)):
        F.cross_entropy(m(x), y).backward()
    assert_grads_match(model, reference)


class MLPWithLoss(nn.Module):
    """Returns its own loss: the engine runs forward and backward as one fused program."""

    def __init__(self):
        super().__init__()
        self.net = MLP()

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "pullback"])
def test_a_finished_backward_lets_go_of_the_step_arrays(fused):
    """A loop's `loss` lives until the next step reassigns it, and torch keeps its graph node
    alive with it. Once `loss.backward()` has freed the graph, the node must not hold the
    step's gradients (fused program) or residuals (pullback): after `zero_grad()`, the device
    holds the training state and nothing else, or the next forward runs beside the last
    step's arrays."""
    import jax

    earlier = jax.live_arrays()  # other tests' arrays (held, so their ids stay theirs)
    module = MLPWithLoss() if fused else MLP()
    model, optimizer = zerojax.initialize(
        module, torch.optim.AdamW(module.parameters(), lr=1e-3), config=ZERO3
    )
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    for _ in range(2):
        loss = model(x, y) if fused else F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.grad_fn is not None  # the graph node is still referenced
    programs = model.engine.compiled_programs()
    assert ("loss_and_grads" in programs) == fused and ("backward" in programs) != fused
    resident = {id(a) for a in [*earlier, *jax.tree.leaves(model.engine.state)]}
    others = [a.shape for a in jax.live_arrays() if id(a) not in resident]
    # The smallest step array here is a bias gradient (10 floats); 2 words is an rng key.
    assert all(np.prod(shape) <= 2 for shape in others), others


def test_no_grad_forward_records_nothing():
    model, reference = wrap(MLP())
    x = torch.randn(BATCH, 32)
    with torch.no_grad():
        out = model(x)
        expected = reference(x)
        exact = exact_of(reference)(x)
    assert not out.requires_grad and out.grad_fn is None
    assert_close_to_exact(out, expected, exact, "output")
    assert all(p.grad is None for p in model.module.parameters())


def test_eval_mode_uses_running_stats_and_disables_dropout():
    """CNN with BatchNorm and dropout: train-mode forwards update the running statistics
    (compared with torch's), eval mode then uses them and drops nothing, deterministically."""
    model, reference = wrap(CNN())
    exact = exact_of(reference)
    for _ in range(2):
        x = torch.randn(BATCH, 3, 16, 16)
        with torch.no_grad():
            for m in (model, reference, exact):
                m(x)
    ours, theirs = model.state_dict(), reference.state_dict()
    exact_state = exact.module.state_dict()
    names = ("bn1.running_mean", "bn1.running_var", "bn2.running_mean")
    tolerances.assert_params_within_torch_error(
        {n: ours[n] for n in names}, theirs, {n: exact_state[n] for n in names}, "running stats"
    )
    assert ours["bn1.num_batches_tracked"] == theirs["bn1.num_batches_tracked"]

    for m in (model, reference, exact):
        m.eval()
    assert not model.training and not model.module.training
    x = torch.randn(BATCH, 3, 16, 16)
    first = model(x)
    assert_close_to_exact(first, reference(x), exact(x), "eval output")
    torch.testing.assert_close(model(x), first, rtol=0, atol=0)  # no dropout: same twice
    # Eval mode still trains if asked (e.g. fine-tuning with frozen BN statistics).
    first.sum().backward()
    reference(x).sum().backward()
    exact(x).sum().backward()
    assert_grads_match(model, reference)
    model.train()
    assert model.module.training


def tiny_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        attn_implementation="sdpa",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def test_hugging_face_loss_runs_fused():
    model, reference = wrap(tiny_hf_gpt2())
    tokens = torch.randint(0, 64, (BATCH, 16))
    out = model(tokens, labels=tokens)
    expected = reference(tokens, labels=tokens)
    # (Hugging Face computes the float64 twin's loss from logits narrowed to float32: the
    # reference carries float32 rounding of the loss, a few u, far below the others' errors.)
    exact = exact_of(reference)(tokens, labels=tokens)
    assert out.loss.ndim == 0 and out.loss.requires_grad
    # One loss: with its forward's float32 rounding as a floor (accumulation lengths: width
    # 32, head_dim 16, 16 keys, MLP 128, norms 32, vocabulary 64, 120 predicted tokens, and ~10
    # library functions, per side).
    rounds = 2 * (32 + 16 + 16 + 32 + 128 + 32 + 64 + 120 + 10 * tolerances.LIBM_ULPS)
    floor = tolerances.rounded_intermediates(torch.float32, rounds, exact.loss.abs().detach())
    tolerances.assert_within_torch_error(
        out.loss.detach(), expected.loss.detach(), exact.loss.detach(), "loss", floor
    )
    assert_close_to_exact(out.logits, expected.logits, exact.logits, "logits")
    assert "loss_and_grads" in model.engine.compiled_programs()
    (out.loss * 0.5).backward()  # a weighted loss scales the fused gradients
    (expected.loss * 0.5).backward()
    (exact.loss * 0.5).backward()
    assert_grads_match(model, reference)

    # Another output joining the loss (TRL computes its loss from the forward's log-probs):
    # the fused gradients do not apply; the call runs again with a pullback (same inputs,
    # random draws and buffers) and the model's later calls take the general path.
    for m in (model, reference, exact_of(reference)):
        m.zero_grad()
    for _ in range(2):
        for m in (model, reference, exact_of(reference)):
            out = m(tokens, labels=tokens)
            (out.loss + 0.1 * out.logits.square().mean()).backward()
    assert_grads_match(model, reference)
    assert "forward_vjp" in model.engine.compiled_programs()


@pytest.mark.slow
def test_hugging_face_unfused_allows_other_outputs():
    model, reference = wrap(tiny_hf_gpt2(), fused=False)
    tokens = torch.randint(0, 64, (BATCH, 16))
    for m in (model, reference, exact_of(reference)):
        out = m(tokens, labels=tokens)
        (out.loss + 0.1 * out.logits.square().mean()).backward()
    assert "loss_and_grads" not in model.engine.compiled_programs()
    assert_grads_match(model, reference)


def test_loss_fn_runs_fused_when_called_with_target():
    module = MLP()
    reference = copy.deepcopy(module)
    exact_model = twin(reference)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model, _ = zerojax.initialize(module, optimizer, config=ZERO3, loss_fn=F.cross_entropy)
    batches = [(torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))) for _ in range(2)]
    for x, y in batches:  # two calls: accumulation on the fused path too
        loss = model(x, y)
        expected = F.cross_entropy(reference(x), y)
        exact = F.cross_entropy(exact_model(x), y)
        assert loss.ndim == 0
        # One loss: an error norm of one element does not concentrate, so with the forward's
        # own float32 rounding as a floor (accumulation 32 + 64 + 64 + LayerNorm 64 + the
        # batch 8 + 10 classes, and ~4 library functions, per side).
        floor = tolerances.rounded_intermediates(
            torch.float32, 2 * (32 + 3 * 64 + 8 + 10 + 4 * tolerances.LIBM_ULPS), exact.abs()
        )
        tolerances.assert_within_torch_error(
            loss.detach(), expected.detach(), exact.detach(), "loss", floor.detach()
        )
        loss.backward()
        expected.backward()
        exact.backward()
    assert "loss_and_grads" in model.engine.compiled_programs()
    assert_grads_match(model, reference)

    # Fed by something that needs an input gradient, the model takes the general path (the
    # fused program returns no input gradients) and the gradient arrives.
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    x_exact = x.double().requires_grad_()
    model(x_ours * 2, y).backward()
    F.cross_entropy(reference(x_ref * 2), y).backward()
    F.cross_entropy(exact_model(x_exact * 2), y).backward()
    assert_close_to_exact(x_ours.grad, x_ref.grad, x_exact.grad, "input gradient")
    assert_grads_match(model, reference)


def test_parameters_frozen_after_initialize_get_no_gradient_and_no_update():
    """Fine-tuning: `requires_grad_(False)` on part of the model after initialize. Frozen
    parameters get no `.grad` and AdamW leaves them alone (no decay, no moments), as in torch."""
    module = MLP()
    reference = copy.deepcopy(module)
    exact = twin(reference)
    model, optimizer = zerojax.initialize(
        module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1), config=ZERO3
    )
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    exact_optimizer = torch.optim.AdamW(exact.parameters(), lr=1e-2, weight_decay=0.1)
    for m in (model.module, reference, exact.module):
        m.fc1.requires_grad_(False)
    for _ in range(2):
        x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
        for m in (model, reference, exact):
            F.cross_entropy(m(x), y).backward()
        assert model.module.fc1.weight.grad is None
        assert_grads_match(model, reference)
        for m, opt in ((model, optimizer), (reference, ref_optimizer), (exact, exact_optimizer)):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    ours, theirs = model.state_dict(), reference.state_dict()
    torch.testing.assert_close(ours["fc1.weight"], theirs["fc1.weight"], rtol=0, atol=0)
    # AdamW turns rounding differences into up to lr-sized steps: held to torch's own float32
    # error against the float64 run, all parameters at once.
    exact_state = exact.module.state_dict()
    tolerances.assert_params_within_torch_error(ours, theirs, exact_state, "trained parameters")
