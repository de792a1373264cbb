"""Make the containers a torch module returns (Hugging Face ModelOutput, ...) JAX pytrees.

`apply` rebuilds the module's output with torch's pytree spec, so JAX must be able to flatten the
same containers for `jax.jit`/`jax.grad` to return them. Any container type torch's pytree knows
and JAX does not is registered with JAX once, reusing torch's flatten/unflatten functions.

torch's spec names every namedtuple class by the one pseudo-type `collections.namedtuple` (the
class itself is the node's context); JAX flattens namedtuples natively, so those need nothing.
"""

from __future__ import annotations

import collections

import jax
import torch.utils._pytree as torch_pytree

_JAX_NATIVE = (tuple, list, dict, type(None))
_registered: set[type] = set()


class _Context:
    """Hashable wrapper of torch's pytree context (JAX compares and hashes treedef aux data)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Context) and self.value == other.value

    def __hash__(self):
        return hash(repr(self.value))


def register_output_types(spec: torch_pytree.TreeSpec) -> None:
    """Register with JAX every container type in a torch pytree spec that JAX does not know."""
    node_type = spec.type
    if node_type is not None and node_type is not collections.namedtuple:
        register_with_jax(node_type)
    for child in spec.children():
        register_output_types(child)


def register_with_jax(node_type: type) -> None:
    """Make a type registered with torch's pytree a JAX pytree node too (idempotent)."""
    if node_type in _JAX_NATIVE or node_type in _registered:
        return
    _registered.add(node_type)
    if _is_jax_pytree_node(node_type):
        return  # namedtuples, OrderedDict, defaultdict, ... JAX already knows.
    node = torch_pytree.SUPPORTED_NODES[node_type]

    def flatten(value):
        children, context = node.flatten_fn(value)
        return children, _Context(context)

    def unflatten(context, children):
        return node.unflatten_fn(list(children), context.value)

    jax.tree_util.register_pytree_node(node_type, flatten, unflatten)


def _is_jax_pytree_node(node_type: type) -> bool:
    if issubclass(node_type, tuple) and hasattr(node_type, "_fields"):
        return True
    return node_type in (collections.OrderedDict, collections.defaultdict, collections.deque)
