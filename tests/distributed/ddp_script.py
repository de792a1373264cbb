"""One small training run, under torchrun, by torch DDP (gloo) or by zerojax: the same model,
data, optimizer and loop, so the two can be compared rank by rank.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/ddp_script.py \
        --engine zerojax --mesh fsdp=-1 --zero-stage 3 --out DIR

Each rank writes DIR/<engine>_rank<r>.npz: its per-step losses, the clip_grad_norm_ result per
step, the final parameters (gathered), and the sample indices its sampler gave it. Run by
tests/distributed/test_ddp_parity.py (not a test module itself).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tests.distributed.leave_together import leave_together

NUM_CLASSES = 10
IN_FEATURES = 16


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN_FEATURES, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.fc2 = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(F.gelu(self.norm(self.fc1(x))))))


def zerojax_config(args: argparse.Namespace) -> dict:
    """The config a script's --mesh ("data=2,fsdp=4"), --zero-stage and --devices-per-process
    describe: simulated CPU devices per process, no compile cache (each run starts cold)."""
    mesh = {k: int(v) for k, v in (item.split("=") for item in args.mesh.split(","))}
    return {
        "devices": {"platform": "cpu", "num_cpu_devices": args.devices_per_process},
        "mesh": mesh,
        "zero_stage": args.zero_stage,
        "runtime": {"compilation_cache_dir": None},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("torch", "zerojax"), required=True)
    parser.add_argument("--mesh", default="fsdp=-1", help="axis=size,... (zerojax only)")
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--local-batch", type=int, default=8)
    parser.add_argument("--max-norm", type=float, default=0.5)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def dataset(num_samples: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(num_samples, IN_FEATURES, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def main() -> None:
    args = parse_args()
    world_size = int(os.environ["WORLD_SIZE"])
    data = dataset(args.steps * args.local_batch * world_size)
    torch.manual_seed(0)  # the same initial model on every rank (DDP would broadcast rank 0's)
    model = MLP()
    # SGD with momentum: its update is proportional to the gradient, so a gradient averaged
    # wrongly (summed over ranks, say) shows in the parameters; Adam would normalise it away.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)

    if args.engine == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        sampler = torch.utils.data.DistributedSampler(
            data, num_replicas=world_size, rank=dist.get_rank(), shuffle=True, seed=7
        )
        model = torch.nn.parallel.DistributedDataParallel(model)
        rank = dist.get_rank()
    else:
        import zerojax

        model, optimizer = zerojax.initialize(model, optimizer, config=zerojax_config(args))
        sampler = zerojax.distributed.sampler(data, shuffle=True, seed=7)
        rank = zerojax.distributed.rank()
    # The same line for both: torch's own clip, on zerojax's live gradients (issue 24).
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)

    loader = torch.utils.data.DataLoader(data, batch_size=args.local_batch, sampler=sampler)
    losses, norms, indices = [], [], list(sampler)
    sampler.set_epoch(0)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norms.append(float(clip()))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    module = model.module if args.engine == "torch" else model
    params = {f"param/{k}": v.detach().numpy() for k, v in module.state_dict().items()}
    out = Path(args.out) / f"{args.engine}_rank{rank}.npz"
    np.savez(
        out, losses=np.array(losses), norms=np.array(norms), indices=np.array(indices), **params
    )
    if args.engine == "torch":
        leave_together()


if __name__ == "__main__":
    main()
