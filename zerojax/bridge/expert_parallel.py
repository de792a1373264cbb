"""Expert parallelism: the grouped GEMM run with each expert's weights on one slice of the mesh.

An MoE layer converted from torch reaches the bridge as routing (top-k, sort by expert, histc,
cumsum) followed by grouped GEMMs over rows sorted by expert (`moe.py`). Expert parallelism
splits the stacked expert weights `[E, K, N]` over the mesh's `expert` axis, so device x of
that axis owns experts [x * E/X, (x + 1) * E/X). The grouped GEMM then runs under
`jax.shard_map` as three steps (the two operators Hybrid-EP / DeepEP name):

- **dispatch**: every device takes its share of the sorted rows and sends the rows of each
  expert to the expert-axis peer owning that expert (an all-to-all over `expert`);
- **compute**: each device multiplies the rows it received by its local experts (`ragged_dot`);
- **combine**: the reverse all-to-all returns each result to the device and row it came from.

Why at the grouped GEMM and not around the whole MoE block: the grouped GEMM is the one op every
transformers MoE (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS) shares, and its inputs
already say everything dispatch needs (rows sorted by expert, cumulative group ends). The
routing before it stays in the global program, partitioned by XLA; the router's softmax, the
top-k weights and the auxiliary load-balancing loss are therefore computed exactly as without
expert parallelism, which is what keeps the loss equal to the single-device run. The cost is one
dispatch + combine per grouped GEMM (two per expert MLP: up and down projection) instead of one
around the expert MLP.

XLA:CPU does not implement `ragged-all-to-all` ("HLO opcode `ragged-all-to-all` is not supported
by XLA:CPU ThunkEmitter", JAX 0.10), so dispatch is a plain `all_to_all` of fixed-size buffers:
`capacity` rows per (sender, receiver) pair. Dropless (the default) sizes the buffer for the
worst case, every local row to one peer (capacity = local rows); a capacity factor f sizes it
at ceil(f * local rows / X), the balanced share times f, and rows beyond it are dropped: their
output is zero (the token keeps only its residual path, as in Switch Transformer / GShard) and
they are counted.

A device's share of the rows is strided, not contiguous: device s of S takes rows s, s + S,
s + 2S, ... The rows are sorted by expert over the whole batch, so a contiguous slice would hold
one or two experts' rows and send nearly all of them to one peer (with uniformly random routing
and a capacity factor of 1, 60% of the rows were dropped that way); a strided share holds about
1/S of every expert's rows, the balanced traffic the capacity is sized for, and is still sorted
by expert. The transpose of an all-to-all is the reverse all-to-all, so gradients take
the same two exchanges backwards.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

__all__ = [
    "ExpertLoadLog",
    "ExpertParallel",
    "dispatch_capacity",
    "dropped_rows",
    "expert_parallel_ragged_dot",
]


class ExpertLoadLog:
    """The latest step's routing per grouped GEMM: rows (token-expert pairs) per expert and rows
    dropped by capacity, as `Engine.moe_stats()` reports them.

    Filled from inside the compiled step by a host callback (`jax.debug.callback`) per grouped
    GEMM: a few dozen integers per MoE layer, next to the all-to-alls' megabytes."""

    def __init__(self) -> None:
        self.latest: dict[str, dict[str, np.ndarray | int]] = {}

    def record(self, site: str, rows_per_expert, dropped) -> None:
        self.latest[site] = {
            "rows_per_expert": np.asarray(rows_per_expert),
            "dropped": int(dropped),
        }


@dataclass(frozen=True, kw_only=True)
class ExpertParallel:
    """Where the grouped GEMMs of a converted model run expert-parallel (the engine builds it
    when the mesh has an `expert` axis larger than 1)."""

    mesh: Mesh
    """The engine's mesh."""

    expert_axis: str = "expert"
    """Mesh axis that splits the experts; dispatch and combine are all-to-alls over it."""

    row_axes: tuple[str, ...] = ("expert",)
    """Mesh axes that split the routed rows among devices (the batch axes and the expert axis,
    in mesh order): each device dispatches only its own slice."""

    capacity_factor: float | None = None
    """None: dropless. Otherwise each (sender, receiver) pair carries at most
    ceil(capacity_factor * local rows / expert-axis size) rows; the rest are dropped."""

    load_log: ExpertLoadLog | None = field(default=None, compare=False)
    """Where each step's rows per expert and dropped rows are recorded; None records nothing."""

    @property
    def num_peers(self) -> int:
        """Devices along the expert axis (X)."""
        return self.mesh.shape[self.expert_axis]

    @property
    def num_row_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.row_axes)


def dispatch_capacity(local_rows: int, num_peers: int, capacity_factor: float | None) -> int:
    """Rows one device may send to one peer: all of them when dropless, else the balanced share
    (local_rows / num_peers) times the capacity factor, rounded up."""
    if capacity_factor is None:
        return local_rows
    return max(1, min(local_rows, math.ceil(capacity_factor * local_rows / num_peers)))


def expert_parallel_ragged_dot(
    placement: ExpertParallel,
    lhs: jax.Array,
    rhs: jax.Array,
    group_ends: jax.Array,
    *,
    where: str,
    site: str | None = None,
    **dot_options,
) -> jax.Array:
    """out[r] = lhs[r] @ rhs[g] for the rows r of group g (rows past group_ends[-1]: zero),
    computed expert-parallel on `placement`'s mesh.

    lhs (M, K) rows sorted by group, rhs (E, K, N), group_ends (E,) cumulative -> (M, N).
    `where` names the op and module for error messages; `site` names this GEMM in
    `placement.load_log`. Raises ValueError when E does not split over the expert axis.
    """
    num_experts, peers = rhs.shape[0], placement.num_peers
    if num_experts % peers:
        raise ValueError(
            f"expert parallelism: {num_experts} experts do not split over mesh axis "
            f"'{placement.expert_axis}' of size {peers} ({where}); use an expert-axis size "
            f"that divides {num_experts} (one of "
            f"{[d for d in range(1, num_experts + 1) if num_experts % d == 0]})"
        )
    rows, width = lhs.shape
    if placement.load_log is not None and site is not None:
        jax.debug.callback(
            functools.partial(placement.load_log.record, site),
            jnp.diff(group_ends.astype(jnp.int32), prepend=0),
            dropped_rows(group_ends, total_rows=rows, placement=placement),
        )
    shards = placement.num_row_shards
    padded = -rows % shards  # zero rows past the last group belong to no expert
    if padded:
        lhs = jnp.pad(lhs, ((0, padded), (0, 0)))
    local_rows = lhs.shape[0] // shards
    capacity = dispatch_capacity(local_rows, peers, placement.capacity_factor)
    # Strided shares (module docstring): row i * S + s is device s's i-th row.
    lhs = lhs.reshape(local_rows, shards, width)
    row_spec = PartitionSpec(None, placement.row_axes)

    def per_shard(lhs, rhs, group_ends):
        return _dispatch_compute_combine(
            lhs[:, 0],
            rhs,
            group_ends.astype(jnp.int32),
            axis=placement.expert_axis,
            row_axes=placement.row_axes,
            capacity=capacity,
            dot_options=dot_options,
            num_shards=shards,
        )[:, None]

    out = jax.shard_map(
        per_shard,
        mesh=placement.mesh,
        in_specs=(row_spec, PartitionSpec(placement.expert_axis), PartitionSpec()),
        out_specs=row_spec,
    )(lhs, rhs, group_ends)
    return out.reshape(local_rows * shards, -1)[:rows]


def _dispatch_compute_combine(
    lhs, rhs, group_ends, *, axis, row_axes, capacity, dot_options, num_shards
):
    """One device's share: its rows (R, K) -> their products (R, N); see the module docstring.

    Dispatch buffers are laid out peer-major: slot p * capacity + i holds this device's i-th row
    for peer p. Rows are sorted by expert, hence by owning peer, so a row's index within its
    peer's run is its index minus the run's first index.
    """
    local_rows = lhs.shape[0]
    local_experts = rhs.shape[0]
    peers = group_ends.shape[0] // local_experts
    row = jnp.arange(local_rows, dtype=jnp.int32)
    global_row = row * num_shards + lax.axis_index(row_axes)
    # Expert of each row (num_experts for rows past the last group end: padding, owned by none).
    expert = jnp.searchsorted(group_ends, global_row, side="right").astype(jnp.int32)
    peer = expert // local_experts  # == peers for padding rows
    run_start = jnp.searchsorted(peer, jnp.arange(peers + 1, dtype=jnp.int32), side="left")
    index_in_run = row - run_start[peer]
    kept = (peer < peers) & (index_in_run < capacity)
    slot = jnp.where(kept, peer * capacity + index_in_run, peers * capacity)  # out of range: drop

    buffer_rows = peers * capacity
    send = jnp.zeros((buffer_rows, lhs.shape[1]), lhs.dtype).at[slot].set(lhs, mode="drop")
    send_expert = jnp.full((buffer_rows,), local_experts, jnp.int32)  # empty slot: no expert
    send_expert = send_expert.at[slot].set(expert % local_experts, mode="drop")

    # Dispatch: chunk p of the buffer goes to peer p; what arrives is ordered by sender.
    received = lax.all_to_all(send, axis, 0, 0, tiled=True)
    received_expert = lax.all_to_all(send_expert, axis, 0, 0, tiled=True)

    # Compute: each sender's rows are sorted by local expert, but the senders' runs interleave;
    # one stable sort makes every local expert's rows contiguous, as ragged_dot needs (empty
    # slots carry expert `local_experts` and sort to the end, past every group).
    order = jnp.argsort(received_expert, stable=True)
    group_sizes = jnp.zeros((local_experts,), jnp.int32).at[received_expert].add(1, mode="drop")
    products = lax.ragged_dot(received[order], rhs, group_sizes, **dot_options)
    products = jnp.zeros_like(products).at[order].set(products)

    # Combine: the reverse exchange brings each product back to the slot its row left from.
    returned = lax.all_to_all(products, axis, 0, 0, tiled=True)
    return jnp.take(returned, slot, axis=0, mode="fill", fill_value=0)


def dropped_rows(group_ends: jax.Array, *, total_rows: int, placement: ExpertParallel) -> jax.Array:
    """How many routed rows capacity-factor dispatch drops for these group ends (0 when
    dropless): the rows beyond `capacity` in each (sender, peer) run, summed over senders.

    Computed from the global group ends alone, the same way each device decides, so a caller
    can report it without reading the devices' buffers.
    """
    shards, peers = placement.num_row_shards, placement.num_peers
    local_rows = -(-total_rows // shards)
    capacity = dispatch_capacity(local_rows, peers, placement.capacity_factor)
    local_experts = group_ends.shape[0] // peers
    # Rows of peer p form one contiguous global range [start_p, end_p); sender s holds the rows
    # r = s (mod S); whatever of that intersection exceeds `capacity` is dropped.
    peer_ends = group_ends.astype(jnp.int32)[local_experts - 1 :: local_experts]
    peer_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), peer_ends[:-1]])
    sender = jnp.arange(shards, dtype=jnp.int32)[:, None]

    def held_below(end):  # rows r < end with r = sender (mod S)
        return jnp.maximum(0, (end[None] - sender + shards - 1) // shards)

    sent = held_below(peer_ends) - held_below(peer_starts)
    return jnp.sum(jnp.maximum(sent - capacity, 0))
