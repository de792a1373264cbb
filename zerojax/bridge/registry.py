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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from zerojax.bridge.dtypes import to_jax_dtype
from zerojax.config import KernelsConfig

Lowering = Callable[..., Any]

_LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}


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


def get_lowering(overload) -> Lowering | None:
    _load_lowerings()
    return _LOWERINGS.get(overload)


def supported_ops() -> frozenset:
    """Every ATen overload with a registered lowering."""
    _load_lowerings()
    return frozenset(_LOWERINGS)


_loaded = False


def _load_lowerings() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import zerojax.bridge.lowerings  # noqa: F401  (registers by import)


@dataclasses.dataclass
class LoweringContext:
    """What a lowering may need beyond its arguments: output metadata, RNG, train flag."""

    node: torch.fx.Node
    train: bool
    rng_for_site: Callable[[], jax.Array]
    float_dtype: np.dtype | None = None  # compute-dtype override for float results (policy)
    kernels: KernelsConfig | None = None  # which fused kernels to use; None: the defaults
    # (mesh, batch axes) when the caller shards the batch: Pallas kernels then run per shard
    # (see kernel_sharding.py); None runs them on whole arrays.
    batch_mesh: tuple[Any, tuple[str, ...]] | None = None

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
        return tuple(int(d) for d in meta.shape)

    def rng_key(self) -> jax.Array:
        """A PRNG key private to this graph node; fresh per call key, stable across traces."""
        return self.rng_for_site()
