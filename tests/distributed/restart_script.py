"""A training job that resumes by itself after `torchrun --max-restarts` restarts it (run by
tests/distributed/test_restarts.py).

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 2 \
        tests/distributed/restart_script.py --dir CKPT --out DIR --kill-at 3

The documented pattern: build, `zerojax.initialize`, `Checkpointer.restore()` when a step
exists, train from the step after it. Batches are a function of the step number, so a resumed
run feeds exactly the batches an uninterrupted one would. With `--kill-at S`, rank 1 of the
first attempt SIGKILLs itself right after step S (its checkpoint of step S - S % save_every
committed); torchrun then stops rank 0 and starts both again. Each rank of the attempt that
finishes writes DIR/final_rank<r>.npz (the gathered state_dict) and the attempt number.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import zerojax
from tests.distributed.ddp_script import IN_FEATURES, MLP, NUM_CLASSES

LOCAL_BATCH = 8


def batch(step: int, rank: int, world_size: int):
    """This rank's rows of step `step`'s global batch (the same on every attempt)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(LOCAL_BATCH * world_size, IN_FEATURES, generator=generator)
    y = torch.randint(0, NUM_CLASSES, (LOCAL_BATCH * world_size,), generator=generator)
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return x[rows], y[rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--ett-log", default=None, help="runtime.effective_time_log")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "devices": {"platform": "cpu", "num_cpu_devices": 4},
        "mesh": {"fsdp": 8},
        "zero_stage": 3,
        "runtime": {"compilation_cache_dir": None, "effective_time_log": args.ett_log},
    }
    model, optimizer = zerojax.initialize(model, optimizer, config=config)
    rank, world_size = zerojax.distributed.rank(), zerojax.distributed.world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    checkpointer = zerojax.Checkpointer(
        args.dir, model, optimizer, save_interval_steps=args.save_every
    )
    start = checkpointer.restore().step if checkpointer.latest_step() is not None else 0
    print(f"rank {rank} attempt {attempt}: starting after step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, world_size)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        checkpointer.save(step)
        if step == args.kill_at and rank == 1 and attempt == 0:
            checkpointer.wait()  # the last interval's step is committed: what a restart resumes
            print(f"rank {rank}: SIGKILL after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.close()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    np.savez(Path(args.out) / f"final_rank{rank}.npz", attempt=attempt, **state)
    print(f"rank {rank} attempt {attempt}: done", flush=True)


if __name__ == "__main__":
    main()
