"""Teach a small GPT-2 to add: an ordinary PyTorch training loop, run by zerojax as sharded XLA.

The model is Hugging Face's GPT2LMHeadModel built from a config (no download); the data is
generated here: "37+58=" followed by the sum's three digits, least significant first ("37+58=590"
means 095), because a left-to-right model can then carry the way people do. The loss covers
only the answer digits. `zerojax.initialize` moves the model and AdamW onto the mesh that
examples/zero3.yaml describes (ZeRO-3 over 8 simulated CPU devices); the loop below is the one
you would write for plain PyTorch. At the end the model answers 1,000 held-out problems by
greedy decoding, and the script prints how many it got exactly right.

Checkpoints go to the config's `checkpoint.directory` (.cache/checkpoints/gpt2-addition) every
100 steps and at the end, asynchronously; `--resume` continues from the latest one (a run
without it starts that directory afresh, except a job that `torchrun --max-restarts` restarted,
which resumes by itself). Inspect or export them with `zerojax ckpt`.

Run: make demo   (or .venv/bin/python examples/train_gpt2.py [--config FILE] [--steps N] [--resume])
Many processes: torchrun --nproc-per-node 2 examples/train_gpt2.py  (the same 8-device mesh as 2
processes x 4 simulated devices; each rank feeds its half of every batch, as under DDP).
About 1.5 minutes on 2 CPU cores; a second run starts faster (persistent compile cache in .cache/).
At exit zerojax prints where the time went (init, compile, checkpoints, training steps).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import zerojax
from zerojax.config.files import read_config_file
from zerojax.sharding.memory import measure_memory

REPO = Path(__file__).resolve().parent.parent
VOCAB = "0123456789+="
PROMPT_LEN = len("37+58=")
ANSWER_LEN = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "examples" / "zero3.yaml"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    return parser.parse_args()


# --- data: every a+b with 0 <= a, b < 100, 1,000 pairs held out -------------------------------


def encode(a, b):
    """(n,) int tensors -> (n, 9) tokens of "ab+cd=" and the sum's digits reversed."""
    answer = a + b
    digits = [a // 10, a % 10, torch.full_like(a, 10), b // 10, b % 10, torch.full_like(a, 11)]
    digits += [answer % 10, answer // 10 % 10, answer // 100]
    return torch.stack(digits, dim=1)


def decode(tokens) -> str:
    return "".join(VOCAB[t] for t in tokens.tolist())


def split_problems(seed: int, num_test: int = 1000):
    pairs = torch.cartesian_prod(torch.arange(100), torch.arange(100))
    pairs = pairs[torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed))]
    return pairs[num_test:], pairs[:num_test]


def batches(train_pairs, batch_size: int, steps: int, seed: int, start: int = 0):
    """(inputs, targets): inputs are the first 8 tokens, targets the next-token labels with the
    prompt positions set to -100 (cross_entropy's ignore_index), so only answers count.
    `start` skips the batches a resumed run has already trained on. With several processes
    each yields its contiguous share of the same global batch (every rank draws it from the
    same generator), so the job trains on exactly the batches one process would."""
    generator = torch.Generator().manual_seed(seed)
    rank, world_size = zerojax.distributed.rank(), zerojax.distributed.world_size()
    share = batch_size // world_size
    for step in range(steps):
        rows = train_pairs[torch.randint(len(train_pairs), (batch_size,), generator=generator)]
        rows = rows[rank * share : (rank + 1) * share]
        if step < start:
            continue
        tokens = encode(rows[:, 0], rows[:, 1])
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        targets[:, : PROMPT_LEN - 1] = -100
        yield inputs, targets


# --- what the newcomer watches: a progress bar, the memory table, the accuracy ----------------


class ProgressBar:
    """One `\\r`-rewritten line (a line per 10% when stdout is not a terminal)."""

    def __init__(self, total: int, width: int = 30):
        self.total, self.width = total, width
        self.start = time.perf_counter()
        self.tty = sys.stdout.isatty()
        self.last_decile = -1

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        done = step / self.total
        filled = int(self.width * done)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (1 - done) if done else 0.0
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} "
            f"|{'#' * filled}{'.' * (self.width - filled)}| "
            f"loss {loss:.4f}  {tokens_per_second / 1e3:6.1f}k tok/s  "
            f"{elapsed:4.0f}s elapsed, eta {eta:3.0f}s"
        )
        if self.tty:
            print("\r" + line, end="\n" if step == self.total else "", flush=True)
        elif int(done * 10) > self.last_decile:
            self.last_decile = int(done * 10)
            print(line, flush=True)


def print_memory_table(model, optimizer, inputs, targets) -> None:
    """Per-device bytes of the live training state, read off the sharded arrays, beside the
    ZeRO formula. One forward/backward makes the gradients live (and compiles both programs)."""
    loss = F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten())
    loss.backward()
    engine = model.engine
    print(
        measure_memory(
            engine.plan,
            params=engine.params,
            grads=engine.grads,
            opt_state=engine.opt_state,
            master_weights=engine.master,
        )
    )
    optimizer.zero_grad()


def held_out_accuracy(model, test_pairs, show: int = 8) -> float:
    """Exact-match accuracy of greedily decoded answers. Every call feeds the same (n, 8)
    shape, so one compiled program serves all three digits (causal attention ignores the
    not-yet-written positions)."""
    tokens = encode(test_pairs[:, 0], test_pairs[:, 1])
    inputs = tokens[:, :-1].clone()
    inputs[:, PROMPT_LEN:] = 0
    model.eval()
    with torch.no_grad():
        for i in range(ANSWER_LEN):
            next_digit = model(inputs).logits[:, PROMPT_LEN - 1 + i].argmax(-1)
            if i + 1 < ANSWER_LEN:
                inputs[:, PROMPT_LEN + i] = next_digit
    predicted = torch.cat([inputs[:, PROMPT_LEN:], next_digit[:, None]], dim=1)
    correct = (predicted == tokens[:, PROMPT_LEN:]).all(dim=1)
    for row in range(show):
        a, b = test_pairs[row].tolist()
        guess = int(decode(predicted[row])[::-1])
        mark = "ok" if correct[row] else f"wrong (is {a + b})"
        print(f"  {a:2d} + {b:2d} = {guess:<4d} {mark}")
    return correct.float().mean().item()


def main() -> None:
    args = parse_args()
    world_size = zerojax.distributed.world_size()  # from torchrun's environment; 1 otherwise
    raw_config = read_config_file(args.config)
    if world_size > 1 and raw_config.get("devices", {}).get("num_cpu_devices"):
        # num_cpu_devices is per process: split the 8 simulated devices over the processes, so
        # the mesh (and the training) is the single-process demo's.
        raw_config["devices"]["num_cpu_devices"] //= world_size
    config = zerojax.load_config(raw_config)  # loaded once; JAX has not started yet
    # Every rank runs this script; one prints (rank 0, as with torch DDP).
    if zerojax.distributed.rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    checkpoint_dir = Path(config.checkpoint.directory)
    # A job torchrun restarted after a failure (`--max-restarts`) resumes by itself.
    resume = args.resume or zerojax.distributed.job().restart_count > 0
    if not resume and checkpoint_dir.exists() and zerojax.distributed.rank() == 0:
        shutil.rmtree(checkpoint_dir)  # the example's own directory: a fresh run starts anew

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    gpt2_config = GPT2Config(
        vocab_size=16,  # 12 symbols, padded so every dimension splits 8 ways
        n_positions=16,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = GPT2LMHeadModel(gpt2_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    num_params = sum(p.numel() for p in model.parameters())

    # Applies the config's `devices:` (8 simulated CPU devices) first: nothing above used JAX.
    model, optimizer = zerojax.initialize(model, optimizer, config=config)
    print(
        f"GPT-2 ({gpt2_config.n_layer} layers, width {gpt2_config.n_embd}, {num_params:,} "
        f"parameters), batch {args.batch_size} x {PROMPT_LEN + ANSWER_LEN - 1} tokens, on "
        f"{len(jax.devices())} {jax.devices()[0].platform.upper()} devices "
        f"({world_size} process{'es' if world_size > 1 else ''}), "
        f"config {os.path.relpath(args.config)}"
    )
    warmup = max(1, args.steps // 20)  # then cosine decay to zero
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / args.steps))),
    )

    # Saves every checkpoint.save_interval_steps, asynchronously: save() returns once the
    # arrays are off the devices, and files appear only when complete.
    checkpointer = zerojax.Checkpointer(model=model, optimizer=optimizer, scheduler=scheduler)
    done_steps = 0
    if resume and checkpointer.latest_step() is not None:
        done_steps = checkpointer.restore().step
        print(f"resumed from step {done_steps} of {checkpoint_dir}")

    train_pairs, test_pairs = split_problems(args.seed)
    loader = batches(train_pairs, args.batch_size, args.steps, args.seed, start=done_steps)
    example_x, example_y = next(batches(train_pairs, args.batch_size, 1, args.seed + 1))
    print_memory_table(model, optimizer, example_x, example_y)
    print(f"setup (trace + compile): {time.perf_counter() - start:.1f} s")

    bar = ProgressBar(args.steps)
    tokens_seen, window_start = 0, time.perf_counter()
    for step, (x, y) in enumerate(loader, start=done_steps + 1):
        out = model(x).logits
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        loss.backward()
        model.clip_grad_norm_(1.0)  # on the shards; torch.nn.utils' is left as torch's
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        checkpointer.save(step)

        tokens_seen += x.numel()
        if step % 10 == 0 or step == args.steps:
            now = time.perf_counter()
            bar.update(step, loss.item(), tokens_seen / (now - window_start))
            tokens_seen, window_start = 0, now

    checkpointer.wait()
    if checkpointer.latest_step() != args.steps:
        checkpointer.save(args.steps, force=True)
    checkpointer.close()  # waits for the last save
    print(f"checkpoints: steps {checkpointer.all_steps()} in {checkpoint_dir}")

    accuracy = held_out_accuracy(model, test_pairs)
    print(
        f"held-out exact-match accuracy: {accuracy:.1%} of {len(test_pairs):,} problems "
        f"(chance: 0.1%); total {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
