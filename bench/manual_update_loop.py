"""A training loop that updates by hand against the same loop with torch.optim.SGD.

pytorch/examples' word_language_model trains without an optimizer: after `loss.backward()`
and `clip_grad_norm_`, `for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)`. Issue
42's target: such a loop steps in at most 1.1x the same loop with `torch.optim.SGD`. This
times that loop's whole step on the GPT-2 bench model (bench/architectures.gpt2_bench_model,
one CPU device) -- `zero_grad`, forward, cross-entropy, backward, `clip_grad_norm_(...,
0.25)` (without it under --no-clip), the update, `loss.item()` as the script logs it --
with zerojax (SGD handed to `initialize`: the engine's compiled update; the hand-written
loop: recorded and replayed, `zerojax.train.replay`) and with plain torch, interleaved over
--repeats rounds. A round times --steps steps and then waits for the updated parameters
(zerojax runs the hand-written update with the next forward, or when the state is read).
`bench/optimizer_step.py` times the update alone.

Run: .venv/bin/python bench/manual_update_loop.py [--repeats N] [--steps K] [--no-clip]
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
from bench.timing import interleaved_times_ms, paired_ratio

LR = 1e-4


def _loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _loop(model, tokens, targets, steps: int, clip: bool, update, zero_grad, wait):
    def run():
        for _ in range(steps):
            zero_grad()
            loss = _loss(model, tokens, targets)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            update()
            loss.item()
        wait()

    return run


def _by_hand(model):
    @torch.no_grad()
    def update():
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)

    return update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--no-clip", action="store_true", help="no clip_grad_norm_")
    args = parser.parse_args()
    clip = not args.no_clip
    torch.manual_seed(0)
    module, (tokens,) = gpt2_bench_model()
    module.eval()
    targets = torch.roll(tokens, -1, dims=1)
    torch_sgd_model, torch_hand_model = copy.deepcopy(module), copy.deepcopy(module)

    def zerojax_wait(model):
        return lambda: jax.block_until_ready(model.engine.state.params)

    contenders = {}
    sgd_module = copy.deepcopy(module)
    model, optimizer = zerojax.initialize(
        sgd_module, torch.optim.SGD(sgd_module.parameters(), lr=LR), {"mesh": {"data": 1}}
    )
    contenders["zerojax SGD (compiled)"] = _loop(
        model, tokens, targets, args.steps, clip, optimizer.step, optimizer.zero_grad,
        zerojax_wait(model),
    )  # fmt: skip
    hand, _ = zerojax.initialize(copy.deepcopy(module), None, {"mesh": {"data": 1}})
    contenders["zerojax p.data.add_ loop"] = _loop(
        hand, tokens, targets, args.steps, clip, _by_hand(hand), hand.zero_grad, zerojax_wait(hand)
    )
    torch_sgd = torch.optim.SGD(torch_sgd_model.parameters(), lr=LR)
    contenders["torch SGD"] = _loop(
        torch_sgd_model, tokens, targets, args.steps, clip, torch_sgd.step,
        torch_sgd.zero_grad, lambda: None,
    )  # fmt: skip
    contenders["torch p.data.add_ loop"] = _loop(
        torch_hand_model, tokens, targets, args.steps, clip, _by_hand(torch_hand_model),
        torch_hand_model.zero_grad, lambda: None,
    )  # fmt: skip

    times = interleaved_times_ms(contenders, args.repeats, rotate=True)  # warm-up: compile
    print(
        f"GPT-2 bench model (52 parameters, 3.49M elements), one CPU device; {args.steps} "
        f"training steps a round ({'with' if clip else 'without'} clip_grad_norm_), median "
        f"of {args.repeats} interleaved rounds, per step"
    )
    for name, samples in times.items():
        print(f"  {name:28s} {sorted(samples)[len(samples) // 2] / args.steps:8.2f} ms")
    for system in ("zerojax", "torch"):
        ratio, low, high = paired_ratio(
            times,
            f"{system} p.data.add_ loop",
            "zerojax SGD (compiled)" if system == "zerojax" else "torch SGD",
        )
        print(f"  {system} p.data.add_ loop / its SGD: {ratio:.3f}x [{low:.3f}-{high:.3f}]")
    ratio, low, high = paired_ratio(times, "zerojax p.data.add_ loop", "torch p.data.add_ loop")
    print(f"  zerojax p.data.add_ loop / torch's: {ratio:.3f}x [{low:.3f}-{high:.3f}]")


if __name__ == "__main__":
    main()
