"""Integer inputs whose *values* decide shapes: traced as constants, the program keyed by them.

Qwen2-VL's vision tower splits its patches with `torch.split(x, lengths.tolist())`, the lengths
computed from the input `image_grid_thw`, and its M-RoPE positions walk `mm_token_type_ids` in
Python. torch.export traces values symbolically, so such a host read of an input's values is a
data-dependent guard it cannot capture. Plain PyTorch runs the same code on every call; the
equivalent here is a program specialised on those values, recaptured when they change, as a
program is already specialised on input shapes.

How: the specialised inputs enter `torch.export` as `ValueKnown` tensors, a pytree node with no
leaves whose *value* is its context (so the exported program has no input for it, and its value
is part of the program's input spec, hence its cache key). While export runs, `FoldConstants`
evaluates eagerly, on real data, every torch call whose tensor arguments are all value-known
(factories included: `torch.arange(h)` with a host int `h`), so `.tolist()` and `.item()` return
real numbers; a value-known tensor that meets a traced one becomes a constant of the graph.
Random ops are never folded (their draw would be baked in), nor `empty` (its memory is filled
afterwards, often with traced values); an in-place write of traced values into a value-known
tensor cannot be folded and fails the capture.

Which inputs: `find_host_read_inputs` runs the same capture with every integer input
value-known, each tagged with its name, and reports the inputs whose values reached a host read
(`tolist`, `item`, `bool`, `int`, ...) or an op whose output shape depends on values (`nonzero`,
`repeat_interleave`, boolean indexing). `zerojax.convert` does this only after a plain capture
failed on a data-dependent guard; token ids that only feed an embedding stay ordinary inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.utils._pytree as torch_pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten

# Tensor methods that hand a tensor's values to Python.
_HOST_READS = frozenset(
    {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
        torch.Tensor.__float__,
        torch.Tensor.numpy,
    }
)
_IN_PLACE_DUNDERS = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    }
)
_UNINITIALISED = ("empty", "new_empty")
# Advanced indexing is shape-dynamic only with boolean masks; integer indices keep shapes.
_INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default)


class ValueKnown(torch.Tensor):
    """A real tensor whose values the capture may read; `sources` names the inputs it came from."""

    sources: frozenset[str] = frozenset()

    def __repr__(self):
        with _eager():
            return f"ValueKnown({torch.Tensor.__repr__(self.as_subclass(torch.Tensor))})"


def value_known(tensor: torch.Tensor, sources: Iterable[str] = ()) -> ValueKnown:
    with _eager():
        known = tensor.detach().as_subclass(torch.Tensor).clone().as_subclass(ValueKnown)
    known.sources = frozenset(sources)
    return known


def _flatten(known: ValueKnown):
    """No leaves: the value is the context (and so part of every spec and cache key)."""
    with _eager():
        plain = known.as_subclass(torch.Tensor)
        values = tuple(plain.flatten().tolist())
    return [], (plain.dtype, tuple(plain.shape), values, tuple(sorted(known.sources)))


def _unflatten(children, context) -> ValueKnown:
    dtype, shape, values, sources = context
    with _eager():
        tensor = torch.tensor(values, dtype=dtype).reshape(shape)
    return value_known(tensor, sources)


torch_pytree.register_pytree_node(
    ValueKnown,
    _flatten,
    _unflatten,
    serialized_type_name="zerojax.ValueKnown",
    flatten_with_keys_fn=_flatten,
)


class _NotFoldable(Exception):
    pass


@contextlib.contextmanager
def _eager():
    """Plain eager torch: no torch-function handlers, no dispatch modes (fake, proxy)."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


class _WatchFoldedOps(TorchDispatchMode):
    """Refuses random ops (their draw would be baked in); notes shape-dynamic ones."""

    def __init__(self):
        super().__init__()
        self.reads_values = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tags = getattr(func, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            raise _NotFoldable(str(func))
        if func in _INDEXING:
            indices = args[1] if len(args) > 1 else ()
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.reads_values = True
        elif torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags:
            self.reads_values = True
        return func(*args, **kwargs)


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _plain(x):
    return x.as_subclass(torch.Tensor) if isinstance(x, ValueKnown) else x


def _writes_in_place(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    in_place = name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))
    target = args[0] if args else None
    return (in_place and isinstance(target, ValueKnown)) or isinstance(
        kwargs.get("out"), ValueKnown
    )


class FoldConstants(TorchFunctionMode):
    """Evaluates torch calls on value-known tensors eagerly during a capture (module docstring).

    `host_reads` collects the `sources` of every value-known tensor whose values were read.
    """

    def __init__(self):
        super().__init__()
        self.host_reads: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = torch_pytree.tree_flatten((args, kwargs), is_leaf=_is_tensor)
        known = [x for x in flat if isinstance(x, ValueKnown)]
        foldable = all(isinstance(x, ValueKnown) for x in flat if _is_tensor(x))
        # Uninitialised memory is filled afterwards, often with traced values: keep it traced.
        if foldable and not getattr(func, "__name__", "").startswith(_UNINITIALISED):
            sources = frozenset().union(*(x.sources for x in known))
            plain_args, plain_kwargs = torch_pytree.tree_unflatten([_plain(x) for x in flat], spec)
            watch = _WatchFoldedOps()
            try:
                with _eager(), watch:
                    out = func(*plain_args, **plain_kwargs)
            except _NotFoldable:
                pass  # traced below, like any op on constants
            else:
                if func in _HOST_READS or watch.reads_values:
                    self.host_reads |= sources
                return torch_pytree.tree_map_only(
                    torch.Tensor,
                    lambda t: value_known(t, sources) if type(t) is torch.Tensor else t,
                    out,
                )
        if _writes_in_place(func, args, kwargs):
            raise RuntimeError(
                f"{getattr(func, '__name__', func)} writes traced values into a tensor computed "
                f"from input values the model reads on the host; zerojax cannot specialise on "
                f"those inputs"
            )
        # Mixed with traced tensors: the value-known ones enter the graph as constants (a copy,
        # not a view of the eager result, which export could not lift).
        with _eager():
            flat = [_plain(x).clone() if isinstance(x, ValueKnown) else x for x in flat]
        plain_args, plain_kwargs = torch_pytree.tree_unflatten(flat, spec)
        return func(*plain_args, **plain_kwargs)


def reads_values_on_host(graph: torch.fx.Graph) -> bool:
    """Whether a captured graph turns a tensor's values into Python numbers (`item()`), which a
    jitted program cannot do."""
    host_reads = (aten._local_scalar_dense.default, aten.item.default)
    return any(node.target in host_reads for node in graph.nodes)


def integer_inputs(args: tuple, kwargs: dict) -> dict[str, int]:
    """Key (`input_key`) -> number of elements of the integer and boolean tensors among the
    inputs, in input order."""
    flat, _ = torch_pytree.tree_flatten_with_path((args, kwargs))
    return {
        input_key(path): leaf.numel()
        for path, leaf in flat
        if isinstance(leaf, torch.Tensor) and not leaf.is_floating_point() and not leaf.is_complex()
    }


def input_key(path) -> str:
    """A readable, stable name for an input leaf: `image_grid_thw`, `args[0]`, `x['a']`."""
    text = torch_pytree.keystr(path)
    if text.startswith("[1]['"):  # a keyword argument: its own name
        return text[5:].replace("']", "", 1)
    if text.startswith("[0]"):
        return "args" + text[3:]
    return text


def mark_value_known(args: tuple, kwargs: dict, keys: Iterable[str], *, tag: bool = False):
    """(args, kwargs) with the tensors named by `keys` as `ValueKnown` (tagged with their key)."""
    keys = frozenset(keys)
    flat, spec = torch_pytree.tree_flatten_with_path((args, kwargs))
    leaves = []
    for path, leaf in flat:
        key = input_key(path)
        if key in keys and isinstance(leaf, torch.Tensor):
            leaf = value_known(leaf, (key,) if tag else ())
        leaves.append(leaf)
    return torch_pytree.tree_unflatten(leaves, spec)


def drop_value_known_leaves(args: tuple, kwargs: dict, keys: frozenset[str]) -> list:
    """The leaves of (args, kwargs) an exported program takes: those not named by `keys`."""
    flat, _ = torch_pytree.tree_flatten_with_path((args, kwargs))
    return [leaf for path, leaf in flat if input_key(path) not in keys]
