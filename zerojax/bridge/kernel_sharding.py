"""Running an op per batch shard under `jax.shard_map`, where XLA's partitioner would not.

XLA's SPMD partitioner cannot split a Pallas call (an opaque custom call): inside the engine's
sharded program it would gather the whole batch onto every device around each kernel. The
lowerings therefore run a kernel per batch shard under `jax.shard_map` when the engine says
how the batch is split (`ParallelPlan.kernel_batch`, as `LoweringContext.parallel`). The kernels are per-example (attention,
norms, per-token loss), so the shards need no communication; gradients of the replicated
inputs (norm weights, the projection) are summed over the shards by shard_map's transpose.
The XLA references stay outside shard_map: XLA partitions them itself.

A grouped convolution takes the same path (`on_batch_shards`): the partitioner gathers a
batch-split input of a convolution whose `feature_group_count` is above 1 and below its input
channels onto every device and convolves the whole batch there (XLA in jax 0.10, Shardy and
GSPMD alike), so every device did the whole batch's grouped convolutions, forward and backward
(bench/grouped_conv_sharded.py: a ResNeXt-50 ZeRO-3 step on 8 CPU devices 0.75x as long now).
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
    if not uses_pallas(implementation, interpret):
        return kernel(*operands, axis_index=None)
    return on_batch_shards(ctx, kernel, operands, batched, pass_axis_index=True)


def on_batch_shards(
    ctx: LoweringContext,
    fn: Callable,
    operands: Sequence,
    batched: Sequence[bool],
    *,
    pass_axis_index: bool = False,
):
    """`fn(*operands)`, run on each batch shard under `shard_map` when the run splits the batch
    (`ParallelPlan.kernel_batch`) and every `batched` operand's dim 0 divides into the shards:
    those operands and the result split on dim 0, the others whole on every device (operands
    may be None). Otherwise `fn` runs on the whole operands. With `pass_axis_index`, `fn` also
    receives `axis_index`: this shard's index, None when not split."""
    whole = {"axis_index": None} if pass_axis_index else {}
    placement = None if ctx.parallel is None else ctx.parallel.kernel_batch
    if placement is None:
        return fn(*operands, **whole)
    mesh, axes = placement
    shards = math.prod(mesh.shape[a] for a in axes)
    rows = [x.shape[0] for x, b in zip(operands, batched, strict=True) if b]
    if shards == 1 or any(r % shards for r in rows):
        return fn(*operands, **whole)
    present = [i for i, x in enumerate(operands) if x is not None]

    def local(*values):
        full = [None] * len(operands)
        for i, v in zip(present, values, strict=True):
            full[i] = v
        if pass_axis_index:
            return fn(*full, axis_index=jax.lax.axis_index(axes))
        return fn(*full)

    batch = PartitionSpec(axes)
    in_specs = tuple(batch if batched[i] else PartitionSpec() for i in present)
    # check_vma=False: Pallas calls (and their interpret mode) carry no varying-axes types.
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=batch, check_vma=False)(
        *(operands[i] for i in present)
    )
