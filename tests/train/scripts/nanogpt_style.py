"""A training script in nanoGPT's train.py shape, as users write them: seeded model, AdamW with
decay/no-decay groups, cosine LR set on every group each iteration, `loss.backward()`,
`torch.nn.utils.clip_grad_norm_`, `raw_model = model.module`, and a checkpoint dict saved with
torch.save. The only zerojax line is the `initialize` call under `--zerojax`; `--resume` loads
a checkpoint into plain torch and goes on from it.

    python tests/train/scripts/nanogpt_style.py --out DIR [--zerojax CONFIG_JSON] [--resume CKPT]

Writes DIR/losses.json (iteration -> loss) and, without --resume, DIR/ckpt.pt at iteration
CHECKPOINT_AT. Run by tests/train/test_scripts.py (not a test module itself).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.architectures import GPT2, GPT2Config

MAX_ITERS, CHECKPOINT_AT = 8, 4
BATCH, BLOCK = 8, 32
LEARNING_RATE, MIN_LR, WARMUP = 6e-3, 6e-4, 2


def get_lr(it: int) -> float:
    if it < WARMUP:
        return LEARNING_RATE * (it + 1) / (WARMUP + 1)
    ratio = (it - WARMUP) / (MAX_ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)


def configure_optimizers(model: torch.nn.Module) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=(0.9, 0.95))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--zerojax", help="zerojax config as JSON; without it plain torch")
    parser.add_argument("--resume", help="a checkpoint this script wrote")
    args = parser.parse_args(argv)
    out = Path(args.out)
    os.makedirs(out, exist_ok=True)

    torch.manual_seed(1337)
    data = torch.randint(0, 128, (4096,), generator=torch.Generator().manual_seed(0))
    model = GPT2(GPT2Config(vocab_size=128, max_seq_len=BLOCK, dropout=0.0))
    optimizer = configure_optimizers(model)
    start = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["iter_num"]
    if args.zerojax:
        import zerojax

        model, optimizer = zerojax.initialize(model, optimizer, json.loads(args.zerojax))
    raw_model = model.module if hasattr(model, "module") else model

    batches = torch.Generator().manual_seed(1)
    losses = {}
    for it in range(MAX_ITERS):
        ix = torch.randint(len(data) - BLOCK - 1, (BATCH,), generator=batches)
        if it < start:
            continue  # the same batches as the run that wrote the checkpoint
        x = torch.stack([data[i : i + BLOCK] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])
        lr = get_lr(it)
        for group in optimizer.param_groups:
            group["lr"] = lr
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[it] = loss.item()
        if it + 1 == CHECKPOINT_AT and not args.resume:
            checkpoint = {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "iter_num": it + 1,
            }
            torch.save(checkpoint, out / "ckpt.pt")
    (out / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
