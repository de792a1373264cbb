"""A LightningModule trained by Lightning's Trainer, run by zerojax as one sharded XLA program.

The only zerojax line is the strategy: `Trainer(strategy=ZeroJaxStrategy(CONFIG))` (or
`strategy="zerojax"` for the default config: data parallel over all devices, ZeRO-0). The
rest is plain Lightning: `training_step` calls the model (`self.model`, the one child holding
the parameters, which zerojax initializes), `self.log`, AdamW with a cosine schedule from
`configure_optimizers`, gradient accumulation and clipping from the Trainer's flags.

The data is made here: 16 random features, labelled by which of 4 fixed random directions they
point along most; the model is a small MLP. ZeRO-3 over 8 simulated CPU devices.

Run: .venv/bin/python examples/lightning_train.py [--steps N]
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from zerojax.lightning import ZeroJaxStrategy

CONFIG = {
    "devices": {"platform": "cpu", "num_cpu_devices": 8},  # rehearse an 8-device mesh
    "mesh": {"data": -1},
    "zero_stage": 3,  # parameters, gradients and AdamW state sharded over the 8 devices
}


class Classifier(L.LightningModule):
    def __init__(self, steps: int):
        super().__init__()
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)
        )
        self.steps = steps
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.losses.append(loss.item())  # .item() waits for the step: fine at this size
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def dataset(rows: int = 1024) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(16, 4, generator=generator)
    x = torch.randn(rows, 16, generator=generator)
    return torch.utils.data.TensorDataset(x, (x @ directions).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    args = parser.parse_args()
    L.seed_everything(0)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=32, shuffle=True)
    module = Classifier(args.steps)
    trainer = L.Trainer(
        strategy=ZeroJaxStrategy(CONFIG),
        max_steps=args.steps,
        accumulate_grad_batches=2,  # Lightning accumulates; zerojax sums each backward's grads
        gradient_clip_val=1.0,  # clipped on the shards, in one program
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, loader)
    first, last = module.losses[:4], module.losses[-4:]
    print(f"loss {sum(first) / 4:.4f} -> {sum(last) / 4:.4f} over {args.steps} steps")


if __name__ == "__main__":
    main()
