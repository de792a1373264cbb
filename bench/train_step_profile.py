"""Where the fused forward+backward program's time goes, op by op (XLA:CPU thunks).

Traces a few runs of the GPT-2 bench model's `loss_and_grads` program with `jax.profiler`,
sums each HLO op's thunk time, and joins it with the op's FLOPs read from the optimized HLO
(dots inside fusions included), so a matmul's GFLOP/s inside the program can be compared with
the same matmul alone. Prints the time per op kind (`ynn_fusion`, `dot_general`, loop fusions
by name) and the slowest dots.

Thunk times are per op on whichever thread ran it; XLA runs independent thunks concurrently
(an Eigen dot beside a YNNPACK fusion), so a dot's time can include sharing the cores.

Run: .venv/bin/python bench/train_step_profile.py [--precision fp32|bf16] [--top N]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp

from bench.train_step_phases import wrapped
from zerojax.bridge.dtypes import from_torch

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(
    r"^\s*(?:ROOT )?%[\w.\-]+ = \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\)"
    r".*?lhs_contracting_dims=\{([\d,]*)\}"
)


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def dot_flops(hlo_text: str) -> dict[str, float]:
    """FLOPs of each entry-level op that is or contains a dot: 2 * output size * contraction."""
    shapes = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            shapes[match.group(1)] = _dims(match.group(3))
    computations = dict(re.findall(r"\n%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo_text, re.DOTALL))

    def flops_in(text: str) -> float:
        total = 0.0
        for line in text.splitlines():
            match = _DOT.match(line)
            if match:
                out, lhs, contracting = match.groups()
                k = math.prod(shapes[lhs][int(d)] for d in contracting.split(","))
                total += 2 * math.prod(_dims(out)) * k
        return total

    flops = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name = match.group(1)
        called = re.search(r"calls=%([\w.\-]+)", line)
        count = flops_in(computations.get(called.group(1), "")) if called else flops_in(line)
        if count:
            flops[name] = count
    return flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--top", type=int, default=25)
    options = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    model, _, tokens, targets = wrapped(options.precision, fused=True)
    engine = model.engine
    x, y = (engine.shard_input(from_torch(t)) for t in (tokens, targets))
    program = engine.programs.loss_and_grads(engine._converted[False], ())
    state, one, rng = engine.state, jnp.float32(1.0), engine.next_rng()

    def run():
        return jax.block_until_ready(program(state.params, state.buffers, (x, y), {}, rng, one))

    run()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(f"fused forward+backward: median {statistics.median(times) * 1e3:.1f} ms")

    runs = 3
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(runs):
                run()
        (trace_file,) = Path(trace_dir).rglob("*.trace.json.gz")
        with gzip.open(trace_file) as trace:
            events = json.load(trace)["traceEvents"]
    flops = dot_flops(program.last.as_text())
    per_op = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and not event["name"].startswith(("$", "ThunkExecutor")):
            per_op[event["name"]] += event["dur"] / runs / 1e3  # ms per run
    per_kind = collections.Counter()
    for name, ms in per_op.items():
        per_kind[re.sub(r"\.\d+$", "", name)] += ms
    print(f"\nthunk time per run: {sum(per_kind.values()):.1f} ms\n\n| op kind | ms |\n|---|---|")
    for kind, ms in per_kind.most_common(20):
        print(f"| {kind} | {ms:.2f} |")
    described = {}
    for line in program.last.as_text().splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            source = re.search(r'op_name="([^"]+)"', line)
            shape = f"{match.group(2)}[{match.group(3)}]"
            described[match.group(1)] = (shape, source.group(1) if source else "")
    dots = sorted(((per_op[n], n, f) for n, f in flops.items() if n in per_op), reverse=True)
    print("\n| dot op | output | from | ms | GFLOP | GFLOP/s |\n|---|---|---|---|---|---|")
    for ms, name, count in dots[: options.top]:
        shape, source = described[name]
        print(
            f"| {name} | {shape} | {source} | {ms:.2f} | {count / 1e9:.3f} | "
            f"{count / 1e9 / ms * 1e3:.0f} |"
        )
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
