"""torch.optim's multi-tensor Adam/AdamW step on live tensors, recorded as one op.

An Adam/AdamW that runs its own `step()` on live tensors (a subclass of torch's built after
`initialize`, one of several optimizers on one model, `fused=True` included:
`zerojax.train.fused_optimizer_ops`; torch's own AdamW built after `initialize` on the whole
model is adopted by the compiled update instead, `zerojax.train.late_optimizers`). Its
foreach implementation, `torch.optim.adam._multi_tensor_adam`, issues a dozen `_foreach_*`
ops, each recorded element by element: Python work per parameter per op, every step. Here
the whole call is recorded as one op over all its parameters, computing what the engine's
compiled update computes (`zerojax.train.optimizers.adam_param_update`: torch's CPU
arithmetic, bias corrections rounded as torch rounds them), so such a step costs about what
the compiled update does.

The step counts stay torch's host tensors, advanced here as torch advances them; the
learning rate, betas, eps and weight decay are program inputs (a schedule never recompiles).
A step from an optimizer's `step()` is made one call of the fused op on the live tensors
(`_as_fused_op`), which `zerojax.train.replay` traces and replays: its scalar inputs are
derived anew from each call's floats and step counts (`_fused_step_scalars`).
Anything else -- a gradient scaler's `grad_scale`/`found_inf`, `capturable`, `differentiable`,
complex or non-live tensors, tensor hyperparameters -- runs torch's own function unchanged.

torch's modules look the function up by name at each step, so `install` replaces the name in
`torch.optim.adam` (idempotent); AdamW calls Adam's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.optim import adam

from zerojax.pallas_kernels.adamw.bias_correction import adam_bias_corrections
from zerojax.train import deferred, optimizers, replay
from zerojax.train.fused_optimizer_ops import in_fused_adam_step
from zerojax.train.live_tensor import LiveTensor
from zerojax.train.parameters import live_of

__all__ = ["install"]

aten = torch.ops.aten
# `optimizers.group_hyper`'s keys for Adam and AdamW, in the order the recorded op takes them.
_HYPER_KEYS = optimizers.hyper_keys("AdamW")


def install() -> None:
    """Record torch.optim's multi-tensor Adam/AdamW step as one op for live tensors."""
    original = adam._multi_tensor_adam
    if getattr(original, "_zerojax_live", False):
        return

    @functools.wraps(original)
    def multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                          grad_scale, found_inf, **options):  # fmt: skip
        lists = [params, grads, exp_avgs, exp_avg_sqs]
        if options["amsgrad"]:
            lists.append(max_exp_avg_sqs)
        live = [[live_of(t) for t in tensors] for tensors in lists]
        recordable = (
            grad_scale is None
            and found_inf is None
            and not options["capturable"]
            and not options["differentiable"]
            and not options["has_complex"]
            and all(not isinstance(options[k], torch.Tensor) for k in ("lr", "beta1", "beta2"))
            and all(t is not None for tensors in live for t in tensors)
            and not any(isinstance(s, LiveTensor) for s in state_steps)
            and len(params) > 0
        )
        if not recordable:
            return original(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                            grad_scale, found_inf, **options)  # fmt: skip
        if in_fused_adam_step():
            _record(live, state_steps, options)
        else:
            _as_fused_op(live, max_exp_avg_sqs, state_steps, options)
        return None

    multi_tensor_adam._zerojax_live = True  # type: ignore[attr-defined]
    adam._multi_tensor_adam = multi_tensor_adam
    replay.derive_scalars(
        {
            aten._fused_adamw_.default: functools.partial(_fused_step_scalars, True),
            aten._fused_adam_.default: functools.partial(_fused_step_scalars, False),
        }
    )


def _scalar_inputs(state_steps: list[torch.Tensor], options) -> list:
    """The recorded op's scalar inputs: the step counts (advanced), then the hyperparameters
    in `_HYPER_KEYS` order (`optimizers.group_hyper`: torch's floats and what is computed
    from them in float64)."""
    hyper = optimizers.group_hyper(
        "AdamW" if options["decoupled_weight_decay"] else "Adam",
        {
            "lr": options["lr"],
            "betas": (options["beta1"], options["beta2"]),
            "eps": options["eps"],
            "weight_decay": options["weight_decay"],
        },
    )
    counts = np.asarray([int(s.item()) for s in state_steps], np.int32)
    return [counts, *(hyper[k] for k in _HYPER_KEYS)]


def _fused_step_scalars(decoupled: bool, args: tuple, kwargs: dict):
    """`replay.derive_scalars` for `aten._fused_adam(w)_` on live tensors
    (`fused_optimizer_ops.run_fused_step`, then `_record`): the op key's part that comes
    from the call's floats, and the scalar inputs `_record` gives the op; None where the call
    runs otherwise (a gradient scaler's arguments)."""
    if kwargs.get("grad_scale") is not None or kwargs.get("found_inf") is not None:
        return None
    options = {k: kwargs[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")}
    steps = list(args[5])
    # Host step counts only: reading a live one here would run the recording mid-call.
    if any(type(v) is not float for v in options.values()) or any(
        type(s) is not torch.Tensor for s in steps
    ):
        return None
    options["decoupled_weight_decay"] = decoupled
    # torch has advanced the step counts before the call; the call leaves them so.
    return options["weight_decay"] != 0, _scalar_inputs(steps, options)


def _as_fused_op(live: list[list[LiveTensor]], max_exp_avg_sqs, state_steps, options) -> None:
    """A foreach step (an AdamW subclass built after `initialize`) as the fused op on the
    live tensors: one ATen call, which `zerojax.train.replay` traces and replays with its
    derived scalars (`_fused_step_scalars`), where the recording made here would be an op
    recorded outside torch's dispatch, never replayed. The fused op takes the step counts
    advanced (`run_fused_step` steps them back, `_record` advances them again)."""
    torch._foreach_add_(state_steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
    op = aten._fused_adamw_ if options["decoupled_weight_decay"] else aten._fused_adam_
    op.default(
        live[0], live[1], live[2], live[3], live[4] if options["amsgrad"] else [],
        state_steps,
        lr=options["lr"], beta1=options["beta1"], beta2=options["beta2"],
        weight_decay=options["weight_decay"], eps=options["eps"], amsgrad=options["amsgrad"],
        maximize=options["maximize"],
    )  # fmt: skip


def _record(live: list[list[LiveTensor]], state_steps: list[torch.Tensor], options) -> None:
    # torch's host step counts, advanced as torch's own step advances them (one CPU scalar
    # tensor, not a 1 wrapped per element)
    torch._foreach_add_(state_steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
    scalars = _scalar_inputs(state_steps, options)
    count = len(live[0])
    group = optimizers.ParamGroupSpec(
        param_names=tuple(str(i) for i in range(count)),
        amsgrad=options["amsgrad"],
        maximize=options["maximize"],
        decoupled_weight_decay=options["decoupled_weight_decay"],
        has_weight_decay=options["weight_decay"] != 0,
    )
    written = [live[0], *live[2:]]  # params, exp_avgs, exp_avg_sqs (, max_exp_avg_sqs)
    values = [[t.value() for t in tensors] for tensors in live]
    # A live tensor's value has its shape and its dtype's JAX dtype (`LiveTensor.write`).
    key = ("adam", group, tuple((v.shape, v.dtype) for vs in (values[0], *values[2:]) for v in vs))
    outputs = deferred.record(
        key,
        functools.partial(_adam_elements, group, count),
        [v for vs in values for v in vs] + scalars,
        _avals(key[2]),
    )
    # Each output has its tensor's shape and dtype (`_avals`): written as it is.
    for tensor, value in zip((t for tensors in written for t in tensors), outputs, strict=True):
        tensor._source.write(value)


@functools.lru_cache(maxsize=64)
def _avals(shapes_and_dtypes: tuple) -> list[jax.ShapeDtypeStruct]:
    """The recorded op's outputs: one per written tensor, of its shape and dtype."""
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes_and_dtypes]


def _adam_elements(group: optimizers.ParamGroupSpec, count: int, arrays: list, rng):
    """The recorded op: every parameter's Adam/AdamW update (params, moments out)."""
    f32 = jnp.float32
    per_list = [arrays[i * count : (i + 1) * count] for i in range(5 if group.amsgrad else 4)]
    params, grads, exp_avgs, exp_avg_sqs = per_list[:4]
    maxima = per_list[4] if group.amsgrad else [None] * count
    rest = arrays[len(per_list) * count :]
    counts = jnp.asarray(rest[0], jnp.int32)
    h = {k: jnp.asarray(v, f32) for k, v in zip(_HYPER_KEYS, rest[1:], strict=True)}
    step_sizes_neg, bc2_sqrts = adam_bias_corrections(
        counts, {k: jnp.broadcast_to(v, (count,)) for k, v in h.items()}
    )
    new_params, new_m, new_v, new_max = [], [], [], []
    for i in range(count):
        p, m, v, v_max = optimizers.adam_param_update(
            group,
            h,
            counts[i] >> 31,  # a zero XLA cannot prove to be zero (see optimizers._rounded)
            step_sizes_neg[i],
            bc2_sqrts[i],
            params[i].astype(f32),
            grads[i].astype(f32),
            exp_avgs[i].astype(f32),
            exp_avg_sqs[i].astype(f32),
            None if maxima[i] is None else maxima[i].astype(f32),
        )
        new_params.append(p.astype(params[i].dtype))
        new_m.append(m.astype(exp_avgs[i].dtype))
        new_v.append(v.astype(exp_avg_sqs[i].dtype))
        if group.amsgrad:
            new_max.append(v_max.astype(maxima[i].dtype))
    return new_params + new_m + new_v + new_max, None
