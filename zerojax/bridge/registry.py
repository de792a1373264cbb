"""The lowering table: one JAX function per ATen overload, registered by decorator.

A lowering mirrors the ATen schema of its overload. It receives a `LoweringContext` first, then
the node's arguments with every tensor replaced by a `jax.Array` (lists of tensors become lists
of arrays; SymInts are plain ints because zerojax traces one program per input shape)::

    @lowering(aten.add.Tensor)
    def lower_add_tensor(ctx, self, other, *, alpha=1):
        ...

The interpreter casts every tensor a lowering returns to the dtype torch's fake tensor recorded
for that node (`ctx.out_dtype`) and checks its shape, so a lowering must get the *values* right
in a dtype at least as wide as torch's; promotion of the final result is handled once, here.

`@lowering` is for zerojax's own table (ATen overloads, imported with the package);
`register_lowering` is the public face of the same table, for users' and libraries' own
`torch.library` ops (and to replace a built-in lowering on purpose, with `override=True`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch

from zerojax.bridge.dtypes import to_jax_dtype
from zerojax.bridge.symbolic_shapes import concrete
from zerojax.config import KernelsConfig

if TYPE_CHECKING:
    from zerojax.parallel.plan import ParallelPlan

Lowering = Callable[..., Any]

_LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}
# Lowerings registered by qualified name ("ns::op" for every overload, "ns::op.overload" for one)
# for ops that need not exist yet: transformers defines its custom ops only when its MoE module
# is imported, which may be after zerojax loads its table.
_LOWERINGS_BY_NAME: dict[str, Lowering] = {}
# Names registered through `register_lowering`: capture keeps these ops whole instead of letting
# torch decompose them (a CompositeImplicitAutograd op would otherwise never reach its lowering).
_KEPT_WHOLE_NAMES: set[str] = set()


class DuplicateLoweringError(RuntimeError):
    """An ATen overload was registered twice (two modules claim the same op)."""


def lowering(*overloads: torch._ops.OpOverload) -> Callable[[Lowering], Lowering]:
    """Register `fn` as the lowering of each overload; registering an overload twice raises."""

    for overload in overloads:
        if not isinstance(overload, torch._ops.OpOverload):
            raise TypeError(
                f"@lowering expects ATen overloads (e.g. aten.add.Tensor), got {overload!r}"
            )

    def register(fn: Lowering) -> Lowering:
        for overload in overloads:
            if overload in _LOWERINGS:
                previous = _LOWERINGS[overload]
                raise DuplicateLoweringError(
                    f"{overload} already lowered by {previous.__module__}.{previous.__name__}; "
                    f"{fn.__module__}.{fn.__name__} registers it again"
                )
            _LOWERINGS[overload] = fn
        return fn

    return register


def register_lowering(
    op: torch._ops.OpOverload | torch._ops.OpOverloadPacket | str, *, override: bool = False
) -> Callable[[Lowering], Lowering]:
    """Register the decorated function as the JAX lowering of a (custom) torch op.

    `op` is an overload (`torch.ops.mylib.op.default`), a packet (`torch.ops.mylib.op`: every
    overload), or a qualified name: `"mylib::op"` (every overload) or `"mylib::op.overload"`.
    A name may be registered before the library defining the op is imported.

    The function receives what a built-in lowering receives: a `LoweringContext` (`ctx.node`,
    `ctx.out_dtype`, `ctx.out_shape`, `ctx.rng_key()`, ...) and then the op's arguments as its
    schema names them, every tensor a `jax.Array`; it returns a `jax.Array` (or a tuple for
    multi-output ops). The interpreter casts results to the dtype torch recorded and checks the
    shape. Gradients come from JAX differentiating the lowering; the op's torch autograd formula
    is not used.

    Capture keeps a registered op whole (torch would otherwise decompose an op with a
    CompositeImplicitAutograd kernel before the lowering is reached).

    Registering an op that already has a lowering raises `DuplicateLoweringError`, as two
    modules claiming one op is almost always a mistake; pass `override=True` to replace the
    existing lowering (built-in ones included) on purpose.

    Example::

        @torch.library.custom_op("mylib::scaled_tanh", mutates_args=())
        def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
            return torch.tanh(x) * scale

        @scaled_tanh.register_fake
        def _(x, scale):
            return torch.empty_like(x)

        @zerojax.register_lowering(torch.ops.mylib.scaled_tanh)
        def lower_scaled_tanh(ctx, x, scale):
            return jnp.tanh(x) * scale
    """
    _load_lowerings()  # built-ins first, so a clash is reported now, not at first convert
    overloads, names = _resolve(op)

    def register(fn: Lowering) -> Lowering:
        if not callable(fn):
            raise TypeError(f"register_lowering({op!r}) decorates a function, got {fn!r}")
        if not override:
            for overload in overloads:
                _check_free(overload, fn)
            for name in names:
                _check_free_name(name, fn)
        for overload in overloads:
            _LOWERINGS[overload] = fn
            _KEPT_WHOLE_NAMES.add(qualified_name(overload))
        for name in names:
            _LOWERINGS_BY_NAME[name] = fn
            _KEPT_WHOLE_NAMES.add(name)
        return fn

    return register


def qualified_name(overload: torch._ops.OpOverload) -> str:
    """'ns::op.overload', e.g. 'aten::add.Tensor', 'transformers::grouped_mm_fallback.default'."""
    return f"{overload._schema.name}.{overload._overloadname}"


def _resolve(op) -> tuple[list[torch._ops.OpOverload], list[str]]:
    """(overloads that exist now, names kept for ops not defined yet) that `op` denotes."""
    if isinstance(op, torch._ops.OpOverload):
        return [op], []
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()], []
    if not isinstance(op, str):
        raise TypeError(
            f"register_lowering expects a torch op (torch.ops.ns.op or torch.ops.ns.op.overload) "
            f"or its qualified name 'ns::op[.overload]', got {type(op).__name__} {op!r}"
        )
    match = re.fullmatch(r"(\w+)::(\w+)(?:\.(\w+))?", op)
    if match is None:
        raise ValueError(
            f"register_lowering: {op!r} is not a qualified op name; expected 'ns::op' (every "
            f"overload) or 'ns::op.overload', e.g. 'mylib::scaled_tanh.default'"
        )
    namespace, name, overload_name = match.groups()
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        if overload_name is None:
            return [getattr(packet, o) for o in packet.overloads()], [op]
        return [getattr(packet, overload_name)], [op]
    except (AttributeError, RuntimeError):
        # Not defined yet (its library is imported later): found by name at lookup.
        return [], [op]


def _check_free(overload: torch._ops.OpOverload, fn: Lowering) -> None:
    previous = _LOWERINGS.get(overload) or _by_name(overload)
    if previous is not None and previous is not fn:
        raise DuplicateLoweringError(
            f"{overload} already lowered by {previous.__module__}.{previous.__name__}; "
            f"{fn.__module__}.{fn.__name__} registers it again (pass override=True to "
            f"register_lowering to replace it)"
        )


def _check_free_name(name: str, fn: Lowering) -> None:
    previous = _LOWERINGS_BY_NAME.get(name)
    if previous is not None and previous is not fn:
        raise DuplicateLoweringError(
            f"{name} already lowered by {previous.__module__}.{previous.__name__}; "
            f"{fn.__module__}.{fn.__name__} registers it again (pass override=True to "
            f"register_lowering to replace it)"
        )


def _by_name(overload: torch._ops.OpOverload) -> Lowering | None:
    if not _LOWERINGS_BY_NAME:
        return None
    name = qualified_name(overload)
    return _LOWERINGS_BY_NAME.get(name) or _LOWERINGS_BY_NAME.get(name.rsplit(".", 1)[0])


def get_lowering(overload) -> Lowering | None:
    _load_lowerings()
    found = _LOWERINGS.get(overload)
    if found is None and isinstance(overload, torch._ops.OpOverload):
        found = _by_name(overload)
    return found


def kept_whole(overload: torch._ops.OpOverload) -> bool:
    """Whether capture must keep `overload` whole: it was registered with `register_lowering`."""
    name = qualified_name(overload)
    return name in _KEPT_WHOLE_NAMES or name.rsplit(".", 1)[0] in _KEPT_WHOLE_NAMES


def kept_whole_overloads() -> list[torch._ops.OpOverload]:
    """Every existing overload registered through `register_lowering` (names resolved now)."""
    found = []
    for name in sorted(_KEPT_WHOLE_NAMES):
        try:
            overloads, _ = _resolve(name)
        except (TypeError, ValueError):  # an OpOverload's own name always parses
            continue
        found.extend(overloads)
    return found


def supported_ops() -> frozenset:
    """Every op overload with a registered lowering (ATen and registered custom ops)."""
    _load_lowerings()
    return frozenset(_LOWERINGS) | frozenset(kept_whole_overloads())


_loaded = False


def _load_lowerings() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import zerojax.bridge.lowerings  # noqa: F401  (registers by import)


@dataclasses.dataclass
class LoweringContext:
    """What a lowering may need beyond its arguments: output metadata, RNG, train flag, the
    kernels the config picks and the parallelism the run uses."""

    node: torch.fx.Node
    train: bool
    rng_for_site: Callable[[], jax.Array]
    float_dtype: np.dtype | None = None  # compute-dtype override for float results (policy)
    kernels: KernelsConfig | None = None  # which fused kernels to use; None: the defaults
    # How the run is parallelised (zerojax/parallel/plan.py): Pallas kernels per batch shard
    # (`kernel_batch`, kernel_sharding.py), grouped GEMMs expert-parallel (`experts`),
    # attention sequence-parallel (`sequence`). None runs every op whole.
    parallel: ParallelPlan | None = None
    # The sizes a symbolic capture's symbols stand for in this trace (symbolic_shapes.py).
    sizes: Mapping[Any, int] = dataclasses.field(default_factory=dict)

    def kernel(self, family: str) -> tuple[str, bool] | None:
        """(implementation, interpret) for a kernel family ("attention", "norm", "optimizer",
        "loss") as the config chooses it; None when the config turns it off."""
        return (self.kernels if self.kernels is not None else KernelsConfig()).choice(family)

    @property
    def out_meta(self):
        """torch's FakeTensor (or tuple of them) recorded for this node's output."""
        return self.node.meta.get("val")

    def jax_dtype(self, torch_dtype: torch.dtype) -> np.dtype:
        """The JAX dtype that a torch dtype named in this graph runs as (policy applied)."""
        dtype = to_jax_dtype(torch_dtype)
        if self.float_dtype is not None and np.issubdtype(dtype, np.floating):
            return np.dtype(self.float_dtype)
        return dtype

    @property
    def out_dtype(self) -> np.dtype:
        """The JAX dtype of this node's (first) tensor output."""
        meta = self.out_meta
        if isinstance(meta, (tuple, list)):
            meta = meta[0]
        return self.jax_dtype(meta.dtype)

    @property
    def out_shape(self) -> tuple[int, ...]:
        meta = self.out_meta
        if isinstance(meta, (tuple, list)):
            meta = meta[0]
        return tuple(concrete(d, self.sizes) for d in meta.shape)

    def rng_key(self) -> jax.Array:
        """A PRNG key private to this graph node; fresh per call key, stable across traces."""
        return self.rng_for_site()
