"""Shared parity check: convert a torch callable with zerojax and compare with torch eager."""

from __future__ import annotations

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree

import zerojax
from zerojax.bridge.dtypes import from_torch, to_torch


class Lambda(torch.nn.Module):
    """Wrap a function of tensors as a module so torch.export can capture it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


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


def assert_close(expected, got, *, rtol=1.3e-6, atol=1e-5, what=""):
    """Leaf-wise comparison; integer/bool results must match exactly, dtypes must agree."""
    exp_leaves = torch_pytree.tree_leaves(expected)
    got_leaves = torch_pytree.tree_leaves(got)
    assert len(exp_leaves) == len(got_leaves), f"{what}: {len(exp_leaves)} vs {len(got_leaves)}"
    for i, (e, g) in enumerate(zip(exp_leaves, got_leaves)):
        if not isinstance(e, torch.Tensor):
            assert e == g, f"{what}[{i}]: {e!r} != {g!r}"
            continue
        g = torch.as_tensor(g)
        expected_dtype = {torch.int64: torch.int32, torch.float64: torch.float32}.get(
            e.dtype, e.dtype
        )
        assert g.dtype in (e.dtype, expected_dtype), f"{what}[{i}]: dtype {g.dtype} vs {e.dtype}"
        assert tuple(g.shape) == tuple(e.shape), f"{what}[{i}]: shape {g.shape} vs {e.shape}"
        torch.testing.assert_close(
            g.to(e.dtype),
            e,
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m: f"{what}[{i}]: {m}",
        )


def check(fn_or_module, *args, rtol=1.3e-6, atol=1e-5, jit=True, **kwargs):
    expected, got = run_both(fn_or_module, *args, jit=jit, **kwargs)
    assert_close(expected, got, rtol=rtol, atol=atol, what=getattr(fn_or_module, "__name__", ""))
    return got
