"""Running a substituted Pallas kernel on batch-sharded activations.

XLA's SPMD partitioner cannot split a Pallas call (an opaque custom call): inside the engine's
sharded program it would gather the whole batch onto every device around each kernel. The
lowerings therefore run a kernel per batch shard under `jax.shard_map` when the engine says
how the batch is split (`ParallelPlan.kernel_batch`, as `LoweringContext.parallel`). The kernels are per-example (attention,
norms, per-token loss), so the shards need no communication; gradients of the replicated
inputs (norm weights, the projection) are summed over the shards by shard_map's transpose.
The XLA references stay outside shard_map: XLA partitions them itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec

from zerojax.bridge.registry import LoweringContext
from zerojax.pallas_kernels.backend import auto_picks_pallas


def uses_pallas(implementation: str, interpret: bool) -> bool:
    """Whether a kernel api given these arguments runs its Pallas kernel (its "auto" rule)."""
    if implementation == "pallas":
        return True
    return implementation == "auto" and auto_picks_pallas(interpret)


def per_batch_shard(
    ctx: LoweringContext,
    kernel: Callable,
    operands: Sequence,
    batched: Sequence[bool],
    *,
    family: str,
):
    """`kernel(*operands)`, with each `batched` operand (and the result) split on dim 0 over
    the batch axes when the config runs `family` as a Pallas kernel on a sharded batch.

    `kernel` receives `axis_index`, this shard's index (None when not split), as a keyword,
    for per-shard random streams.
    """
    implementation, interpret = ctx.kernel(family)
    placement = None if ctx.parallel is None else ctx.parallel.kernel_batch
    if placement is None or not uses_pallas(implementation, interpret):
        return kernel(*operands, axis_index=None)
    mesh, axes = placement
    shards = math.prod(mesh.shape[a] for a in axes)
    rows = [x.shape[0] for x, b in zip(operands, batched, strict=True) if b]
    if shards == 1 or any(r % shards for r in rows):
        return kernel(*operands, axis_index=None)
    present = [i for i, x in enumerate(operands) if x is not None]

    def local(*values):
        full = [None] * len(operands)
        for i, v in zip(present, values, strict=True):
            full[i] = v
        return kernel(*full, axis_index=jax.lax.axis_index(axes))

    batch = PartitionSpec(axes)
    in_specs = tuple(batch if batched[i] else PartitionSpec() for i in present)
    # check_vma=False: Pallas calls (and their interpret mode) carry no varying-axes types.
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=batch, check_vma=False)(
        *(operands[i] for i in present)
    )
