"""Public LayerNorm: a Pallas GPU kernel with a custom VJP, or the jnp reference.

``implementation="pallas"`` runs the Triton-lowered kernels in ``kernel.py`` (``interpret=True``
runs them in the Pallas interpreter, e.g. on CPU in tests); ``"xla"`` runs ``reference.py``;
``"auto"`` picks pallas on GPU and xla elsewhere. The backend choice stays behind this function so
a Mosaic GPU kernel can be added beside the Triton one without touching callers.

``NormConfig`` (shared with ``rms_norm``) holds the block sizes and Triton launch parameters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zerojax.pallas_kernels.backend import auto_picks_pallas
from zerojax.pallas_kernels.layer_norm.kernel import layer_norm_backward, layer_norm_forward
from zerojax.pallas_kernels.layer_norm.reference import STATISTICS, layer_norm_reference

Implementation = Literal["auto", "pallas", "xla"]

# A tile lives in registers as fp32 (several copies in the backward). 16K elements is 64 per
# thread at 8 warps, the same per-row cap as Triton's fused LayerNorm tutorial (64 KB of fp32);
# wider rows would spill to local memory, and "auto" sends them to XLA instead.
MAX_TILE_ELEMENTS = 1 << 14
# The widest row a single program can own (block_rows=1).
MAX_FEATURES = MAX_TILE_ELEMENTS
_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class NormConfig:
    """Block sizes of the LayerNorm / RMSNorm kernels.

    block_rows: rows per forward program, and rows per tile of the backward loop.
    backward_block_rows: rows per backward program (each writes one fp32 partial row of the
        weight/bias gradients, summed afterwards); a multiple of ``block_rows``.
    num_warps, num_stages: Triton launch parameters.

    The feature block always covers the whole row, padded to a power of two and masked.

    >>> NormConfig(block_rows=4, backward_block_rows=32)
    NormConfig(block_rows=4, backward_block_rows=32, num_warps=4, num_stages=1)
    """

    block_rows: int = 4
    backward_block_rows: int = 64
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for name in ("block_rows", "backward_block_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or not _is_power_of_two(value):
                raise ValueError(f"{name}={value!r} must be a power of two (a Triton block size)")
        if self.backward_block_rows % self.block_rows:
            raise ValueError(
                f"backward_block_rows={self.backward_block_rows} must be a multiple of "
                f"block_rows={self.block_rows}"
            )
        if not isinstance(self.num_warps, int) or not (
            _is_power_of_two(self.num_warps) and self.num_warps <= 32
        ):
            raise ValueError(f"num_warps={self.num_warps!r} must be a power of two in [1, 32]")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages!r} must be a positive integer")

    @classmethod
    def for_features(cls, n_features: int) -> NormConfig:
        """The default: tiles of about 4K elements (several short rows or one long row).

        >>> NormConfig.for_features(768)
        NormConfig(block_rows=4, backward_block_rows=64, num_warps=8, num_stages=1)
        """
        padded = pl.next_power_of_2(n_features)
        block_rows = max(1, min(16, 4096 // padded))
        num_warps = max(1, min(8, block_rows * padded // 256))
        return cls(
            block_rows=block_rows,
            backward_block_rows=max(block_rows, 64),
            num_warps=num_warps,
        )

    def check_shape(self, n_features: int) -> None:
        """Raise ValueError when a tile of ``n_features``-wide rows does not fit."""
        padded = pl.next_power_of_2(n_features)
        if self.block_rows * padded > MAX_TILE_ELEMENTS:
            raise ValueError(
                f"block_rows * padded features = {self.block_rows} * {padded} exceeds "
                f"{MAX_TILE_ELEMENTS} elements per tile ({n_features=} pads to {padded}); "
                f"use block_rows <= {max(1, MAX_TILE_ELEMENTS // padded)}"
            )


def kernel_unsupported_reason(x: jax.Array, **params: jax.Array | None) -> str | None:
    """Why the Pallas norm kernels cannot take these operands, or None when they can."""
    if x.ndim == 0:
        return f"x must have at least one dimension, got shape {x.shape}"
    n_features = x.shape[-1]
    if pl.next_power_of_2(n_features) > MAX_FEATURES:
        return f"{n_features=} exceeds the kernel maximum of {MAX_FEATURES} (one row per program)"
    for name, array in {"x": x, **params}.items():
        if array is not None and array.dtype not in _KERNEL_DTYPES:
            return f"{name}.dtype={array.dtype} is not one of float32, bfloat16, float16"
    return None


def select_implementation(
    implementation: Implementation, interpret: bool, unsupported: str | None
) -> Literal["pallas", "xla"]:
    """Resolve ``implementation``; "auto" means pallas on GPU (or when interpreting) when the
    kernel supports the operands, else xla. An explicit "pallas" raises on unsupported operands."""
    if implementation not in ("auto", "pallas", "xla"):
        raise ValueError(f"{implementation=} must be one of 'auto', 'pallas', 'xla'")
    if implementation == "xla":
        return "xla"
    if implementation == "pallas":
        if unsupported is not None:
            raise ValueError(f"implementation='pallas' cannot run: {unsupported}")
        return "pallas"
    return "pallas" if auto_picks_pallas(interpret) and unsupported is None else "xla"


def kernel_config(
    x: jax.Array,
    implementation: Implementation,
    interpret: bool,
    block_config: NormConfig | None,
    **params: jax.Array | None,
) -> NormConfig | None:
    """Validate the operands of a norm and pick its backend: the kernel's ``NormConfig``, or
    None when the jnp reference should run. Each param must be ``[n_features]`` or None."""
    unsupported = kernel_unsupported_reason(x, **params)
    n_features = x.shape[-1] if x.ndim else 0
    for name, param in params.items():
        if param is not None and param.shape != (n_features,):
            raise ValueError(
                f"{name}.shape={param.shape} must be ({n_features},), the last dimension of x"
            )
    if select_implementation(implementation, interpret, unsupported) == "xla":
        return None
    config = block_config if block_config is not None else NormConfig.for_features(n_features)
    config.check_shape(n_features)
    return config


def _forward(x, weight, bias, eps, config, interpret, with_stats):
    return layer_norm_forward(
        x,
        weight,
        bias,
        eps=eps,
        block_rows=config.block_rows,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        with_stats=with_stats,
        interpret=interpret,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_norm_pallas(x, weight, bias, eps: float, config: NormConfig, interpret: bool):
    # The primal alone (no gradient taken) skips writing the statistics.
    return _forward(x, weight, bias, eps, config, interpret, with_stats=False)[0]


def _layer_norm_pallas_fwd(x, weight, bias, eps, config, interpret):
    y, mean, rstd = _forward(x, weight, bias, eps, config, interpret, with_stats=True)
    return y, (x, weight, bias, mean, rstd)


def _layer_norm_pallas_bwd(eps, config, interpret, residuals, g):
    del eps  # rstd already holds it
    x, weight, bias, mean, rstd = residuals
    dx, dweight, dbias = layer_norm_backward(
        x,
        weight,
        g,
        mean,
        rstd,
        want_dweight=weight is not None,
        want_dbias=bias is not None,
        block_rows=config.block_rows,
        backward_block_rows=config.backward_block_rows,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
    )
    if weight is not None:
        dweight = dweight.astype(weight.dtype)
    if bias is not None:
        dbias = dbias.astype(bias.dtype)
    return dx, dweight, dbias


_layer_norm_pallas.defvjp(_layer_norm_pallas_fwd, _layer_norm_pallas_bwd)


@functools.partial(
    jax.checkpoint,
    static_argnums=(3,),
    policy=jax.checkpoint_policies.save_only_these_names(STATISTICS),
)
def _rematerialized_reference(x, weight, bias, eps):
    """The reference, keeping for its backward what torch's keeps (the input, the per-row mean
    and reciprocal standard deviation), not also autodiff's centred and normalized rows: the
    backward forms them again, with the same arithmetic. The GPT-2 bench model
    (bench/train_step.py, one CPU device, `memory_analysis()`): the general path's forward
    outputs 308.7 -> 289.8 MB fp32 and 261.5 -> 233.2 bf16, the fused program's temporaries
    302.5 -> 264.4 and 307.2 -> 269.4; its steps (interleaved A/B, per-round ratios' medians of
    15) general 0.99x / 0.98x, fused 0.93x / 0.95x."""
    return layer_norm_reference(x, weight, bias, eps=eps)


def layer_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = 1e-5,
    implementation: Implementation = "auto",
    interpret: bool = False,
    block_config: NormConfig | None = None,
) -> jax.Array:
    """``torch.nn.functional.layer_norm`` over the last dimension of ``x``.

    Statistics (mean, biased variance) and the affine transform run in fp32; the output is
    rounded once to ``x.dtype``. Leading dimensions are flattened into rows. Differentiable with
    respect to ``x``, ``weight`` and ``bias``.

    Args:
      x: ``[..., n_features]``.
      weight, bias: ``[n_features]`` or None (no scale / no shift).
      eps: added to the variance.
      implementation: "pallas" (the Triton kernel), "xla" (the jnp reference) or "auto"
        (pallas on GPU, or whenever ``interpret=True``; xla otherwise and for operands the kernel
        does not support, e.g. more than 16384 features or float64).
      interpret: run the Pallas kernel in the interpreter (CPU tests).
      block_config: block sizes; default ``NormConfig.for_features(n_features)``.

    >>> x = jax.random.normal(jax.random.key(0), (2, 8, 96), jnp.bfloat16)
    >>> layer_norm(x, jnp.ones(96), jnp.zeros(96), implementation="pallas", interpret=True).shape
    (2, 8, 96)
    """
    config = kernel_config(x, implementation, interpret, block_config, weight=weight, bias=bias)
    if config is None:
        return _rematerialized_reference(x, weight, bias, float(eps))
    rows = x.reshape(-1, x.shape[-1])
    y = _layer_norm_pallas(rows, weight, bias, float(eps), config, bool(interpret))
    return y.reshape(x.shape)
