"""torch.optim.Adafactor's step on live tensors, recorded as one op with no host reads.

torch's Adafactor (`torch.optim._adafactor`, its default single-tensor step) reads two values
per parameter on the host: `param.norm(2).item()` for the relative step size and
`update.norm(2).item()` for the update's clipping. On live tensors each read runs every op
recorded before it, so a step was two programs per parameter, each waiting for the device
(the GPT-2 bench model: 104 programs, 16x the compiled AdamW update). Here the whole step is
recorded as one op: the same ATen ops in the same order, each through the bridge's lowering
(what the op-by-op path runs), and the Python arithmetic around the two reads, `max(eps2,
norm / sqrt(numel)) * rho` and `max(1, norm / (sqrt(numel) * d))`, computed on the device.

What differs from torch: torch does that scalar arithmetic in double precision on the host,
then its kernels cast the result to float32; here it is float32 throughout, so the step size
can differ from torch's by a few float32 ulps (~2e-7 relative), well inside the float32
reordering differences the recorded ops have anyway (tests/train/test_torch_optimizers.py).
The step-count scalars (`step ** beta2_decay`, `min(lr, 1 / sqrt(step))`) and the other
hyperparameter expressions are computed on the host in double as torch computes them; every
one is a program input, so a schedule never recompiles. The step counts stay torch's host
tensors, advanced as torch advances them.

Anything else -- `foreach=True` (torch's multi-tensor form, recorded op by op), complex or
non-float32 parameters, a tensor learning rate, a gradient scaler's `grad_scale`/`found_inf`,
tensors that are not live -- runs torch's own function unchanged.

torch's Adafactor looks the function up by name at each step, so `install` replaces the name
in `torch.optim._adafactor` (idempotent).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from torch.optim import _adafactor

from zerojax.bridge import eager
from zerojax.bridge.dtypes import to_torch_dtype
from zerojax.train import deferred
from zerojax.train.live_tensor import LiveTensor, key_of
from zerojax.train.parameters import live_of

__all__ = ["install"]

aten = torch.ops.aten


def install() -> None:
    """Record torch.optim.Adafactor's single-tensor step as one op for live tensors."""
    original = _adafactor.adafactor
    if getattr(original, "_zerojax_live", False):
        return

    @functools.wraps(original)
    def adafactor(params, grads, row_vars, col_vars, variances, state_steps, foreach=None,
                  grad_scale=None, found_inf=None, has_complex=False, **options):  # fmt: skip
        live = _live_lists(params, grads, row_vars, col_vars, variances)
        recordable = (
            live is not None
            and not foreach
            and grad_scale is None
            and found_inf is None
            and not has_complex
            and not isinstance(options["lr"], torch.Tensor)
            and not any(isinstance(s, LiveTensor) for s in state_steps)
        )
        if not recordable:
            return original(params, grads, row_vars, col_vars, variances, state_steps,
                            foreach=foreach, grad_scale=grad_scale, found_inf=found_inf,
                            has_complex=has_complex, **options)  # fmt: skip
        _record(*live, state_steps, options)
        return None

    adafactor._zerojax_live = True  # type: ignore[attr-defined]
    _adafactor.adafactor = adafactor


def _live_lists(params, grads, row_vars, col_vars, variances):
    """(params, grads, factors) as live tensors -- factors per parameter: (row_var, col_var)
    for a matrix-like gradient, (variance,) for a vector -- or None where any is not a live
    float32 tensor (torch's own function runs then)."""
    if not params:
        return None
    lives: list[list[LiveTensor]] = [[], []]
    factors = []
    for p, g, row, col, variance in zip(params, grads, row_vars, col_vars, variances, strict=True):
        held = (p, g, row, col) if g.dim() > 1 else (p, g, variance)
        tensors = [live_of(t) for t in held]
        if any(t is None or t.dtype != torch.float32 for t in tensors):
            return None
        lives[0].append(tensors[0])
        lives[1].append(tensors[1])
        factors.append(tuple(tensors[2:]))
    return lives[0], lives[1], factors


def _record(params, grads, factors, state_steps, options) -> None:
    for step in state_steps:  # torch: `step_t += 1` on its host tensor
        step += 1
    steps = [step.item() for step in state_steps]
    lr, beta2_decay, d = options["lr"], options["beta2_decay"], options["d"]
    eps1 = options["eps1"]
    if eps1 is None:
        eps1 = torch.finfo(torch.float32).eps
    weight_decay = options["weight_decay"]
    # The host's double-precision expressions, as torch's step computes them; its kernels take
    # them as float32.
    per_param = np.asarray(
        [
            [
                step**beta2_decay,  # one_minus_beta2_t
                min(lr, 1 / (step**0.5)),  # rho_t
                p.numel() ** 0.5,
                (p.numel() ** 0.5) * d,
            ]
            for step, p in zip(steps, params, strict=True)
        ],
        np.float32,
    )
    shared = np.asarray([options["eps2"], 1 - lr * weight_decay, eps1, eps1 * eps1], np.float32)
    structure = (
        options["maximize"],
        weight_decay != 0,
        tuple(len(f) for f in factors),
    )
    values = [t.value() for t in params] + [t.value() for t in grads]
    values += [t.value() for f in factors for t in f]
    key = ("adafactor", structure, tuple((v.shape, v.dtype) for v in values))
    written = params + [t for f in factors for t in f]
    outputs = deferred.record(
        key,
        functools.partial(_adafactor_elements, structure),
        [*values, per_param, shared],
        _avals(tuple((tuple(t.shape), jnp.float32) for t in written)),
    )
    for tensor, value in zip(written, outputs, strict=True):
        tensor._source.write(value)


@functools.lru_cache(maxsize=64)
def _avals(shapes: tuple) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


def _adafactor_elements(structure: tuple, arrays: list, rng):
    """The recorded op: torch's `_single_tensor_adafactor`, parameter by parameter (new
    params, then the new factors in the order the inputs hold them)."""
    maximize, has_weight_decay, factor_counts = structure
    count = len(factor_counts)
    params, grads = arrays[:count], arrays[count : 2 * count]
    factor_arrays = arrays[2 * count : -2]
    per_param, shared = arrays[-2], arrays[-1]
    eps2, decay, eps1, eps1_squared = (shared[i] for i in range(4))
    new_params, new_factors, start = [], [], 0
    for i in range(count):
        param, grad = params[i], grads[i]
        factors = factor_arrays[start : start + factor_counts[i]]
        start += factor_counts[i]
        one_minus_beta2, rho, root_numel, root_numel_d = (per_param[i, j] for j in range(4))
        if maximize:
            grad = _aten(aten.neg.default, grad)
        alpha = _python_max(eps2, _norm(param) / root_numel) * rho
        if has_weight_decay:
            param = _aten(aten.mul.Tensor, param, decay)
        if len(factors) == 2:
            row_var, col_var = factors
            row_mean = _mean_square(grad, -1)
            row_var = _aten(aten.lerp.Tensor, row_var, row_mean, one_minus_beta2)
            col_mean = _mean_square(grad, -2)
            col_var = _aten(aten.lerp.Tensor, col_var, col_mean, one_minus_beta2)
            # (..., R, 1) @ (..., 1, C): one product per element, exact as torch's.
            var_estimate = jnp.matmul(row_var, col_var)
            mean = _aten(aten.mean.dim, row_var, [-2], True)
            var_estimate = _aten(
                aten.div.Tensor, var_estimate, _aten(aten.clamp.Tensor, mean, eps1)
            )
            new_factors += [row_var, col_var]
        else:
            (variance,) = factors
            squared = _aten(aten.mul.Tensor, grad, grad)
            variance = _aten(aten.lerp.Tensor, variance, squared, one_minus_beta2)
            var_estimate = variance
            new_factors.append(variance)
        update = _aten(aten.rsqrt.default, _aten(aten.clamp.Tensor, var_estimate, eps1_squared))
        update = _aten(aten.mul.Tensor, update, grad)
        denom = _python_max(jnp.float32(1.0), _norm(update) / root_numel_d)
        param = _aten(aten.add.Tensor, param, _aten(aten.mul.Tensor, update, -alpha / denom))
        new_params.append(param)
    return new_params + new_factors, None


def _python_max(first, second):
    """Python's `max(first, second)`: `second` only where it is greater (a NaN is not)."""
    return jnp.where(second > first, second, first)


def _norm(x):
    """`x.norm(2)`: torch's vector 2-norm, a 0-d float32."""
    return _aten(aten.linalg_vector_norm.default, x, 2)


def _mean_square(grad, dim: int):
    """torch's `torch.norm(grad, dim=dim, keepdim=True).square_().div_(grad.size(dim))`."""
    norm = _aten(aten.linalg_vector_norm.default, grad, 2, [dim], True)
    return _aten(aten.div.Tensor, _aten(aten.mul.Tensor, norm, norm), float(grad.shape[dim]))


def _aten(op, *args, **kwargs):
    """`op` on traced arrays through the bridge's lowering: what the op-by-op path runs for
    it on live tensors (`zerojax.bridge.eager`). Arrays stand where torch takes tensors (a 0-d
    one where torch's kernel casts a Python scalar to float32); other arguments are
    constants."""
    leaves, spec = torch_pytree.tree_flatten((args, kwargs))
    metas = [
        torch.empty(x.shape, dtype=to_torch_dtype(x.dtype), device="meta")
        if isinstance(x, jax.Array)
        else x
        for x in leaves
    ]
    call = eager.eager_call(op, spec, metas, key_of, eager.meta_of)
    value, _flags = call.run([leaves[i] for i in call.dynamic], None)
    return value
