"""Effective training time of a whole job: every rank, every restart, from the ledgers' logs.

    zerojax ett run/ett.jsonl            # the path of `runtime.effective_time_log`
    zerojax ett run/ett.jsonl --json

A process's ledger (effective_time.py) accounts for its own wall clock. A job restarted by
`torchrun --max-restarts` is several processes per rank, one after another, and the time a
restart costs falls between them or is paid again inside the next one. This module rebuilds the
job's timeline per rank from the records each process appended to its log file
(`process_start`, the lost-time categories, one `step` per optimizer update) and splits the
job's wall clock, from the first process's start to the last record, into:

    startup            process start -> `initialize` (interpreter, imports, joining the job),
                       in every attempt
    init, trace_compile, checkpoint_blocking, checkpoint_restore
                       as the process ledger measures them (restore and recompile are what a
                       restart pays inside the new attempt)
    redone_steps       an attempt's time after its last step that a later attempt computed
                       again (the work lost since the checkpoint it resumed from), and up to
                       its last record
    between_attempts   the last record of an attempt -> the next attempt's process start:
                       detecting the failure and the launcher's restart
    after_last_step    the final attempt's time after its last optimizer step (final save,
                       evaluation, shutdown)
    productive         the rest: optimizer steps that count, and the loop around them

Runs append to the same files: a process that is not a launcher's restart (attempt 0) starts
a new job, and the latest job is the one accounted for. ETT% is productive / wall. A step is
redone when a later attempt runs an update with the same
number (numbers continue from the restored checkpoint). A process killed by SIGKILL writes no
summary, which is why the timeline is built from per-step records rather than summaries.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from zerojax.runtime.effective_time import CATEGORIES, goodput_line

MEASURED = CATEGORIES[:-1]  # the ledger's lost-time categories, logged as events
JOB_CATEGORIES = (
    "startup",
    *MEASURED,
    "redone_steps",
    "between_attempts",
    "after_last_step",
    "productive",
)


class LedgerLogError(ValueError):
    """A log file that is missing or holds no job timeline; the message names the file."""


@dataclasses.dataclass
class Attempt:
    """One process of one rank: its records between two `process_start` records."""

    number: int
    process_started: float
    clock_start: float
    end: float
    steps: list[tuple[float, int]]  # (time the update finished, its number)
    events: list[tuple[float, str, float]]  # (time the block ended, category, seconds)


def log_files(path: str | Path) -> list[Path]:
    """The files of `runtime.effective_time_log = path`: `path` itself (one process) or its
    per-rank siblings `<stem>.rank<R><suffix>`, whichever was written last when both exist.
    Raises LedgerLogError when there are none."""
    path = Path(path)
    if path.is_dir():
        raise LedgerLogError(f"{path} is a directory; give the effective_time_log file path")
    pattern = re.compile(re.escape(path.stem) + r"\.rank(\d+)" + re.escape(path.suffix))
    ranked = {}
    for candidate in path.parent.glob(f"{path.stem}.rank*"):
        match = pattern.fullmatch(candidate.name)
        if match:
            ranked[int(match[1])] = candidate
    ranked = [ranked[rank] for rank in sorted(ranked)]
    if path.is_file() and ranked:
        # One-process runs wrote `path`, multi-process runs the rank files: the newer is the
        # latest job.
        newest_ranked = max(p.stat().st_mtime for p in ranked)
        return ranked if newest_ranked >= path.stat().st_mtime else [path]
    files = ([path] if path.is_file() else []) + ranked
    if not files:
        raise LedgerLogError(
            f"no effective-time log at {path} (nor per-rank {path.stem}.rank<R>{path.suffix}); "
            "set runtime.effective_time_log in the config to write one"
        )
    return files


def read_attempts(path: Path) -> tuple[int, list[Attempt], int]:
    """(rank, the attempts of the file's latest job in order, number of earlier jobs) from one
    rank's log file. Runs append to the same file; a process that is not a launcher's restart
    (attempt 0) begins a new job."""
    attempts: list[Attempt] = []
    earlier_jobs = 0
    rank = None
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            event, when = record["event"], float(record["time"])
        except (ValueError, KeyError, TypeError) as exc:
            # A process killed mid-write leaves at most a torn last line.
            if number == len(lines):
                break
            raise LedgerLogError(f"{path}:{number}: not a ledger record ({exc})") from exc
        if event == "process_start":
            rank = int(record.get("rank", 0))
            if attempts and int(record.get("attempt", 0)) == 0:
                earlier_jobs += 1
                attempts = []
            started = record.get("process_started") or record["clock_start"]
            attempts.append(
                Attempt(
                    number=int(record.get("attempt", len(attempts))),
                    process_started=float(started),
                    clock_start=float(record["clock_start"]),
                    end=when,
                    steps=[],
                    events=[],
                )
            )
            continue
        if not attempts:
            continue  # appended by a zerojax without job accounting: not a job we can account
        current = attempts[-1]
        current.end = max(current.end, when)
        if event == "step":
            current.steps.append((when, int(record["step"])))
        elif event in MEASURED:
            current.events.append((when, event, float(record["seconds"])))
    if not attempts:
        raise LedgerLogError(
            f"{path}: no process_start record (written by a zerojax without job accounting, or "
            "not an effective-time log); a run of this zerojax appends one"
        )
    return (0 if rank is None else rank), attempts, earlier_jobs


def account(attempts: list[Attempt]) -> dict:
    """One rank's job accounting: seconds per JOB_CATEGORIES, wall, ETT and per-restart costs."""
    seconds = dict.fromkeys(JOB_CATEGORIES, 0.0)
    restarts = []
    kept_steps = redone_count = 0
    redone_before = 0.0
    for index, attempt in enumerate(attempts):
        later_firsts = [a.steps[0][1] for a in attempts[index + 1 :] if a.steps]
        redo_from = min(later_firsts, default=None)
        kept = [(t, n) for t, n in attempt.steps if redo_from is None or n < redo_from]
        kept_steps += len(kept)
        redone_count += len(attempt.steps) - len(kept)
        last_kept = kept[-1][0] if kept else attempt.clock_start
        measured = dict.fromkeys(MEASURED, 0.0)
        measured_before_last_kept = 0.0
        for when, category, duration in attempt.events:
            measured[category] += duration
            if when <= last_kept:
                measured_before_last_kept += duration
        for category, duration in measured.items():
            seconds[category] += duration
        startup = max(attempt.clock_start - attempt.process_started, 0.0)
        seconds["startup"] += startup
        productive = max(last_kept - attempt.clock_start - measured_before_last_kept, 0.0)
        seconds["productive"] += productive
        tail = (attempt.end - attempt.clock_start) - productive - sum(measured.values())
        final = index == len(attempts) - 1
        seconds["after_last_step" if final else "redone_steps"] += max(tail, 0.0)
        if index > 0:
            between = max(attempt.process_started - attempts[index - 1].end, 0.0)
            seconds["between_attempts"] += between
            restarts.append(
                {
                    "attempt": attempt.number,
                    "between_attempts": round(between, 3),
                    "startup": round(startup, 3),
                    "init": round(measured["init"], 3),
                    "restore": round(measured["checkpoint_restore"], 3),
                    "recompile": round(measured["trace_compile"], 3),
                    "redone_seconds": round(redone_before, 3),
                    "first_step": attempt.steps[0][1] if attempt.steps else None,
                }
            )
        redone_before = 0.0 if final else max(tail, 0.0)
    wall = attempts[-1].end - attempts[0].process_started
    return {
        "wall": round(wall, 3),
        **{k: round(v, 3) for k, v in seconds.items()},
        "productive_fraction": round(seconds["productive"] / wall, 4) if wall > 0 else 0.0,
        "optimizer_steps": kept_steps,
        "redone_step_count": redone_count,
        "attempts": len(attempts),
        "restarts": restarts,
    }


def job_summary(path: str | Path) -> dict:
    """{"ranks": {rank: account}, "job": rank 0's account (the lowest rank found)}, for the
    latest job in the files (`earlier_jobs` says how many runs before it appended there)."""
    ranks = {}
    for file in log_files(path):
        rank, attempts, earlier_jobs = read_attempts(file)
        if rank in ranks:
            raise LedgerLogError(f"{file}: rank {rank} appears in two log files")
        ranks[rank] = account(attempts) | {"file": str(file), "earlier_jobs": earlier_jobs}
    return {"ranks": dict(sorted(ranks.items())), "job": ranks[min(ranks)]}


def format_summary(summary: dict) -> str:
    job = summary["job"]
    wall = job["wall"] or 1.0
    lines = [
        f"zerojax job effective training time: {len(summary['ranks'])} rank(s), "
        f"{job['attempts']} attempt(s), {job['optimizer_steps']} optimizer steps"
        + (
            f", {job['redone_step_count']} redone after a restart"
            if job["redone_step_count"]
            else ""
        )
        + f"; rank {min(summary['ranks'])}'s timeline",
    ]
    if job["earlier_jobs"]:
        lines.append(f"  (the latest job in the log; {job['earlier_jobs']} earlier run(s) skipped)")
    for name in JOB_CATEGORIES:
        lines.append(f"  {name:<20} {job[name]:9.2f} s  {100 * job[name] / wall:5.1f} %")
    lines.append(f"  {'wall':<20} {job['wall']:9.2f} s")
    lines.append(f"  ETT {100 * job['productive_fraction']:.1f} %")
    lines.append(goodput_line(job))
    if job["restarts"]:
        lines.append("restarts (s): between_attempts startup init restore recompile redone")
        for r in job["restarts"]:
            lines.append(
                f"  attempt {r['attempt']}: {r['between_attempts']:.2f} {r['startup']:.2f} "
                f"{r['init']:.2f} {r['restore']:.2f} {r['recompile']:.2f} "
                f"{r['redone_seconds']:.2f} (resumed at step {r['first_step']})"
            )
    if len(summary["ranks"]) > 1:
        per_rank = ", ".join(
            f"rank {rank} {100 * acc['productive_fraction']:.1f} %"
            for rank, acc in summary["ranks"].items()
        )
        lines.append(f"ETT per rank: {per_rank}")
    return "\n".join(lines)
