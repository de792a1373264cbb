"""The memory and offload sections' GPU-only verdicts (tools/gpu_check/memory.py, offload.py).

Run: `.venv/bin/python -m pytest -q tests/tools/test_gpu_check_memory_offload.py -p no:cacheprovider`

On the CPU no peak is measured and no memory budget is enforced, so the `--cpu` run of the GPU
check never reaches the planned-vs-measured target, the out-of-memory check or the budget's
environment. These tests hand those judges synthetic child results (no model, no compile) so
that a verdict inverted by mistake shows here rather than on the first GPU run; and stop a
child that outlasts its deadline, keeping what it printed before.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from tools.gpu_check import memory, offload
from tools.gpu_check.report import SectionReport

GB = 10**9


def memory_result(planned_peak: int, measured_peak: int, live_params: int = 4) -> dict:
    states = {"params": 4, "opt_state": 16, "master_weights": 8}
    return {
        "losses": [11.0, 10.5, 10.0],
        "measured_peak": measured_peak,
        "bytes_in_use_after_steps": 28,
        "live_state": {**states, "params": live_params},
        "live_device_resident": 28,
        "compiled_for": "gpu: NVIDIA H100 80GB HBM3",
        "num_params": 2,
        "planned": {
            "step_peak": planned_peak,
            "device_states": 28,
            "host_states": 0,
            "host_step_peak": 0,
            "components": {name: {"bytes": b, "host": False} for name, b in states.items()},
        },
    }


def test_memory_target_is_met_near_1_and_missed_far_from_it_and_checks_state_bytes():
    report = SectionReport("memory")
    results = {
        "close": memory_result(10 * GB, int(10.4 * GB)),
        "under-planned": memory_result(10 * GB, 13 * GB),
        "wrong state": memory_result(10 * GB, 10 * GB, live_params=6),
    }
    memory.report_results(report, results, cpu=False)
    targets = {t.name.split(":")[0]: t.met for t in report.targets}
    assert targets == {"close": True, "under-planned": False, "wrong state": True}
    failed = [c.name for c in report.checks if not c.passed]
    assert failed == ["wrong state: planned state bytes = the live arrays' bytes"]


def test_memory_child_out_of_time_is_a_note_and_a_crash_a_failure():
    report = SectionReport("memory")
    results = {
        "slow": {"measured_peak": 5 * GB, "error": "killed", "timed_out": True},
        "plan left out": {"measured_peak": 5 * GB, "plan_skipped": "3 s left"},
        "crashed": {"error": "exit status 1: RuntimeError: boom"},
    }
    memory.report_results(report, results, cpu=False)
    assert [(c.name, c.passed) for c in report.checks] == [("crashed: planned and measured", False)]
    assert sum("not planned for lack of time" in note for note in report.notes) == 2


def budget_report(no_offload: dict, offloaded: dict) -> SectionReport:
    report = SectionReport("offload")
    peaks = {offload.NO_OFFLOAD: 6 * GB, offload.OFFLOAD: 2 * GB}
    results = {offload.NO_OFFLOAD: no_offload, offload.OFFLOAD: offloaded}
    gpu = SimpleNamespace(cpu=False)
    budget = (int(3.46 * GB), "between the peaks")
    offload.budget_results(gpu, report, "model", peaks, budget, results)
    return report


def budget_run(losses, *, out_of_memory=False) -> dict:
    return {
        "out_of_memory": out_of_memory,
        "error": "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory" if out_of_memory else None,
        "failed_at": "step 1" if out_of_memory else None,
        "losses": losses,
        "bytes_limit": int(3.46 * GB),
        "peak": 2 * GB,
    }


def test_offload_checks_need_the_oom_without_and_falling_finite_losses_with():
    passing = budget_report(budget_run([], out_of_memory=True), budget_run([11, 10.8, 10.5, 10.1]))
    assert [c.passed for c in passing.checks] == [True, True]
    fitting = budget_report(budget_run([11, 10, 9, 8]), budget_run([11, 10.8, 10.5, 10.1]))
    assert [c.passed for c in fitting.checks] == [False, True]
    for losses in ([11, 11.2, 11.5, 11.9], [11, float("nan"), 10, 9], [11, 10]):
        failing = budget_report(budget_run([], out_of_memory=True), budget_run(losses))
        assert [c.passed for c in failing.checks] == [True, False], losses


def test_offload_run_out_of_time_gives_no_verdict():
    killed = {"error": "not finished by the section's deadline (killed)", "timed_out": True}
    report = budget_report(killed, killed)
    assert report.checks == []
    assert len(report.notes) == 2


def test_out_of_memory_is_recognised_through_wrapping_exceptions():
    try:
        try:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8 GB")
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert offload.is_out_of_memory(outer)
    assert not offload.is_out_of_memory(ValueError("shapes differ"))


def test_budget_sits_below_the_states_without_offload_when_that_leaves_room():
    planned = {"peaks": {offload.NO_OFFLOAD: 6 * GB, offload.OFFLOAD: 2 * GB}}
    budget, _ = offload.choose_budget({**planned, "no_offload_states": 4 * GB})
    assert budget == int(3.8 * GB)
    # 95% of 2.2 GB leaves the offloaded run < 20% of room: the peaks' geometric mean.
    budget, _ = offload.choose_budget({**planned, "no_offload_states": int(2.2 * GB)})
    assert budget == int((12**0.5) * GB)


def test_budget_env_sets_the_one_fraction_jax_reads(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # jaxlib refuses both names
    env = offload.budget_env({"bytes_limit": 60 * GB, "memory_fraction": 0.75}, 2 * GB)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
    assert float(env["XLA_CLIENT_MEM_FRACTION"]) == 2 / 80
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


def test_a_child_past_its_deadline_is_killed_and_keeps_what_it_printed():
    code = "import json, time; print(json.dumps({'measured_peak': 7}), flush=True); time.sleep(60)"
    child = memory.start_child(["-c", code])
    result = memory.collect_child("sleeper", child, time.monotonic() + 3)
    assert result["measured_peak"] == 7 and result["timed_out"]
    assert child.returncode is not None  # killed, not left running
