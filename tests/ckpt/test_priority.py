"""Background checkpoint writes run at background priority (zerojax/ckpt/priority.py).

Run: `.venv/bin/python -m pytest -q tests/ckpt/test_priority.py -p no:cacheprovider`
Why: issue 44 -- the training step right after `save()` ran 1.5 s slower than a step alone on
the 2-core bench host while the write was in flight. The write's threads (the Checkpointer's
writer, TensorStore's pool) now run at nice `BACKGROUND_NICE`; the thread that enqueues the
snapshot (which the next update may wait for) and the training thread keep theirs.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

from tests.ckpt.test_checkpointer import assert_state_equal, host, make, scramble
from zerojax.ckpt import priority
from zerojax.ckpt.checkpointer import Checkpointer

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
    write, snapshot_and_write = Checkpointer._write, Checkpointer._snapshot_and_write

    def recording_write(self, *args):
        seen["write"] = nice(threading.get_native_id())
        write(self, *args)
        seen["tensorstore"] = [nice(t) for t in tensorstore_threads()]

    def recording_snapshot_and_write(self, *args):
        seen["snapshot"] = nice(threading.get_native_id())
        snapshot_and_write(self, *args)

    monkeypatch.setattr(Checkpointer, "_write", recording_write)
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
