"""DDP semantics past the plain loop, in one 2-process torchrun job (see semantics_script.py):
per-rank input gradients, the fused loss path, `p.grad` as DDP's average, and the errors for
an uneven local batch and for ranks that built different models.

    .venv/bin/python -m pytest -q -m slow tests/distributed/test_semantics.py
"""

from __future__ import annotations

import pytest

from tests.distributed.torchrun import REPO, check_ok, torchrun


@pytest.mark.slow
def test_ddp_semantics_in_two_processes():
    result = torchrun(REPO / "tests" / "distributed" / "semantics_script.py", timeout=300)
    check_ok(result)
    for rank in range(2):
        assert f"rank {rank}: all checks passed" in result.stdout, result.stdout[-4000:]
