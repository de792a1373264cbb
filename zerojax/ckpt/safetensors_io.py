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
import os
import struct
import sys
from typing import BinaryIO

import numpy as np

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


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """({name: array}, metadata) of a safetensors file, in header order.

    Arrays are read-only views of a memory map: nothing is read until used. ValueError names
    the file and what is wrong with it (not safetensors, unsupported dtype, bad offsets).

    >>> arrays, metadata = read_safetensors("model.safetensors")
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path!r} is not a safetensors file: {size} bytes, no header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER, size - 8):
            raise ValueError(
                f"{path!r} is not a safetensors file: header length {header_len} does not fit "
                f"in its {size} bytes"
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise ValueError(f"{path!r} is not a safetensors file: bad JSON header") from exc
    if not isinstance(header, dict):
        raise ValueError(  # noqa: TRY004 - the file's content is wrong, not an argument's type
            f"{path!r} is not a safetensors file: header is not a JSON object"
        )
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_size = 8 + header_len, size - 8 - header_len
    # One map of the data section; every tensor is a view into it.
    data = np.memmap(path, np.uint8, "r", offset=data_start) if data_size else None
    arrays: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path!r}: bad header entry for {name!r}: {info!r}") from exc
        dtype = _FROM_CODE.get(code)
        if dtype is None:
            raise ValueError(
                f"{path!r}: tensor {name!r} has safetensors dtype {code!r}; zerojax supports "
                f"{', '.join(_FROM_CODE)}"
            )
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or end > data_size:
            raise ValueError(
                f"{path!r}: tensor {name!r} {code}{list(shape)} needs {nbytes} bytes, its "
                f"offsets are [{begin}, {end}] in a data section of {data_size} bytes"
            )
        if nbytes == 0:
            arrays[name] = np.empty(shape, dtype)
        else:
            arrays[name] = data[begin:end].view(dtype).reshape(shape)
    return arrays, metadata
