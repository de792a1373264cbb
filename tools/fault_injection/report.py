"""The suite's report: a table on stdout, every row in JSON, and the counts by verdict."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

from tools.fault_injection.outcomes import CAUGHT, RECOVERED, SILENT, VERDICTS, Row


def counts(rows: list[Row]) -> dict[str, int]:
    """{"faults": n, verdict: n, ..., "controls": n, "controls_ok": n}; the controls (the
    undamaged copy) are not faults and are counted apart."""
    faults = [r for r in rows if r.group != "control"]
    controls = [r for r in rows if r.group == "control"]
    tally = Counter(r.verdict for r in faults)
    return {
        "faults": len(faults),
        **{v: tally.get(v, 0) for v in VERDICTS},
        "controls": len(controls),
        "controls_ok": sum(r.verdict == RECOVERED for r in controls),
    }


def table(rows: list[Row], *, everything: bool = False) -> str:
    """One line per row (only the rows not caught unless `everything`), then the counts."""
    shown = rows if everything else [r for r in rows if r.verdict != CAUGHT]
    width = max([len(r.fault) for r in shown] + [5])
    lines = [f"{'fault':<{width}}  {'verdict':<9}  observed", "-" * (width + 40)]
    for r in shown:
        lines.append(f"{r.fault:<{width}}  {r.verdict:<9}  {r.observed}")
    if not everything:
        lines.append(f"({sum(r.verdict == CAUGHT for r in rows)} caught rows not shown)")
    tally = counts(rows)
    lines.append(", ".join(f"{k}: {v}" for k, v in tally.items()))
    by_group: dict[str, Counter] = {}
    for r in rows:
        by_group.setdefault(r.group, Counter())[r.verdict] += 1
    for group, tally_ in by_group.items():
        lines.append(f"  {group:<10} " + ", ".join(f"{v} {n}" for v, n in sorted(tally_.items())))
    return "\n".join(lines)


def write(rows: list[Row], out: Path, seconds: float) -> Path:
    path = out / "faults.json"
    path.write_text(
        json.dumps(
            {
                "counts": counts(rows),
                "seconds": round(seconds, 1),
                "silent": [r.fault for r in rows if r.verdict == SILENT],
                "rows": [dataclasses.asdict(r) for r in rows],
            },
            indent=1,
        )
    )
    (out / "faults.txt").write_text(table(rows, everything=True) + "\n")
    return path
