"""The driver: build the base checkpoint, run every fault, collect the rows.

No jax here: every fault runs in a worker process (`worker.py`), so a fault that crashes or
hangs a process is itself a finding rather than the end of the suite. Reader faults run in
one worker per lane, in order; when it dies or a fault takes longer than `fault_timeout`, the fault
is recorded as flawed and a new worker takes the rest.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import time
from pathlib import Path

from tools.fault_injection import environment_faults, file_faults
from tools.fault_injection.environment_faults import REPO, _env, worker_command
from tools.fault_injection.outcomes import FLAWED, Row


def _build(root: Path, timeout: float) -> None:
    process = subprocess.run(
        worker_command("build", root),
        capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO,
    )  # fmt: skip
    if process.returncode != 0:
        raise RuntimeError(f"building the base checkpoint failed:\n{process.stderr[-3000:]}")


def run_readers(
    faults: list[dict], base: Path, scratch: Path, fault_timeout: float, name: str = "readers"
) -> list[Row]:
    """Run reader faults in worker processes, replacing a worker that dies or hangs."""
    for i, fault in enumerate(faults):
        fault.setdefault("id", i)  # ids (and the seeds and work directories made from them)
    pending = {f["id"]: f for f in faults}
    rows: dict[int, list[Row]] = {}
    attempt = 0
    while pending:
        attempt += 1
        spec_path = scratch / f"{name}_{attempt}.json"
        results_path = scratch / f"{name}_{attempt}.jsonl"
        spec_path.write_text(
            json.dumps(
                {"base": str(base), "scratch": str(scratch), "faults": list(pending.values())}
            )
        )
        log = open(scratch / f"{name}_{attempt}.log", "w")  # noqa: SIM115 - the worker's
        worker = subprocess.Popen(
            worker_command("readers", spec_path, results_path),
            stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO,
        )  # fmt: skip
        current, since, seen = None, time.monotonic(), 0
        while True:
            done = worker.poll() is not None
            lines = results_path.read_text().splitlines() if results_path.exists() else []
            for line in lines[seen:]:
                event = json.loads(line)
                if "start" in event:
                    current, since = event["start"], time.monotonic()
                else:
                    rows[event["id"]] = [Row(**r) for r in event["rows"]]
                    pending.pop(event["id"], None)
                    current = None
            seen = len(lines)
            if done or not pending:
                break
            if current is not None and time.monotonic() - since > fault_timeout:
                worker.kill()
                worker.wait()
                done = True
                break
            time.sleep(0.2)
        worker.wait()
        log.close()
        if worker.returncode is not None and worker.returncode > 0:
            # A Python exception escaped the worker: every call into zerojax is inside a
            # try, so this is the harness or the environment (an import failing), not a fault.
            raise RuntimeError(
                f"the reader worker failed (exit {worker.returncode}): "
                f"{(scratch / f'{name}_{attempt}.log').read_text()[-3000:]}"
            )
        if current is not None and current in pending:
            fault = pending.pop(current)
            what = "hung" if worker.returncode == -9 else f"died (exit {worker.returncode})"
            tail = (scratch / f"{name}_{attempt}.log").read_text()[-300:]
            rows[current] = [
                Row(fault=f"{fault.get('label', fault.get('file'))}: {fault.get('damage', '')}",
                    group=fault["group"], expected="no crash, no hang", verdict=FLAWED,
                    observed=" ".join(f"the worker {what} on this fault: {tail}".split()))
            ]  # fmt: skip
    return [row for i in sorted(rows) for row in rows[i]]


def run_suite(
    out: Path, *, kills: int = 6, seed: int = 0, only: str = "", fault_timeout: float = 120.0
) -> list[Row]:
    """Every fault. After the build, four lanes run side by side (much of each child's time
    is starting Python and JAX): the damaged files in two halves; the SIGKILLs, then their
    resumes; the full disk, then the read-only directories."""
    scratch = out / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    base = scratch / "base"
    base.mkdir(parents=True)
    _build(base, timeout=600)

    faults = file_faults.step_damage_specs(base / "ckpt" / "2") + file_faults.import_specs()
    faults = [f for f in faults if only in json.dumps(f)]
    for i, fault in enumerate(faults):
        fault["id"] = i  # unique across the two halves: their work directories differ

    def files(half: int) -> list[Row]:
        mine = faults[half::2]
        return run_readers(mine, base, scratch, fault_timeout, f"readers{half}") if mine else []

    def killed() -> list[Row]:
        if not kills or (only and "sigkill" not in only):
            return []
        specs = environment_faults.kill_faults(base, scratch, kills, seed, timeout=300)
        for i, spec in enumerate(specs):
            spec["id"] = len(faults) + i
        return run_readers(specs, base, scratch, fault_timeout, "resume")

    def machine() -> list[Row]:
        rows = []
        if not only or "disk" in only:
            rows += environment_faults.disk_full_faults(base, scratch, timeout=180)
        if not only or "read-only" in only:
            rows += environment_faults.read_only_faults(base, scratch, timeout=180)
        return rows

    with concurrent.futures.ThreadPoolExecutor(4) as lanes:
        halves = [lanes.submit(files, 0), lanes.submit(files, 1)]
        others = [lanes.submit(killed), lanes.submit(machine)]
        rows = [row for result in halves for row in result.result()]
        return sorted(rows, key=lambda r: (r.group, r.fault)) + [
            row for result in others for row in result.result()
        ]
