"""Restore's fast path: the arrays of an Orbax item read straight from the files Orbax wrote,
each byte read once and checked against the step's manifest as it is read.

Why: restoring the bench's 409 MiB state through Orbax took 685 ms to read the arrays into host
memory, on a host where reading every file of the step once takes 111 ms, and the manifest's
crc32 pass read every byte a second time (BENCHMARKS.md, "Where a restore's time goes"):
TensorStore decodes the item's 2,978 chunks one by one through the OCDBT b-tree, and Orbax
drives it with ~0.2 ms of Python per array. The files themselves are simple: Orbax stores a
PyTree item as zarr v2 arrays (one chunk per shard written) in an OCDBT key-value database,
and zerojax saves them uncompressed (`checkpointer._handlers`), so every chunk is its array's
raw little-endian bytes at some offset of some data file.

How (one process; `Checkpointer._read_arrays` decides):

1. `plan_item` lists the item's b-tree with TensorStore's own OCDBT reader
   (`tensorstore.ocdbt.dump`: the manifest, then the root node): for every key its value,
   inline (small chunks and each array's `.zarray`) or as (data file, offset, length). The
   b-tree nodes carry their own crc32c, which TensorStore checks as it decodes them; the files
   holding them are small and are checked against the manifest by the usual pass.
2. `DirectRead.read` streams every data file of the item once, in offset order, on a few
   threads (`readinto` and the hash release the GIL): a chunk whose place in its
   destination array is contiguous (ZeRO's row shards, replicated arrays) is read straight
   into it, any other chunk into a scratch buffer and copied into place, and the bytes between
   chunks into scratch. The file's checksum (the manifest entry's kind: xxh3_64, or crc32 in
   manifests from before 2026-11-28) is computed over those same bytes right after they are
   read, while they are still in cache, and compared with the manifest: the bytes restored are
   the bytes verified, and the manifest pass skips these files (`verify_manifest(skip=)`). A
   size or checksum that differs raises the manifest's own CheckpointCorruptedError naming the
   file. At xxh3_64's ~32 GB/s the hash costs a fraction of the read's copy from the page
   cache (~9 GB/s here); zlib's crc32 (1.1-4 GB/s) was most of a restore's time.

Anything this reader does not know -- compressed chunks (older zerojax saves, Orbax defaults),
zarr v3, a b-tree of more than one node, a missing chunk (Orbax's fill value), an unknown dtype
or byte order, a file shorter than its offsets say -- raises `Unsupported`, and the item (or
the array: another shape or dtype than the target's) goes through Orbax as before. Nothing is
written to disk differently: a checkpoint stays what Orbax reads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import jax
import numpy as np

from zerojax.ckpt.manifest import (
    checksum_kind,
    file_checksum,
    file_problem,
    new_hasher,
    unreadable_problem,
)

__all__ = ["DirectRead", "ItemPlan", "StoredArray", "Unsupported", "plan_item"]

_READ_THREADS = 4
"""Data files streamed at once: enough to overlap one file's hash with another's read."""
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _read_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The read threads, started once per process: a restore that started its own spent
    ~2 ms a thread starting them (14 per restore of the bench state)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                _READ_THREADS, thread_name_prefix="zerojax-read"
            )
        return _pool


def _forget_pool() -> None:
    # A forked child (a DataLoader worker) has none of the parent's threads: a pool inherited
    # from it would queue work that nothing runs.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)
_SCRATCH = 1 << 22
"""Bytes between chunks (and chunks read out of place) go through a scratch buffer this big."""


class Unsupported(Exception):
    """The item's layout is not one this reader knows: read it through Orbax instead."""


class _Value(NamedTuple):
    # A tuple, not a frozen dataclass: built once per chunk of a step (~4,800 for the bench
    # state), where a frozen dataclass's __init__ cost twice as much.
    inline: bytes | None
    file: str | None  # relative to the step directory
    offset: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class StoredArray:
    """One zarr v2 array of an item: shape, dtype, chunk shape, and where each chunk lies."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    values: dict[tuple[int, ...], _Value]

    def chunk_grid(self) -> Iterable[tuple[int, ...]]:
        counts = [math.ceil(s / c) if c else 0 for s, c in zip(self.shape, self.chunks)]
        return np.ndindex(*counts)


@dataclasses.dataclass(frozen=True, slots=True)
class ItemPlan:
    """Every array of an Orbax item (by Orbax's parameter name) and the data files holding
    their chunks (relative to the step directory)."""

    arrays: dict[str, StoredArray]
    files: frozenset[str]


def _dtype(text: str) -> np.dtype:
    try:
        dtype = np.dtype(text)
    except TypeError:
        import ml_dtypes  # bfloat16 and the float8s: JAX's own dtypes

        dtype = np.dtype(getattr(ml_dtypes, text.lstrip("<>|"), None) or "V0")
    if dtype.kind == "V" or dtype.hasobject:
        raise Unsupported(f"dtype {text!r}")
    # Chunks are read into native arrays as they are: little-endian data on a little-endian
    # host only.
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder != "little"):
        raise Unsupported(f"byte order of {text!r}")
    return dtype


def _value(entry: Mapping, item: str, files: Mapping[str, dict]) -> _Value:
    if "inline_value" in entry:
        data = entry["inline_value"]
        if not isinstance(data, bytes):
            raise Unsupported("inline value is not bytes")
        return _Value(data, None, 0, len(data))
    ref = entry.get("indirect_value")
    if not isinstance(ref, str) or not ref.startswith("value:"):
        raise Unsupported(f"value reference {ref!r}")
    # "value:<base path>:<relative path>:<offset>:<length>", paths relative to the item.
    head, offset, length = ref[len("value:") :].rsplit(":", 2)
    base, _, rel = head.partition(":")
    path = f"{item}/{base}{rel}"
    if path not in files:
        raise Unsupported(f"data file {path!r} is not in the manifest")
    return _Value(None, path, int(offset), int(length))


def plan_item(step_dir: str, item: str, files: Mapping[str, dict]) -> ItemPlan:
    """Where every chunk of item `item` lies (see the module docstring); `files` is the step's
    manifest (`read_manifest`). Raises Unsupported for a layout this reader does not know."""
    import tensorstore as ts

    try:
        base = ts.KvStore.open(
            {"driver": "file", "path": os.path.join(step_dir, item) + "/"}
        ).result()
        manifest = ts.ocdbt.dump(base).result()
        version = manifest["versions"][-1]
        if version["root_height"] != 0:
            raise Unsupported("b-tree deeper than one node")
        if "location" not in version["root"]:
            return ItemPlan({}, frozenset())  # an empty database
        node = ts.ocdbt.dump(base, version["root"]["location"]).result()
    except Unsupported:
        raise
    except Exception as e:  # damaged, or not OCDBT: Orbax's read reports it
        raise Unsupported(f"{type(e).__name__}: {e}") from e
    metadata: dict[str, dict] = {}
    chunks: dict[str, dict[str, _Value]] = {}
    for entry in node["entries"]:
        key = entry["key"].decode() if isinstance(entry["key"], bytes) else entry["key"]
        name, _, leaf = key.rpartition("/")
        if leaf == ".zarray":
            value = _value(entry, item, files)
            if value.inline is None:
                raise Unsupported(f"{key}: metadata out of line")
            metadata[name] = json.loads(value.inline)
        elif not leaf.startswith("."):
            chunks.setdefault(name, {})[leaf] = _value(entry, item, files)
    arrays = {}
    for name, meta in metadata.items():
        if (
            meta.get("zarr_format") != 2
            or meta.get("compressor") is not None
            or meta.get("filters") is not None
            or meta.get("order", "C") != "C"
        ):
            raise Unsupported(f"{name}: zarr metadata {meta!r}")
        shape, chunk_shape = tuple(meta["shape"]), tuple(meta["chunks"])
        dtype = _dtype(meta["dtype"])
        separator = meta.get("dimension_separator", ".")
        stored = StoredArray(shape, dtype, chunk_shape, {})
        chunk_bytes = math.prod(chunk_shape) * dtype.itemsize
        own = chunks.get(name, {})
        for index in stored.chunk_grid():
            key = separator.join(map(str, index)) if index else "0"
            found = own.get(key)
            if found is None or found.length != chunk_bytes:
                # Absent: Orbax's fill value; another length: compressed or not zarr v2 bytes.
                raise Unsupported(f"{name}: chunk {key}")
            stored.values[tuple(index)] = found
        arrays[name] = stored
    files_used = frozenset(
        v.file for a in arrays.values() for v in a.values.values() if v.file is not None
    )
    return ItemPlan(arrays, files_used)


# --------------------------------------------------------------------------- reading

_ALIGN = 64  # XLA's CPU client aliases a host array aligned to this instead of copying it


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    offset = -raw.ctypes.data % _ALIGN
    return raw[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


@functools.lru_cache(maxsize=256)
def _chunk_of_device(sharding, shape: tuple[int, ...], chunks: tuple[int, ...]):
    """(device, chunk index) of every addressable device when each device's shard of an array
    of `shape` on `sharding` is exactly one stored chunk of shape `chunks`; else None. Cached:
    a model's arrays share a few (sharding, shape) pairs (the bench GPT-2: 1,119 arrays)."""
    found = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        chunk = []
        for s, c, dim in zip(index, chunks, shape, strict=True):
            start, stop, _ = s.indices(dim)
            if c == 0 or start % c or stop - start != c:
                return None
            chunk.append(start // c)
        found.append((device, tuple(chunk)))
    return tuple(found)


def _shard_buffers(array: StoredArray, struct: jax.ShapeDtypeStruct) -> dict | None:
    """{"buffers": {chunk index: host buffer}, "chunks": {first element: the same buffer}}
    when every addressable device's shard of `struct` is exactly one whole stored chunk; else
    None. The shards' buffers are consecutive pieces of one allocation when a chunk's bytes
    keep each piece aligned (they live and die together, as the array's shards)."""
    placed = _chunk_of_device(struct.sharding, array.shape, array.chunks)
    if placed is None:
        return None
    indices = sorted({chunk for _, chunk in placed})
    chunk_bytes = math.prod(array.chunks) * array.dtype.itemsize
    if chunk_bytes and chunk_bytes % _ALIGN == 0:
        block = _aligned_empty((len(indices), *array.chunks), array.dtype)
        buffers = dict(zip(indices, block, strict=True))
    else:
        buffers = {i: _aligned_empty(array.chunks, array.dtype) for i in indices}
    # By each shard's first element, which is how a shard's index names its chunk.
    chunks = {tuple(i * c for i, c in zip(index, array.chunks)): b for index, b in buffers.items()}
    return {"buffers": buffers, "chunks": chunks}


def _into_whole(array: StoredArray, index: tuple[int, ...], dest: np.ndarray):
    """(destination bytes, None) when chunk `index` is one run of `dest`'s memory, else
    (None, where to copy it)."""
    region = _chunk_region(array, index)
    if all(r.stop - r.start == c for r, c in zip(region, array.chunks)) and _contiguous(
        array.shape, region
    ):
        first = [r.start for r in region]
        start = (int(np.ravel_multi_index(first, array.shape)) if array.shape else 0) * (
            array.dtype.itemsize
        )
        length = math.prod(array.chunks) * array.dtype.itemsize
        return dest.reshape(-1).view(np.uint8).data[start : start + length], None
    return None, (dest, region, array)


def _place(struct: jax.ShapeDtypeStruct, shards: dict | None, dest: np.ndarray | None):
    """One read array on its devices: `shards` (`_shard_buffers`) or the array assembled whole
    (`dest`). Shard buffers become the shards through `jax.make_array_from_callback` (JAX's
    batched placement: ~3x fewer microseconds per shard than `jax.device_put` of a list
    here); a device sharing a shard with another gets a copy, so that no two device arrays
    alias one buffer. An array assembled whole is sliced onto its devices the same way (the
    bench's 249 small arrays onto ZeRO-3 shardings: 19 ms, where one `jax.device_put` of the
    list took 44 ms); a device whose slice another device already holds gets a copy (a fully
    replicated array is one value for every device, which JAX hands out as `jax.device_put`
    does)."""
    if shards is not None:
        chunks = shards["chunks"]
        handed: set[tuple[int, ...]] = set()

        def shard(index):
            first = tuple(s.indices(d)[0] for s, d in zip(index, struct.shape, strict=True))
            buffer = chunks[first]
            if first in handed:
                return np.array(buffer)
            handed.add(first)
            return buffer

        return jax.make_array_from_callback(struct.shape, struct.sharding, shard)
    assert dest is not None  # one of the two, `_pieces` says which
    sliced: set[tuple] = set()

    def piece(index):
        key = tuple(s.indices(d) for s, d in zip(index, struct.shape, strict=True))
        if key in sliced:
            return np.array(dest[index])
        sliced.add(key)
        return dest[index]

    return jax.make_array_from_callback(struct.shape, struct.sharding, piece)


def _chunk_region(array: StoredArray, index: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(
        slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, array.chunks, array.shape)
    )


def _contiguous(shape: tuple[int, ...], region: tuple[slice, ...]) -> bool:
    """Whether `region` of a C-ordered array of `shape` is one run of memory."""
    extents = [r.stop - r.start for r in region]
    dims = [d for d, e in enumerate(extents) if e != 1]
    return not dims or all(extents[d] == shape[d] for d in dims[1:])


@dataclasses.dataclass(slots=True)
class _Piece:
    offset: int
    length: int
    into: memoryview | None  # the destination bytes, when contiguous
    place: tuple[np.ndarray, tuple[slice, ...], StoredArray] | None  # else: copied there


class DirectRead:
    """The data files of the planned items of one step, each checked exactly once: by the
    reader as it reads an item, or by `verify_unread` for files no read took."""

    def __init__(self, step_dir: str, files: Mapping[str, dict], plans: Mapping[str, ItemPlan]):
        self.step_dir = step_dir
        self.files = files
        self.plans = dict(plans)
        self.skip = frozenset(f for plan in self.plans.values() for f in plan.files)
        """What the manifest pass leaves to this reader (`verify_manifest(skip=)`)."""
        self._checked: set[str] = set()
        self._lock = threading.Lock()

    def read(self, item: str, wanted: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        """{name: jax.Array on its target's sharding} for every name in `wanted` (targets with
        the shape and dtype the item's plan holds); every data file of the item is read whole
        and checked against the manifest. `read_items` reads several items in one pass."""
        return self.read_items({item: wanted})[item]

    def read_items(
        self, wanted: Mapping[str, Mapping[str, jax.ShapeDtypeStruct]]
    ) -> dict[str, dict[str, jax.Array]]:
        """`read` of several items ({item: {name: target}}) at once: the data files of all of
        them are streamed by the same threads, largest first, so that one item's largest file
        does not end the restore alone.

        Where each device's shard is exactly one stored chunk (a restore onto the mesh that
        saved), the chunk is read straight into its piece of one aligned allocation per array
        (`_shard_buffers`), which becomes the device's array without a copy (`jax.device_put`
        of an aligned numpy array on a CPU device aliases it; elsewhere it is one transfer);
        otherwise the array is assembled whole in host memory and
        `jax.make_array_from_callback` slices it onto its devices.

        Reading and placing overlap: an array is placed on its devices, on this thread, as
        soon as every file holding one of its chunks has been read and checked, while the
        other files are still being read (bench state, interleaved: 144 -> 138 ms a restore;
        the reads end with the largest file, so what overlaps is the placing of the arrays
        in the others). Every file is handed to the read threads at once, largest first:
        handing each item's files over as soon as that item was laid out started the largest
        file later, and the restore took 271 instead of 179 ms."""
        pool = _read_pool()
        futures: dict[concurrent.futures.Future, str] = {}
        waiting: dict[str, list[tuple[str, str]]] = {}  # file -> arrays with chunks in it
        left: dict[tuple[str, str], int] = {}  # array -> its files not read yet
        destinations: dict[tuple[str, str], tuple] = {}
        out: dict[str, dict[str, jax.Array]] = {item: {} for item in wanted}
        by_file: dict[str, list[_Piece]] = {}
        try:
            for item, item_wanted in wanted.items():
                placing = self._pieces(item, item_wanted, by_file)
                for name, (struct, shards, dest, files) in placing.items():
                    if not files:
                        out[item][name] = _place(struct, shards, dest)
                        continue
                    destinations[item, name] = (struct, shards, dest)
                    left[item, name] = len(files)
                    for f in files:
                        waiting.setdefault(f, []).append((item, name))
            for f in sorted(by_file, key=lambda f: -self.files[f]["size"]):
                futures[pool.submit(self._read_file, f, by_file[f])] = f
            for future in concurrent.futures.as_completed(futures):
                future.result()
                for item, name in waiting.get(futures[future], ()):
                    left[item, name] -= 1
                    if not left[item, name]:
                        out[item][name] = _place(*destinations.pop((item, name)))
        finally:
            # On an error the rest stops before its next file: nothing waits on a restore that
            # already failed, and no thread writes into buffers once this returns.
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)
        return out

    def _pieces(self, item: str, wanted: Mapping[str, jax.ShapeDtypeStruct], by_file: dict):
        """Where each chunk of `item` goes, added to `by_file` ({data file: [_Piece]}); returns
        {name: (target, shard buffers or None, whole destination or None, the data files
        holding its chunks)} for every wanted array, what `_place` turns into the array once
        those files are read."""
        plan = self.plans[item]
        for f in plan.files:
            by_file.setdefault(f, [])
        placing: dict[str, tuple] = {}
        for name, array in plan.arrays.items():
            struct = wanted.get(name)
            shards, dest = None, None
            if struct is not None:
                shards = _shard_buffers(array, struct)
                if shards is None:
                    dest = np.empty(array.shape, array.dtype)
            files: set[str] = set()
            for index, value in array.values.items():
                into, place = None, None  # not wanted: read, checked, dropped
                if shards is not None:
                    buffer = shards["buffers"][index]
                    into = buffer.reshape(-1).view(np.uint8).data
                elif dest is not None:
                    into, place = _into_whole(array, index, dest)
                if value.file is None:
                    if into is not None or place is not None:
                        _put(value.inline, into, place)
                    continue
                files.add(value.file)
                by_file[value.file].append(_Piece(value.offset, value.length, into, place))
            if struct is not None:
                placing[name] = (struct, shards, dest, files)
        return placing

    def verify_unread(self) -> None:
        """Check the data files of planned items that no `read` took (the optimizer's, when
        the optimizer was not restored) against the manifest."""
        for rel in sorted(self.skip - self._checked):
            path = os.path.join(self.step_dir, rel)
            expected = self.files[rel]
            try:
                size = os.stat(path).st_size
                same = size == expected["size"]
                checksum = file_checksum(path, checksum_kind(expected)) if same else None
            except OSError as error:
                raise unreadable_problem(path, expected, error) from error
            if problem := file_problem(path, expected, size=size, checksum=checksum):
                raise problem
            self._checked.add(rel)

    def _read_file(self, rel: str, pieces: list[_Piece]) -> None:
        path = os.path.join(self.step_dir, rel)
        expected = self.files[rel]
        try:
            checksum, size = self._stream(path, rel, pieces)
        except OSError as error:
            raise unreadable_problem(path, expected, error) from error
        if problem := file_problem(path, expected, size=size, checksum=checksum):
            raise problem
        with self._lock:
            self._checked.add(rel)

    def _stream(self, path: str, rel: str, pieces: list[_Piece]) -> tuple[int, int]:
        """(checksum, size) of the file at `path`, every piece read into its place on the way."""
        expected = self.files[rel]
        hasher = new_hasher(checksum_kind(expected))
        scratch = bytearray(_SCRATCH)
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if problem := file_problem(path, expected, size=size, checksum=None):
                raise problem
            position = 0
            for piece in sorted(pieces, key=lambda p: p.offset):
                if piece.offset < position or piece.offset + piece.length > size:
                    raise Unsupported(f"{rel}: chunk at {piece.offset}+{piece.length}")
                _skip(f, piece.offset - position, hasher, scratch, rel)
                if piece.into is not None:
                    _read_exactly(f, piece.into, rel)
                    hasher.update(piece.into)
                else:
                    if piece.length > len(scratch):
                        scratch = bytearray(piece.length)
                    view = memoryview(scratch)[: piece.length]
                    _read_exactly(f, view, rel)
                    hasher.update(view)
                    if piece.place is not None:
                        _put(view, None, piece.place)
                position = piece.offset + piece.length
            _skip(f, size - position, hasher, scratch, rel)
        return hasher.intdigest(), size


def _read_exactly(f, view: memoryview, rel: str) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise Unsupported(f"{rel}: ends early")  # shorter than its stat said: Orbax names it
        done += n


def _skip(f, count: int, hasher, scratch: bytearray, rel: str) -> None:
    """Read `count` bytes no array takes (and fold them into the checksum)."""
    view = memoryview(scratch)
    while count > 0:
        part = view[: min(count, len(view))]
        _read_exactly(f, part, rel)
        hasher.update(part)
        count -= len(part)


def _put(data, into: memoryview | None, place) -> None:
    if into is not None:
        into[:] = data
        return
    dest, region, array = place
    chunk = np.frombuffer(data, array.dtype).reshape(array.chunks)
    dest[region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]
