"""The original module's parameters and buffers after initialize: stand-ins for the engine's.

Each parameter keeps its identity (the optimizer's param_groups and the user's own references
hold the same object), its name, shape, dtype and `requires_grad`, and gives its memory up: its
storage becomes a zero-stride view of one element, the engine's `TrainState` being the only
copy. Its class becomes `ShardedParameter`, whose torch functions run on a live view of the
engine's value (`zerojax.train.live_tensor`): `p.data`, `p.detach()`, `p.norm()`,
`F.linear(x, p)`, `module.state_dict()` and `p.grad` read the engine's arrays, and in-place ops
(`p.data.lerp_`, `nn.init.zeros_(p)`, `p.grad.mul_`) write them. Metadata (shape, dtype,
`requires_grad`, numel) is answered by the stand-in itself, without a detour: the wrapped
model's forward reads `requires_grad` of every parameter on every call.

Buffers are stand-ins the same way (`ShardedBuffer`, keeping their memory for torch.export):
BatchNorm's running statistics read as the training-mode forwards left them in the engine.

`copy.deepcopy` and pickling (`torch.save(module)`) give ordinary `nn.Parameter`s and tensors
holding the values, so a deep copy of the module (an EMA model, `AveragedModel(model.module)`) is an
ordinary torch model.

While the engine captures the module, `plain_parameters()` turns all of this off: torch.export
must see ordinary parameters (and no gradients).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import torch
import torch.utils._pytree as torch_pytree

from zerojax.bridge.dtypes import from_torch, to_jax_dtype
from zerojax.train import deferred
from zerojax.train.deferred import Deferred
from zerojax.train.live_tensor import LiveTensor, to_host

__all__ = [
    "ShardedBuffer",
    "ShardedParameter",
    "is_plain",
    "live_of",
    "plain_parameters",
    "release_parameters",
]

Tensor = torch.Tensor

_DATA_GET, _DATA_SET = Tensor.data.__get__, Tensor.data.__set__

# Answered by the stand-in: its metadata is the parameter's own.
_OWN_METADATA = frozenset(
    {
        Tensor.requires_grad.__get__,
        Tensor.requires_grad.__set__,
        Tensor.requires_grad_,
        Tensor.shape.__get__,
        Tensor.dtype.__get__,
        Tensor.device.__get__,
        Tensor.layout.__get__,
        Tensor.ndim.__get__,
        Tensor.is_leaf.__get__,
        Tensor.grad_fn.__get__,
        Tensor.is_cuda.__get__,
        Tensor.is_meta.__get__,
        Tensor.is_sparse.__get__,
        Tensor.is_quantized.__get__,
        Tensor.size,
        Tensor.dim,
        Tensor.numel,
        Tensor.nelement,
        Tensor.element_size,
        Tensor.is_floating_point,
        Tensor.is_complex,
        torch.is_floating_point,  # torch.optim's `_init_group` asks every parameter, every step
        torch.is_complex,
        torch.numel,
        Tensor.__hash__,
        Tensor.__len__,
        Tensor._is_view,
        Tensor.register_hook,
        # The stand-in's own one-element storage: what the parameter holds on the host.
        Tensor.untyped_storage,
        Tensor.data_ptr,
        Tensor.register_post_accumulate_grad_hook,
    }
)

_plain = threading.local()


@contextlib.contextmanager
def plain_parameters():
    """Within: stand-ins behave as the ordinary (memory-free) parameters they are, and report
    no gradient. For capturing the module with torch.export."""
    previous = getattr(_plain, "active", False)
    _plain.active = True
    try:
        yield
    finally:
        _plain.active = previous


def is_plain() -> bool:
    """Whether `plain_parameters()` is in force (torch.export is capturing the model)."""
    return getattr(_plain, "active", False)


class EngineEntry:
    """A live tensor's source: one entry of the engine's state (a parameter, its gradient, a
    buffer), read afresh at every use through `reader(name, dtype)` and replaced through
    `writer({name: value})` (engine methods that know the entry's dtype, sharding and scaling;
    a recording's writes reach them together, `zerojax.train.deferred`)."""

    __slots__ = ("__weakref__", "dtype", "name", "reader", "sharding", "writer")

    def __init__(self, reader, writer, name: str, dtype: torch.dtype, sharding=None):
        self.reader, self.writer = reader, writer
        self.name, self.dtype = name, to_jax_dtype(dtype)
        self.sharding = sharding
        """Where the engine keeps the entry (None: the writer places it)."""

    def value(self) -> jax.Array | Deferred:
        """The entry's value, or what recorded ops have written into it and not yet run
        (`zerojax.train.deferred`)."""
        if deferred.interrupt[0] is not None:
            deferred.interrupt[0]()
        pending = deferred.pending_write(self.writer, self.name)
        if pending is not None:
            return pending
        value = self.reader(self.name, self.dtype)
        if value is None:
            raise RuntimeError(
                f"zerojax: the gradient of '{self.name}' was cleared (zero_grad, or a step with "
                f"gradient accumulation) after this `p.grad` tensor was taken; read `p.grad` again"
            )
        deferred.read_entry(value, self.writer, self.name)
        return value

    def read(self) -> jax.Array:
        return deferred.resolve(self.value())

    def write(self, value: jax.Array | Deferred) -> None:
        if deferred.interrupt[0] is not None:
            deferred.interrupt[0]()
        if deferred.write_hook[0] is not None:
            deferred.write_hook[0](self, value)
        if isinstance(value, Deferred) and value.computed is not None:
            value = value.computed  # computed already: written as any array is
        if isinstance(value, Deferred) or deferred.pending_write(self.writer, self.name):
            deferred.write(self.writer, self.name, value, self.sharding)
        else:
            self.writer({self.name: value})


class _StandIn:
    """What parameter and buffer stand-ins share: a live view of their engine entry, torch
    functions run on it (metadata answered by the stand-in itself), and ordinary copies when
    deep-copied, pickled or printed. Subclasses name the engine's reader and writer."""

    __slots__ = ()
    _reader: str
    _writer: str

    def live(self) -> LiveTensor:
        """The value as a live tensor (what `.data` and `.detach()` give): one per stand-in,
        made on first use (it reads the engine afresh at every use)."""
        view = self.__dict__.get("_zerojax_live_view")
        if view is None:
            view = self._zerojax_live_view = _live_view(self, self._reader, self._writer)
        return view

    @property
    def data(self):
        """`p.data`: a new live tensor over the same entry, as torch's `.data` of the live view
        is (its alias route). A property of its own, not torch's descriptor: that one goes
        through `__torch_function__` (~2 us per access), and a hand-written update loop
        asks once per parameter per step."""
        if is_plain():
            with torch._C.DisableTorchFunctionSubclass():
                return _DATA_GET(self)
        return self.live().aliased()

    @data.setter
    def data(self, value):
        if is_plain():
            with torch._C.DisableTorchFunctionSubclass():
                _DATA_SET(self, value)
            return
        if tuple(value.shape) != tuple(self.shape):
            raise RuntimeError(
                f"zerojax: `.data = tensor` with shape {tuple(value.shape)} on "
                f"'{self._zerojax_name}' of shape {tuple(self.shape)}; a zerojax "
                f"tensor's shape is fixed at initialize"
            )
        self.live().copy_(value)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _OWN_METADATA or is_plain():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        # A descriptor's `__get__`/`__set__` is a new method-wrapper at each access: compared
        # with ==, never `is`. (`p.data` itself is the property above; these are explicit
        # calls of torch's descriptor.)
        if func == _DATA_GET:
            return _StandIn.data.fget(*args)
        if func == _DATA_SET:
            return _StandIn.data.fset(*args)
        plain_kwargs = not kwargs or not any(
            isinstance(v, (_StandIn, list, tuple, dict)) for v in kwargs.values()
        )
        lively = _lively(args) if plain_kwargs else None
        if lively is None:
            args, kwargs = torch_pytree.tree_map_only(_StandIn, lambda t: t.live(), (args, kwargs))
        else:
            args = lively
        return func(*args, **kwargs)

    def _ordinary(self) -> torch.Tensor:
        """An ordinary torch tensor (or parameter) holding the current value."""
        return to_host(self.live())

    def __deepcopy__(self, memo):
        copied = self._ordinary()
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):
        return self._ordinary().__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return repr(self._ordinary())


def live_of(tensor) -> LiveTensor | None:
    """The live tensor of a parameter or buffer stand-in (its live view), a live tensor itself;
    None for anything else."""
    if isinstance(tensor, LiveTensor):
        return tensor
    return tensor.live() if isinstance(tensor, _StandIn) else None


def _lively(args: tuple) -> tuple | None:
    """`args` with each stand-in, alone or in a flat list (a foreach call's, an optimizer's
    every step), as its live view; None where a container holds containers (the caller walks
    those as a tree)."""
    lively = []
    for a in args:
        if isinstance(a, _StandIn):
            a = a.live()
        elif type(a) is list or type(a) is tuple:
            items = []
            for item in a:
                if isinstance(item, _StandIn):
                    item = item.live()
                elif isinstance(item, (list, tuple, dict)):
                    return None
                items.append(item)
            a = items if type(a) is list else tuple(items)
        elif isinstance(a, (list, tuple, dict)) and not isinstance(a, torch.Size):
            return None
        lively.append(a)
    return tuple(lively)


def _live_view(stand_in, reader: str, writer: str) -> LiveTensor:
    """A live tensor over the engine entry `stand_in` names, read and written through the
    engine methods named `reader`/`writer` for its kind (weight, gradient, buffer)."""
    engine, name = stand_in._zerojax_engine, stand_in._zerojax_name
    source = EngineEntry(
        getattr(engine, reader),
        getattr(engine, writer),
        name,
        stand_in.dtype,
        engine.entry_sharding(writer, name),
    )
    return LiveTensor(source, stand_in.shape, stand_in.dtype)


class ShardedParameter(_StandIn, torch.nn.Parameter):
    """A parameter whose value and gradient live in a zerojax engine (see the module
    docstring)."""

    _zerojax_engine: object
    _zerojax_name: str
    _reader, _writer = "weight_value", "write_weights"

    @property
    def grad(self):
        if is_plain() or not self._zerojax_engine.has_grad(self._zerojax_name):
            return None
        # One live tensor per parameter, made on first read: it reads the engine afresh, so
        # `p.grad is p.grad` as in torch, and clip_grad_norm_'s four reads per parameter
        # cost a lookup each.
        view = self.__dict__.get("_zerojax_grad_view")
        if view is None:
            view = self._zerojax_grad_view = _live_view(self, "grad_value", "write_grads")
        return view

    @grad.setter
    def grad(self, value):
        engine, name = self._zerojax_engine, self._zerojax_name
        if value is None:  # as in torch, this parameter's gradient is gone
            engine.drop_grad(name)
            return
        if tuple(value.shape) != tuple(self.shape):
            raise RuntimeError(
                f"zerojax: assigned grad of shape {tuple(value.shape)} to parameter '{name}' "
                f"of shape {tuple(self.shape)}"
            )
        array = value.array if isinstance(value, LiveTensor) else from_torch(value)
        engine.write_grads({name: array})

    def _ordinary(self) -> torch.nn.Parameter:
        return torch.nn.Parameter(to_host(self.live()), self.requires_grad)


class ShardedBuffer(_StandIn, torch.Tensor):
    """A buffer (BatchNorm's running statistics, ...) whose value lives in a zerojax engine:
    reads see what the training-mode forwards made of it."""

    _zerojax_engine: object
    _zerojax_name: str
    _reader, _writer = "buffer_value", "write_buffers"


def release_parameters(module: torch.nn.Module, engine) -> None:
    """Hand every parameter's memory to the engine and make parameters and buffers stand-ins:
    same objects, names, shapes and dtypes; their values are the engine's from now on."""
    for name, param in module.named_parameters():
        param.data = torch.empty((), dtype=param.dtype).expand(param.shape)
        _stand_in(param, ShardedParameter, engine, engine.alias[name])
    for name, buffer in module.named_buffers():
        # Buffers keep their (small) memory: torch.export writes BatchNorm's running statistics
        # in place while it traces, which a zero-stride stand-in refuses.
        _stand_in(buffer, ShardedBuffer, engine, engine.alias.get(name, name))


def _stand_in(tensor: torch.Tensor, stand_in_type: type, engine, name: str) -> None:
    tensor.__class__ = stand_in_type
    tensor._zerojax_engine = engine
    tensor._zerojax_name = name
