"""Hugging Face KV caches as pytrees, for torch.export and for JAX.

A `transformers` causal LM returns its KV cache (`DynamicCache`; T5/Whisper an
`EncoderDecoderCache` of two) with its default config, and takes one back as `past_key_values`
for the next generation step. A cache is a plain Python object: a list of layers, each holding
key/value tensors next to static fields (`is_initialized`, `dtype`, `sliding_window`, ...).
Neither torch.export nor JAX can see into such an object, so every cache class is registered
here as a pytree node with one generic rule: walk the object's `__dict__` (and the lists, tuples
and dicts in it); array values are the leaves, everything else (ints, bools, dtypes, devices,
classes) is static structure. So the same flatten serves torch tensors (export), `jax.Array`
and tracers (`apply` under `jax.jit`), and any static field is part of the trace-cache key.

The rule is generic rather than a list of known classes: every `transformers.cache_utils.Cache`
subclass (DynamicCache, StaticCache, EncoderDecoderCache, QuantizedCache, ..., with their
full, sliding-window, linear-attention and indexed layers) and the model-specific `*Cache`
classes beside a model (transformers' own export rule, `is_cache_class`) are registered.

`transformers` is an optional dependency: nothing here imports it unless the user already has.
"""

from __future__ import annotations

import enum
import re
import sys
import weakref
from typing import Any

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree

from zerojax.bridge.output_tree import register_with_jax

# Leaf values: what flows through a converted program (torch at capture, JAX at apply time).
_ARRAY_TYPES = (torch.Tensor, jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
# Static values: kept in the pytree context, so a change retraces instead of being traced.
_STATIC_TYPES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, type)

_registered: set[type] = set()
# Rebuilt object id -> paths that were leaves when it was rebuilt (see `_remember_leaf_slots`).
_leaf_slots: dict[int, frozenset[tuple]] = {}


def register_cache_pytrees(module: torch.nn.Module | None = None) -> None:
    """Register every `transformers` cache class as a torch and a JAX pytree node.

    Cheap and idempotent: capture calls it before every export. Classes defined after an earlier
    call (a model file imported later) are picked up by the next one. Without `transformers`
    imported there is nothing a model could return, so nothing is done.
    """
    if "transformers" not in sys.modules:
        return
    from transformers import cache_utils

    candidates = list(_subclasses(cache_utils.Cache))
    if module is not None:
        # Model-specific caches that do not subclass Cache (transformers' own rule for export:
        # a class named *Cache defined in the model's modeling file).
        model_file = sys.modules.get(type(module).__module__)
        for value in vars(model_file).values() if model_file is not None else ():
            if (
                isinstance(value, type)
                and value.__module__ == type(module).__module__
                and value.__name__.endswith("Cache")
                and not issubclass(value, torch.nn.Module)
            ):
                candidates.append(value)
    for cache_type in candidates:
        if cache_type not in _registered:
            _register(cache_type)


def is_cache(value: Any) -> bool:
    """Whether `value` is an object of a registered cache class."""
    return type(value) in _registered


def drop_caches(tree: Any) -> Any:
    """`tree` with every cache object replaced by None (a ModelOutput field then reads None)."""
    if not _registered:
        return tree
    return torch_pytree.tree_map(lambda x: None if is_cache(x) else x, tree, is_leaf=is_cache)


def contains_cache(tree: Any) -> bool:
    """Whether any node of `tree` (a call's args and kwargs) is a cache object."""
    if not _registered:
        return False
    return any(is_cache(x) for x in torch_pytree.tree_leaves(tree, is_leaf=is_cache))


def _subclasses(cls: type):
    for subclass in cls.__subclasses__():
        yield subclass
        yield from _subclasses(subclass)


def _register(cache_type: type) -> None:
    _registered.add(cache_type)
    if cache_type not in torch_pytree.SUPPORTED_NODES:
        torch_pytree.register_pytree_node(
            cache_type,
            flatten_cache,
            unflatten_cache,
            serialized_type_name=f"{cache_type.__module__}.{cache_type.__qualname__}",
            flatten_with_keys_fn=_flatten_cache_with_keys,
        )
    # else: someone (transformers' own exporter, the user) registered it first; theirs is kept
    # for torch and JAX reuses it, as for any other container type.
    register_with_jax(cache_type)


# --- the generic flatten -------------------------------------------------------------------
#
# Context nodes are nested tuples (hashable, comparable: torch compares specs, JAX hashes aux):
#   ("leaf",)  ("static", value)  ("list"|"tuple", (child, ...))  ("dict", ((key, child), ...))
#   ("object", cls, ((attribute, child), ...))

_LEAF = ("leaf",)


def flatten_cache(cache: Any) -> tuple[list, tuple]:
    leaves: list = []
    context = _flatten_object(cache, leaves, where=type(cache).__name__)
    return leaves, context


def _flatten_cache_with_keys(cache: Any):
    leaves, context = flatten_cache(cache)
    # torch.export names graph inputs after these keys and wants identifiers: layers_0_keys.
    names = [re.sub(r"\W+", "_", name).strip("_") for name in _leaf_names(context, "")]
    return [(torch_pytree.GetAttrKey(n), leaf) for n, leaf in zip(names, leaves)], context


def unflatten_cache(leaves, context: tuple) -> Any:
    leaves = iter(leaves)
    value = _unflatten(context, leaves)
    assert next(leaves, None) is None, "more cache leaves than the context has slots"
    return value


def _flatten_object(obj, leaves: list, where: str) -> tuple:
    slots = _leaf_slots.get(id(obj), frozenset())
    fields = tuple(
        (name, _flatten_value(value, leaves, f"{where}.{name}", (name,), slots))
        for name, value in vars(obj).items()
    )
    return ("object", type(obj), fields)


def _flatten_value(value, leaves: list, where: str, path: tuple, slots: frozenset) -> tuple:
    if path in slots or isinstance(value, _ARRAY_TYPES):
        leaves.append(value)
        return _LEAF
    if isinstance(value, _STATIC_TYPES + (enum.Enum, torch.Size)):
        return ("static", value)
    if type(value) in (list, tuple):
        children = tuple(
            _flatten_value(v, leaves, f"{where}[{i}]", (*path, i), slots)
            for i, v in enumerate(value)
        )
        return (type(value).__name__, children)
    if type(value) is dict:
        children = tuple(
            (k, _flatten_value(v, leaves, f"{where}[{k!r}]", (*path, k), slots))
            for k, v in value.items()
        )
        return ("dict", children)
    if (
        hasattr(value, "__dict__")
        and not callable(value)
        and not isinstance(value, torch.nn.Module)
    ):
        return _flatten_object(value, leaves, where)  # a cache layer, a nested cache
    raise ValueError(
        f"zerojax cannot carry the cache field {where} ({type(value).__name__}) through a "
        f"converted program: a cache may hold tensors, Python scalars, dtypes/devices and "
        f"lists, tuples, dicts or objects of those"
    )


def _unflatten(context: tuple, leaves) -> Any:
    kind = context[0]
    if kind == "leaf":
        return next(leaves)
    if kind == "static":
        return context[1]
    if kind == "list":
        return [_unflatten(c, leaves) for c in context[1]]
    if kind == "tuple":
        return tuple(_unflatten(c, leaves) for c in context[1])
    if kind == "dict":
        return {k: _unflatten(c, leaves) for k, c in context[1]}
    assert kind == "object", kind
    cls, fields = context[1], context[2]
    obj = cls.__new__(cls)  # no __init__: every attribute is restored as it was flattened
    for name, child in fields:
        obj.__dict__[name] = _unflatten(child, leaves)
    _remember_leaf_slots(obj, fields)
    return obj


def _remember_leaf_slots(obj, fields) -> None:
    """Remember which attributes of a rebuilt object are leaves, whatever they now hold.

    JAX rebuilds a cache with any values in its leaf slots (`jax.tree.map(lambda _: False, out)`
    puts bools there); flattening it again must give back the same slots, not read a bool as
    static structure.
    """
    paths = frozenset(_leaf_paths(fields))
    if not paths:
        return
    key = id(obj)
    try:
        weakref.finalize(obj, _leaf_slots.pop, key, None)
    except TypeError:  # a class with __slots__ and no weakref support: nothing to remember by
        return
    _leaf_slots[key] = paths


def _leaf_paths(fields, prefix=()):
    for name, child in fields:
        yield from _child_leaf_paths(child, (*prefix, name))


def _child_leaf_paths(child, path):
    kind = child[0]
    if kind == "leaf":
        yield path
    elif kind in ("list", "tuple"):
        for i, c in enumerate(child[1]):
            yield from _child_leaf_paths(c, (*path, i))
    elif kind == "dict":
        for k, c in child[1]:
            yield from _child_leaf_paths(c, (*path, k))
    # nested objects remember their own slots


def _leaf_names(context: tuple, where: str) -> list[str]:
    """Readable key paths of the leaves ('DynamicCache.layers[0].keys'), in flatten order."""
    kind = context[0]
    if kind == "leaf":
        return [where]
    if kind in ("list", "tuple"):
        return [n for i, c in enumerate(context[1]) for n in _leaf_names(c, f"{where}[{i}]")]
    if kind == "dict":
        return [n for k, c in context[1] for n in _leaf_names(c, f"{where}[{k!r}]")]
    if kind == "object":
        return [n for name, c in context[2] for n in _leaf_names(c, f"{where}.{name}")]
    return []
