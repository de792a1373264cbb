"""How a run is parallelised: one `ParallelPlan`, made once from the config and the mesh.

Everything that decides which parallelism applies is here, in the order it is applied:

1. **Mesh.** `zerojax.sharding.make_mesh(config)` names the device axes (`data`, `fsdp`,
   `tensor`, `expert`, `sequence`, ...). An axis of size 1 splits nothing and is left out of
   every decision below.
2. **Data-parallel axes**: the config's `zero.data_parallel_axes` larger than 1, in mesh order.
   Each device along them holds the whole model (up to its rule specs) and its own examples.
3. **ZeRO axes**: the data-parallel axes plus the sequence-parallel axis, when the config sets
   one. A device along the sequence axis also holds the whole model and its own tokens, so like
   a data-parallel rank it can own a ZeRO shard (DeepSpeed-Ulysses partitions over data x
   sequence); gradients are summed over it anyway. `zerojax.sharding.zero` shards optimizer
   state, master weights, gradients and stored params over exactly these axes, per stage.
4. **Batch placement**: the inputs' batch dim over `inputs.batch_axes` (default: the
   data-parallel axes; never the sequence axis), their sequence dim over the sequence axis
   (`input_sharding`). Pallas kernels, which XLA cannot partition, run per batch shard under
   `shard_map` (`kernel_batch`, `zerojax.bridge.kernel_sharding`).
5. **Tensor parallelism** is not decided here: it is the name rules' specs
   (`zerojax.sharding.rules`), which ZeRO's axes are added to.
6. **Sequence parallelism** (`sequence`, a `SequenceParallel`): with `sequence_parallel` on an
   axis larger than 1, attention runs as Ulysses or ring attention over it, per batch shard
   (`zerojax.parallel.sequence_parallel`); everything else is per token and XLA keeps it split.
7. **Expert parallelism** (`experts`, an `ExpertParallel`): on a mesh with an `expert` axis
   larger than 1 the MoE grouped GEMMs run with the experts split over it and the routed rows
   over it and the batch axes, with dispatch/combine all-to-alls
   (`zerojax.parallel.expert_parallel`).
8. **Offload** (`offloaded`): the components the `offload` section puts in host memory keep
   their ZeRO sharding there (`zerojax.sharding.zero.HOST_MEMORY_KIND`).

The ZeRO `ShardingPlan` is made over this plan (`make_sharding_plan(..., parallel=...)`, which
makes it from the config when not given) and carries it as `ShardingPlan.parallel`; the step's
programs (`zerojax.train.programs`) pass it to the bridge, whose lowerings read it as
`LoweringContext.parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zerojax.config import Config
from zerojax.parallel.expert_parallel import ExpertLoadLog, ExpertParallel
from zerojax.parallel.sequence_parallel import SequenceParallel

__all__ = ["OFFLOADABLE", "ParallelPlan", "make_parallel_plan"]

OFFLOADABLE = {
    "params": "params",
    "grads": "grads",
    "opt_state": "optimizer",
    "master_weights": "master",
}
"""Sharding-plan component -> the `offload` config field that can move it to host memory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan:
    """Which parallelism a run uses and over which mesh axes (see the module docstring for the
    order). Made by `make_parallel_plan`; a hand-made one (a benchmark's, a test's) sets only
    what it uses: the defaults split nothing."""

    mesh: Mesh
    """The run's mesh."""

    data_parallel_axes: tuple[str, ...] = ()
    """The config's data-parallel axes larger than 1, in mesh order."""

    zero_axes: tuple[str, ...] = ()
    """Axes ZeRO shards state over: the data-parallel axes plus the sequence-parallel axis."""

    batch_axes: tuple[str, ...] = ()
    """Axes the inputs' batch dim is split over."""

    batch_dim: int = 0
    """The inputs' batch dim."""

    sequence_axis: str | None = None
    """Axis the inputs' sequence dim is split over (the sequence-parallel axis), or None."""

    sequence_dim: int = 1
    """The inputs' sequence dim."""

    sequence: SequenceParallel | None = None
    """How attention crosses the sequence split; None: attention runs whole."""

    experts: ExpertParallel | None = None
    """How the MoE grouped GEMMs split over the expert axis; None: they run whole."""

    offloaded: tuple[str, ...] = ()
    """Components (`params`, `grads`, `opt_state`, `master_weights`) kept in host memory."""

    def input_sharding(self, ndim: int) -> NamedSharding:
        """Sharding for a batch input of rank `ndim`: batch dim over the batch axes, sequence
        dim over the sequence axis (if configured and the input has that dim)."""
        entries: list[Any] = [None] * ndim
        if ndim > self.batch_dim and self.batch_axes:
            axes = self.batch_axes
            entries[self.batch_dim] = axes[0] if len(axes) == 1 else axes
        if self.sequence_axis and ndim > self.sequence_dim:
            entries[self.sequence_dim] = self.sequence_axis
        return NamedSharding(self.mesh, PartitionSpec(*entries))

    @property
    def kernel_batch(self) -> tuple[Mesh, tuple[str, ...]] | None:
        """(mesh, axes) the per-shard kernels split dim 0 over: the axes that split an input's
        dim 0; None when nothing does."""
        axes = self.input_sharding(2).spec[0]
        if axes is None:
            return None
        return self.mesh, (axes,) if isinstance(axes, str) else tuple(axes)


def make_parallel_plan(
    config: Config, mesh: Mesh, *, expert_load_log: ExpertLoadLog | None = None
) -> ParallelPlan:
    """The `ParallelPlan` of a run on `mesh` (built from `config`, its axes the config's).

    `expert_load_log` is where expert parallelism records each step's routing; a new one when
    not given (read it back as `plan.experts.load_log`).
    """
    axis_sizes = dict(mesh.shape)
    data_parallel_axes = tuple(a for a in config.data_parallel_axes if axis_sizes[a] > 1)
    section = config.sequence_parallel
    sequence_split = section.axis is not None and axis_sizes[section.axis] > 1
    zero_axes = data_parallel_axes
    if sequence_split:
        zero_axes = tuple(
            a for a in mesh.axis_names if a in data_parallel_axes or a == section.axis
        )
    batch_axes = config.inputs.batch_axes
    if batch_axes is None:
        batch_axes = data_parallel_axes
    batch_axes = tuple(batch_axes)

    sequence = None
    if sequence_split and section.axis is not None:
        sequence = SequenceParallel(
            mesh=mesh,
            axis=section.axis,
            attention=section.attention,
            batch_axes=batch_axes,
            modules=section.modules,
        )
    experts = None
    if axis_sizes.get("expert", 1) > 1:
        # Each device dispatches its own tokens: rows split over the batch axes and `expert`.
        row_axes = set(batch_axes) | {"expert"}
        experts = ExpertParallel(
            mesh=mesh,
            expert_axes=("expert",),
            row_axes=tuple(a for a in mesh.axis_names if a in row_axes),
            capacity_factor=config.moe.capacity_factor,
            load_log=expert_load_log if expert_load_log is not None else ExpertLoadLog(),
        )
    offloaded = tuple(c for c, key in OFFLOADABLE.items() if getattr(config.offload, key) == "host")
    return ParallelPlan(
        mesh=mesh,
        data_parallel_axes=data_parallel_axes,
        zero_axes=zero_axes,
        batch_axes=batch_axes,
        batch_dim=config.inputs.batch_dim,
        sequence_axis=config.inputs.sequence_axis,
        sequence_dim=config.inputs.sequence_dim,
        sequence=sequence,
        experts=experts,
        offloaded=offloaded,
    )
