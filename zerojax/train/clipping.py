"""`torch.nn.utils.clip_grad_norm_` on a wrapped model's parameters, run on the shards.

zerojax.initialize installs `clip_grad_norm_` in place of torch's: for parameters a zerojax
engine owns it computes the global norm and scales the accumulated gradients in JAX (no
gradient is gathered to the host); for any other parameters it is torch's own function.
"""

from __future__ import annotations

import torch
import torch.nn.utils.clip_grad as torch_clip_grad

_torch_clip_grad_norm = torch_clip_grad.clip_grad_norm_


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch's signature and result (the total norm before clipping, as a tensor)."""
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
        return _torch_clip_grad_norm(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
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
    norm = torch.tensor(float(engine.clip_grad_norm(float(max_norm), float(norm_type))))
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite")
    return norm


def install() -> None:
    """Route torch.nn.utils.clip_grad_norm_ through zerojax (idempotent)."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch_clip_grad.clip_grad_norm_ = clip_grad_norm_
