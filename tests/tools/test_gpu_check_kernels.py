"""The kernels section's judge (tools/gpu_check/kernels.py) fails a wrong kernel.

Run: `.venv/bin/python -m pytest -q tests/tools/test_gpu_check_kernels.py -p no:cacheprovider`

The `--cpu` run of the GPU check only ever shows correct kernels passing; these tests hand the
judge synthetic outputs (no Pallas, no compiles) so that a tolerance loosened by mistake, or a
NaN or a crash that slips through, shows here: a kernel that is wrong in one block of rows, or
returns NaN, or raises, must fail its check, and one as accurate as XLA's must pass.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest

from tools.gpu_check.context import Context
from tools.gpu_check.kernels import Contender, KernelCheck
from tools.gpu_check.report import SectionReport


class SyntheticCheck(KernelCheck):
    kind = "norm"
    title = "synthetic"
    unit = "GB/s"

    def speed_title(self) -> str:
        return "synthetic outputs"

    # The tests hand contenders to `compare` themselves: no cases to run.
    def cases(self) -> list[tuple[str, int, dict]]:
        return []

    def run_case(self, label: str, **arguments) -> None:
        del label, arguments


def reference_output() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((256, 64), np.float32)


def judged(pallas_output, tmp_path) -> SectionReport:
    """The check of a 'pallas' contender returning `pallas_output` (a callable raises),
    against an 'xla' contender that rounds the fp32 reference to bf16 once."""
    ctx = Context(cpu=True, deadline=time.monotonic() + 60, scratch_dir=str(tmp_path))
    report = SectionReport("kernels")
    reference = jnp.asarray(reference_output())

    def xla():
        return 1e-3, [reference.astype(jnp.bfloat16)]

    def pallas():
        if callable(pallas_output):
            pallas_output()
        return 2e-3, [jnp.asarray(pallas_output, jnp.bfloat16)]

    contenders = [Contender("xla", xla), Contender("pallas", pallas, is_pallas=True, is_peer=False)]
    check = SyntheticCheck(ctx, report, {})
    check.compare("case", "fwd", contenders, work=1e6, output_names=("y",), reference=[reference])
    check.finish()
    return report


def test_an_output_as_accurate_as_xla_passes(tmp_path):
    # Rounded after a relative error of 2^-10 (a quarter of a bf16 half-ulp): another
    # rounding site, no more error than XLA's own.
    report = judged(reference_output() * (1 + 2.0**-10), tmp_path)
    assert [check.passed for check in report.checks] == [True], report.checks
    assert report.targets[0].met is False  # 2 ms against XLA's 1 ms


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param(
            lambda y: np.concatenate([np.zeros_like(y[:16]), y[16:]]), id="a tile skipped"
        ),
        pytest.param(
            lambda y: y * np.where(np.arange(256)[:, None] < 8, 1.05, 1.0), id="rows 5% off"
        ),
        pytest.param(lambda y: np.where(y > 3, np.nan, y), id="NaN"),
    ],
)
def test_a_wrong_output_fails(tmp_path, wrong):
    report = judged(wrong(reference_output()), tmp_path)
    assert [check.passed for check in report.checks] == [False], report.checks


def test_a_kernel_that_raises_fails_and_its_row_says_why(tmp_path):
    def crash():
        raise RuntimeError("Triton compilation failed\nsecond line")

    report = judged(crash, tmp_path)
    assert [check.passed for check in report.checks] == [False]
    assert "RuntimeError: Triton compilation failed" in report.checks[0].detail
    speed = report.tables[0]
    assert speed.rows[1][3] == "failed: RuntimeError: Triton compilation failed"
