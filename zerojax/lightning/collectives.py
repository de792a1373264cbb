"""What Lightning asks of a strategy across processes (broadcast, gather, reduce, barrier),
over JAX's multi-process runtime: zerojax has no torch process group.

Lightning uses these for its own bookkeeping -- a checkpoint directory broadcast from rank 0,
`self.log(..., sync_dist=True)`, early-stopping decisions -- never for gradients (the engine
averages those in its program). With one process each is the identity.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

from zerojax import distributed


def _several() -> bool:
    return distributed.world_size() > 1


def barrier(name: str | None = None) -> None:
    if _several():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name or "zerojax.lightning")


def broadcast(obj: Any, src: int = 0) -> Any:
    """`obj` as process `src` has it, on every process (any picklable object)."""
    if not _several():
        return obj
    from jax.experimental import multihost_utils

    source = distributed.rank() == src
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if source else None
    length = int(
        multihost_utils.broadcast_one_to_all(
            np.int64(len(payload) if source else 0), is_source=source
        )
    )
    data = payload if source else np.zeros(length, np.uint8)
    data = multihost_utils.broadcast_one_to_all(data, is_source=source)
    return pickle.loads(np.asarray(data).tobytes())  # bytes from our own processes


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's `tensor`, stacked: shape (world_size, *tensor.shape)."""
    if not _several():
        return tensor
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(tensor.detach().cpu().numpy(), tiled=False)
    return torch.from_numpy(np.asarray(gathered)).to(tensor.dtype)


def reduce(tensor: Any, reduce_op: Any = "mean") -> Any:
    """Sum or mean of `tensor` over processes (Lightning's "sum", "mean"/"avg" and ReduceOp)."""
    if not _several() or not isinstance(tensor, torch.Tensor):
        return tensor
    op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
    stacked = all_gather(tensor)
    if op.endswith("sum"):
        return stacked.sum(0)
    if op.endswith(("mean", "avg")):
        return (
            stacked.float()
            .mean(0)
            .to(tensor.dtype if tensor.is_floating_point() else torch.float32)
        )
    raise ValueError(f"zerojax.lightning: reduce_op={reduce_op!r}: only sum and mean are supported")
