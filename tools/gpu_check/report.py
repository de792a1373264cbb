"""What a section of the GPU check reports: tables of measured rows, and pass/fail checks.

A section builds one `SectionReport`; the runner serializes it to JSON in the section's
subprocess and merges all of them into gpu_check.json and gpu_check.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


@dataclasses.dataclass
class Table:
    """One table: a title saying what was measured and how, column names, rows of cells.

    Cells are numbers (kept as numbers in the JSON) or short strings.
    """

    title: str
    columns: list[str]
    rows: list[list[Any]] = dataclasses.field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"row {cells!r} has {len(cells)} cells for columns {self.columns}")
        self.rows.append(list(cells))


@dataclasses.dataclass
class Check:
    """A correctness check: `passed` decides the exit status; `detail` gives the numbers
    (measured value, tolerance and where the tolerance comes from)."""

    name: str
    passed: bool
    detail: str


@dataclasses.dataclass
class Target:
    """A performance target from the issue (e.g. "kernel at least as fast as XLA's"): reported
    as met or not, never a failure of the check (a missed target is a finding, not a bug)."""

    name: str
    met: bool
    detail: str


@dataclasses.dataclass
class SectionReport:
    section: str
    tables: list[Table] = dataclasses.field(default_factory=list)
    checks: list[Check] = dataclasses.field(default_factory=list)
    targets: list[Target] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None  # a crash of the section: set by the runner
    # Why the section stopped before its end (its time was up): what it measured is kept, and a
    # check it did not reach is neither passed nor failed.
    incomplete: str | None = None
    skipped: str | None = None  # why the section did not run (no time left, ...)
    seconds: float | None = None  # the section's wall time, set by the runner

    def table(self, title: str, columns: list[str]) -> Table:
        table = Table(title, columns)
        self.tables.append(table)
        return table

    def check(self, name: str, passed: bool, detail: str) -> bool:
        self.checks.append(Check(name, bool(passed), detail))
        return bool(passed)

    def target(self, name: str, met: bool, detail: str) -> None:
        self.targets.append(Target(name, bool(met), detail))

    @property
    def failed(self) -> bool:
        return self.error is not None or any(not check.passed for check in self.checks)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> SectionReport:
        data = dict(data)
        data["tables"] = [Table(**table) for table in data.get("tables", [])]
        data["checks"] = [Check(**check) for check in data.get("checks", [])]
        data["targets"] = [Target(**target) for target in data.get("targets", [])]
        return cls(**data)


def format_cell(value: Any) -> str:
    """Numbers to 4 significant digits (a table is read, not re-computed: the JSON keeps all)."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else ("yes" if value else "no")
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def markdown(header: dict, reports: list[SectionReport]) -> str:
    """The whole report as markdown: the run's header, then per section its tables, checks,
    targets and notes."""
    lines = ["# zerojax GPU check", ""]
    lines += [f"- {key}: {format_cell(value)}" for key, value in header.items()]
    for report in reports:
        lines += ["", f"## {report.section}", ""]
        if report.skipped:
            lines += [f"Skipped: {report.skipped}"]
            continue
        if report.seconds is not None:
            lines += [f"Wall time {report.seconds:.1f} s.", ""]
        if report.error:
            lines += ["**Crashed:**", "", "```", report.error.strip()[-3000:], "```", ""]
        if report.incomplete:
            lines += [f"**Incomplete:** {report.incomplete}", ""]
        for table in report.tables:
            lines += [f"**{table.title}**", ""]
            lines += ["| " + " | ".join(table.columns) + " |"]
            lines += ["|" + "---|" * len(table.columns)]
            lines += ["| " + " | ".join(format_cell(c) for c in row) + " |" for row in table.rows]
            lines += [""]
        for check in report.checks:
            lines += [f"- check {'PASS' if check.passed else 'FAIL'}: {check.name}: {check.detail}"]
        for target in report.targets:
            lines += [
                f"- target {'met' if target.met else 'MISSED'}: {target.name}: {target.detail}"
            ]
        lines += [f"- note: {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


def write_json(path, header: dict, reports: list[SectionReport]) -> None:
    with open(path, "w") as f:
        json.dump({"header": header, "sections": [r.to_json() for r in reports]}, f, indent=1)
