"""Orbax's noise about a failed save goes to the debug log; the user sees one error.

One full disk during a save made Orbax print hundreds of lines to stderr (thousands for a
large state): its ERROR records with tracebacks from each thread the exception passes
through, asyncio's "Task exception was never retrieved" for each abandoned write, and, from
the writes still in flight when Orbax closed its event loop, one "RuntimeError: Event loop is
closed" per write through `sys.unraisablehook` (some at interpreter shutdown, as
"ImportError: sys.meta_path is None"). zerojax reports the failure once, as the
CheckpointSaveError naming the step and the path (`zerojax.ckpt.checkpointer`); all of the
above goes to the `zerojax.orbax` logger at DEBUG instead:

- absl's logger (Orbax logs through it): records at ERROR or above whose source file is in
  Orbax's package. Orbax's warnings are left alone.
- asyncio's logger: records that name a coroutine of Orbax's package, or a write into Orbax's
  temporary directory (a TensorStore future's unretrieved exception).
- `sys.unraisablehook`: an exception whose traceback passes through Orbax's package, or the
  "Event loop is closed" of a callback reaching Orbax's closed loop (raised in asyncio
  itself). Anything else goes to the hook that was there before.

`install()` (idempotent) is called by the first Checkpointer.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

import orbax.checkpoint as ocp

__all__ = ["install"]

_ORBAX_DIR = os.path.dirname(os.path.abspath(ocp.__file__))
# What a write Orbax abandoned names when it fails: its temporary directory. A TensorStore
# future's "Future exception was never retrieved" carries no frame of Orbax's, only the path
# of the write (`.../2.orbax-checkpoint-tmp/optimizer.orbax-checkpoint-tmp/ocdbt...`).
_ORBAX_TMP = ".orbax-checkpoint-tmp"
_to = logging.getLogger("zerojax.orbax")


def _demote(record: logging.LogRecord) -> bool:
    """Hand `record` to `zerojax.orbax` at DEBUG; False: its original logger drops it."""
    if _to.isEnabledFor(logging.DEBUG):
        record.levelno, record.levelname, record.name = logging.DEBUG, "DEBUG", _to.name
        _to.handle(record)
    return False


class _OrbaxErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.pathname.startswith(_ORBAX_DIR):
            return _demote(record)
        return True


class _OrbaxTasks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format: not ours to judge
            return True
        if _ORBAX_DIR in message or _ORBAX_TMP in message:
            return _demote(record)
        return True


def _from_orbax(unraisable: Any) -> bool:
    error = unraisable.exc_value
    tb = unraisable.exc_traceback
    files = []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    if any(f.startswith(_ORBAX_DIR) for f in files):
        return True
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine closed unawaited
    if code is not None and code.co_filename.startswith(_ORBAX_DIR):
        return True
    # A tensorstore write finishing after Orbax closed the loop it was awaited on: the
    # traceback holds asyncio's frames only.
    return (
        isinstance(error, RuntimeError)
        and str(error) == "Event loop is closed"
        and bool(files)
        and all(os.path.basename(os.path.dirname(f)) == "asyncio" for f in files)
    )


def _unraisable_hook(previous):
    def hook(unraisable: Any) -> None:
        try:
            ours = _from_orbax(unraisable)
        except Exception:  # noqa: BLE001 - at interpreter shutdown anything may be gone
            ours = False
        if not ours:
            previous(unraisable)
            return
        try:
            _to.debug(
                "Orbax (unraisable, %s)",
                unraisable.err_msg or "exception ignored",
                exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback),
            )
        except Exception:  # noqa: BLE001 - logging torn down at shutdown: drop it
            pass

    return hook


@functools.cache
def install() -> None:
    """Route Orbax's failure noise to `zerojax.orbax` at DEBUG (see the module docstring)."""
    logging.getLogger("absl").addFilter(_OrbaxErrors())
    logging.getLogger("asyncio").addFilter(_OrbaxTasks())
    sys.unraisablehook = _unraisable_hook(sys.unraisablehook)
