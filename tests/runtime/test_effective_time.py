"""Effective-training-time ledger and the persistent compilation cache, in fresh processes.

Run: .venv/bin/python -m pytest -q tests/runtime/test_effective_time.py
Each run of the script below is a new process, as a restarted job is: the second one must find
its programs in the compilation cache instead of compiling them again.
"""

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from zerojax.runtime.effective_time import CATEGORIES, EffectiveTimeLedger

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, torch, zerojax
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None
    )
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {
        "mesh": {"fsdp": 8},
        "zero": {"stage": 3},
        "runtime": {
            "compilation_cache_dir": sys.argv[1],
            "effective_time_log": sys.argv[2],
            "report_effective_time": sys.argv[3] == "report",
        },
    }
    model, optimizer = zerojax.initialize(net, torch.optim.AdamW(net.parameters()), config)
    for _ in range(3):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    print(json.dumps({"cache_hits": len(hits)}))
    """
)


def _run(tmp_path: Path, report: bool) -> tuple[dict, list[dict], str]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    log = tmp_path / "effective_time.jsonl"
    log.unlink(missing_ok=True)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(tmp_path / "cache"),
            str(log),
            "report" if report else "quiet",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return json.loads(done.stdout.strip().splitlines()[-1]), events, done.stderr


@pytest.mark.multidevice
@pytest.mark.long
def test_restarted_process_reuses_compiled_programs_and_reports_time(tmp_path):
    first, events, stderr = _run(tmp_path, report=True)
    assert first["cache_hits"] == 0
    assert any((tmp_path / "cache").iterdir())
    summary = events[-1]
    assert summary["event"] == "summary" and summary["optimizer_steps"] == 3
    for name in CATEGORIES:
        assert summary[name] >= 0.0
    assert summary["init"] > 0 and summary["trace_compile"] > 0 and summary["productive"] > 0
    # Every category is part of the same wall clock. The summary rounds each figure to the
    # millisecond, so the rounded parts may exceed the rounded wall by half a millisecond each.
    rounding = 0.0005 * (len(CATEGORIES) + 1)
    assert sum(summary[name] for name in CATEGORIES) <= summary["wall"] + rounding
    # The job timeline `zerojax ett` reads: where the process began, then each update's number.
    assert events[0]["event"] == "process_start" and events[0]["attempt"] == 0
    assert events[0]["process_started"] <= events[0]["clock_start"] <= events[0]["time"]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]
    assert {e["event"] for e in events[1:-1]} <= set(CATEGORIES) | {"step"}
    assert "zerojax effective training time (3 optimizer steps)" in stderr

    second, _, stderr = _run(tmp_path, report=False)
    assert second["cache_hits"] > 0
    assert "zerojax effective training time" not in stderr  # the report is opt-in


def test_ledger_counts_blocks_and_ignores_compiles_inside_them():
    ledger = EffectiveTimeLedger()
    ledger.begin(log_path=None, report_at_exit=False)
    with ledger.measure("checkpoint_restore"):
        ledger._on_jax_event("/jax/core/compile/backend_compile_duration", 5.0)
    assert ledger.seconds["trace_compile"] == 0.0
    assert ledger.seconds["checkpoint_restore"] > 0.0
    ledger._on_jax_event("/jax/core/compile/backend_compile_duration", 2.0)
    ledger._on_jax_event("/jax/some/other_event", 7.0)
    assert ledger.seconds["trace_compile"] == 2.0
    # A compile on another thread (a checkpoint's background snapshot) does not stop the loop.
    worker = threading.Thread(
        target=ledger._on_jax_event, args=("/jax/core/compile/backend_compile_duration", 3.0)
    )
    worker.start()
    worker.join()
    assert ledger.seconds["trace_compile"] == 2.0


def test_compile_listener_lives_as_long_as_an_engine():
    """Compile time is counted while an attached engine is alive, and JAX's listener is
    removed once the last one is collected (nothing left hooked into JAX)."""

    class Engine:  # any object that can be weakly referenced stands in for an engine
        pass

    ledger = EffectiveTimeLedger()
    ledger.begin(log_path=None, report_at_exit=False)
    engine = Engine()
    ledger.attach(engine)
    jax.jit(lambda x: x * 3.0 + 1.0).lower(jnp.ones(7)).compile()  # a program not cached yet
    counted = ledger.seconds["trace_compile"]
    assert counted > 0.0
    del engine
    gc.collect()
    jax.jit(lambda x: x * 5.0 - 2.0).lower(jnp.ones(9)).compile()
    assert ledger.seconds["trace_compile"] == counted
