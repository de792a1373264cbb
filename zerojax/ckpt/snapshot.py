"""Snapshots: copies of a tree of jax.Arrays that the next training step cannot overwrite,
taken without waiting for the copy.

An asynchronous checkpoint returns to the training loop before its bytes are written, and the
loop's next optimizer update donates the params, master weights and optimizer state it saves
(`zerojax.train.programs`, `donate_argnums`): XLA then writes the new values into those very
buffers, and a jax.Array that was donated is deleted, however many references to it are held.
`snapshot(tree)` returns the same tree with every jax.Array replaced by a copy in buffers of
its own, which nothing donates:

    >>> frozen = snapshot({"w": w_sharded, "step": step})   # returns at once
    >>> optimizer.step()                                     # donates w: frozen["w"] unaffected
    >>> write(frozen)                                        # e.g. on a background thread

Why this is safe without waiting: the copy is a program (or transfer) that reads the arrays,
enqueued before the update that donates them, and the runtime lets a donating program write a
buffer only after every read of it enqueued earlier has finished -- the ordering any JAX code
`y = f(x); z = g_donating(x)` relies on. So `snapshot` only enqueues: it returns once the
copies are dispatched (~20-50 ms of Python for 374 arrays in 2,978 shards on 8 CPU devices),
the copying runs on the devices while the loop goes on, and a reader of the snapshot waits for
it like for any jax.Array (`np.asarray`, `block_until_ready`). The only requirement is that
`snapshot` returns before the donating program is dispatched: the Checkpointer calls it on its
own thread and makes the next optimizer update wait for it (`Engine.before_next_update`).

Where the copies live (`method`):

- "device": one jitted copy program per device assignment (mesh), outputs on the input's
  sharding. The default on CPU devices, where device memory is host memory (and XLA's copy is
  faster than a transfer to pinned host memory: 30-40 vs 80-90 ms to dispatch on the loaded
  bench host, BENCHMARKS.md).
- "pinned_host": `jax.device_put` onto the same sharding in the devices' pinned host memory: a
  device-to-host transfer (DMA on accelerators; unmeasured on a GPU, none was available), no
  device memory. The default on other platforms when every device has such a memory (else
  "device").

Cost: one copy of the snapshotted arrays, alive as long as the snapshot is referenced (the
Checkpointer drops it once the write has committed); on accelerators in pinned host memory, so
device memory is untouched. The first snapshot of a tree compiles its copy program (~0.2 s for
374 arrays; cached per signature, and by JAX's persistent compile cache when it is on).

Leaves that are not jax.Arrays (numpy arrays, Python scalars) pass through unchanged: nothing
donates them.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, Sharding

__all__ = ["Method", "resolve_method", "snapshot"]

Method = Literal["auto", "device", "pinned_host"]
_METHODS = ("auto", "device", "pinned_host")


def resolve_method(method: Method, devices) -> Literal["device", "pinned_host"]:
    """The method "auto" stands for on `devices` (see the module docstring)."""
    if method not in _METHODS:
        raise ValueError(f"snapshot: method={method!r}; use one of {', '.join(_METHODS)}")
    if method != "auto":
        return method
    devices = list(devices)
    if all(d.platform == "cpu" for d in devices):
        return "device"
    pinned = all(any(m.kind == "pinned_host" for m in d.addressable_memories()) for d in devices)
    return "pinned_host" if pinned else "device"


def _group_key(sharding: Sharding) -> Any:
    # One jitted program may only take arrays on one device assignment: the engine's arrays
    # share its mesh, its rng lives on one device.
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    return sharding


def _copy(arrays: list[jax.Array]) -> list[jax.Array]:
    return [jnp.copy(a) for a in arrays]


@functools.lru_cache(maxsize=32)
def _copy_program(shardings: tuple[Sharding, ...]):
    """A jitted copy of arrays on `shardings`, outputs on the same shardings (cached: the
    engine's arrays are new every step, their shardings are not)."""
    return jax.jit(_copy, out_shardings=list(shardings))


def snapshot(tree: Any, *, method: Method = "auto") -> Any:
    """`tree` with every jax.Array replaced by a copy no donation can reach, dispatched
    asynchronously (see the module docstring)."""
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    if not positions:
        return tree
    arrays = [leaves[i] for i in positions]
    devices = {d for a in arrays for d in a.sharding.device_set}
    out = list(leaves)
    if resolve_method(method, devices) == "pinned_host":
        # Extended dtypes (PRNG keys) have no host-memory layout: those are copied on device.
        is_key = lambda i: jax.dtypes.issubdtype(leaves[i].dtype, jax.dtypes.extended)
        keys = [i for i in positions if is_key(i)]
        hosted = [i for i in positions if not is_key(i)]
        copies = jax.device_put(
            [leaves[i] for i in hosted],
            [leaves[i].sharding.with_memory_kind("pinned_host") for i in hosted],
            may_alias=False,
        )
        for i, copy in zip(hosted, copies, strict=True):
            out[i] = copy
        positions = keys
    groups: dict[Any, list[int]] = {}
    for i in positions:
        groups.setdefault(_group_key(leaves[i].sharding), []).append(i)
    for group in groups.values():
        program = _copy_program(tuple(leaves[i].sharding for i in group))
        for i, copy in zip(group, program([leaves[i] for i in group]), strict=True):
            out[i] = copy
    return jax.tree.unflatten(treedef, out)
