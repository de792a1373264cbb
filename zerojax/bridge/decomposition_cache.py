"""A persistent cache of the decomposition step of capture, keyed by the graph it decomposes.

Capture is torch.export (the model's Python code traced to a training-IR graph), then
`run_decompositions` (that graph traced again, down to core ATen). The second step is the
larger part of a first step's capture (~0.6 s of ~1 s for the bench GPT-2, torch's first-call
costs included) and it is a pure function of its inputs: the training-IR graph with its node
metadata, the graph signature, the lifted constants, the decomposition table, torch itself and
the bits of torch's global state its decompositions read (default dtype, deterministic mode).
So it is cached under a hash of exactly those, next to JAX's persistent compilation cache
(`<jax_compilation_cache_dir>/zerojax-capture/<key>.program`), and a restarted job loads the
decomposed program instead of tracing it again.

What is deliberately *not* cached is torch.export itself: its result depends on the model's
code and everything that code reads (module attributes such as `num_heads`, configs, globals,
environment variables, torch flags), which no key can list. It runs every time; a changed model
changes its graph, hence the key. A graph the key cannot describe completely is not cached:
symbolic shapes, higher-order ops or submodules, ops outside ATen/prims (a custom op's
decomposition is the user's Python code), metadata of kinds not listed in `_NODE_META`, or
constants that are not tensors.

Trust: an entry is data, never code. It was a pickle, and a planted `<key>.pickle` ran a shell
command on the next capture. Now it is `program_data`'s format (torch.export's serialized
program as JSON under a header with the key and a sha256, constants as raw bytes; no pickle,
no torch.load), read by a decoder that checks every value's type and refuses what would reach
an evaluator in torch's own reader (symbolic shape expressions go to `sympy.sympify`) or in FX
code generation. `<key>.pickle` files of earlier versions are never read, only evicted. An
entry that does not load (damaged, truncated, filed under another key, refused) is a
`CaptureCacheWarning` naming it and why; the graph is decomposed again and the entry replaced
(an entry of an earlier format is replaced the same way, at debug level: stale, not damaged).
A valid but different program planted by someone who can write to the directory cannot be told
from a real one, so the directory, like JAX's around it, must be writable by this user alone
(`runtime/private_directory.py`: UnsafeDirectoryError otherwise).

Speed: torch's own JSON reader (`torch.export.load`) took 0.62 s just to turn GPT-2's JSON
into its schema objects (`typing.get_type_hints` per object), as long as decomposing; hence
the pickle before. `program_data`'s decoder builds them once per type: for Hugging Face GPT-2
(GPT2Config() defaults, logits out, 64 tokens; a 1.46 MB entry, 1.76 MB as a pickle) reading
and checking an entry takes 119 ms (median of 15, min 49 ms) where unpickling took 122 ms (min
52 ms), and a whole load, torch's deserializer included, 753 ms against 847 ms (min 313 vs
345 ms); interleaved in one process on a shared 2-core host at load 4-10, so the medians are
inflated but their ratio holds. A first capture in a fresh process: 7.3 s served from the
cache against 7.4 s before, 9.4-10.3 s uncached (n=5 and 3, same host).

Entries are written atomically (temporary file, then rename), and only if reading them back
gives the graph decomposition gave. The directory is bounded: after each write the least
recently used entries go until the rest fit in `max_bytes()` (JAX's
`jax_compilation_cache_max_size` when set, else DEFAULT_MAX_BYTES). An entry is a few KB to
~1.5 MB and every edit of a model writes a new one, so an unbounded cache only grows.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import os
import tempfile
import warnings
from collections.abc import Callable

import jax
import torch
import torch.utils._pytree as torch_pytree

from zerojax.bridge import program_data
from zerojax.runtime.private_directory import check_private_directory

log = logging.getLogger("zerojax")

FORMAT = 3
"""Bumped whenever what is cached, or how it is keyed, changes."""

SUBDIRECTORY = "zerojax-capture"

SUFFIX = ".program"
"""An entry is `<directory>/<key>.program`, a program as `program_data` writes it."""

_OLD_SUFFIXES = (".pickle",)
"""Entries of earlier formats: never read, evicted like the others (they are the oldest)."""

DEFAULT_MAX_BYTES = 256 * 2**20
"""The directory's size bound when JAX's compilation cache has none (its default, -1): a few
hundred captures of models the size of the bench GPT-2 (~1 MB each); scanning the directory
after a write costs ~7 ms at 3,000 entries."""

# Node metadata torch.export writes on a training-IR graph and run_decompositions carries over
# (`original_aten` and `seq_nr` where node meta is preserved, as capture does for checkpoint
# tags). Any other key makes the graph uncacheable: its content would not be in the key.
_NODE_META = (
    "val",
    "tensor_meta",
    "nn_module_stack",
    "stack_trace",
    "torch_fn",
    "custom",
    "original_aten",
    "seq_nr",
)


class CaptureCacheWarning(UserWarning):
    """A capture cache entry did not load (it is captured again and replaced)."""


# Ops whose lowering reads their input's storage offset (bridge/lowerings/shape.py).
_READS_STORAGE_OFFSET = (
    torch.ops.aten.as_strided.default,
    torch.ops.aten.as_strided_copy.default,
    torch.ops.aten.as_strided_scatter.default,
)


def cache_directory() -> str | None:
    """Where entries live: beside JAX's persistent compilation cache, None without one."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory:
        return None
    return os.path.join(directory, SUBDIRECTORY)


def decompose(
    exported: torch.export.ExportedProgram,
    table: dict,
    run: Callable[[torch.export.ExportedProgram, dict], torch.export.ExportedProgram],
) -> torch.export.ExportedProgram:
    """`run(exported, table)`, or its result from the cache when the key matches.

    UnsafeDirectoryError if the cache directory, or JAX's cache directory holding it, can be
    written by other users (`runtime/private_directory.py`)."""
    directory = cache_directory()
    if directory is None:
        return run(exported, table)
    check_private_directory(os.path.dirname(directory), "the compilation cache directory")
    check_private_directory(directory, "the capture cache directory")
    try:
        key = cache_key(exported, table)
    except Exception as error:  # noqa: BLE001 - a graph the key trips on is just not cached
        log.debug("zerojax: no capture cache key for this graph (%s); decomposing", error)
        key = None
    if key is None:
        return run(exported, table)
    path = os.path.join(directory, key + SUFFIX)
    try:
        loaded = _load(path, exported)
    except FileNotFoundError:
        pass  # not cached (or just evicted by another process)
    except program_data.OtherFormatError as error:  # an earlier zerojax's entry: replaced
        log.debug("zerojax: capture cache entry %s is stale (%s); replacing it", path, error)
    except Exception as error:  # noqa: BLE001 - a bad entry only costs the decomposition
        reason = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"zerojax: capture cache entry {path} did not load ({reason[:500]}); capturing "
            "again and replacing it",
            CaptureCacheWarning,
            stacklevel=2,
        )
    else:
        os.utime(path)  # recently used: the last to be evicted
        return loaded
    decomposed = run(exported, table)
    try:
        _save(decomposed, exported, directory, path)
        evict_least_recently_used(directory, max_bytes())
    except Exception as error:  # noqa: BLE001 - an unwritable cache only costs the next run
        log.debug("zerojax: could not write capture cache entry %s (%s)", path, error)
    return decomposed


def max_bytes() -> int:
    """The directory's size bound: JAX's compilation cache bound when set, else the default."""
    configured = jax.config.jax_compilation_cache_max_size
    return configured if configured >= 0 else DEFAULT_MAX_BYTES


def evict_least_recently_used(directory: str, budget: int) -> None:
    """Delete entries, least recently used (written or served) first, until the rest fit in
    `budget` bytes. Another process may delete or replace entries meanwhile: a vanished file is
    skipped, and a process that finds its entry gone decomposes again."""
    entries = []
    for entry in os.scandir(directory):
        if entry.name.endswith((SUFFIX, *_OLD_SUFFIXES)):
            try:
                status = entry.stat()
            except FileNotFoundError:
                continue
            entries.append((status.st_mtime, status.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= budget:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        total -= size


def _save(
    decomposed: torch.export.ExportedProgram,
    exported: torch.export.ExportedProgram,
    directory: str,
    path: str,
) -> None:
    """The program as data (`program_data.encode`), written atomically, and only if decoding it
    back gives the same graph as the lowerings read it: the serializer gives every view a
    storage offset of 0, so a graph with `as_strided`, whose lowering reads them, is not cached,
    and an entry this process could not load (`program_data` refuses it) is never written."""
    try:
        encoded = program_data.encode(decomposed, _key_of(path))
    except program_data.ProgramDataError as error:
        log.debug("zerojax: the decomposed graph is not cached: %s", error)
        return
    # The serializer drops views' storage offsets; only `as_strided` reads them.
    offsets = any(node.target in _READS_STORAGE_OFFSET for node in decomposed.graph.nodes)
    loaded = _deserialize(encoded, _key_of(path), exported)
    if _graph_description(loaded, offsets) != _graph_description(decomposed, offsets):
        log.debug("zerojax: the decomposed graph does not survive serialization; not cached")
        return
    os.makedirs(directory, mode=0o700, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(encoded)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _load(path: str, exported: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    with open(path, "rb") as file:
        return _deserialize(file.read(), _key_of(path), exported)


def _key_of(path: str) -> str:
    return os.path.basename(path).removesuffix(SUFFIX)


def _graph_description(program: torch.export.ExportedProgram, storage_offsets: bool) -> list[str]:
    """Every node as the interpreter and the lowerings see it: op, target, arguments and the
    recorded value (shape, strides, storage offset if asked, dtype, ...). The output node's own
    value is left out: the deserializer records one, decomposition does not, nothing reads it."""
    described = []
    for node in program.graph_module.graph.nodes:
        value = None if node.op == "output" else node.meta.get("val")
        parts = [node.op, node.name, _target_name(node.target)]
        parts += [_describe(x, storage_offsets) for x in (node.args, node.kwargs, value)]
        described.append("|".join(parts))
    return described


def _deserialize(encoded: bytes, key: str, exported: torch.export.ExportedProgram):
    loaded = program_data.decode(encoded, key, exported.state_dict, exported.example_inputs)
    # The deserializer gives every output of a multi-output op a getitem node, used or not
    # (`native_layer_norm_unused_1 = native_layer_norm[1]`); decomposition leaves none.
    graph = loaded.graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is operator.getitem and not node.users:
            graph.erase_node(node)
        elif _returns_a_list(node) and isinstance(node.meta.get("val"), tuple):
            # ... and records an op's `Tensor[]` result (split) as a tuple, torch as a list.
            node.meta["val"] = list(node.meta["val"])
    loaded.graph_module.recompile()
    return loaded


def _returns_a_list(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.ListType)


def cache_key(exported: torch.export.ExportedProgram, table: dict) -> str | None:
    """A hash of everything `run_decompositions(table)` reads, or None if the program has
    something the key could not describe completely (module docstring)."""
    parts = [
        f"format={FORMAT}",
        f"torch={torch.__version__} {torch.version.git_version}",
        # Global state some of torch's decompositions read (window functions' default dtype,
        # max-pool backward's deterministic fallback).
        f"default dtype={torch.get_default_dtype()}",
        f"deterministic={torch.are_deterministic_algorithms_enabled()}",
        _table_description(table),
    ]
    graph = exported.graph_module
    if any(True for _ in graph.named_children()):
        return None  # higher-order ops' subgraphs
    # Autograd's sequence numbers count every autograd node the process made before: keyed
    # relative to the graph's first (a cached graph carries its writer's absolute numbers,
    # which nothing in zerojax reads).
    first_seq_nr = min(
        (n.meta["seq_nr"] for n in graph.graph.nodes if isinstance(n.meta.get("seq_nr"), int)),
        default=0,
    )
    for node in graph.graph.nodes:
        if node.op in ("get_attr", "call_module", "call_method"):
            return None
        if node.op == "call_function" and not _is_plain_function(node.target):
            return None
        unknown = set(node.meta) - set(_NODE_META)
        if unknown:
            return None
        described = [node.op, node.name, _target_name(node.target)]
        described.append(_describe((node.args, node.kwargs)))
        for name in _NODE_META:
            if name in node.meta:
                value = node.meta[name]
                if name == "seq_nr" and isinstance(value, int):
                    value -= first_seq_nr
                described.append(f"{name}={_describe(value)}")
        parts.append("|".join(described))
    parts.append(repr(exported.graph_signature.input_specs))
    parts.append(repr(exported.graph_signature.output_specs))
    parts.append(repr(exported.range_constraints))
    parts.append(repr(exported.module_call_graph))
    for name, constant in sorted(exported.constants.items()):
        if not isinstance(constant, torch.Tensor):
            return None
        parts.append(f"constant {name} {_describe(constant)} {_digest(constant)}")
    text = "\n".join(parts)
    if _UNDESCRIBED in text or " at 0x" in text:
        return None  # an object known only by its identity: no stable description
    return hashlib.sha256(text.encode()).hexdigest()


_UNDESCRIBED = "<undescribed>"


def _is_plain_function(target) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in program_data.CORE_NAMESPACES
    return getattr(target, "__module__", None) in ("_operator", "operator") and hasattr(
        operator, getattr(target, "__name__", "")
    )


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"


def _describe(value, storage_offsets: bool = True) -> str:
    """A repr that names everything decomposition sees: tensors by shape, strides, storage
    offset (unless `storage_offsets` is False), dtype, device and flags (FakeTensor's repr
    omits strides), nodes by name."""
    describe = functools.partial(_describe, storage_offsets=storage_offsets)
    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, torch.Tensor):
        return (
            f"T({tuple(value.shape)},{value.stride()},"
            f"{value.storage_offset() if storage_offsets else '_'},{value.dtype},"
            f"{value.device},{value.requires_grad},{value.layout})"
        )
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _UNDESCRIBED  # symbolic shapes: their constraints live elsewhere
    if isinstance(value, (list, tuple)):
        inner = ",".join(describe(v) for v in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        inner = ",".join(f"{describe(k)}:{describe(v)}" for k, v in value.items())
        return f"{type(value).__name__}{{{inner}}}"
    if isinstance(value, (str, int, float, bool, complex, type(None), torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, torch._ops.OpOverload):
        return str(value)
    if isinstance(value, (torch.memory_format, torch.layout, type)):
        return repr(value)
    if torch_pytree.is_namedtuple_instance(value):
        return f"{type(value).__name__}({describe(tuple(value))})"
    return _UNDESCRIBED


def _digest(tensor: torch.Tensor) -> str:
    if tensor.device.type == "meta":
        return "meta"
    data = tensor.detach().contiguous().cpu()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def _table_description(table: dict) -> str:
    """The table's ops and the decomposition each gets (by qualified name)."""
    entries = sorted(f"{op}={_function_name(fn)}" for op, fn in table.items())
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def _function_name(fn) -> str:
    """A function by qualified name; a `functools.partial` (torch's CIA decompositions) by
    its function's and its arguments' (an address in a key would never match again)."""
    if isinstance(fn, functools.partial):
        arguments = _describe((fn.args, fn.keywords))
        return f"partial({_function_name(fn.func)},{arguments})"
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
