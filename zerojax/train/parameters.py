"""The original module's parameters after initialize: stand-ins whose values are the engine's.

Each parameter keeps its identity (the optimizer's param_groups and the user's own references
hold the same object), its name, shape, dtype and `requires_grad`, and gives its memory up: its
storage becomes a zero-stride view of one element, the engine's `TrainState` being the only
copy. Its class becomes `ShardedParameter`, whose torch functions run on a live view of the
engine's value (`zerojax.train.live_tensor`): `p.data`, `p.detach()`, `p.norm()`,
`F.linear(x, p)`, `module.state_dict()` and `p.grad` read the engine's arrays, and in-place ops
(`p.data.lerp_`, `nn.init.zeros_(p)`, `p.grad.mul_`) write them. Metadata (shape, dtype,
`requires_grad`, numel) is answered by the stand-in itself, without a detour: the wrapped
model's forward reads `requires_grad` of every parameter on every call.

`copy.deepcopy` and pickling (`torch.save(module)`) give ordinary `nn.Parameter`s holding the
values, so a deep copy of the module (an EMA model, `AveragedModel(model.module)`) is an
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
from zerojax.train.live_tensor import LiveTensor, to_host

__all__ = ["ShardedParameter", "plain_parameters", "release_parameters"]

Tensor = torch.Tensor

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


def _is_plain() -> bool:
    return getattr(_plain, "active", False)


class EngineWeight:
    """A live tensor's source: one parameter's authoritative value (master weight if kept)."""

    __slots__ = ("engine", "name", "dtype")

    def __init__(self, engine, name: str, dtype: torch.dtype):
        self.engine, self.name, self.dtype = engine, name, to_jax_dtype(dtype)

    def read(self) -> jax.Array:
        return self.engine.weight_value(self.name, self.dtype)

    def write(self, value: jax.Array) -> None:
        self.engine.write_weight(self.name, value)


class EngineGrad:
    """A live tensor's source: one parameter's accumulated gradient, as torch shows it
    (unscaled, in the parameter's dtype)."""

    __slots__ = ("engine", "name", "dtype")

    def __init__(self, engine, name: str, dtype: torch.dtype):
        self.engine, self.name, self.dtype = engine, name, to_jax_dtype(dtype)

    def read(self) -> jax.Array:
        value = self.engine.grad_value(self.name, self.dtype)
        if value is None:
            raise RuntimeError(
                f"zerojax: the gradient of '{self.name}' was cleared (zero_grad or a step with "
                f"gradient accumulation) after this `p.grad` tensor was taken; read `p.grad` again"
            )
        return value

    def write(self, value: jax.Array) -> None:
        self.engine.write_grad(self.name, value)


class ShardedParameter(torch.nn.Parameter):
    """A parameter whose value and gradient live in a zerojax engine (see the module
    docstring)."""

    _zerojax_engine: object
    _zerojax_name: str

    def live(self) -> LiveTensor:
        """The parameter's value as a live tensor (what `p.data` and `p.detach()` give)."""
        return LiveTensor(
            EngineWeight(self._zerojax_engine, self._zerojax_name, self.dtype),
            self.shape,
            self.dtype,
        )

    @property
    def grad(self):
        if _is_plain():
            return None
        engine, name = self._zerojax_engine, self._zerojax_name
        if not engine.has_grad(name):
            return None
        return LiveTensor(EngineGrad(engine, name, self.dtype), self.shape, self.dtype)

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
        engine.write_grad(name, array)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _OWN_METADATA or _is_plain():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is Tensor.data.__set__:
            param, value = args
            if tuple(value.shape) != tuple(param.shape):
                raise RuntimeError(
                    f"zerojax: `p.data = tensor` with shape {tuple(value.shape)} on parameter "
                    f"'{param._zerojax_name}' of shape {tuple(param.shape)}; a zerojax "
                    f"parameter's shape is fixed at initialize"
                )
            param.live().copy_(value)
            return None
        live_args, live_kwargs = torch_pytree.tree_map_only(
            ShardedParameter, ShardedParameter.live, (args, kwargs)
        )
        return func(*live_args, **live_kwargs)

    def __deepcopy__(self, memo):
        copied = torch.nn.Parameter(to_host(self.live()), self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol):
        return torch.nn.Parameter(to_host(self.live()), self.requires_grad).__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"Parameter containing:\n{to_host(self.live())!r}"


def release_parameters(module: torch.nn.Module, engine) -> None:
    """Hand every parameter's memory to the engine: same object, names, shapes and dtypes;
    its values are the engine's from now on."""
    for name, param in module.named_parameters():
        param.data = torch.empty((), dtype=param.dtype).expand(param.shape)
        param.__class__ = ShardedParameter
        param._zerojax_engine = engine
        param._zerojax_name = engine.alias[name]
