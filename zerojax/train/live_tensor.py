"""Live tensors: torch tensors whose values are the engine's sharded `jax.Array`s.

`p.grad`, `p.data`, `p.detach()` and `state_dict()` values of a wrapped model are `LiveTensor`s
(DTensor's role, torchax's mechanism): a `__torch_dispatch__` wrapper subclass with no storage
of its own. Its `source` says where the value lives -- an array the tensor owns (the result of
an op), or one entry of the engine's `TrainState` (a gradient, a parameter) read afresh at
every use -- and every ATen op on it runs as JAX through the bridge's lowering table
(`zerojax.bridge.eager`), on the shards: recorded, and run with the ops around it as one
compiled program when a value is needed (`zerojax.train.deferred`). So torch's own
`clip_grad_norm_`, `p.grad.mul_`, `torch._foreach_*`, EMAs with `lerp_`, and `nn.init` after
initialize work on the engine's state, with nothing gathered to the host.

In-place ops (`mul_`, `copy_`, `lerp_`, `uniform_`, `_foreach_mul_`) compute their
out-of-place form and write the result into the source: into the engine's gradients (times the
loss scale, in the grad dtype), or its weights (the master copy where the policy keeps one,
then the param cast from it, as the optimizer update does).

The host sees values only where torch semantics demand one: `.item()` / `float()` / `bool()`,
`.tolist()`, `.numpy()`, printing, `torch.save` / pickling, `copy.deepcopy` (an ordinary torch
tensor), and ops JAX cannot compute as torch does -- float64/complex128 values (JAX runs
32-bit here), ops with no lowering nor decomposition, `out=` variants into a host tensor or
one torch would resize -- which run in torch on host copies, writing back what they modify
(`out=` into a live tensor of the result's shape is its functional op, written into it). A view op's result (`view`, `select`, slicing,
`t`) is a live view of its base: it reads the base's current value, and writing it writes the
base, as torch's aliasing does.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from torch._decomp import decomposition_table

from zerojax.bridge import eager
from zerojax.bridge.dtypes import from_torch, host_array, to_jax_dtype, to_torch
from zerojax.bridge.registry import get_lowering
from zerojax.distributed.arrays import host_copy
from zerojax.train import deferred
from zerojax.train.deferred import Deferred
from zerojax.train.fused_optimizer_ops import FUSED_OPTIMIZER_OPS, run_fused_step

__all__ = ["LiveTensor", "Owned", "flatten_arguments", "run_op", "to_host"]

aten = torch.ops.aten

# Ops whose result is the same tensor under another name: the result shares the source.
_ALIASES = frozenset({aten.detach.default, aten.alias.default})
# Dtypes JAX holds in 32 bits here (no jax_enable_x64): ops on them run in torch on the host.
_WIDE = frozenset({torch.float64, torch.complex128})


class Owned:
    """The source of an op's result: an array the tensor owns (a `Deferred` until the
    recording that computes it runs). With a `sharding` (an optimizer's state on its ZeRO
    shards), every value written is kept there: a recorded one leaves its program there."""

    __slots__ = ("__weakref__", "array", "sharding")

    def __init__(self, array: jax.Array | Deferred, sharding=None):
        self.array, self.sharding = array, sharding

    def value(self) -> jax.Array | Deferred:
        if deferred.interrupt[0] is not None:
            deferred.interrupt[0]()
        return self.array

    def read(self) -> jax.Array:
        if deferred.interrupt[0] is not None:
            deferred.interrupt[0]()
        array = self.array
        if isinstance(array, Deferred):
            array = self.array = array.resolve()
        return array

    def write(self, value: jax.Array | Deferred) -> None:
        if deferred.interrupt[0] is not None:
            deferred.interrupt[0]()
        if deferred.write_hook[0] is not None:
            deferred.write_hook[0](self, value)
        if self.sharding is not None:
            if isinstance(value, Deferred) and value.computed is None:
                deferred.place(value, self.sharding)
            elif deferred.resolve(value).sharding != self.sharding:
                value = jax.device_put(deferred.resolve(value), self.sharding)
        self.array = value


class LiveTensor(torch.Tensor):
    """A torch tensor whose value is a JAX array (see the module docstring).

    Its device is `cpu` whatever the accelerator: torch code compares and moves devices
    (`.to(first_device)`), and a CPU tensor is what the host copies are.
    """

    _source: Any

    @staticmethod
    def __new__(cls, source, shape, dtype: torch.dtype):
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device="cpu", requires_grad=False
        )
        tensor._source = source
        return tensor

    @classmethod
    def owning(cls, array: jax.Array | Deferred, dtype: torch.dtype):
        return cls(Owned(array), array.shape, dtype)

    @property
    def array(self) -> jax.Array:
        """The value, in the JAX dtype that holds this tensor's torch dtype (running the
        recorded ops it waits for: `zerojax.train.deferred`)."""
        return self._source.read()

    def value(self) -> jax.Array | Deferred:
        """The value, or the Deferred a recorded op will produce: what later ops record."""
        return self._source.value()

    def aliased(self) -> LiveTensor:
        """A new live tensor over the same value (what `detach()` and `.data` give)."""
        return LiveTensor(self._source, self.shape, self.dtype)

    def write(self, value: jax.Array | Deferred) -> None:
        """Replace the value (broadcast and cast to this tensor's shape and dtype)."""
        shape, dtype = tuple(self.shape), to_jax_dtype(self.dtype)
        if value.shape != shape or value.dtype != dtype:
            value = _conform(value, shape, dtype)
        self._source.write(value)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        hook = dispatch_hook[0]
        if hook is not None:  # recordings traced and replayed (`zerojax.train.replay`)
            return hook(func, args, kwargs or {})
        return run_op(func, args, kwargs or {})

    # --- where torch semantics want host values ------------------------------------------

    def numpy(self, *, force: bool = False) -> np.ndarray:
        return to_host(self).numpy()

    def tolist(self):
        return to_host(self).tolist()

    def __array__(self, dtype=None, copy=None):
        array = to_host(self).numpy()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(to_host(self))

    def __format__(self, spec: str) -> str:
        return to_host(self).__format__(spec)

    def __reduce_ex__(self, protocol):
        # torch.save / pickle: an ordinary tensor, loadable by plain torch.
        return to_host(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        copied = to_host(self)
        memo[id(self)] = copied
        return copied


# Where every ATen call on live tensors goes instead of `run_op` once recordings are traced
# and replayed (`zerojax.train.replay.install`).
dispatch_hook: list[Callable[[Any, tuple, dict], Any] | None] = [None]

# `watching_host_reads`' callback, per thread.
_host_reads = threading.local()


@contextlib.contextmanager
def watching_host_reads(callback: Callable[[], None]):
    """Within: `callback()` at every host read of a live tensor's value (`.item()`, an op run
    on host copies), each of which runs the ops recorded so far."""
    previous = getattr(_host_reads, "callback", None)
    _host_reads.callback = callback
    try:
        yield
    finally:
        _host_reads.callback = previous


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An ordinary torch tensor with `tensor`'s values (a host copy for a live tensor)."""
    if not isinstance(tensor, LiveTensor):
        return tensor
    callback = getattr(_host_reads, "callback", None)
    if callback is not None:
        callback()
    host = to_torch(host_copy(tensor.array))
    return host if host.dtype == tensor.dtype else host.to(tensor.dtype)


def _value_of(tensor: torch.Tensor) -> jax.Array | Deferred:
    return tensor.value() if isinstance(tensor, LiveTensor) else from_torch(tensor)


def _input_of(tensor: torch.Tensor) -> jax.Array | Deferred | np.ndarray:
    """A recorded op's input: a live tensor's value, or a host tensor's values as a numpy copy
    (the program takes it as it takes any argument; a JAX array made of it here would be a
    dispatch of its own: Rprop passes 0-d host tensors to three ops per parameter per step)."""
    return tensor.value() if isinstance(tensor, LiveTensor) else host_array(tensor)


def _conform(value: jax.Array | Deferred, shape: tuple[int, ...], dtype) -> jax.Array | Deferred:
    """`value` broadcast to `shape` and cast to `dtype`, recorded when it is not computed yet."""
    if not isinstance(value, Deferred):
        value = value if value.shape == shape else jnp.broadcast_to(value, shape)
        return value if value.dtype == dtype else value.astype(dtype)
    (result,) = deferred.record(
        ("conform", value.shape, value.dtype, shape, dtype),
        functools.partial(_conformed, shape=shape, dtype=dtype),
        [value],
        [jax.ShapeDtypeStruct(shape, dtype)],
    )
    return result


def _conformed(arrays: list, rng, *, shape, dtype):
    (value,) = arrays
    return jnp.broadcast_to(value, shape).astype(dtype), None


def key_of(tensor: torch.Tensor):
    """A tensor's part of an `eager.eager_call` signature: its shape and dtype."""
    return (tuple(tensor.shape), tensor.dtype)


_rng_counter = itertools.count()
_rng_base: list[jax.Array] = []


def _next_rng() -> jax.Array:
    """A fresh key for a random op on live tensors (`nn.init.normal_(p)` after initialize):
    its own stream, seeded from torch's initial seed without drawing from torch's generator."""
    if not _rng_base:
        _rng_base.append(jax.random.key(torch.initial_seed() % (2**31)))
    return jax.random.fold_in(_rng_base[0], next(_rng_counter))


@functools.cache
def _mutated_positions(op: torch._ops.OpOverload) -> list[int]:
    return [
        i
        for i, argument in enumerate(op._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]


@functools.cache
def _returns_view(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return bool(returns) and returns[0].alias_info is not None


@functools.cache
def _route(func) -> tuple[str, bool, list[int], bool]:
    """(Which path of `run_op` an op takes, whether it is a fused optimizer step, the
    positions it writes, whether it returns a view): asked once per op in one lookup, as an
    optimizer's step makes hundreds of calls (hashing an OpOverload runs Python)."""
    fused = func in FUSED_OPTIMIZER_OPS
    mutated, view = _mutated_positions(func), _returns_view(func)
    if func in _ALIASES:
        return "alias", fused, mutated, view
    if func is aten.copy_.default:
        return "copy", fused, mutated, view
    if func.namespace == "aten" and func.__name__.startswith("_foreach_"):
        return "foreach", fused, mutated, view
    if _written_kwargs(func):
        return "out", fused, mutated, view
    if mutated:
        return "mutated", fused, mutated, view
    return "functional", fused, mutated, view


def run_op(func, args: tuple, kwargs: dict):
    """One ATen call with live tensors among its arguments."""
    route, fused, mutated, view = _route(func)
    if route == "alias":
        (tensor,) = args
        return tensor.aliased()
    if route == "copy":
        return _copy_(*args, **kwargs)
    if route == "foreach":
        return _foreach(func, args, kwargs)
    if fused and run_fused_step(func, args, kwargs):
        return None
    if route == "out":
        return _into_out(func, args, kwargs)
    if mutated:
        functional = eager.functional_variant(func)
        if mutated != [0] or functional is None or not isinstance(args[0], LiveTensor):
            return _on_host(func, args, kwargs, mutated)
        if get_lowering(functional) is None and func in decomposition_table:
            # e.g. square_: torch's reference runs the out-of-place ops and copy_s the result.
            return decomposition_table[func](*args, **kwargs)
        functional_route = _route(functional)
        if functional_route[:2] == ("functional", False):
            value = _functional(functional, args, kwargs, *functional_route[2:], wrap=False)
        else:
            value = run_op(functional, args, kwargs)
        args[0].write(_value_of(value) if isinstance(value, torch.Tensor) else value)
        return args[0]
    return _functional(func, args, kwargs, mutated, view, True)


def _functional(func, args: tuple, kwargs: dict, mutated: list, view: bool, wrap: bool):
    """`run_op` for an op that writes none of its arguments. `wrap=False` (an in-place op's
    out-of-place form, written back at once) may give a recorded result's value without the
    live tensor around it."""
    if get_lowering(func) is None:
        decomposition = decomposition_table.get(func)
        if decomposition is not None:
            return decomposition(*args, **kwargs)
        return _on_host(func, args, kwargs, mutated)
    leaves, spec, spec_key = flatten_arguments(args, kwargs)
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.dtype in _WIDE:
            return _on_host(func, args, kwargs, mutated)
    try:
        call = eager.eager_call(func, spec, leaves, key_of, eager.meta_of, spec_key)
    except (RuntimeError, NotImplementedError):
        # No meta kernel, or a data-dependent output shape (nonzero, unique): torch decides.
        return _on_host(func, args, kwargs, mutated)
    if _wide_result(call):
        return _on_host(func, args, kwargs, mutated)
    if view and isinstance(args[0], LiveTensor):
        return _views(func, spec, spec_key, leaves, call, args[0])  # computed when read
    inputs = [
        _input_of(x) if isinstance(x, torch.Tensor) else x
        for x in (leaves[i] for i in call.dynamic)
    ]
    return _recorded(call, inputs, func, args, kwargs, wrap)


@functools.lru_cache(maxsize=1024)  # as many as `eager` keeps
def _wide_result(call) -> bool:
    """Whether `call` returns a float64/complex128 tensor (computed on the host)."""
    return any(m.dtype in _WIDE for m in torch_pytree.tree_leaves(call.out_meta))


def _recorded(call, inputs: list, func, args: tuple, kwargs: dict, wrap: bool = True):
    """`call` on `inputs`, recorded (`zerojax.train.deferred`): live tensors over its results,
    computed when the recording runs (`wrap=False`: a single result's Deferred itself)."""
    try:
        avals = call.output_avals(inputs)
    except eager.ScalarsMustBeConstant:
        return run_op(func, args, kwargs)
    # Keyed by the call's serial (its op, signature and constants); the op's name says which
    # op it is in the compile log, and hashes faster than the op.
    outputs = deferred.record(
        (call.serial, call.op.__name__),
        call.run,
        inputs,
        avals,
        _next_rng if call.random else None,
    )
    if call.reads_indices:
        # An index out of range raises torch's error at the call, as torch does (and before
        # anything else is recorded behind it): ops that read indices are rare on live tensors.
        deferred.flush()
    meta = call.out_meta
    if isinstance(meta, torch.Tensor):
        return LiveTensor.owning(outputs[0], meta.dtype) if wrap else outputs[0]
    metas, spec = torch_pytree.tree_flatten(meta)
    tensors = [LiveTensor.owning(d, m.dtype) for d, m in zip(outputs, metas, strict=True)]
    return torch_pytree.tree_unflatten(tensors, spec)


class ViewOf:
    """The source of a view op's result (`view`, `select`, slicing, `t`, `split`...): read, it
    is the op applied to its base's current value; written, the base's elements it selects are
    set (torch's aliasing, as functionalization replays it: `y = x.t(); y.mul_(2)` changes x)."""

    __slots__ = ("_positions", "base", "index", "positions_call", "view_call")

    def __init__(self, base: LiveTensor, view_call, positions_call, index: int | None):
        self.base, self.view_call, self.positions_call = base, view_call, positions_call
        self.index = index
        self._positions = None

    def value(self) -> jax.Array | Deferred:
        base = self.base.value()
        outputs = deferred.record(
            (self.view_call.serial, self.view_call.op.__name__),
            self.view_call.run,
            [base],
            self.view_call.output_avals([base]),
        )
        return outputs[0 if self.index is None else self.index]

    def read(self) -> jax.Array:
        return deferred.resolve(self.value())

    def write(self, value: jax.Array | Deferred) -> None:
        base = self.base.value()
        positions = self.positions()
        (written,) = deferred.record(
            ("set_elements", base.shape, base.dtype, positions.shape, value.shape, value.dtype),
            _set_elements_op,
            [base, positions, value],
            [jax.ShapeDtypeStruct(base.shape, base.dtype)],
        )
        self.base.write(written)

    def positions(self) -> jax.Array:
        """Which element of the base each view element is: the view op on the base's element
        numbers (computed once)."""
        if self._positions is None:
            positions = self.positions_call([_element_numbers(tuple(self.base.shape))], _no_rng)
            self._positions = positions if self.index is None else positions[self.index]
        return self._positions


def _views(func, spec, spec_key, leaves: list, call, base: LiveTensor):
    """Live views of `base` for the result(s) of view op `func`."""
    # The same op on int32 element numbers in `base`'s shape gives the positions it selects.
    numbered = [
        torch.empty(tuple(base.shape), dtype=torch.int32, device="meta") if x is base else x
        for x in leaves
    ]
    positions_call = eager.eager_call(func, spec, numbered, key_of, eager.meta_of, spec_key)
    meta = call.out_meta
    if isinstance(meta, torch.Tensor):
        return LiveTensor(ViewOf(base, call, positions_call, None), meta.shape, meta.dtype)
    return [
        LiveTensor(ViewOf(base, call, positions_call, i), m.shape, m.dtype)
        for i, m in enumerate(meta)
    ]


def _no_rng() -> None:
    return None


@functools.cache
def _element_numbers(shape: tuple[int, ...]) -> jax.Array:
    return jnp.arange(int(np.prod(shape)), dtype=jnp.int32).reshape(shape)


def _set_elements_op(arrays: list, rng):
    base, positions, value = arrays
    value = jnp.broadcast_to(value, positions.shape).astype(base.dtype)
    flat = base.reshape(-1).at[positions.reshape(-1)].set(value.reshape(-1))
    return flat.reshape(base.shape), None


def flatten_arguments(args: tuple, kwargs: dict):
    """(leaves, tree spec, its cache key) of an op's arguments. Arguments without containers
    (most calls: `add_(g, alpha=-lr)`) and arguments with flat lists or tuples of leaves
    (`index_put_`'s indices: Rprop's masks, per parameter per step) skip the pytree walk, and
    their spec is keyed by the argument count, the keyword names and each list's type and
    length (hashing a spec walks it); deeper containers are flattened as a tree, keyed by
    their spec."""
    structure = None
    for i, a in enumerate((*args, *kwargs.values())):
        if isinstance(a, (list, tuple, dict)):
            if (type(a) is not list and type(a) is not tuple) or any(
                isinstance(x, (list, tuple, dict)) for x in a
            ):
                leaves, spec = torch_pytree.tree_flatten((args, kwargs))
                return leaves, spec, None
            if structure is None:
                structure = [None] * (len(args) + len(kwargs))
            structure[i] = (type(a), len(a))
    if structure is None:
        key: tuple = (len(args), tuple(kwargs))
        return [*args, *kwargs.values()], _flat_spec(key), key
    leaves = []
    for a in (*args, *kwargs.values()):
        if type(a) is list or type(a) is tuple:
            leaves.extend(a)
        else:
            leaves.append(a)
    key = (len(args), tuple(kwargs), tuple(structure))
    return leaves, _flat_spec(key), key


@functools.cache
def _flat_spec(key: tuple):
    """The spec of arguments shaped as `key` says (`flatten_arguments`): leaves, or flat lists or
    tuples of them."""
    count, names = key[0], key[1]
    shapes = key[2] if len(key) > 2 else (None,) * (count + len(names))
    stand_ins = [0 if shape is None else shape[0]([0] * shape[1]) for shape in shapes]
    return torch_pytree.tree_flatten(
        (tuple(stand_ins[:count]), dict(zip(names, stand_ins[count:], strict=True)))
    )[1]


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
    if not isinstance(dst, LiveTensor):
        return dst.copy_(to_host(src))
    dst.write(_value_of(src))
    return dst


def _foreach(func, args: tuple, kwargs: dict):
    """`torch._foreach_<op>[_]` as torch's CPU fallback runs it: the per-tensor op on each
    element, list arguments indexed (a `scalars` tensor too: one scalar per element), the rest
    shared."""
    if "out" in kwargs:
        return _on_host(func, args, kwargs, _mutated_positions(func))
    returns_none, schema, indexed, per_tensor, written, target = _foreach_form(func, len(args))
    count = len(args[min(indexed)])

    def element(j, argument, i):
        if j not in indexed:
            return argument
        item = argument[i]
        return item.item() if schema[j].name == "scalars" and torch.is_tensor(item) else item

    def bind(i):
        positional, keywords = [], dict(kwargs)
        for j, argument in enumerate(args):
            value = element(j, argument, i)
            if j < len(target) and target[j].kwarg_only:
                keywords[target[j].name] = value
            else:
                positional.append(value)
        return positional, keywords

    plan_key = _foreach_key(func, per_tensor, written, args, kwargs, indexed, schema)
    plan = _foreach_plans.get(plan_key) if plan_key is not None else None
    if plan is not None:
        return plan.record(args, kwargs, indexed, returns_none)
    elements = [bind(i) for i in range(count)]
    recorded = _foreach_recorded(per_tensor, elements, written)
    results = None if recorded is None else recorded[0]
    if recorded is not None and plan_key is not None:
        plan = _ForeachPlan.of(per_tensor, written, args, kwargs, target, elements, recorded)
        if plan is not None:
            if len(_foreach_plans) >= _MAX_FOREACH_PLANS:
                _foreach_plans.pop(next(iter(_foreach_plans)))  # the oldest
            _foreach_plans[plan_key] = plan
    if results is None:  # element by element, as torch's fallback does
        results = [per_tensor(*positional, **keywords) for positional, keywords in elements]
        if written:
            for (positional, _), result in zip(elements, results, strict=True):
                positional[0].copy_(result)
    return None if returns_none else results


@functools.cache
def _foreach_form(func, positional: int) -> tuple:
    """What `_foreach` needs of a foreach op's schema, called with `positional` positional
    arguments: (whether it returns None: in place; its arguments; the positions indexed per
    element; the per-tensor op and whether its result is written into the first list; that
    op's arguments)."""
    name = func.__name__.split(".")[0].removeprefix("_foreach_")
    schema = func._schema.arguments
    indexed = frozenset(
        i
        for i, argument in enumerate(schema[:positional])
        if str(argument.type).startswith("List[")
        or (argument.name == "scalars" and str(argument.type) == "Tensor")
    )
    per_tensor, written = _per_tensor_op(func)
    # The per-tensor schema takes some of the foreach op's positional arguments by keyword
    # (`addcmul_`'s value): bind them in order, by its names.
    return name.endswith("_"), schema, indexed, per_tensor, written, per_tensor._schema.arguments


def _foreach_key(func, per_tensor, written, args, kwargs, indexed, schema) -> tuple | None:
    """What decides a foreach call's recorded op (`_ForeachPlan`): each element's tensor kinds,
    shapes and dtypes, and its scalars as `eager.eager_call` keys them (a float traced as a
    program input: its type; else its value). None where no plan is kept (a `scalars` tensor,
    read on the host per element)."""
    traced = _traces_scalars(per_tensor, written)
    key: list = [func]
    for j, argument in enumerate(args):
        if j in indexed:
            if schema[j].name == "scalars" and torch.is_tensor(argument):
                return None
            key.append(tuple([_leaf_key(x, traced) for x in argument]))
        else:
            key.append(_leaf_key(argument, traced))
    for name, value in kwargs.items():
        key.append((name, _leaf_key(value, traced)))
    key = tuple(key)
    try:
        hash(key)
    except TypeError:  # an argument that is no key (a list where one value is expected)
        return None
    return key


@functools.cache
def _traces_scalars(per_tensor, written: bool) -> bool:
    """Whether the op a foreach call records for `per_tensor` takes floats as program inputs."""
    in_place = written or bool(_mutated_positions(per_tensor))
    op = eager.functional_variant(per_tensor) if in_place and not written else per_tensor
    return op is not None and eager.traces_scalars(op)


def _leaf_key(x, traced: bool):
    if isinstance(x, torch.Tensor):
        return (type(x) is LiveTensor, x.shape, x.dtype)
    if traced and type(x) is float:
        return float
    return (type(x), x) if isinstance(x, (int, float, bool, complex)) else x


# A foreach call's key (`_foreach_key`) -> how it was recorded (`_ForeachPlan`); beyond the
# limit the oldest goes (as eager's calls do).
_foreach_plans: dict[tuple, _ForeachPlan] = {}
_MAX_FOREACH_PLANS = 1024


class _ForeachPlan:
    """A foreach call recorded before, kept so the next call with the same key (the next
    optimizer step) records it without binding, flattening and looking up each element's
    call again: where each element's inputs come from in the foreach arguments, and the one
    recorded op it was."""

    __slots__ = ("avals", "calls", "conforms", "dtypes", "in_place", "run", "serials", "sources")

    @classmethod
    def of(
        cls, per_tensor, written, args, kwargs, target, elements, recorded
    ) -> _ForeachPlan | None:
        """The plan of a call `_foreach_recorded` just recorded (`recorded`: its results,
        each element's call and output aval), or None where elements hold containers."""
        _, calls, avals = recorded
        in_place = written or bool(_mutated_positions(per_tensor))
        # Each element's leaves in `bind`'s order: positional arguments, the call's keywords,
        # then the foreach op's positional arguments the per-tensor op takes by keyword.
        kwarg_only = [j < len(target) and target[j].kwarg_only for j in range(len(args))]
        origin = [("arg", j) for j in range(len(args)) if not kwarg_only[j]]
        origin += [("kw", n) for n in kwargs]
        origin += [("arg", j) for j in range(len(args)) if kwarg_only[j]]
        sources = []
        for (positional, keywords), call in zip(elements, calls, strict=True):
            if flatten_arguments(tuple(positional), keywords)[2] is None:  # containers: no plan
                return None
            sources.append(tuple(origin[i] for i in call.dynamic))
        plan = cls()
        plan.calls, plan.sources, plan.in_place = tuple(calls), tuple(sources), in_place
        plan.avals = list(avals)
        # Whether a result written in place must be cast or broadcast to its tensor first (the
        # plan's key fixes every element's shape and dtype).
        plan.conforms = in_place and any(
            aval.shape != tuple(positional[0].shape)
            or aval.dtype != to_jax_dtype(positional[0].dtype)
            for (positional, _), aval in zip(elements, avals, strict=True)
        )
        plan.dtypes = [call.out_meta.dtype for call in calls]
        plan.serials = ("foreach", per_tensor, tuple(call.serial for call in calls))
        plan.run = functools.partial(
            _run_elements, plan.calls, tuple(len(source) for source in sources)
        )
        return plan

    def record(self, args: tuple, kwargs: dict, indexed: set, returns_none: bool):
        inputs: list = []
        append = inputs.append
        for i, source in enumerate(self.sources):
            for kind, where in source:
                if kind == "kw":
                    x = kwargs[where]
                else:
                    x = args[where][i] if where in indexed else args[where]
                # `_input_of`, inlined for the commonest input: this runs per element.
                if type(x) is LiveTensor:
                    append(x._source.value())
                else:
                    append(_input_of(x) if isinstance(x, torch.Tensor) else x)
        outputs = deferred.record(self.serials, self.run, inputs, self.avals)
        if self.conforms:
            for tensor, value in zip(args[0], outputs, strict=True):
                tensor.write(value)
        elif self.in_place:
            for tensor, value in zip(args[0], outputs, strict=True):
                tensor._source.write(value)
        if returns_none:
            return None
        return [LiveTensor.owning(v, d) for v, d in zip(outputs, self.dtypes, strict=True)]


def _foreach_recorded(per_tensor, elements: list, written: bool) -> tuple | None:
    """A foreach op recorded as one op over all its elements (an optimizer's `_foreach_*`
    steps: the per-element Python of `run_op` once per list, not per tensor): (the live
    results, written into the first list where the op is in place; each element's call; each
    element's output aval). None where an element needs
    another path (a host tensor written, an op without lowering, a view, float64): the caller
    runs the elements one at a time."""
    in_place = written or bool(_mutated_positions(per_tensor))
    op = eager.functional_variant(per_tensor) if in_place and not written else per_tensor
    if op is None or get_lowering(op) is None or _returns_view(op):
        return None
    calls, inputs, sizes, avals = [], [], [], []
    for positional, keywords in elements:
        if in_place and not isinstance(positional[0], LiveTensor):
            return None
        leaves, spec, spec_key = flatten_arguments(tuple(positional), keywords)
        if any(isinstance(x, torch.Tensor) and x.dtype in _WIDE for x in leaves):
            return None
        try:
            call = eager.eager_call(op, spec, leaves, key_of, eager.meta_of, spec_key)
        except (RuntimeError, NotImplementedError):
            return None
        if not isinstance(call.out_meta, torch.Tensor) or call.out_meta.dtype in _WIDE:
            return None
        values = [
            _input_of(x) if isinstance(x, torch.Tensor) else x
            for x in (leaves[i] for i in call.dynamic)
        ]
        try:
            avals.append(call.output_avals(values)[0])
        except eager.ScalarsMustBeConstant:
            return None
        calls.append(call)
        inputs.extend(values)
        sizes.append(len(values))
    outputs = deferred.record(
        ("foreach", per_tensor, tuple(call.serial for call in calls)),
        functools.partial(_run_elements, tuple(calls), tuple(sizes)),
        inputs,
        avals,
    )
    if in_place:
        for (positional, _), value in zip(elements, outputs, strict=True):
            positional[0].write(value)
    results = [
        LiveTensor.owning(value, call.out_meta.dtype)
        for value, call in zip(outputs, calls, strict=True)
    ]
    return results, calls, avals


def _run_elements(calls: tuple, sizes: tuple, arrays: list, rng):
    """The recorded function of a foreach op: each element's call on its slice of `arrays`."""
    values, flags, start = [], [], 0
    for call, size in zip(calls, sizes, strict=True):
        value, flag = call.run(arrays[start : start + size], None)
        values.append(value)
        if flag is not None:
            flags.append(flag)
        start += size
    return values, flags or None


# Foreach overload -> the per-tensor overloads it applies, best first.
_PER_TENSOR_OVERLOADS = {
    # pow names its forms by operand kinds: `pow.Scalar` is a scalar raised to a tensor.
    "Scalar": ("Tensor_Scalar", "Scalar", "default"),
    "ScalarList": ("Tensor_Scalar", "Scalar", "default"),
    "List": ("Tensor", "Tensor_Tensor", "default"),
    "Tensor": ("Tensor", "default"),
    "ScalarAndTensor": ("Scalar", "default"),
    "default": ("default",),
}


@functools.cache
def _per_tensor_op(func) -> tuple[torch._ops.OpOverload, bool]:
    """(The per-tensor overload `func` applies, whether its result is written into the first
    list's tensors by `_foreach` rather than by the op: `_foreach_maximum_` applies
    `maximum`, which has no in-place form)."""
    name = func.__name__.split(".")[0].removeprefix("_foreach_")
    if name == "norm":  # _foreach_norm(tensors, ord, dtype) applies linalg_vector_norm
        return aten.linalg_vector_norm.default, False
    packet, written = getattr(aten, name, None), False
    if packet is None and name.endswith("_"):
        packet, written = getattr(aten, name[:-1], None), True
    for overload in _PER_TENSOR_OVERLOADS.get(func._overloadname, ("default",)):
        if packet is not None and overload in packet.overloads():
            return getattr(packet, overload), written
    raise NotImplementedError(f"zerojax: no per-tensor form of {func} for live tensors")


def _on_host(func, args: tuple, kwargs: dict, mutated: list[int]):
    """Run `func` in torch on host copies of the live tensors; write back the ones it
    modifies, and hand back the live tensor itself where torch returns a modified argument."""
    originals: dict[int, LiveTensor] = {}

    def host(tensor):
        copied = to_host(tensor)
        originals[id(copied)] = tensor
        return copied

    host_args, host_kwargs = torch_pytree.tree_map_only(LiveTensor, host, (args, kwargs))
    result = func(*host_args, **host_kwargs)
    written = [host_args[i] for i in mutated if i < len(host_args)]
    written += [host_kwargs[a.name] for a in _written_kwargs(func) if a.name in host_kwargs]
    for value in torch_pytree.tree_leaves(written):
        original = originals.get(id(value))
        if original is not None:
            original.write(from_torch(value))
    return torch_pytree.tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), result)


@functools.cache
def _written_kwargs(func) -> list:
    return [
        a
        for a in func._schema.arguments
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
    ]


def _into_out(func, args: tuple, kwargs: dict):
    """An `out=` op (`torch.maximum(a, b, out=exp_inf)`, Adamax's step): its functional
    overload, written into the live `out` tensors (recorded like any write). Host copies where
    an `out` is not live, the shapes differ (torch would resize it) or there is no functional
    overload."""
    names = [a.name for a in _written_kwargs(func)]
    outs = [kwargs.get(name) for name in names]
    functional = eager.functional_of_out(func)
    if functional is None or not all(isinstance(o, LiveTensor) for o in outs):
        return _on_host(func, args, kwargs, _mutated_positions(func))
    result = run_op(functional, args, {k: v for k, v in kwargs.items() if k not in names})
    results = [result] if isinstance(result, torch.Tensor) else list(result)
    if len(results) != len(outs) or any(
        tuple(r.shape) != tuple(o.shape) for r, o in zip(results, outs, strict=True)
    ):
        return _on_host(func, args, kwargs, _mutated_positions(func))
    for out, value in zip(outs, results, strict=True):
        out.write(_value_of(value))
    return outs[0] if len(outs) == 1 else tuple(outs)
