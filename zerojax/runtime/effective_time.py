"""Effective training time: where a run's wall-clock time went.

Meta's Effective Training Time accounting counts everything that is not a productive training
step as lost: initialisation, tracing and compiling, blocking on checkpoint saves, restoring.
zerojax records each of these as it happens, in one ledger per process:

    init                 zerojax.initialize (placing the sharded state)
    trace_compile        torch.export capture + JAX tracing, lowering and XLA compilation
                         (or loading from the persistent compilation cache), from JAX's own
                         monitoring events
    checkpoint_blocking  the part of a checkpoint save the training loop waits for
    checkpoint_restore   restoring a checkpoint
    productive           the rest of the time between `initialize` and the last optimizer step

At exit the summary is printed to stderr (`runtime.report_effective_time`) and, with
`runtime.effective_time_log`, every event and the summary are appended to a JSON-lines file.
Only a config that asks for either registers the exit hook. JAX's compile events are listened
to while an engine is alive (`attach`): the listener is removed when the last one is collected.

In Google's ML goodput terms every lost category here costs *runtime goodput*, and a job's
restarts add *scheduling* badput between attempts (`GOODPUT`); the report ends with both.

The ledger is one per process on purpose: it accounts for the process's wall clock, which
engines and checkpointers share. It lives here, below `train` and `ckpt`, which both report
to it.

A job is more than one process: under torchrun every rank has a ledger, and a restarted job
starts new ones. With several processes the log file is one per rank (`ett.jsonl` ->
`ett.rank0.jsonl`, ...), and each process appends to it: a `process_start` record (rank,
launcher attempt, when the OS started the process) and one `step` record per optimizer update
(the update's number, restored with a checkpoint), so a process killed without its summary
still leaves its timeline. `zerojax ett LOG` reads the files of every rank and attempt and
accounts for the whole job (zerojax/runtime/job_time.py): steps redone after a restart, the
time between attempts, restore and recompile.

>>> with zerojax.runtime.effective_time.LEDGER.measure("checkpoint_restore"):
...     checkpointer.restore()
>>> zerojax.effective_time()["productive_fraction"]
0.93
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
import weakref
from pathlib import Path

import jax

CATEGORIES = ("init", "trace_compile", "checkpoint_blocking", "checkpoint_restore", "productive")
_LOST = CATEGORIES[:-1]

GOODPUT = {
    "between_attempts": "scheduling",
    "startup": "runtime",
    "init": "runtime",
    "trace_compile": "runtime",
    "checkpoint_blocking": "runtime",
    "checkpoint_restore": "runtime",
    "redone_steps": "runtime",
    "after_last_step": "runtime",
}
"""Which of Google's ML goodput terms each lost-time category (this ledger's and the job's,
`zerojax.runtime.job_time`) takes away from. *Scheduling goodput*: the share of the job's
time in which it holds every resource it needs -- lost between a failure and the relaunched
processes' start (`between_attempts`). *Runtime goodput*: the share of that time spent on
training progress that is kept -- lost to startup, init, compiles, checkpoint blocking and
restores, and steps redone after a restart. *Program goodput*: how much of the hardware's
peak the steps reach (MFU); a ledger of wall-clock time cannot measure it, so it is reported
as not measured. ETT (productive / wall) = scheduling goodput x runtime goodput."""


def goodput(summary: dict) -> dict[str, float | None]:
    """{"scheduling": f, "runtime": f, "program": None} of a summary (this ledger's or a job's:
    seconds per category, "productive" and "wall"); see `GOODPUT`."""
    wall = summary.get("wall") or 0.0
    unscheduled = sum(v for k, v in summary.items() if GOODPUT.get(k) == "scheduling")
    held = wall - unscheduled
    return {
        "scheduling": held / wall if wall > 0 else 0.0,
        "runtime": summary.get("productive", 0.0) / held if held > 0 else 0.0,
        "program": None,
    }


def goodput_line(summary: dict) -> str:
    """The goodput terms of `summary` as one report line."""
    terms = goodput(summary)
    scheduling, runtime = terms["scheduling"] or 0.0, terms["runtime"] or 0.0
    return (
        f"  goodput: scheduling {100 * scheduling:.1f} %, runtime {100 * runtime:.1f} %, "
        f"program (MFU) not measured"
    )


# JAX's durations for tracing to a jaxpr, lowering it and compiling it (a persistent-cache hit
# skips the backend compile but still traces and lowers).
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class EffectiveTimeLedger:
    """Seconds per category since the first `initialize` of this process."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.seconds = dict.fromkeys(_LOST, 0.0)
        self.optimizer_steps = 0
        self.last_step_end: float | None = None
        self.lost_before_last_step = 0.0
        self.log_path: Path | None = None
        self.report_at_exit = False
        self._lock = threading.Lock()
        self._depth = 0  # >0 while a measure() block runs: compile events inside belong to it
        # The training loop's thread (the one that called begin): compiles on other threads (a
        # checkpoint's background snapshot program) do not hold the loop up.
        self._loop_thread: int | None = None
        self._num_engines = 0  # alive engines: JAX's compile events are listened to while > 0
        self._exit_hook = False

    def begin(
        self,
        *,
        log_path: str | None,
        report_at_exit: bool,
        rank: int = 0,
        world_size: int = 1,
        attempt: int = 0,
    ) -> None:
        """Start the clock (first call only); register the exit report only if it is asked
        for (a report, or a log file to append the summary to). `rank`/`world_size`: this
        process in its job (a log file per rank when several); `attempt`: the launcher's
        restart count (torchrun's TORCHELASTIC_RESTART_COUNT)."""
        if self.start is None:
            self.start = time.perf_counter()
            self._loop_thread = threading.get_ident()
        if log_path is not None and self.log_path is None:
            self.log_path = rank_log_path(log_path, rank, world_size)
            self._log(
                {
                    "event": "process_start",
                    "rank": rank,
                    "world_size": world_size,
                    "attempt": attempt,
                    "pid": os.getpid(),
                    "process_started": _process_start_time(),
                    # The ledger's start on the wall clock (an earlier initialize without a
                    # log may have started it before this record).
                    "clock_start": round(time.time() - (time.perf_counter() - self.start), 3),
                }
            )
        self.report_at_exit = self.report_at_exit or report_at_exit
        if (self.report_at_exit or self.log_path is not None) and not self._exit_hook:
            atexit.register(self._at_exit)
            self._exit_hook = True

    def attach(self, engine: object) -> None:
        """Count JAX's compile time while `engine` is alive (listener removed after the last)."""
        with self._lock:
            if self._num_engines == 0:
                jax.monitoring.register_event_duration_secs_listener(self._on_jax_event)
            self._num_engines += 1
        weakref.finalize(engine, self._detach)

    def _detach(self) -> None:
        with self._lock:
            self._num_engines -= 1
            if self._num_engines == 0:
                jax.monitoring.unregister_event_duration_listener(self._on_jax_event)

    def _on_jax_event(self, event: str, duration_secs: float, **_: str | int) -> None:
        if threading.get_ident() != self._loop_thread:
            return
        if event in _COMPILE_EVENTS and self._depth == 0 and self.start is not None:
            self.add("trace_compile", duration_secs, source=event.rsplit("/", 1)[-1])

    def add(self, category: str, seconds: float, **fields) -> None:
        assert category in _LOST, category
        with self._lock:
            self.seconds[category] += seconds
        self._log({"event": category, "seconds": round(seconds, 6), **fields})

    @contextlib.contextmanager
    def measure(self, category: str, **fields):
        """Time a block as `category`; JAX compiles inside it are not counted twice."""
        begin = time.perf_counter()
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
            self.add(category, time.perf_counter() - begin, **fields)

    def step_done(self, step: int) -> None:
        """Called after each optimizer update, `step` its number (counting restored ones):
        productive time runs up to the last one."""
        self.optimizer_steps += 1
        self.last_step_end = time.perf_counter()
        with self._lock:
            self.lost_before_last_step = sum(self.seconds.values())
        self._log({"event": "step", "step": step})

    def summary(self) -> dict:
        """{"wall": s, "<category>": s, ..., "productive_fraction": f, "optimizer_steps": n}."""
        now = time.perf_counter()
        start = self.start if self.start is not None else now
        wall = now - start
        # Productive time ends at the last optimizer step; what follows (a final save,
        # evaluation, shutdown) and what was lost before it are not training.
        until_last_step = (self.last_step_end or start) - start
        productive = max(until_last_step - self.lost_before_last_step, 0.0)
        result = {"wall": round(wall, 3)}
        result.update({k: round(v, 3) for k, v in self.seconds.items()})
        result["productive"] = round(productive, 3)
        result["productive_fraction"] = round(productive / wall, 4) if wall > 0 else 0.0
        result["optimizer_steps"] = self.optimizer_steps
        return result

    def report(self) -> str:
        summary = self.summary()
        wall = summary["wall"] or 1.0
        lines = [f"zerojax effective training time ({summary['optimizer_steps']} optimizer steps)"]
        for name in CATEGORIES:
            seconds = summary[name]
            lines.append(f"  {name:<20} {seconds:9.2f} s  {100 * seconds / wall:5.1f} %")
        lines.append(f"  {'wall':<20} {summary['wall']:9.2f} s")
        lines.append(goodput_line(summary))
        return "\n".join(lines)

    def _log(self, record: dict) -> None:
        if self.log_path is None:
            return
        record = {"time": round(time.time(), 3), **record}
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self._lock, self.log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:  # a metrics file must never stop training
            print(f"zerojax: cannot write {self.log_path}: {exc}", file=sys.stderr)
            self.log_path = None

    def _at_exit(self) -> None:
        if self.start is None:
            return
        self._log({"event": "summary", **self.summary()})
        if self.report_at_exit:
            print(self.report(), file=sys.stderr)


def rank_log_path(log_path: str, rank: int, world_size: int) -> Path:
    """The log file of `rank`: `log_path` itself for one process, else `.rank<R>` before its
    suffix (`run/ett.jsonl` -> `run/ett.rank1.jsonl`): one writer per file on any filesystem."""
    path = Path(os.path.expanduser(log_path))
    if world_size <= 1:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _process_start_time() -> float | None:
    """When the OS started this process (Unix time), from Linux's /proc; None elsewhere. The
    job's accounting starts there: interpreter start, imports and joining the job come before
    `initialize` and are paid again on every restart."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); the command name (field 2) may hold
            # spaces, so count from the closing parenthesis.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        # Seconds since boot now, to the nanosecond: /proc/stat's btime is whole seconds, which
        # put process starts up to 1 s early (a restart then seemed to begin before the
        # previous attempt ended).
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return round(time.time() - age, 3)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


LEDGER = EffectiveTimeLedger()


def effective_time() -> dict:
    """This process's effective-training-time summary so far (see the module docstring)."""
    return LEDGER.summary()
