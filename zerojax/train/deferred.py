"""Ops on live tensors, recorded and then run as one compiled program (lazy tensors).

An op on a live tensor (`zerojax.train.live_tensor`) does not run when torch calls it: it is
recorded, and its result is a `Deferred` value with a known shape and dtype. The recording
runs as one jitted program when a value is needed -- on the host (`.item()`, printing,
`torch.save`), or by the engine's next program (the forward, `step()`, a checkpoint: the
engine's state is never read with work pending) -- so torch's `clip_grad_norm_`, an EMA's
`lerp_` over every parameter, `p.data.add_(p.grad, alpha=-lr)` loops and a torch optimizer's
own `step()` each cost one program per step, not one call per op.

This is torch_xla's lazy tensor and torch.compile's optimizer capture, with their known
pitfalls kept out:

- **No recompile per step.** Python floats in arithmetic (a scheduled learning rate, a bias
  correction computed from the step count, a clip coefficient) are program inputs
  (`zerojax.bridge.eager`'s traced scalars), so the program is keyed by the op sequence alone:
  each op's signature (op, shapes, dtypes, constant arguments), where its inputs come from,
  and which results are still referenced when the recording runs. A recording that meets a new
  key compiles once and says why at info level (`zerojax.train.deferred`: the first op where it
  differs from the program compiled before it); `programs_compiled()` counts them.
- **No hidden host syncs.** Recording reads no values; the only syncs are the ones torch
  semantics demand (a host read) and, with a program whose arrays span several devices, waiting
  for its result (the rendezvous argument of `EagerCall.__call__`).
- **Bounded recordings.** The engine runs pending work before each of its programs, so a
  recording never spans a step; a recording that reaches `_MAX_OPS` runs at once.
- **Processes in step.** Over arrays that span several processes (a multi-process job) each
  op runs as it is recorded: where a recording is cut must not depend on one process alone.
- **Recorded once.** A recording like one before it (the next step's) is not recorded call
  by call again: `zerojax.train.replay` traces it and answers the next one's calls from the
  trace, rebuilding the recording they stand for before it runs here.

An op that would be a recording's only one (a captured optimizer step, with nothing recorded
before it) may instead run at once as a program of its own (`run_alone`): the same donation
rule, none of a recording's bookkeeping per input.

Only results still referenced when the recording runs leave the program (a Python temporary's
value never reaches memory), which CPython's reference counting decides deterministically.
Writes into the engine's state (a gradient, a weight, a buffer) are kept as pending writes
that later reads see, and are handed to the engine after the program runs.

Reference counts also decide which inputs the program may overwrite (JAX buffer donation, as
the engine's compiled update donates its state): an input array that nothing but the
recording holds -- an optimizer's moment before its in-place update, a value the recording
superseded -- or that only the engine holds for an entry the recording writes anew (a
parameter an optimizer's step updates; the engine's hold ends at the hand-over). Its buffer
then takes the new value, with no fresh allocation (XLA:CPU pays for a fresh buffer in page
faults). An array held anywhere else (a user's reference, a checkpoint's snapshot) is never
donated, so no value anyone can still read is lost.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from zerojax.bridge.index_bounds import raise_if_out_of_range
from zerojax.train.xla_options import in_place_options

__all__ = [
    "Deferred",
    "current_recording",
    "exclusive",
    "flush",
    "idle",
    "programs_compiled",
    "programs_run",
    "record",
    "resolve",
    "run_alone",
    "signature_generation",
]

log = logging.getLogger(__name__)

# A recording this long runs at once: a loop that never reads a value (an EMA updated for many
# steps with no engine program between) must not grow one program without bound.
_MAX_OPS = 20_000
# `sys.getrefcount(array)` in `_unheld` for an input array only the recording holds: its
# list's reference, `_unheld`'s argument and `getrefcount`'s own; where a call holds its
# arguments once more (below), one more.
_UNHELD = 3
# Compiled recordings kept; beyond it the least recently added is dropped.
_MAX_PROGRAMS = 256
# Distinct recorded-op signatures numbered before the numbering starts again.
_MAX_SIGNATURES = 1_000_000

# While a recording is replayed (`zerojax.train.replay`): called before anything reads,
# writes or records live values outside the replayed calls, to turn them into the recording
# they stand for first.
interrupt: list[Callable[[], None] | None] = [None]
# While a recording is traced or replayed: called with (source, value) at each write of a
# live tensor's source.
write_hook: list[Callable[[Any, Any], None] | None] = [None]
# Called by `flush` before it runs a recording: its trace ends, or its replay is made a
# recording (`zerojax.train.replay`).
segment_end: list[Callable[[], None] | None] = [None]


class Deferred:
    """The value of a recorded op that has not run yet (shape and JAX dtype known)."""

    __slots__ = ("__weakref__", "_array", "_error", "_position", "dtype", "shape")

    def __init__(self, shape: tuple[int, ...], dtype, position: tuple = ()):
        self.shape, self.dtype = shape if type(shape) is tuple else tuple(shape), dtype
        self._array: jax.Array | None = None
        self._error: BaseException | None = None
        # ("op", op index, output index) in the recording that will compute it.
        self._position = position

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def computed(self) -> jax.Array | None:
        """The value if its recording has run, else None (nothing runs)."""
        return self._array

    def resolve(self) -> jax.Array:
        """The value, running the recording if it has not run."""
        if self._array is None and self._error is None:
            flush()
        if self._error is not None:
            raise RuntimeError(
                "zerojax: this tensor's value was to come from recorded ops whose program "
                f"failed: {self._error}"
            ) from self._error
        assert self._array is not None, "a Deferred outlived its recording unresolved"
        return self._array


def resolve(value):
    """`value` as an array: a Deferred's value (running the recording if needed), else itself."""
    return value.resolve() if isinstance(value, Deferred) else value


# One recorded op: `fn(arrays, rng)` -> (its result: an array or a list/tuple of them, an index
# flag vector, a list of them, or None), traced into the recording's program. `signature`
# numbers its key and inputs' origins (same key: the same computation on same-shaped inputs).
class _Op:
    __slots__ = ("fn", "random", "refs", "signature")

    def __init__(self, signature: int, fn: Callable, refs: tuple, random: bool):
        self.signature, self.fn, self.refs, self.random = signature, fn, refs, random


# (op key, input refs) -> a small int standing for it in program keys (hashed once, when
# recorded), and back (for the log line saying why a program is new).
_signatures: dict[tuple, int] = {}
_described: list[tuple] = []


class _Recording:
    def __init__(self):
        self.ops: list[_Op] = []
        self.outputs: list[list[weakref.ref]] = []
        self.arrays: list[jax.Array] = []
        self.array_slots: dict[int, int] = {}
        self.scalars: list[Any] = []
        self.scalar_slots: dict[int, int] = {}
        self.rngs: list[jax.Array] = []
        # Whether an input is an array of several processes: then every op runs at once (see
        # `record`); whether one spans several devices (then `flush` waits for the results).
        self.spans_processes = False
        self.spans_devices = False
        # (writer, name) -> (the value last written into that engine entry, its sharding);
        # `writer` takes {name: array} (all of a recording's writes through it at once).
        self.writes: dict[tuple[Callable, str], tuple[Deferred | jax.Array, Any]] = {}
        # (op index, output index) -> the sharding that output is to leave the program on
        # (`place`).
        self.placed: dict[tuple[int, int], Any] = {}
        # id(array) -> (the array, (writer, name)): engine entries' values read while recording
        # (`read_entry`); one this recording writes anew loses the engine's hold when it runs.
        self.entries: dict[int, tuple[jax.Array, tuple[Callable, str]]] = {}

    def take_arrays(self, arrays: list[jax.Array], final: bool = False) -> None:
        """Take `arrays` as the next input arrays (a replay rebuilding a recording: the same
        array may fill two slots, as a recording made afresh could not). `final`: no op will
        be recorded after them (the recording runs next), so no slot is noted for one."""
        if not final:
            slots, start = self.array_slots, len(self.arrays)
            for i, array in enumerate(arrays, start):
                slots.setdefault(id(array), i)
        self.arrays.extend(arrays)
        shardings = {}
        for array in arrays:
            sharding = array.sharding
            shardings[id(sharding)] = sharding
        for sharding in shardings.values():
            processes, devices = _spans(sharding)
            self.spans_processes |= processes
            self.spans_devices |= devices

    def take_scalars(self, values: list, final: bool = False) -> None:
        """Take `values` as the next scalar inputs (see `take_arrays`)."""
        if not final:
            slots, start = self.scalar_slots, len(self.scalars)
            for i, value in enumerate(values, start):
                slots.setdefault(id(value), i)
        self.scalars.extend(values)

    def take_ops(self, ops: list, outputs: list[list]) -> None:
        """Take recorded `ops` (recorded before, their inputs taken here in the same order)
        and, per op, weak references to the Deferreds standing for its outputs (None: none)."""
        self.ops.extend(ops)
        self.outputs.extend([ref or _gone for ref in refs] for refs in outputs)

    def ref(self, value) -> tuple:
        """Where an op's input comes from: an earlier op's output, an array or a scalar."""
        if type(value) is Deferred:
            if value._array is None and value._error is None:
                # Pending values are this recording's: `flush` computes or fails all of a
                # recording's referenced outputs before another one starts.
                return value._position
            value = value.resolve()  # raises for a value whose recording failed
        if isinstance(value, jax.Array):
            slot = self.array_slots.get(id(value))
            if slot is None:
                slot = self.array_slots[id(value)] = len(self.arrays)
                self.arrays.append(value)
                processes, devices = _spans(value.sharding)
                self.spans_processes |= processes
                self.spans_devices |= devices
            return ("array", slot)
        # One input per scalar object: a foreach op hands its one `value=-lr` to each of its
        # elements, which would be as many program inputs (each converted to a device value
        # at every run). `scalars` holds each object, so no other takes its id meanwhile.
        slot = self.scalar_slots.get(id(value))
        if slot is None:
            slot = self.scalar_slots[id(value)] = len(self.scalars)
            self.scalars.append(value)
        return ("scalar", slot)


def _gone() -> None:
    """An output no Deferred stands for (a weak reference whose object is gone)."""
    return None


_lock = threading.RLock()
_recording = _Recording()
# How many times the signature numbering started again (`record`): numbers of one generation
# mean nothing in another.
_generation = [0]
_programs: dict[tuple, Callable] = {}
# (op key, donated inputs, result shardings) -> (its program, whether its arrays span several
# devices) for ops run alone (`run_alone`).
_alone_programs: dict[tuple, tuple[Callable, bool]] = {}
_last_key: list[tuple] = []
_compiled = [0]
_runs = [0]
# How many recordings `flush` is running (taken out of `_recording`, their writes not yet
# handed over).
_running = [0]


def record(
    key: Hashable,
    fn: Callable,
    inputs: Sequence[Any],
    out_avals: Sequence[jax.ShapeDtypeStruct],
    rng: Callable[[], jax.Array] | None = None,
) -> list[Deferred]:
    """Record `fn(inputs, rng_key)` (see `_Op`) and return its outputs as Deferreds, one per
    leaf of its result in `out_avals`. `inputs` are Deferreds, arrays or traced scalars; `rng`
    makes the op's key (random ops only)."""
    if interrupt[0] is not None:
        interrupt[0]()
    with _lock:
        recording = _recording
        ref = recording.ref
        refs = tuple([ref(x) for x in inputs])
        signature = _signatures.get((key, refs))
        if signature is None:
            if len(_described) >= _MAX_SIGNATURES:  # numbers are reused: programs go too
                _signatures.clear(), _described.clear(), _programs.clear(), _last_key.clear()
                _generation[0] += 1
            signature = _signatures[(key, refs)] = len(_described)
            _described.append((key, refs))
        op = _Op(signature, fn, refs, rng is not None)
        if rng is not None:
            recording.rngs.append(rng())
        index = len(recording.ops)
        recording.ops.append(op)
        outputs = [Deferred(a.shape, a.dtype, ("op", index, k)) for k, a in enumerate(out_avals)]
        recording.outputs.append([weakref.ref(d) for d in outputs])
        # Several processes run their programs' collectives in one order only if every
        # process runs the same programs: a host read that one rank makes alone (rank 0 saving
        # `optimizer.state_dict()`) would cut its recording where the others' goes on, and the
        # job would hang. Over arrays of several processes each op runs as it comes, as torch
        # runs it.
        if len(recording.ops) >= _MAX_OPS or recording.spans_processes:
            flush()
        return outputs


def read_entry(array: jax.Array, writer: Callable, name: str) -> None:
    """Note that `array` is the engine's value of entry `name` (written through `writer`): if
    this recording writes that entry, the engine's hold on `array` ends when it runs, and the
    program may reuse its buffer (`flush`)."""
    _recording.entries.setdefault(id(array), (array, (writer, name)))  # atomic under the GIL


def pending_write(writer: Callable, name: str) -> Deferred | jax.Array | None:
    """The value last written into engine entry `name` (through `writer`) while recording."""
    written = _recording.writes.get((writer, name))
    return None if written is None else written[0]


def write(writer: Callable, name: str, value: Deferred | jax.Array, sharding=None) -> None:
    """Write `value` into engine entry `name` when the recording runs (reads see it now).
    `sharding`: where the entry lives, for the program to leave the value there (None: where
    the compiler puts it; the writer moves it)."""
    with _lock:
        _recording.writes[(writer, name)] = (value, sharding)


def place(value: Deferred, sharding) -> None:
    """Have the recording leave `value` on `sharding` (an optimizer's state tensor on its ZeRO
    shards): placed by the program itself, not moved after it."""
    with _lock:
        if value._array is None and value._error is None:
            _recording.placed[value._position[1:]] = sharding


def current_recording() -> _Recording:
    """The recording ops are being recorded into (`zerojax.train.replay` traces it)."""
    return _recording


def signature_generation() -> int:
    """Changes when recorded ops' signature numbers are reused (a trace of them is stale)."""
    return _generation[0]


def programs_compiled() -> int:
    """How many distinct recordings have been compiled in this process."""
    return _compiled[0]


def programs_run() -> int:
    """How many recordings have run in this process (one program each)."""
    return _runs[0]


def flush() -> None:
    """Run what has been recorded, as one program; resolve every Deferred still referenced and
    hand pending writes to the engine. Nothing to do without recorded ops or writes."""
    global _recording
    if segment_end[0] is not None:
        segment_end[0]()
    if not (_recording.ops or _recording.writes or _running[0]):
        _recording.entries.clear()  # notes of reads no op took in (a host read's)
        return
    # A flush running on another thread holds the lock until it has handed its writes over:
    # the engine is not read in between (its entries' old arrays may be donated).
    with _lock:
        recording = _recording
        if not (recording.ops or recording.writes):
            recording.entries.clear()
            return
        _recording = _Recording()
        _running[0] += 1
        try:
            _run(recording)
        finally:
            _running[0] -= 1


def _run(recording: _Recording) -> None:
    """Run `recording` (taken out of `_recording` by `flush`, which holds the lock)."""
    if not recording.ops:  # writes of values computed already (an earlier recording's)
        _hand_over(recording)
        return
    wanted = [
        (i, k)
        for i, outputs in enumerate(recording.outputs)
        for k, output in enumerate(outputs)
        if output() is not None
    ]
    # Values bound for the engine leave the program on the entry's sharding: no transfer
    # afterwards (the compiler's own choice can be an equal layout spelt differently).
    targets = {
        id(value): sharding
        for value, sharding in recording.writes.values()
        if isinstance(value, Deferred)
    }
    placed = recording.placed
    out_shardings = tuple(
        targets.get(id(recording.outputs[i][k]()), placed.get((i, k))) for i, k in wanted
    )
    # Inputs nothing else holds once it has run (`_unheld`: an optimizer state tensor's value
    # before the step, a parameter the step rewrites): their buffers are the program's to
    # reuse for its results (XLA writes the new values where the old ones were).
    arrays = recording.arrays
    # Not where a result leaves for host memory (offloaded optimizer state): XLA pairs donated
    # inputs with results by shape and dtype alone, and a device buffer given to a result
    # bound for the host fails the run ("Memory kind mismatch").
    donated = ()
    if not any(_in_host_memory(sharding) for sharding in out_shardings):
        extra = _extra_argument_references()
        donated = tuple(i for i in range(len(arrays)) if _unheld(recording, arrays[i], extra))
    layout, packed = _packed_scalars(recording.scalars)
    key = (
        tuple(op.signature for op in recording.ops),
        tuple(wanted),
        len(arrays),
        out_shardings,
        donated,
        layout,
    )
    try:
        program = _programs.get(key)
        new = program is None
        if new:
            program = _compile(recording, wanted, key)
        given, kept = [], arrays
        if donated:
            given, kept = _split(arrays, donated)
            recording.arrays = arrays = []
        with warnings.catch_warnings():
            if new:  # XLA reuses what it can; a buffer it cannot reuse is just freed
                warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            results, flags = program(given, kept, packed, recording.rngs)
        del given
        if recording.spans_devices:
            jax.block_until_ready(results)
    except Exception as error:
        # The values are lost, not wrong: every tensor waiting for them says why when read.
        for i, k in wanted:
            deferred = recording.outputs[i][k]()
            if deferred is not None:
                deferred._error = error
        raise
    _runs[0] += 1
    for (i, k), array in zip(wanted, results, strict=True):
        deferred = recording.outputs[i][k]()
        if deferred is not None:
            deferred._array = array
    _hand_over(recording)
    for vector in flags:
        raise_if_out_of_range(vector)


def idle() -> bool:
    """Whether nothing is recorded or running, and no trace or replay is under way (their
    hooks are set while one is): then an op run at once (`run_alone`) reads and leaves what a
    recording of it would."""
    recording = _recording
    return not (
        recording.ops
        or recording.writes
        or _running[0]
        or interrupt[0] is not None
        or write_hook[0] is not None
    )


def exclusive() -> threading.RLock:
    """The lock a flush holds while it runs and hands over (`run_alone`'s caller holds it from
    its reads to its writes)."""
    return _lock


def run_alone(
    key: Hashable,
    fn: Callable,
    arrays: list[jax.Array],
    rest: list,
    written: Sequence[int],
    out_shardings: Sequence[Any],
    what: str,
) -> list[jax.Array]:
    """Run `fn(arrays + rest, None)` (an op, see `_Op`; `what` it is, for the log) at once as
    a program of its own, where `idle()`: with nothing to fuse it with, a recording's bookkeeping per input (its origin,
    its result's hand-over) would cost more than it saves (a captured optimizer step: ~1 ms of
    Python for 156 arrays). `written`: the positions in `arrays` of the inputs its results
    replace, in the results' order; results leave on `out_shardings`. Such an input's buffer is
    the program's to reuse (as `flush` donates) where nothing holds it but `arrays` and the one
    owner it was read from (a live tensor's own array; an engine entry, with the recording's
    note of that read): the caller writes each result there. Empties `arrays`."""
    extra = _extra_argument_references()
    donated = tuple(k for k in written if _owner_only(arrays[k], extra))
    program_key = (key, donated, tuple(out_shardings))
    entry = _alone_programs.get(program_key)
    new = entry is None
    if new:
        entry = _compile_alone(fn, arrays, donated, program_key, what)
    program, spans_devices = entry
    given, kept = _split(arrays, donated)
    arrays.clear()
    with warnings.catch_warnings():
        if new:  # (as `_run`: a buffer XLA cannot reuse is just freed)
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        results, flags = program(given, kept, rest)
    del given
    if spans_devices:
        jax.block_until_ready(results)
    _runs[0] += 1
    for vector in flags:
        raise_if_out_of_range(vector)
    return results


def _owner_only(array: jax.Array, extra: int) -> bool:
    """Whether nothing holds `array` but its list, its owner and, for an engine entry's value,
    the recording's note of its read (`read_entry`)."""
    references = sys.getrefcount(array) - extra  # (as `_unheld` counts)
    noted = _recording.entries.get(id(array))
    return references <= _UNHELD + 1 + (noted is not None and noted[0] is array)


def _compile_alone(fn: Callable, arrays: list, donated: tuple, key: tuple, what: str) -> tuple:
    count, out_shardings = len(arrays), key[2]
    kept = _kept(count, donated)

    def program(given, held, rest):
        value, flag = fn(_joined(count, donated, kept, given, held) + list(rest), None)
        flags = flag if isinstance(flag, list) else [] if flag is None else [flag]
        return jax.tree.leaves(value), flags

    _compiled[0] += 1
    log.info(
        "zerojax: compiling %s, run alone; %d of its %d input arrays donated",
        what,
        len(donated),
        count,
    )
    compiled = _jitted(program, out_shardings)
    spans_devices = any(_spans(a.sharding)[1] for a in arrays)
    if len(_alone_programs) >= _MAX_PROGRAMS:
        _alone_programs.pop(next(iter(_alone_programs)))
    _alone_programs[key] = (compiled, spans_devices)
    return compiled, spans_devices


def _jitted(program: Callable, out_shardings) -> Callable:
    """`program` (given arrays first, donated) jitted with its results on `out_shardings`,
    written in place as the update's are (`xla_options.in_place_options`)."""
    return jax.jit(
        program,
        out_shardings=(list(out_shardings), None),
        donate_argnums=0,
        compiler_options=in_place_options(jax.default_backend()) or None,
    )


def _in_host_memory(sharding) -> bool:
    return getattr(sharding, "memory_kind", None) not in (None, "device")


def _unheld(recording: _Recording, array: jax.Array, extra: int) -> bool:
    """Whether nothing outside `recording` will hold `array` once it has run: no reference but
    the recording's own, or else the engine's to an entry the recording writes anew (handed
    over right after the program) and `recording.entries`' note of it."""
    references = sys.getrefcount(array) - extra  # (`_extra_argument_references`)
    if references <= _UNHELD:
        return True
    entry = recording.entries.get(id(array))
    return (
        entry is not None
        and entry[0] is array
        and entry[1] in recording.writes
        and references <= _UNHELD + 2  # the engine's state and the note
    )


def _extra_argument_references() -> int:
    """How many references more than CPython 3.11's own a call holds to its argument: 0, or 1
    in a process where some torch.compile traces failed (torch 2.11's dynamo on Adagrad's
    step, 2.13's on a fused step: every call holds its arguments once more afterwards, which
    `_unheld` would take for a holder of every array). Measured, not assumed."""
    held = [object()]
    return _argument_references(held[0]) - _UNHELD


def _argument_references(value) -> int:
    return sys.getrefcount(value)


def _hand_over(recording: _Recording) -> None:
    """Give the engine what `recording` wrote into its entries, one call per writer."""
    by_writer: dict[Callable, dict[str, jax.Array]] = {}
    for (writer, name), (value, _) in recording.writes.items():
        by_writer.setdefault(writer, {})[name] = resolve(value)
    for writer, values in by_writer.items():
        writer(values)


# A Python float in a packed scalar layout (`_packed_scalars`).
_FLOAT = "float"


def _packed_scalars(scalars: list) -> tuple[tuple, tuple]:
    """(layout, packed): a recording's scalar inputs as few program arguments. Each argument
    is a conversion at every run (~2.5 us on this host), and NAdam's foreach step takes 160
    floats (a bias correction per parameter), Rprop's 208 0-d host tensors: the Python floats
    go in one vector (in the dtype JAX gives a float argument, so each is rounded as it would
    be), the 0-d host arrays in one vector per dtype, anything else as itself. `layout` says
    which is which, per scalar (`_unpacked_scalars` undoes it in the program)."""
    floats, zero_d, rest, layout = [], {}, [], []
    for value in scalars:
        kind = type(value)
        if kind is float:
            layout.append(_FLOAT)
            floats.append(value)
        elif kind is np.ndarray and not value.shape:
            dtype = value.dtype.str
            layout.append(dtype)
            zero_d.setdefault(dtype, []).append(value)
        else:
            layout.append(None)
            rest.append(value)
    vectors = tuple(np.array(values, dtype) for dtype, values in zero_d.items())
    packed = (np.array(floats, jax.dtypes.canonicalize_dtype(np.float64)), vectors, rest)
    return (tuple(layout), tuple(zero_d)), packed


def _unpacked_scalars(layout: tuple, packed: tuple) -> list:
    """The scalar inputs `_packed_scalars` packed, as the program's traced values: a float
    weakly typed, as a Python float argument is (it takes its dtype from the tensor it meets,
    a bfloat16 one's too), a 0-d host array in its own dtype."""
    # JAX's own way to a weakly typed value (what it makes of a Python float argument); no
    # public spelling takes `weak_type`. Imported here, where a program is traced: jax 0.10
    # and 0.11, the versions pyproject.toml admits, both have it (`make test-gpu-stack`).
    from jax._src.lax.lax import _convert_element_type

    kinds, dtypes = layout
    floats, vectors, rest = packed
    # Each kind of scalar read in order from its own source (a dtype string is neither key).
    sources = {
        _FLOAT: iter([_convert_element_type(x, weak_type=True) for x in floats]),
        None: iter(rest),
        **dict(zip(dtypes, [iter(list(v)) for v in vectors], strict=True)),
    }
    return [next(sources[kind]) for kind in kinds]


def _split(arrays: list, donated: tuple) -> tuple[list, list]:
    """A program's input arrays as its two arguments: those it may reuse (`donated`, their
    positions), the others in order."""
    return [arrays[i] for i in donated], [arrays[i] for i in _kept(len(arrays), donated)]


def _kept(count: int, donated: tuple) -> list[int]:
    """The positions of a program's input arrays that are not donated."""
    gone = set(donated)
    return [i for i in range(count) if i not in gone]


def _joined(count: int, donated: tuple, kept: list, given: list, held: list) -> list:
    """`_split`'s two arguments as the input arrays in their order again (in the program)."""
    arrays = [None] * count
    for i, array in zip(donated, given, strict=True):
        arrays[i] = array
    for i, array in zip(kept, held, strict=True):
        arrays[i] = array
    return arrays


def _compile(recording: _Recording, wanted: list, key: tuple) -> Callable:
    steps = [(op.fn, op.refs, op.random) for op in recording.ops]
    count, donated, layout = key[2], key[4], key[5]
    kept = _kept(count, donated)

    def program(given, held, packed, rngs):
        scalars = _unpacked_scalars(layout, packed)
        arrays = _joined(count, donated, kept, given, held)
        produced, flags, draws = [], [], iter(rngs)
        for fn, refs, random in steps:
            inputs = [
                produced[r[1]][r[2]]
                if r[0] == "op"
                else arrays[r[1]]
                if r[0] == "array"
                else scalars[r[1]]
                for r in refs
            ]
            value, flag = fn(inputs, next(draws) if random else None)
            produced.append(jax.tree.leaves(value))
            if isinstance(flag, list):  # one per element of a foreach op
                flags.extend(flag)
            elif flag is not None:
                flags.append(flag)
        return [produced[i][k] for i, k in wanted], flags

    _compiled[0] += 1
    log.info(
        "zerojax: compiling recorded live-tensor ops: %s; %d of its %d input arrays donated",
        _why_new(key),
        len(donated),
        count,
    )
    compiled = _jitted(program, key[3])
    if len(_programs) >= _MAX_PROGRAMS:
        _programs.pop(next(iter(_programs)))
    _programs[key] = compiled
    _last_key[:] = [key]
    return compiled


def _why_new(key: tuple) -> str:
    """A sentence on what makes `key` a new program: the first op where it differs from the
    program compiled before it."""
    ops = key[0]
    if not _last_key:
        return f"{len(ops)} ops, the first recording"
    previous = _last_key[0][0]
    for i, (op, before) in enumerate(zip(ops, previous, strict=False)):
        if op != before:
            key = _described[op][0]
            return f"{len(ops)} ops, differing from the previous program at op {i}: {key!r}"
    if len(ops) != len(previous):
        return f"{len(ops)} ops where the previous program had {len(previous)}"
    if key[1] != _last_key[0][1]:
        return f"{len(ops)} ops, the same ops with other results still referenced"
    if key[4] != _last_key[0][4]:
        return f"{len(ops)} ops, the same ops with other inputs held elsewhere (not donated)"
    if key[5] != _last_key[0][5]:
        return f"{len(ops)} ops, the same ops with scalar inputs of other types"
    return f"{len(ops)} ops, the same ops with results placed on other shardings"


# id(sharding) -> (the sharding, (whether it spans several processes, several devices)),
# asked once per array a recording takes in: keyed by identity, as the few sharding objects
# of a step's arrays recur (equal ones compare through a Python __eq__); holding each keeps
# its id its own.
_spanning: dict[int, tuple[Any, tuple[bool, bool]]] = {}
_MAX_SHARDINGS = 4096


def _spans(sharding) -> tuple[bool, bool]:
    known = _spanning.get(id(sharding))
    if known is not None and known[0] is sharding:
        return known[1]
    if len(_spanning) >= _MAX_SHARDINGS:
        _spanning.clear()
    spans = (
        not sharding.is_fully_addressable,
        isinstance(sharding, NamedSharding) and sharding.mesh.size > 1,
    )
    _spanning[id(sharding)] = (sharding, spans)
    return spans
