"""The processes the suite starts: `python -m tools.fault_injection.worker <command> ...`.

    build ROOT                          the base checkpoint (`base.build_base`)
    readers SPECS RESULTS               damaged files and resumes, one after another; a line
                                        of JSON per fault started and per rows found, so the
                                        driver can replace a worker that crashes or hangs
    disk-full ROOT MOUNT OUT            inside a private namespace with a tmpfs at MOUNT
    save-without-close ROOT DIR MOUNT END  ends without close() after a failing async save
    read-only ROOT SCRATCH OUT          as a user chmod applies to
    kill-save ROOT DIR                  saves step 3 and waits for SIGKILL

It sets up the 8 simulated devices before anything imports jax.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import signal
import sys
from pathlib import Path

from tools.fault_injection.base import simulated_devices

simulated_devices()
# The driver sends SIGUSR1 to a process that hangs, before it kills it: the stacks of every
# thread then say where (on stderr, into the report).
faulthandler.register(signal.SIGUSR1, all_threads=True)


def _write_rows(path: str, rows) -> None:
    Path(path).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))


def _readers(spec_path: str, results_path: str) -> None:
    from tools.fault_injection.environment_faults import run_resume
    from tools.fault_injection.file_faults import run_import_damage, run_step_damage

    spec = json.loads(Path(spec_path).read_text())
    base, scratch = Path(spec["base"]), Path(spec["scratch"])
    run = {"step": run_step_damage, "import": run_import_damage, "resume": run_resume}
    with open(results_path, "a") as results:
        for fault in spec["faults"]:
            results.write(json.dumps({"start": fault["id"]}) + "\n")
            results.flush()
            rows = run[fault["type"]](fault, base, scratch, seed=100 + 2 * fault["id"])
            results.write(
                json.dumps({"id": fault["id"], "rows": [dataclasses.asdict(r) for r in rows]})
                + "\n"
            )
            results.flush()


def main(argv: list[str]) -> None:
    command, args = argv[0], argv[1:]
    if command != "save-without-close":
        # Orbax logs every failed write with its traceback; these verdicts come from what the
        # zerojax API raises and returns. save-without-close is judged on its stderr: as is.
        logging.getLogger("absl").setLevel(logging.CRITICAL)
    if command == "build":
        from tools.fault_injection.base import build_base

        build_base(args[0])
    elif command == "readers":
        _readers(*args)
    elif command == "disk-full":
        from tools.fault_injection.environment_faults import child_disk_full

        _write_rows(args[2], child_disk_full(Path(args[0]), Path(args[1])))
    elif command == "save-without-close":
        from tools.fault_injection.environment_faults import child_save_without_close

        child_save_without_close(Path(args[0]), Path(args[1]), args[2], Path(args[3]))
    elif command == "read-only":
        from tools.fault_injection.environment_faults import child_read_only

        _write_rows(args[2], child_read_only(Path(args[0]), Path(args[1])))
    elif command == "kill-save":
        from tools.fault_injection.environment_faults import child_kill_save

        child_kill_save(Path(args[0]), Path(args[1]))
    else:
        raise SystemExit(f"worker: unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
