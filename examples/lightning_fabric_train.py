"""A plain PyTorch loop under Lightning Fabric, run by zerojax as one sharded XLA program.

`Fabric(strategy=ZeroJaxFabricStrategy(CONFIG))` (or `strategy="zerojax"`), `fabric.launch()`,
then the usual Fabric loop: `fabric.setup(model, optimizer)` is `zerojax.initialize`,
`fabric.backward(loss)` runs the engine's backward, `fabric.clip_gradients` clips on the
shards and `fabric.save` writes torch-format state dicts (`fabric.load` resumes from them).

Data and model as in examples/lightning_train.py: a small MLP learns which of 4 fixed random
directions 16 random features point along most. ZeRO-3 over 8 simulated CPU devices.

Run: .venv/bin/python examples/lightning_fabric_train.py [--steps N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning as L
import torch

from zerojax.lightning import ZeroJaxFabricStrategy

CONFIG = {
    "devices": {"platform": "cpu", "num_cpu_devices": 8},  # rehearse an 8-device mesh
    "mesh": {"data": -1},
    "zero_stage": 3,
}


def dataset(rows: int = 1024) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(16, 4, generator=generator)
    x = torch.randn(rows, 16, generator=generator)
    return torch.utils.data.TensorDataset(x, (x @ directions).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    args = parser.parse_args()
    fabric = L.Fabric(strategy=ZeroJaxFabricStrategy(CONFIG))
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(dataset(), batch_size=32, shuffle=True)
    )
    losses: list[float] = []
    while len(losses) < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) == args.steps:
                break
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "state.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": len(losses)})
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(path, state)  # resuming is the same call into the set-up objects
        fabric.print(f"saved and reloaded the step-{state['step']} checkpoint")
    first, last = losses[:4], losses[-4:]
    fabric.print(f"loss {sum(first) / 4:.4f} -> {sum(last) / 4:.4f} over {args.steps} steps")


if __name__ == "__main__":
    main()
