"""torch's checkpoint format, written one tensor at a time, read without running its code, and
the torch <-> numpy dtype table.

`torch.save` pickles the whole state_dict and then copies every storage into the zip, so it
needs every tensor in memory at once -- the thing `zerojax ckpt export` exists to avoid.
`TorchStateDictWriter` writes the same file: the zip written by torch's own
`PyTorchFileWriter` (so alignment, crc32 and the version records are torch's), `data.pkl`
pickled from shapes and dtypes alone with the persistent ids `torch.serialization._save`
gives storages, then one `data/<key>` record per storage as its array arrives. The result
loads with `torch.load(path, weights_only=True)` (and `mmap=True`) as an OrderedDict.

    >>> specs = [TensorSpec("w", (4, 3), "float32"), TensorSpec("b", (3,), "int64")]
    >>> with open(tmp, "wb") as f, TorchStateDictWriter(f, specs) as writer:
    ...     writer.write("w", w_array)        # numpy, in storage order
    ...     writer.write("b", b_array)

A torch file is a pickle, and a pickle runs whatever its writer chose when it is loaded, so
`load_torch_file` reads one only with `torch.load(weights_only=True)`: torch's restricted
unpickler, which builds tensors and plain containers and refuses every other global. A file
that needs anything else (a pickled class, or a planted `os.system`) is refused with a
`CheckpointFormatError` naming the file and the global; nothing of it runs. zerojax never
retries with `weights_only=False` (torch's own message suggests it), and no environment
variable changes that: torch's TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only applies where
`weights_only` is not passed.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO, Self

import ml_dtypes
import numpy as np
import torch

from zerojax.ckpt.errors import CheckpointFormatError

__all__ = [
    "NUMPY_DTYPES",
    "TensorSpec",
    "TorchStateDictWriter",
    "load_torch_file",
    "numpy_dtype",
    "tensor_to_numpy",
    "torch_dtype_name",
]

NUMPY_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}
"""torch dtype name (without "torch.") -> numpy dtype, for every dtype the checkpoint tools
read and write: those torch pickles as typed storages and safetensors, Orbax and numpy all
hold (bfloat16 through ml_dtypes, as JAX does)."""

_FLOATING = {"float64", "float32", "float16", "bfloat16"}


def torch_dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32" (the form `meta.parameters[...]["dtype"]` holds)."""
    return str(dtype).removeprefix("torch.")


def load_torch_file(path: str | os.PathLike) -> Any:
    """`torch.load(path, weights_only=True)` onto the CPU, memory-mapped where the file allows
    (tensors are then read from the page cache as they are used, not all loaded).

    CheckpointFormatError (a ValueError) naming the file if torch cannot read it, and, if the
    file needs code to load, which global it asked for; nothing in the file runs (module
    docstring)."""
    path = os.fspath(path)
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zip" not in str(exc):
                raise
        # Legacy (pre-1.6, non-zip) files cannot be memory-mapped.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling raises anything; name the file
        message = str(exc)
        needed = _REFUSED_GLOBAL.search(message)
        if isinstance(exc, pickle.UnpicklingError) and needed:
            raise CheckpointFormatError(
                f"{path!r} needs code to load (it asks for {needed.group(1)}), and zerojax "
                f"never runs code from a checkpoint: it reads torch files with "
                f"torch.load(weights_only=True), which builds only tensors and plain "
                f"containers. If you trust the file, load it in torch yourself and save its "
                f"state_dict (torch.save(model.state_dict(), ...)) or a .safetensors file",
                path=path,
            ) from None
        # torch's restricted unpickler puts its reason after a long preamble.
        reason = message.partition("WeightsUnpickler error:")[2].partition("Check the doc")[0]
        reason = (reason or message).strip()
        first = reason.splitlines()[0][:300] if reason else ""
        raise CheckpointFormatError(
            f"{path!r} cannot be read by torch.load(weights_only=True): "
            f"{type(exc).__name__}: {first}. Expected a file written by "
            f"torch.save(model.state_dict())",
            path=path,
        ) from exc


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
"""The global torch's restricted unpickler refused, as its message names it."""


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a torch dtype name; ValueError listing the supported ones."""
    try:
        return NUMPY_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} is not supported by the checkpoint tools; supported: "
            f"{', '.join(NUMPY_DTYPES)}"
        ) from None


def is_floating(name: str) -> bool:
    return name in _FLOATING


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's data (no copy; bfloat16 via a 16-bit integer view)."""
    tensor = tensor.detach()
    name = torch_dtype_name(tensor.dtype)
    dtype = numpy_dtype(name)
    if name == "bfloat16":
        return tensor.view(torch.int16).numpy().view(dtype)
    return tensor.numpy()


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One state_dict entry to write: `alias_of` names an earlier entry whose storage it
    shares (a tied weight), written once, as `torch.save` writes shared storages."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch dtype name, a key of NUMPY_DTYPES"""
    alias_of: str | None = None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * numpy_dtype(self.dtype).itemsize


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _StorageRef:
    """Stands for a storage in the pickle; the pickler turns it into torch's persistent id."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, dtype: str, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles exactly as `torch.Tensor._reduce_ex_internal` pickles a contiguous CPU tensor
    of a typed-storage dtype: `_rebuild_tensor_v2(storage, offset, size, stride,
    requires_grad, backward_hooks)`."""

    __slots__ = ("shape", "storage")

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        args = (self.storage, 0, self.shape, _contiguous_strides(self.shape), False, OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            # The tuple `torch.serialization._save` returns for a TypedStorage.
            storage_type = getattr(
                torch, torch.storage._dtype_to_storage_type_map()[getattr(torch, obj.dtype)]
            )
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class TorchStateDictWriter:
    """Writes a torch state_dict file (`torch.load(..., weights_only=True)` -> OrderedDict)
    one storage at a time; see the module docstring.

    `specs` gives every entry in state_dict order. Call `write(name, array)` once for each
    entry without `alias_of`, in the order of `storage_names`; `close()` (or leaving the
    `with` block without an exception) finishes the zip and checks nothing is missing.
    `file` is a binary file object opened for writing; the caller owns renaming it into
    place.
    """

    def __init__(self, file: BinaryIO, specs: list[TensorSpec]):
        self._specs = {s.name: s for s in specs}
        if len(self._specs) != len(specs):
            raise ValueError("TorchStateDictWriter: duplicate entry names")
        storages: dict[str, _StorageRef] = {}
        tensors = OrderedDict()
        for spec in specs:
            numpy_dtype(spec.dtype)  # unsupported dtypes fail before anything is written
            if spec.alias_of is not None:
                owner = self._specs.get(spec.alias_of)
                if owner is None or owner.alias_of is not None or spec.alias_of not in storages:
                    raise ValueError(
                        f"TorchStateDictWriter: {spec.name!r} is an alias of "
                        f"{spec.alias_of!r}, which is not an earlier non-alias entry"
                    )
                if (owner.shape, owner.dtype) != (spec.shape, spec.dtype):
                    raise ValueError(
                        f"TorchStateDictWriter: alias {spec.name!r} {spec.dtype}{list(spec.shape)}"
                        f" differs from {owner.name!r} {owner.dtype}{list(owner.shape)}"
                    )
                storage = storages[spec.alias_of]
            else:
                storage = _StorageRef(str(len(storages)), spec.dtype, spec.numel)
                storages[spec.name] = storage
            tensors[spec.name] = _TensorRef(storage, tuple(spec.shape))
        self.storage_names = list(storages)
        self._keys = {name: ref.key for name, ref in storages.items()}
        self._written: set[str] = set()
        self._next = 0

        buffer = io.BytesIO()
        _Pickler(buffer, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(tensors)
        data_pkl = buffer.getvalue()
        self._zip = torch._C.PyTorchFileWriter(
            file,
            torch.serialization.get_crc32_options(),
            torch.serialization._get_storage_alignment(),
        )
        # The records `torch.serialization._save` writes ahead of the storages.
        self._zip.write_record("data.pkl", data_pkl, len(data_pkl))
        self._zip.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        self._zip.write_record(".storage_alignment", alignment, len(alignment))
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._closed = False

    def write(self, name: str, array: np.ndarray) -> None:
        """Append the storage of entry `name` (the next one in `storage_names`)."""
        if self._next >= len(self.storage_names) or self.storage_names[self._next] != name:
            expected = (
                self.storage_names[self._next] if self._next < len(self.storage_names) else None
            )
            raise ValueError(f"TorchStateDictWriter: got {name!r}, expected {expected!r} next")
        spec = self._specs[name]
        dtype = numpy_dtype(spec.dtype)
        if array.dtype != dtype or tuple(array.shape) != tuple(spec.shape):
            raise ValueError(
                f"TorchStateDictWriter: {name!r} is {array.dtype}{list(array.shape)}, the "
                f"header says {dtype}{list(spec.shape)}"
            )
        # As a storage viewing the array's bytes: no bytes() copy of a tensor that may be
        # gigabytes.
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        storage = torch.from_numpy(raw).untyped_storage()
        self._zip.write_record(f"data/{self._keys[name]}", storage, raw.nbytes)
        self._next += 1

    def close(self) -> None:
        if self._closed:
            return
        missing = self.storage_names[self._next :]
        if missing:
            raise ValueError(f"TorchStateDictWriter: no data written for {missing[:5]}")
        self._zip.write_end_of_file()
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
