"""Job accounting across ranks and restarts (zerojax/runtime/job_time.py, `zerojax ett`) on
logs written by hand, so every second is known.

Run: .venv/bin/python -m pytest -q tests/runtime/test_job_time.py

The end-to-end case (a real torchrun job whose rank is SIGKILLed and restarted) is
tests/distributed/test_restarts.py.
"""

from __future__ import annotations

import json
import os

import pytest

from zerojax.cli import main
from zerojax.runtime.effective_time import goodput, rank_log_path
from zerojax.runtime.job_time import JOB_CATEGORIES, LedgerLogError, job_summary, log_files


def _start(time, attempt, rank=0, started=None):
    return {
        "time": time,
        "event": "process_start",
        "rank": rank,
        "world_size": 2,
        "attempt": attempt,
        "pid": 100 + attempt,
        "process_started": started if started is not None else time - 5.0,
        "clock_start": time,
    }


def _step(time, step):
    return {"time": time, "event": "step", "step": step}


def _event(time, category, seconds):
    return {"time": time, "event": category, "seconds": seconds}


# Attempt 0: process up at 995, initialize at 1000 (startup 5), init 2 s, compile 3 s, steps
# 1-4 finish at 1010, 1012, 1014, 1016, a 1 s checkpoint save of step 2 ends at 1013, then it
# dies; its last record is step 4. Attempt 1 starts at 1030 (14 s between attempts), initializes
# at 1036 (startup 6), restores step 2 (1 s), recompiles (2 s), redoes steps 3-4 and runs 5-6.
ATTEMPT_0 = [
    _start(1000.0, 0),
    _event(1002.0, "init", 2.0),
    _event(1005.0, "trace_compile", 3.0),
    _step(1010.0, 1),
    _step(1012.0, 2),
    _event(1013.0, "checkpoint_blocking", 1.0),
    _step(1014.0, 3),
    _step(1016.0, 4),
]
ATTEMPT_1 = [
    _start(1036.0, 1, started=1030.0),
    _event(1037.0, "init", 1.0),
    _event(1038.0, "checkpoint_restore", 1.0),
    _event(1040.0, "trace_compile", 2.0),
    _step(1042.0, 3),
    _step(1044.0, 4),
    _step(1046.0, 5),
    _step(1048.0, 6),
    _event(1049.0, "checkpoint_blocking", 1.0),
    {"time": 1050.0, "event": "summary"},
]


def _write(path, records, torn_tail=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text + ('{"time": 10' if torn_tail else ""))


def test_restart_is_split_into_redone_work_downtime_restore_and_recompile(tmp_path):
    log = tmp_path / "ett.jsonl"
    # A SIGKILLed process can leave half a line; the reader drops it.
    # An earlier run appended to the same file first: only the latest job is accounted for.
    earlier = [_start(900.0, 0), _step(901.0, 1), _step(902.0, 2)]
    _write(rank_log_path(str(log), 0, 2), earlier + ATTEMPT_0 + ATTEMPT_1, torn_tail=True)
    job = job_summary(log)["job"]
    assert job["earlier_jobs"] == 1
    assert job["wall"] == 1050.0 - 995.0
    assert job["startup"] == 5.0 + 6.0
    assert job["init"] == 3.0 and job["trace_compile"] == 5.0
    assert job["checkpoint_blocking"] == 2.0 and job["checkpoint_restore"] == 1.0
    # Attempt 0 kept steps 1-2 (attempt 1 redid 3 and 4): productive up to 1012 minus init,
    # compile; the 4 s after it, less the 1 s save, were redone.
    assert job["redone_steps"] == (1016.0 - 1012.0) - 1.0
    assert job["between_attempts"] == 1030.0 - 1016.0
    assert job["after_last_step"] == 1050.0 - 1048.0 - 1.0
    assert job["productive"] == (1012.0 - 1000.0 - 5.0) + (1048.0 - 1036.0 - 4.0)
    assert sum(job[c] for c in JOB_CATEGORIES) == pytest.approx(job["wall"])
    assert job["productive_fraction"] == round(15.0 / 55.0, 4)
    # Google's goodput terms: the 14 s between attempts are scheduling badput; the rest of the
    # loss is runtime badput; ETT is their product.
    terms = goodput(job)
    assert terms["scheduling"] == pytest.approx(41.0 / 55.0)
    assert terms["runtime"] == pytest.approx(15.0 / 41.0) and terms["program"] is None
    assert terms["scheduling"] * terms["runtime"] == pytest.approx(15.0 / 55.0)
    assert job["optimizer_steps"] == 6 and job["redone_step_count"] == 2
    assert job["restarts"] == [
        {
            "attempt": 1,
            "between_attempts": 14.0,
            "startup": 6.0,
            "init": 1.0,
            "restore": 1.0,
            "recompile": 2.0,
            "redone_seconds": 3.0,
            "first_step": 3,
        }
    ]


def test_cli_reports_every_rank(tmp_path, capsys):
    log = tmp_path / "ett.jsonl"
    _write(rank_log_path(str(log), 0, 2), ATTEMPT_0 + ATTEMPT_1)
    rank1 = [dict(r, rank=1) if r["event"] == "process_start" else r for r in ATTEMPT_0 + ATTEMPT_1]
    _write(rank_log_path(str(log), 1, 2), rank1)
    (tmp_path / "ett.rankX.jsonl").write_text("not a rank file\n")
    assert [p.name for p in log_files(log)] == ["ett.rank0.jsonl", "ett.rank1.jsonl"]
    assert main(["ett", str(log)]) == 0
    out = capsys.readouterr().out
    assert "2 rank(s), 2 attempt(s), 6 optimizer steps, 2 redone after a restart; rank 0's" in out
    assert "ETT 27.3 %" in out and "attempt 1: 14.00 6.00 1.00 1.00 2.00 3.00" in out
    assert "goodput: scheduling 74.5 %, runtime 36.6 %, program (MFU) not measured" in out
    assert main(["ett", str(log), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert sorted(summary["ranks"]) == ["0", "1"]


def test_missing_or_foreign_logs_are_named(tmp_path, capsys):
    assert main(["ett", str(tmp_path / "none.jsonl")]) == 2
    assert "no effective-time log at" in capsys.readouterr().err
    stale = tmp_path / "old.jsonl"
    _write(stale, ATTEMPT_0[1:])
    with pytest.raises(LedgerLogError, match=r"old\.jsonl: no process_start record"):
        job_summary(stale)
    # Records of an older zerojax before this one's are skipped, not an error.
    _write(stale, ATTEMPT_0[1:] + ATTEMPT_0 + ATTEMPT_1)
    assert job_summary(stale)["job"]["attempts"] == 2


def test_the_latest_of_one_process_and_many_process_logs_is_read(tmp_path):
    log = tmp_path / "ett.jsonl"
    _write(log, ATTEMPT_0)
    _write(rank_log_path(str(log), 0, 2), ATTEMPT_0 + ATTEMPT_1)
    os.utime(log, (1, 1))  # the one-process run is older
    assert [p.name for p in log_files(log)] == ["ett.rank0.jsonl"]
    os.utime(log, None)
    os.utime(rank_log_path(str(log), 0, 2), (1, 1))
    assert log_files(log) == [log]
