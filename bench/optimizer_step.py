"""Optimizer step time: every torch.optim optimizer against zerojax's compiled AdamW update.

After one backward of the GPT-2 bench model (bench/architectures.gpt2_bench_model, one CPU
device), times `optimizer.step()` interleaved, --repeats rounds, and reports each contender's
median and its per-round ratio to the compiled AdamW update (issue 42's target: every
optimizer within 1.2x of it):

- AdamW handed to `zerojax.initialize`: the engine's compiled update (zerojax.train.optimizers);
- every other torch.optim optimizer, a user-defined one and Muon (for the matrices, beside
  AdamW for the rest, as torch's docs advise): torch's own `step()`, captured by torch.compile
  on a twin and recorded as one op on the live tensors (zerojax.train.captured_step);
- AdamW built *after* initialize on the model's parameters (minGPT's trainer, the HF Trainer):
  adopted at its first step as the engine's compiled update (zerojax.train.late_optimizers);
  and a subclass of AdamW built after initialize, which is not: torch's step on live tensors,
  one recorded op (zerojax.train.recorded_adam);
- a hand-written update loop, `p.data.add_(p.grad, alpha=-lr)` (pytorch/examples' style),
  against `torch.optim.SGD` handed to initialize: the update alone
  (`bench/manual_update_loop.py` times such a loop's whole training step against SGD's);
- plain torch's AdamW, RMSprop, Adafactor and Muon + AdamW on a twin, for scale, timed in a
  second interleaved pass with the compiled AdamW update as their reference: torch's CPU
  ops leave its OpenMP threads spinning for a while after they return, and a zerojax step
  right after one ran 1.25x as long as alone (NAdam after torch's Adafactor, 6.2 vs 5.0 ms;
  5.2 vs 4.8 ms with OMP_WAIT_POLICY=PASSIVE), which in one pass penalized whichever zerojax
  contenders followed a torch one (Adafactor 1.77x and NAdam 1.66x the compiled AdamW in
  one pass, 1.24x and 1.08x without the torch twins);
- RMSprop, NAdam, Rprop, ASGD, SignMomentum and the AdamW subclass built after initialize
  not captured (zerojax.train.captured_step switched off around them): their Python run and
  replayed (zerojax.train.replay), as before; what the capture saves. And the hand-written
  loop recorded at every step, not replayed (the replay switched off): what the replay saves.

A zerojax timing ends when the updated parameters are ready (`engine.state` runs what was
recorded; `jax.block_until_ready` waits for it). Gradients stay in place between steps (no
zero_grad), so every step updates every parameter.

Run: .venv/bin/python bench/optimizer_step.py [--repeats N] [--skip-muon] [--skip-torch]
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
from tests.train.test_torch_optimizers import SignMomentum
from zerojax.train import captured_step, live_tensor

# name -> (make(parameters) -> optimizer or list of them, also time plain torch)
OPTIMIZERS = {
    "AdamW (compiled)": (lambda p: torch.optim.AdamW(p, lr=1e-4), True),
    "RMSprop": (lambda p: torch.optim.RMSprop(p, lr=1e-5), True),
    "Adafactor": (lambda p: torch.optim.Adafactor(p, lr=1e-4), True),
    "NAdam": (lambda p: torch.optim.NAdam(p, lr=1e-4), False),
    "RAdam": (lambda p: torch.optim.RAdam(p, lr=1e-4), False),
    "Adagrad": (lambda p: torch.optim.Adagrad(p, lr=1e-4), False),
    "Adamax": (lambda p: torch.optim.Adamax(p, lr=1e-4), False),
    "Adadelta": (lambda p: torch.optim.Adadelta(p, lr=1e-4), False),
    "ASGD": (lambda p: torch.optim.ASGD(p, lr=1e-4), False),
    "Rprop": (lambda p: torch.optim.Rprop(p, lr=1e-4), False),
    "SignMomentum (user-defined)": (lambda p: SignMomentum(p, lr=1e-4), False),
    "SGD (compiled)": (lambda p: torch.optim.SGD(p, lr=1e-4), False),
}
REFERENCE = "zerojax AdamW (compiled)"
# Also timed not captured (replayed, as before the capture).
CAPTURE_COMPARED = (
    "RMSprop",
    "NAdam",
    "Rprop",
    "ASGD",
    "SignMomentum (user-defined)",
    "AdamW subclass built after initialize",
)


class OwnAdamW(torch.optim.AdamW):
    """A user's own AdamW class: not adopted into the compiled update (torch's classes are)."""


def _bench_model():
    torch.manual_seed(0)
    module, (tokens,) = gpt2_bench_model()
    module.eval()
    return module, tokens, torch.roll(tokens, -1, dims=1)


def _backward(model, tokens, targets) -> None:
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()


def _zerojax_step(step, model):
    def run():
        step()
        jax.block_until_ready(model.engine.params)

    return run


def _add_muon(contenders: dict, torch_contenders: dict | None) -> None:
    """Muon for the matrices beside AdamW for the rest (torch's docs): both handed over."""
    module, tokens, targets = _bench_model()
    matrices = [p for p in module.parameters() if p.ndim == 2]
    rest = [p for p in module.parameters() if p.ndim != 2]
    model, (muon, adamw) = zerojax.initialize(
        module,
        [torch.optim.Muon(matrices, lr=1e-4), torch.optim.AdamW(rest, lr=1e-4)],
        {"mesh": {"data": 1}},
    )
    _backward(model, tokens, targets)
    contenders["zerojax Muon + AdamW"] = _zerojax_step(lambda: (muon.step(), adamw.step()), model)
    if torch_contenders is None:
        return
    # Muon's Newton-Schulz matmuls (bfloat16) are most of its step, in torch as here: its
    # scale is torch's own Muon step, not the element-wise AdamW update.
    twin, _, _ = _bench_model()
    twin_muon = torch.optim.Muon([p for p in twin.parameters() if p.ndim == 2], lr=1e-4)
    twin_adamw = torch.optim.AdamW([p for p in twin.parameters() if p.ndim != 2], lr=1e-4)
    _backward(twin, tokens, targets)
    torch_contenders["torch Muon + AdamW"] = lambda: (twin_muon.step(), twin_adamw.step())


def _not_captured(step):
    def run():
        with captured_step.disabled():
            step()

    return run


def _not_replayed(step):
    def run():
        hook, live_tensor.dispatch_hook[0] = live_tensor.dispatch_hook[0], None
        try:
            step()
        finally:
            live_tensor.dispatch_hook[0] = hook

    return run


def _print_against_reference(times: dict) -> None:
    for name, samples in times.items():
        median = sorted(samples)[len(samples) // 2]
        ratio, low, high = paired_ratio(times, name, REFERENCE)
        print(f"  {name:44s} {median:8.1f} ms  {ratio:5.2f}x  [{low:.2f}-{high:.2f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--skip-muon", action="store_true", help="no Muon + AdamW (its ~100 ms step dominates)"
    )
    parser.add_argument("--skip-torch", action="store_true", help="no plain-torch twins")
    args = parser.parse_args()
    contenders, torch_contenders = {}, {}
    for name, (make, with_torch) in OPTIMIZERS.items():
        module, tokens, targets = _bench_model()
        twin = copy.deepcopy(module)
        model, optimizer = zerojax.initialize(
            module, make(module.parameters()), {"mesh": {"data": 1}}
        )
        _backward(model, tokens, targets)
        contenders[f"zerojax {name}"] = _zerojax_step(optimizer.step, model)
        if with_torch and not args.skip_torch:
            twin_optimizer = make(twin.parameters())
            _backward(twin, tokens, targets)
            torch_contenders[f"torch {name.split(' ')[0]}"] = twin_optimizer.step

    if not args.skip_muon:
        _add_muon(contenders, None if args.skip_torch else torch_contenders)

    # AdamW built after initialize on the model's parameters (minGPT, the HF Trainer).
    module, tokens, targets = _bench_model()
    model, _ = zerojax.initialize(module, None, {"mesh": {"data": 1}})
    late = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _backward(model, tokens, targets)
    contenders["zerojax AdamW built after initialize"] = _zerojax_step(late.step, model)
    module, tokens, targets = _bench_model()
    model, _ = zerojax.initialize(module, None, {"mesh": {"data": 1}})
    late = OwnAdamW(model.parameters(), lr=1e-4)
    _backward(model, tokens, targets)
    contenders["zerojax AdamW subclass built after initialize"] = _zerojax_step(late.step, model)

    # A hand-written update loop (pytorch/examples' word_language_model).
    module, tokens, targets = _bench_model()
    model, _ = zerojax.initialize(module, None, {"mesh": {"data": 1}})
    _backward(model, tokens, targets)

    @torch.no_grad()
    def by_hand(model=model):
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-1e-4)

    contenders["zerojax hand-written p.data.add_ loop"] = _zerojax_step(by_hand, model)

    # The loop recorded every time, not replayed (zerojax.train.replay switched off around
    # it): what the replay saves; optimizers not captured: what the capture saves.
    contenders["zerojax hand-written loop, not replayed"] = _not_replayed(
        contenders["zerojax hand-written p.data.add_ loop"]
    )
    for name in CAPTURE_COMPARED:
        contenders[f"zerojax {name}, not captured"] = _not_captured(contenders[f"zerojax {name}"])

    times = interleaved_times_ms(contenders, args.repeats, rotate=True)  # warm-up: compile
    print(
        f"GPT-2 bench model (52 parameters, 3.49M elements), one CPU device; median of "
        f"{args.repeats} interleaved rounds; ratio = per-round median against {REFERENCE}"
    )
    _print_against_reference(times)
    ratio, low, high = paired_ratio(
        times, "zerojax hand-written p.data.add_ loop", "zerojax SGD (compiled)"
    )
    print(f"  hand-written loop / SGD (compiled): {ratio:.2f}x [{low:.2f}-{high:.2f}]")
    pairs = [("zerojax hand-written p.data.add_ loop", "zerojax hand-written loop, not replayed")]
    pairs += [(f"zerojax {n}", f"zerojax {n}, not captured") for n in CAPTURE_COMPARED]
    for name, other in pairs:
        ratio, low, high = paired_ratio(times, name, other)
        print(f"  {name} / {other.split(', ')[-1]}: {ratio:.2f}x [{low:.2f}-{high:.2f}]")
    if torch_contenders:
        print("plain torch on twins, in a pass of their own with the same reference:")
        torch_contenders = {REFERENCE: contenders[REFERENCE], **torch_contenders}
        _print_against_reference(interleaved_times_ms(torch_contenders, args.repeats, rotate=True))


if __name__ == "__main__":
    main()
