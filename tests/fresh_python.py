"""A Python subprocess started as a user starts one: without the XLA_FLAGS tests/conftest.py
sets for the test process (8 simulated devices: a script or config must say its own device
count), with this checkout first on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_fresh_python(
    args: list[str], *, timeout: float, cwd: str | os.PathLike = REPO
) -> subprocess.CompletedProcess:
    """`python *args`, its output captured as text; the caller checks the return code."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
