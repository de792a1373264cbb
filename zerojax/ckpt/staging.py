"""Copy a tree of sharded jax.Arrays into host memory the copy owns, in few large copies.

An asynchronous checkpoint may only return to the training loop once the state is off the
device: the next step donates (overwrites) the very buffers being saved. Handing Orbax the
device arrays makes it copy every shard on its own (~3,000 copies for a GPT-2 + AdamW state
on 8 devices, ~0.3 ms of Python each). `HostStager.stage` returns the same tree as whole numpy
arrays instead, each global array assembled from its distinct shards (one copy of replicated
blocks), so that the writer only ever reads host memory that no training step can touch.

    >>> stager = HostStager()
    >>> host_tree = stager.stage({"w": w_sharded, "step": step})  # numpy arrays, owned
    >>> write(host_tree)                                           # e.g. in the background
    >>> stager.release()       # the writer is done: the next stage() may reuse that memory

How the bytes leave the device (`method`):

- "views" (default on CPU devices, where device memory *is* host memory): each distinct shard
  is read through a zero-copy numpy view of its buffer and copied once into the staging area,
  the large copies split over a few threads (numpy releases the GIL while copying).
- "pack" (default on accelerators): per device and dtype, one jitted program ravels and
  concatenates every distinct shard living on that device into one buffer (several of at most
  256 MiB for a large share, two rounds of them in flight: bounded extra device memory); the
  device-to-host copies of all those buffers start at once (`copy_to_host_async`), then each
  is split on the host into the staging area. One transfer per device and dtype instead of
  one per shard.

The staging area is one host buffer, reused by the next `stage` of a tree with the same
shapes and dtypes once `release()` says the previous staged tree is no longer read: writing
into freshly allocated memory costs its first-touch page faults, up to several times the copy
itself (409 MiB on the 2-core bench host: 250-3,600 ms into new pages, 240-520 ms into reused
ones). The area stays allocated until `clear()` (one host copy of the state, as torch DCP's
cached stager or pinned-memory async checkpointing keep). What remains is the copy: shards of
~0.4 MiB copy at about half the speed of one 409 MiB memcpy (glibc's memcpy uses non-temporal
stores only for copies of several MiB), so staging costs ~2.5x one memcpy of the state.

Concurrency contract: `stage` returns once every byte is copied (the device arrays may be
donated right after). The arrays it returns are overwritten only by a `stage` called after
`release()`: stage, hand the tree to the writer, release once the writer is done with it; a
tree never released is never overwritten (the next `stage` allocates anew). Call a HostStager
from one thread at a time.

Leaves that are not jax/numpy arrays pass through unchanged, as do arrays with extended dtypes
(PRNG keys). Several processes: `stage` returns the tree as it is (no process holds whole
arrays; Orbax copies and writes each process's own shards).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import os
from collections import defaultdict
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["HostStager", "stage_to_host", "stages_to_host"]

Method = Literal["auto", "views", "pack"]

_ALIGN = 64
"""Byte alignment of every array in the staging area (cache line; numpy/tensorstore need only
the itemsize)."""
_PACK_BUFFER_BYTES = 1 << 28
"""At most this many bytes per packed device buffer ("pack"): a device holds at most two rounds
of them beside the state, 512 MiB, however large its share of the state."""
_MIN_PARALLEL_BYTES = 1 << 16
"""Copies below this size stay on the calling thread: numpy holds the GIL for them anyway."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Leaf:
    """Where one staged leaf lives in the staging area."""

    index: int  # position among the tree's leaves
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int  # bytes into the area


def _stageable(leaf: Any) -> bool:
    if isinstance(leaf, np.ndarray):
        return not leaf.dtype.hasobject
    if isinstance(leaf, jax.Array):
        return not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)
    return False


def _layout(leaves: list) -> tuple[list[_Leaf], int]:
    placed, offset = [], 0
    for i, leaf in enumerate(leaves):
        if not _stageable(leaf):
            continue
        dtype = np.dtype(leaf.dtype)
        placed.append(_Leaf(i, tuple(leaf.shape), dtype, offset))
        offset += -(-math.prod(leaf.shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return placed, offset


def _view(area: np.ndarray, leaf: _Leaf) -> np.ndarray:
    nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
    return area[leaf.offset : leaf.offset + nbytes].view(leaf.dtype).reshape(leaf.shape)


def _resolve(method: Method, arrays: list[jax.Array]) -> Literal["views", "pack"]:
    if method != "auto":
        return method
    # On CPU devices a shard's buffer is host memory already: packing would add a copy (and
    # XLA:CPU concatenates ~370 operands slowly: 765 ms vs 338 ms for views, 409 MiB, 8 devices).
    on_cpu = all(d.platform == "cpu" for a in arrays for d in a.sharding.device_set)
    return "views" if on_cpu else "pack"


@jax.jit
def _pack(blocks: list[jax.Array]) -> jax.Array:
    """All blocks (one device, one dtype) raveled into one buffer, in order."""
    return jnp.concatenate([b.ravel() for b in blocks])


@dataclasses.dataclass(frozen=True, slots=True)
class _Block:
    """One distinct block of an array: `array.addressable_data(position)` is `array[index]`."""

    position: int
    index: tuple
    device: jax.Device


class HostStager:
    """Stages trees of (sharded) jax.Arrays into a reusable host buffer; see the module
    docstring for the method and the concurrency contract.

    `method`: "auto" (views on CPU devices, pack elsewhere), "views" or "pack".
    `reuse`: keep the staging area for the next `stage` (False: fresh memory every time).
    `num_threads`: threads sharing the host-side copies (default: the CPUs, at most 8; the
    training loop waits for `stage`, so its cores are free, and ~8 threads saturate a host's
    memory bandwidth).
    """

    def __init__(
        self, *, method: Method = "auto", reuse: bool = True, num_threads: int | None = None
    ) -> None:
        if method not in ("auto", "views", "pack"):
            raise ValueError(f"HostStager: method={method!r}; use 'auto', 'views' or 'pack'")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"HostStager: num_threads={num_threads}; use >= 1 or None")
        self.method = method
        self.reuse = reuse
        self.num_threads = num_threads or max(1, min(8, _cpu_count()))
        self._area: np.ndarray | None = None
        self._area_free = False  # the last staged tree was released: _area may be overwritten
        # (sharding, shape) -> its distinct blocks. Building Shard objects for every array
        # (`addressable_shards`) cost ~45 ms per save for 374 arrays; the engine's arrays are
        # new every step, their shardings are not.
        self._blocks: dict[tuple, list[_Block]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def stage(self, tree: Any) -> Any:
        """`tree` with every array replaced by a host numpy array holding the same values,
        in memory of this stager's (valid until the `release()` after the next `stage`)."""
        if not stages_to_host():
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        placed, nbytes = _layout(leaves)
        area = self._take_area(nbytes)
        out = list(leaves)
        copies: list[tuple[np.ndarray, Any, Any]] = []  # (destination, index, source)
        device_arrays: list[tuple[np.ndarray, jax.Array]] = []
        for leaf in placed:
            value = leaves[leaf.index]
            out[leaf.index] = dst = _view(area, leaf)
            if isinstance(value, np.ndarray):
                copies.append((dst, Ellipsis, value))
            elif not value.is_fully_addressable:
                raise ValueError(  # cannot happen in one process; guards a future caller
                    f"HostStager.stage: leaf {leaf.index} {value.shape} {value.dtype} is not "
                    f"fully addressable; stage only single-process trees"
                )
            elif dst.size:
                device_arrays.append((dst, value))
        arrays = [a for _, a in device_arrays]
        if arrays and _resolve(self.method, arrays) == "pack":
            blocks = [(dst, a, self.distinct_blocks(a)) for dst, a in device_arrays]
            for round_copies in _packed_rounds(blocks, _PACK_BUFFER_BYTES):
                self._run(round_copies)
        else:
            for dst, a in device_arrays:
                for block in self.distinct_blocks(a):
                    copies.append((dst, block.index, a.addressable_data(block.position)))
        self._run(copies)
        return jax.tree.unflatten(treedef, out)

    def distinct_blocks(self, array: jax.Array) -> list[_Block]:
        """The blocks to copy: one per distinct index (replica 0 of a replicated block)."""
        key = (array.sharding, array.shape)
        blocks = self._blocks.get(key)
        if blocks is None:
            shards = array.addressable_shards
            blocks = [
                _Block(i, s.index, s.device) for i, s in enumerate(shards) if s.replica_id == 0
            ]
            # addressable_data(i) is the i-th shard's data (its device's buffer).
            assert all(array.addressable_data(b.position).device == b.device for b in blocks)
            self._blocks[key] = blocks
        return blocks

    def release(self) -> None:
        """The last staged tree is no longer read: the next `stage` may overwrite it."""
        self._area_free = True

    def clear(self) -> None:
        """Drop the staging area (arrays already handed out keep their memory alive) and the
        copying threads."""
        self._area, self._area_free = None, False
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _take_area(self, nbytes: int) -> np.ndarray:
        area = self._area
        if not (self.reuse and self._area_free and area is not None and area.size == nbytes):
            area = np.empty(max(nbytes, 1), np.uint8)
        self._area = area if self.reuse else None
        self._area_free = False
        return area

    def _run(self, copies: list[tuple[np.ndarray, Any, Any]]) -> None:
        """dst[index] = src for every copy; the large ones shared with the pool's threads.

        np.asarray of a CPU shard is a zero-copy view, so each byte is copied once."""
        jobs = [(dst, index, np.asarray(src)) for dst, index, src in copies]  # Python: GIL
        large = [j for j in jobs if j[2].nbytes >= _MIN_PARALLEL_BYTES]
        if self.num_threads == 1 or len(large) < 2:
            for dst, index, src in jobs:
                dst[index] = src
            return
        # Balance bytes over the pool's threads and this one: largest first, least loaded.
        groups: list[list] = [[] for _ in range(self.num_threads)]
        loads = [0] * self.num_threads
        for job in sorted(large, key=lambda j: -j[2].nbytes):
            i = loads.index(min(loads))
            groups[i].append(job)
            loads[i] += job[2].nbytes
        if self._pool is None:  # kept: starting threads for every save costs ~10 ms each
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.num_threads - 1, thread_name_prefix="zerojax-staging"
            )
        running = [self._pool.submit(_copy_all, g) for g in groups[1:] if g]
        _copy_all(groups[0] + [j for j in jobs if j[2].nbytes < _MIN_PARALLEL_BYTES])
        for future in running:
            future.result()


def _copy_all(jobs: list) -> None:
    for dst, index, src in jobs:
        dst[index] = src  # numpy releases the GIL while it copies


def _packed_rounds(arrays: list[tuple[np.ndarray, jax.Array, list[_Block]]], budget: int):
    """Yields lists of (destination, index, host block) copies, one list per round.

    Per (device, dtype), the distinct blocks are cut into chunks of at most `budget` bytes
    (a larger block is a chunk of its own); round r packs the r-th chunk of every group into
    one device buffer each and starts all their device-to-host copies, then hands over round
    r-1's host data while those run. At most two rounds of buffers live on a device, so
    packing adds at most 2 x `budget` bytes to a device's memory, whatever the state's size."""
    groups: dict[tuple, list[list]] = defaultdict(lambda: [[]])
    sizes: dict[tuple, int] = defaultdict(int)
    for dst, array, blocks in arrays:
        for block in blocks:
            data = array.addressable_data(block.position)
            key = (block.device, np.dtype(array.dtype))
            if sizes[key] and sizes[key] + data.nbytes > budget:
                groups[key].append([])
                sizes[key] = 0
            groups[key][-1].append((dst, block.index, data))
            sizes[key] += data.nbytes
    in_flight: list = []
    for chunks in itertools.zip_longest(*groups.values()):
        started = [_start_transfer(chunk) for chunk in chunks if chunk]
        if in_flight:
            yield _host_blocks(in_flight)
        in_flight = started
    if in_flight:
        yield _host_blocks(in_flight)


def _start_transfer(chunk: list) -> tuple[list, jax.Array]:
    blocks = [data for _, _, data in chunk]
    # A lone block needs no packing: its own buffer is the one transfer.
    buffer = blocks[0] if len(blocks) == 1 else _pack(blocks)
    buffer.copy_to_host_async()
    return chunk, buffer


def _host_blocks(started: list) -> list:
    copies = []
    for chunk, buffer in started:
        host = np.asarray(buffer)  # waits for this buffer's transfer only
        if len(chunk) == 1:
            dst, index, _ = chunk[0]
            copies.append((dst, index, host))
            continue
        offset = 0
        for dst, index, data in chunk:
            copies.append((dst, index, host[offset : offset + data.size].reshape(data.shape)))
            offset += data.size
    return copies


def stages_to_host() -> bool:
    """Whether `HostStager.stage` copies arrays to host here: in a single process only (with
    several, no process holds whole arrays; the tree is returned as it is)."""
    return jax.process_count() == 1


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def stage_to_host(tree: Any, *, method: Method = "auto") -> Any:
    """One-off `HostStager(reuse=False).stage(tree)`: fresh host arrays the caller owns."""
    return HostStager(method=method, reuse=False).stage(tree)
