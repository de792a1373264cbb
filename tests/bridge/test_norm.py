"""Parity of the layer/group/batch norm lowerings (outputs, statistics, gradients, buffers).

Run: .venv/bin/python -m pytest -q tests/bridge/test_norm.py -p no:cacheprovider

What reaches zerojax: nn.LayerNorm -> native_layer_norm, nn.GroupNorm -> native_group_norm,
BatchNorm in eval -> _native_batch_norm_legit_no_training, in train ->
_native_batch_norm_legit_functional (its new running stats are the module's BUFFER_MUTATION
outputs), track_running_stats=False and InstanceNorm -> _native_batch_norm_legit.no_stats.
Calling the aten ops directly also checks the saved statistics (mean, rstd) they return.
"""

import jax
import pytest
import torch
from torch import nn

import zerojax
from tests.bridge.parity import Each, check, check_grad
from zerojax.bridge.dtypes import from_torch, to_torch

FP32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 2e-2, "atol": 2e-2}
aten = torch.ops.aten


def randomized(module: nn.Module) -> nn.Module:
    """Random affine parameters and running statistics, so none of them is a no-op 1 or 0."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param))
        for name, buffer in module.named_buffers():
            if name.endswith("running_mean"):
                buffer.normal_()
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 2.0)
    return module


# --- layer norm ----------------------------------------------------------------------------------


def test_layer_norm_modules():
    norms = [
        randomized(nn.LayerNorm(4)),
        randomized(nn.LayerNorm((3, 4), eps=1e-3)),
        nn.LayerNorm(4, elementwise_affine=False),
        randomized(nn.LayerNorm(4, bias=False)),
    ]
    check(Each(*norms), *(torch.randn(2, 3, 4) * 3 + 1 for _ in norms), **FP32)


def test_native_layer_norm_stats():
    def fn(x, w, b):
        return (
            aten.native_layer_norm(x, [5], w, b, 1e-5),
            aten.native_layer_norm(x, [3, 5], None, None, 1e-6),
        )

    check(fn, torch.randn(2, 3, 5) + 2, torch.randn(5), torch.randn(5), **FP32)


def test_layer_norm_bf16():
    x, w, b = torch.randn(2, 3, 64).bfloat16() + 4, torch.randn(64), torch.randn(64)
    check(
        lambda x, w, b: aten.native_layer_norm(x, [64], w.bfloat16(), b.bfloat16(), 1e-5),
        x,
        w,
        b,
        **BF16,
    )


# --- group norm ----------------------------------------------------------------------------------


def test_group_norm():
    def fn(x, w, b, y):
        return (
            aten.native_group_norm(x, w, b, 2, 6, 12, 3, 1e-5),
            aten.native_group_norm(y, None, None, 3, 4, 5, 1, 1e-3),
            nn.functional.group_norm(x, 2, w, b),
        )

    inputs = torch.randn(2, 6, 3, 4) * 2 - 1, torch.randn(6), torch.randn(6), torch.randn(3, 4, 5)
    check(fn, *inputs, **FP32)


def test_group_norm_bf16():
    check(randomized(nn.GroupNorm(2, 4)).bfloat16(), torch.randn(2, 4, 5, 5).bfloat16(), **BF16)


def test_group_and_layer_norm_grad():
    norms = nn.Sequential(randomized(nn.GroupNorm(3, 6)), randomized(nn.LayerNorm((6, 4))))
    check_grad(norms, torch.randn(2, 6, 4))


# --- batch norm ----------------------------------------------------------------------------------


def test_batch_norm_eval():
    norms = [
        randomized(nn.BatchNorm1d(3)),
        randomized(nn.BatchNorm2d(3)),
        randomized(nn.BatchNorm3d(2, affine=False)),
    ]
    inputs = torch.randn(4, 3), torch.randn(2, 3, 4, 4), torch.randn(2, 2, 3, 3, 3)
    check(Each(*norms).eval(), *inputs, **FP32)


def test_batch_norm_without_running_stats():
    """track_running_stats=False and InstanceNorm: batch statistics in train and eval mode."""
    norms = [
        randomized(nn.BatchNorm2d(3, track_running_stats=False)),
        randomized(nn.InstanceNorm1d(3, affine=True)),
    ]
    inputs = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 7)
    check(Each(*norms).eval(), *inputs, **FP32)


def test_native_batch_norm_stats():
    """save_mean/save_invstd of the functional (train and eval) and no_stats overloads."""
    mean, var = torch.randn(3), torch.rand(3) + 0.5

    def fn(x, w, b):
        return (
            aten._native_batch_norm_legit_functional(x, w, b, mean, var, True, 0.2, 1e-5),
            aten._native_batch_norm_legit_functional(x, w, b, mean, var, False, 0.2, 1e-5),
            aten._native_batch_norm_legit(x, None, b, True, 0.1, 1e-3),
            aten._native_batch_norm_legit_no_training(x, w, None, mean, var, 0.1, 1e-5),
        )

    check(fn, torch.randn(4, 3, 5) + 1, torch.randn(3), torch.randn(3), **FP32)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)),
        (lambda: nn.BatchNorm1d(3, momentum=0.3), (6, 3, 4)),
    ],
)
def test_batch_norm_train_updates_buffers(make, shape, dtype, tol):
    """One train-mode step: output and running_mean/running_var/num_batches_tracked as torch."""
    module = randomized(make()).to(dtype).train()
    x = torch.randn(*shape, dtype=dtype) * 2 + 1
    converted = zerojax.convert(module, (x,))
    out, new_buffers = jax.jit(converted.apply)(converted.params, converted.buffers, from_torch(x))
    with torch.no_grad():
        expected = module(x)
    torch.testing.assert_close(to_torch(out), expected, **tol)
    assert set(new_buffers) == {"running_mean", "running_var", "num_batches_tracked"}
    for name, buffer in module.named_buffers():
        got = to_torch(new_buffers[name])
        torch.testing.assert_close(
            got.to(buffer.dtype), buffer, **tol, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_grad(train):
    check_grad(randomized(nn.BatchNorm2d(3)).train(train), torch.randn(4, 3, 3, 3))


def test_batch_norm_closed_form_backward():
    """Train-mode batch norm differentiates through norm._standardize, whose vjp is torch's
    closed form (it fixed a 1e-3 gradient error on ResNet-18, tests/tools/test_model_coverage.py).
    Its vjp, including the cotangents of the mean and variance it also returns (they feed the
    running statistics), must match finite differences. fp32 central differences with step
    1e-2 on O(1) values are good to ~1e-2 relative, hence the tolerance."""
    from jax.test_util import check_grads

    from zerojax.bridge.lowerings.norm import _standardize

    x = from_torch(torch.randn(4, 3, 5) * 2 + 1)
    check_grads(
        lambda x: _standardize(x, (0, 2), 1e-5),
        (x,),
        order=1,
        modes=["rev"],
        atol=2e-2,
        rtol=2e-2,
        eps=1e-2,
    )


def _direct(op, *args):
    """A lowering called directly (these overloads are decomposed away before export)."""
    from zerojax.bridge.registry import get_lowering

    jax_args = [from_torch(a) if isinstance(a, torch.Tensor) else a for a in args]
    return [None if v is None else to_torch(v) for v in get_lowering(op)(None, *jax_args)]


def test_native_layer_norm_backward_matches_torch():
    x, w, b = torch.randn(3, 4, 6), torch.randn(6), torch.randn(6)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [6], w, b, 1e-5)
    grad = torch.randn(3, 4, 6)
    args = (grad, x, [6], mean, rstd, w, b, [True, True, True])
    expected = torch.ops.aten.native_layer_norm_backward(*args)
    for got, want in zip(
        _direct(torch.ops.aten.native_layer_norm_backward.default, *args), expected
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_group_norm_backward_matches_torch():
    x, w, b = torch.randn(2, 6, 4, 3), torch.randn(6), torch.randn(6)
    _, mean, rstd = torch.ops.aten.native_group_norm(x, w, b, 2, 6, 12, 3, 1e-5)
    grad = torch.randn(2, 6, 4, 3)
    args = (grad, x, mean, rstd, w, 2, 6, 12, 3, [True, True, False])
    expected = torch.ops.aten.native_group_norm_backward(*args)
    got = _direct(torch.ops.aten.native_group_norm_backward.default, *args)
    assert got[2] is None
    for g, want in zip(got[:2], expected[:2]):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
