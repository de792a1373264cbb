"""The Hugging Face Trainer's step: plain, with only the `initialize` line, and with the
optimizer handed to `initialize`.

A small Llama (LlamaConfig built in code: 4 layers, hidden 128, vocabulary 512, sequences of
64, batch 8), the Trainer's defaults (its own fused AdamW, `max_grad_norm=1.0` clipping through
accelerate, a linear schedule), one CPU device, --steps steps each. Three contenders, each in
its own fresh process (a Trainer run owns the process's torch state), run in turn --rounds
times so that load hits them alike; each reports the median of its steps after the first two
(compilation):

- plain: the Trainer as it is;
- initialize only: `model = zerojax.initialize(model)[0]` before the Trainer, which then builds
  its AdamW over the live parameters (adopted at its first step as the engine's compiled
  update: zerojax.train.late_optimizers) and clips them with torch's clip_grad_norm_ (its ops
  recorded and replayed as one program per step: zerojax.train.deferred, replay);
- handed over: `zerojax.initialize(model, AdamW(...))` and the Trainer given that optimizer
  (`optimizers=(optimizer, None)`): the engine's compiled update.

A step is timed from the Trainer's `on_step_begin` to its `on_step_end` callback (forward,
backward, clip, optimizer and scheduler step).

`--replay-ab` instead runs the `initialize`-only Trainer once, in this process, with the
replay of recorded work (zerojax.train.replay) on and off in alternating blocks of 4 steps
(the first step of each block and the first two blocks not timed), and reports each mode's
median step, wall-clock and this thread's CPU time: what the replay saves the Trainer's step.

Run: .venv/bin/python bench/trainer_step.py [--steps N] [--rounds N] [--replay-ab]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The repository, not bench/, first on the path: bench/multiprocess.py would shadow the
# `multiprocess` package the Trainer's `datasets` imports.
sys.path[0] = str(REPO)

CONTENDERS = ("plain", "initialize only", "handed over")


def run_one(contender: str, steps: int, replay_ab: dict | None = None) -> list[float]:
    """Step times (ms) of one Trainer run, in this process. `replay_ab`: {"on": [], "off":
    []}, filled with (wall ms, thread CPU ms) of steps with the replay on and off (see
    --replay-ab)."""
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import tempfile

    import torch
    import transformers

    import zerojax

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, rows: int):
            generator = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 512, (rows, 64), generator=generator)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    from zerojax.train import live_tensor

    class StepTimes(transformers.TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.replay_hook = live_tensor.dispatch_hook[0]  # installed by initialize

        def on_step_begin(self, args, state, control, **kwargs):
            if replay_ab is not None:
                self.replay_hook = self.replay_hook or live_tensor.dispatch_hook[0]
                self.mode = "on" if (len(self.times) // 4) % 2 == 0 else "off"
                live_tensor.dispatch_hook[0] = self.replay_hook if self.mode == "on" else None
            self.start, self.cpu = time.perf_counter(), time.thread_time()

        def on_step_end(self, args, state, control, **kwargs):
            wall, cpu = time.perf_counter() - self.start, time.thread_time() - self.cpu
            if replay_ab is not None and len(self.times) >= 8 and len(self.times) % 4:
                replay_ab[self.mode].append((wall * 1e3, cpu * 1e3))
            self.times.append(wall * 1e3)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    optimizer = None
    if contender == "initialize only":
        model = zerojax.initialize(model, config={"mesh": {"data": 1}})[0]
    elif contender == "handed over":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = zerojax.initialize(model, optimizer, {"mesh": {"data": 1}})
    times = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-4,
            report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
            logging_strategy="no",
        )  # fmt: skip
        transformers.Trainer(
            model=model,
            args=args,
            train_dataset=Tokens(8 * steps),
            optimizers=(optimizer, None),
            callbacks=[times],
        ).train()
    return times.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--replay-ab", action="store_true", help="see the module docstring")
    args = parser.parse_args()
    if args.replay_ab:
        modes: dict[str, list] = {"on": [], "off": []}
        run_one("initialize only", args.steps, modes)
        print(f"HF Trainer with only the initialize line, {args.steps} steps, one process")
        for mode, samples in modes.items():
            wall = statistics.median(s[0] for s in samples)
            cpu = statistics.median(s[1] for s in samples)
            print(
                f"  replay {mode:3s}  {wall:6.1f} ms wall  {cpu:6.2f} ms thread  ({len(samples)})"
            )
        return
    if args.contender:
        print(json.dumps(run_one(args.contender, args.steps)))
        return
    medians: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for _ in range(args.rounds):
        for contender in CONTENDERS:
            result = subprocess.run(
                [sys.executable, __file__, "--contender", contender, "--steps", str(args.steps)],
                capture_output=True, text=True, check=True, cwd=REPO, timeout=1800,
            )  # fmt: skip
            times = json.loads(result.stdout.strip().splitlines()[-1])
            medians[contender].append(statistics.median(times[2:]))
    print(
        f"HF Trainer, small Llama (4 layers, hidden 128), batch 8 x 64, one CPU device; "
        f"median step of steps 3-{args.steps}, median over {args.rounds} rounds"
    )
    plain = statistics.median(medians["plain"])
    for contender, values in medians.items():
        ms = statistics.median(values)
        print(f"  {contender:16s} {ms:8.1f} ms  {ms / plain:5.2f}x plain")


if __name__ == "__main__":
    main()
