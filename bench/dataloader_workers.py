"""DataLoader epochs with 2 worker processes: plain torch vs after `zerojax.initialize`.

After initialize, workers start from a forkserver that preloads the script
(zerojax/runtime/worker_processes.py) instead of a fork of the JAX process. This measures what
that costs a training script's data loading, each contender in a fresh process (JAX cannot be
stopped once started), the processes interleaved round by round in rotated order:

- torch: no JAX in the process; torch's default start method (fork on Linux).
- zerojax: `zerojax.initialize` and one training step first, then the same loaders (forkserver).
- zerojax, fork: the same with `multiprocessing_context="fork"` on the loaders: the fork
  torch would make, with JAX's deadlock warning.

Two datasets, batch 64, 2 workers, no persistent workers (a fresh start every epoch, torch's
default): a TensorDataset of 16,384 x 256 fp32 and a Python-transform dataset of 4,096 items
(each built by a Python loop from a file name the dataset holds, as a decoder or augmentation
would). Per process: the
first epoch (a forkserver's start included) and the median of the next `--epochs - 1`.

Run: .venv/bin/python bench/dataloader_workers.py [--rounds 5] [--epochs 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("torch", "zerojax", "zerojax, fork")


class PythonTransform:
    """Items made by Python code from what the dataset holds, as an image dataset holds file
    names and decodes each: a name per item, 256 values computed from it in a Python loop."""

    def __init__(self, n: int) -> None:
        self.names = [f"images/train/{i:08d}.jpg" for i in range(n)]

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int):
        import torch

        seed = sum(ord(c) for c in self.names[i])
        return torch.tensor([((seed * 31 + j) % 97) * 0.5 - 1.0 for j in range(256)])


def child(contender: str, epochs: int) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    if contender != "torch":
        import zerojax

        model = torch.nn.Linear(256, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = zerojax.initialize(model, opt, {"mesh": {"data": 1}})
        x = torch.randn(64, 256)
        torch.nn.functional.mse_loss(model(x), torch.randn(64, 8)).backward()
        opt.step()
    kwargs = {"multiprocessing_context": "fork"} if contender == "zerojax, fork" else {}
    torch.manual_seed(0)
    datasets = {
        "tensor": TensorDataset(torch.randn(16384, 256), torch.randint(0, 8, (16384,))),
        "python": PythonTransform(4096),
    }
    out = {}
    for name, dataset in datasets.items():
        loader = DataLoader(dataset, batch_size=64, num_workers=2, shuffle=True, **kwargs)
        times = []
        for _ in range(epochs):
            start = time.perf_counter()
            for _batch in loader:
                pass
            times.append(time.perf_counter() - start)
        out[name] = times
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--child", choices=CONTENDERS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.epochs)))
        return
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO)
    results: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    warned: dict[str, bool] = {}
    for round_ in range(args.rounds):
        first = round_ % len(CONTENDERS)
        for contender in CONTENDERS[first:] + CONTENDERS[:first]:
            run = subprocess.run(
                [sys.executable, __file__, "--child", contender, "--epochs", str(args.epochs)],
                env=env,
                capture_output=True,
                text=True,
                check=False,
                timeout=1200,
            )
            if run.returncode != 0:
                sys.exit(f"{contender} failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
            results[contender].append(json.loads(run.stdout.strip().splitlines()[-1]))
            warned[contender] = warned.get(contender, False) or "os.fork() was called" in run.stderr
    print(
        f"{args.rounds} rounds, one fresh process per contender and round; load average "
        f"{os.getloadavg()[0]:.1f} at the end\n"
    )
    print(
        "| dataset | contender | first epoch (s) | later epochs (s) | first vs torch | later vs "
        "torch | JAX fork warning |"
    )
    print("|---|---|---|---|---|---|---|")
    for dataset in ("tensor", "python"):
        base_first = statistics.median(r[dataset][0] for r in results["torch"])
        base_later = statistics.median(t for r in results["torch"] for t in r[dataset][1:])
        for contender in CONTENDERS:
            first = statistics.median(r[dataset][0] for r in results[contender])
            later = statistics.median(t for r in results[contender] for t in r[dataset][1:])
            print(
                f"| {dataset} | {contender} | {first:.3f} | {later:.3f} | "
                f"{first / base_first:.2f}x | {later / base_later:.2f}x | "
                f"{'yes' if warned[contender] else 'no'} |"
            )


if __name__ == "__main__":
    main()
