"""PyTorch DDP semantics when the mesh spans several processes (torchrun, SLURM).

One process sees the whole batch; with P processes each feeds its own rows, as under
`DistributedDataParallel`, and the engine's arrays are global (`zerojax.distributed.arrays`):

- inputs: each process's tensors are its local batch (dim 0); the global batch is their
  concatenation in process order, assembled with `jax.make_array_from_process_local_data` (no
  host holds it). Tensors without a batch dim (0-d) must be equal on every process.
- outputs: an output whose dim 0 is a multiple of the global batch is split by rows like the
  inputs, and `model(x)` returns this process's rows; any other output (a loss the model
  computes itself, batch statistics) is over the global batch, the same on every process.
- gradients: DDP's gradient is the average over processes of each one's local-loss gradient,
  (1/P) sum_p dL_p/dw. The program's pullback of the processes' row cotangents, concatenated,
  is sum_p dL_p/dw, so each row cotangent is divided by P before it (exact for P a power of
  two). An output that is not split by rows has one value for the whole job: its cotangent,
  which every process must pass equally (JAX checks), enters once, which is the average of P
  equal ones. A loss the model computes over the global batch (`loss_fn=`, HF `labels=`) is
  its mean over all rows: its gradient equals DDP's whenever each process's loss is the mean
  over an equal number of rows (not so with per-process counts of ignored tokens).
- loss kwargs: a model called with `num_items_in_batch` (the Hugging Face Trainer's loss
  kwargs, the number of items the loss is normalised by over all processes) computes a sum
  over the global batch divided by it, whose DDP value on each process is its own rows' sum
  divided by it: the processes' shares, which the caller adds up (the Trainer multiplies each
  by P before DDP averages the gradients, and averages the logged values). Each process gets
  the global loss divided by P: the shares add up to the same loss and the same gradient
  (its cotangent divided by P alike); one process's share is not its own rows' part.
- input gradients (a wrapped model feeding torch) are per process in DDP, dL_p/dx_p: the
  pullback gave (1/P) of that, so they are multiplied back by P.
- BatchNorm in train mode normalises over the global batch, as `SyncBatchNorm` does.

Parameters are checked equal on every process when placed (JAX's `device_put` compares them),
as DDP broadcasts rank 0's: build the model identically on every rank (same seed). The
dropout seed is rank 0's.
"""

from __future__ import annotations

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from zerojax.distributed.arrays import (
    batch_dim_sharding,
    data_parallel_process_count,
    global_from_local,
    local_rows,
)
from zerojax.sharding.zero import ShardingPlan

__all__ = ["ProcessLocalBatches", "rank0_seed"]


def rank0_seed(seed: int) -> int:
    """Process 0's `seed` on every process (dropout masks must agree across the job)."""
    return int(multihost_utils.broadcast_one_to_all(np.int64(seed)))


class ProcessLocalBatches:
    """Conversions between one process's torch tensors and the engine's global arrays."""

    def __init__(self, plan: ShardingPlan):
        if plan.batch_dim != 0:
            raise ValueError(
                f"inputs.batch_dim={plan.batch_dim}: with several processes the batch must be "
                "dim 0 of every input (each process's rows are stacked along it)"
            )
        self.plan = plan
        self.replicated = NamedSharding(plan.mesh, PartitionSpec())
        self.num_processes = data_parallel_process_count(plan.input_sharding(1))

    def _row_sharding(self, ndim: int) -> NamedSharding:
        return batch_dim_sharding(self.plan.input_sharding(ndim), ndim)

    # --- inputs ---------------------------------------------------------------------------

    def global_input(self, local) -> jax.Array:
        """This process's input tensor (host data) as the global batch."""
        local = np.asarray(local)
        return global_from_local(local, self.plan.input_sharding(local.ndim), self.num_processes)

    def global_example(self, args, kwargs):
        """Torch inputs with the global batch's shapes (each process's rows repeated P times),
        for torch.export to specialize on the shapes the program will see."""

        def widen(t: torch.Tensor) -> torch.Tensor:
            return t.repeat(self.num_processes, *[1] * (t.ndim - 1)) if t.ndim else t

        return torch_pytree.tree_map_only(torch.Tensor, widen, (args, kwargs))

    @staticmethod
    def global_rows(jax_leaves) -> int | None:
        """The global batch size of one call: dim 0 of its first batch-split input."""
        for leaf in jax_leaves:
            if isinstance(leaf, jax.Array) and leaf.ndim and not leaf.is_fully_addressable:
                return leaf.shape[0]
        return None

    # --- outputs and their cotangents -------------------------------------------------------

    @staticmethod
    def is_rows(leaf, global_rows: int | None) -> bool:
        """Whether an output (an array or its ShapeDtypeStruct) holds the batch's rows."""
        shape = leaf.shape
        return bool(global_rows and shape and shape[0] and shape[0] % global_rows == 0)

    def local_output(self, leaf: jax.Array, global_rows: int | None) -> np.ndarray:
        """This process's share of one output: its rows, or the whole of a non-row output."""
        if self.is_rows(leaf, global_rows):
            return local_rows(leaf, self._row_sharding(leaf.ndim))
        if not leaf.is_fully_replicated:
            leaf = jax.device_put(leaf, self.replicated)
        return np.asarray(leaf)

    def global_cotangent(
        self, leaf: jax.ShapeDtypeStruct, grad, global_rows: int | None
    ) -> jax.Array:
        """The program's cotangent for output `leaf` (its shape and dtype) from this process's
        torch gradient (None: zeros)."""
        rows = self.is_rows(leaf, global_rows)
        if grad is None or not np.issubdtype(leaf.dtype, np.floating):
            shape = (leaf.shape[0] // self.num_processes, *leaf.shape[1:]) if rows else leaf.shape
            grad = np.zeros(shape, leaf.dtype)
        else:
            grad = np.asarray(grad).astype(leaf.dtype)
        if rows:
            grad = (grad / np.asarray(self.num_processes, grad.dtype)).astype(leaf.dtype)
            return global_from_local(grad, self._row_sharding(leaf.ndim), self.num_processes)
        try:
            return jax.device_put(grad, self.replicated)
        except AssertionError as exc:  # JAX's check that every process passed the same value
            raise ValueError(
                f"the gradient of a model output of shape {leaf.shape} that is not split by rows "
                "(the same value on every process) differs between processes; its cotangent "
                "must be equal on every rank"
            ) from exc

    def local_input_grad(self, grad: jax.Array, global_rows: int | None) -> np.ndarray:
        """DDP's per-process input gradient from the program's (see the module docstring)."""
        local = self.local_output(grad, global_rows)
        return (local * np.asarray(self.num_processes, local.dtype)).astype(local.dtype)
