"""Checkpoints across processes, under torchrun (run by tests/distributed/test_checkpoints.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/ckpt_script.py \
        save --dir CKPT --mesh fsdp=8 --out DIR
    python -m torch.distributed.run --nproc-per-node 1 tests/distributed/ckpt_script.py \
        restore --dir CKPT --mesh data=2,fsdp=4 --devices-per-process 8 --out DIR

`save` trains the MLP of ddp_script.py for two AdamW steps, saves step 2 (every process writes
its own shards) and writes the gathered state; `restore` builds the same model fresh on its own
mesh and process count, restores the latest step and writes the state it got. Each rank writes
DIR/<mode>_rank<r>.npz: the model's state_dict and the optimizer's (torch format) tensors.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import zerojax
from tests.distributed.ddp_script import MLP, dataset, zerojax_config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "restore"))
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mesh", default="fsdp=-1")
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = zerojax.initialize(model, optimizer, config=zerojax_config(args))
    checkpointer = zerojax.Checkpointer(args.dir, model, optimizer)
    if args.mode == "save":
        data = dataset(64)
        sampler = zerojax.distributed.sampler(data, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
        for step, (x, y) in enumerate(loader, start=1):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 2:
                break
        checkpointer.save(2, force=True)
    else:
        assert checkpointer.restore().step == 2
    checkpointer.close()
    arrays = {f"model/{k}": v.numpy() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            arrays[f"optimizer/{index}/{key}"] = np.asarray(value)
    rank = zerojax.distributed.rank()
    np.savez(Path(args.out) / f"{args.mode}_rank{rank}.npz", **arrays)
    print(f"rank {rank} of {zerojax.distributed.world_size()}: {args.mode} done", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
