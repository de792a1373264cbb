"""Plan DeepSpeed's published low-precision memory figures with `zerojax plan` (issue 11).

    .venv/bin/python bench/memory.py                    # the two configurations below
    .venv/bin/python bench/memory.py --plot peak.png    # + peak vs sequence length, 512 to 64k

DeepSpeed reports, for a 6.86B-parameter transformer (hidden 4096, 32 layers, 32 heads, batch 1,
sequence 512) on 4 GPUs with ZeRO-3 and activation checkpointing, a peak of 31.38 GB per GPU
with bf16 compute and fp32 master weights, gradients and Adam moments, and 18.93 GB with
every model state in bf16 (`bf16_master_weights_and_grads`, `bf16_optimizer_states`). This
bench plans both on this machine: `zerojax plan --devices 4 --json` builds the model on the meta
device (no weights in memory) and compiles the training step for 4 simulated CPU devices from
shapes alone. The model is Hugging Face GPT-2 at that size (vocabulary 50,257, 6.65B
parameters: DeepSpeed does not publish its exact architecture), its loss computed inside
(`model(input_ids=x, labels=x).loss`), every block checkpointed. It prints both per-device
peaks beside DeepSpeed's and their ratio; goal: (b)/(a) <= 0.60 and (b) <= 18.93 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICES = 4
DEEPSPEED_GB = {"a": 31.38, "b": 18.93}

CONFIGS = {
    "a": {
        "what": "bf16 compute, fp32 master weights, gradients and Adam moments",
        "deepspeed": {"bf16": {"enabled": True}},
    },
    "b": {
        "what": "every model state bf16 (bf16_master_weights_and_grads, bf16_optimizer_states)",
        "deepspeed": {
            "bf16": {
                "enabled": True,
                "bf16_master_weights_and_grads": True,
                "bf16_optimizer_states": True,
            }
        },
    },
}


def gpt2_with_loss(*, hidden: int, layers: int, heads: int, sequence: int):
    """(module, example args) for `zerojax plan`: Hugging Face GPT-2 (vocabulary 50,257) at
    these dims, returning its own loss, batch 1 x `sequence` tokens."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=hidden, n_layer=layers, n_head=heads, n_positions=sequence, vocab_size=50257
    )

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = GPT2LMHeadModel(config).train()

        def forward(self, tokens):
            return self.model(input_ids=tokens, labels=tokens).loss

    return WithLoss(), (torch.randint(0, config.vocab_size, (1, sequence)),)


def gpt_6_86b():
    """The factory `zerojax plan` calls (under torch.device("meta")): GPT-2 with DeepSpeed's
    dims, returning its own loss. BENCH_SEQUENCE / BENCH_LAYERS change the size."""
    return gpt2_with_loss(
        hidden=4096,
        layers=int(os.environ.get("BENCH_LAYERS", "32")),
        heads=32,
        sequence=int(os.environ.get("BENCH_SEQUENCE", "512")),
    )


def plan(config: dict, workdir: Path, env: dict) -> tuple[dict, float]:
    """`zerojax plan --devices 4 --json` on one DeepSpeed config: (report, seconds)."""
    path = workdir / "ds_config.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "zerojax.cli", "plan", "--config", str(path)]
    command += [f"{Path(__file__).resolve()}:gpt_6_86b", "--devices", str(DEVICES), "--json"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"zerojax plan failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout), seconds


def deepspeed_config(states: dict, checkpointing: bool) -> dict:
    config = {"zero_optimization": {"stage": 3}, **states}
    if checkpointing:
        config["zerojax"] = {
            "activation_checkpointing": {"modules": {r"model\.transformer\.h\.\d+": "full"}}
        }
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--plot", metavar="FILE.png", help="also peak vs sequence length")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(REPO), BENCH_LAYERS=str(args.layers), BENCH_SEQUENCE="512")
    gb = lambda b: b / 1e9  # DeepSpeed's figures are decimal GB
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, case in CONFIGS.items():
            report, seconds = plan(deepspeed_config(case["deepspeed"], True), Path(tmp), env)
            peaks[key] = report["step_peak"]
            print(
                f"({key}) {case['what']}: Ψ={report['num_params']:,}, ZeRO-3 on {DEVICES} devices"
                f", checkpointing every block; per device: states {gb(report['states']):.2f} GB"
                f" + activations and scratch {gb(report['activations']):.2f} GB = peak "
                f"{gb(report['step_peak']):.2f} GB (DeepSpeed measured {DEEPSPEED_GB[key]} GB); "
                f"planned in {seconds:.0f} s",
                flush=True,
            )
        ratio = peaks["b"] / peaks["a"]
        deepspeed_ratio = DEEPSPEED_GB["b"] / DEEPSPEED_GB["a"]
        print(
            f"(b)/(a) = {ratio:.3f} (DeepSpeed {deepspeed_ratio:.3f}); goal <= 0.60 and (b) <= "
            f"18.93 GB: {'met' if ratio <= 0.60 and gb(peaks['b']) <= 18.93 else 'not met'}"
        )
        if args.plot:
            plot_sequence_sweep(Path(tmp), env, args.plot)


def plot_sequence_sweep(workdir: Path, env: dict, out: str) -> None:
    """Peak per device vs sequence length, ZeRO-3 with and without checkpointing (config a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [512, 2048, 8192, 32768, 65536]
    lines = {}
    for checkpointing in (False, True):
        label = "checkpointing every block" if checkpointing else "no checkpointing"
        for length in lengths:
            config = deepspeed_config(CONFIGS["a"]["deepspeed"], checkpointing)
            report, seconds = plan(config, workdir, {**env, "BENCH_SEQUENCE": str(length)})
            lines.setdefault(label, []).append(report["step_peak"] / 1e9)
            print(f"{label}, sequence {length}: peak {lines[label][-1]:.2f} GB ({seconds:.0f} s)")
    figure, axes = plt.subplots(figsize=(7, 4))
    for label, peaks in lines.items():
        axes.plot(lengths, peaks, marker="o", label=label)
    axes.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="peak GB per device")
    axes.set_title(f"GPT-2 6.65B, ZeRO-3 on {DEVICES} devices, bf16 compute + fp32 states")
    axes.legend()
    figure.savefig(out, dpi=120, bbox_inches="tight")
    print(f"plot written to {out}")


if __name__ == "__main__":
    main()
