"""Gradient clipping on the shards: the wrapped model's `clip_grad_norm_(max_norm, norm_type)`
(as FSDP has), one program over all of the engine's accumulated gradients.

torch's own `torch.nn.utils.clip_grad_norm_` works too, unpatched: `p.grad` is a live tensor
over the engine's sharded gradient (`zerojax.train.live_tensor`), so its per-gradient norms and
in-place scaling run as JAX on the shards. This function is the one-program fast path.
"""

from __future__ import annotations

import torch

__all__ = ["clip_engine_grad_norm_"]


def clip_engine_grad_norm_(
    engine, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip all of `engine`'s accumulated gradients; the total norm before clipping."""
    norm = torch.tensor(float(engine.clip_grad_norm(float(max_norm), float(norm_type))))
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite")
    return norm
