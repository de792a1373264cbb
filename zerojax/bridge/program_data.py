"""A captured program as plain data: torch.export's serialized form as JSON, loaded without
running anything the bytes say.

The capture cache (`decomposition_cache.py`) keeps programs on disk between processes, so
whatever reads them back must treat the file as data: a pickle (what the cache used before)
runs any code its writer chose when it is loaded. Here a program is a header line, then one
JSON document:

    zerojax-program 2 <label> <sha256 of the document>
    {"format": 2,
     "program": <torch.export's schema.ExportedProgram, as torch's own JSON writer gives it>,
     "constants": {name: {"dtype", "size", "stride", "storage_offset", "requires_grad",
                          "storage": <the tensor's whole storage, base64>}},
     "original_aten": {node name: "torch.ops.aten.<op>.<overload>"}}

The label is what the writer filed the program under (the capture cache's key), so a file
copied or renamed to another key is refused; the digest finds a truncated or damaged file
(it is no defence against a writer who means harm: anyone able to write the file can compute
it, which is why the cache's directory must be writable by its user alone).

`original_aten` (the op each node was decomposed from, e.g. `nll_loss_forward` for the nodes of
a cross_entropy) is node metadata torch's serializer drops; the index checks read it
(`bridge/index_bounds.py`), so it is stored beside the program and set back on load.

Weights and example inputs are not stored (the fresh capture's are used). The constants are
stored here, not as torch's `torch.save` bytes, because reading those means `torch.load`, and
torch's reader (`deserialize_torch_artifact`) retries a failed `weights_only=True` load with
`weights_only=False`.

Reading is `json.loads`, then a decoder driven by the schema's dataclasses that checks every
value's type (torch's own `_dict_to_dataclass` checks none and calls `typing.get_type_hints`
for every object: 0.62 s for GPT-2's program, where this decoder takes ~0.05 s), then torch's
`ExportedProgramDeserializer` with the constants as tensors. That deserializer, and the FX code
generation after it, were written for trusted input, so the decoder refuses what a program
zerojax caches never holds and what would reach an evaluator:

- symbolic expressions (`SymExpr`): torch parses their text with `sympy.sympify`, which
  evaluates it as Python. A cached program has static shapes (the cache key refuses symbolic
  ones), so none may appear; nor may range constraints or guard code.
- node targets and operator arguments other than core ATen/prims overloads and functions of
  Python's `operator` module (the only ones the cache key admits); no subgraphs, custom
  objects or extension ops.
- control characters other than tab and newline in any string: FX writes some node metadata
  into the Python source it generates, where a carriage return would end a comment line.

Anything else wrong (a wrong header, label or digest, not JSON, a missing or unknown field, a wrong type, an unknown dtype, a
storage too small for its tensor) raises `ProgramDataError` naming the field.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import functools
import hashlib
import json
import math
import operator
import re
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

FORMAT = 2
"""Bumped whenever the document's layout changes."""

MAGIC = b"zerojax-program"

CORE_NAMESPACES = ("aten", "prims")
"""Op namespaces whose overloads a loaded program may call (the cache key admits no others)."""

_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
"""dtypes a stored constant may have (torch dtype name -> dtype)."""

# C0 controls but tab and newline, DEL, C1 controls, and Unicode's line separators.
_UNSAFE_CHARACTERS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")

_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
"""How torch's JSON writer spells non-finite floats (JSON has none)."""


class ProgramDataError(ValueError):
    """Bytes that are not a program as `encode` writes it, or that hold something a loaded
    program may not (module docstring). The message names the field."""


class OtherFormatError(ProgramDataError):
    """A well-formed header of another `FORMAT` (an entry an earlier zerojax wrote): stale, not
    damaged."""


def encode(program: torch.export.ExportedProgram, label: str) -> bytes:
    """`program` without its weights or example inputs, filed under `label` (letters, digits,
    `_` and `-`), as `decode` reads it. ProgramDataError if a constant cannot be stored as data
    (not a plain dense CPU tensor of a dtype in the table)."""
    from torch._export.serde.serialize import EnumEncoder, _dataclass_to_dict

    from zerojax.compat.torch_export import serialize_without_weights

    if not _LABEL.fullmatch(label):
        raise ValueError(f"program_data: label {label!r} is not letters, digits, _ and -")
    constants = {name: _encode_tensor(name, value) for name, value in program.constants.items()}
    serialized = serialize_without_weights(program)
    original_aten = {
        node.name: f"torch.ops.{node.meta['original_aten']}"
        for node in program.graph_module.graph.nodes
        if isinstance(node.meta.get("original_aten"), torch._ops.OpOverload)
    }
    document = {
        "format": FORMAT,
        "program": _dataclass_to_dict(serialized.exported_program),
        "constants": constants,
        "original_aten": original_aten,
    }
    body = json.dumps(document, cls=EnumEncoder, allow_nan=False).encode()
    digest = hashlib.sha256(body).hexdigest()
    return b"%s %d %s %s\n" % (MAGIC, FORMAT, label.encode(), digest.encode()) + body


def decode(
    data: bytes,
    label: str,
    state_dict: dict[str, torch.Tensor],
    example_inputs: tuple | None,
) -> torch.export.ExportedProgram:
    """The program `encode` filed under `label`, with `state_dict` and `example_inputs` as its
    weights and example inputs (the fresh capture's). ProgramDataError for anything else
    (module docstring); nothing in `data` is run."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer

    header, _, body = data.partition(b"\n")
    fields = header.split(b" ")
    if len(fields) != 4 or fields[0] != MAGIC:
        raise ProgramDataError(f"not a zerojax program: the file starts {header[:60]!r}")
    if fields[1] != b"%d" % FORMAT:
        raise OtherFormatError(f"format {fields[1][:20]!r}, expected {FORMAT}")
    if fields[2] != label.encode():
        raise ProgramDataError(f"filed under {fields[2][:80]!r}, not {label!r}")
    if hashlib.sha256(body).hexdigest().encode() != fields[3]:
        raise ProgramDataError(
            f"the document's sha256 is not the one its header records: the file is truncated "
            f"or damaged ({len(data)} bytes)"
        )
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise ProgramDataError(f"not JSON: {error}") from error
    if not isinstance(document, dict) or set(document) != set(_DOCUMENT_KEYS):
        keys = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise ProgramDataError(f"expected keys {', '.join(_DOCUMENT_KEYS)}; got {keys}")
    if document["format"] != FORMAT:
        raise ProgramDataError(f"format {document['format']!r}, expected {FORMAT}")
    try:
        serialized = _decoder(schema.ExportedProgram)(document["program"])
    except RecursionError as error:
        raise ProgramDataError("the program is nested too deeply") from error
    if serialized.range_constraints:
        raise ProgramDataError("range_constraints: a cached program has static shapes")
    if serialized.guards_code:
        raise ProgramDataError("guards_code: a cached program has no guards")
    constants = document["constants"]
    if not isinstance(constants, dict):
        raise ProgramDataError(f"constants: expected an object, got {type(constants).__name__}")
    tensors = {name: _decode_tensor(name, value) for name, value in constants.items()}
    original_aten = _decode_original_aten(document["original_aten"])
    # Every part is passed as an object, never as bytes: torch would `torch.load` bytes.
    program = ExportedProgramDeserializer().deserialize(
        serialized, dict(state_dict), tensors, example_inputs
    )
    for node in program.graph_module.graph.nodes:
        if node.name in original_aten:
            node.meta["original_aten"] = original_aten[node.name]
    return program


_DOCUMENT_KEYS = ("format", "program", "constants", "original_aten")


def _decode_original_aten(entries: Any) -> dict[str, torch._ops.OpOverload]:
    """node name -> the overload it was decomposed from; each a core ATen/prims overload."""
    if not isinstance(entries, dict):
        raise ProgramDataError(f"original_aten: expected an object, got {type(entries).__name__}")
    decoded = {}
    for name, target in entries.items():
        overload = _core_overload(_string(target))
        if overload is None:
            raise ProgramDataError(
                f"original_aten: {target[:200]!r} is not a core ATen/prims overload"
            )
        decoded[_string(name)] = overload
    return decoded


_LABEL = re.compile(r"[A-Za-z0-9_-]+")


def _encode_tensor(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if (
        type(tensor) is not torch.Tensor
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or dtype not in _DTYPES
    ):
        raise ProgramDataError(
            f"constant {name!r}: a {type(tensor).__name__} of dtype {dtype} on "
            f"{tensor.device} ({tensor.layout}); only dense CPU tensors of dtypes "
            f"{', '.join(_DTYPES)} are stored"
        )
    # The whole storage with offset and strides: the tensor exactly as it was, views included.
    storage = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return {
        "dtype": dtype,
        "size": list(tensor.shape),
        "stride": list(tensor.stride()),
        "storage_offset": tensor.storage_offset(),
        "requires_grad": tensor.requires_grad,
        "storage": base64.b64encode(storage.numpy().tobytes()).decode(),
    }


def _decode_tensor(name: str, entry: Any) -> torch.Tensor:
    where = f"constants[{name!r}]"
    fields = {"dtype", "size", "stride", "storage_offset", "requires_grad", "storage"}
    if not isinstance(entry, dict) or set(entry) != fields:
        raise ProgramDataError(f"{where}: expected the keys {sorted(fields)}")
    dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise ProgramDataError(f"{where}.dtype: {entry['dtype']!r} is not one of {list(_DTYPES)}")
    size, stride, offset = entry["size"], entry["stride"], entry["storage_offset"]
    for field, value in (("size", size), ("stride", stride)):
        if not (isinstance(value, list) and all(_is_natural(v) for v in value)):
            raise ProgramDataError(f"{where}.{field}: expected a list of integers >= 0")
    if len(stride) != len(size) or not _is_natural(offset):
        raise ProgramDataError(
            f"{where}: {len(size)} sizes, {len(stride)} strides, offset {offset!r}"
        )
    if not isinstance(entry["requires_grad"], bool) or not isinstance(entry["storage"], str):
        raise ProgramDataError(f"{where}: requires_grad must be a bool, storage a string")
    try:
        raw = bytearray(base64.b64decode(entry["storage"], validate=True))
    except binascii.Error as error:
        raise ProgramDataError(f"{where}.storage: not base64 ({error})") from error
    itemsize = dtype.itemsize
    if math.prod(size) > 0:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if (last + 1) * itemsize > len(raw):
            raise ProgramDataError(
                f"{where}: size {size}, stride {stride} and offset {offset} reach byte "
                f"{(last + 1) * itemsize}, past its {len(raw)}-byte storage"
            )
    storage = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    tensor = torch.empty(0, dtype=dtype).set_(storage.untyped_storage(), offset, size, stride)
    if entry["requires_grad"]:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise ProgramDataError(f"{where}: requires_grad on a {entry['dtype']} tensor")
        tensor.requires_grad_(True)
    return tensor


def _is_natural(value: Any) -> bool:
    return type(value) is int and value >= 0


# The schema decoder. Each type of the schema gets one decoding function, built once (the
# cost torch's decoder pays per object), that checks the JSON value's type and builds it.

_Decode = Callable[[Any], Any]


def _refused(what: str) -> _Decode:
    def refuse(value: Any) -> None:
        raise ProgramDataError(f"{what}: a cached program holds none")

    return refuse


@functools.cache
def _refused_types() -> dict[type, str]:
    from torch._export.serde import schema

    return {
        schema.SymExpr: "a symbolic expression (torch evaluates its text with sympy)",
        schema.GraphArgument: "a subgraph (higher-order op)",
        schema.CustomObjArgument: "a custom object",
    }


@functools.cache
def _decoder(hint: Any) -> _Decode:
    from torch._export.serde.union import _Union

    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _decoder(typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        (inner,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
        decode_inner = _decoder(inner)
        return lambda value: None if value is None else decode_inner(value)
    if origin is list:
        decode_item = _decoder(typing.get_args(hint)[0])

        def decode_list(value):
            if type(value) is not list:
                raise _wrong_type(hint, value)
            return [decode_item(item) for item in value]

        return decode_list
    if origin is dict:
        key, item = typing.get_args(hint)
        assert key is str, hint  # JSON object keys are strings
        decode_item = _decoder(item)

        def decode_dict(value):
            if type(value) is not dict:
                raise _wrong_type(hint, value)
            return {_string(k): decode_item(v) for k, v in value.items()}

        return decode_dict
    if hint in _refused_types():
        return _refused(_refused_types()[hint])
    if isinstance(hint, type) and issubclass(hint, _Union):
        return _UnionDecoder(hint)
    if dataclasses.is_dataclass(hint):
        return _DataclassDecoder(hint)
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return functools.partial(_enum, hint)
    decode = {str: _string, int: _integer, bool: _boolean, float: _float}.get(hint)
    if decode is None:  # pragma: no cover - a schema type this decoder does not know yet
        raise TypeError(f"program_data: no decoder for the schema type {hint!r}")
    return decode


def _string(value: Any) -> str:
    if type(value) is not str:
        raise _wrong_type(str, value)
    if _UNSAFE_CHARACTERS.search(value):
        raise ProgramDataError(f"a string holds a control character: {value[:200]!r}")
    return value


def _integer(value: Any) -> int:
    if type(value) is not int:
        raise _wrong_type(int, value)
    return value


def _boolean(value: Any) -> bool:
    if type(value) is not bool:
        raise _wrong_type(bool, value)
    return value


def _float(value: Any) -> float:
    if type(value) in (int, float):
        return float(value)
    if type(value) is str and value in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[value]
    raise _wrong_type(float, value)


def _enum(cls: type[enum.IntEnum], value: Any) -> enum.IntEnum:
    if type(value) is not int:
        raise _wrong_type(cls, value)
    try:
        return cls(value)
    except ValueError as error:
        raise ProgramDataError(f"{value} is not a {cls.__name__}") from error


def _wrong_type(hint: Any, value: Any) -> ProgramDataError:
    shown = repr(value) if isinstance(value, (int, float, bool, str)) else type(value).__name__
    name = getattr(hint, "__name__", repr(hint))
    return ProgramDataError(f"expected {name}, got {shown[:200]}")


class _DataclassDecoder:
    """A schema dataclass from a JSON object: every key a field, every value its field's type.

    Objects are built as pickle builds them (`object.__new__`, then their `__dict__`), not
    through `__init__`: a third of the decoding time otherwise. No schema dataclass has a
    `__post_init__` of its own (unions have one that checks field names, a class invariant).
    Field decoders are looked up on first use: the schema is recursive (Graph, Argument)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.fields: dict[str, _Decode] | None = None
        self.defaults: dict[str, Any] = {}
        self.factories: dict[str, Callable[[], Any]] = {}
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                self.defaults[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                self.factories[field.name] = field.default_factory

    def _field_decoders(self) -> dict[str, _Decode]:
        from torch._export.serde import schema

        hints = typing.get_type_hints(self.cls, globalns=vars(schema), include_extras=True)
        decoders = {}
        for field in dataclasses.fields(self.cls):
            decode = _decoder(hints[field.name])
            check = _CHECKED_FIELDS.get((self.cls.__name__, field.name))
            decoders[field.name] = decode if check is None else _then(decode, check)
        return decoders

    def _decode_fields(self, value: Any, fields: dict[str, _Decode]) -> dict[str, Any]:
        decoded = {}
        for name, item in value.items():
            decode = fields.get(name)
            if decode is None:
                raise ProgramDataError(f"{self.cls.__name__} has no field {name!r}")
            try:
                decoded[name] = decode(item)
            except ProgramDataError as error:
                raise ProgramDataError(f"{self.cls.__name__}.{name}: {error}") from None
        return decoded

    def __call__(self, value: Any) -> Any:
        fields = self.fields
        if fields is None:
            fields = self.fields = self._field_decoders()
        if type(value) is not dict:
            raise _wrong_type(self.cls, value)
        decoded = self._decode_fields(value, fields)
        if len(decoded) < len(fields):
            for name, factory in self.factories.items():
                if name not in decoded:
                    decoded[name] = factory()
            state = {**self.defaults, **decoded}
            missing = fields.keys() - state.keys()
            if missing:
                raise ProgramDataError(f"{self.cls.__name__}: missing {sorted(missing)}")
        else:
            state = decoded
        built = object.__new__(self.cls)
        built.__dict__.update(state)
        return built


class _UnionDecoder(_DataclassDecoder):
    """A schema union (`_Union`): a JSON object with exactly one key, the member that is set.
    Built as `_Union.create` builds it: every other member None, `_type` the member's tag (one
    tag per member, shared: a tag is an immutable string)."""

    def __init__(self, cls: type) -> None:
        from torch._export.serde.union import _UnionTag

        super().__init__(cls)
        names = [field.name for field in dataclasses.fields(cls)]
        self.nones = dict.fromkeys(names)
        self.tags = {name: _UnionTag.create(name, cls) for name in names}

    def __call__(self, value: Any) -> Any:
        fields = self.fields
        if fields is None:
            fields = self.fields = self._field_decoders()
        if type(value) is not dict or len(value) != 1:
            raise ProgramDataError(f"{self.cls.__name__}: expected an object with one key")
        ((name, item),) = self._decode_fields(value, fields).items()
        built = object.__new__(self.cls)
        state = built.__dict__
        state.update(self.nones)
        state[name] = item
        state["_type"] = self.tags[name]
        return built


def _then(decode: _Decode, check: Callable[[Any], None]) -> _Decode:
    def decode_and_check(value):
        decoded = decode(value)
        check(decoded)
        return decoded

    return decode_and_check


def _check_target(target: str | None) -> None:
    """A node's target or an operator argument: a core ATen/prims overload or a function of
    Python's `operator` module (what the cache key admits), by the name torch writes."""
    if target is not None and not _is_allowed_target(target):
        raise ProgramDataError(
            f"target {target[:200]!r} is not a core ATen/prims overload or an operator function"
        )


@functools.lru_cache(maxsize=4096)
def _is_allowed_target(target: str) -> bool:
    parts = target.split(".")
    if len(parts) == 2 and parts[0] == "_operator":
        return callable(getattr(operator, parts[1], None)) and not parts[1].startswith("_")
    return _core_overload(target) is not None


@functools.lru_cache(maxsize=4096)
def _core_overload(target: str) -> torch._ops.OpOverload | None:
    """The overload `torch.ops.<core namespace>.<op>.<overload>` names, if it is one."""
    parts = target.split(".")
    if len(parts) != 5 or parts[:2] != ["torch", "ops"] or parts[2] not in CORE_NAMESPACES:
        return None
    try:
        packet = getattr(getattr(torch.ops, parts[2]), parts[3])
        overload = getattr(packet, parts[4])
    except (AttributeError, RuntimeError):
        return None
    return overload if isinstance(overload, torch._ops.OpOverload) else None


_CHECKED_FIELDS: dict[tuple[str, str], Callable[[Any], None]] = {
    ("Node", "target"): _check_target,
    ("Argument", "as_operator"): _check_target,
}
"""(schema class, field) -> a check of the decoded value beyond its type."""
