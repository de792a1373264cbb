"""zerojax.convert API: inputs, parameters, buffers, tied weights, dtype override, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import zerojax
from zerojax.bridge.dtypes import from_torch


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


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
    np.testing.assert_allclose(grads["embed.weight"], model.embed.weight.grad, rtol=1e-5, atol=1e-5)


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
    np.testing.assert_allclose(out, model(x), rtol=1e-6)


def test_inputs_match_by_keyword_in_any_order():
    class Keywords(nn.Module):
        def forward(self, x, *, bias, gate=None):
            return x * gate + bias

    x, bias, gate = torch.randn(3), torch.randn(3), torch.randn(3)
    model = Keywords()
    converted = zerojax.convert(model, (x,), {"gate": gate, "bias": bias})
    out, _ = converted.apply({}, {}, from_torch(x), bias=from_torch(bias), gate=from_torch(gate))
    np.testing.assert_allclose(out, model(x, bias=bias, gate=gate), rtol=1e-6)


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
    np.testing.assert_allclose(np.asarray(out, np.float32), model(x).detach(), rtol=5e-2, atol=5e-2)


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
    np.testing.assert_allclose(out, model(x).detach(), rtol=1e-5, atol=1e-6)


def test_input_mutation_is_refused_with_the_fix():
    class Mutates(nn.Module):
        def forward(self, x):
            x.add_(1)
            return x * 2

    with pytest.raises(zerojax.UnsupportedOpError, match="clone"):
        zerojax.convert(Mutates(), (torch.randn(3),))
