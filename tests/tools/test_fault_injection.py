"""The checkpoint fault-injection suite runs end to end and finds no SILENT fault.

Run: `.venv/bin/python -m pytest -q -m slow tests/tools/test_fault_injection.py -p no:cacheprovider`
Why: issue 41 -- a checkpoint must never lie: a damaged step restores, exports or verifies
only with an error or a warned fallback, a failed save never exits 0. `tools/fault_injection`
injects the faults (every file kind of a step damaged five ways, a full disk, read-only
directories, SIGKILL mid-save) into a real ZeRO-3 checkpoint; this test runs it as a user
would and fails on any SILENT row, listing them. It takes 2-4 minutes: slow-marked.
The quick tests below pin the suite's own judging, so a verdict cannot drift to "caught".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.fault_injection import file_faults
from tools.fault_injection.outcomes import CAUGHT, FLAWED, SILENT, VERDICTS, judge_cli, names

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_no_fault_is_silent(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tools.fault_injection", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=REPO,
    )
    report = json.loads((tmp_path / "faults.json").read_text())
    counts, rows = report["counts"], report["rows"]
    # Every fault group ran (a harness that skipped them all would find nothing silent).
    groups = {r["group"] for r in rows if r["verdict"] != "skipped"}
    assert {"control", "file", "item", "import", "sigkill"} <= groups, (
        groups,
        result.stdout[-3000:],
    )
    assert counts["faults"] >= 150, counts
    # The undamaged copy reads as saved everywhere: else "caught" would mean nothing.
    controls = [r for r in rows if r["group"] == "control"]
    assert len(controls) == 4 and all(r["verdict"] == "recovered" for r in controls), controls
    silent = [f"{r['fault']}: {r['observed']}" for r in rows if r["verdict"] == SILENT]
    assert not silent, "SILENT faults:\n" + "\n".join(silent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_file_kinds_group_every_file_of_a_step(tmp_path):
    """Orbax's file names map to kinds; an unknown file becomes its own kind, not ignored."""
    step = tmp_path / "2"
    files = [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "zerojax_manifest.json",
        "meta/metadata",
        "model/_METADATA",
        "model/_sharding",
        "model/manifest.ocdbt",
        "model/array_metadatas/process_0",
        "model/d/c386096f36d7f4c58a78aaaaf104d733",
        "model/ocdbt.process_0/manifest.ocdbt",
        "model/ocdbt.process_0/d/240ff6f84c21b3905ef01e5e7ca5e324",
        "model/ocdbt.process_0/d/b9eb62530000eb21a793d0ae34f235a6",
        "optimizer/new_orbax_file.bin",
    ]
    for i, name in enumerate(files):
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).write_bytes(b"x" * (i + 1))
    kinds = file_faults.step_file_kinds(step)
    assert sum(len(v) for v in kinds.values()) == len(files)
    assert kinds["model: array data (ocdbt.process_N/d)"] == [
        "model/ocdbt.process_0/d/b9eb62530000eb21a793d0ae34f235a6",  # largest first
        "model/ocdbt.process_0/d/240ff6f84c21b3905ef01e5e7ca5e324",
    ]
    assert kinds["optimizer: other: new_orbax_file.bin"] == ["optimizer/new_orbax_file.bin"]
    assert "meta: JSON item (metadata)" in kinds and "zerojax manifest" in kinds


def test_damages_change_the_file_as_named(tmp_path):
    data = bytes(range(200))
    for how in file_faults.DAMAGES:
        path = tmp_path / how
        path.write_bytes(data)
        file_faults.damage(path, how, seed=1)
        after = path.read_bytes() if path.exists() else None
        expected = {
            "flip": data[:100] + bytes([data[100] ^ 1]) + data[101:],
            "truncate": data[:100],
            "delete": None,
            "empty": b"",
        }
        if how == "garbage":
            assert len(after) == len(data) and after != data
        else:
            assert after == expected[how], how


def test_judging_a_cli_failure():
    """A non-zero exit is caught only with a message naming the step or path and no
    traceback; exit 0 from a verify of a damaged step is the reader's SILENT case."""
    assert judge_cli(2, "zerojax ckpt inspect: error: step 2 of /x: crc32\n", 2, [])[0] == CAUGHT
    assert judge_cli(2, "error: '/x/2/model/d/ab' is missing\n", 2, ["/x/2"])[0] == CAUGHT
    assert judge_cli(2, "error: something failed\n", 2, ["/x/2"])[0] == FLAWED
    assert judge_cli(1, "Traceback (most recent call last):\n step 2\n", 2, [])[0] == FLAWED
    # In the worker, stderr also holds other threads' noise: only the command's lines count.
    noise = "Traceback (most recent call last):\n  RuntimeError: Event loop is closed\n"
    own = "zerojax ckpt export: error: step 2 of /x: crc32\n"
    assert judge_cli(2, noise + own, 2, [], in_process=True) == (CAUGHT, "exit 2: " + own.strip())
    assert names("step 12 is damaged", 2, []) is False
    assert names("checkpoint step 2: missing", 2, []) is True
    assert SILENT in VERDICTS
