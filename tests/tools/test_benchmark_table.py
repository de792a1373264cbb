"""The benchmarks page's headline table (tools/benchmark_table.py, bench/results/headline.yaml)
and what the benchmark pages may say.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/tools/test_benchmark_table.py

Why it exists: the table a user reads first must be the one the results file renders (a
number edited by hand, or a results row added without re-rendering, fails here), every row
must lead to the measurement behind it, and the pages are for users: no machine's paths, no
account of who worked on what when.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

# The table's anchors are mkdocs' own (markdown's slugify): the docs dependencies, which `make
# docs` installs in the main venv; the other stacks' venvs (torch 2.11/2.14) have no docs.
pytest.importorskip("markdown", reason="the docs dependencies (markdown) are not installed")

from tools import benchmark_table

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A path of the machine a measurement ran on, and wording about work sessions and the issue
# tracker rather than about what was measured.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home|Users)/\w|(?<![\w.])/tmp/\w")
DIARY = re.compile(r"\bsessions?\b|\bworktree\b|\bthis task\b|\bissue \d+|\bissue's\b", re.I)


def test_page_is_rendered_from_the_results_file():
    assert benchmark_table.rendered() == benchmark_table.PAGE.read_text(), (
        "docs/benchmarks.md's headline table differs from bench/results/headline.yaml: run "
        ".venv/bin/python -m tools.benchmark_table"
    )


def test_every_row_names_a_section_of_the_history():
    _, rows = benchmark_table.load()
    assert rows
    assert all(row.section for row in rows), [row.what for row in rows if not row.section]
    missing = benchmark_table.missing_sections(rows, benchmark_table.HISTORY.read_text())
    assert not missing, f"headline rows whose BENCHMARKS.md section does not exist: {missing}"


def test_every_row_names_its_hardware_peer_and_command():
    hardware, rows = benchmark_table.load()
    table = benchmark_table.render_table(hardware, rows)
    for row in rows:
        assert row.peer and row.command, row
        assert hardware[row.hardware]["label"] in table
        assert f"`{row.command}`" in table


def test_ratio_is_computed_from_the_numbers(tmp_path):
    row = benchmark_table.Row(
        area="a",
        what="w",
        hardware="h",
        peer="p",
        zerojax=7,
        peer_value=1245,
        unit="ms",
        better="lower",
    )
    assert benchmark_table.ratio_text(row) == "0.0056x"
    higher = dataclasses.replace(row, zerojax=14.73, peer_value=13, better="higher")
    assert benchmark_table.ratio_text(higher) == "1.13x (higher is better)"
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "hardware: {h: {label: L, about: A}}\nrows:\n  - {area: a, what: w, hardware: x, peer: p,"
        " zerojax: 1, peer_value: 2, unit: ms, better: lower}\n"
    )
    with pytest.raises(ValueError, match="hardware 'x' is not one of"):
        benchmark_table.load(bad)


def _user_facing_files() -> list[pathlib.Path]:
    docs = [p for p in (ROOT / "docs").glob("*.md") if p.name != "configuration.md"]
    return [ROOT / "BENCHMARKS.md", ROOT / "README.md", *docs]


def test_pages_name_no_machine_paths_and_no_work_sessions():
    found = []
    for path in _user_facing_files():
        for i, line in enumerate(path.read_text().split("\n"), 1):
            for pattern in (MACHINE_PATH, DIARY):
                match = pattern.search(line)
                if match:
                    found.append(f"{path.relative_to(ROOT)}:{i}: {match.group(0)!r}")
    assert not found, (
        "say what was measured, not who worked on it when, and no machine's paths (a results "
        f"section is headed by what it measured and its date): {found}"
    )


def test_bench_scripts_name_no_machine_paths():
    found = [
        f"{path.relative_to(ROOT)}: {m.group(0)!r}"
        for path in sorted((ROOT / "bench").rglob("*.py"))
        for m in [re.search(r"(?<![\w.])/(?:work|home|Users)/\w", path.read_text())]
        if m
    ]
    assert not found, found
