"""How a wrapped model's outputs reach torch: zero-copy where safe, and still plain tensors.

Run: `.venv/bin/python -m pytest -q tests/train/test_output_handover.py -p no:cacheprovider`.
Why: on one CPU device the front end hands each output buffer to torch through DLPack instead
of copying it (`zerojax.parallel.placement.hand_over`), so logits a loop never reads cost nothing.
These tests check that such outputs behave as ordinary torch tensors for what loops do with
them, that an in-place change to one reaches no array the engine keeps (state, pullback
residuals), that shared or sharded buffers are still copied, and that the fused path's
gradient weighting (now folded into the accumulation) gives torch's gradients.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench.architectures import MLP
from tests.train.test_backward_patterns import tiny_hf_gpt2
from zerojax.config import load_config
from zerojax.parallel.placement import hand_over
from zerojax.sharding import make_mesh
from zerojax.train.engine import Engine
from zerojax.train.module import ZeroModule, zero_module
from zerojax.train.optimizer_shim import ZeroOptimizer
from zerojax.train.parameters import release_parameters
from zerojax.train.programs import Program

pytestmark = pytest.mark.multidevice

TOL = {"rtol": 1e-5, "atol": 1e-5}
"""float32 forward of a few small layers: XLA and torch sum in different orders, a few ulps of
values of order 1-10."""
GRAD_TOL = 1e-4
"""max |ours - torch| <= GRAD_TOL * max |torch| per parameter: float32 gradients summed over
the batch and the vocabulary in different orders (as tests/train/test_backward_patterns.py)."""


def wrap_on_one_device(module: nn.Module, **engine_kwargs) -> tuple[ZeroModule, nn.Module]:
    """What zerojax.initialize does, on one CPU device (where outputs are handed over
    zero-copy); returns (wrapped model, plain-torch deep copy)."""
    reference = copy.deepcopy(module)
    config = load_config({"mesh": {"data": 1}}, num_devices=1)
    mesh = make_mesh(config, devices=jax.devices()[:1])
    engine = Engine(module, config, seed=0, mesh=mesh, **engine_kwargs)
    ZeroOptimizer(torch.optim.SGD(module.parameters(), lr=0.1), engine)
    model = zero_module(module, engine)
    release_parameters(module, engine)
    return model, reference


def engine_buffer_addresses(model: ZeroModule) -> set[int]:
    state = model.engine.state
    arrays = jax.tree.leaves((state.params, state.buffers, state.grads))
    return {a.unsafe_buffer_pointer() for a in arrays}


def assert_grads_match(model: ZeroModule, reference: nn.Module) -> None:
    ours = dict(model.module.named_parameters())
    for name, ref in reference.named_parameters():
        grad = ours[name].grad
        scale = float(ref.grad.abs().max())
        error = float((grad - ref.grad).abs().max())
        assert error <= GRAD_TOL * max(scale, 1e-6), f"{name}: error {error:.3g} of {scale:.3g}"


def test_hand_over_shares_a_fresh_buffer_and_copies_shared_ones():
    fresh = jnp.arange(6.0).reshape(2, 3) + 1.0
    (tensor,) = hand_over([fresh], kept=())
    assert tensor.data_ptr() == fresh.unsafe_buffer_pointer()  # zero-copy
    torch.testing.assert_close(tensor, torch.arange(6.0).reshape(2, 3) + 1.0)

    # A buffer the engine keeps (state, residuals) is copied: torch may change it in place.
    kept = jnp.arange(4.0) * 2.0
    (copied,) = hand_over([kept], kept={"state": kept})
    assert copied.data_ptr() != kept.unsafe_buffer_pointer()
    copied.add_(1.0)
    np.testing.assert_array_equal(np.asarray(kept), np.arange(4.0) * 2.0)

    # The same buffer twice: the first output takes it, the second gets a copy.
    first, second = hand_over([fresh, fresh], kept=())
    assert first.data_ptr() != second.data_ptr()

    # bf16 and ints travel as they are; sharded arrays (8 devices) are assembled into a copy.
    bf16 = (jnp.arange(8.0) / 3.0).astype(jnp.bfloat16)
    ints = jnp.arange(8, dtype=jnp.int32) * 3
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    sharded = jax.device_put(jnp.arange(16.0) + 0.5, spec)
    bf16_t, ints_t, sharded_t = hand_over([bf16, ints, sharded], kept=())
    assert bf16_t.dtype == torch.bfloat16 and ints_t.dtype == torch.int32
    torch.testing.assert_close(bf16_t, (torch.arange(8.0) / 3.0).to(torch.bfloat16))
    torch.testing.assert_close(ints_t, torch.arange(8, dtype=torch.int32) * 3)
    torch.testing.assert_close(sharded_t, torch.arange(16.0) + 0.5)


def test_compiled_outputs_never_share_a_buffer_with_inputs_or_each_other():
    """What `hand_over`'s identity check relies on: a compiled program (`Program`, as the engine
    runs them) returns fresh, distinct buffers even for an input returned as it is and for one
    value returned twice."""
    x = jnp.arange(8.0) + 1.0
    outputs = Program("forward", lambda x: (x, x * 2.0, x * 2.0))(x)
    addresses = {o.unsafe_buffer_pointer() for o in outputs}
    assert len(addresses) == 3 and x.unsafe_buffer_pointer() not in addresses
    assert all(o is not x for o in outputs)


def test_fused_outputs_are_plain_tensors_and_changing_them_changes_no_state():
    """A Hugging Face CausalLM on the fused path: loss and logits are handed over; everything a
    loop does with them works, and writing into the logits changes nothing zerojax holds."""
    torch.manual_seed(0)
    model, reference = wrap_on_one_device(tiny_hf_gpt2())
    model.eval()
    reference.eval()
    tokens = torch.randint(0, 64, (2, 16))
    out = model(tokens, labels=tokens)
    expected = reference(tokens, labels=tokens)
    assert "loss_and_grads" in model.engine.compiled_programs()
    loss, logits = out.loss, out.logits
    assert logits.data_ptr() not in engine_buffer_addresses(model)

    # What loops do with outputs.
    assert loss.requires_grad and loss.shape == () and isinstance(loss.item(), float)
    assert loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)
    assert float(loss.detach()) == loss.item()
    assert logits.shape == expected.logits.shape and logits.dtype == torch.float32
    torch.testing.assert_close(logits.detach(), expected.logits.detach(), **TOL)
    torch.testing.assert_close(logits[1, 3], expected.logits[1, 3].detach(), **TOL)
    predictions = logits.argmax(-1)
    # Ties aside (none with random weights), the argmax is torch's.
    assert torch.equal(predictions, expected.logits.argmax(-1))
    assert torch.equal(logits.detach() > 1e-3, expected.logits.detach() > 1e-3)
    np.testing.assert_allclose(
        logits.detach().cpu().numpy(), expected.logits.detach().numpy(), **TOL
    )

    loss.backward()
    expected.loss.backward()
    assert_grads_match(model, reference)

    # In-place writes into the handed-over logits reach no parameter or buffer.
    logits.detach().zero_()
    again = model(tokens, labels=tokens)
    assert again.loss.item() == loss.item()
    torch.testing.assert_close(again.logits.detach(), expected.logits.detach(), **TOL)


class Tanh(nn.Module):
    """Its output is also what its backward needs (tanh' = 1 - tanh^2)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_general_path_residuals_survive_in_place_changes_to_the_output():
    model, reference = wrap_on_one_device(Tanh())
    x = torch.randn(4, 8)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = model(x_ours), reference(x_ref)
    torch.testing.assert_close(out, expected, **TOL)
    # (out * w).sum() saves only w: torch lets the output change after the loss is taken, and
    # the JAX pullback must still use its own residuals (tanh's output), not this buffer.
    w = torch.randn(4, 8)
    loss, expected_loss = (out * w).sum(), (expected * w).sum()
    out.detach().fill_(7.0)
    loss.backward()
    expected_loss.backward()
    assert_grads_match(model, reference)
    # The input gradient, a fresh output of the backward program, is handed over too.
    torch.testing.assert_close(x_ours.grad, x_ref.grad, **TOL)

    # Overwrite it for good after the backward: the next call is unaffected.
    out.detach().fill_(-1.0)
    torch.testing.assert_close(model(x), expected.detach(), **TOL)


class ReturnsItsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0) + 1.0)

    def forward(self, x):
        return self.linear(x), self.table


def test_an_output_that_is_a_buffer_does_not_alias_the_engine_state():
    model, _ = wrap_on_one_device(ReturnsItsBuffer())
    x = torch.randn(2, 4)
    for grad_mode in (torch.no_grad(), torch.enable_grad()):
        with grad_mode:
            _, table = model(x)
        table.detach().mul_(0.0)
        np.testing.assert_array_equal(
            np.asarray(model.engine.state.buffers["table"]), np.arange(4.0) + 1.0
        )


def test_weighted_fused_backwards_accumulate_like_torch():
    """Fused path, two backward calls with cotangents 0.5 and 2: the weight of each is folded
    into the accumulation (one pass), as torch sums 0.5 g1 + 2 g2 into .grad."""
    torch.manual_seed(0)
    model, reference = wrap_on_one_device(MLP(), loss_fn=F.cross_entropy)
    for weight in (0.5, 2.0, 1.0):
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        loss, expected = model(x, y), F.cross_entropy(reference(x), y)
        torch.testing.assert_close(loss, expected, **TOL)
        (loss * weight).backward()
        (expected * weight).backward()
    assert "loss_and_grads" in model.engine.compiled_programs()
    assert_grads_match(model, reference)
