"""Every way a torch training loop calls backward, through a zerojax-wrapped model.

Run: `.venv/bin/python -m pytest -q tests/train/test_backward_patterns.py -p no:cacheprovider`.
Why: `loss.backward()` on a wrapped model's output runs a JAX pullback (or, on the fused path,
adds gradients computed in the forward program) and accumulates into sharded buffers. Each test
runs one backward pattern (issue 4) on a wrapped model and on a deep copy in plain torch, and
compares every `p.grad` (read through the lazy gather) and every input gradient with torch's.
The models sit on 8 simulated devices at ZeRO-3 with the batch split over `data`, so the
gathers, the sharded accumulation and the batch-sharded inputs are all on the path.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from bench.architectures import CNN, MLP

pytestmark = pytest.mark.multidevice

# The patch lets one loop clip both models with torch.nn.utils.clip_grad_norm_.
ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3, "train": {"patch_clip_grad_norm": True}}
TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = 1e-5
"""Gradients: max |ours - torch| <= GRAD_TOL * max |torch| per parameter (float32 sums over a
batch reorder differently in XLA and in torch)."""
BATCH = 8  # divisible by the 8-way data axis: inputs really are batch-sharded


def wrap(module: nn.Module, config=ZERO3, **kwargs) -> tuple[nn.Module, nn.Module]:
    """(wrapped model, plain-torch deep copy taken before zerojax releases the parameters)."""
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    wrapped, _ = zerojax.initialize(module, optimizer, config=config, **kwargs)
    return wrapped, reference


def assert_grads_match(wrapped: nn.Module, reference: nn.Module, tol: float = GRAD_TOL) -> None:
    ours = dict(wrapped.module.named_parameters())
    theirs = dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, ref in theirs.items():
        grad = ours[name].grad
        if ref.grad is None:
            assert grad is None or not grad.abs().any(), name
            continue
        assert grad is not None, f"{name}: no gradient"
        scale = float(ref.grad.abs().max())
        error = float((grad - ref.grad).abs().max())
        assert error <= tol * max(scale, 1e-6), f"{name}: max error {error:.3g}, scale {scale:.3g}"


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
    for m in (model, reference):
        F.cross_entropy(m(x), y).backward()
    assert_grads_match(model, reference)


def test_nonscalar_backward_with_gradient():
    model, reference = wrap(MLP())
    x, grad = torch.randn(BATCH, 32), torch.randn(BATCH, 10)
    for m in (model, reference):
        out = m(x)
        assert out.requires_grad and out.shape == (BATCH, 10)
        out.backward(grad)
    assert_grads_match(model, reference)


def test_several_outputs_feed_one_loss():
    model, reference = wrap(TwoHeads())
    x = torch.randn(BATCH, 16)
    y, target = torch.randint(0, 5, (BATCH,)), torch.randn(BATCH, 3)
    for m in (model, reference):
        logits, rest = m(x)
        # "aux" is returned but unused by the loss: its cotangent is None on the torch side.
        loss = F.cross_entropy(logits, y) + F.mse_loss(rest["reg"], target)
        loss.backward()
    assert_grads_match(model, reference)


def test_input_gradients_flow_back_to_torch():
    model, reference = wrap(MLP())
    x = torch.randn(BATCH, 32)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(x_ours).pow(2).sum().backward()
    reference(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, **TOL)
    assert_grads_match(model, reference)


def test_two_wrapped_models_combined_loss():
    """Distillation / GAN generator step: A's output feeds B, the loss is on B's output, and
    A's gradients arrive through B's input gradient; B's own loss term adds to B."""
    a, a_ref = wrap(MLP(in_features=16, hidden=32, num_classes=32))
    b, b_ref = wrap(MLP(in_features=32, hidden=32, num_classes=4))
    z, y = torch.randn(BATCH, 16), torch.randint(0, 4, (BATCH,))
    real = torch.randn(BATCH, 32)
    for ma, mb in ((a, b), (a_ref, b_ref)):
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
    for mg, md in ((g, d), (g_ref, d_ref)):
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
    for p in (*frozen.parameters(), *frozen_ref.parameters()):
        p.requires_grad_(False)
    z = torch.randn(BATCH, 16)
    for ma, mf in ((a, frozen), (a_ref, frozen_ref)):
        mf(ma(z)).square().mean().backward()
    assert_grads_match(a, a_ref)
    assert all(p.grad is None for p in frozen.module.parameters())


def test_same_model_called_twice_before_one_backward():
    model, reference = wrap(MLP(in_features=32, hidden=32, num_classes=32))
    x1, x2 = torch.randn(BATCH, 32), torch.randn(BATCH, 32)
    for m in (model, reference):
        # Two independent calls and one composed call (the output fed back in).
        loss = m(x1).square().mean() + m(m(x2)).abs().mean()
        loss.backward()
    assert_grads_match(model, reference)


def test_gradient_accumulation_sums_over_backward_calls():
    model, reference = wrap(MLP())
    batches = [(torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))) for _ in range(3)]
    for m in (model, reference):
        for x, y in batches:
            (F.cross_entropy(m(x), y) / len(batches)).backward()
    assert_grads_match(model, reference)


def test_retain_graph_then_second_backward():
    model, reference = wrap(MLP())
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    for m in (model, reference):
        out = m(x)
        F.cross_entropy(out, y).backward(retain_graph=True)
        out.square().mean().backward()  # the same graph again, another loss
    assert_grads_match(model, reference)


def test_zero_grad_then_fresh_backward():
    """optimizer.zero_grad() (p.grad = None) drops what earlier backwards accumulated."""
    module = MLP()
    reference = copy.deepcopy(module)
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
    for m in (model, reference):
        F.cross_entropy(m(x), y).backward()
    assert_grads_match(model, reference)


def test_no_grad_forward_records_nothing():
    model, reference = wrap(MLP())
    x = torch.randn(BATCH, 32)
    with torch.no_grad():
        out = model(x)
        expected = reference(x)
    assert not out.requires_grad and out.grad_fn is None
    torch.testing.assert_close(out, expected, **TOL)
    assert all(p.grad is None for p in model.module.parameters())


def test_eval_mode_uses_running_stats_and_disables_dropout():
    """CNN with BatchNorm and dropout: train-mode forwards update the running statistics
    (compared with torch's), eval mode then uses them and drops nothing, deterministically."""
    model, reference = wrap(CNN())
    for _ in range(2):
        x = torch.randn(BATCH, 3, 16, 16)
        with torch.no_grad():
            model(x)
            reference(x)
    ours, theirs = model.state_dict(), reference.state_dict()
    for name in (
        "bn1.running_mean",
        "bn1.running_var",
        "bn2.running_mean",
        "bn1.num_batches_tracked",
    ):
        torch.testing.assert_close(
            ours[name], theirs[name], msg=lambda m, name=name: f"{name}: {m}", **TOL
        )

    model.eval()
    reference.eval()
    assert not model.training and not model.module.training
    x = torch.randn(BATCH, 3, 16, 16)
    first = model(x)
    torch.testing.assert_close(first, reference(x), **TOL)
    torch.testing.assert_close(model(x), first)  # no dropout: the same output twice
    # Eval mode still trains if asked (e.g. fine-tuning with frozen BN statistics).
    first.sum().backward()
    reference(x).sum().backward()
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
    assert out.loss.ndim == 0 and out.loss.requires_grad
    torch.testing.assert_close(out.loss, expected.loss, **TOL)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert "loss_and_grads" in model.engine.compiled_programs()
    (out.loss * 0.5).backward()  # a weighted loss scales the fused gradients
    (expected.loss * 0.5).backward()
    assert_grads_match(model, reference, tol=1e-4)

    # Another output of a fused model cannot join the loss: a clear error, not wrong grads.
    out = model(tokens, labels=tokens)
    with pytest.raises(RuntimeError, match="fused=False"):
        (out.loss + out.logits.square().mean()).backward()


@pytest.mark.slow
def test_hugging_face_unfused_allows_other_outputs():
    model, reference = wrap(tiny_hf_gpt2(), fused=False)
    tokens = torch.randint(0, 64, (BATCH, 16))
    for m in (model, reference):
        out = m(tokens, labels=tokens)
        (out.loss + 0.1 * out.logits.square().mean()).backward()
    assert "loss_and_grads" not in model.engine.compiled_programs()
    assert_grads_match(model, reference, tol=1e-4)


def test_loss_fn_runs_fused_when_called_with_target():
    module = MLP()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model, _ = zerojax.initialize(module, optimizer, config=ZERO3, loss_fn=F.cross_entropy)
    batches = [(torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))) for _ in range(2)]
    for x, y in batches:  # two calls: accumulation on the fused path too
        loss = model(x, y)
        expected = F.cross_entropy(reference(x), y)
        assert loss.ndim == 0
        torch.testing.assert_close(loss, expected, **TOL)
        loss.backward()
        expected.backward()
    assert "loss_and_grads" in model.engine.compiled_programs()
    assert_grads_match(model, reference)

    # Fed by something that needs an input gradient, the model takes the general path (the
    # fused program returns no input gradients) and the gradient arrives.
    x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(x_ours * 2, y).backward()
    F.cross_entropy(reference(x_ref * 2), y).backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, **TOL)
    assert_grads_match(model, reference)


def test_parameters_frozen_after_initialize_get_no_gradient_and_no_update():
    """Fine-tuning: `requires_grad_(False)` on part of the model after initialize. Frozen
    parameters get no `.grad` and AdamW leaves them alone (no decay, no moments), as in torch."""
    module = MLP()
    reference = copy.deepcopy(module)
    model, optimizer = zerojax.initialize(
        module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1), config=ZERO3
    )
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for m in (model.module, reference):
        m.fc1.requires_grad_(False)
    for _ in range(2):
        x, y = torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
        for m in (model, reference):
            F.cross_entropy(m(x), y).backward()
        assert model.module.fc1.weight.grad is None
        assert_grads_match(model, reference)
        for m, opt in ((model, optimizer), (reference, ref_optimizer)):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    ours, theirs = model.state_dict(), reference.state_dict()
    torch.testing.assert_close(ours["fc1.weight"], theirs["fc1.weight"], rtol=0, atol=0)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
