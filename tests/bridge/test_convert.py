"""zerojax.convert API: inputs, parameters, buffers, tied weights, dtype override, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import zerojax
from tests import tolerances
from zerojax.bridge.dtypes import from_torch

U32 = tolerances.unit_roundoff(torch.float32)


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def mlp_error(model: nn.Sequential, x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Elementwise bound on one side's error for mlp() run with inputs and parameters rounded
    to `dtype` (u_in), float32 accumulation and results rounded to `dtype` (u_c), first order:
    h = W1 x + b1 within (2 u_in + (16 + 1) u + u_c) S1, S1 = |W1| |x| + |b1| (two rounded
    factors per product, the 16-term sum and the bias add, the result's rounding);
    GELU (|gelu'| <= 1.13) passes 1.13 times that on and adds 4 u_c + 2 LIBM_ULPS u of |h|
    (x / sqrt 2, erf, 1 + erf, the product); y = W2 g + b2 adds |W2| times that and
    (2 u_in + (32 + 1) u + u_c) (|W2| |g| + |b2|)."""
    first, _, second = model
    u_in = 0.0 if dtype == torch.float32 else tolerances.unit_roundoff(dtype)
    u_c = tolerances.unit_roundoff(dtype)
    w1, b1, w2, b2 = (
        t.detach().double() for t in (first.weight, first.bias, second.weight, second.bias)
    )
    x = x.double()
    s1 = x.abs() @ w1.abs().T + b1.abs()
    h_error = (2 * u_in + 17 * U32 + u_c) * s1
    g = nn.functional.gelu(x @ w1.T + b1)
    libm = tolerances.LIBM_ULPS * tolerances.eps(torch.float32)
    g_error = 1.13 * h_error + (4 * u_c + libm) * s1
    s2 = g.abs() @ w2.abs().T + b2.abs()
    return g_error @ w2.abs().T + (2 * u_in + 33 * U32 + u_c) * s2


def test_params_and_buffers_keep_state_dict_names_and_values():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    converted = zerojax.convert(model, (torch.randn(3, 4),))
    assert set(converted.params) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert set(converted.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    np.testing.assert_array_equal(
        np.asarray(converted.params["0.weight"]), model[0].weight.detach()
    )


def test_tied_weights_are_one_array_and_gradients_add():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(self.embed(tokens))

    model, tokens = Tied(), torch.randint(0, 10, (2, 5))
    converted = zerojax.convert(model, (tokens,))
    assert list(converted.params) == ["embed.weight"]
    assert converted.tied == {"head.weight": "embed.weight"}

    model(tokens).square().sum().backward()
    grads = jax.grad(lambda p: jnp.sum(converted.apply(p, {}, from_torch(tokens))[0] ** 2))(
        converted.params
    )
    # Running-error bound: the gradient's computation on absolute values, M, times the
    # roundings along it, per side: logits (6-term dots, 6 u) and 2 * out (1), the head's
    # gradient (a 10-token sum) and the embedding's (10 vocabulary rows, then a scatter-add of
    # up to 10 repeated tokens and the two tied contributions): 6 + 1 + 10 + 10 + 1 = 28.
    weight = model.embed.weight.detach().double().abs().requires_grad_()
    logits_abs = weight[tokens] @ weight.T
    (logits_abs * 2 * logits_abs.detach()).sum().backward()
    bound = tolerances.rounded_intermediates(torch.float32, 2 * 28, weight.grad)
    tolerances.assert_within(
        torch.tensor(np.asarray(grads["embed.weight"])), model.embed.weight.grad, bound
    )


def test_non_persistent_buffers_and_lifted_constants():
    class WithConstants(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.rand(4) + 1, persistent=False)

        def forward(self, x):
            return x * self.scale + torch.tensor([1.0, 2.0, 3.0, 4.0])

    model, x = WithConstants(), torch.randn(2, 4)
    converted = zerojax.convert(model, (x,))
    assert "scale" in converted.buffers
    out, _ = converted.apply(converted.params, converted.buffers, from_torch(x))
    # A product and a sum, each rounded once per side (or fused into one rounding).
    magnitude = (x * model.scale).abs() + torch.tensor([1.0, 2.0, 3.0, 4.0])
    bound = tolerances.rounded_intermediates(torch.float32, 2 * 2, magnitude.double())
    tolerances.assert_within(torch.tensor(np.asarray(out)), model(x), bound)


def test_inputs_match_by_keyword_in_any_order():
    class Keywords(nn.Module):
        def forward(self, x, *, bias, gate=None):
            return x * gate + bias

    x, bias, gate = torch.randn(3), torch.randn(3), torch.randn(3)
    model = Keywords()
    converted = zerojax.convert(model, (x,), {"gate": gate, "bias": bias})
    out, _ = converted.apply({}, {}, from_torch(x), bias=from_torch(bias), gate=from_torch(gate))
    magnitude = ((x * gate).abs() + bias.abs()).double()  # a product and a sum, per side
    bound = tolerances.rounded_intermediates(torch.float32, 2 * 2, magnitude)
    tolerances.assert_within(torch.tensor(np.asarray(out)), model(x, bias=bias, gate=gate), bound)


def test_train_flag_overrides_module_mode_and_restores_it():
    model = nn.Sequential(nn.Dropout(0.5)).eval()
    converted = zerojax.convert(model, (torch.randn(4, 4),), train=True)
    assert converted.train and not model.training
    with pytest.raises(ValueError, match="rng"):
        converted.apply({}, {}, jnp.ones((4, 4)))


def test_float_dtype_override_runs_the_graph_in_bf16():
    model, x = mlp(), torch.randn(4, 16)
    converted = zerojax.convert(model, (x,))
    out, _ = converted.apply(
        converted.params, converted.buffers, from_torch(x), float_dtype=jnp.bfloat16
    )
    assert out.dtype == jnp.bfloat16
    # torch runs in float32: its own error (mlp_error in float32) plus zerojax's in bf16.
    bound = mlp_error(model, x, torch.bfloat16) + mlp_error(model, x)
    tolerances.assert_within(torch.tensor(np.asarray(out, np.float32)), model(x).detach(), bound)


def test_missing_parameter_names_the_key():
    model, x = mlp(), torch.randn(4, 16)
    converted = zerojax.convert(model, (x,))
    params = dict(converted.params)
    del params["2.bias"]
    with pytest.raises(KeyError, match=r"parameter '2\.bias' missing"):
        converted.apply(params, converted.buffers, from_torch(x))


def test_convert_rejects_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        zerojax.convert(lambda x: x, (torch.randn(2),))


def test_single_tensor_args_need_no_tuple():
    model, x = mlp(), torch.randn(4, 16)
    converted = zerojax.convert(model, x)
    out, _ = jax.jit(converted.apply)(converted.params, converted.buffers, from_torch(x))
    tolerances.assert_within(
        torch.tensor(np.asarray(out)), model(x).detach(), 2 * mlp_error(model, x)
    )


def test_input_mutation_is_refused_with_the_fix():
    class Mutates(nn.Module):
        def forward(self, x):
            x.add_(1)
            return x * 2

    with pytest.raises(zerojax.UnsupportedOpError, match="clone"):
        zerojax.convert(Mutates(), (torch.randn(3),))
