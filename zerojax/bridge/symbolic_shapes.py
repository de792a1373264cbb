"""Symbolic input shapes: one torch.export capture that serves many input shapes.

A model fed batches of varying length (the Hugging Face Trainer's default collator pads each
batch to its longest row) would otherwise be captured by torch.export once per length. Instead
(`bridge.convert.Converted`), the first shape is captured as it is; when a second shape of the
same inputs arrives, the dims that changed between them are captured as symbols (torch.export's
`Dim.AUTO`), and that one capture serves every later shape it admits. The lowering specialises:
the interpreter binds each symbol to the concrete size of the array it is read from (`bind`),
so `sym_size` nodes and the recorded shapes the lowerings read (`concrete`) are plain ints at
trace time, and XLA compiles one program per shape as before: a new shape costs XLA only.

Which shapes a capture admits is torch.export's own contract for an exported program
(`ShapeGuards`): every dim torch recorded as an integer must be equal (`Dim.AUTO` specialises a
dim the model's code guarded on a value, and torch's 0/1 specialisation keeps sizes 0 and 1
out of any symbol), one symbol read from several inputs must be one size, each symbol must lie
in the program's `range_constraints`, and the shape checks torch deferred to run time
(`_assert_scalar` nodes on sizes, collected before zerojax drops the graph's assertions) must
hold for the bound sizes. A shape that fails any of them is captured again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.utils._pytree as torch_pytree
from torch.export import Dim, ShapesCollection
from torch.export.graph_signature import InputKind
from torch.utils._sympy.numbers import int_oo

from zerojax.bridge.value_inputs import input_key

Sizes = Mapping[sympy.Symbol, int]


def dynamic_shapes(args: tuple, kwargs: dict, dims: Mapping[str, Sequence[int]]):
    """torch.export's `dynamic_shapes` for (args, kwargs): the dims `dims[key]` of the tensor
    input named `key` (`value_inputs.input_key`) as `Dim.AUTO`, every other dim static."""
    collection = ShapesCollection()
    for path, leaf in torch_pytree.tree_flatten_with_path((args, kwargs))[0]:
        wanted = dims.get(input_key(path))
        if wanted and isinstance(leaf, torch.Tensor):
            collection[leaf] = dict.fromkeys(wanted, Dim.AUTO)
    return collection


def input_shapes(args: tuple, kwargs: dict) -> dict[str, tuple[int, ...] | None]:
    """{input key: shape} of each leaf of (args, kwargs); None for a leaf that is no array."""
    return {
        input_key(path): tuple(leaf.shape) if hasattr(leaf, "shape") else None
        for path, leaf in torch_pytree.tree_flatten_with_path((args, kwargs))[0]
    }


def changed_dims(seen: Sequence[Mapping[str, tuple | None]]) -> dict[str, tuple[int, ...]]:
    """{input key: dims} where the shapes `seen` (`input_shapes` of calls whose inputs have one
    structure) differ."""
    changed: dict[str, tuple[int, ...]] = {}
    for key, first in seen[0].items():
        if first is None:
            continue
        dims = tuple(d for d in range(len(first)) if len({s[key][d] for s in seen}) > 1)
        if dims:
            changed[key] = dims
    return changed


def describe_dims(changed: Mapping[str, Sequence[int]]) -> str:
    """`input_ids` dim 1, `labels` dim 1: the changed dims named for a message."""
    return ", ".join(
        f"{key!r} dim{'s' if len(dims) > 1 else ''} {', '.join(map(str, dims))}"
        for key, dims in changed.items()
    )


def shape_assertions(graph: torch.fx.Graph) -> tuple[sympy.Basic, ...]:
    """Every condition on input sizes the capture assumed, as sympy expressions: the guards
    torch's shape environment recorded while it traced (`x.shape[1] % 4 == 0` in the model's
    Python: with `Dim.AUTO` torch keeps such a guard there and exports neither it nor an
    error, so the program's `range_constraints` alone would admit sizes it is wrong for), and
    the checks it deferred to run time (`_assert_scalar` nodes, `deferred_runtime_asserts`).
    Conditions on values (unbacked symbols, `u0`) are not shape conditions and are left out.
    Called before the graph's assertions are dropped (`assertions.py`)."""
    found: list[sympy.Basic] = []
    shape_env = _shape_env(graph)
    if shape_env is not None:
        found.extend(guard.expr for guard in shape_env.guards)
        for asserts in shape_env.deferred_runtime_asserts.values():
            found.extend(a.expr for a in asserts)
    for node in graph.nodes:
        if node.target is not torch.ops.aten._assert_scalar.default:
            continue
        condition = node.args[0]
        value = condition.meta.get("val") if isinstance(condition, torch.fx.Node) else condition
        if isinstance(value, torch.SymBool):
            found.append(value.node.expr)
    kept = []
    for expr in found:
        # In the symbols the program's shapes are written in: sizes torch found equal (an
        # attention mask's length and the ids') were unified after the guard was recorded.
        expr = sympy.sympify(shape_env.simplify(expr) if shape_env is not None else expr)
        symbols = expr.free_symbols
        if symbols and not any(map(_unbacked, symbols)) and expr not in kept:
            kept.append(expr)
    return tuple(kept)


def _shape_env(graph: torch.fx.Graph):
    for node in graph.nodes:
        value = node.meta.get("val")
        fake_mode = getattr(value, "fake_mode", None)
        if fake_mode is not None and fake_mode.shape_env is not None:
            return fake_mode.shape_env
    return None


def _unbacked(symbol: sympy.Symbol) -> bool:
    return str(symbol).startswith("u")


def is_symbolic(exported: torch.export.ExportedProgram) -> bool:
    """Whether any user input of the program has a symbolic dim."""
    return any(
        not isinstance(d, int) and not _constant(d)
        for shape in _input_shapes(exported)
        if shape is not None
        for d in shape
    )


@dataclasses.dataclass(frozen=True)
class ShapeGuards:
    """The input shapes one exported program admits (module docstring): per user input, its
    recorded dims (ints, or sympy expressions over the input symbols), the symbols' ranges and
    the deferred size checks."""

    shapes: tuple[tuple[Any, ...] | None, ...]
    ranges: tuple[tuple[sympy.Symbol, int, float], ...]
    assertions: tuple[sympy.Basic, ...]

    @classmethod
    def of(cls, exported: torch.export.ExportedProgram, assertions=()) -> ShapeGuards:
        shapes = tuple(
            None if shape is None else tuple(_dim_expr(d) for d in shape)
            for shape in _input_shapes(exported)
        )
        ranges = tuple(
            (symbol, _bound_of(r.lower), _bound_of(r.upper))
            for symbol, r in exported.range_constraints.items()
            if isinstance(symbol, sympy.Symbol)
        )
        return cls(shapes, ranges, tuple(assertions))

    def bind(self, leaf_shapes: Sequence[tuple | None]) -> dict[sympy.Symbol, int] | None:
        """symbol -> size for these user-input shapes, or None where the program does not admit
        them (a static dim differs, one symbol two sizes, a range or a deferred check fails)."""
        if len(leaf_shapes) != len(self.shapes):
            return None
        sizes: dict[sympy.Symbol, int] = {}
        pending = []
        for recorded, actual in zip(self.shapes, leaf_shapes, strict=True):
            if recorded is None or actual is None:
                if (recorded is None) != (actual is None):
                    return None
                continue
            if len(recorded) != len(actual):
                return None
            for dim, size in zip(recorded, actual, strict=True):
                if isinstance(dim, int):
                    if dim != size:
                        return None
                elif isinstance(dim, sympy.Symbol):
                    if sizes.setdefault(dim, int(size)) != size:
                        return None
                else:
                    pending.append((dim, size))
        for symbol, lower, upper in self.ranges:
            if symbol in sizes and not lower <= sizes[symbol] <= upper:
                return None
        for dim, size in pending:  # a dim recorded as an expression of the symbols (2 * s0)
            if dim.free_symbols - sizes.keys() or int(dim.xreplace(sizes)) != size:
                return None
        for check in self.assertions:
            if check.free_symbols - sizes.keys() or not bool(check.xreplace(sizes)):
                return None
        return sizes


def bind(graph_inputs: Sequence[tuple[Any, Any]]) -> dict[sympy.Symbol, int]:
    """symbol -> size from (recorded FakeTensor, actual array) pairs of a graph's user inputs:
    what `concrete` evaluates recorded shapes with while the graph is lowered."""
    sizes: dict[sympy.Symbol, int] = {}
    for recorded, actual in graph_inputs:
        if not isinstance(recorded, torch.Tensor) or not hasattr(actual, "shape"):
            continue
        for dim, size in zip(recorded.shape, actual.shape, strict=False):
            expr = _dim_expr(dim)
            if isinstance(expr, sympy.Symbol):
                sizes[expr] = int(size)
    return sizes


def concrete(dim, sizes: Sizes) -> int:
    """A recorded dim (int or SymInt) as the int it is for the bound `sizes`; never the example
    size torch traced with (`int()` of a SymInt would silently give that)."""
    expr = _dim_expr(dim)
    if isinstance(expr, int):
        return expr
    value = sympy.sympify(expr.xreplace(sizes))
    if value.free_symbols:
        raise ValueError(
            f"recorded size {expr} depends on {sorted(map(str, value.free_symbols))}, which no "
            f"input of the graph binds"
        )
    return int(value)


def _bound_of(value) -> float:
    """A range bound as a number: torch's `int_oo` (and sympy's oo) as math.inf."""
    if value in (int_oo, -int_oo, sympy.oo, -sympy.oo):
        return math.inf if value > 0 else -math.inf
    return int(value)


def _dim_expr(dim):
    if isinstance(dim, int):
        return dim
    if isinstance(dim, torch.SymInt):
        if dim.node.is_constant():
            return int(dim)
        expr = dim.node.expr
        return int(expr) if expr.is_Integer else expr
    return dim


def _constant(dim) -> bool:
    return isinstance(dim, torch.SymInt) and dim.node.is_constant()


def _input_shapes(exported: torch.export.ExportedProgram) -> list[tuple | None]:
    """The recorded shape of each user input in graph order (None for a non-tensor input)."""
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    shapes = []
    for spec, node in zip(exported.graph_signature.input_specs, placeholders, strict=True):
        if spec.kind != InputKind.USER_INPUT:
            continue
        value = node.meta.get("val")
        shapes.append(tuple(value.shape) if isinstance(value, torch.Tensor) else None)
    return shapes
