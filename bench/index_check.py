"""What the out-of-range index check costs the GPT-2 bench train step (issue 41: at most 2%).

The check (`zerojax.bridge.index_bounds`, config `train.check_index_bounds`) adds, per indexed
op, a min and a max over the index array to the step's program and one small int32 output,
read on the host when the loss is handed to torch. This times the bench step of
`bench/train_step.py` (GPT-2 4 layers, width 256, vocabulary 1024, batch 8 x 256, AdamW, one CPU
device) with the check on and off, fused and general paths, in one process: each round runs one
step of every contender, the order rotated per round, and the cost is the median of the
per-round ratios on/off (load that drifts over the run divides out), with its quartiles, of the
wall time and of the process's CPU time.

Run: .venv/bin/python bench/index_check.py [--rounds N] [--precision fp32|bf16] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import torch

from bench.timing import paired_ratio
from bench.train_step import PRECISIONS, WARMUP_STEPS, zerojax_step


def step_fn(quick: bool, precision: str, fused: bool, check: bool):
    """One training step of the bench model, the index check on or off; and its engine."""
    step = zerojax_step(quick, precision, fused, train={"check_index_bounds": check})
    return step, step.engine


def _instruction_counts(hlo: str) -> dict[str, int]:
    """Instructions of an optimized HLO module: all, and its reductions and all-reduces."""
    lines = [
        line for line in hlo.splitlines() if " = " in line and not line.startswith("HloModule")
    ]
    return {
        "all": len(lines),
        "reduce": sum(" reduce(" in line for line in lines),
        "all-reduce": sum(" all-reduce(" in line for line in lines),
    }


def interleaved_wall_and_cpu_ms(contenders: dict, rounds: int, warmup: int) -> tuple[dict, dict]:
    """(wall, process CPU) milliseconds of each round's call of each contender, the order
    rotated per round (`bench.timing.interleaved_times_ms`, plus CPU time: on a host shared
    with other jobs the process's own CPU time moves less with their load than its wall)."""
    for run in contenders.values():
        for _ in range(warmup):
            run()
    names = list(contenders)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        first = round_ % len(names)
        for name in names[first:] + names[:first]:
            start, start_cpu = time.perf_counter(), time.process_time()
            contenders[name]()
            wall[name].append((time.perf_counter() - start) * 1e3)
            cpu[name].append((time.process_time() - start_cpu) * 1e3)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument("--quick", action="store_true", help="a tiny model, to try the script")
    parser.add_argument("--paths", default="fused,general", help="fused, general or both")
    args = parser.parse_args()
    torch.set_num_threads(2)
    precision = PRECISIONS[args.precision]
    paths = args.paths.split(",")
    contenders, engines = {}, {}
    for path in paths:
        for check in (True, False):
            name = f"{path} check {'on' if check else 'off'}"
            contenders[name], engines[name] = step_fn(args.quick, precision, path == "fused", check)
    wall, cpu = interleaved_wall_and_cpu_ms(contenders, args.rounds, WARMUP_STEPS)
    print(f"GPT-2 bench step, {args.precision}, {args.rounds} rounds (rotated order)")
    print(f"{'contender':<22} {'wall median':>12} {'wall min':>9} {'CPU median':>11}  (ms)")
    for name in contenders:
        print(
            f"{name:<22} {statistics.median(wall[name]):>12.1f} {min(wall[name]):>9.1f} "
            f"{statistics.median(cpu[name]):>11.1f}"
        )
    for name, engine in engines.items():
        # What the check adds to the compiled programs, free of timing noise.
        counts = {
            program: _instruction_counts(compiled.as_text())
            for program, compiled in engine.compiled_programs().items()
            if program != "update"
        }
        print(f"{name}: HLO instructions {counts}")
    for path in paths:
        for what, times in (("wall", wall), ("CPU", cpu)):
            median, low, high = paired_ratio(times, f"{path} check on", f"{path} check off")
            print(
                f"{path} {what}: per-round ratio on/off median {median:.4f} "
                f"(quartiles {low:.4f} .. {high:.4f})"
            )


if __name__ == "__main__":
    main()
