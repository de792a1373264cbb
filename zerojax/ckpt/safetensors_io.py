"""The safetensors format, read through np.memmap and written one tensor at a time.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 N, a JSON
header of N bytes -- {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
"__metadata__": {str: str}} padded with spaces to a multiple of 8 -- then the tensors' raw
little-endian bytes, offsets relative to the end of the header, covering the data section
without gaps. Since the header needs only shapes and dtypes, it is written first and the
tensors are appended as they arrive, so a writer holds one tensor at a time.

    >>> with open(tmp, "wb") as f:
    ...     writer = SafetensorsWriter(f, [("w", (4, 3), np.dtype("float32"))])
    ...     writer.write("w", w_array)
    ...     writer.close()
    >>> arrays = read_safetensors("model.safetensors")   # {name: read-only memmap view}

This module is ours rather than the `safetensors` package's because that package writes from
a complete dict in memory; it is not a dependency of zerojax.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections import Counter
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from zerojax.ckpt.errors import CheckpointFormatError
from zerojax.ckpt.torch_io import NUMPY_DTYPES

__all__ = ["SAFETENSORS_DTYPES", "SafetensorsWriter", "read_safetensors"]

SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
"""numpy/torch dtype name -> safetensors dtype code, for the dtypes the tools support."""

_FROM_CODE = {code: NUMPY_DTYPES[name] for name, code in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the limit the reference implementation enforces

if sys.byteorder != "little":  # raw bytes are little-endian; our arrays are native-endian
    raise ImportError("zerojax.ckpt.safetensors_io supports little-endian hosts only")


def _code(dtype: np.dtype) -> str:
    code = SAFETENSORS_DTYPES.get(np.dtype(dtype).name)
    if code is None:
        raise ValueError(
            f"dtype {np.dtype(dtype).name!r} cannot be written to safetensors by zerojax; "
            f"supported: {', '.join(SAFETENSORS_DTYPES)}"
        )
    return code


class SafetensorsWriter:
    """Streams tensors into a safetensors file: header from `entries` up front, then
    `write(name, array)` in the data order (`data_order`, by default the entries' order).

    `entries` are (name, shape, numpy dtype) in the order the header lists them;
    `data_order` may place the data differently (tied copies next to their source, so the
    source array is written twice while it is in memory). `file` is a binary file object;
    the caller owns renaming it into place.
    """

    def __init__(
        self,
        file: BinaryIO,
        entries: list[tuple[str, tuple[int, ...], np.dtype]],
        *,
        data_order: list[str] | None = None,
        metadata: dict[str, str] | None = None,
    ):
        self._file = file
        spec = {name: (tuple(int(d) for d in shape), np.dtype(dt)) for name, shape, dt in entries}
        if len(spec) != len(entries):
            raise ValueError("SafetensorsWriter: duplicate entry names")
        order = list(spec) if data_order is None else list(data_order)
        if sorted(order) != sorted(spec):
            raise ValueError("SafetensorsWriter: data_order must list every entry once")
        offsets, position = {}, 0
        for name in order:
            shape, dtype = spec[name]
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            offsets[name] = (position, position + size)
            position += size
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        for name, (shape, dtype) in spec.items():
            header[name] = {
                "dtype": _code(dtype),
                "shape": list(shape),
                "data_offsets": list(offsets[name]),
            }
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        self._spec, self._order, self._next = spec, order, 0
        self.total_bytes = position

    def write(self, name: str, array: np.ndarray) -> None:
        """Append the bytes of entry `name`, the next one in the data order."""
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise ValueError(f"SafetensorsWriter: got {name!r}, expected {expected!r} next")
        shape, dtype = self._spec[name]
        if array.dtype != dtype or tuple(array.shape) != shape:
            raise ValueError(
                f"SafetensorsWriter: {name!r} is {array.dtype}{list(array.shape)}, the header "
                f"says {dtype}{list(shape)}"
            )
        # memoryview of the contiguous array: written without a bytes() copy.
        self._file.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        self._next += 1

    def close(self) -> None:
        missing = self._order[self._next :]
        if missing:
            raise ValueError(f"SafetensorsWriter: no data written for {missing[:5]}")
        self._file.flush()


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a validated header: dtype, shape and byte range in the data section."""

    name: str
    code: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_int(value: object) -> bool:
    # JSON true/false arrive as bool, a subclass of int: never a size or an offset.
    return isinstance(value, int) and not isinstance(value, bool)


class _JSONObject(dict):
    """A JSON object that remembers the keys it held more than once (json.loads keeps the
    last of two equal keys silently; the reference reader refuses the file)."""

    duplicates: list[str]


def _json_object(pairs: list[tuple[str, object]]) -> _JSONObject:
    obj = _JSONObject(pairs)
    obj.duplicates = [key for key, count in Counter(k for k, _ in pairs).items() if count > 1]
    return obj


def _read_header(path: str) -> tuple[list[_Entry], dict[str, str], int, int]:
    """(entries in data order, metadata, data start, data size) of a safetensors file, every
    rule of the format checked before any tensor is touched.

    The rules are the reference reader's: a header of at most 100 MB that fits in the file, a
    JSON object of unique names, `__metadata__` a str -> str map, each entry a supported dtype
    code, a shape of non-negative ints, and `data_offsets` [begin, end] whose length is
    exactly the shape's byte count; sorted by offset, the tensors tile the data section with
    neither gaps nor overlaps, up to its last byte.
    """
    size = os.path.getsize(path)

    def bad(what: str, tensor: str | None = None) -> CheckpointFormatError:
        where = f"{path!r}: tensor {tensor!r}" if tensor is not None else repr(path)
        return CheckpointFormatError(
            f"{where}: not a safetensors file: {what}", path=path, tensor=tensor
        )

    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER:
            raise bad(f"header length {header_len} exceeds the format's limit of {_MAX_HEADER}")
        if header_len > size - 8:
            raise bad(f"header length {header_len} does not fit in its {size} bytes")
        raw = f.read(header_len)
    try:
        header = json.loads(raw, object_pairs_hook=_json_object)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad(f"bad JSON header ({type(exc).__name__}: {str(exc)[:100]})") from None
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    if header.duplicates:
        raise bad("the header lists it more than once", header.duplicates[0])
    # Absent or null is no metadata (the reference reader's Option<map>).
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = _json_object([])
    if (
        not isinstance(metadata, dict)
        or metadata.duplicates
        or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad(f"__metadata__ must map strings to strings, got {str(metadata)[:100]}")
    data_start, data_size = 8 + header_len, size - 8 - header_len

    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise bad(f"entry {str(info)[:100]} lacks dtype, shape and data_offsets", name)
        if info.duplicates:
            raise bad(f"its entry repeats {', '.join(info.duplicates)}", name)
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(code, str) or code not in _FROM_CODE:
            raise bad(f"dtype {code!r}; zerojax reads {', '.join(_FROM_CODE)}", name)
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise bad(f"shape {str(shape)[:100]} is not a list of non-negative ints", name)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
        ):
            raise bad(f"data_offsets {str(offsets)[:100]} is not a pair of ints [begin, end]", name)
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise bad(
                f"data_offsets [{begin}, {end}] are not 0 <= begin <= end <= {data_size}, the "
                f"size of the data section",
                name,
            )
        dtype = _FROM_CODE[code]
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
        if end - begin != nbytes:
            raise bad(
                f"{code}{shape} needs {nbytes} bytes, its data_offsets [{begin}, {end}] hold "
                f"{end - begin}",
                name,
            )
        entries.append(_Entry(name, code, dtype, tuple(shape), begin, end))

    # Sorted by offset, each tensor starts where the previous one ended: none overlaps another
    # (two names for the same bytes would alias), and no byte is left unaccounted for.
    entries_by_offset = sorted(entries, key=lambda e: (e.begin, e.end))
    position, previous = 0, None
    for entry in entries_by_offset:
        if entry.begin < position:
            raise bad(
                f"data_offsets [{entry.begin}, {entry.end}] overlap tensor {previous.name!r} "
                f"[{previous.begin}, {previous.end}]",
                entry.name,
            )
        if entry.begin > position:
            raise bad(
                f"data_offsets [{entry.begin}, {entry.end}] leave bytes [{position}, "
                f"{entry.begin}) of the data section to no tensor",
                entry.name,
            )
        position, previous = entry.end, entry
    if position != data_size:
        last = previous.name if previous is not None else None
        raise bad(
            f"the tensors end at byte {position} of a {data_size}-byte data section (bytes "
            f"after the last tensor)",
            last,
        )
    return entries, metadata, data_start, data_size


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """({name: array}, metadata) of a safetensors file, in header order.

    The whole header is validated first (`_read_header`); then arrays are read-only views of
    a memory map: nothing is read until used. A malformed file raises CheckpointFormatError
    (a ValueError) naming the file, the tensor at fault and the broken rule.

    >>> arrays, metadata = read_safetensors("model.safetensors")
    """
    path = os.fspath(path)
    entries, metadata, data_start, data_size = _read_header(path)
    # One map of the data section; every tensor is a view into it.
    data = np.memmap(path, np.uint8, "r", offset=data_start) if data_size else None
    arrays: dict[str, np.ndarray] = {}
    for entry in entries:
        if entry.end == entry.begin:
            arrays[entry.name] = np.empty(entry.shape, entry.dtype)
        else:
            arrays[entry.name] = (
                data[entry.begin : entry.end].view(entry.dtype).reshape(entry.shape)
            )
    return arrays, metadata
