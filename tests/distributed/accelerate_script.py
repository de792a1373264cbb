"""One small accelerate training run under torchrun: plain accelerate (DDP on gloo) or zerojax
initialized before (order A) or after (order B) `accelerator.prepare`, so the runs can be
compared rank by rank.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/accelerate_script.py \
        --engine zerojax --order B --out DIR

Each rank writes DIR/<engine><order>_rank<r>.npz: its per-micro-batch local losses, the
gathered losses (`accelerator.gather`), the clip norm per optimizer step, the final parameters (flattened, by sorted name),
whether the prepared model was DDP-wrapped, and a save_state/load_state round trip: the state
saved after the first optimizer step is loaded back at the end and the rest trained again (its
losses and final weights, to compare with the first pass). Run by tests/distributed/
test_accelerate_torchrun.py (not a test module itself).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator

from tests.distributed.leave_together import leave_together

ACCUMULATION = 2
LOCAL_BATCH = 8
OPTIMIZER_STEPS = 3
CONFIG = {
    "devices": {"platform": "cpu", "num_cpu_devices": 4},
    "mesh": {"data": 2, "fsdp": 4},
    "zero_stage": 3,
    "runtime": {"compilation_cache_dir": None},
}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(F.gelu(self.norm(self.fc1(x))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("torch", "zerojax"), required=True)
    parser.add_argument("--order", choices=("A", "B"), default="A", help="zerojax only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    rows = ACCUMULATION * OPTIMIZER_STEPS * LOCAL_BATCH * accelerator.num_processes
    generator = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(
        torch.randn(rows, 16, generator=generator),
        torch.randint(0, 10, (rows,), generator=generator),
    )
    torch.manual_seed(0)  # the same initial model on every rank
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = torch.utils.data.DataLoader(data, batch_size=LOCAL_BATCH)

    zerojax_first = args.engine == "zerojax" and args.order == "A"
    zerojax_after = args.engine == "zerojax" and args.order == "B"
    if zerojax_first:
        import zerojax

        model, optimizer = zerojax.initialize(model, optimizer, CONFIG)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ddp_wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if zerojax_after:
        import zerojax

        model, optimizer = zerojax.initialize(model, optimizer, CONFIG)
        # What the accelerator saves and clips is the zerojax model now, not the dropped DDP.
        assert accelerator._models == [model], accelerator._models

    name = "torch" if args.engine == "torch" else f"zerojax{args.order}"
    checkpoint = Path(args.out) / f"checkpoint_{name}"

    def train(batches, save_at=None):
        losses, gathered, norms = [], [], []
        for i, (x, y) in enumerate(batches):
            if i == save_at:  # after the first optimizer step
                accelerator.save_state(str(checkpoint))
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            gathered.append(accelerator.gather(loss.detach()[None]).numpy())
        return losses, gathered, norms

    def flat_weights():
        state = accelerator.unwrap_model(model).state_dict()
        return np.concatenate([state[k].detach().numpy().ravel() for k in sorted(state)])

    losses, gathered, norms = train(loader, save_at=ACCUMULATION)
    final = flat_weights()
    # save_state/load_state round trip: back to the first optimizer step, then the rest again.
    accelerator.wait_for_everyone()
    accelerator.load_state(str(checkpoint))
    resumed_losses, _, _ = train(accelerator.skip_first_batches(loader, ACCUMULATION))
    resumed_final = flat_weights()

    rank = accelerator.process_index
    np.savez(
        Path(args.out) / f"{name}_rank{rank}.npz",
        losses=np.array(losses),
        gathered=np.stack(gathered),
        norms=np.array(norms),
        resumed_losses=np.array(resumed_losses),
        final=final,
        resumed_final=resumed_final,
        ddp_wrapped=np.array(ddp_wrapped),
        num_processes=np.array(accelerator.num_processes),
    )
    leave_together()


if __name__ == "__main__":
    main()
