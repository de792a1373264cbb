"""Rows of the report and the rules that give each its verdict (see the package docstring).

A row is one fault met by one reader or writer: `fault` (what was done), `expected` (what a
correct system must do), `observed` (what happened, in a line) and `verdict`. The judging
helpers here are the only place the verdicts are decided, so every fault is held to the
same rules.
"""

from __future__ import annotations

import dataclasses
import re

CAUGHT = "caught"
RECOVERED = "recovered"
TOLERATED = "tolerated"
FLAWED = "flawed"
SILENT = "SILENT"
SKIPPED = "skipped"
VERDICTS = (CAUGHT, RECOVERED, TOLERATED, FLAWED, SILENT, SKIPPED)


@dataclasses.dataclass(kw_only=True)
class Row:
    fault: str
    """What was done, e.g. 'step 2 model/_METADATA: truncate | restore latest'."""
    group: str
    """'file', 'item', 'disk-full', 'read-only', 'sigkill', 'import'."""
    expected: str
    observed: str
    verdict: str
    seconds: float = 0.0


def one_line(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def names(message: str, step: int | None, paths: list[str]) -> bool:
    """Whether an error message names the step (`step 2`, `.../2`) or one of `paths`."""
    if any(p and p in message for p in paths):
        return True
    return step is not None and re.search(rf"\bstep\W{{0,3}}{step}\b", message) is not None


def judge_error(error: BaseException, step: int | None, paths: list[str]) -> tuple[str, str]:
    """(verdict, observed) of an operation that raised `error`."""
    from zerojax.ckpt.errors import CheckpointError

    observed = one_line(f"{type(error).__name__}: {error}")
    if not isinstance(error, CheckpointError):
        return FLAWED, f"raised a bare {observed} (not a CheckpointError)"
    if not names(str(error), step, paths):
        return FLAWED, f"raised {observed} -- names neither step {step} nor its path"
    return CAUGHT, f"raised {observed}"


def judge_cli(
    code: int | str, err: str, step: int | None, paths: list[str], *, in_process: bool = False
) -> tuple[str, str]:
    """(verdict, observed) of a `zerojax ckpt` command that exited non-zero.

    `in_process`: the command ran inside the worker (`file_faults.run_cli`), whose stderr
    also catches what other threads print meanwhile (a previous fault's background thread),
    so only the command's own lines count and a traceback there is not held against it; an
    exception escaping the command is judged by the caller."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    if in_process:
        own = [i for i, line in enumerate(lines) if line.startswith("zerojax ")]
        lines = lines[own[0] :] if own else lines
        err = "\n".join(lines)
    first = one_line(
        lines[0] if in_process and lines else lines[-1] if lines else "(nothing on stderr)"
    )
    if "Traceback" in err and not in_process:
        return FLAWED, f"exit {code} with a traceback: {first}"
    if not names(err, step, paths):
        return FLAWED, f"exit {code}, names neither step {step} nor path: {first}"
    return CAUGHT, f"exit {code}: {first}"
