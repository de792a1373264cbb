"""Optimizer step time: torch's own step on live tensors vs zerojax's compiled update.

After one backward of the GPT-2 bench model (bench/architectures.gpt2_bench_model, one CPU
device), times `optimizer.step()` interleaved, --repeats times each, median:

- AdamW, compiled (zerojax.train.optimizers: one jitted program over the TrainState);
- RMSprop and Adafactor, torch's own `step()` on live tensors (an op at a time, each a jitted
  JAX call on the engine's arrays: zerojax.train.optimizer_shim);
- the same three in plain torch on a twin, for scale.

A zerojax timing ends when the updated parameters are ready (`jax.block_until_ready`). The
gradients stay in place between steps (no zero_grad), so every step updates every parameter.

Run: .venv/bin/python bench/optimizer_step.py [--repeats N]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import gpt2_bench_model
from bench.timing import interleaved_medians_ms

OPTIMIZERS = {
    "AdamW (compiled)": lambda p: torch.optim.AdamW(p, lr=1e-4),
    "RMSprop (own step, live)": lambda p: torch.optim.RMSprop(p, lr=1e-5),
    "Adafactor (own step, live)": lambda p: torch.optim.Adafactor(p, lr=1e-4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    contenders = {}
    for name, make in OPTIMIZERS.items():
        torch.manual_seed(0)
        module, (tokens,) = gpt2_bench_model()
        module.eval()
        twin = copy.deepcopy(module)
        targets = torch.roll(tokens, -1, dims=1)
        model, optimizer = zerojax.initialize(
            module, make(module.parameters()), {"mesh": {"data": 1}}
        )
        twin_optimizer = make(twin.parameters())
        for m in (model, twin):
            F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten()).backward()

        def zerojax_step(optimizer=optimizer, model=model):
            optimizer.step()
            jax.block_until_ready(model.engine.state.params)

        contenders[f"zerojax {name}"] = zerojax_step
        contenders[f"torch {name.split(' ')[0]}"] = twin_optimizer.step
    medians = interleaved_medians_ms(contenders, args.repeats)  # warm-up: compile, state
    print(
        f"GPT-2 bench model (52 parameters, 3.49M elements), one CPU device; median of "
        f"{args.repeats}"
    )
    for name, ms in medians.items():
        print(f"  {name:40s} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
