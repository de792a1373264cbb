"""Expert parallelism: the grouped GEMM run with each expert's weights on one slice of the mesh.

An MoE layer converted from torch reaches the bridge as routing (top-k, sort by expert, histc,
cumsum) followed by grouped GEMMs over rows sorted by expert (`bridge/lowerings/moe.py`). Expert
parallelism splits the stacked expert weights `[E, K, N]` over the mesh's expert axes, so device x
of the X devices along them owns experts [x * E/X, (x + 1) * E/X). The grouped GEMM then runs under
`jax.shard_map` as three steps (the two operators Hybrid-EP / DeepEP name):

- **dispatch**: every device takes its share of the sorted rows and sends the rows of each
  expert to the device owning that expert (all-to-all over the expert axes);
- **compute**: each device multiplies the rows it received by its local experts (`ragged_dot`);
- **combine**: the reverse all-to-all returns each result to the device and row it came from.

Why at the grouped GEMM and not around the whole MoE block: the grouped GEMM is the one op every
transformers MoE (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS) shares, and its inputs
already say everything dispatch needs (rows sorted by expert, cumulative group ends). The
routing before it stays in the global program, partitioned by XLA; the router's softmax, the
top-k weights and the auxiliary load-balancing loss are therefore computed exactly as without
expert parallelism, which is what keeps the loss equal to the single-device run. The cost is one
dispatch + combine per grouped GEMM (two per expert MLP: up and down projection) instead of one
around the expert MLP, and rows, not tokens, travel: a token routed to two experts on one
device is sent twice (the grouped GEMM's rows are already the token-expert pairs).

XLA:CPU does not implement `ragged-all-to-all` ("HLO opcode `ragged-all-to-all` is not supported
by XLA:CPU ThunkEmitter", JAX 0.10), so dispatch is a plain `all_to_all` of fixed-size buffers:
`capacity` rows per (sender, receiver) pair. Dropless (the default) sizes the buffer for the
worst case, every row a device holds to one receiver (capacity = the rows it holds); a capacity
factor f sizes it at ceil(f * R / receivers), R the rows a device starts with: the balanced
share times f. Rows beyond it are dropped: their output is zero (the token keeps only its
residual path, as in Switch Transformer / GShard) and they are counted on the devices.

**Hierarchical dispatch** (`hierarchical=True` with two or more expert axes, e.g. `node` x
`local`): one all-to-all per axis, outermost first. A row first crosses the slow axis to the
device with the same inner coordinates on its expert's node, then fans out over the fast axis to
the device owning its expert; combine runs the reverse (fast axis first, then slow), DeepEP's
internode order (RDMA to the same-local-rank GPU, then NVLink forwarding; combine reduces over
NVLink before RDMA). Over the slow axis a dropless device then sends one buffer of R rows per
other node instead of one per other device of that node: the flat form's padded cross-node
bytes divided by the local size; the fan-out padding moves to the fast axis. The opposite order
(fast axis first) would gather up to local-size x R rows on a device before the slow hop and
pad the slow link by that much.

A device's share of the rows is strided, not contiguous: device s of S takes rows s, s + S,
s + 2S, ... The rows are sorted by expert over the whole batch, so a contiguous slice would hold
one or two experts' rows and send nearly all of them to one peer (with uniformly random routing
and a capacity factor of 1, 60% of the rows were dropped that way); a strided share holds about
1/S of every expert's rows, the balanced traffic the capacity is sized for. The transpose of an
all-to-all is the reverse all-to-all, so gradients take the same exchanges backwards.
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
    """Where the grouped GEMMs of a converted model run expert-parallel (`make_parallel_plan`
    builds it when the mesh has an `expert` axis larger than 1, as `ParallelPlan.experts`)."""

    mesh: Mesh
    """The engine's mesh."""

    expert_axes: tuple[str, ...] = ("expert",)
    """Mesh axes that split the experts, outermost (slowest link) first; device x of their
    product, in mesh order, owns experts [x * E/X, (x + 1) * E/X)."""

    row_axes: tuple[str, ...] = ("expert",)
    """Mesh axes that split the routed rows among devices (the batch axes and the expert axes,
    in mesh order): each device dispatches only its own share."""

    capacity_factor: float | None = None
    """None: dropless. Otherwise each (sender, receiver) pair of an exchange carries at most
    ceil(capacity_factor * R / receivers) rows; the rest are dropped."""

    hierarchical: bool = False
    """One all-to-all per expert axis, outermost first (module docstring); False: one
    all-to-all over all expert axes together."""

    load_log: ExpertLoadLog | None = field(default=None, compare=False)
    """Where each step's rows per expert and dropped rows are recorded; None records nothing."""

    def __post_init__(self) -> None:
        for axis in (*self.expert_axes, *self.row_axes):
            if axis not in self.mesh.shape:
                raise ValueError(
                    f"ExpertParallel: axis {axis!r} is not in the mesh; mesh axes: "
                    f"{', '.join(self.mesh.axis_names)}"
                )
        missing = [a for a in self.expert_axes if a not in self.row_axes]
        if missing:
            raise ValueError(
                f"ExpertParallel: row_axes {self.row_axes} must include every expert axis "
                f"({missing} missing): each device along them dispatches its own rows"
            )

    @property
    def num_peers(self) -> int:
        """Devices the experts are split over (X)."""
        return math.prod(self.mesh.shape[a] for a in self.expert_axes)

    @property
    def num_row_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.row_axes)

    @property
    def stages(self) -> tuple[tuple[str | tuple[str, ...], int], ...]:
        """(axis or axes, receivers) of each dispatch all-to-all, in dispatch order."""
        if self.hierarchical:
            return tuple((a, self.mesh.shape[a]) for a in self.expert_axes)
        axes = self.expert_axes[0] if len(self.expert_axes) == 1 else self.expert_axes
        return ((axes, self.num_peers),)


def dispatch_capacity(
    rows_in: int, start_rows: int, receivers: int, capacity_factor: float | None
) -> int:
    """Rows one device may send one receiver in an exchange whose input buffer has `rows_in`
    rows, on a device that started with `start_rows`: all of them when dropless, else the
    balanced share (start_rows / receivers) times the capacity factor, rounded up."""
    if capacity_factor is None:
        return rows_in
    return max(1, min(rows_in, math.ceil(capacity_factor * start_rows / receivers)))


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
    `placement.load_log`. Raises ValueError when E does not split over the expert axes.
    """
    out, dropped = expert_parallel_ragged_dot_and_drops(
        placement, lhs, rhs, group_ends, where=where, **dot_options
    )
    if placement.load_log is not None and site is not None:
        jax.debug.callback(
            functools.partial(placement.load_log.record, site),
            jnp.diff(group_ends.astype(jnp.int32), prepend=0),
            dropped,
        )
    return out


def expert_parallel_ragged_dot_and_drops(
    placement: ExpertParallel,
    lhs: jax.Array,
    rhs: jax.Array,
    group_ends: jax.Array,
    *,
    where: str,
    **dot_options,
) -> tuple[jax.Array, jax.Array]:
    """`expert_parallel_ragged_dot` and the number of rows capacity dropped (0 when dropless),
    counted on the devices."""
    num_experts, peers = rhs.shape[0], placement.num_peers
    if num_experts % peers:
        axes = " x ".join(f"{a}={placement.mesh.shape[a]}" for a in placement.expert_axes)
        raise ValueError(
            f"expert parallelism: {num_experts} experts do not split over mesh "
            f"{'axis' if len(placement.expert_axes) == 1 else 'axes'} {axes} ({peers} devices; "
            f"{where}); use expert axes whose product divides "
            f"{num_experts} (one of {[d for d in range(1, num_experts + 1) if num_experts % d == 0]})"
        )
    rows, width = lhs.shape
    shards = placement.num_row_shards
    padded = -rows % shards  # zero rows past the last group belong to no expert
    if padded:
        lhs = jnp.pad(lhs, ((0, padded), (0, 0)))
    local_rows = lhs.shape[0] // shards
    # Strided shares (module docstring): row i * S + s is device s's i-th row.
    lhs = lhs.reshape(local_rows, shards, width)
    row_spec = PartitionSpec(None, placement.row_axes)
    expert_spec = PartitionSpec(placement.expert_axes)

    def per_shard(lhs, rhs, group_ends):
        out, dropped = _dispatch_compute_combine(
            lhs[:, 0], rhs, group_ends.astype(jnp.int32), placement, shards, dot_options
        )
        return out[:, None], lax.psum(dropped, placement.row_axes)

    out, dropped = jax.shard_map(
        per_shard,
        mesh=placement.mesh,
        in_specs=(row_spec, expert_spec, PartitionSpec()),
        out_specs=(row_spec, PartitionSpec()),
    )(lhs, rhs, group_ends)
    return out.reshape(local_rows * shards, -1)[:rows], dropped


def _dispatch_compute_combine(lhs, rhs, group_ends, placement, num_shards, dot_options):
    """One device's share: its rows (R, K) -> (their products (R, N), rows it dropped)."""
    local_rows = lhs.shape[0]
    row = jnp.arange(local_rows, dtype=jnp.int32)
    global_row = row * num_shards + lax.axis_index(placement.row_axes)
    # Expert of each row (num_experts for rows past the last group end: padding, owned by none).
    expert = jnp.searchsorted(group_ends, global_row, side="right").astype(jnp.int32)

    def compute(rows, local_expert):
        # Rows arrive grouped by sender; one stable sort makes every local expert's rows
        # contiguous, as ragged_dot needs (empty slots carry `local_experts` and sort last).
        local_experts = rhs.shape[0]
        order = jnp.argsort(local_expert, stable=True)
        sizes = jnp.zeros((local_experts,), jnp.int32).at[local_expert].add(1, mode="drop")
        products = lax.ragged_dot(rows[order], rhs, sizes, **dot_options)
        return jnp.zeros_like(products).at[order].set(products)

    return _exchange(
        lhs,
        expert,
        group_ends.shape[0],
        placement.stages,
        compute,
        start_rows=local_rows,
        capacity_factor=placement.capacity_factor,
    )


def _exchange(rows, target, num_targets, stages, compute, *, start_rows, capacity_factor):
    """Dispatch `rows` over `stages`, `compute` where they land, combine back.

    `target` is each row's expert counted within the current domain of `num_targets` experts
    (`num_targets` for a row that goes nowhere). Stage (axes, receivers) sends a row to the
    receiver owning its expert, as expert number `target mod (num_targets / receivers)` of that
    receiver's domain, then recurses there. Returns (results (rows, N), rows dropped here and
    downstream). Buffers are receiver-major: slot d * capacity + i holds the i-th row for d.
    """
    if not stages:
        return compute(rows, target), jnp.int32(0)
    (axes, receivers), rest = stages[0], stages[1:]
    per_receiver = num_targets // receivers
    receiver = target // per_receiver  # == receivers for rows that go nowhere
    capacity = dispatch_capacity(rows.shape[0], start_rows, receivers, capacity_factor)
    # A row's place in its receiver's run: how many rows for that receiver precede it.
    runs = jnp.cumsum(receiver[:, None] == jnp.arange(receivers)[None], axis=0, dtype=jnp.int32)
    index_in_run = (
        jnp.take_along_axis(runs, jnp.minimum(receiver, receivers - 1)[:, None], axis=1)[:, 0] - 1
    )
    routed = receiver < receivers
    kept = routed & (index_in_run < capacity)
    slot = jnp.where(kept, receiver * capacity + index_in_run, receivers * capacity)
    dropped = jnp.sum(routed & ~kept, dtype=jnp.int32)

    buffer_rows = receivers * capacity
    send = jnp.zeros((buffer_rows, rows.shape[1]), rows.dtype).at[slot].set(rows, mode="drop")
    send_target = jnp.full((buffer_rows,), per_receiver, jnp.int32)  # empty slot: no expert
    send_target = send_target.at[slot].set(target % per_receiver, mode="drop")
    # Dispatch: chunk d of the buffer goes to receiver d; what arrives is ordered by sender.
    received = lax.all_to_all(send, axes, 0, 0, tiled=True)
    received_target = lax.all_to_all(send_target, axes, 0, 0, tiled=True)
    results, dropped_later = _exchange(
        received,
        received_target,
        per_receiver,
        rest,
        compute,
        start_rows=start_rows,
        capacity_factor=capacity_factor,
    )
    # Combine: the reverse exchange brings each result back to the slot its row left from.
    returned = lax.all_to_all(results, axes, 0, 0, tiled=True)
    out = jnp.take(returned, slot, axis=0, mode="fill", fill_value=0)
    return out, dropped + dropped_later
