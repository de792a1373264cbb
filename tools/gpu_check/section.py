"""One section of the GPU check, in its own process: `python -m tools.gpu_check.section NAME
--json OUT --seconds S --scratch DIR [--cpu]`. Writes the section's report as JSON to OUT,
also when stopped by SIGTERM (what was measured so far) or when the section raises."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time
import traceback

from tools.gpu_check.context import Context, prepare_environment
from tools.gpu_check.report import SectionReport


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--json", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    prepare_environment(args.cpu)
    report = SectionReport(args.name)

    def write() -> None:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f)

    def stopped(signum, frame):
        report.incomplete = f"stopped when its {args.seconds:.0f} s were up"
        write()
        sys.exit(124)

    signal.signal(signal.SIGTERM, stopped)
    context = Context(
        cpu=args.cpu, deadline=time.monotonic() + args.seconds, scratch_dir=args.scratch
    )
    module = importlib.import_module(f"tools.gpu_check.{args.name}")
    try:
        module.run(context, report)
    except Exception:  # noqa: BLE001 (the report names the crash; the runner goes on)
        report.error = traceback.format_exc()
    write()
    print(f"section {args.name}: {'crashed' if report.error else 'done'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
