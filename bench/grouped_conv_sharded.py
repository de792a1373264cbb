"""Grouped convolutions under a split batch: per batch shard vs XLA's partitioning of them.

XLA's SPMD partitioner gathers the batch-split input of a convolution whose groups hold more
than one channel each (ResNeXt's 32 groups, RegNet's group widths) onto every device and
convolves the whole batch there; zerojax runs such a convolution per batch shard under
`shard_map` (zerojax/bridge/lowerings/conv.py, `_split_over_batch`). On 8 simulated CPU
devices, ZeRO-3, fp32, AdamW, batch 16 of 64x64: a training step of torchvision's
`regnet_y_400mf` and `resnext50_32x4d` (forward, cross-entropy, backward, step), with the
per-shard lowering and with XLA's partitioning patched back in, interleaved; and how many of
each forward program's convolutions compute the whole batch.

Run: .venv/bin/python bench/grouped_conv_sharded.py [--repeats N] [--nets a,b]
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEVICES = 8
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"

import jax
import torch
import torch.nn.functional as F

import zerojax
from tools.model_zoo import import_torchvision
from zerojax.bridge.lowerings import conv

BATCH, IMAGE, CLASSES = 2 * DEVICES, 64, 10
CONFIG = {
    "mesh": {"fsdp": DEVICES},
    "zero": {"stage": 3, "max_replicated_fraction": 1.0},  # 10 classes: 8 splits no dim
    "runtime": {"compilation_cache_dir": None, "report_effective_time": False},
}
_per_shard = conv._split_over_batch


def _partitioned_by_xla(ctx, input, weight, bias, *conv_args):
    return conv.convolution(input, weight, bias, *conv_args)


def step_of(net: torch.nn.Module, x, y, per_shard: bool):
    """(step() -> loss, whole-batch convolutions in the forward program, all of them); the
    lowering is chosen while the first step traces it."""
    conv._split_over_batch = _per_shard if per_shard else _partitioned_by_xla
    model, optimizer = zerojax.initialize(
        net, torch.optim.AdamW(net.parameters(), lr=1e-3), config=CONFIG
    )

    def step():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        jax.block_until_ready(model.engine.params)
        return float(loss.detach())

    losses = [step(), step()]
    conv._split_over_batch = _per_shard
    forward = model.engine.compiled_programs()["forward_vjp"].as_text()
    rows = [int(r) for r in re.findall(r"= f32\[(\d+),[\d,]*\]\{[\d,]*\} convolution\(", forward)]
    return step, losses, sum(r == BATCH for r in rows), len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nets", default="regnet_y_400mf,resnext50_32x4d")
    options = parser.parse_args()
    tv = import_torchvision()
    print(f"{DEVICES} simulated CPU devices, ZeRO-3, batch {BATCH}x3x{IMAGE}x{IMAGE}, fp32")
    print(f"load average at start: {os.getloadavg()}")
    print("| net | contender | step (ms) | first two losses | whole-batch convolutions |")
    print("|---|---|---|---|---|")
    for name in options.nets.split(","):
        torch.manual_seed(0)
        base = tv.models.get_model(name, weights=None, num_classes=CLASSES)
        x, y = torch.randn(BATCH, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (BATCH,))
        contenders = {
            "XLA's partitioning": step_of(copy.deepcopy(base), x, y, per_shard=False),
            "per batch shard": step_of(copy.deepcopy(base), x, y, per_shard=True),
        }
        times: dict[str, list[float]] = {what: [] for what in contenders}
        for round_ in range(options.repeats):
            order = list(contenders) if round_ % 2 else list(reversed(contenders))
            for what in order:
                start = time.perf_counter()
                contenders[what][0]()
                times[what].append(time.perf_counter() - start)
        for what, (_, losses, whole, total) in contenders.items():
            median = 1000 * statistics.median(times[what])
            shown = ", ".join(f"{loss:.6f}" for loss in losses)
            print(f"| {name} | {what} | {median:.1f} | {shown} | {whole} of {total} |")


if __name__ == "__main__":
    main()
