"""Shared parity check: convert a torch callable with zerojax and compare with torch eager."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree

import zerojax
from tests import tolerances
from zerojax.bridge.dtypes import from_torch, to_torch

# Defaults derived in tests/tolerances.py: elementwise results (ELEMENTWISE) and gradients
# through elementwise ops and short reductions (GRADIENT); callers with longer accumulations,
# special functions or other dtypes pass their own derived tolerances.
RTOL, ATOL = tolerances.ELEMENTWISE["rtol"], tolerances.ELEMENTWISE["atol"]
GRAD_RTOL, GRAD_ATOL = tolerances.GRADIENT["rtol"], tolerances.GRADIENT["atol"]


class Lambda(torch.nn.Module):
    """Wrap a function of tensors as a module so torch.export can capture it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class Each(torch.nn.Module):
    """Apply the i-th module to the i-th input: many cases in one export and one compile."""

    def __init__(self, *modules):
        super().__init__()
        self.layers = torch.nn.ModuleList(modules)

    def forward(self, *inputs):
        return [layer(x) for layer, x in zip(self.layers, inputs, strict=True)]


def run_both(fn_or_module, *args, jit: bool = True, **kwargs):
    """(torch eager output, zerojax output as torch tensors) for the same inputs."""
    module = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else Lambda(fn_or_module)
    with torch.no_grad():
        expected = module(*args, **kwargs)
    converted = zerojax.convert(module, args, kwargs)
    apply = jax.jit(converted.apply) if jit else converted.apply
    jax_args, jax_kwargs = torch_pytree.tree_map_only(torch.Tensor, from_torch, (args, kwargs))
    got, _ = apply(converted.params, converted.buffers, *jax_args, **jax_kwargs)
    got = torch_pytree.tree_map(lambda x: to_torch(x) if isinstance(x, jax.Array) else x, got)
    return expected, got


def assert_close(expected, got, *, rtol=RTOL, atol=ATOL, what=""):
    """Leaf-wise comparison; integer/bool results must match exactly, dtypes must agree."""
    exp_leaves = torch_pytree.tree_leaves(expected)
    got_leaves = torch_pytree.tree_leaves(got)
    assert len(exp_leaves) == len(got_leaves), f"{what}: {len(exp_leaves)} vs {len(got_leaves)}"
    for i, (e, g) in enumerate(zip(exp_leaves, got_leaves)):
        if not isinstance(e, torch.Tensor):
            assert e == g, f"{what}[{i}]: {e!r} != {g!r}"
            continue
        g = torch.as_tensor(g)
        expected_dtype = {
            torch.int64: torch.int32,
            torch.float64: torch.float32,
            torch.complex128: torch.complex64,
        }.get(e.dtype, e.dtype)
        assert g.dtype in (e.dtype, expected_dtype), f"{what}[{i}]: dtype {g.dtype} vs {e.dtype}"
        assert tuple(g.shape) == tuple(e.shape), f"{what}[{i}]: shape {g.shape} vs {e.shape}"
        torch.testing.assert_close(
            g.to(e.dtype),
            e,
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m, i=i: f"{what}[{i}]: {m}",
        )


# A torch gradient below this fraction of the largest one may be float noise of an analytically
# zero gradient (an attention key bias: softmax ignores a per-query constant), which zerojax may
# legitimately compute as exactly 0; above it, an exact 0 means the gradient was dropped. Not a
# comparison tolerance: rounding noise of a float32 gradient is ~ (accumulation length) x 2^-24
# of the largest (< 1e-5 for sums of up to ~170 terms); the tests' real gradients are >= 1e-2.
VANISHED_FLOOR = 1e-5


def _float64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x, np.float64)


def vanished_gradients(got: Mapping[str, object], expected: Mapping[str, object]) -> list[str]:
    """Names whose torch gradient is nonzero (above VANISHED_FLOOR of the largest gradient norm)
    while zerojax's is exactly zero everywhere: the signature of a stop_gradient or a cotangent
    returned as None somewhere in a lowering (issue 15: Swin's relative position table), which
    a relative-error check can miss when the parameter's gradient is small."""
    norms = {name: float(np.linalg.norm(_float64(e))) for name, e in expected.items()}
    floor = VANISHED_FLOOR * max(norms.values(), default=0.0)
    return [
        name
        for name, norm in norms.items()
        if norm > floor and norm > 0.0 and not _float64(got[name]).any()
    ]


def assert_no_vanished_gradients(
    got: Mapping[str, object], expected: Mapping[str, object], *, what: str = ""
) -> None:
    """Fail naming every parameter that torch trains and zerojax gives an all-zero gradient.

    `got`: name -> zerojax gradient (jax/numpy); `expected`: name -> torch gradient (same names).
    """
    missing = sorted(set(expected) - set(got))
    assert not missing, f"{what}: no zerojax gradient for {missing}"
    offenders = vanished_gradients(got, expected)
    assert not offenders, (
        f"{what}: zerojax gradient is all zero where torch's is not, for "
        + ", ".join(
            f"{name} (torch |grad| = {np.linalg.norm(_float64(expected[name])):.3g})"
            for name in offenders
        )
    )


def float64_gradient_errors(module: torch.nn.Module, *args: torch.Tensor) -> dict[str, float]:
    """Relative (norm-wise) error of zerojax's fp32 gradients against torch in float64.

    The loss is a random weighting of the module's single float output; gradients are taken for
    every floating-point input ("input i") and parameter (its name). For tests whose tolerance is
    derived from fp32 rounding: a float64 reference has no error of its own to share it with.
    """
    inputs = [a.detach().double().requires_grad_(a.is_floating_point()) for a in args]
    module64 = copy.deepcopy(module).double()
    out64 = module64(*inputs)
    cotangent = torch.randn_like(out64)
    (out64 * cotangent).sum().backward()
    expected = {f"input {i}": a.grad for i, a in enumerate(inputs) if a.is_floating_point()}
    expected |= {name: p.grad for name, p in module64.named_parameters()}

    converted = zerojax.convert(module, tuple(a.detach() for a in args))
    jax_args = [from_torch(a.detach()) for a in args]
    floats = [i for i, a in enumerate(args) if a.is_floating_point()]

    def loss(params, float_args):
        inputs = list(jax_args)
        for i, value in zip(floats, float_args, strict=True):
            inputs[i] = value
        out, _ = converted.apply(params, converted.buffers, *inputs)
        return (out * from_torch(cotangent.float())).sum()

    grad_params, grad_inputs = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        converted.params, [jax_args[i] for i in floats]
    )
    got = {f"input {i}": g for i, g in zip(floats, grad_inputs, strict=True)}
    got |= {name: grad_params[converted.alias[name]] for name, _ in module.named_parameters()}
    errors = {}
    for name, want in expected.items():
        want = want.numpy()
        diff = np.linalg.norm(np.asarray(got[name], np.float64) - want)
        errors[name] = float(diff / max(np.linalg.norm(want), np.finfo(np.float64).tiny))
    return errors


def check(fn_or_module, *args, rtol=RTOL, atol=ATOL, jit=True, **kwargs):
    expected, got = run_both(fn_or_module, *args, jit=jit, **kwargs)
    assert_close(expected, got, rtol=rtol, atol=atol, what=getattr(fn_or_module, "__name__", ""))
    return got


def check_grad(fn_or_module, *args, wrt=None, rtol=GRAD_RTOL, atol=GRAD_ATOL):
    """jax.grad through the converted module equals torch autograd, for inputs and parameters.

    The loss is a random weighting of every float output (a plain sum would make the gradient
    of softmax or a normalisation vanish). `wrt`: indices of the inputs to differentiate
    (default: every floating-point input); every floating-point parameter is always included.
    """
    module = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else Lambda(fn_or_module)
    if wrt is None:
        wrt = tuple(i for i, a in enumerate(args) if a.is_floating_point())
    leaves = [a.detach().clone().requires_grad_(i in wrt) for i, a in enumerate(args)]
    outputs = [o for o in torch_pytree.tree_leaves(module(*leaves)) if o.is_floating_point()]
    cotangents = [torch.randn_like(o) for o in outputs]
    params = {n: p for n, p in module.named_parameters() if p.is_floating_point()}
    total = sum((o * c).sum() for o, c in zip(outputs, cotangents, strict=True))
    expected = torch.autograd.grad(
        total, [leaves[i] for i in wrt] + list(params.values()), allow_unused=True
    )
    expected = [
        torch.zeros_like(t) if g is None else g
        for g, t in zip(expected, [leaves[i] for i in wrt] + list(params.values()))
    ]

    converted = zerojax.convert(module, tuple(a.detach() for a in args))
    jax_args = [from_torch(a.detach()) for a in args]

    def loss(params, wrt_values):
        inputs = list(jax_args)
        for i, value in zip(wrt, wrt_values, strict=True):
            inputs[i] = value
        out, _ = converted.apply(params, converted.buffers, *inputs)
        floats = [
            o for o in jax.tree.leaves(out) if jax.numpy.issubdtype(o.dtype, jax.numpy.floating)
        ]
        return sum((o * from_torch(c)).sum() for o, c in zip(floats, cotangents, strict=True))

    grad_params, grad_inputs = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        converted.params, [jax_args[i] for i in wrt]
    )
    got = [to_torch(g) for g in grad_inputs]
    got += [to_torch(grad_params[converted.alias[name]]) for name in params]
    names = [f"input {i}" for i in wrt] + list(params)
    assert_no_vanished_gradients(
        dict(zip(names, got, strict=True)),
        {n: e.detach() for n, e in zip(names, expected, strict=True)},
        what=getattr(fn_or_module, "__name__", type(module).__name__),
    )
    for name, g, e in zip(names, got, expected, strict=True):
        torch.testing.assert_close(
            g, e, rtol=rtol, atol=atol, msg=lambda m, n=name: f"grad {n}: {m}"
        )
