"""The precision policy: which dtype each part of the training state lives and computes in.

    params=bfloat16,compute=bfloat16,master=float32   (bf16 compute, fp32 master weights)

Built from the config's `precision` section. float16 compute brings dynamic loss scaling,
performed inside the JAX step so that a plain `loss.backward()` keeps working: the backward
multiplies its cotangent by the scale, the optimizer step divides the gradients by it, skips
the update if any gradient is not finite, and adjusts the scale (DeepSpeed's rule).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from zerojax.config import LossScaleConfig, PrecisionConfig


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionPolicy:
    param_dtype: np.dtype
    """Dtype params are stored in between steps."""
    compute_dtype: np.dtype
    """Dtype of the forward/backward arithmetic (matmuls accumulate in fp32 regardless)."""
    output_dtype: np.dtype
    """Dtype of float outputs handed back to torch."""
    master_dtype: np.dtype | None
    """Dtype of the master copy the optimizer updates; None updates the params in place."""
    optimizer_state_dtype: np.dtype
    """Dtype of the optimizer moments."""
    grad_dtype: np.dtype
    """Dtype gradients are reduced and accumulated in."""
    loss_scale: LossScaleConfig | None
    """Dynamic loss scaling for float16; None when no float16 is involved."""

    @classmethod
    def from_config(cls, precision: PrecisionConfig) -> PrecisionPolicy:
        master = precision.master_dtype
        return cls(
            param_dtype=np.dtype(precision.param_dtype),
            compute_dtype=np.dtype(precision.compute_dtype),
            output_dtype=np.dtype(precision.output_dtype),
            master_dtype=None if master in (None, "none") else np.dtype(master),
            optimizer_state_dtype=np.dtype(precision.optimizer_state_dtype),
            grad_dtype=np.dtype(precision.grad_reduce_dtype),
            loss_scale=precision.loss_scale,
        )

    @property
    def compute_override(self):
        """The float dtype the converted graph runs in, or None to keep torch's dtypes."""
        return None if self.compute_dtype == np.float32 else self.compute_dtype


def initial_loss_scale_state(config: LossScaleConfig) -> dict:
    return {
        "scale": jnp.float32(config.initial_scale),
        "good_steps": jnp.int32(0),
        "hysteresis": jnp.int32(config.hysteresis),
    }


def next_loss_scale_state(config: LossScaleConfig, state: dict, finite) -> dict:
    """DeepSpeed's dynamic rule: an overflow uses up one unit of hysteresis and, once none is
    left, halves the scale; `window` clean steps in a row double it."""
    if not config.dynamic:
        return state
    scale, good, hysteresis = state["scale"], state["good_steps"], state["hysteresis"]
    lowered = jnp.where(hysteresis <= 1, jnp.maximum(scale / 2, config.min_scale), scale)
    grown_good = good + 1
    grow = grown_good >= config.window
    return {
        "scale": jnp.where(finite, jnp.where(grow, scale * 2, scale), lowered),
        "good_steps": jnp.where(finite, jnp.where(grow, 0, grown_good), 0).astype(jnp.int32),
        "hysteresis": jnp.where(
            finite, jnp.int32(config.hysteresis), jnp.maximum(hysteresis - 1, 1)
        ).astype(jnp.int32),
    }
