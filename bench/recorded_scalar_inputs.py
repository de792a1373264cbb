"""A replayed optimizer step with its scalar inputs packed, against one program argument each.

A recorded program takes a step's scalar inputs (NAdam's bias correction per parameter,
Rprop's 0-d host tensors) packed into a few arguments (`zerojax.train.deferred`,
`_packed_scalars`): each jit argument is a conversion at every call. This times each
optimizer's step on the GPT-2 bench model (one CPU device) with the packing and with one
argument per scalar (`_packed_scalars` replaced by a stand-in that packs nothing), the two
alternated per round in one process, and reports per-round medians of packed / unpacked and
each against the compiled AdamW update.

Run: .venv/bin/python bench/recorded_scalar_inputs.py [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import numpy as np
import torch

import zerojax
from bench.optimizer_step import _backward, _bench_model, _zerojax_step
from tests.train.test_torch_optimizers import SignMomentum
from zerojax.train import deferred

OPTIMIZERS = {
    "AdamW (compiled)": lambda p: torch.optim.AdamW(p, lr=1e-4),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-4),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-4),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-4),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-4),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-4),
    "SignMomentum (user-defined)": lambda p: SignMomentum(p, lr=1e-4),
}
PACKED = deferred._packed_scalars


def one_argument_each(scalars: list):
    """`_packed_scalars` packing nothing: every scalar its own program argument."""
    return ((None,) * len(scalars), ()), (np.zeros(0, np.float32), (), list(scalars))


MODES = {"packed": PACKED, "one argument each": one_argument_each}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    steps = {}
    for name, make in OPTIMIZERS.items():
        module, tokens, targets = _bench_model()
        model, optimizer = zerojax.initialize(
            module, make(module.parameters()), {"mesh": {"data": 1}}
        )
        _backward(model, tokens, targets)
        steps[name] = _zerojax_step(optimizer.step, model)
    times = {(name, mode): [] for name in steps for mode in MODES}
    warm_up = 2  # each mode compiles its programs
    for round_ in range(args.rounds + warm_up):
        order = list(MODES) if round_ % 2 else list(reversed(MODES))
        for mode in order:
            deferred._packed_scalars = MODES[mode]
            try:
                for name, step in steps.items():
                    start = time.perf_counter()
                    step()
                    if round_ >= warm_up:
                        times[name, mode].append((time.perf_counter() - start) * 1e3)
            finally:
                deferred._packed_scalars = PACKED

    def median(values):
        return sorted(values)[len(values) // 2]

    reference = median(times["AdamW (compiled)", "packed"])
    print(
        f"GPT-2 bench model, one CPU device; medians of {args.rounds} rounds, the two modes "
        f"alternated per round; compiled AdamW {reference:.2f} ms"
    )
    for name in steps:
        packed, each = times[name, "packed"], times[name, "one argument each"]
        ratio = median([a / b for a, b in zip(packed, each, strict=True)])
        print(
            f"  {name:28s} packed {median(packed):6.2f} ms ({median(packed) / reference:.2f}x "
            f"AdamW)  one argument each {median(each):6.2f} ms  packed / each {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
