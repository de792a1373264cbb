"""Background checkpoint writes yield to training: background priority
(zerojax/ckpt/priority.py) and no full garbage collection started by a save.

Run: `.venv/bin/python -m pytest -q tests/ckpt/test_priority.py -p no:cacheprovider`
Why: issue 44 -- the training step right after `save()` ran 1.5 s slower than a step alone on
the 2-core bench host while the write was in flight. The write's threads (the Checkpointer's
writer, TensorStore's pool) now run at nice `BACKGROUND_NICE`; the thread that enqueues the
snapshot (which the next update may wait for) and the training thread keep theirs. And
Python's cyclic GC is paused from a save's snapshot to its commit: a full collection of the
bench process (650k objects, 0.4-1.0 s holding the GIL) fell in one of three saves, started
by the growth of Orbax's objects alive until the commit (`checkpointer._save_gc_paused`).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest

from tests.ckpt.test_checkpointer import assert_state_equal, host, make, scramble
from zerojax.ckpt import commit, priority
from zerojax.ckpt.checkpointer import Checkpointer
from zerojax.ckpt.errors import CheckpointSaveError

pytestmark = [
    pytest.mark.multidevice,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux"),
]


def nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def tensorstore_threads() -> list[int]:
    found = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "ts_pool_worker":
                    found.append(int(tid))
        except OSError:
            continue
    return found


def test_the_background_write_runs_at_background_priority(tmp_path, monkeypatch):
    seen = {}
    write, snapshot_and_write = Checkpointer._background_write, Checkpointer._snapshot_and_write

    def recording_write(self, *args):
        seen["write"] = nice(threading.get_native_id())
        write(self, *args)
        seen["tensorstore"] = [nice(t) for t in tensorstore_threads()]

    def recording_snapshot_and_write(self, *args):
        seen["snapshot"] = nice(threading.get_native_id())
        snapshot_and_write(self, *args)

    monkeypatch.setattr(Checkpointer, "_background_write", recording_write)
    monkeypatch.setattr(Checkpointer, "_snapshot_and_write", recording_snapshot_and_write)
    main_before = nice(threading.get_native_id())
    model, opt = make()
    scramble(model)
    saved = host(model)
    with Checkpointer(tmp_path, model, opt) as ckpt:
        ckpt.save(1)
    assert seen["write"] >= priority.BACKGROUND_NICE
    assert seen["tensorstore"] and min(seen["tensorstore"]) >= priority.BACKGROUND_NICE
    # The snapshot's thread and the training thread keep their priority.
    assert seen["snapshot"] == main_before
    assert nice(threading.get_native_id()) == main_before
    other, other_opt = make(seed=5)
    Checkpointer(tmp_path, other, other_opt).restore()
    assert_state_equal(host(other), saved)


def test_the_collector_is_paused_from_snapshot_to_commit_and_back_after(tmp_path, monkeypatch):
    """Orbax's save call and the commit's manifest pass run with the collector off; it is on
    again once the save is committed (the training loop's garbage is collected as before),
    and a failed save turns it back on too."""
    assert gc.isenabled()
    seen = {}
    start_write, write_manifest = Checkpointer._start_write, commit.write_manifest

    def recording_start_write(self, *args):
        seen["orbax save"] = gc.isenabled()
        start_write(self, *args)

    def recording_write_manifest(step_dir):
        seen["commit"] = gc.isenabled()
        write_manifest(step_dir)

    monkeypatch.setattr(Checkpointer, "_start_write", recording_start_write)
    monkeypatch.setattr(commit, "write_manifest", recording_write_manifest)
    model, opt = make()
    scramble(model)
    saved = host(model)
    with Checkpointer(tmp_path, model, opt) as ckpt:
        ckpt.save(1)
        ckpt.wait()
        assert gc.isenabled()
    assert seen == {"orbax save": False, "commit": False}
    other, other_opt = make(seed=5)
    Checkpointer(tmp_path, other, other_opt).restore()
    assert_state_equal(host(other), saved)

    def failing_start_write(self, *args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Checkpointer, "_start_write", failing_start_write)
    ckpt = Checkpointer(tmp_path, model, opt)
    ckpt.save(2)
    with pytest.raises(CheckpointSaveError, match="No space left"):
        ckpt.wait()
    ckpt.close()
    assert gc.isenabled()


def test_a_collector_the_process_turned_off_stays_off(tmp_path):
    model, opt = make()
    gc.disable()
    try:
        with Checkpointer(tmp_path, model, opt) as ckpt:
            ckpt.save(1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_tensorstore_workers_started_during_the_write_are_lowered_as_they_appear():
    """TensorStore starts pool workers while a save runs, at the priority of whichever thread
    started its overseer (nice 0 after a restore through TensorStore on the main thread):
    each is lowered soon after it appears, not only those there before the save. A thread
    started here at normal priority and named as TensorStore names its workers stands for
    one."""
    named, release = threading.Event(), threading.Event()
    tid, started_at = [], []

    def worker() -> None:
        tid.append(threading.get_native_id())
        started_at.append(nice(tid[0]))  # before the name, which the watcher looks for
        with open(f"/proc/self/task/{tid[0]}/comm", "w") as f:
            f.write("ts_pool_worker")
        named.set()
        release.wait(10)

    with priority.tensorstore_threads_lowered():
        started = threading.Thread(target=worker)
        started.start()
        try:
            assert named.wait(10)
            assert started_at == [nice(threading.get_native_id())]  # started at ours
            deadline = time.monotonic() + 10 * priority._WATCH_S + 5
            while nice(tid[0]) < priority.BACKGROUND_NICE and time.monotonic() < deadline:
                time.sleep(priority._WATCH_S / 5)
            assert nice(tid[0]) >= priority.BACKGROUND_NICE
        finally:
            release.set()
            started.join()
