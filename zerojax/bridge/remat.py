"""Activation checkpointing: the parts of a graph whose activations the backward pass recomputes.

A *region* is a run of consecutive graph nodes that came from one module instance matched by the
config's `activation_checkpointing.modules` (by its path in the model, e.g. `transformer.h.3`;
the outermost matching module wins), or else from one call of `torch.utils.checkpoint.checkpoint`
in the model (capture tags those nodes, see `torch_checkpoint.py`). The interpreter evaluates a
region as one function under `jax.checkpoint` with the region's policy, so what the region
computes is rematerialised in the backward pass instead of kept, as torch's checkpoint does.

XLA:CPU removes `jax.checkpoint`'s optimization barriers early in its pipeline (its
`cse_barrier_expander` pass), after which CSE merges each recomputation with the forward value:
checkpointing would neither save memory nor cost time there, unlike on GPU and TPU. Programs
that train compile with that pass off (`zerojax.train.xla_options`), so a CPU run (and a memory
plan made on CPU) behaves as the accelerator will.

Policies (`zerojax.config.REMAT_POLICIES`): `full` keeps only the region's inputs; `save_dots`
keeps matmul outputs too; `offload` moves matmul outputs to host memory and back (backends
with a `pinned_host` memory space); `none` keeps everything (no region).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import torch

from zerojax.config import ActivationCheckpointingConfig

__all__ = ["CHECKPOINT_TAG", "Region", "checkpoint_policy", "find_regions"]

CHECKPOINT_TAG = "zerojax_torch_checkpoint"
"""Key in `node.meta["custom"]` of the nodes one torch checkpoint call made: its call number."""


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """Consecutive nodes evaluated together under `jax.checkpoint`."""

    origin: str
    """What asked for it: `module transformer.h.3` or `torch.utils.checkpoint call 2`."""

    policy: str
    nodes: tuple[torch.fx.Node, ...]
    inputs: tuple[torch.fx.Node, ...]
    """Nodes outside the region whose values it reads, in graph order."""

    outputs: tuple[torch.fx.Node, ...]
    """Region nodes read after it (or returned), in graph order."""


def _module_paths(node: torch.fx.Node) -> list[str]:
    """The module paths of a node's `nn_module_stack`, outermost first (the root's is '')."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values()]


def _origin_and_policy(
    node: torch.fx.Node, config: ActivationCheckpointingConfig
) -> tuple[str, str] | None:
    for path in _module_paths(node):
        if path:
            policy = config.policy_for(path)
            if policy is not None:
                return (f"module {path}", policy)
    call = (node.meta.get("custom") or {}).get(CHECKPOINT_TAG)
    if call is not None:
        return (f"torch.utils.checkpoint call {call}", config.torch_checkpoint)
    return None


def find_regions(
    graph: torch.fx.Graph, config: ActivationCheckpointingConfig
) -> dict[torch.fx.Node, Region]:
    """First node of each region -> the region, for `config` (empty when nothing matches)."""
    runs: list[tuple[tuple[str, str], list[torch.fx.Node]]] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            key = None
        else:
            key = _origin_and_policy(node, config)
        if key is not None and key[1] == "none":
            key = None
        if key is None:
            runs.append((None, [node]))
        elif runs and runs[-1][0] == key:
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
    regions = {}
    for key, nodes in runs:
        if key is None:
            continue
        members = set(nodes)
        inputs = {}
        for node in nodes:
            for used in node.all_input_nodes:
                if used not in members:
                    inputs[used] = None
        outputs = [n for n in nodes if any(user not in members for user in n.users)]
        regions[nodes[0]] = Region(
            origin=key[0],
            policy=key[1],
            nodes=tuple(nodes),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
        )
    return regions


def checkpoint_policy(policy: str, origin: str) -> Callable | None:
    """The `jax.checkpoint` policy for a zerojax policy name (None: save nothing)."""
    if policy == "full":
        return None
    if policy == "save_dots":
        return jax.checkpoint_policies.dots_saveable
    if policy == "offload":
        kinds = jax.devices()[0].addressable_memories()
        if not any(memory.kind == "pinned_host" for memory in kinds):
            raise ValueError(
                f"activation checkpointing policy 'offload' for {origin}: this backend has no "
                f"pinned_host memory (memories: {', '.join(m.kind for m in kinds)}); use "
                f"'full' or 'save_dots'"
            )
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise ValueError(f"unknown activation checkpointing policy {policy!r} for {origin}")
