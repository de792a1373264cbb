"""Adam's bias corrections, -lr/(1-beta1**t) and sqrt(1-beta2**t), as the float32 values torch
computes in Python float64, without enabling x64.

Shared by the fused kernel's reference (`reference.adamw_scalars`) and zerojax's torch-exact
optimizers (`zerojax.train.optimizers`), which import it from here: the math sits below both.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["adam_bias_corrections"]

# Double-float ("df": an unevaluated float32 sum hi + lo, ~48 bits) scalar arithmetic, so the
# bias corrections torch computes in Python float64 come out as the same float32 without
# enabling x64. Only exact products (halves of <= 12 significant bits) feed additions, so XLA's
# FMA contraction cannot break the error-free transformations; and no literal constant enters
# a two-sum, because XLA's simplifier reassociates `(x + 1) - 1` to `x`, which erases the
# rounding error the two-sum exists to capture (`_opaque_one`).


def _opaque_one(like: jax.Array) -> jax.Array:
    return lax.optimization_barrier(jnp.ones_like(like))


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    hi = lax.bitcast_convert_type(
        lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32
    )
    return hi, x - hi


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    s = a + b
    b_virtual = s - a
    return s, (a - (s - b_virtual)) + (b - b_virtual)


def _fast_two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    s = a + b
    return s, b - (s - a)


def _df_mul(a, b):
    ah, al = _split(a[0])
    bh, bl = _split(b[0])
    s, e1 = _two_sum(ah * bh, ah * bl)
    s, e2 = _two_sum(s, al * bh)
    return _fast_two_sum(s, (e1 + e2 + al * bl) + (a[0] * b[1] + a[1] * b[0]))


def _df_one_minus(a):
    s, e = _two_sum(_opaque_one(a[0]), -a[0])
    return _fast_two_sum(s, e - a[1])


def _df_pow(base, exponent: jax.Array):
    """base**exponent for an int32 exponent >= 0, by squaring over its 31 bits.

    A fori_loop, not unrolled: unrolling costs ~3 s of XLA compile time on CPU.
    """

    def body(bit, carry):
        result, base = carry
        product = _df_mul(result, base)
        take = ((exponent >> bit) & 1) == 1
        result = (jnp.where(take, product[0], result[0]), jnp.where(take, product[1], result[1]))
        return result, _df_mul(base, base)

    one = _opaque_one(base[0])
    result, _ = lax.fori_loop(0, 31, body, ((one, jnp.zeros_like(one)), base))
    return result


def _df_div_to_f32(a, b) -> jax.Array:
    q1 = a[0] / b[0]
    qb = _df_mul((q1, jnp.zeros_like(q1)), b)
    r, e = _two_sum(a[0], -qb[0])
    q2 = (r + (e + a[1] - qb[1])) / b[0]
    return q1 + q2


def _df_sqrt_to_f32(a) -> jax.Array:
    s = jnp.sqrt(a[0])
    ss = _df_mul((s, jnp.zeros_like(s)), (s, jnp.zeros_like(s)))
    r, e = _two_sum(a[0], -ss[0])
    return s + (r + (e + a[1] - ss[1])) / (2 * s)


def adam_bias_corrections(steps: jax.Array, hyper: Mapping[str, jax.Array]):
    """Per group -lr/(1-beta1**t) and sqrt(1-beta2**t), rounded from ~float64 as torch's."""
    num_groups = steps.shape[0]
    betas = (
        jnp.concatenate([hyper["beta1"], hyper["beta2"]]),
        jnp.concatenate([hyper["beta1_lo"], hyper["beta2_lo"]]),
    )
    bc = _df_one_minus(_df_pow(betas, jnp.concatenate([steps, steps])))
    bc1 = (bc[0][:num_groups], bc[1][:num_groups])
    bc2 = (bc[0][num_groups:], bc[1][num_groups:])
    step_size_neg = -_df_div_to_f32((hyper["lr"], hyper["lr_lo"]), bc1)
    return step_size_neg, _df_sqrt_to_f32(bc2)
