"""Fused AdamW as a Pallas kernel for the GPU (Triton) lowering.

One pass: each program loads a `block_size` slice of the flat weight, gradient and moments,
does the whole torch AdamW step in float32 registers and stores weight and moments back
in place (`input_output_aliases`), plus optionally a low-precision copy of the new weight.
A step is memory bound: 4 reads and 3-4 writes per element, guaranteed one pass (XLA usually
fuses the reference into one or a few loops too; the kernel makes the pass, the in-place
aliasing and the rounding explicit). Not measured on a GPU yet.

Exact rounding on the GPU: Triton lowers `/` to the approximate `div.full.f32` and leaves
mul-add contraction to LLVM, while torch rounds each operation (its FMAs are explicit). So
with `exact_ptx=True` (every compiled GPU run) the divisions, square root and torch's three
FMAs are emitted as PTX with explicit `.rn` rounding; in interpret mode (CPU) the same
expressions are plain jnp, written as the reference writes them.

The tail of a tensor whose size is not a multiple of `block_size` is handled with masked loads
and stores rather than padding, which would copy every operand once more and break aliasing.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zerojax.pallas_kernels.adamw.reference import (
    BC2_SQRT,
    BETA2,
    DECAY,
    EPS,
    NUM_SCALARS,
    ONE_MINUS_BETA1,
    ONE_MINUS_BETA2,
    STEP_SIZE_NEG,
    ZERO_BITS,
)

__all__ = ["adamw_kernel", "adamw_pallas"]


def _ptx(asm: str, *args: jax.Array) -> jax.Array:
    # Every operand a block-shaped float32 register ("r": 32-bit), one element per instance.
    constraints = ",".join(["=r"] + ["r"] * len(args))
    (out,) = plgpu.elementwise_inline_asm(
        asm,
        args=list(args),
        constraints=constraints,
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)],
    )
    return out


def _div(a: jax.Array, b: jax.Array, exact_ptx: bool) -> jax.Array:
    return _ptx("div.rn.f32 $0, $1, $2;", a, b) if exact_ptx else a / b


def _sqrt(a: jax.Array, exact_ptx: bool) -> jax.Array:
    return _ptx("sqrt.rn.f32 $0, $1;", a) if exact_ptx else jnp.sqrt(a)


def _fma(a: jax.Array, b: jax.Array, c: jax.Array, exact_ptx: bool) -> jax.Array:
    # Off the GPU: `a*b + c`, which XLA contracts into one FMA, as in the reference.
    return _ptx("fma.rn.f32 $0, $1, $2, $3;", a, b, c) if exact_ptx else a * b + c


def _rounded(x: jax.Array, zero_bits: jax.Array) -> jax.Array:
    # OR with a runtime zero: the product that made `x` cannot be fused into the next add.
    bits = lax.bitcast_convert_type(x, jnp.int32) | zero_bits
    return lax.bitcast_convert_type(bits, jnp.float32)


def adamw_kernel(
    scalars_ref,
    weight_ref,
    grad_ref,
    exp_avg_ref,
    exp_avg_sq_ref,
    *refs,
    block_size: int,
    num_elements: int,
    amsgrad: bool,
    emit_param: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    exact_ptx: bool,
):
    """One `block_size` slice of the update. `refs`: [max_exp_avg_sq_ref] (amsgrad), then the
    outputs weight, exp_avg, exp_avg_sq, [max_exp_avg_sq], [param]."""
    refs = list(refs)
    max_in_ref = refs.pop(0) if amsgrad else None
    weight_out_ref, exp_avg_out_ref, exp_avg_sq_out_ref = refs[:3]
    max_out_ref = refs[3] if amsgrad else None
    param_out_ref = refs[-1] if emit_param else None

    mask = None
    if num_elements % block_size:
        # Only the last program has a ragged tail; int32 is safe (api caps the size at 2**31-1).
        remaining = num_elements - pl.program_id(0) * block_size
        mask = lax.broadcasted_iota(jnp.int32, (block_size,), 0) < remaining

    def load(ref):
        return plgpu.load(ref, mask=mask).astype(jnp.float32)

    def store(ref, value):
        plgpu.store(ref, value.astype(ref.dtype), mask=mask)

    def scalar(slot):
        # Broadcast: the PTX helpers want every operand block-shaped.
        return jnp.full((block_size,), scalars_ref[slot], jnp.float32)

    p, g = load(weight_ref), load(grad_ref)
    m, v = load(exp_avg_ref), load(exp_avg_sq_ref)
    if maximize:
        g = -g
    if decoupled_weight_decay:
        zero_bits = lax.bitcast_convert_type(scalars_ref[ZERO_BITS], jnp.int32)
        p = _rounded(p * scalar(DECAY), zero_bits)
    else:
        g = _fma(scalar(DECAY), p, g, exact_ptx)
    # torch's lerp(m, g, w): fma(w, g - m, m) if |w| < 0.5 else fma(w - 1, g - m, g).
    weight = scalar(ONE_MINUS_BETA1)
    diff = g - m
    m = jnp.where(
        jnp.abs(weight) < 0.5,
        _fma(weight, diff, m, exact_ptx),
        _fma(weight - 1, diff, g, exact_ptx),
    )
    # torch's addcmul: fma((1-beta2)*g, g, v*beta2).
    v = _fma(scalar(ONE_MINUS_BETA2) * g, g, v * scalar(BETA2), exact_ptx)
    v_for_denom = v
    if amsgrad:
        v_max = jnp.maximum(load(max_in_ref), v)
        v_for_denom = v_max
    denom = _div(_sqrt(v_for_denom, exact_ptx), scalar(BC2_SQRT), exact_ptx) + scalar(EPS)
    # torch's addcdiv: p + (step_size * m) / denom.
    p = p + _div(scalar(STEP_SIZE_NEG) * m, denom, exact_ptx)

    store(weight_out_ref, p)
    store(exp_avg_out_ref, m)
    store(exp_avg_sq_out_ref, v)
    if amsgrad:
        store(max_out_ref, v_max)
    if emit_param:
        store(param_out_ref, p)


def adamw_pallas(
    scalars: jax.Array,
    weight: jax.Array,
    grad: jax.Array,
    exp_avg: jax.Array,
    exp_avg_sq: jax.Array,
    max_exp_avg_sq: jax.Array | None,
    *,
    param_dtype: Any,
    maximize: bool,
    decoupled_weight_decay: bool,
    block_size: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, ...]:
    """`pallas_call` over flat 1-D operands of equal length; returns the flat outputs
    weight, exp_avg, exp_avg_sq, [max_exp_avg_sq], [param], the first 3-4 aliasing their
    inputs (donate those under jit, or XLA copies them to keep the originals alive)."""
    (num_elements,) = weight.shape
    amsgrad = max_exp_avg_sq is not None
    emit_param = param_dtype is not None
    inputs = [scalars, weight, grad, exp_avg, exp_avg_sq] + ([max_exp_avg_sq] if amsgrad else [])
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs[1:2] + inputs[3:]]
    if emit_param:
        out_shape.append(jax.ShapeDtypeStruct((num_elements,), param_dtype))
    # inputs 1, 3, 4, [5] -> outputs 0, 1, 2, [3]
    aliases = {1: 0, 3: 1, 4: 2} | ({5: 3} if amsgrad else {})
    block = pl.BlockSpec((block_size,), lambda i: (i,))
    kernel = functools.partial(
        adamw_kernel,
        block_size=block_size,
        num_elements=num_elements,
        amsgrad=amsgrad,
        emit_param=emit_param,
        maximize=maximize,
        decoupled_weight_decay=decoupled_weight_decay,
        exact_ptx=not interpret,
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(num_elements, block_size),),
        in_specs=[pl.BlockSpec((NUM_SCALARS,), lambda i: (0,))] + [block] * (len(inputs) - 1),
        out_specs=[block] * len(out_shape),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="adamw_update",
    )(*inputs)
