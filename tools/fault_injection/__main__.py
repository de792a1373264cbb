"""`python -m tools.fault_injection --out DIR`: run the suite, print the table, write
DIR/faults.json and DIR/faults.txt. Exit status 1 when any fault is SILENT."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tools.fault_injection import report
from tools.fault_injection.outcomes import SILENT
from tools.fault_injection.runner import run_suite


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fault_injection", description=__doc__)
    parser.add_argument("--out", required=True, type=Path, help="report directory (created)")
    parser.add_argument("--kills", type=int, default=6, help="SIGKILLs during async saves")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    parser.add_argument("--only", default="", help="run the faults whose spec contains this")
    parser.add_argument("--all", action="store_true", help="print the caught rows too")
    opts = parser.parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = run_suite(opts.out.absolute(), kills=opts.kills, seed=opts.seed, only=opts.only)
    seconds = time.perf_counter() - start
    path = report.write(rows, opts.out, seconds)
    print(report.table(rows, everything=opts.all))
    print(f"{len(rows)} faults in {seconds:.0f} s; every row in {path}")
    return 1 if any(r.verdict == SILENT for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
