"""Gradient clipping on the shards, and the opt-in route for `torch.nn.utils.clip_grad_norm_`.

The wrapped model's `clip_grad_norm_(max_norm, norm_type)` (as FSDP has) clips the engine's
accumulated gradients in JAX: no gradient is gathered to the host. Nothing global changes by
default. With `train.patch_clip_grad_norm: true`, `torch.nn.utils.clip_grad_norm_` is replaced
by `clip_grad_norm_` below while at least one engine that asked for it is alive; a finalizer on
each such engine restores torch's function when the last one is collected.

Unpatched, torch's own function on zerojax parameters gathers each `p.grad` (a read-only host
copy) and then fails on its in-place scaling with an error naming `model.clip_grad_norm_` and
the config key: it cannot silently clip a copy.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.utils.clip_grad as torch_clip_grad

__all__ = ["clip_grad_norm_", "patch_torch_clip_grad_norm", "torch_clip_grad_norm_"]

torch_clip_grad_norm_ = torch_clip_grad.clip_grad_norm_
"""torch's own function, as imported before any patch."""

_lock = threading.Lock()
_num_patching_engines = 0


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch's signature and result (the total norm before clipping, as a tensor); for the
    parameters of one zerojax model it clips on the shards, for others it is torch's."""
    from zerojax.train.module import ShardedParameter

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    engines = {
        id(p._zerojax_engine): p._zerojax_engine
        for p in parameters
        if isinstance(p, ShardedParameter)
    }
    if not engines:
        return torch_clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    others = [p for p in parameters if not isinstance(p, ShardedParameter) and p.grad is not None]
    if len(engines) > 1 or others:
        raise ValueError(
            "zerojax: clip_grad_norm_ over parameters of several models (or zerojax and plain "
            "torch parameters together) is not supported; clip each model's parameters "
            "separately or set train.gradient_clipping in the config"
        )
    (engine,) = engines.values()
    owned = {p._zerojax_name for p in parameters}
    # Parameters without a gradient (frozen, or cleared) do not count, as in torch.
    if engine.grads is not None and not set(engine.grads) <= owned:
        raise ValueError(
            "zerojax: clip_grad_norm_ must be given all of the model's parameters "
            "(model.parameters()); clipping a subset is not supported"
        )
    return clip_engine_grad_norm_(engine, max_norm, norm_type, error_if_nonfinite)


def clip_engine_grad_norm_(
    engine, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip all of `engine`'s accumulated gradients; the total norm before clipping."""
    norm = torch.tensor(float(engine.clip_grad_norm(float(max_norm), float(norm_type))))
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite")
    return norm


def patch_torch_clip_grad_norm(engine) -> None:
    """Route `torch.nn.utils.clip_grad_norm_` through zerojax while `engine` is alive."""
    global _num_patching_engines
    with _lock:
        if _num_patching_engines == 0:
            torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
            torch_clip_grad.clip_grad_norm_ = clip_grad_norm_
        _num_patching_engines += 1
    weakref.finalize(engine, _engine_gone)


def _engine_gone() -> None:
    global _num_patching_engines
    with _lock:
        _num_patching_engines -= 1
        if _num_patching_engines:
            return
        # Restore only what is still ours: a later patch by someone else stays in place.
        if torch.nn.utils.clip_grad_norm_ is clip_grad_norm_:
            torch.nn.utils.clip_grad_norm_ = torch_clip_grad_norm_
        if torch_clip_grad.clip_grad_norm_ is clip_grad_norm_:
            torch_clip_grad.clip_grad_norm_ = torch_clip_grad_norm_
