"""Model-level parity: the eight reference architectures, converted whole, against torch eager.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_models.py`

Op-level tests prove each lowering; these prove they compose: forward outputs and the gradient
of a scalar loss w.r.t. every parameter must match torch (fp32) for MLP, CNN, GPT-2, Llama,
BERT, ViT, top-2 MoE and a causal attention block. The rest of the file pins down the
behaviour `convert` promises around the graph: BatchNorm buffer updates, dropout keyed by
`rng`, re-tracing on new shapes, output structure, and errors that point at the user's code.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from torch import nn

import zerojax
from bench.architectures import ARCHITECTURES, scalar_loss
from tests import tolerances
from tools.float64_judge import KinkRecorder, float64_gradients_at, recording_kinks
from zerojax.bridge.dtypes import from_torch, to_torch
from zerojax.train.programs import find_scalar_loss

# Whole models in float32: no useful per-element bound, so every output, gradient and buffer is
# held to torch's own float32 error against a float64 twin of the same model
# (tolerances.assert_within_torch_error; gradients and buffers all at once, normwise).


def widened(args):
    """Floating tensors of `args` in float64 (token ids and masks unchanged)."""
    return torch_pytree.tree_map(
        lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, args
    )


def float64_twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).double()


aten = torch.ops.aten


def relative_error(got, expected, *, floor: float = 0.0) -> float:
    """||got - expected|| / max(||expected||, floor) (absolute error when both are zero)."""
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, f"shape {got.shape} vs {expected.shape}"
    scale = max(np.linalg.norm(expected), floor)
    diff = np.linalg.norm(got - expected)
    return float(diff / scale) if scale > 0 else float(diff)


# A parameter whose gradient is analytically zero (an attention key bias: softmax is invariant
# to adding q.b to every score of a query) gets only float noise from either side; its error is
# measured against this fraction of the largest parameter gradient instead of its own norm.
GRAD_FLOOR = 1e-5


def gradient_errors(grads: dict, torch_params: dict[str, torch.nn.Parameter]) -> dict[str, float]:
    """Per-parameter relative error of JAX gradients against torch's p.grad (None = zeros)."""
    expected = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
        for name, p in torch_params.items()
    }
    floor = GRAD_FLOOR * max(np.linalg.norm(g) for g in expected.values())
    return {
        name: relative_error(grads[name], value, floor=floor) for name, value in expected.items()
    }


def to_jax_args(args):
    return torch_pytree.tree_map(
        lambda x: from_torch(x) if isinstance(x, torch.Tensor) else x, args
    )


@functools.cache
def _converted_eval(name: str):
    """(torch model in eval mode, torch args, converted) for one architecture, built once."""
    torch.manual_seed(0)
    model, args = ARCHITECTURES[name]()
    model.eval()
    return model, args, zerojax.convert(model, args)


def assert_tree_close(expected, got, exact, *, what, roundings: int = 0):
    """Same leaves at the same key paths, each float leaf erring against the float64 twin's
    `exact` no more than torch's float32 does, others equal. `roundings`: the leaves' own
    float32 rounding count as a floor, for leaves too small for their error norms to
    concentrate (a scalar).

    Compared by path, not by torch TreeSpec equality: jax.jit returns a plain dict with its keys
    sorted (JAX flattens dicts in sorted-key order), so only the key order may differ.
    """
    exp_leaves = {
        torch_pytree.keystr(path): leaf
        for path, leaf in torch_pytree.tree_flatten_with_path(expected)[0]
    }
    got_leaves = {
        torch_pytree.keystr(path): leaf
        for path, leaf in torch_pytree.tree_flatten_with_path(got)[0]
    }
    assert set(got_leaves) == set(exp_leaves), (
        f"{what}: {sorted(got_leaves)} vs {sorted(exp_leaves)}"
    )
    exact_leaves = {
        torch_pytree.keystr(path): leaf
        for path, leaf in torch_pytree.tree_flatten_with_path(exact)[0]
    }
    for path, e in exp_leaves.items():
        g = got_leaves[path]
        assert isinstance(g, jax.Array), f"{what}{path}: {type(g).__name__} is not a jax.Array"
        g = torch.tensor(np.asarray(g))
        if e.is_floating_point():
            reference = exact_leaves[path].detach()
            floor = tolerances.rounded_intermediates(torch.float32, roundings, reference.abs())
            tolerances.assert_within_torch_error(g, e.detach(), reference, f"{what}{path}", floor)
        else:
            torch.testing.assert_close(g.to(e.dtype), e, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Forward and gradient parity per architecture
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_forward_parity(name):
    model, args, converted = _converted_eval(name)
    with torch.no_grad():
        expected = model(*args)
        exact = float64_twin(model)(*widened(args))
    got, new_buffers = jax.jit(converted.apply)(
        converted.params, converted.buffers, *to_jax_args(args), rng=jax.random.key(0)
    )
    assert_tree_close(expected, got, exact, what=name)
    assert set(new_buffers) == set(converted.buffers)


@functools.cache
def _converted_recorder(name: str):
    """`_converted_eval`'s model, returning also its kinked calls' inputs, converted."""
    model, args, _ = _converted_eval(name)
    return zerojax.convert(KinkRecorder(model), args)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_gradient_parity(name):
    """jax.grad of scalar_loss w.r.t. every parameter equals torch autograd's p.grad, each
    float32 run measured against float64 at its own ReLU/max-pool branches
    (tools/float64_judge.py: a pre-activation within rounding of zero takes either branch by
    luck, differently on another CPU)."""
    model, args, converted = _converted_eval(name)
    model.zero_grad()
    with recording_kinks() as torch_seen:
        outputs = model(*args)
    scalar_loss(outputs).backward()
    torch_params = dict(model.named_parameters())  # deduplicated: tied weights appear once
    assert set(converted.params) == set(torch_params)

    jax_args = to_jax_args(args)
    if torch_seen:  # ReLU or max-pool: the program that also returns their inputs
        converted = _converted_recorder(name)

    def loss(params):
        params = {f"model.{n}": p for n, p in params.items()} if torch_seen else params
        out, _ = converted.apply(params, converted.buffers, *jax_args)
        out, seen = out if torch_seen else (out, ())
        return scalar_loss(out), seen

    params = {n.removeprefix("model."): p for n, p in converted.params.items()}
    grads, our_seen = jax.jit(jax.grad(loss, has_aux=True))(params)

    def exact_at(seen):
        grads64 = float64_gradients_at(model, widened(args), scalar_loss, seen)
        return {n: torch.as_tensor(grads64[n]) for n in torch_params}

    theirs = {n: p.grad for n, p in torch_params.items()}
    torch_exact, exact = exact_at(torch_seen), exact_at([to_torch(s) for s in our_seen])
    for n, value in list(theirs.items()):  # a parameter the loss does not reach: zeros
        if value is None:
            theirs[n] = torch.zeros_like(torch_params[n])
    tolerances.assert_params_within_torch_error(
        {n: grads[n] for n in theirs}, theirs, exact, f"{name} gradients", torch_exact=torch_exact
    )
    errors = gradient_errors(grads, torch_params)
    assert all(np.isfinite(e) for e in errors.values()), errors


def test_gpt2_tied_weights_are_one_array():
    """lm_head.weight is an alias: its gradient is wte.weight's (test_gradient_parity[gpt2])."""
    _, _, converted = _converted_eval("gpt2")
    assert converted.tied == {"lm_head.weight": "wte.weight"}
    assert "wte.weight" in converted.params and "lm_head.weight" not in converted.params


# ---------------------------------------------------------------------------------------------
# BatchNorm running statistics
# ---------------------------------------------------------------------------------------------


def test_batchnorm_train_mode_updates_buffers_like_torch():
    torch.manual_seed(0)
    model, args = ARCHITECTURES["cnn"]()
    model.train()
    converted = zerojax.convert(model, args)
    assert converted.train
    # A copy runs the torch forward, so the converted buffers stay the pre-step values.
    reference = copy.deepcopy(model)
    reference(*args)
    twin = float64_twin(model)
    twin(*widened(args))
    _, new_buffers = jax.jit(converted.apply)(
        converted.params, converted.buffers, *to_jax_args(args), rng=jax.random.key(0)
    )
    expected = dict(reference.named_buffers())
    exact = dict(twin.named_buffers())
    assert set(new_buffers) == set(expected)
    stats = [n for n in expected if not n.endswith("num_batches_tracked")]
    for name in set(expected) - set(stats):
        assert int(new_buffers[name]) == int(expected[name]) == 1, name
    tolerances.assert_params_within_torch_error(
        {n: new_buffers[n] for n in stats}, expected, {n: exact[n] for n in stats}, "buffers"
    )
    for name in stats:  # the step must actually move the statistics from their initial values
        assert relative_error(converted.buffers[name], expected[name].numpy()) > 1e-3, name


def test_batchnorm_eval_mode_leaves_buffers_unchanged():
    _, args, converted = _converted_eval("cnn")
    _, new_buffers = jax.jit(converted.apply)(
        converted.params, converted.buffers, *to_jax_args(args)
    )
    for name, value in converted.buffers.items():
        np.testing.assert_array_equal(new_buffers[name], value)


# ---------------------------------------------------------------------------------------------
# Dropout and rng
# ---------------------------------------------------------------------------------------------


class TwoDropouts(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.first = nn.Dropout(p)
        self.second = nn.Dropout(p)

    def forward(self, x):
        return self.first(x), self.second(x)


def _dropout_model(p=0.5, shape=(100, 100)):
    x = torch.rand(*shape) + 1.0  # strictly positive, so a zero means "dropped"
    model = TwoDropouts(p).train()
    converted = zerojax.convert(model, (x,))
    return converted, from_torch(x)


def test_dropout_same_key_same_mask_different_key_different_mask():
    converted, x = _dropout_model()
    apply = jax.jit(converted.apply)
    (a1, _), _ = apply(converted.params, converted.buffers, x, rng=jax.random.key(1))
    (a2, _), _ = apply(converted.params, converted.buffers, x, rng=jax.random.key(1))
    (b, _), _ = apply(converted.params, converted.buffers, x, rng=jax.random.key(2))
    np.testing.assert_array_equal(a1, a2)
    assert not np.array_equal(a1 == 0, b == 0)


def test_two_dropout_sites_get_different_masks_from_one_key():
    converted, x = _dropout_model()
    (first, second), _ = jax.jit(converted.apply)(
        converted.params, converted.buffers, x, rng=jax.random.key(0)
    )
    assert not np.array_equal(first == 0, second == 0)


def test_dropout_rate_and_scaling():
    p = 0.3
    converted, x = _dropout_model(p=p)
    (out, _), _ = jax.jit(converted.apply)(
        converted.params, converted.buffers, x, rng=jax.random.key(3)
    )
    out, x = np.asarray(out), np.asarray(x)
    dropped = out == 0
    assert abs(dropped.mean() - p) <= 0.05, f"dropped fraction {dropped.mean():.3f}, p={p}"
    # Survivors are scaled by 1 / (1 - p), as torch does.
    # x / (1 - p), or x * (1 / (1 - p)): at most 2 roundings against numpy's 1.
    np.testing.assert_allclose(
        out[~dropped], x[~dropped] / (1 - p), rtol=tolerances.ulps(np.float32, 2)
    )


def test_train_mode_without_rng_raises():
    converted, x = _dropout_model()
    with pytest.raises(ValueError, match="rng"):
        converted.apply(converted.params, converted.buffers, x)


def test_eval_mode_dropout_is_identity_and_needs_no_rng():
    x = torch.randn(8, 8)
    model = TwoDropouts(0.5).eval()
    converted = zerojax.convert(model, (x,))
    (first, second), _ = converted.apply(converted.params, converted.buffers, from_torch(x))
    np.testing.assert_array_equal(first, x.numpy())
    np.testing.assert_array_equal(second, x.numpy())


def test_gpt2_train_mode_step_is_keyed_by_rng():
    """A training step (nn.Dropout + SDPA dropout_p) is a function of the key, and differentiable."""
    torch.manual_seed(0)
    model, args = ARCHITECTURES["gpt2"]()
    converted = zerojax.convert(model.train(), args)
    jax_args = to_jax_args(args)

    def loss(params, key):
        out, _ = converted.apply(params, converted.buffers, *jax_args, rng=key)
        return scalar_loss(out)

    step = jax.jit(jax.value_and_grad(loss))
    loss_a, grads_a = step(converted.params, jax.random.key(0))
    loss_b, grads_b = step(converted.params, jax.random.key(0))
    loss_c, _ = step(converted.params, jax.random.key(1))
    assert float(loss_a) == float(loss_b) and float(loss_a) != float(loss_c)
    for name, grad in grads_a.items():
        assert np.all(np.isfinite(grad)), name
        np.testing.assert_array_equal(grad, grads_b[name])


class SDPADropout(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


def test_sdpa_dropout_depends_on_key():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    converted = zerojax.convert(SDPADropout().train(), (q, k, v))
    apply = jax.jit(converted.apply)
    jq, jk, jv = to_jax_args((q, k, v))
    a1, _ = apply(converted.params, converted.buffers, jq, jk, jv, rng=jax.random.key(0))
    a2, _ = apply(converted.params, converted.buffers, jq, jk, jv, rng=jax.random.key(0))
    b, _ = apply(converted.params, converted.buffers, jq, jk, jv, rng=jax.random.key(1))
    np.testing.assert_array_equal(a1, a2)
    assert not np.allclose(a1, b)


# ---------------------------------------------------------------------------------------------
# New input shapes: re-trace once, cached, with one warning
# ---------------------------------------------------------------------------------------------


def test_new_batch_size_retraces_once_with_one_warning(caplog):
    # Not under jax.jit: jit's own cache would hide whether zerojax caches the new program.
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh()).eval()
    converted = zerojax.convert(model, (torch.randn(2, 8),))
    bigger = torch.randn(5, 8)
    with caplog.at_level(logging.WARNING, logger="zerojax"):
        out, _ = converted.apply(converted.params, converted.buffers, from_torch(bigger))
    warnings = [r for r in caplog.records if r.name == "zerojax"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "new input shapes" in warnings[0].getMessage()
    with torch.no_grad():
        tolerances.assert_within_torch_error(
            torch.tensor(np.asarray(out)), model(bigger), float64_twin(model)(bigger.double())
        )

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zerojax"):
        converted.apply(converted.params, converted.buffers, from_torch(torch.randn(5, 8)))
        # The original shape is still cached too.
        converted.apply(converted.params, converted.buffers, from_torch(torch.randn(2, 8)))
    assert [r for r in caplog.records if r.name == "zerojax"] == []


class KeywordInputs(nn.Module):
    def forward(self, x, *, scale, shift):
        return x * scale + shift


def test_keyword_inputs_under_jit_reuse_the_converted_program(caplog):
    """jax.jit hands kwargs over in sorted-key order; that alone must not re-trace."""
    x = torch.randn(3)
    converted = zerojax.convert(KeywordInputs(), (x,), {"shift": torch.randn(3), "scale": x})
    with caplog.at_level(logging.WARNING, logger="zerojax"):
        out, _ = jax.jit(converted.apply)(
            converted.params,
            converted.buffers,
            from_torch(x),
            shift=from_torch(x),
            scale=from_torch(x),
        )
    assert [r.getMessage() for r in caplog.records if r.name == "zerojax"] == []
    # x * x + x: a product and a sum per side (or one fused rounding): 2 u (x^2 + |x|) each.
    bound = tolerances.rounded_intermediates(torch.float32, 2 * 2, (x * x + x.abs()).double())
    tolerances.assert_within(torch.tensor(np.asarray(out)), x * x + x, bound)


def test_new_batch_size_under_jit():
    _, (x,), converted = _converted_eval("mlp")
    model = converted.module
    bigger = torch.randn(3 * x.shape[0], x.shape[1])
    out, _ = jax.jit(converted.apply)(converted.params, converted.buffers, from_torch(bigger))
    with torch.no_grad():
        tolerances.assert_within_torch_error(
            torch.tensor(np.asarray(out)), model(bigger), float64_twin(model)(bigger.double())
        )


# ---------------------------------------------------------------------------------------------
# Output structure
# ---------------------------------------------------------------------------------------------


class NestedOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        return {"logits": y, "aux": (y.sum(-1), [torch.tanh(y), {"mean": y.mean()}])}


def test_nested_output_structure_survives_jit():
    x = torch.randn(3, 8)
    model = NestedOutputs().eval()
    converted = zerojax.convert(model, (x,))
    got, _ = jax.jit(converted.apply)(converted.params, converted.buffers, from_torch(x))
    with torch.no_grad():
        expected = model(x)
        exact = float64_twin(model)(x.double())
    assert isinstance(got, dict) and set(got) == {"logits", "aux"}
    assert isinstance(got["aux"], tuple) and isinstance(got["aux"][1], list)
    assert isinstance(got["aux"][1][1], dict)
    # Floor: an 8-term dot and the bias, a 4-term sum or a 12-term mean, per side.
    assert_tree_close(expected, got, exact, what="nested", roundings=2 * (9 + 12 + 1))
    # And the structure is a JAX pytree: jax.grad through a dict-of-tuple output works.
    grads = jax.grad(
        lambda p: scalar_loss(converted.apply(p, converted.buffers, from_torch(x))[0])
    )(converted.params)
    assert set(grads) == {"linear.weight", "linear.bias"}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_output_shapes_match_a_trace_of_apply(name):
    """`Converted.output_shapes` (read off the captured graph) is what tracing `apply` gives:
    the fused training path picks the loss from it instead of tracing the model twice."""
    _, args, converted = _converted_eval(name)
    jax_args = to_jax_args(args)
    traced = jax.eval_shape(
        lambda p, b, a: converted.apply(p, b, *a, rng=jax.random.key(0))[0],
        converted.params,
        converted.buffers,
        jax_args,
    )
    recorded = converted.output_shapes(*jax_args)
    assert jax.tree.structure(recorded) == jax.tree.structure(traced)
    for got, want in zip(jax.tree.leaves(recorded), jax.tree.leaves(traced), strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)


def test_output_shapes_of_nested_outputs_and_a_scalar_loss():
    x = torch.randn(3, 8)
    converted = zerojax.convert(NestedOutputs().eval(), (x,))
    shapes = converted.output_shapes(from_torch(x))
    assert set(shapes) == {"logits", "aux"}
    assert shapes["logits"] == jax.ShapeDtypeStruct((3, 8), np.float32)
    assert shapes["aux"][1][1]["mean"] == jax.ShapeDtypeStruct((), np.float32)
    assert find_scalar_loss(shapes) is None
    loss_model = zerojax.convert(TupleOutput(), (x,))
    assert [s.shape for s in loss_model.output_shapes(from_torch(x))] == [(3, 8), (3, 8)]


class TupleOutput(nn.Module):
    def forward(self, x):
        return x + 1, x * 2


def test_tuple_output():
    x = torch.randn(4)
    converted = zerojax.convert(TupleOutput(), (x,))
    got, _ = jax.jit(converted.apply)(converted.params, converted.buffers, from_torch(x))
    assert isinstance(got, tuple) and len(got) == 2
    # One correctly rounded IEEE add, and an exact doubling: equal on both sides.
    np.testing.assert_array_equal(got[0], (x + 1).numpy())
    np.testing.assert_array_equal(got[1], (x * 2).numpy())


# ---------------------------------------------------------------------------------------------
# Errors point at the user's code
# ---------------------------------------------------------------------------------------------

# An ATen overload no lowering module claims (symmetric eigendecomposition has no JAX lowering
# in zerojax; jnp.linalg.eigh's gradient differs from torch's on degenerate spectra).
UNSUPPORTED_OP = aten._linalg_eigh.default


class Eigh(nn.Module):
    def forward(self, x):
        symmetric = x @ x.transpose(-1, -2)
        return torch.linalg.eigh(symmetric).eigenvalues  # UNSUPPORTED LINE


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Eigh()

    def forward(self, x):
        return self.attn(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block()])

    def forward(self, x):
        return self.blocks[0](x) + 1


def test_unsupported_op_error_names_op_module_path_and_source_line():
    assert UNSUPPORTED_OP not in zerojax.bridge.supported_ops(), (
        f"{UNSUPPORTED_OP} gained a lowering; pick another unsupported op for this test"
    )
    lines, start = inspect.getsourcelines(Eigh.forward)
    offset = next(i for i, line in enumerate(lines) if "UNSUPPORTED LINE" in line)
    with pytest.raises(zerojax.UnsupportedOpError) as raised:
        zerojax.convert(Net().eval(), (torch.randn(2, 4, 4),))
    message = str(raised.value)
    assert "_linalg_eigh" in message
    assert "blocks.0.attn" in message
    assert f"test_models.py:{start + offset}" in message, message


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def test_data_dependent_control_flow_raises_capture_error_with_torch_reason():
    with pytest.raises(zerojax.CaptureError) as raised:
        zerojax.convert(DataDependent(), (torch.randn(4),))
    message = str(raised.value)
    cause = raised.value.__cause__
    assert cause is not None
    assert type(cause).__name__ in message
    # torch's own first line of explanation is carried in the message.
    assert str(cause).strip().splitlines()[0] in message
