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

__all__ = ["CHECKPOINT_TAG", "Region", "checkpoint_policy", "find_gather_regions", "find_regions"]

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


def find_gather_regions(
    graph: torch.fx.Graph,
    params: dict[torch.fx.Node, str],
    regather: frozenset[str],
    constants: set[torch.fx.Node],
    configured: dict[torch.fx.Node, Region],
) -> dict[torch.fx.Node, Region]:
    """ZeRO-3's reshard after forward, as FSDP does it: each op that reads a parameter named in
    `regather` (directly, or through ops on parameters alone: a linear layer's `t` of its
    weight) -> a region of that op and those ops, policy `full`, keyed by the op.

    The parameter's all-gather happens where an op reads it (`GraphFunction.__call__`'s
    `param_use`), so inside the region: the backward pass keeps the region's inputs (the shard
    and the op's activations) and gathers again when it reaches the op, instead of keeping
    every gathered weight from the forward pass on (which an op that differentiates through its
    weight, a matmul or a convolution, otherwise does: the whole model on every device). What
    the backward pass recomputes is the gather, the ops on the weight, and whatever of the op
    its own backward needs (a normalization's statistics; a matmul's product is not needed).
    Ops inside a configured region (`configured`, from `find_regions`) are left to it: it
    recomputes their gathers already."""
    in_configured = {node for region in configured.values() for node in region.nodes}
    # Nodes computed from parameters (and constants) alone, with the regathered parameters
    # each depends on.
    derived: dict[torch.fx.Node, set[str]] = {}
    regions = {}
    for node in graph.nodes:
        if node.op != "call_function" or node in in_configured:
            continue
        inputs = node.all_input_nodes
        on_params = [n for n in inputs if n in params or n in derived]
        if not on_params:
            continue
        names = set()
        for n in on_params:
            names |= ({params[n]} & regather) if n in params else derived[n]
        if all(n in params or n in derived or n in constants for n in inputs):
            derived[node] = names
            continue
        if not names:
            continue
        chain: dict[torch.fx.Node, None] = {}
        stack = [n for n in on_params if n in derived]
        while stack:
            n = stack.pop()
            if n not in chain:
                chain[n] = None
                stack.extend(m for m in n.all_input_nodes if m in derived)
        members = sorted(chain, key=_graph_position(graph)) + [node]
        member_set = set(members)
        outside = {}
        for member in members:
            for used in member.all_input_nodes:
                if used not in member_set:
                    outside[used] = None
        regions[node] = Region(
            origin=f"ZeRO-3 gather for {node.name}",
            policy="full",
            nodes=tuple(members),
            inputs=tuple(outside),
            outputs=(node,),
        )
    return regions


def _graph_position(graph: torch.fx.Graph) -> Callable[[torch.fx.Node], int]:
    position = {node: i for i, node in enumerate(graph.nodes)}
    return position.__getitem__
