"""Host offload (issue 27): what fits a device with and without it, planned; and what the
transfers cost a step on this CPU, run.

    .venv/bin/python bench/offload.py                    # all three parts
    .venv/bin/python bench/offload.py --skip-fit         # parts 1 and 3 only (~5 min)

1. ZeRO-Offload's case, planned: a 13B GPT-2-style model (hidden 5120, 40 layers, 40 heads,
   vocabulary 50,257, sequence 512, batch 1, every block checkpointed), DeepSpeed config with
   bf16 (fp32 master weights, gradients and Adam moments), on ONE device: ZeRO-2 without
   offload, ZeRO-2 with `offload_optimizer: {device: cpu}` (ZeRO-Offload: DeepSpeed trains it
   on one 32 GB V100), and ZeRO-3 with `offload_param: {device: cpu}` too (ZeRO-Infinity's CPU
   tier). `zerojax plan --devices 1 --json` builds the model on the meta device and compiles
   the step, never runs it; each figure is the per-device step peak in device memory and in
   host memory (`MemoryReport.step_peak`, `host_step_peak`). Goal: <= 32 GB with optimizer
   offload, far above without; about one layer's working set plus activations with both.
2. The largest model of that shape (hidden 5120, layers varied) that fits a device budget
   (default 32 GB) and a host budget (default 256 GB per device) under each setting: each
   peak is planned at 2 and 4 layers and is linear in the layer count (every layer adds the
   same states and the same checkpointed input), so the largest layer count follows; it is
   then planned at that size to check.
3. The cost on this CPU, run: a small GPT-2 (hidden 256, 4 layers) trained with ZeRO-2 on 8
   simulated CPU devices under each offload setting (ZeRO-3 for parameter offload), interleaved, median step times. On a CPU
   host and device are one memory: transfers compile to nothing, so this measures only what
   offload changes in the programs (the update computing as a separate host computation, the
   gradients accumulated there), not PCIe. What a GPU pays is each step's gradients out and
   new params in (ZeRO-Offload: 2 bytes x Psi in each direction with bf16 params; parameter
   offload adds each parameter shard in, twice, forward and backward), at PCIe bandwidth,
   overlapped with compute where XLA's scheduler can.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BF16_MASTER = "params=bfloat16,compute=bfloat16,master=float32"
CHECKPOINT_BLOCKS = {
    "activation_checkpointing": {"modules": {r"model\.transformer\.h\.\d+": "full"}}
}
SETTINGS = {
    "no offload (ZeRO-2)": {"stage": 2},
    "offload_optimizer: cpu (ZeRO-2)": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "offload_optimizer + offload_param: cpu (ZeRO-3)": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    },
}


def gpt_13b():
    """The factory `zerojax plan` calls (under torch.device("meta")): GPT-2 at ZeRO-Offload's
    13B dims, returning its own loss. BENCH_LAYERS changes the depth."""
    from bench.memory import gpt2_with_loss

    layers = int(os.environ.get("BENCH_LAYERS", "40"))
    return gpt2_with_loss(hidden=5120, layers=layers, heads=40, sequence=512)


def plan(zero: dict, layers: int, workdir: Path) -> tuple[dict, float]:
    """`zerojax plan --devices 1 --json` for one setting: (report, seconds)."""
    path = workdir / "ds_config.json"
    config = {"zero_optimization": zero, "bf16": {"enabled": True}, "zerojax": CHECKPOINT_BLOCKS}
    path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(REPO), BENCH_LAYERS=str(layers))
    command = [sys.executable, "-m", "zerojax.cli", "plan", "--config", str(path)]
    command += [f"{Path(__file__).resolve()}:gpt_13b", "--devices", "1", "--json"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"zerojax plan failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout), seconds


def gb(value: float) -> float:
    return value / 1e9  # DeepSpeed's figures are decimal GB


def describe(name: str, report: dict, seconds: float) -> str:
    return (
        f"{name}: Ψ={report['num_params']:,}; states {gb(report['device_states']):.2f} GB on "
        f"the device, {gb(report['host_states']):.2f} GB on the host; step peak "
        f"{gb(report['step_peak']):.2f} GB device, {gb(report['host_step_peak'] or 0):.2f} GB "
        f"host (planned in {seconds:.0f} s)"
    )


def zero_offload_case(workdir: Path) -> None:
    print("1. 13B GPT-2-style model on one device (bf16, fp32 master/grads/moments):")
    peaks = {}
    for name, zero in SETTINGS.items():
        report, seconds = plan(zero, 40, workdir)
        peaks[name] = report["step_peak"]
        print("   " + describe(name, report, seconds), flush=True)
    none, optimizer, params = (gb(p) for p in peaks.values())
    print(
        f"   optimizer offload: {optimizer:.2f} GB <= 32 GB: {'met' if optimizer <= 32 else 'NOT met'}"
        f" (without offload {none:.2f} GB); with parameter offload {params:.2f} GB"
    )


def largest_fitting(workdir: Path, device_gb: float, host_gb: float) -> None:
    print(f"2. Largest hidden-5120 GPT-2 fitting {device_gb:g} GB device + {host_gb:g} GB host:")
    for name, zero in SETTINGS.items():
        small, large = (plan(zero, layers, workdir)[0] for layers in (2, 4))
        fits = []
        for key, budget in (("step_peak", device_gb), ("host_step_peak", host_gb)):
            per_layer = ((large[key] or 0) - (small[key] or 0)) / 2
            base = (small[key] or 0) - 2 * per_layer
            fits.append(math.inf if per_layer <= 0 else (budget * 1e9 - base) / per_layer)
        layers = int(min(fits))
        if layers < 1:
            print(f"   {name}: not even one layer fits")
            continue
        report, seconds = plan(zero, layers, workdir)
        binding = "device" if fits[0] <= fits[1] else "host"
        print(
            f"   {layers} layers ({binding} memory binds), planned: "
            + describe(name, report, seconds),
            flush=True,
        )


def step_cost(steps: int) -> None:
    """Part 3, in a child process with 8 simulated devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    command = [sys.executable, __file__, "--time-steps", str(steps)]
    subprocess.run(command, env=env, check=True)


def time_steps(steps: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import zerojax

    host = {"optimizer": "host", "master": "host"}
    offloads = {  # name -> (ZeRO stage, offload section)
        "ZeRO-2, no offload": (2, None),
        "ZeRO-2, optimizer + master": (2, host),
        "ZeRO-2, + grads (offload_optimizer: cpu)": (2, {**host, "grads": "host"}),
        "ZeRO-3, no offload": (3, None),
        "ZeRO-3, + grads + params (offload_param: cpu)": (
            3,
            {**host, "grads": "host", "params": "host"},
        ),
    }
    config = GPT2Config(
        n_embd=256,
        n_layer=4,
        n_head=4,
        n_positions=128,
        vocab_size=8192,
        bos_token_id=0,
        eos_token_id=0,
    )
    runs = {}
    for name, (stage, offload) in offloads.items():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        settings = {"mesh": {"data": 8}, "zero_stage": stage, "precision": BF16_MASTER}
        if offload:
            settings["offload"] = offload
        runs[name] = zerojax.initialize(model, optimizer, config=settings, seed=0)
    tokens = torch.randint(
        0, config.vocab_size, (16, 128), generator=torch.Generator().manual_seed(1)
    )
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(steps + 2):  # two warm-up steps (compilation)
        for name, (model, optimizer) in runs.items():
            start = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    baselines = {stage: statistics.median(times[f"ZeRO-{stage}, no offload"]) for stage in (2, 3)}
    print(
        "3. Step time on this CPU, GPT-2 hidden 256 x 4 layers, batch 16 x 128, on 8 simulated devices, bf16 + fp32 masters; ratios to the same stage without offload:"
    )
    for name, values in times.items():
        median, stage = statistics.median(values), offloads[name][0]
        baseline = baselines[stage]
        same = losses[name] == losses[f"ZeRO-{stage}, no offload"]
        print(
            f"   {name}: {median * 1e3:.1f} ms ({median / baseline:.2f}x); losses bitwise equal to the same stage without offload: {same}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-gb", type=float, default=32.0)
    parser.add_argument("--host-gb", type=float, default=256.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-fit", action="store_true", help="skip part 2")
    parser.add_argument("--time-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time_steps:
        time_steps(args.time_steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        zero_offload_case(Path(tmp))
        if not args.skip_fit:
            largest_fitting(Path(tmp), args.device_gb, args.host_gb)
    step_cost(args.steps)


if __name__ == "__main__":
    main()
