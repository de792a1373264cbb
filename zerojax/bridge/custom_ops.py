"""Custom `torch.library` ops at capture: keep the lowered ones whole, decompose the others.

An op outside ATen reaches the interpreter only if something lowers it. zerojax gives a custom
op three chances, in this order:

1. A lowering registered with `zerojax.register_lowering` (or built in, e.g. transformers'
   grouped GEMM): the op is taken out of the decomposition table so it stays whole.
2. A CompositeImplicitAutograd kernel: torch's `run_decompositions` already traces through it.
3. A Python implementation registered for CompositeExplicitAutograd or CPU (what
   `torch.library.custom_op(...)` registers its function as, or `Library.impl(..., "CPU")`):
   that kernel is called on export's tracing tensors, which records the ATen ops it runs.
   Implementations that read tensor values (`.tolist()`, `.item()` to drive Python control flow)
   cannot be traced to one static program; such ops keep their node, annotated with the reason
   (`NO_DECOMPOSITION`), and the interpreter's missing-lowering error reports it.

Gradients of a decomposed op come from JAX differentiating the ATen ops it traced to; its torch
autograd formula (`register_autograd`) is not used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from zerojax.bridge.registry import get_lowering, kept_whole_overloads

# node.meta key: why a custom op without a lowering could not be decomposed.
NO_DECOMPOSITION = "zerojax_no_decomposition"

# Namespaces whose ops the built-in table covers or torch decomposes itself.
_CORE_NAMESPACES = ("aten", "prims", "prim")

# Kernels that hold an op's real (not fake) implementation, tried in order.
_IMPLEMENTATION_KEYS = ("CompositeExplicitAutograd", "CPU")

# Each round decomposes the custom ops found so far; an implementation may itself call custom
# ops, found in the next round. A bound keeps a self-referential registration from looping.
_MAX_ROUNDS = 8


def without_kept_whole(table):
    """The decomposition table minus every op registered through `register_lowering`."""
    kept = kept_whole_overloads()
    if not kept:
        return table
    table = table.copy()
    for op in kept:
        table.pop(op, None)
    return table


def python_implementation(op: torch._ops.OpOverload) -> Callable | None:
    """A callable running `op`'s real implementation (to trace into ATen), or None."""
    name = op._schema.name
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
        return op.decompose
    for key in _IMPLEMENTATION_KEYS:
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
            return functools.partial(op._op_dk, getattr(torch._C.DispatchKey, key))
    return None


def decompose_unlowered(exported: torch.export.ExportedProgram, table):
    """`exported` with every unlowered custom op traced through its Python implementation.

    Ops that cannot be decomposed stay in the graph with `node.meta[NO_DECOMPOSITION]` set.
    """
    attempted: set[torch._ops.OpOverload] = set()
    reasons: dict[torch._ops.OpOverload, str] = {}
    for _ in range(_MAX_ROUNDS):
        pending = [op for op in _unlowered_custom_ops(exported.graph) if op not in attempted]
        if not pending:
            break
        for op in pending:
            attempted.add(op)
            implementation = python_implementation(op)
            if implementation is None:
                reasons[op] = (
                    "it has no Python implementation to decompose through (no "
                    "CompositeImplicitAutograd, CompositeExplicitAutograd or CPU kernel)"
                )
                continue
            with_op = table.copy()
            with_op[op] = implementation
            try:
                exported = exported.run_decompositions(with_op)
            # Any failure to trace (torch raises many types) means "keep the node, say why".
            except Exception as error:  # noqa: BLE001
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
                reasons[op] = (
                    f"tracing its Python implementation failed ({type(error).__name__}: "
                    f"{first_line}); implementations that read tensor values (.tolist(), "
                    f".item()) cannot become one static program"
                )
    for node in exported.graph.nodes:
        if node.op == "call_function" and node.target in reasons:
            node.meta[NO_DECOMPOSITION] = reasons[node.target]
    return exported


def is_custom(target) -> bool:
    """Whether a graph target is an op overload from outside ATen / prims."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in _CORE_NAMESPACES


def _unlowered_custom_ops(graph: torch.fx.Graph) -> list[torch._ops.OpOverload]:
    found = {}
    for node in graph.nodes:
        target = node.target
        if node.op == "call_function" and is_custom(target) and get_lowering(target) is None:
            found.setdefault(target, None)
    return list(found)
