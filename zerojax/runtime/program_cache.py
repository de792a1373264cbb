"""A persistent cache of traced and lowered programs, so a restarted job skips tracing them.

JAX's persistent compilation cache (`compilation_cache.py`) is keyed by the lowered program:
a restart still traces every program (for the update, zerojax's optimizer code run over a few
hundred parameters) and lowers it before the cache can answer. This cache stores what tracing
and lowering produce, `jax.export`'s serialized StableHLO module (`Exported.serialize`, a
flatbuffer), under a key that lists everything the module could depend on, and a restarted
job compiles that module (JAX's cache then loads the executable) instead of tracing.

A wrong hit would train silently different numbers, so the key is built to miss whenever the
program could differ (`program_key`): the program's name and a description of everything its
Python function closes over, given by the caller (`zerojax.train.programs.StepPrograms`: the
optimizer spec, the sharding plan, the precision policy, the config); the arguments' tree and,
per leaf, shape, dtype, weak type, whether it is committed to its devices and its sharding
(mesh axes, sizes, device ids, spec, memory kind); the jit options; the compiler options; JAX's configuration (global and the trace
context); the platform, the devices and processes; zerojax's own source (a hash of every module
in the package: any edit misses); and the versions of Python, JAX, jaxlib, numpy, torch and
the XLA_FLAGS. A value the describer does not know (`describe`: an object known only by its
identity, a function) makes the program uncached, not approximately keyed. Only programs whose
tracing has no side effects the caller reads are cached: a program whose trace also computes
something (`Program`'s `reached_from`), or one with other jit options than donation, is not.

Every program the cache serves runs the same way in the process that wrote it and in the ones
that load it: the deserialized `Exported` called inside `jax.jit` with the original donation,
compiled with the original compiler options (so a warm process runs the executable the writing
process ran, bitwise). Exporting refuses what it cannot serialize (host callbacks, some custom
calls, pytree nodes without a serialization); such a program is traced and compiled as before.
The writer records the executable's input and output shardings and donated arguments; a loaded
program that compiles to anything else is refused (`ProgramCacheWarning`), traced again and
replaced.

Trust: an entry is a program XLA compiles and runs, like the executables of JAX's cache around
it, so the directory follows the same rule (`private_directory.py`: writable by this user
alone). Nothing in an entry is unpickled or evaluated as Python: a header (JSON) and the
flatbuffer, which `jax.export.deserialize` reads. An entry that does not load (truncated,
damaged, filed under another key, not a flatbuffer JAX reads) is a `ProgramCacheWarning`
naming it and why, and the program is traced, compiled and stored again: a bad entry costs
time, never a result. Entries are written atomically (temporary file, then rename), beside
JAX's cache (`<jax_compilation_cache_dir>/zerojax-programs/<key>.program`), and share the
capture cache's size bound (least recently used first).

Requires the `flatbuffers` package (a dependency of zerojax, optional for JAX): without it
nothing is cached and programs are traced as before.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import os
import platform as python_platform
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zerojax.runtime.private_directory import check_private_directory

__all__ = [
    "ProgramCacheWarning",
    "Undescribable",
    "cache_directory",
    "describe",
    "export_and_store",
    "load",
    "program_key",
]

log = logging.getLogger("zerojax")

FORMAT = 1
"""Bumped whenever what is cached, or how it is keyed, changes."""

SUBDIRECTORY = "zerojax-programs"
SUFFIX = ".program"
_MAGIC = b"ZEROJAX-PROGRAM\n"

# JAX options that say where and when to cache, not what a program computes.
_CACHE_OPTIONS = frozenset(
    {
        "jax_compilation_cache_dir",
        "jax_compilation_cache_max_size",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
        "jax_persistent_cache_enable_xla_caches",
        "jax_enable_compilation_cache",
        "jax_explain_cache_misses",
        "jax_log_compiles",
    }
)


class ProgramCacheWarning(UserWarning):
    """A program cache entry did not load (the program is traced again and replaced)."""


class Undescribable(TypeError):
    """A value the key cannot describe by content: its program is not cached."""


def cache_directory() -> str | None:
    """Where entries live: beside JAX's persistent compilation cache, None without one."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory:
        return None
    return os.path.join(directory, SUBDIRECTORY)


@functools.cache
def available() -> bool:
    """Whether `Exported.serialize` can run here (it needs the flatbuffers package)."""
    try:
        import flatbuffers  # noqa: F401
    except ImportError:
        log.info("zerojax: the flatbuffers package is missing; programs are not cached")
        return False
    return True


# --- the key --------------------------------------------------------------------------------


def describe(value: Any) -> str:
    """A text naming `value` by content, the same in every process; Undescribable for what
    has no such description (functions, objects known by identity)."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{_qualname(type(value))}.{value.name}"
    if isinstance(value, np.dtype):
        return f"dtype({value})"
    if isinstance(value, type) and issubclass(value, np.generic):
        return f"dtype({np.dtype(value)})"
    if isinstance(value, jax.sharding.NamedSharding):
        return _describe_named_sharding(value)
    if isinstance(value, jax.sharding.PartitionSpec):
        return f"P{describe(tuple(value))}"
    if isinstance(value, jax.sharding.Mesh):
        return _describe_mesh(value)
    if isinstance(value, jax.sharding.SingleDeviceSharding):
        device = next(iter(value.device_set))
        return f"SingleDevice({_describe_device(device)},{value.memory_kind})"
    if isinstance(value, tuple | list):
        return f"{type(value).__name__}({','.join(describe(v) for v in value)})"
    if isinstance(value, frozenset | set):
        return f"set({','.join(sorted(describe(v) for v in value))})"
    if isinstance(value, Mapping):
        items = ",".join(f"{describe(k)}:{describe(v)}" for k, v in value.items())
        return f"{{{items}}}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(
            f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return f"{_qualname(type(value))}({fields})"
    raise Undescribable(f"{_qualname(type(value))} has no description by content")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _describe_device(device) -> str:
    return f"{device.platform}:{device.id}:{device.device_kind}:{device.process_index}"


# Cached: a step's hundreds of arguments and plan entries share a few meshes and shardings
# (the bench GPT-2's update: ~1,900 descriptions, 0.17 s uncached).
@functools.lru_cache(maxsize=256)
def _describe_mesh(mesh: jax.sharding.Mesh) -> str:
    devices = ",".join(_describe_device(d) for d in mesh.devices.flat)
    axis_types = describe(tuple(getattr(mesh, "axis_types", ())))
    return f"Mesh({describe(dict(mesh.shape))},{axis_types},[{devices}])"


@functools.lru_cache(maxsize=4096)
def _describe_named_sharding(sharding: jax.sharding.NamedSharding) -> str:
    """The sharding's layout, spelled one way: `P()`, `P(None)` and `P(None, None)` (or
    `P(('a',))` and `P('a')`) are one layout, and an executable's shardings are its
    arguments' objects, spelled either way."""
    spec = [a[0] if isinstance(a, tuple) and len(a) == 1 else a for a in sharding.spec]
    while spec and spec[-1] is None:
        spec.pop()
    return f"Named({_describe_mesh(sharding.mesh)},{describe(tuple(spec))},{sharding.memory_kind})"


def _describe_leaf(leaf) -> str:
    """What an executable requires of an argument: its aval and its sharding's layout."""
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        placed = describe(leaf.sharding)
        weak_type = getattr(leaf, "weak_type", False)
        # jit places an uncommitted array (made without a device: `jnp.zeros`) where the
        # program wants it, a committed one where it is: other input shardings.
        committed = getattr(leaf, "committed", True)
        return f"A({leaf.shape},{leaf.dtype},{weak_type},{committed},{placed})"
    if isinstance(leaf, np.ndarray | np.generic | bool | int | float | complex):
        return f"N({type(leaf).__name__},{np.shape(leaf)},{np.result_type(leaf)})"
    raise Undescribable(f"an argument of type {_qualname(type(leaf))}")


@functools.cache
def source_digest() -> str:
    """sha256 of every module of the zerojax package (paths and contents): any edit misses."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _environment() -> list[str]:
    import jaxlib
    import torch
    from jax._src import config as jax_config

    options = {k: v for k, v in jax.config.values.items() if k not in _CACHE_OPTIONS}
    context = []
    for value in jax_config.trace_context():
        axis_sizes = getattr(value, "axis_sizes", None)  # the axis environment: empty here
        context.append(describe(dict(axis_sizes)) if axis_sizes is not None else describe(value))
    devices = ",".join(_describe_device(d) for d in jax.devices())
    return [
        f"format={FORMAT}",
        f"python={sys.version} {python_platform.machine()}",
        f"jax={jax.__version__} jaxlib={jaxlib.__version__} numpy={np.__version__}",
        f"torch={torch.__version__} {torch.version.git_version}",
        f"zerojax source={source_digest()}",
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}",
        f"jax options={describe(dict(sorted(options.items())))}",
        f"trace context={','.join(context)}",
        f"devices={devices} processes={jax.process_count()}:{jax.process_index()}",
    ]


def program_key(
    name: str,
    identity: str,
    treedef,
    leaves: list,
    jit_options: Mapping[str, Any],
    platform: str,
    compiler_options: Mapping[str, Any],
) -> str | None:
    """The key of program `name` for these arguments, or None if something in it has no
    description by content (the program is then not cached). `identity` describes what the
    program's function closes over (the caller's `describe` of it)."""
    try:
        parts = [
            *_environment(),
            f"program={name}",
            f"identity={identity}",
            f"tree={treedef}",
            *(_describe_leaf(leaf) for leaf in leaves),
            f"jit={describe(dict(sorted(jit_options.items())))}",
            f"platform={platform}",
            f"compiler={describe(dict(sorted(compiler_options.items())))}",
        ]
    except Undescribable as error:
        log.debug("zerojax: program %s is not cached: %s", name, error)
        return None
    text = "\n".join(parts)
    if " at 0x" in text:
        return None  # an object's repr by its address: no stable description
    return hashlib.sha256(text.encode()).hexdigest()


# --- storing and loading --------------------------------------------------------------------


def _jitted_call(exported, jit_options: Mapping[str, Any]):
    return jax.jit(exported.call, **jit_options)


def _compile(exported, args, jit_options, compiler_options):
    lowered = _jitted_call(exported, jit_options).trace(*args).lower()
    return lowered.compile(compiler_options=dict(compiler_options) or None)


def _executable_layout(compiled) -> dict[str, Any]:
    """The input and output shardings and donated arguments of a compiled program, as text."""

    def shardings(tree) -> list[str]:
        return [
            _describe_named_sharding(s) if isinstance(s, jax.sharding.NamedSharding) else repr(s)
            for s in jax.tree.leaves(tree)
        ]

    return {
        "input_shardings": shardings(compiled.input_shardings),
        "output_shardings": shardings(compiled.output_shardings),
        "donated": [bool(a.donated) for a in jax.tree.leaves(compiled.args_info)],
    }


def export_and_store(
    key: str,
    name: str,
    traced,
    args: tuple,
    platform: str,
    jit_options: Mapping[str, Any],
    compiler_options: Mapping[str, Any],
):
    """The executable of `traced` (a `jax.stages.Traced` of the program for `args`), compiled
    from its exported module, which is stored under `key`; None if it cannot be exported (the
    caller lowers and compiles `traced` itself)."""
    directory = cache_directory()
    if directory is None or not available():
        return None
    from jax._src.export import _export
    from jax._src.interpreters import mlir

    try:
        lowered = traced.lower(
            lowering_platforms=(platform,),
            _private_parameters=mlir.LoweringParameters(
                for_export=True, hoist_constants_as_args=False
            ),
        )
        exported = _export._export_lowered(lowered, traced.jaxpr, traced.fun_name)
        payload = bytes(exported.serialize())
        # The process that writes the entry runs what the ones that read it will run.
        loaded = jax.export.deserialize(bytearray(payload))
        compiled = _compile(loaded, args, jit_options, compiler_options)
    except Exception as error:  # noqa: BLE001 - not exportable: traced and compiled as before
        log.debug("zerojax: program %s is not cached (%s: %s)", name, type(error).__name__, error)
        return None
    donated = [bool(a.donated) for a in jax.tree.leaves(traced.args_info)]
    layout = _executable_layout(compiled)
    if layout["donated"] != donated:
        log.debug("zerojax: program %s is not cached: its donation differs when exported", name)
        return None
    try:
        _write(directory, key, name, payload, layout)
    except OSError as error:  # an unwritable cache only costs the next run
        log.debug("zerojax: could not write program cache entry %s (%s)", key, error)
    return compiled


def load(
    key: str,
    name: str,
    args: tuple,
    jit_options: Mapping[str, Any],
    compiler_options: Mapping[str, Any],
):
    """The executable stored under `key`, compiled for `args` (JAX's persistent cache loads
    it), or None when there is no usable entry (a bad one warns)."""
    directory = cache_directory()
    if directory is None or not available():
        return None
    check_private_directory(os.path.dirname(directory), "the compilation cache directory")
    check_private_directory(directory, "the program cache directory")
    path = os.path.join(directory, key + SUFFIX)
    begin = time.perf_counter()
    try:
        with open(path, "rb") as file:
            header, payload = _parse(file.read(), key)
        exported = jax.export.deserialize(bytearray(payload))
        read_seconds = time.perf_counter() - begin
        compiled = _compile(exported, args, jit_options, compiler_options)
        layout = _executable_layout(compiled)
        for part, value in layout.items():
            if header[part] != value:
                raise ValueError(f"it compiles to other {part.replace('_', ' ')}")
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - a bad entry only costs the tracing
        reason = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"zerojax: program cache entry {path} ({name}) did not load ({reason[:500]}); "
            "tracing the program again and replacing the entry",
            ProgramCacheWarning,
            stacklevel=3,
        )
        return None
    os.utime(path)  # recently used: the last to be evicted
    _note_load(name, path, read_seconds)
    return compiled


def _note_load(name: str, path: str, seconds: float) -> None:
    from zerojax.runtime.effective_time import LEDGER

    log.info("zerojax: program %s loaded from the program cache (%s), not traced", name, path)
    if LEDGER.start is not None:
        LEDGER.add("trace_compile", seconds, source="program_cache_load", program=name)


def _write(directory: str, key: str, name: str, payload: bytes, layout: dict) -> None:
    from zerojax.bridge.decomposition_cache import evict_least_recently_used, max_bytes

    header = {
        "format": FORMAT,
        "key": key,
        "program": name,
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        **layout,
    }
    encoded = _MAGIC + json.dumps(header).encode() + b"\n" + payload
    os.makedirs(directory, mode=0o700, exist_ok=True)
    check_private_directory(directory, "the program cache directory")
    handle, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(encoded)
        os.replace(temporary, os.path.join(directory, key + SUFFIX))
    except BaseException:
        os.unlink(temporary)
        raise
    # The capture cache's bound and eviction (its entries share this suffix).
    evict_least_recently_used(directory, max_bytes())


def _parse(data: bytes, key: str) -> tuple[dict, bytes]:
    """(header, payload) of an entry, checked: ValueError naming what is wrong."""
    if not data.startswith(_MAGIC):
        raise ValueError("not a zerojax program cache entry")
    end = data.find(b"\n", len(_MAGIC))
    if end < 0:
        raise ValueError("truncated header")
    header = json.loads(data[len(_MAGIC) : end])
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format') if isinstance(header, dict) else '?'}")
    if header.get("key") != key:
        raise ValueError(f"filed under {key}, written for {header.get('key')}")
    payload = data[end + 1 :]
    if len(payload) != header.get("size"):
        raise ValueError(f"{len(payload)} bytes of a {header.get('size')}-byte program")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("sha256 mismatch")
    return header, payload
