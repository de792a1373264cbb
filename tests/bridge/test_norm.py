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
import torch.utils._pytree as torch_pytree
from torch import nn

import zerojax
from tests import tolerances
from tests.bridge.parity import Each, check_grad, run_both
from zerojax.bridge.dtypes import from_torch, to_torch

aten = torch.ops.aten
U32 = tolerances.unit_roundoff(torch.float32)

# Every value is compared with its own derived bound (tolerances.normalization: float32 rounding
# of the mean, variance and rsqrt over the n elements normalized together, then of the affine
# map, on these inputs' magnitudes), and a bf16 result with the two roundings to bf16 on top.


def assert_all_within(expected, got, bounds, what: str) -> None:
    """Leaf by leaf |got - expected| <= bound (None: must be equal, e.g. passed-through or
    empty statistics); a bf16 leaf also gets each side's rounding to bf16, u_bf16 |value|."""
    leaves = torch_pytree.tree_leaves(expected)
    got_leaves = torch_pytree.tree_leaves(got)
    assert len(leaves) == len(got_leaves) == len(bounds), (len(leaves), len(got_leaves))
    for i, (e, g, bound) in enumerate(zip(leaves, got_leaves, bounds, strict=True)):
        assert g.dtype == e.dtype, f"{what}[{i}]: dtype {g.dtype} vs {e.dtype}"
        if bound is None:
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=f"{what}[{i}]")
            continue
        bound = bound.reshape(e.shape)
        if e.dtype != torch.float32:
            low = tolerances.unit_roundoff(e.dtype)
            bound = bound + 2 * low * (e.double().abs() + bound)
        tolerances.assert_within(g, e, bound, f"{what}[{i}]")


def norm_bounds(x, dims, epsilon, weight=None, bias=None, **kwargs) -> dict:
    """tolerances.normalization (for modules: weight/bias shaped to broadcast against x)."""
    return tolerances.normalization(x, dims, epsilon, weight=weight, bias=bias, **kwargs)


def channel(param, ndim):
    """A per-channel (C,) parameter shaped to broadcast over (N, C, *spatial)."""
    return None if param is None else param.detach().reshape((1, -1) + (1,) * (ndim - 2))


def eval_bound(x, weight, bias, mean, var, epsilon):
    """Batch norm with given statistics, y = (x - mean) rsqrt(var + eps) w + b, is pointwise:
    per side the subtraction, the add to var, the product and the affine map round (4 u on
    |x_hat w|, 1 u on |y|) and rsqrt is within LIBM_ULPS ulps; two sides double it."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    x_hat = (x.double() - mean.double().reshape(shape)) * (
        var.double().reshape(shape) + epsilon
    ).rsqrt()
    w = 1.0 if weight is None else weight.double().reshape(shape)
    b = 0.0 if bias is None else bias.double().reshape(shape)
    per_side = (tolerances.LIBM_ULPS * tolerances.eps(torch.float32) + 4 * U32) * (
        x_hat * w
    ).abs() + U32 * (x_hat * w + b).abs()
    return 2 * per_side


def running_bounds(x, dims, momentum, running_mean, running_var):
    """New running statistics (1 - m) r + m stat (torch's unbiased variance, n / (n - 1) var):
    m times the statistic's bound (tolerances.normalization's mean bound; the variance's
    (n + 3) u mean(x^2), plus the n / (n - 1) scaling's rounding) and three roundings (two
    products, the add) of the terms' magnitudes, per side; doubled."""
    x = x.double()
    n = x.numel() // x.shape[1]
    mean, var = x.mean(dims), x.var(dims, correction=1)
    mean_error = n * U32 * x.abs().mean(dims)
    var_error = (n / (n - 1)) * (n + 3) * U32 * x.square().mean(dims) + U32 * var
    rm, rv = running_mean.double(), running_var.double()
    new_mean = momentum * mean_error + 3 * U32 * ((1 - momentum) * rm.abs() + momentum * mean.abs())
    new_var = momentum * var_error + 3 * U32 * ((1 - momentum) * rv.abs() + momentum * var)
    return 2 * new_mean, 2 * new_var


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
    inputs = [torch.randn(2, 3, 4) * 3 + 1 for _ in norms]
    expected, got = run_both(Each(*norms), *inputs)
    bounds = [
        norm_bounds(x, tuple(range(3 - len(m.normalized_shape), 3)), m.eps, m.weight, m.bias)["out"]
        for m, x in zip(norms, inputs, strict=True)
    ]
    assert_all_within(expected, got, bounds, "layer norms")


def test_native_layer_norm_stats():
    def fn(x, w, b):
        return (
            aten.native_layer_norm(x, [5], w, b, 1e-5),
            aten.native_layer_norm(x, [3, 5], None, None, 1e-6),
        )

    x, w, b = torch.randn(2, 3, 5) + 2, torch.randn(5), torch.randn(5)
    expected, got = run_both(fn, x, w, b)
    first = norm_bounds(x, (2,), 1e-5, w, b)
    second = norm_bounds(x, (1, 2), 1e-6)
    bounds = [first[k] for k in ("out", "mean", "rstd")] + [
        second[k] for k in ("out", "mean", "rstd")
    ]
    assert_all_within(expected, got, bounds, "native_layer_norm")


def test_layer_norm_bf16():
    """bf16 in and out, statistics in float32 (both sides), every result rounded to bf16."""
    x, w, b = torch.randn(2, 3, 64).bfloat16() + 4, torch.randn(64), torch.randn(64)
    expected, got = run_both(
        lambda x, w, b: aten.native_layer_norm(x, [64], w.bfloat16(), b.bfloat16(), 1e-5),
        x,
        w,
        b,
    )
    bounds = norm_bounds(x, (2,), 1e-5, w.bfloat16(), b.bfloat16())
    assert_all_within(expected, got, [bounds[k] for k in ("out", "mean", "rstd")], "bf16")


# --- group norm ----------------------------------------------------------------------------------


def test_group_norm():
    def fn(x, w, b, y):
        return (
            aten.native_group_norm(x, w, b, 2, 6, 12, 3, 1e-5),
            aten.native_group_norm(y, None, None, 3, 4, 5, 1, 1e-3),
            nn.functional.group_norm(x, 2, w, b),
        )

    inputs = torch.randn(2, 6, 3, 4) * 2 - 1, torch.randn(6), torch.randn(6), torch.randn(3, 4, 5)
    expected, got = run_both(fn, *inputs)
    x, w, b, y = inputs

    # Groups as their own dims: x (N, group, C / group, HxW), normalized over dims (2, 3).
    def grouped(x, groups, w, b, epsilon):
        n, c = x.shape[:2]
        shape = (1, groups, c // groups, 1)
        return norm_bounds(
            x.reshape(n, groups, c // groups, -1),
            (2, 3),
            epsilon,
            w.reshape(shape),
            b.reshape(shape),
        )

    three = grouped(x, 3, w, b, 1e-5)
    two = grouped(x, 2, w, b, 1e-5)
    plain = norm_bounds(y.reshape(3, 1, 4, 5), (2, 3), 1e-3)
    bounds = [three["out"], three["mean"], three["rstd"]]
    bounds += [plain["out"], plain["mean"], plain["rstd"], two["out"]]
    assert_all_within(expected, got, bounds, "group norm")


def test_group_norm_bf16():
    module = randomized(nn.GroupNorm(2, 4)).bfloat16()
    x = torch.randn(2, 4, 5, 5).bfloat16()
    expected, got = run_both(module, x)
    w, b = (p.detach().reshape(1, 2, 2, 1) for p in (module.weight, module.bias))
    bound = norm_bounds(x.reshape(2, 2, 2, 25), (2, 3), module.eps, w, b)["out"]
    assert_all_within(expected, got, [bound], "bf16 group norm")


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
    expected, got = run_both(Each(*norms).eval(), *inputs)
    bounds = [
        eval_bound(x, m.weight, m.bias, m.running_mean, m.running_var, m.eps)
        for m, x in zip(norms, inputs, strict=True)
    ]
    assert_all_within(expected, got, bounds, "eval batch norm")


def test_batch_norm_without_running_stats():
    """track_running_stats=False and InstanceNorm: batch statistics in train and eval mode."""
    norms = [
        randomized(nn.BatchNorm2d(3, track_running_stats=False)),
        randomized(nn.InstanceNorm1d(3, affine=True)),
    ]
    inputs = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 7)
    expected, got = run_both(Each(*norms).eval(), *inputs)
    batch, instance = norms
    bounds = [
        norm_bounds(
            inputs[0], (0, 2, 3), batch.eps, channel(batch.weight, 4), channel(batch.bias, 4)
        )["out"],
        norm_bounds(
            inputs[1], (2,), instance.eps, channel(instance.weight, 3), channel(instance.bias, 3)
        )["out"],
    ]
    assert_all_within(expected, got, bounds, "batch statistics")


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

    x, w, b = torch.randn(4, 3, 5) + 1, torch.randn(3), torch.randn(3)
    expected, got = run_both(fn, x, w, b)
    dims = (0, 2)
    train = norm_bounds(x, dims, 1e-5, channel(w, 3), channel(b, 3))
    no_weight = norm_bounds(x, dims, 1e-3, None, channel(b, 3))
    new_mean, new_var = running_bounds(x, dims, 0.2, mean, var)
    bounds = [train["out"], train["mean"], train["rstd"], new_mean, new_var]
    bounds += [eval_bound(x, w, b, mean, var, 1e-5), None, None, None, None]
    bounds += [no_weight["out"], no_weight["mean"], no_weight["rstd"]]
    bounds += [eval_bound(x, w, None, mean, var, 1e-5), None, None]
    assert_all_within(expected, got, bounds, "batch norm stats")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)),
        (lambda: nn.BatchNorm1d(3, momentum=0.3), (6, 3, 4)),
    ],
)
def test_batch_norm_train_updates_buffers(make, shape, dtype):
    """One train-mode step: output and running_mean/running_var/num_batches_tracked as torch.
    In bf16 torch rounds the batch mean and invstd to bf16 (its saved statistics, in the
    parameters' dtype) before the transform (stats_dtype), and may update the running
    statistics in bf16 arithmetic: three more bf16 roundings (two products, the add) of the
    terms' magnitudes per side."""
    module = randomized(make()).to(dtype).train()
    x = torch.randn(*shape, dtype=dtype) * 2 + 1
    old = {name: buffer.clone() for name, buffer in module.named_buffers()}
    converted = zerojax.convert(module, (x,))
    out, new_buffers = jax.jit(converted.apply)(converted.params, converted.buffers, from_torch(x))
    with torch.no_grad():
        expected = module(x)
    dims = (0, *range(2, x.ndim))
    weight, bias = channel(module.weight, x.ndim), channel(module.bias, x.ndim)
    bound = norm_bounds(x, dims, module.eps, weight, bias, stats_dtype=dtype)
    assert_all_within(expected, to_torch(out), [bound["out"]], "output")
    assert set(new_buffers) == {"running_mean", "running_var", "num_batches_tracked"}
    new_mean, new_var = running_bounds(
        x, dims, module.momentum, old["running_mean"], old["running_var"]
    )
    if dtype != torch.float32:
        low = 3 * tolerances.unit_roundoff(dtype)
        m = module.momentum
        xs = x.double()
        new_mean = new_mean + 2 * low * (
            (1 - m) * old["running_mean"].double().abs() + m * xs.mean(dims).abs()
        )
        new_var = new_var + 2 * low * (
            (1 - m) * old["running_var"].double().abs() + m * xs.var(dims)
        )
    bounds = {"running_mean": new_mean, "running_var": new_var, "num_batches_tracked": None}
    for name, buffer in module.named_buffers():
        got = to_torch(new_buffers[name]).to(buffer.dtype)
        assert_all_within(buffer, got, [bounds[name]], name)


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_grad(train):
    check_grad(randomized(nn.BatchNorm2d(3)).train(train), torch.randn(4, 3, 3, 3))


def _direct(op, *args):
    """A lowering called directly (these overloads are decomposed away before export)."""
    from zerojax.bridge.registry import get_lowering

    jax_args = [from_torch(a) if isinstance(a, torch.Tensor) else a for a in args]
    return [None if v is None else to_torch(v) for v in get_lowering(op)(None, *jax_args)]


def test_native_layer_norm_backward_matches_torch():
    """Both sides start from torch's saved mean and rstd; tolerances.normalization_gradients
    (which also counts the statistics' own errors) bounds the difference."""
    x, w, b = torch.randn(3, 4, 6), torch.randn(6), torch.randn(6)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [6], w, b, 1e-5)
    grad = torch.randn(3, 4, 6)
    args = (grad, x, [6], mean, rstd, w, b, [True, True, True])
    expected = torch.ops.aten.native_layer_norm_backward(*args)
    got = _direct(torch.ops.aten.native_layer_norm_backward.default, *args)
    bounds = tolerances.normalization_gradients(x, (2,), 1e-5, grad, weight=w, bias_shape=(6,))
    for g, want, name in zip(got, expected, ("dx", "dw", "db"), strict=True):
        tolerances.assert_within(g, want, bounds[name], name)


def test_native_group_norm_backward_matches_torch():
    x, w, b = torch.randn(2, 6, 4, 3), torch.randn(6), torch.randn(6)
    _, mean, rstd = torch.ops.aten.native_group_norm(x, w, b, 2, 6, 12, 3, 1e-5)
    grad = torch.randn(2, 6, 4, 3)
    args = (grad, x, mean, rstd, w, 2, 6, 12, 3, [True, True, False])
    expected = torch.ops.aten.native_group_norm_backward(*args)
    got = _direct(torch.ops.aten.native_group_norm_backward.default, *args)
    assert got[2] is None
    # Groups as their own dims: (N, group, C / group, HxW) normalized over dims (2, 3).
    bounds = tolerances.normalization_gradients(
        x.reshape(2, 3, 2, 12),
        (2, 3),
        1e-5,
        grad.reshape(2, 3, 2, 12),
        weight=w.reshape(1, 3, 2, 1),
    )
    tolerances.assert_within(got[0], expected[0], bounds["dx"].reshape(x.shape), "dx")
    tolerances.assert_within(got[1], expected[1], bounds["dw"].reshape(6), "dw")
