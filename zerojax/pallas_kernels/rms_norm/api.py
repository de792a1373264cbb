"""Public RMSNorm: a Pallas GPU kernel with a custom VJP, or the jnp reference.

``implementation`` and ``interpret`` work as in ``layer_norm`` (and share its ``NormConfig``):
"pallas" runs ``kernel.py``, "xla" runs ``reference.py``, "auto" picks pallas on GPU.
"""

from __future__ import annotations

import functools

import jax

from zerojax.pallas_kernels.layer_norm.api import (
    Implementation,
    NormConfig,
    kernel_config,
)
from zerojax.pallas_kernels.rms_norm.kernel import rms_norm_backward, rms_norm_forward
from zerojax.pallas_kernels.rms_norm.reference import STATISTICS, rms_norm_reference


def _forward(x, weight, eps, config, interpret, with_stats):
    return rms_norm_forward(
        x,
        weight,
        eps=eps,
        block_rows=config.block_rows,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        with_stats=with_stats,
        interpret=interpret,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm_pallas(x, weight, eps: float, config: NormConfig, interpret: bool):
    # The primal alone (no gradient taken) skips writing rstd.
    return _forward(x, weight, eps, config, interpret, with_stats=False)[0]


def _rms_norm_pallas_fwd(x, weight, eps, config, interpret):
    y, rstd = _forward(x, weight, eps, config, interpret, with_stats=True)
    return y, (x, weight, rstd)


def _rms_norm_pallas_bwd(eps, config, interpret, residuals, g):
    del eps  # rstd already holds it
    x, weight, rstd = residuals
    dx, dweight = rms_norm_backward(
        x,
        weight,
        g,
        rstd,
        block_rows=config.block_rows,
        backward_block_rows=config.backward_block_rows,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
    )
    if weight is not None:
        dweight = dweight.astype(weight.dtype)
    return dx, dweight


_rms_norm_pallas.defvjp(_rms_norm_pallas_fwd, _rms_norm_pallas_bwd)


@functools.partial(
    jax.checkpoint,
    static_argnums=(2,),
    policy=jax.checkpoint_policies.save_only_these_names(STATISTICS),
)
def _rematerialized_reference(x, weight, eps):
    """The reference, keeping for its backward the input and the per-row reciprocal root mean
    square, not also autodiff's normalized rows (the backward forms them again, with the same
    arithmetic), as the layer norm's (`zerojax.pallas_kernels.layer_norm.api`). A 4-layer HF
    Llama (width 256, batch 8 x 256, fp32, one CPU device): the general path's forward outputs
    411.1 -> 392.2 MB, the fused program's temporaries 295.3 -> 276.4; steps (interleaved A/B,
    per-round ratios' medians of 15) general 0.97x, fused 0.97x."""
    return rms_norm_reference(x, weight, eps=eps)


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    implementation: Implementation = "auto",
    interpret: bool = False,
    block_config: NormConfig | None = None,
) -> jax.Array:
    """Hugging Face ``LlamaRMSNorm`` over the last dimension of ``x``.

    ``y = x * rsqrt(mean(x**2) + eps)`` in fp32, rounded to ``x.dtype``, then multiplied by
    ``weight``; the output dtype is ``result_type(weight, x)``, or ``x.dtype`` when ``weight`` is
    None (no scale, like ``torch.nn.RMSNorm(elementwise_affine=False)``). Note the rounding
    before the weight multiply: ``torch.nn.functional.rms_norm`` multiplies first and rounds
    once, which differs by about one bf16 ulp. Differentiable with respect to ``x`` and
    ``weight``.

    Args:
      x: ``[..., n_features]``; leading dimensions are flattened into rows.
      weight: ``[n_features]`` or None.
      eps: added to the mean square.
      implementation: "pallas", "xla" or "auto" (pallas on GPU or when ``interpret=True``,
        else xla, and xla for operands the kernel does not support).
      interpret: run the Pallas kernel in the interpreter (CPU tests).
      block_config: block sizes; default ``NormConfig.for_features(n_features)``.

    >>> x = jax.random.normal(jax.random.key(0), (2, 8, 96), jax.numpy.bfloat16)
    >>> rms_norm(x, jax.numpy.ones(96), implementation="pallas", interpret=True).dtype
    dtype('float32')
    """
    config = kernel_config(x, implementation, interpret, block_config, weight=weight)
    if config is None:
        return _rematerialized_reference(x, weight, float(eps))
    rows = x.reshape(-1, x.shape[-1])
    y = _rms_norm_pallas(rows, weight, float(eps), config, bool(interpret))
    return y.reshape(x.shape)
