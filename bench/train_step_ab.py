"""A/B of the train-step front-end changes, interleaved in one process (for a shared machine).

Each round runs one step of every contender with the *before* code paths patched in, then one
with the current code, then one PyTorch eager step, so load changes hit both sides alike; the
table gives medians and each side's ratio to eager. The "before" paths are the front end as it
was before issue 14's step work, kept here only to measure against:

- `copy`: every output leaf copied into torch (`to_torch`: host copy), instead of handed over
  zero-copy (`zerojax.parallel.placement.hand_over`);
- `rescale`: `loss.backward()`'s cotangent of 1 multiplied into the fused gradients in a
  separate pass (`scale_grads`) before they are added to the accumulator.

Run: .venv/bin/python bench/train_step_ab.py [--steps N] [--precision fp32|bf16] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp

from bench.train_step import PRECISIONS, WARMUP_STEPS, torch_step, zerojax_step
from zerojax.bridge.dtypes import to_torch
from zerojax.parallel import placement
from zerojax.train.engine import Engine
from zerojax.train.programs import add_grads, scale_grads


def _copy_every_output(leaves, kept):
    return [to_torch(x) for x in leaves]


def _accumulate_with_rescale(self, grads, weight=None):
    """Engine.accumulate as it was: the fused path's weight (1.0) always multiplied in."""
    if weight is None and self.loss_fn is not None:  # the fused path passed its cotangent
        weight = jnp.float32(1.0)
    frozen = self.frozen_names()
    if frozen:
        grads = {n: g for n, g in grads.items() if n not in frozen}
    if weight is not None:
        grads = scale_grads(grads, weight)
    current = self._state.grads
    self._state = self._state.replace(grads=grads if current is None else add_grads(current, grads))


BEFORE = {
    "copy": (placement, "hand_over", _copy_every_output),
    "rescale": (Engine, "accumulate", _accumulate_with_rescale),
}


@contextlib.contextmanager
def patched(names):
    saved = []
    for name in names:
        owner, attribute, replacement = BEFORE[name]
        saved.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--before",
        default="copy,rescale",
        help="comma-separated 'before' paths to patch in on the A side (default: all)",
    )
    options = parser.parse_args()
    before = [b for b in options.before.split(",") if b]
    jax.numpy.zeros(())
    print(f"load average at start: {os.getloadavg()}")
    precision = PRECISIONS[options.precision]
    contenders = {
        "fused": zerojax_step(options.quick, precision, fused=True),
        "general": zerojax_step(options.quick, precision, fused=False),
    }
    eager = torch_step(options.quick, options.precision, compiled=False)
    times: dict[str, list[float]] = {"eager": []}
    for name in contenders:
        times[f"{name} before"], times[f"{name} after"] = [], []

    cpu: dict[str, list[float]] = {key: [] for key in times}

    def timed(step, key=None, names=()):
        with patched(names):
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            if key is not None:
                times[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - start_cpu)

    for _ in range(WARMUP_STEPS):
        for step in contenders.values():
            timed(step, names=before)
            timed(step)
        timed(eager)
    for _ in range(options.steps):
        for name, step in contenders.items():
            timed(step, f"{name} before", before)
            timed(step, f"{name} after")
        timed(eager, "eager")
    eager_ms = statistics.median(times["eager"]) * 1e3
    print(f"load average at end: {os.getloadavg()}")
    print(
        f"\n{options.precision}, before = {before}, median of {options.steps} interleaved steps\n"
    )
    print(
        "| contender | step (ms) | ratio to eager | process CPU time per step (ms) |\n"
        "|---|---|---|---|"
    )
    for key, values in times.items():
        ms = statistics.median(values) * 1e3
        cpu_ms = statistics.median(cpu[key]) * 1e3
        print(f"| {key} | {ms:.1f} | {ms / eager_ms:.2f}x | {cpu_ms:.0f} |")


if __name__ == "__main__":
    main()
