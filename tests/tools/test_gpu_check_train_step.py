"""The train_step section's judges (tools/gpu_check/train_step.py) fail what they must.

Run: `.venv/bin/python -m pytest -q tests/tools/test_gpu_check_train_step.py -p no:cacheprovider`

The `--cpu` run of the GPU check only shows agreeing losses passing and contenders that finish
in time; these tests hand the judges synthetic losses (no model, no compiles) so that a
tolerance loosened by mistake shows here, and stop a contender that outlasts the deadline,
which no `--cpu` run does.
"""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest

from tools.gpu_check import train_step
from tools.gpu_check.context import Context
from tools.gpu_check.report import SectionReport

# GPT-2 small's shape: 12 layers, batch 8 x 1024 tokens.
WORKLOAD = SimpleNamespace(config=SimpleNamespace(n_layer=12), batch=8, seq=1024)


def measured(first: float, second: float) -> train_step.Measured:
    return train_step.Measured(losses=[first, second], step_seconds=[0.1], first_step_seconds=1.0)


def compared(losses: dict[str, tuple[float, float]]) -> SectionReport:
    report = SectionReport("train_step")
    results = {name: measured(*pair) for name, pair in losses.items()}
    train_step.compare_losses(report, WORKLOAD, results, set())
    return report


def test_losses_within_bf16_rounding_pass_and_a_wrong_step_2_fails():
    # zerojax's bf16 loss sits on bf16's grid (spacing 2^-4 at 8-16): one rounding away.
    agreeing = compared({"torch eager": (10.9617, 9.8661), "zerojax ZeRO-0": (10.9375, 9.875)})
    assert [check.passed for check in agreeing.checks] == [True]
    # A gradient that is off shows in step 2 (GPT-2 small drops ~1.1 there), not in step 1.
    wrong_update = compared({"torch eager": (10.9617, 9.8661), "zerojax ZeRO-0": (10.9617, 10.2)})
    assert [check.passed for check in wrong_update.checks] == [False]


def test_step_2_must_lower_the_loss():
    for second, passes in ((9.87, True), (10.97, False), (float("nan"), False)):
        report = SectionReport("train_step")
        train_step.check_update(report, "zerojax ZeRO-0", measured(10.96, second))
        assert report.checks[0].passed is passes


def test_a_contender_past_the_deadline_is_stopped(tmp_path):
    ctx = Context(
        cpu=True,
        deadline=time.monotonic() + train_step.DEADLINE_MARGIN_S + 0.2,
        scratch_dir=str(tmp_path),
    )
    previous = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    with pytest.raises(train_step.OutOfTime), train_step.stopped_at_deadline(ctx) as alarm:
        while time.monotonic() - start < 10:
            pass
    assert alarm and time.monotonic() - start < 2
    assert signal.getsignal(signal.SIGALRM) is previous
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
