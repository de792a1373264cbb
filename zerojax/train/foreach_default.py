"""torch.optim's multi-tensor (`foreach`) implementations for live parameters.

A torch optimizer left at `foreach=None` picks its implementation per step with
`torch.optim.optimizer._default_to_fused_or_foreach`: the `_foreach_*` one only when every
parameter is a plain tensor on a CUDA-like device. zerojax's parameters are stand-ins on `cpu`
(`zerojax.train.parameters`), so torch would run the single-tensor loop: several ops per
parameter, each dispatched through Python. Every op is recorded into one program either way
(`zerojax.train.deferred`); the multi-tensor form records the same math with a fraction of the
Python per step (RMSprop on the GPT-2 bench model: 109 ms -> 41 ms per step, see
BENCHMARKS.md). So for parameters that are zerojax's, the default is `foreach=True`, as it
is for CUDA parameters; an explicit `foreach=False` or `fused=` is the user's and is kept.

torch's gradient clipping (`clip_grad_norm_`, `clip_grad_value_`, `get_total_norm`) decides
the same way with `_has_foreach_support` (its per-tensor loop: a norm and a multiply per
gradient; the foreach one: one `_foreach_norm` and one `_foreach_mul_`), and gets the same
default.

torch's modules import these functions by name, so each module's reference is replaced
(`install`, idempotent).
"""

from __future__ import annotations

import functools
import importlib

import torch

__all__ = ["install"]

# torch.optim modules whose step() asks `_default_to_fused_or_foreach` (torch 2.11-2.15).
_OPTIMIZER_MODULES = (
    "adadelta",
    "adagrad",
    "adam",
    "adamax",
    "asgd",
    "nadam",
    "radam",
    "rmsprop",
    "rprop",
    "sgd",
    "_adafactor",
)


def install() -> None:
    """Default torch.optim's and torch's gradient clipping's foreach choice to True for
    zerojax's live parameters and gradients."""
    from zerojax.train.live_tensor import LiveTensor
    from zerojax.train.parameters import ShardedParameter

    live_types = (ShardedParameter, LiveTensor)
    for name in _OPTIMIZER_MODULES:
        try:
            module = importlib.import_module(f"torch.optim.{name}")
        except ImportError:  # an optimizer this torch does not have
            continue
        original = getattr(module, "_default_to_fused_or_foreach", None)
        if original is None or getattr(original, "_zerojax_live", False):
            continue
        module._default_to_fused_or_foreach = _live_default(original, live_types)
    clip_grad = importlib.import_module("torch.nn.utils.clip_grad")
    original = getattr(clip_grad, "_has_foreach_support", None)
    if original is not None and not getattr(original, "_zerojax_live", False):
        clip_grad._has_foreach_support = _live_support(original, live_types)


def _live_default(original, live_types: tuple[type, ...]):
    @functools.wraps(original)
    def choose(params, differentiable: bool, use_fused: bool = False) -> tuple[bool, bool]:
        present = [p for p in params if p is not None]
        if (
            not differentiable
            and present
            and all(isinstance(p, live_types) for p in present)
            and not torch.jit.is_scripting()
        ):
            return False, True
        return original(params, differentiable, use_fused)

    choose._zerojax_live = True  # type: ignore[attr-defined]
    return choose


def _live_support(original, live_types: tuple[type, ...]):
    @functools.wraps(original)
    def supported(tensors, device) -> bool:
        present = [t for t in tensors if t is not None]
        if present and all(isinstance(t, live_types) for t in present):
            return not torch.jit.is_scripting()
        return original(tensors, device)

    supported._zerojax_live = True  # type: ignore[attr-defined]
    return supported
