"""What becomes of checkpoint saves when the script ends: none vanishes.

A script may end with an asynchronous save still being written, or with one that failed in the
background (disk full) and that no later `save`, `wait` or `close` reported. At exit, every
such save is finished (waited for) and reported: a failed one prints its `CheckpointSaveError`
(naming the step and the path) to stderr and the process exits with status 1, even when the
script ended with `sys.exit(0)`. A Checkpointer with such a save is held here
(`track`) until it is reported, so dropping the last reference to it loses nothing.

Where the waiting happens, and why there:

- Python >= 3.12 refuses to start a thread once its finalization begins, and both
  `threading`'s exit hooks and `atexit` run after that; Orbax starts threads all through a
  save. So the wait runs when the main thread's outermost frame returns or unwinds, the last
  moment before finalization: a `sys.monitoring` callback on PY_RETURN of that one code object
  (a local event: nothing else is monitored) and on PY_UNWIND (a global event, switched on at
  the first tracked save and left on: its callback returns at once for every other frame, ~30
  ns a frame an exception unwinds, where switching it off and on at each save would make every
  function re-instrument itself, ~0.3 ms and more a toggle, measured on 3.12). A
  failure found there ends the script with SystemExit(1) (unless it was already ending with a
  non-zero status or an exception, whose traceback stays the one shown).
- Before 3.12, and as the backstop (no free monitoring tool id, a script whose main thread
  ended while another thread saved), a `threading` exit hook waits. It runs before
  `concurrent.futures` shuts its executors down at exit (from then on Orbax could not schedule
  the work its save still needs), being registered the same way
  (`threading._register_atexit`, last registered first) after `concurrent.futures` was
  imported. Nothing can change the exit status from there; so when a save failed, a callback
  is registered that runs first in the `atexit` phase: it runs every other `atexit` callback
  (logging's flush, the user's), flushes stdout and stderr, and ends the process with
  `os._exit(1)`. Objects still alive are then not finalized (that step is skipped), which is
  why this is only the backstop.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import os
import sys
import threading
from typing import Any

from zerojax.ckpt.errors import CheckpointError

__all__ = ["track", "untrack"]

log = logging.getLogger("zerojax")

_tracked: dict[int, Any] = {}
"""id -> Checkpointer with a save in flight or failed and not yet reported (strong refs)."""
_lock = threading.RLock()
_finishing = False


def track(checkpointer: Any) -> None:
    """Hold `checkpointer` until its pending save is reported (`untrack`): it has one now."""
    with _lock:
        _tracked[id(checkpointer)] = checkpointer
        _monitor.arm()


def untrack(checkpointer: Any) -> None:
    """`checkpointer` has no pending save any more (reported, or closed)."""
    with _lock:
        _tracked.pop(id(checkpointer), None)


def _finish_all() -> list[CheckpointError]:
    """Close every tracked Checkpointer (waiting for its save); the failures, each reported
    on stderr once."""
    global _finishing
    failures: list[CheckpointError] = []
    with _lock:
        if _finishing:
            return failures
        _finishing = True
    try:
        while True:
            with _lock:
                if not _tracked:
                    break
                _, checkpointer = _tracked.popitem()
            try:
                checkpointer.close()
            except CheckpointError as error:
                failures.append(error)
            except Exception as error:  # noqa: BLE001 - close() wraps all; report anything
                failures.append(CheckpointError(f"closing {checkpointer!r} failed: {error}"))
    finally:
        with _lock:
            _finishing = False
            _monitor.disarm()
    for error in failures:
        log.debug("zerojax: checkpoint save failed at exit", exc_info=error)
        print(f"zerojax: error: {error}", file=sys.stderr, flush=True)
    if failures:
        print(
            f"zerojax: {len(failures)} checkpoint save{'s' * (len(failures) > 1)} failed; "
            "exiting with status 1",
            file=sys.stderr,
            flush=True,
        )
    return failures


# --------------------------------------------------------------------------- Python >= 3.12


class _Monitor:
    """sys.monitoring callbacks on the main thread's outermost frame (see the module
    docstring); inert before Python 3.12 or when no tool id is free."""

    _TOOL_IDS = (4, 3)  # the two ids sys.monitoring leaves unnamed

    def __init__(self) -> None:
        self.tool: int | None = None
        self.code: Any = None
        self.unwind_on = False

    def _start(self) -> bool:
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            return False
        if self.tool is None:
            frame = sys._current_frames().get(threading.main_thread().ident)
            if frame is None:
                return False
            while frame.f_back is not None:
                frame = frame.f_back
            for tool in self._TOOL_IDS:
                if monitoring.get_tool(tool) is None:
                    monitoring.use_tool_id(tool, "zerojax checkpoint exit")
                    break
            else:
                log.debug("zerojax: no free sys.monitoring tool id; saves finish at exit")
                self.tool = -1
                return False
            self.tool, self.code = tool, frame.f_code
            events = monitoring.events
            monitoring.register_callback(tool, events.PY_RETURN, self._on_return)
            monitoring.register_callback(tool, events.PY_UNWIND, self._on_unwind)
            monitoring.set_local_events(tool, self.code, events.PY_RETURN)
        return self.tool >= 0

    def arm(self) -> None:
        if not self.unwind_on and self._start():
            sys.monitoring.set_events(self.tool, sys.monitoring.events.PY_UNWIND)
            self.unwind_on = True

    def disarm(self) -> None:
        if self.unwind_on:
            sys.monitoring.set_events(self.tool, 0)
            self.unwind_on = False

    def _on_return(self, code, offset, value) -> Any:
        if code is not self.code:
            return None
        if _finish_all():
            raise SystemExit(1)
        return None

    def _on_unwind(self, code, offset, exception) -> None:
        if code is not self.code:
            return
        if _finish_all() and isinstance(exception, SystemExit) and exception.code in (None, 0):
            raise SystemExit(1)


_monitor = _Monitor()


# --------------------------------------------------------------------------- the backstop


def _finish_at_exit() -> None:
    failures = _finish_all()
    if failures:
        atexit.register(_exit_with_status_1)


def _exit_with_status_1() -> None:
    atexit.unregister(_exit_with_status_1)
    atexit._run_exitfuncs()  # every other callback, once (the list is then cleared)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
            pass
    os._exit(1)


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_finish_at_exit)
else:  # not CPython: the best available, after the executors' shutdown
    atexit.register(_finish_at_exit)
