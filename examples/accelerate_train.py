"""A Hugging Face accelerate training loop, run by zerojax: the script you would write for
accelerate, plus the one `zerojax.initialize` line.

The model is a tiny GPT-2 built from a config (no download); the data is generated here: rows
that count up from a random token by a random stride of 1 to 3 (mod 128), so the model has
something to learn within a few steps. The loop uses what accelerate users do: a prepared
DataLoader and LR scheduler, gradient accumulation (`accumulate`), `accelerator.backward`,
`clip_grad_norm_` and `gather` for the logged loss. zerojax may be initialized before
`accelerator.prepare` (as here) or after it (`--initialize-after-prepare`); under torchrun
accelerate does not wrap the zerojax model in DDP (zerojax already averages gradients over
processes; see zerojax/integrations/accelerate.py).

Run: .venv/bin/python examples/accelerate_train.py [--steps N] [--initialize-after-prepare]
Many processes: torchrun --nproc-per-node 2 examples/accelerate_train.py (each process 4
simulated CPU devices, each feeding its own rows, as under DDP).
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

import zerojax

VOCAB, SEQ_LEN = 128, 32
CONFIG = {
    "devices": {"platform": "cpu", "num_cpu_devices": 4},
    "mesh": {"fsdp": -1},
    "zero_stage": 3,
}


def counting_rows(num_rows: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (num_rows, 1), generator=generator)
    stride = torch.randint(1, 4, (num_rows, 1), generator=generator)
    ids = (start + stride * torch.arange(SEQ_LEN)) % VOCAB
    return torch.utils.data.TensorDataset(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--initialize-after-prepare", action="store_true")
    args = parser.parse_args()

    accumulation = 2
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    torch.manual_seed(0)  # the same initial model on every process
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=2)
    config.bos_token_id = config.eos_token_id = 0  # GPT-2's 50256 lies outside this vocabulary
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    rows = args.steps * accumulation * 8 * accelerator.num_processes
    loader = torch.utils.data.DataLoader(counting_rows(rows), batch_size=8, shuffle=True)

    if not args.initialize_after_prepare:
        model, optimizer = zerojax.initialize(model, optimizer, CONFIG)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if args.initialize_after_prepare:
        model, optimizer = zerojax.initialize(model, optimizer, CONFIG)

    model.train()
    for i, (ids,) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            mean_loss = accelerator.gather(loss.detach()).mean().item()
            accelerator.print(f"step {(i + 1) // accumulation:3d}  loss {mean_loss:.4f}")


if __name__ == "__main__":
    main()
