"""Long-context benchmark: ZeRO-3 alone vs ZeRO-3 + sequence parallelism on 8 CPU devices.

The model is HF Llama (2 layers, width 128, 4 query heads, 2 key/value heads, SDPA attention)
whose own loss (`labels=`) is trained. Two measurements:

1. **Longest sequence per device budget.** For each layout, the longest sequence whose training
   step fits `--budget-mib` per device, read from `zerojax.memory_report(..., abstract=True)`:
   the model lives on the `meta` device and the step is compiled for the 8-device mesh, never
   run, so nothing of that size is allocated. Lengths are tried in ascending order
   (`CANDIDATE_LENGTHS`) until one does not fit. The layouts hold one sequence per
   data-parallel rank: ZeRO-3 `data: 8` (batch 8, a whole sequence per device) against
   ZeRO-3 + SP=4 `data: 2, sequence: 4` (batch 2, each sequence split over 4 devices), both
   with activation checkpointing of every decoder layer where named.
2. **Step time vs sequence length.** One real training step (forward, backward, AdamW) timed
   at the same global batch (8 sequences) for ZeRO-3 `data: 8` and ZeRO-3 + SP=4 (Ulysses,
   ring): every device then holds the same number of tokens, so the times compare the
   layouts' exchanges and attention work, not the amount of data. Median of --steps after
   one untimed step.

The 8 devices are simulated on this machine's CPU cores (`jax_num_cpu_devices`); they share
the cores, so times compare programs, not a network.

Run: .venv/bin/python bench/long_context.py [--quick] [--budget-mib N] [--plot out.png]
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

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")

import torch
import transformers
from torch import nn

import zerojax

VOCAB = 256
CANDIDATE_LENGTHS = tuple(1024 * k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
CHECKPOINT_LAYERS = {"activation_checkpointing": {"modules": {r"lm\.model\.layers\.\d+": "full"}}}
ZERO3 = {"mesh": {"data": 8}, "zero_stage": 3}


def sequence_parallel(attention: str) -> dict:
    return {
        "mesh": {"data": 2, "sequence": 4},
        "zero_stage": 3,
        "sequence_parallel": {"attention": attention},
    }


# name -> (config, sequences per step in the max-length search: one per data-parallel rank)
MAX_LENGTH_LAYOUTS = {
    "ZeRO-3": (ZERO3, 8),
    "ZeRO-3 + AC": ({**ZERO3, **CHECKPOINT_LAYERS}, 8),
    "ZeRO-3 + SP=4 Ulysses + AC": ({**sequence_parallel("ulysses"), **CHECKPOINT_LAYERS}, 2),
    "ZeRO-3 + SP=4 ring + AC": ({**sequence_parallel("ring"), **CHECKPOINT_LAYERS}, 2),
}
TIMED_LAYOUTS = {
    "ZeRO-3": ZERO3,
    "ZeRO-3 + SP=4 Ulysses": sequence_parallel("ulysses"),
    "ZeRO-3 + SP=4 ring": sequence_parallel("ring"),
}


class LlamaLoss(nn.Module):
    """HF Llama returning its own next-token loss, so the step is the model's."""

    def __init__(self, max_length: int):
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_length,
            attn_implementation="sdpa",
        )
        self.lm = transformers.LlamaForCausalLM(config)

    def forward(self, tokens):
        return self.lm(input_ids=tokens, labels=tokens).loss


def llama_4k():
    """`zerojax plan` factory: the bench's model on 2 sequences of 4,096 tokens, e.g.
    `zerojax plan --config examples/long_context.yaml bench/long_context.py:llama_4k
    --devices 8` (the README's "Long sequences" compares it with and without the split)."""
    return LlamaLoss(4096), (torch.zeros((2, 4096), dtype=torch.long),)


def step_peak_bytes(config: dict, batch: int, length: int) -> int:
    """Peak bytes per device of the training step, compiled for the mesh, never run."""
    with torch.device("meta"):
        model = LlamaLoss(length)
    tokens = torch.zeros((batch, length), dtype=torch.long, device="meta")
    config = {**config, "runtime": {"compilation_cache_dir": None}}
    report = zerojax.memory_report(model, (tokens,), config, abstract=True)
    return report.step_peak


def longest_fitting(config: dict, batch: int, budget: int, lengths) -> tuple[int | None, dict]:
    """(longest length whose step fits `budget` bytes per device, {length: peak bytes})."""
    peaks, best = {}, None
    for length in lengths:
        started = time.perf_counter()
        peaks[length] = step_peak_bytes(config, batch, length)
        fits = peaks[length] <= budget
        print(
            f"    sequence {length:6d}: peak {peaks[length] / 2**20:8.1f} MiB per device "
            f"({'fits' if fits else 'over'}; {time.perf_counter() - started:.0f} s to compile)",
            flush=True,
        )
        if not fits:
            break
        best = length
    return best, peaks


def time_step(config: dict, length: int, steps: int, batch: int = 8) -> tuple[float, float]:
    """(first loss, median seconds of one training step)."""
    torch.manual_seed(0)
    module = LlamaLoss(length)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    config = {**config, "runtime": {"compilation_cache_dir": None}}
    model, optimizer = zerojax.initialize(module, optimizer, config)
    tokens = torch.randint(0, VOCAB, (batch, length))
    times, first = [], None
    for step in range(steps + 1):
        started = time.perf_counter()
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        jax.block_until_ready(model.engine.state.params)
        if step == 0:
            first = loss.item()
        else:
            times.append(time.perf_counter() - started)
    return first, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=256.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="shorter lengths and sweeps")
    parser.add_argument("--plot", help="write the step-time and peak-memory plot here (png)")
    args = parser.parse_args()
    budget = int(args.budget_mib * 2**20)
    lengths = CANDIDATE_LENGTHS[:6] if args.quick else CANDIDATE_LENGTHS
    timed_lengths = (256, 512) if args.quick else (512, 1024, 2048)

    print(f"Longest sequence within {args.budget_mib:.0f} MiB per device (8 devices):")
    longest, peak_curves = {}, {}
    for name, (config, batch) in MAX_LENGTH_LAYOUTS.items():
        print(f"  {name} (batch {batch}):", flush=True)
        longest[name], peak_curves[name] = longest_fitting(config, batch, budget, lengths)
    baseline = longest["ZeRO-3"]
    print("\n| layout | longest sequence | vs ZeRO-3 |\n|---|---|---|")
    for name, length in longest.items():
        shown = "-" if length is None else f"{length:,}"
        ratio = "-" if length is None or not baseline else f"{length / baseline:.1f}x"
        capped = " (largest tried)" if length == lengths[-1] else ""
        print(f"| {name} | {shown}{capped} | {ratio} |")

    print(f"\nStep time vs sequence length (global batch 8, median of {args.steps}):")
    times: dict[str, list[float]] = {}
    print("| sequence | " + " | ".join(TIMED_LAYOUTS) + " |")
    print("|---" * (len(TIMED_LAYOUTS) + 1) + "|")
    for length in timed_lengths:
        row = []
        for name, config in TIMED_LAYOUTS.items():
            loss, seconds = time_step(config, length, args.steps)
            times.setdefault(name, []).append(seconds)
            row.append(f"{seconds * 1e3:.0f} ms (loss {loss:.5f})")
        print(f"| {length} | " + " | ".join(row) + " |", flush=True)

    if args.plot:
        plot(args.plot, peak_curves, budget, timed_lengths, times)


def plot(out: str, peak_curves: dict, budget: int, timed_lengths, times: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, peaks in peak_curves.items():
        memory.plot(list(peaks), [p / 2**20 for p in peaks.values()], marker="o", label=name)
    memory.axhline(budget / 2**20, color="grey", linestyle="--", label="budget")
    memory.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="step peak MiB per device",
        title="Peak memory per device (compiled, not run)",
    )
    memory.legend(fontsize=8)
    for name, seconds in times.items():
        speed.plot(timed_lengths, [s * 1e3 for s in seconds], marker="o", label=name)
    speed.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="step ms (global batch 8)",
        title="Training step time, 8 simulated CPU devices",
    )
    speed.legend(fontsize=8)
    figure.savefig(out, dpi=120, bbox_inches="tight")
    print(f"plot written to {out}")


if __name__ == "__main__":
    main()
