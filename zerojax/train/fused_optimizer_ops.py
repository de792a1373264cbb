"""torch's fused optimizer kernels (`fused=True`) on live tensors, as torch's foreach steps.

`torch.optim.AdamW(fused=True)` -- the Hugging Face Trainer's default optimizer
(`adamw_torch_fused`) -- and `Adam`/`SGD(fused=True)` end in one ATen op per step,
`aten._fused_adamw_` (`_fused_adam_`, `_fused_sgd_`), which the bridge has no lowering for: on
live tensors it ran on host copies of every parameter, gradient and moment, each step (the
Trainer with only the `initialize` line stepped 6x slower than with its optimizer handed to
`initialize`, see BENCHMARKS.md). The same step is torch's own multi-tensor implementation,
`torch.optim.adam._multi_tensor_adam` / `sgd._multi_tensor_sgd`, whose ops are recorded into
one program like any other (`zerojax.train.deferred`); the two agree to float32 rounding, as
torch's own tests hold its fused and foreach paths to.

The fused op is called after torch's `_fused_adam` has advanced the step counts (the foreach
step advances them itself): they are stepped back first. A gradient scaler's `grad_scale` /
`found_inf` (fp16 AMP) keeps the host path, which computes exactly what torch does.
"""

from __future__ import annotations

import threading

import torch
from torch.optim import adam, sgd

__all__ = ["FUSED_OPTIMIZER_OPS", "in_fused_adam_step", "run_fused_step"]

aten = torch.ops.aten

FUSED_OPTIMIZER_OPS = frozenset(
    {
        aten._fused_adamw_.default,
        aten._fused_adamw_.tensor_lr,
        aten._fused_adam_.default,
        aten._fused_adam_.tensor_lr,
        aten._fused_sgd_.default,
        aten._fused_sgd_.tensor_lr,
    }
)


# Set while `run_fused_step` runs torch's multi-tensor Adam for a fused op (on this thread).
_in_fused_adam = threading.local()


def in_fused_adam_step() -> bool:
    """Whether torch's multi-tensor Adam is called by `run_fused_step` for a fused op (not by
    an optimizer's step: `zerojax.train.recorded_adam` routes that call through the fused op)."""
    return getattr(_in_fused_adam, "active", False)


def run_fused_step(func, args: tuple, kwargs: dict) -> bool:
    """Run fused optimizer op `func` as torch's foreach step; False (nothing done) where it
    must run as it is (a gradient scaler's arguments)."""
    if kwargs.get("grad_scale") is not None or kwargs.get("found_inf") is not None:
        return False
    if func in (aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr):
        params, grads, momentum_buffers = args
        # On the first step the fused kernel fills the (empty) buffers itself; the foreach
        # step makes them from the gradients when given none, and they are copied in.
        # Without momentum the fused op gets no buffers; the foreach step wants a None each.
        fresh = kwargs["is_first_step"] or not momentum_buffers
        buffers = [None] * len(params) if fresh else list(momentum_buffers)
        sgd._multi_tensor_sgd(
            list(params), list(grads), buffers, None, None,
            weight_decay=kwargs["weight_decay"], momentum=kwargs["momentum"], lr=kwargs["lr"],
            dampening=kwargs["dampening"], nesterov=kwargs["nesterov"],
            maximize=kwargs["maximize"], has_sparse_grad=False,
        )  # fmt: skip
        if kwargs["is_first_step"] and momentum_buffers:
            for kept, made in zip(momentum_buffers, buffers, strict=True):
                kept.copy_(made)
        return True
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = args
    steps = list(state_steps)
    torch._foreach_sub_(steps, 1)  # the foreach step advances them again
    _in_fused_adam.active = True
    try:
        adam._multi_tensor_adam(
            list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs),
            steps, None, None,
            amsgrad=kwargs["amsgrad"], has_complex=False, beta1=kwargs["beta1"],
            beta2=kwargs["beta2"], lr=kwargs["lr"], weight_decay=kwargs["weight_decay"],
            eps=kwargs["eps"], maximize=kwargs["maximize"], capturable=False,
            differentiable=False,
            decoupled_weight_decay=func
            in (aten._fused_adamw_.default, aten._fused_adamw_.tensor_lr),
        )  # fmt: skip
    finally:
        _in_fused_adam.active = False
    return True
