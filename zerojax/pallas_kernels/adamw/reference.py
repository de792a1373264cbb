"""AdamW in pure jnp: the spec of the fused kernel and its "xla" implementation.

The arithmetic is torch 2.13's single-tensor AdamW (CPU), operation by operation, written
exactly as `zerojax.train.optimizers.apply_update` writes it, so that the two agree bit for
bit in float32 (tests/pallas_kernels/test_adamw.py checks it):

    param *= 1 - lr*wd                                  (rounded before the step is added)
    m = lerp(m, g, 1 - beta1)
    v = v*beta2 + (1 - beta2)*g*g                       (torch's addcmul: one FMA)
    denom = sqrt(v) / sqrt(1 - beta2**step) + eps
    param += (-lr / (1 - beta1**step)) * m / denom      (torch's addcdiv)

The per-step scalars are folded once per call into a float32 vector (`adamw_scalars`), which
is also what the Pallas kernel reads from a small input ref: a changing learning rate is a
changing array value, never a recompile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zerojax.pallas_kernels.adamw.bias_correction import adam_bias_corrections

__all__ = [
    "NUM_SCALARS",
    "REQUIRED_HYPER_KEYS",
    "adamw_hyper",
    "adamw_scalars",
    "adamw_update_reference",
]

REQUIRED_HYPER_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay", "step")
"""Keys `hyper` must have. `step` is torch's step count *after* this update's increment (1 on
the first update). Optional, float64-derived keys (as `hyper_from_torch` produces them):
`one_minus_beta1`, `one_minus_beta2`, `decay_factor` (`1 - lr*wd`) and the float32 residuals
`beta1_lo`, `beta2_lo`, `lr_lo`; without them they are derived on device in float32, which
can differ from torch in the last bit of those scalars."""

# Slots of the scalar vector handed to the kernel (float32; slot 7 holds int32 bits).
ONE_MINUS_BETA1, ONE_MINUS_BETA2, BETA2, EPS, DECAY, STEP_SIZE_NEG, BC2_SQRT, ZERO_BITS = range(8)
NUM_SCALARS = 8


def adamw_hyper(
    *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: int
) -> dict[str, np.ndarray]:
    """Host-side hyperparameters with torch's float64 derivations (what `hyper_from_torch` does
    for one param group), as 0-d float32 arrays plus an int32 `step`.

    >>> hyper = adamw_hyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, step=1)
    """
    beta1, beta2 = (float(b) for b in betas)
    lr, weight_decay = float(lr), float(weight_decay)

    def lo(x: float) -> np.ndarray:
        # float64 x as the pair float32(x) + lo, for the double-float bias corrections.
        return np.float32(x - float(np.float32(x)))

    return {
        "lr": np.float32(lr),
        "beta1": np.float32(beta1),
        "beta2": np.float32(beta2),
        "eps": np.float32(eps),
        "weight_decay": np.float32(weight_decay),
        "step": np.int32(step),
        "one_minus_beta1": np.float32(1 - beta1),
        "one_minus_beta2": np.float32(1 - beta2),
        "decay_factor": np.float32(1 - lr * weight_decay),
        "beta1_lo": lo(beta1),
        "beta2_lo": lo(beta2),
        "lr_lo": lo(lr),
    }


def _check_hyper(hyper: Mapping[str, Any]) -> None:
    if not isinstance(hyper, Mapping):
        raise TypeError(
            f"hyper must be a mapping with keys {REQUIRED_HYPER_KEYS}, got {type(hyper).__name__};"
            " build it with adamw_hyper(...) or from hyper_from_torch(...)"
        )
    missing = [k for k in REQUIRED_HYPER_KEYS if k not in hyper]
    if missing:
        raise ValueError(
            f"hyper lacks {missing}; it needs {REQUIRED_HYPER_KEYS} (step = torch's step count"
            " after the increment, 1 on the first update)"
        )
    for key, value in hyper.items():
        if jnp.ndim(value) != 0:
            raise ValueError(
                f"hyper[{key!r}] must be a scalar (0-d), got shape {jnp.shape(value)}; index the"
                " param group first, e.g. {k: v[group] for k, v in hyper_from_torch(opt).items()}"
            )


def adamw_scalars(hyper: Mapping[str, Any], *, decoupled_weight_decay: bool = True) -> jax.Array:
    """The per-step scalars of one update as a float32 vector of `NUM_SCALARS` (traced).

    Bias corrections use `bias_correction`'s double-float arithmetic (shared with
    `zerojax.train.optimizers`), so they round to the float32 values torch computes in float64. Slot `DECAY` holds `1 - lr*wd` (AdamW) or
    `wd` (Adam's L2 decay); slot `ZERO_BITS` is a runtime zero that stops the compiler fusing
    `p * (1 - lr*wd)` into the next add, where torch rounds in between.
    """
    _check_hyper(hyper)
    f32 = jnp.float32

    def get(key: str, default: Any) -> jax.Array:
        return jnp.asarray(hyper.get(key, default), f32)

    lr, wd = jnp.asarray(hyper["lr"], f32), jnp.asarray(hyper["weight_decay"], f32)
    beta1, beta2 = jnp.asarray(hyper["beta1"], f32), jnp.asarray(hyper["beta2"], f32)
    step = jnp.asarray(hyper["step"], jnp.int32)
    as_group = {
        "lr": lr,
        "lr_lo": get("lr_lo", 0.0),
        "beta1": beta1,
        "beta1_lo": get("beta1_lo", 0.0),
        "beta2": beta2,
        "beta2_lo": get("beta2_lo", 0.0),
    }
    step_size_neg, bc2_sqrt = adam_bias_corrections(
        step[None], {k: v[None] for k, v in as_group.items()}
    )
    # Any step count is >= 0, so this is 0; the compilers cannot prove it.
    zero_bits = lax.bitcast_convert_type(step >> 31, f32)
    decay = get("decay_factor", 1 - lr * wd) if decoupled_weight_decay else wd
    return jnp.stack(
        [
            get("one_minus_beta1", 1 - beta1),
            get("one_minus_beta2", 1 - beta2),
            beta2,
            jnp.asarray(hyper["eps"], f32),
            decay,
            step_size_neg[0],
            bc2_sqrt[0],
            zero_bits,
        ]
    )


def _rounded(x: jax.Array, zero_bits: jax.Array) -> jax.Array:
    # `x` with its bits OR-ed with a runtime zero: neither XLA nor LLVM can contract the
    # product that made it into a later add (torch rounds `p * (1 - lr*wd)` on its own).
    bits = lax.bitcast_convert_type(x, jnp.int32) | zero_bits
    return lax.bitcast_convert_type(bits, jnp.float32)


def _lerp(start: jax.Array, end: jax.Array, weight: jax.Array) -> jax.Array:
    # torch's lerp: two formulas picked by |weight| < 0.5, each one FMA.
    diff = end - start
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end + (weight - 1) * diff)


def adamw_update_reference(
    weight: jax.Array,
    grad: jax.Array,
    exp_avg: jax.Array,
    exp_avg_sq: jax.Array,
    hyper: Mapping[str, Any],
    *,
    param_dtype: Any = None,
    max_exp_avg_sq: jax.Array | None = None,
    maximize: bool = False,
    decoupled_weight_decay: bool = True,
) -> tuple[jax.Array | None, ...]:
    """One torch AdamW step for one tensor; see `zerojax.pallas_kernels.adamw.adamw_update`.

    Returns `(new_weight, new_exp_avg, new_exp_avg_sq, new_param_or_None)`, plus
    `new_max_exp_avg_sq` when `max_exp_avg_sq` is given (amsgrad). Math in float32; every
    output keeps its input's dtype; `new_param` is `new_weight` in `param_dtype`.

    >>> w, m, v, _ = adamw_update_reference(w, g, m, v, adamw_hyper(lr=1e-3, betas=(0.9, 0.999),
    ...                                     eps=1e-8, weight_decay=0.01, step=1))
    """
    scalars = adamw_scalars(hyper, decoupled_weight_decay=decoupled_weight_decay)
    s = [scalars[i] for i in range(NUM_SCALARS)]
    f32 = jnp.float32
    p, g = weight.astype(f32), grad.astype(f32)
    m, v = exp_avg.astype(f32), exp_avg_sq.astype(f32)
    if maximize:
        g = -g
    if decoupled_weight_decay:
        p = _rounded(p * s[DECAY], lax.bitcast_convert_type(s[ZERO_BITS], jnp.int32))
    else:
        g = g + s[DECAY] * p
    m = _lerp(m, g, s[ONE_MINUS_BETA1])
    # addcmul = fma((1-beta2)*g, g, v*beta2); XLA contracts the *first* product of a*b + c*d.
    v = ((s[ONE_MINUS_BETA2] * g) * g) + v * s[BETA2]
    v_max = None
    if max_exp_avg_sq is not None:
        v_max = jnp.maximum(max_exp_avg_sq.astype(f32), v)
        denom = jnp.sqrt(v_max) / s[BC2_SQRT] + s[EPS]
    else:
        denom = jnp.sqrt(v) / s[BC2_SQRT] + s[EPS]
    p = p + (s[STEP_SIZE_NEG] * m) / denom
    outputs = (
        p.astype(weight.dtype),
        m.astype(exp_avg.dtype),
        v.astype(exp_avg_sq.dtype),
        None if param_dtype is None else p.astype(param_dtype),
    )
    if v_max is not None:
        outputs += (v_max.astype(max_exp_avg_sq.dtype),)
    return outputs
