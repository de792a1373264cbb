"""Background checkpoint work yields the CPUs to training.

An asynchronous save returns at once, and its write then shares the host's cores with the
training steps that follow: the snapshot's host copies, TensorStore's chunk copies and file
writes, the manifest's crc32 pass. On the 2-core bench host the step right after `save()` took
1.5 s longer than a step alone while the write was in flight (issue 44). None of that work is
urgent -- the next save is many steps away -- so its threads run at a lower scheduling
priority (a higher nice value, Linux's per-thread `setpriority`): the kernel gives the
training threads the cores first and the write the time they leave. An idle host (the
interpreter's exit waiting for the last save, a save between epochs) runs it as fast as ever.

Which threads: the Checkpointer's own save thread, at its start; every thread it starts
inherits its nice value (Orbax's commit thread, the manifest's hashing threads); and
TensorStore's worker pool (`ts_pool_worker`), which does the chunk copies and writes but is
started by whichever thread first used TensorStore, so it is lowered by name before each
save, and again as new ones appear while it runs (`tensorstore_threads_lowered`). The pool
grows as work comes in, its new workers started at the priority of whatever thread started
its overseer; workers idle for 20 s exit. So after a read through TensorStore on a thread
at normal priority (an Orbax restore), a save can find workers at nice 0 appearing midway
(seen: 4 of 8 after the save, when lowered only before it). Raising a nice value needs no
privilege; lowering it back would, so TensorStore's pool stays lowered for the process
(restores read arrays on their own threads: `direct_read`).
Elsewhere than Linux nothing changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

__all__ = [
    "BACKGROUND_NICE",
    "lower_tensorstore_threads",
    "lower_this_thread",
    "tensorstore_threads_lowered",
]

log = logging.getLogger("zerojax")

BACKGROUND_NICE = 10
"""Nice value of background checkpoint threads: CFS weight 110 against a training thread's
1024 (at nice 0), so under full load the write gets ~10% of a core and still progresses."""

_TENSORSTORE_THREAD = "ts_pool_worker"


def _lower(tid: int) -> None:
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
    except (OSError, AttributeError) as error:  # not Linux, or the thread is gone
        log.debug("zerojax: could not lower the priority of thread %d: %s", tid, error)


def lower_this_thread() -> None:
    """Give the calling thread (and the threads it starts from now on) background priority."""
    if hasattr(threading, "get_native_id") and os.path.isdir("/proc/self/task"):
        _lower(threading.get_native_id())


def lower_tensorstore_threads() -> None:
    """Give TensorStore's worker threads background priority (found by name in /proc)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _TENSORSTORE_THREAD:
                    continue
        except OSError:
            continue
        _lower(int(tid))


_WATCH_S = 0.05
"""How often `tensorstore_threads_lowered` looks for new TensorStore workers (a /proc scan of
the process's threads: 0.4 ms for 29 threads here)."""


@contextlib.contextmanager
def tensorstore_threads_lowered():
    """TensorStore's workers at background priority for the duration, new ones within
    `_WATCH_S` of their start, and every one on exit."""
    lower_tensorstore_threads()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_WATCH_S):
            lower_tensorstore_threads()

    watcher = threading.Thread(target=watch, name="zerojax-lower-tensorstore", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        lower_tensorstore_threads()
