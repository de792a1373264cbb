"""Python's cyclic GC is off while programs are captured, traced and lowered, and back after.

Run: .venv/bin/python -m pytest -q tests/runtime/test_gc_pause.py -p no:cacheprovider
Why: full collections inside a restart's first step walked the whole process three times
(2.8-3.5 s of it for the bench GPT-2, zerojax/runtime/gc_pause.py) and freed next to nothing.
The pause must cover torch.export's capture and each program's trace, and must always end:
a collector left off would let cyclic garbage grow for the rest of the job.
"""

from __future__ import annotations

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import torch

import zerojax
from zerojax.runtime.gc_pause import collection_paused
from zerojax.train.programs import Program


def test_the_collector_is_off_inside_and_on_after():
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_it_comes_back_after_an_exception():
    try:
        with collection_paused():
            raise KeyError("inside")
    except KeyError:
        pass
    assert gc.isenabled()


def test_nested_and_concurrent_blocks_end_with_the_last():
    entered, release = threading.Event(), threading.Event()

    def other_thread():
        with collection_paused():
            entered.set()
            release.wait(timeout=30)

    worker = threading.Thread(target=other_thread)
    with collection_paused():
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block is still running
        worker.start()
        assert entered.wait(timeout=30)
    # This thread's block ended, the worker's has not.
    assert not gc.isenabled()
    release.set()
    worker.join(timeout=30)
    assert gc.isenabled()


def test_a_collector_the_process_turned_off_stays_off():
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_program_is_traced_with_the_collector_off():
    seen = []

    def double(x):
        seen.append(gc.isenabled())  # runs once, while jax traces it
        return x * 2

    program = Program("double", double)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(8, dtype=np.float32))
    out = program(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)  # x2 is exact
    assert seen == [False]
    assert gc.isenabled()
    program(x + 1)  # same signature: no trace, and the collector stays on
    assert seen == [False] and gc.isenabled()


class _Recording(torch.nn.Module):
    """A linear layer whose forward notes whether the collector is on when it runs (during
    torch.export's capture: a zerojax model's own forward is the engine's program)."""

    def __init__(self, seen: list):
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)
        self.seen = seen

    def forward(self, x):
        self.seen.append(gc.isenabled())
        return self.linear(x)


def test_capture_runs_with_the_collector_off():
    torch.manual_seed(0)
    seen: list = []
    model = _Recording(seen)
    x = torch.randn(8, 16)
    expected = model(x).detach()
    seen.clear()
    model, _ = zerojax.initialize(model, config={"mesh": {"data": len(jax.devices())}})
    out = model(x)
    assert seen and not any(seen), seen  # torch.export ran the forward, never with GC on
    assert gc.isenabled()
    # The pause changes no number: the same float32 matmul as torch's, up to summation order
    # (16 terms of |x*w| <= ~1: a few ulps of 1).
    torch.testing.assert_close(out.detach(), expected, rtol=1e-6, atol=1e-6)
