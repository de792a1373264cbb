"""One ATen call at a time on JAX arrays, through the lowering table: the bridge's eager mode.

The live tensors of a wrapped model (`zerojax.train.live_tensor`) run each torch op they meet on
the engine's sharded arrays. A call becomes a one-node FX graph -- placeholders carrying the
tensor arguments' meta tensors, the op node carrying torch's meta output -- evaluated by the
interpreter's own `_evaluate`, so a lowering sees exactly what it sees in a captured graph
(`ctx.node.args[i].meta["val"]`, `ctx.out_dtype`) and its result is conformed the same way. The
walk is jitted once per signature: the op, the non-tensor arguments (Python scalars are part of
the key, as they are constants of a captured graph) and each tensor's shape and dtype. Inputs'
shardings are JAX's business: a jitted call on ZeRO-sharded arrays runs on the shards. An op
that reads indices checks them as torch does and raises torch's error at the call
(`zerojax.bridge.index_bounds`). Live tensors mostly record calls rather than run them: a
recording traces each call's `run` into one program (`zerojax.train.deferred`), its result
shapes known from `output_avals`.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import torch
import torch.utils._pytree as torch_pytree
from jax.sharding import NamedSharding

from zerojax.bridge.index_bounds import IndexBounds, raise_if_out_of_range
from zerojax.bridge.interpreter import _evaluate
from zerojax.bridge.registry import LoweringContext

__all__ = [
    "EagerCall",
    "ScalarsMustBeConstant",
    "eager_call",
    "functional_of_out",
    "functional_variant",
    "meta_of",
]

# Distinct signatures kept compiled; beyond it the least recently used is dropped (a script
# whose Python scalars change every step -- a decay schedule -- would otherwise grow it forever).
_MAX_CACHED_CALLS = 1024


def meta_of(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `tensor`'s shape and dtype (contiguous: JAX values have no strides)."""
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")


class EagerCall:
    """One ATen overload on one signature, lowered and jitted.

    `meta_leaves` are the call's flattened (args, kwargs) with every tensor a meta tensor.
    The leaves at `traced_scalars` (Python floats) are inputs of the program, not constants.
    `dynamic` lists the positions whose values a call passes: tensors and traced scalars.
    """

    def __init__(
        self, op: torch._ops.OpOverload, spec, meta_leaves: list, traced_scalars=frozenset()
    ):
        self.op = op
        self.traced_scalars = traced_scalars
        args, kwargs = torch_pytree.tree_unflatten(meta_leaves, spec)
        with torch.no_grad():
            self.out_meta = op(*args, **kwargs)
        graph = torch.fx.Graph()
        graph_leaves, placeholders, self.dynamic = [], [], []
        for i, leaf in enumerate(meta_leaves):
            if isinstance(leaf, torch.Tensor) or i in traced_scalars:
                node = graph.placeholder(f"arg{i}")
                node.meta["val"] = leaf
                placeholders.append(node)
                graph_leaves.append(node)
                self.dynamic.append(i)
            else:
                graph_leaves.append(leaf)
        graph_args, graph_kwargs = torch_pytree.tree_unflatten(graph_leaves, spec)
        node = graph.call_function(op, tuple(graph_args), dict(graph_kwargs))
        node.meta["val"] = self.out_meta
        self._placeholders, self._node = placeholders, node
        self.random = torch.Tag.nondeterministic_seeded in op.tags
        """Whether the op draws random numbers: only then is a key passed (making one per call
        costs more than most ops)."""
        self._program = jax.jit(self._run)
        self._collectives: dict[tuple, bool] = {}
        self._avals: list[jax.ShapeDtypeStruct] | None = None
        self.reads_indices = False
        """Whether the op checks indices (`zerojax.bridge.index_bounds`): known once
        `output_avals` has traced it."""
        self.serial = next(_serials)
        """A number no other call has: what a recording keys this call's computation by
        (cheaper to hash than the signature)."""

    def run(self, arrays: list, rng: jax.Array | None):
        """(The result, the index flag vector or None) for `arrays`, traceable: what a
        recording of live-tensor ops runs (`zerojax.train.deferred`)."""
        return self._run(arrays, rng)

    def output_avals(self, inputs: list) -> list[jax.ShapeDtypeStruct]:
        """Shapes and dtypes of the result's leaves for inputs shaped like `inputs` (arrays,
        values with `shape`/`dtype`, traced scalars), traced once. Raises
        `ScalarsMustBeConstant` as `__call__` does."""
        if self._avals is None:
            abstract = [
                x if isinstance(x, (bool, int, float)) else jax.ShapeDtypeStruct(x.shape, x.dtype)
                for x in inputs
            ]
            key = jax.random.key(0) if self.random else None
            try:
                out, flags = jax.eval_shape(self._run, abstract, key)
            except jax.errors.ConcretizationTypeError:
                if not self.traced_scalars:
                    raise
                _needs_constant_scalars.add(self.op)
                raise ScalarsMustBeConstant from None
            self._avals = jax.tree.leaves(out)
            self.reads_indices = flags is not None
        return self._avals

    def _run(self, arrays: list, rng: jax.Array | None):
        env = dict(zip(self._placeholders, arrays, strict=True))
        draws = itertools.count()

        def context(node):
            return LoweringContext(
                node=node,
                train=True,
                rng_for_site=lambda: jax.random.fold_in(rng, next(draws)),
            )

        # An index out of range raises torch's error (zerojax.bridge.index_bounds): the flags
        # leave the program beside its result.
        bounds = IndexBounds()
        value = _evaluate(
            self._node, env, context, lambda values, n, consumer=None: values[n], bounds
        )
        return value, bounds.packed()

    def __call__(self, arrays: list, rng: Callable[[], jax.Array]):
        """The lowering's result: an array, or a tuple/list of them (as the op returns).
        `rng()` makes a fresh key, called only for a random op.

        A program with collectives waits for its result. XLA:CPU runs
        each device's part of a program as a task on one shared thread pool, so independent
        programs with collectives in flight together (torch's clip_grad_norm_ issues one norm
        per gradient, none waiting for another) can each hold some of the threads at their
        rendezvous and wait for the others forever (seen with 8 simulated devices on 2 cores:
        "Expected 8 threads to join the rendezvous, but only 6 of them arrived"). One at a
        time, they cannot; programs without collectives never wait on each other."""
        key = rng() if self.random else None
        try:
            result, index_flags = self._program(arrays, key)
        except jax.errors.ConcretizationTypeError:
            if not self.traced_scalars:
                raise
            # The lowering needs the scalar's value (it branches on it): from now on this op's
            # scalars are constants, keyed by value (`eager_call` asks again).
            _needs_constant_scalars.add(self.op)
            raise ScalarsMustBeConstant from None
        if self._has_collectives(arrays, key):
            jax.block_until_ready(result)
        # An op that reads indices waits for its flags (one call at a time: eager index ops on
        # live tensors are rare, and torch raises at the op too).
        raise_if_out_of_range(index_flags)
        return result

    def _has_collectives(self, arrays: list, key) -> bool:
        """Whether the program compiled for these inputs' shardings communicates (read once
        per set of shardings from its HLO; elementwise ops on shards do not)."""
        placed = [a for a in arrays if isinstance(a, jax.Array)]  # not the traced scalars
        if not any(
            isinstance(a.sharding, NamedSharding) and a.sharding.mesh.size > 1 for a in placed
        ):
            return False
        shardings = tuple(a.sharding for a in placed)
        found = self._collectives.get(shardings)
        if found is None:
            text = self._program.lower(arrays, key).compile().as_text()
            found = any(op in text for op in _COLLECTIVE_OPS)
            self._collectives[shardings] = found
        return found


class ScalarsMustBeConstant(Exception):
    """Raised by a call whose Python scalars were traced but must be constants; the caller
    gets the call again from `eager_call` (keyed by the values now) and retries."""


aten = torch.ops.aten
# Arithmetic whose Python-float operands (an optimizer's step size, a bias correction, 1 - an
# EMA decay: new values every step) are program inputs, so a new value does not compile a new
# program. Other ops keep scalars as constants: their lowerings may need the value (pow's
# exponent, a norm's order).
_SCALAR_INPUT_OPS = frozenset(
    {
        aten.add.Tensor,
        aten.add.Scalar,
        aten.sub.Tensor,
        aten.sub.Scalar,
        aten.mul.Tensor,
        aten.mul.Scalar,
        aten.div.Tensor,
        aten.div.Scalar,
        aten.lerp.Scalar,
        aten.addcmul.default,
        aten.addcdiv.default,
    }
)
_needs_constant_scalars: set = set()
_TRACED = object()  # a traced scalar's place in a cache key

_COLLECTIVE_OPS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")

_calls: OrderedDict[Any, EagerCall] = OrderedDict()
_serials = itertools.count()


def traces_scalars(op) -> bool:
    """Whether `op`'s Python floats are program inputs (see `_SCALAR_INPUT_OPS`)."""
    return op in _SCALAR_INPUT_OPS and op not in _needs_constant_scalars


def eager_call(
    op, spec, leaves: list, key_of: Callable[[torch.Tensor], Any], meta, spec_key=None
) -> EagerCall:
    """The cached `EagerCall` for `op` on flattened arguments `leaves` (tree `spec`).

    `key_of(tensor)` is the signature part of a tensor leaf; `meta(tensor)` its meta stand-in;
    `spec_key` stands for `spec` in the cache key when given (hashing a spec walks it).
    """
    traced = frozenset()
    if traces_scalars(op):
        traced = frozenset(i for i, x in enumerate(leaves) if type(x) is float)
    signature = (
        key_of(x) if isinstance(x, torch.Tensor) else _TRACED if i in traced else _hashable(x)
        for i, x in enumerate(leaves)
    )
    key = (op, spec if spec_key is None else spec_key, tuple(signature))
    call = _calls.get(key)
    if call is not None:
        _calls.move_to_end(key)
        return call
    metas = [meta(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    call = EagerCall(op, spec, metas, traced)
    _calls[key] = call
    if len(_calls) > _MAX_CACHED_CALLS:
        _calls.popitem(last=False)
    return call


def _hashable(value):
    # Python floats keep their type in the key: 1 and 1.0 promote differently.
    return (type(value), value) if isinstance(value, (int, float, bool, complex)) else value


@functools.cache
def functional_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten.mul.Tensor` for `aten.mul_.Tensor`: the out-of-place overload of an in-place op
    (trailing underscore) taking the same arguments, or None when torch has none. Matched by
    the arguments, not the overload name: `pow_.Scalar` is `pow.Tensor_Scalar`."""
    name = op._schema.name.split("::", 1)[1]
    if not name.endswith("_"):
        return None
    arguments = _argument_types(op)
    namespace = getattr(torch.ops, op.namespace)
    for candidate in (name[:-1], name[:-1] + "_functional"):
        packet = getattr(namespace, candidate, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            functional = getattr(packet, overload)
            if _argument_types(functional) == arguments:
                return functional
    return None


@functools.cache
def functional_of_out(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten.maximum.default` for `aten.maximum.out`: the overload of the same op taking the
    same arguments but the keyword-only outputs it writes, or None."""
    arguments = tuple(
        t
        for t, a in zip(_argument_types(op), op._schema.arguments, strict=True)
        if not (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
    )
    packet = getattr(getattr(torch.ops, op.namespace), op._schema.name.split("::", 1)[1], None)
    for overload in () if packet is None else packet.overloads():
        candidate = getattr(packet, overload)
        if candidate is not op and _argument_types(candidate) == arguments:
            return candidate
    return None


def _argument_types(op: torch._ops.OpOverload) -> tuple:
    return tuple((a.name, str(a.type), a.kwarg_only) for a in op._schema.arguments)
