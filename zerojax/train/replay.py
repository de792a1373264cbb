"""Recorded work on live tensors, traced once and replayed without its op-by-op Python.

Ops on live tensors are recorded and run as one program when a value is needed
(`zerojax.train.deferred`): torch's clip, an optimizer's own `step()`, a hand-written
`p.data.add_(p.grad, alpha=-lr)` loop. Recording is Python work per op and per list
element: the dispatch finds the op's lowering, binds and keys its arguments, and notes where
each input comes from -- every step, although the ops, their inputs and their program are
those of the step before. So a recording, from its first call to the flush that runs it, is
*traced*, and the next recording that opens with the same call is *replayed*.

Tracing notes every ATen call on live tensors (a "call") with its arguments described by
what they are, not by their values:

- a live tensor over something outside the recording (a parameter, its gradient, an
  optimizer's state tensor: the same source object every step), or a result of an earlier
  call of the recording;
- a Python float the program takes as an input (a learning rate, a bias correction: new
  values every step), or a constant the program was specialized on;
- a host tensor whose values the program takes as an input (Rprop's step-size factors,
  ASGD's `eta` and `mu`: torch passes them as 0-d CPU tensors), copied at the call as when
  recorded;

with what the call returned, which sources it wrote with which result, and the ops it
recorded. A replay lets the Python run unchanged (torch's host step counts advance, its
branches are taken); each call is checked against the trace -- the same op, argument
structure, tensors and constants -- and answered at once: its floats are the program's
scalar inputs, its results live tensors over values the program will compute. When the
recording is flushed, it is rebuilt from the trace (its ops, their inputs read from the same
sources, the new scalars, the writes) and runs as it would have: the same program, found by
its key, not compiled again.

The check is the guard. A replay is the recording the calls would have made: a call's ops
are a function of its op, its arguments' structure, shapes, dtypes and constants, and of
where its tensors' values come from, all checked; its traced floats are inputs, not part of
the program. What happens on the host runs for real. A call that differs (a new state key,
another param-group structure, a changed constant or dtype) -- or anything else that would
read, write or record live values meanwhile (a host read, an op recorded outside a call,
another thread's op) -- turns what was replayed into the recording it stands for, and the
rest is recorded and traced. Recordings that open alike and go on differently keep a trace
each, and a replay passes from one to another that shares the calls made so far.

Not traced (recorded as before): a recording that draws random numbers, writes a live
tensor with a value it did not record, takes in a view, records ops outside a call (Adam's
and Adafactor's steps recorded as one op outside torch's dispatch), or makes a call that
changes a host tensor it is given or takes values computed from one: a replay does not run
the call. Recordings that open alike and were not traceable are traced less and less often
(`_backoff`). Decompositions (an op without lowering, run as the ops torch decomposes it
into), and a call whose ops take a float it computed from its own, are traced with their
floats as constants: their Python may branch on the values, and a replay could not compute
the derived ones anew -- unless the code that records the call says how it derives them
(`derive_scalars`: a fused Adam step, the Hugging Face Trainer's default, takes its bias
corrections and host step counts so), when a replay derives them from each call's
arguments. A trace holds the tensors it began with weakly: it keeps no value alive.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import jax
import numpy as np
import torch

from zerojax.bridge.dtypes import host_array
from zerojax.train import deferred, live_tensor
from zerojax.train.deferred import Deferred
from zerojax.train.live_tensor import LiveTensor, Owned, run_op
from zerojax.train.parameters import EngineEntry

__all__ = ["derive_scalars", "install", "replays", "traces"]

log = logging.getLogger(__name__)

# What a dispatch's argument leaf is (see `_Entry.leaves`).
_SOURCE, _RESULT, _SLOT, _CONST, _HOST, _FREE = range(6)
# How an argument is checked (see `_argument_groups`).
_LEAF, _SOURCES, _RESULTS, _LEAVES = range(4)
# What a dispatch returned besides new live tensors.
_NONE, _FIRST, _ALIAS = "none", "first", "alias"
# Leaf types a trace keeps as constants (compared by type and value).
_CONSTANTS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
_counts = {"traces": 0, "replays": 0}
# Calls whose ops take scalar inputs that the call's own Python computes from its arguments
# (`derive_scalars`): op -> derivation(args, kwargs) -> (key, values) or None.
_derivations: dict = {}


def derive_scalars(derivations: dict) -> None:
    """Declare, per ATen op, how its calls on live tensors make their ops' scalar inputs.

    `derivation(args, kwargs)`, before the call runs, returns `(key, values)`: the values
    that the ops the call records take as scalar inputs, in order, and a key for what else
    those ops depend on among the call's floats and host tensors (None where the call is
    not recorded that way). With the ops a function of the call's op, its argument
    structure, shapes, dtypes and constants, and of that key, a replay computes the values
    anew from each call's arguments: the call is traced with its floats and host tensors
    free (a fused Adam step's learning rate, its bias-correction terms, its host step
    counts). A trace checks the values against those the call's ops took.
    """
    _derivations.update(derivations)


def traces() -> int:
    """How many recordings were recorded, not replayed, and traced (or found not traceable)
    in this process; not those recorded without tracing after failures (`_backoff`)."""
    return _counts["traces"]


def replays() -> int:
    """How many recordings were replayed from a trace in this process."""
    return _counts["replays"]


class _NotTraceable(Exception):
    """The recording does something a replay cannot stand for (the message says what)."""


class _Entry:
    """One call of a traced recording.

    `leaves`: per argument leaf (`live_tensor.flatten_arguments`' order), `(_SOURCE, source)` a
    live tensor over a source outside the recording, `(_RESULT, (entry, k))` the k-th live
    tensor entry `entry` returned, `(_SLOT, slot)` a float the program takes as scalar input
    `slot`, `(_HOST, slot, shape, dtype)` a host tensor whose values (copied at the call) the
    program takes as scalar input `slot`, `(_CONST, type, value)` a constant. `returns`:
    `_NONE`, `_FIRST` (its first argument), `_ALIAS` (a new live tensor over its first
    argument's source), or `(container type, [(position, shape, JAX dtype, torch dtype)])` of
    new live tensors over recorded results (container type None: one tensor). `writes`:
    `(target, position, shape, JAX dtype)`, the target a leaf-like `(_SOURCE, source)` or
    `(_RESULT, (entry, k))`. `ops`, `arrays`, `scalars`: the recording's sizes after it.
    `derived`: for a call whose scalar inputs are derived (`derive_scalars`), `(key, first
    slot, count)`, its float and host tensor leaves `(_FREE, float)` and `(_FREE,
    torch.Tensor, shape, dtype)`; else None."""

    __slots__ = (
        "arrays",
        "derived",
        "func",
        "groups",
        "leaves",
        "ops",
        "returns",
        "scalars",
        "spec",
        "writes",
    )


class _Trace:
    __slots__ = (
        "array_sources",
        "entries",
        "generation",
        "opener",
        "ops",
        "scalars",
    )


# Traces by the first call of their recording (`_segment_key`), keys least recently used
# first, each key's traces most recent first. Recordings that open alike and go on
# differently (a step that reads a norm every few steps) keep a trace each: those traced from
# another's replay share its first calls, and a replay passes from one to the other where
# they part (`_Replayer.switch`).
_traces: OrderedDict[tuple, list[_Trace]] = OrderedDict()
_MAX_TRACES = 64
_MAX_TRACES_PER_KEY = 4
# Recordings that open alike, were not traceable (Adam's step recorded as one op, the HF
# Trainer's every step) and have no trace to replay are traced again less and less often:
# after n failures in a row the next 2**(n-1) - 1 are recorded without tracing (at most 63),
# since tracing is Python work per call that, for them, buys nothing. A trace made ends the
# back-off.
_backoff: OrderedDict[tuple, _Backoff] = OrderedDict()
_MAX_SKIPPED = 63
# The recording now being traced or replayed.
_active: list[_Session | None] = [None]


class _Backoff:
    __slots__ = ("failures", "generation", "opener", "skip")


def install() -> None:
    """Trace and replay the recorded work on live tensors from now on (idempotent)."""
    live_tensor.dispatch_hook[0] = _dispatch
    deferred.segment_end[0] = _end_segment


def _dispatch(func, args: tuple, kwargs: dict):
    """Every ATen call on live tensors: into the recording being traced or replayed, or the
    first of a new one."""
    session = _active[0]
    if session is None:
        session = _begin(func, args)
        if session is None:
            return run_op(func, args, kwargs)
    return session.dispatch(func, args, kwargs)


def _begin(func, args: tuple) -> _Session | None:
    """Start tracing or replaying at a call that opens a recording (None: a recording holds
    ops already, or arrays span several processes, where each op runs as it comes)."""
    recording = deferred.current_recording()
    if recording.ops or recording.writes or _multiprocess():
        return None
    key, opener = _segment_key(func, args)
    traces = _traces.get(key)
    if traces is not None and (
        traces[0].generation != deferred.signature_generation()
        or traces[0].opener() is not opener  # the id of a source gone, taken by another
    ):
        del _traces[key]
        traces = None
    if traces is not None:
        _traces.move_to_end(key)
    elif (backoff := _backoff.get(key)) is not None:  # a trace to replay goes first
        if backoff.generation != deferred.signature_generation() or backoff.opener() is not opener:
            del _backoff[key]
        elif backoff.skip:
            backoff.skip -= 1
            return None
    session = _Session(key, opener, None if traces is None else _Replayer(traces))
    _active[0] = session
    session.install()
    return session


def _no_source() -> None:
    """A trace's opener when its first call has no live tensor first."""
    return None


@functools.cache
def _multiprocess() -> bool:
    return jax.process_count() > 1


def _segment_key(func, args: tuple) -> tuple[tuple, Any]:
    """(What a recording's trace is found by: its first call and the identity of the source
    of its first live tensor; that source, or None)."""
    first = args[0] if args else None
    if type(first) in (list, tuple) and first:
        first = first[0]
    source = first._source if type(first) is LiveTensor else None
    return (func, id(source)), source


def _end_segment() -> None:
    """`deferred.flush`, before it runs the recording: a replay becomes the recording it
    stands for, a trace is kept for the recordings to come."""
    session = _active[0]
    if session is None:
        return
    with session.lock:
        if _active[0] is not session:
            return
        _active[0] = None
        trace, why = session.finish()
    opener = _no_source if session.opener is None else weakref.ref(session.opener)
    if trace is None:
        _back_off(session.key, opener)
    else:
        _backoff.pop(session.key, None)
        trace.opener = opener
        kept = [t for t in _traces.pop(session.key, []) if t is not trace]
        _traces[session.key] = [trace, *kept[: _MAX_TRACES_PER_KEY - 1]]
        if len(_traces) > _MAX_TRACES:
            _traces.popitem(last=False)
    if session.replayed:
        _counts["replays"] += 1
        return
    _counts["traces"] += 1
    if trace is None:
        log.debug("zerojax: recorded live-tensor ops not traced: %s", why)
    else:
        log.debug(
            "zerojax: traced %d live-tensor calls for replay%s",
            len(trace.entries),
            "" if why is None else f"; the trace before no longer matched: {why}",
        )


def _back_off(key: tuple, opener) -> None:
    """A recording opening with `key` was not traceable: skip tracing the next ones."""
    backoff = _backoff.pop(key, None)
    if backoff is None:
        backoff = _Backoff()
        backoff.failures, backoff.opener = 0, opener
        backoff.generation = deferred.signature_generation()
    backoff.failures += 1
    backoff.skip = min(2 ** (backoff.failures - 1) - 1, _MAX_SKIPPED)
    _backoff[key] = backoff
    if len(_backoff) > _MAX_TRACES:
        _backoff.popitem(last=False)


class _Session:
    """One recording traced or replayed: the hooks on live tensors' values and writes."""

    def __init__(self, key: tuple, opener, replayer: _Replayer | None):
        self.key, self.opener = key, opener
        self.replayer = replayer
        self.recorder = _Recorder() if replayer is None else None
        self.thread = threading.get_ident()
        self.replayed = replayer is not None
        self.diverged: str | None = None
        # The trace replayed to its end before a call it does not have (`interrupt`).
        self.replayed_whole: _Trace | None = None
        # Another thread's live-tensor op, read or flush ends a replay or a trace while this
        # thread may be answering a call: the two never interleave.
        self.lock = threading.RLock()

    def install(self) -> None:
        deferred.write_hook[0] = self.on_write
        if self.replayer is not None:
            deferred.interrupt[0] = self.interrupt
        else:
            self.recorder.begin()

    def dispatch(self, func, args: tuple, kwargs: dict):
        if threading.get_ident() != self.thread:
            self.interrupt("a live-tensor op on another thread")
            with self.lock:
                if self.recorder is not None:
                    self.recorder.fail("another thread's ops went into its recording")
            return run_op(func, args, kwargs)
        with self.lock:
            replayer = self.replayer
            if replayer is not None:
                answer = replayer.dispatch(func, args, kwargs)
                if answer is _DIVERGED and replayer.switch(func):
                    answer = replayer.dispatch(func, args, kwargs)
                if answer is not _DIVERGED:
                    return answer
                self.interrupt(replayer.diverged)
            return self.recorder.dispatch(func, args, kwargs)

    def on_write(self, source, value) -> None:
        if self.recorder is not None and threading.get_ident() == self.thread:
            self.recorder.on_write(source, value)

    def interrupt(self, why: str = "a live value read, written or recorded outside a call"):
        """Turn the replayed calls into their recording; the rest is recorded and traced."""
        with self.lock:
            replayer = self.replayer
            if replayer is None:
                return
            deferred.interrupt[0] = None
            self.replayer, self.replayed, self.diverged = None, False, why
            self.recorder = replayer.materialize()
            self.replayed_whole = (
                replayer.trace if replayer.next == len(replayer.trace.entries) else None
            )

    def finish(self) -> tuple[_Trace | None, str | None]:
        """End the recording: a replay becomes the recording it stands for (`deferred.flush`
        then runs the program recorded before); returns the trace for the recordings to come
        and why the last one did not match (or why there is none)."""
        replayer = self.replayer
        try:
            if replayer is not None:
                if replayer.next == len(replayer.trace.entries) or replayer.switch(None):
                    self._uninstall()  # materializing reads and writes the sources
                    replayer.materialize(goes_on=False)
                    return replayer.trace, None
                self.interrupt(f"{len(replayer.trace.entries) - replayer.next} fewer dispatches")
            trace, why = self.recorder.end()
            whole = self.replayed_whole
            if trace is not None and whole is not None and len(trace.entries) == len(whole.entries):
                # Every call was replayed, and what came after was no call (a host read's op
                # running the recording): the replay was the recording.
                self.replayed = True
                return whole, None
            return trace, self.diverged if trace is not None else why
        finally:
            self._uninstall()

    def _uninstall(self) -> None:
        deferred.write_hook[0] = None
        deferred.interrupt[0] = None


_DIVERGED = object()


class _Recorder:
    """Records as usual and traces each call (`_Entry`)."""

    def __init__(self):
        self.entries: list[_Entry] = []
        # id(source) -> (weakref to it, (entry, k)) for live tensors the recording's calls
        # returned: one of them met as an argument is that result, not outside state.
        self.results: dict[int, tuple[weakref.ref, tuple[int, int]]] = {}
        # id(array) -> (the array, its source): outside sources' values when first met (the
        # recording takes them in as arrays).
        self.first_values: dict[int, tuple[jax.Array, Any]] = {}
        self.seen: set[int] = set()
        self.depth = 0
        self.nested = False
        self.writes: list | None = None
        self.host_before: dict[int, np.ndarray] = {}
        self.untraceable: str | None = None
        self.recording = None

    def begin(self, entries=(), results=None, first_values=None) -> None:
        self.entries = list(entries)
        self.results = dict(results or {})
        self.first_values = dict(first_values or {})
        self.seen = {id(v[1]) for v in self.first_values.values()}
        self.recording = deferred.current_recording()

    def fail(self, why: str) -> None:
        if self.untraceable is None:
            self.untraceable = why

    def dispatch(self, func, args: tuple, kwargs: dict):
        if self.depth or self.untraceable is not None:
            self.nested = True
            return run_op(func, args, kwargs)
        recording = deferred.current_recording()
        if recording is not self.recording:
            self.fail("its recording ran before its calls ended")
            return run_op(func, args, kwargs)
        ops_before, scalars_before = len(recording.ops), len(recording.scalars)
        if ops_before != (self.entries[-1].ops if self.entries else 0):
            self.fail("it records ops outside torch's dispatch")
        leaves, spec, spec_key = live_tensor.flatten_arguments(args, kwargs)
        # Host tensors' values before the call: a replay does not run it, so a call that
        # changes them is not traced.
        self.host_before = {}
        for x in leaves:
            if type(x) is LiveTensor:
                self._note_source(x._source)
            elif type(x) is torch.Tensor:
                self.host_before[id(x)] = host_array(x)
        derivation = _derivations.get(func)
        derived = None if derivation is None else derivation(args, kwargs)
        self.depth, self.nested, self.writes = 1, False, []
        try:
            result = run_op(func, args, kwargs)
        finally:
            self.depth = 0
        if self.untraceable is None:
            try:
                structure = spec if spec_key is None else spec_key
                self._trace_entry(
                    func, args, leaves, structure, result, recording, ops_before, scalars_before,
                    derived,
                )  # fmt: skip
            except _NotTraceable as why:
                self.fail(str(why))
        self.writes = None
        return result

    def _note_source(self, source) -> None:
        """Remember an outside source's value before the recording changes it (the array a
        recording takes in for it)."""
        if id(source) in self.seen:
            return
        known = self.results.get(id(source))
        if known is not None and known[0]() is source:
            return
        self.seen.add(id(source))
        if type(source) not in (Owned, EngineEntry):
            self.fail(f"it reads a live tensor over a {type(source).__name__}")
            return
        value = source.value()
        if type(value) is Deferred:
            value = value.computed
        if value is not None:
            self.first_values.setdefault(id(value), (value, source))

    def on_write(self, source, value) -> None:
        if self.writes is None:
            self.fail("it writes a live tensor outside torch's dispatch")
            return
        self.writes.append((source, value))

    def _leaf(self, x, traced: set, scalar_slots: dict, host_slots: list, scalars: list):
        if isinstance(x, torch.Tensor):
            if type(x) is not LiveTensor:
                return self._host_leaf(x, host_slots, scalars)
            return self._tensor_leaf(x._source)
        if type(x) is float and not self.nested:
            slot = scalar_slots.get(id(x))
            if slot in traced:
                return (_SLOT, slot)
        if not isinstance(x, _CONSTANTS):
            raise _NotTraceable(f"it passes a {type(x).__name__} to an op")
        return (_CONST, type(x), x)

    def _host_leaf(self, x: torch.Tensor, host_slots: list, scalars: list):
        """A host tensor passed to an op: the op took its values in as its next scalar input
        that is no float (`live_tensor._input_of`, one copy per tensor, in argument order)."""
        if type(x) is not torch.Tensor or x.device.type != "cpu" or self.nested or not host_slots:
            raise _NotTraceable(f"it passes a host tensor ({type(x).__name__}) to an op")
        slot = host_slots.pop(0)
        copy, before = scalars[slot], self._unchanged(x)
        if not (np.array_equal(copy, before) and copy.dtype == before.dtype):
            raise _NotTraceable("an op takes values computed from a host tensor")
        return (_HOST, slot, copy.shape, x.dtype)

    def _unchanged(self, x: torch.Tensor) -> np.ndarray:
        """Host tensor `x`'s values before the call, which must have left them as they were
        (a replay does not run it)."""
        before, after = self.host_before[id(x)], host_array(x)
        if not (np.array_equal(before, after) and before.dtype == after.dtype):  # shapes too
            raise _NotTraceable("an op changes a host tensor")
        return before

    def _free_leaf(self, x):
        """A float or host tensor of a call whose scalar inputs are derived: any value of its
        kind (a host tensor of its shape and dtype, which the call must leave as it was)."""
        if type(x) is float:
            return (_FREE, float)
        if type(x) is torch.Tensor and x.device.type == "cpu":
            self._unchanged(x)
            return (_FREE, torch.Tensor, tuple(x.shape), x.dtype)
        if isinstance(x, torch.Tensor):
            raise _NotTraceable(f"it passes a host tensor ({type(x).__name__}) to an op")
        if not isinstance(x, _CONSTANTS):
            raise _NotTraceable(f"it passes a {type(x).__name__} to an op")
        return (_CONST, type(x), x)

    def _tensor_leaf(self, source):
        known = self.results.get(id(source))
        if known is not None and known[0]() is source:
            return (_RESULT, known[1])
        if type(source) not in (Owned, EngineEntry):
            raise _NotTraceable(f"it uses a live tensor over a {type(source).__name__}")
        # Held weakly: a trace must not keep a value alive (a model's output it began with).
        return (_SOURCE, weakref.ref(source))

    def _trace_entry(
        self, func, args, leaves, spec, result, recording, ops_before, scalars_before, derived
    ) -> None:
        ops, scalars = recording.ops, recording.scalars
        traced = {ref[1] for op in ops[ops_before:] for ref in op.refs if ref[0] == "scalar"}
        if derived is not None:
            key, values = derived
            made = scalars[scalars_before:]
            if traced != set(range(scalars_before, len(scalars))) or not (
                len(made) == len(values) and all(map(_same_value, made, values))
            ):
                raise _NotTraceable(f"its ops take scalars other than {func}'s derived ones")
            entry = _Entry()
            entry.func, entry.spec = func, spec
            entry.leaves = tuple(
                self._tensor_leaf(x._source) if type(x) is LiveTensor else self._free_leaf(x)
                for x in leaves
            )
            entry.derived = (key, scalars_before, len(values))
            self._finish_entry(entry, result, args, leaves, recording)
            return
        host_slots = [
            slot
            for slot in range(scalars_before, len(scalars))
            if type(scalars[slot]) is np.ndarray and slot in traced
        ]
        entry = _Entry()
        entry.func, entry.spec, entry.derived = func, spec, None
        entry.leaves = tuple(
            self._leaf(x, traced, recording.scalar_slots, host_slots, scalars) for x in leaves
        )
        if host_slots:
            raise _NotTraceable("an op takes values no argument of its call holds")
        if traced - {leaf[1] for leaf in entry.leaves if leaf[0] is _SLOT or leaf[0] is _HOST}:
            # The ops take values the call computed from its arguments (a fused optimizer
            # step's `1 - beta`, `lr * weight_decay`): a replay could not compute them anew,
            # so the arguments they come from are constants of the trace.
            if any(leaf[0] is _HOST for leaf in entry.leaves):
                raise _NotTraceable("an op takes values computed from a host tensor")
            entry.leaves = tuple(
                (_CONST, float, scalars[leaf[1]]) if leaf[0] is _SLOT else leaf
                for leaf in entry.leaves
            )
        self._finish_entry(entry, result, args, leaves, recording)

    def _finish_entry(self, entry: _Entry, result, args, leaves, recording) -> None:
        entry.returns = self._returns(result, args, leaves, len(self.entries))
        entry.writes = [
            (self._tensor_leaf(source), *_pending(value, "writes")) for source, value in self.writes
        ]
        if recording.rngs:
            raise _NotTraceable("it draws random numbers")
        entry.groups = _argument_groups(entry)
        entry.ops, entry.arrays = len(recording.ops), len(recording.arrays)
        entry.scalars = len(recording.scalars)
        self.entries.append(entry)

    def _returns(self, result, args: tuple, leaves: list, index: int):
        if result is None:
            return _NONE
        first = args[0] if args else None
        if result is first:
            return _FIRST
        returned = result if type(result) in (list, tuple) else (result,)
        if any(r is leaf for r in returned for leaf in leaves):
            # An `out=` tensor given back: a replay's new tensor would not be that object.
            raise _NotTraceable("an op returns one of its other arguments")
        if type(result) is LiveTensor:
            if type(first) is LiveTensor and result._source is first._source:
                return _ALIAS
            return (None, [self._new_result(result, index, 0)])
        if type(result) in (list, tuple) and all(type(t) is LiveTensor for t in result):
            return (type(result), [self._new_result(t, index, k) for k, t in enumerate(result)])
        raise _NotTraceable(f"an op returns {type(result).__name__}")

    def _new_result(self, tensor: LiveTensor, index: int, k: int):
        source = tensor._source
        if type(source) is not Owned:
            raise _NotTraceable(f"an op returns a live tensor over a {type(source).__name__}")
        self.results[id(source)] = (weakref.ref(source), (index, k))
        return (*_pending(source.array, "returns"), tensor.dtype)

    def end(self) -> tuple[_Trace | None, str | None]:
        """The trace of the recording about to run (None, and why, where it cannot be
        replayed)."""
        recording = deferred.current_recording()
        # The values noted are the recording's inputs: held here, the program could not reuse
        # their buffers (`deferred._unheld`).
        first_values, self.first_values = self.first_values, {}
        if self.untraceable is None:
            if recording is not self.recording:
                self.fail("its recording ran before its calls ended")
            elif not self.entries or len(recording.ops) != self.entries[-1].ops:
                self.fail("it records ops outside torch's dispatch")
        if self.untraceable is not None:
            return None, self.untraceable
        sources = []
        for array in recording.arrays:
            known = first_values.get(id(array))
            if known is None or known[0] is not array:
                return None, "an op's input is no live tensor's value before the recording"
            sources.append(weakref.ref(known[1]))
        host = {leaf[1] for entry in self.entries for leaf in entry.leaves if leaf[0] is _HOST}
        for entry in self.entries:
            if entry.derived is not None:
                host.update(range(entry.derived[1], entry.derived[1] + entry.derived[2]))
        if any(type(s) is not float and i not in host for i, s in enumerate(recording.scalars)):
            return None, "an op takes a host tensor's values outside its call's arguments"
        trace = _Trace()
        # A copy: where the recording runs inside a call (an op run on the host reads its
        # inputs), that call's entry comes after this, and is not the trace's.
        entries = _pin_shared_slots(list(self.entries), recording)
        trace.entries, trace.array_sources = entries, sources
        trace.ops, trace.scalars = list(recording.ops), list(recording.scalars)
        trace.generation = deferred.signature_generation()
        return trace, None


def _argument_groups(entry: _Entry) -> list | None:
    """Per argument (positional, then keyword) of a dispatch whose arguments are leaves or
    flat lists of them (`flatten_arguments`' `spec_key`), how a replay checks it:
    `(_LEAF, leaf)`; for a list, `(kind, type, length, what)`: `_SOURCES` with the sources of
    its live tensors (outside the recording), `_RESULTS` with the entry that returned it whole, or
    `_LEAVES` with its leaves. None for other arguments (checked leaf by leaf)."""
    if not isinstance(entry.spec, tuple):
        return None
    count = entry.spec[0] + len(entry.spec[1])
    structure = entry.spec[2] if len(entry.spec) > 2 else (None,) * count
    groups, leaves = [], iter(entry.leaves)
    for shape in structure:
        if shape is None:
            groups.append((_LEAF, next(leaves)))
            continue
        kind, length = shape
        items = [next(leaves) for _ in range(length)]
        if items and all(leaf[0] is _SOURCE for leaf in items):
            groups.append((_SOURCES, kind, length, [leaf[1] for leaf in items]))
        elif length > 1 and all(
            leaf[0] is _RESULT and leaf[1] == (items[0][1][0], k) for k, leaf in enumerate(items)
        ):  # (one item could be a call's single tensor, not a list it returned: a leaf)
            groups.append((_RESULTS, kind, length, items[0][1][0]))
        else:
            groups.append((_LEAVES, kind, length, items))
    return groups


def _pin_shared_slots(entries: list[_Entry], recording) -> list[_Entry]:
    """`entries` with a float kept constant where its scalar input is also taken by ops of
    a dispatch that does not pass it as a traced leaf (a decomposition's, which may have
    branched on it): a new value there would not reach what that dispatch computed."""
    pinned, start = set(), 0
    for entry in entries:
        taken = {
            ref[1]
            for op in recording.ops[start : entry.ops]
            for ref in op.refs
            if ref[0] == "scalar"
        }
        own = {leaf[1] for leaf in entry.leaves if leaf[0] is _SLOT or leaf[0] is _HOST}
        if entry.derived is not None:
            own.update(range(entry.derived[1], entry.derived[1] + entry.derived[2]))
        pinned |= taken - own
        start = entry.ops
    if not pinned:
        return entries
    values = recording.scalars
    for entry in entries:
        entry.leaves = tuple(
            (_CONST, float, values[leaf[1]]) if leaf[0] is _SLOT and leaf[1] in pinned else leaf
            for leaf in entry.leaves
        )
        entry.groups = _argument_groups(entry)
    return entries


def _same_value(a, b) -> bool:
    """Whether scalar inputs `a` and `b` are the same value: a float or a numpy array, bit
    for bit (a -0.0 is no 0.0)."""
    if type(a) is not type(b):
        return False
    if type(a) is np.ndarray:
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return np.float64(a).tobytes() == np.float64(b).tobytes() if type(a) is float else a == b


def _pending(value, what: str) -> tuple:
    """(position, shape, JAX dtype) of a value the recording will compute."""
    if type(value) is not Deferred or value.computed is not None or value._error is not None:
        raise _NotTraceable(f"it {what} a value it did not record")
    return value._position, value.shape, value.dtype


class _Replayer:
    """Answers a recording's calls from its trace, then rebuilds the recording they stand
    for."""

    def __init__(self, traces: list[_Trace]):
        self.traces = traces
        self.trace = traces[0]
        self.next = 0
        self.scalars = list(self.trace.scalars)
        self.assigned = [False] * len(self.scalars)
        # (entry, k) -> weakref to the source of a live tensor the replay returned.
        self.results: dict[tuple[int, int], weakref.ref] = {}
        # position -> weakref to the Deferred standing for it.
        self.made: dict[tuple, weakref.ref] = {}
        # The sources the replayed calls took in (the trace holds them weakly): the recording
        # reads their values when it is rebuilt.
        self.held: list = []
        # entry -> weakrefs to the sources of the list of live tensors it returned.
        self.result_lists: dict[int, list[weakref.ref]] = {}
        self.diverged = ""

    def dispatch(self, func, args: tuple, kwargs: dict):
        entries = self.trace.entries
        index = self.next
        if index >= len(entries):
            self.diverged = f"a dispatch beyond the {len(entries)} traced ({func})"
            return _DIVERGED
        entry = entries[index]
        if func is not entry.func:
            self.diverged = f"dispatch {index} is {func}, traced {entry.func}"
            return _DIVERGED
        if not self._arguments_match(entry, args, kwargs):
            self.diverged = f"dispatch {index} ({func}): its arguments differ from the trace"
            return _DIVERGED
        if entry.derived is not None:
            key, start, count = entry.derived
            derived = _derivations[func](args, kwargs)
            if derived is None or derived[0] != key or len(derived[1]) != count:
                self.diverged = f"dispatch {index} ({func}): its derived scalars differ"
                return _DIVERGED
            self.scalars[start : start + count] = derived[1]
            self.assigned[start : start + count] = [True] * count
        self.next = index + 1
        returns = entry.returns
        if returns is _NONE:
            return None
        if returns is _FIRST:
            return args[0]
        if returns is _ALIAS:
            return args[0].aliased()
        container, items = returns
        made = [self._result(index, k, *item) for k, item in enumerate(items)]
        if container is None:
            return made[0]
        self.result_lists[index] = [weakref.ref(t._source) for t in made]
        return container(made)

    def switch(self, func) -> bool:
        """Go on with another trace of this key that shares the calls replayed so far and
        has `func` as its next call (None: ends there); False where none does."""
        done, current = self.next, self.trace
        for trace in self.traces:
            entries = trace.entries
            if (
                trace is current
                or trace.generation != current.generation
                or (
                    done
                    and (len(entries) < done or entries[done - 1] is not current.entries[done - 1])
                )
                or (
                    len(entries) != done
                    if func is None
                    else len(entries) <= done or entries[done].func is not func
                )
            ):
                continue
            # The same calls so far are the same ops, inputs and scalar slots: what was
            # collected carries over.
            shared = entries[done - 1].scalars if done else 0
            scalars = list(trace.scalars)
            scalars[:shared] = self.scalars[:shared]
            assigned = [False] * len(scalars)
            assigned[:shared] = self.assigned[:shared]
            self.trace, self.scalars, self.assigned = trace, scalars, assigned
            return True
        return False

    def _arguments_match(self, entry: _Entry, args: tuple, kwargs: dict) -> bool:
        groups = entry.groups
        if groups is None:  # containers in containers: compared leaf by leaf
            leaves, spec, _ = live_tensor.flatten_arguments(args, kwargs)
            return (
                spec == entry.spec
                and len(leaves) == len(entry.leaves)
                and all(map(self._leaf_matches, leaves, entry.leaves))
            )
        if len(args) != entry.spec[0] or (tuple(kwargs) if kwargs else ()) != entry.spec[1]:
            return False
        for argument, group in zip((*args, *kwargs.values()), groups, strict=True):
            kind = group[0]
            if kind is _LEAF:
                if not self._leaf_matches(argument, group[1]):
                    return False
                continue
            if type(argument) is not group[1] or len(argument) != group[2]:
                return False
            if kind is _SOURCES or kind is _RESULTS:
                if kind is _SOURCES:
                    expected = [ref() for ref in group[3]]
                    self.held.append(expected)  # their values are read when it runs
                else:
                    refs = self.result_lists.get(group[3])
                    if refs is None:
                        return False
                    expected = [ref() for ref in refs]
                try:  # a list of the same live tensors' sources, compared by identity
                    if [x._source for x in argument] != expected:
                        return False
                except AttributeError:  # not a live tensor
                    return False
            elif not all(map(self._leaf_matches, argument, group[3])):
                return False
        return True

    def _leaf_matches(self, x, want) -> bool:
        kind = want[0]
        if kind is _SOURCE:
            if type(x) is LiveTensor and x._source is want[1]():
                self.held.append(x._source)  # its value is read when it runs
                return True
            return False
        if kind is _SLOT:
            if type(x) is not float:
                return False
            slot, scalars = want[1], self.scalars
            if not self.assigned[slot]:
                scalars[slot] = x
                self.assigned[slot] = True
                return True
            # The same object, as when traced (one program input for both): an equal value
            # could still differ in sign (0.0, -0.0).
            return x is scalars[slot]
        if kind is _RESULT:
            source = self.results.get(want[1])
            return type(x) is LiveTensor and source is not None and x._source is source()
        if kind is _HOST:
            if type(x) is not torch.Tensor or x.device.type != "cpu" or x.dtype != want[3]:
                return False
            if tuple(x.shape) != want[2]:
                return False
            # Copied now, as the recording copies it at the call: torch changes such tensors
            # in place afterwards (ASGD's `eta`).
            self.scalars[want[1]] = host_array(x)
            self.assigned[want[1]] = True
            return True
        if kind is _FREE:
            if want[1] is float:
                return type(x) is float
            return (
                type(x) is torch.Tensor
                and x.device.type == "cpu"
                and x.dtype == want[3]
                and tuple(x.shape) == want[2]
            )
        return type(x) is want[1] and (x is want[2] or x == want[2])

    def _result(self, index: int, k: int, position, shape, dtype, torch_dtype) -> LiveTensor:
        value = self._deferred(position, shape, dtype)
        tensor = LiveTensor.owning(value, torch_dtype)
        self.results[(index, k)] = weakref.ref(tensor._source)
        return tensor

    def _deferred(self, position, shape, dtype) -> Deferred:
        known = self.made.get(position)
        value = None if known is None else known()
        if value is None:
            value = Deferred(shape, dtype, position)
            self.made[position] = weakref.ref(value)
        return value

    def materialize(self, goes_on: bool = True) -> _Recorder | None:
        """Make the recording the replayed dispatches stand for the current one; with
        `goes_on`, return a recorder that goes on from there (a call differed)."""
        trace, done = self.trace, self.next
        entries = trace.entries
        last = entries[done - 1] if done else None
        recording = deferred.current_recording()
        # The replay began with nothing recorded, and nothing was recorded since (the hooks).
        assert not recording.ops and not recording.writes, "a replay met a recording"
        sources = [ref() for ref in trace.array_sources[: last.arrays if last else 0]]
        # The values before the recording (nothing is written yet), as it took them in.
        values = [deferred.resolve(source.value()) for source in sources]
        recording.take_arrays(values, final=not goes_on)
        recording.take_scalars(self.scalars[: last.scalars if last else 0], final=not goes_on)
        ops = trace.ops[: last.ops if last else 0]
        for entry in entries[:done]:
            for target, position, shape, dtype in entry.writes:
                source = target[1]() if target[0] is _SOURCE else self._result_source(target[1])
                if source is not None:  # else a result nothing holds any more
                    source.write(self._deferred(position, shape, dtype))
        outputs: list[list] = [[] for _ in ops]
        for (_, index, k), known in self.made.items():
            slots = outputs[index]
            if len(slots) <= k:
                slots.extend([None] * (k + 1 - len(slots)))
            slots[k] = known
        recording.take_ops(ops, outputs)
        if not goes_on:
            return None
        recorder = _Recorder()
        results = {}
        for where, known in self.results.items():
            source = known()
            if source is not None:
                results[id(source)] = (known, where)
        first_values = {
            id(value): (value, source) for value, source in zip(values, sources, strict=True)
        }
        recorder.begin(entries[:done], results, first_values)
        return recorder

    def _result_source(self, where: tuple[int, int]):
        known = self.results.get(where)
        return None if known is None else known()
