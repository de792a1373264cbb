"""Varying input shapes: a Hugging Face Trainer fine-tune with dynamic padding, counted.

A small Llama (LlamaConfig built here, no download) is fine-tuned by the unchanged Trainer
(its own AdamW and schedule, `zerojax.initialize(model, config=...)` the one added line) for
STEPS steps of batch BATCH, rows of random lengths, collated by `DataCollatorForSeq2Seq`
(pad to the longest row of the batch: `input_ids` with the pad token, `attention_mask` with 0,
`labels` with -100), the common fine-tuning setup. Rows' lengths are drawn so that the 20
batches have 15 distinct padded lengths. Counted per run, in one process each (no in-process
cache shared between them), the persistent compilation cache off:

- torch.export captures (calls of `torch.export.export`, whatever calls it) and their time;
- XLA compilations (JAX's `/jax/core/compile/backend_compile_duration` events) and their time,
  in all and by compiled function (`jit(fused)`: the fused step program, one per input shape;
  `jit(program)`: a recorded eager program, here the Trainer's clip and AdamW step; the rest
  are made once, at `initialize` or by the first step);
- the median step (wall time of `training_step`, the Trainer's forward, backward, clip, step is
  outside it) over the steps, and the whole `trainer.train()`.

Cases: `varying` (dynamic padding, no zerojax option), `fixed` (the collator's
`pad_to_multiple_of=MAX_LEN`: one shape, the floor), `buckets` (dynamic padding with
zerojax's `inputs.pad_to_multiple_of: 16`), and `torch` (plain Trainer, for the losses).

Run: .venv/bin/python bench/varying_shapes.py [--case varying|fixed|buckets|torch|all]
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
# `multiprocess` package that datasets (imported by the Trainer) needs.
sys.path[0] = str(REPO)

STEPS = 20
BATCH = 4
MAX_LEN = 64
VOCAB = 256
DATA_SEED = 8  # with this seed the 20 batches have 15 distinct padded lengths
BUCKET_MULTIPLE = 16


def llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tokenizer():
    """A word-level tokenizer over VOCAB tokens, built here (the collator pads with it)."""
    import tokenizers
    import transformers

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="[PAD]")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(model), pad_token="[PAD]", padding_side="right"
    )


def rows(seed: int = DATA_SEED, num_rows: int = STEPS * BATCH) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, MAX_LEN + 1, (num_rows,), generator=generator)
    out = []
    for length in lengths.tolist():
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * length, "labels": list(ids)})
    return out


class Rows:
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def run(case: str) -> dict:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 1)
    import torch
    import transformers
    from jax._src import dispatch

    import zerojax

    exports = {"count": 0, "secs": 0.0}
    real_export = torch.export.export

    def counted_export(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real_export(*args, **kwargs)
        finally:
            exports["count"] += 1
            exports["secs"] += time.perf_counter() - start

    torch.export.export = counted_export
    compiles = {"count": 0, "secs": 0.0}
    by_function: dict[str, int] = {}

    def on_event(event, secs, fun_name="?", **_):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiles["count"] += 1
            compiles["secs"] += secs
            by_function[fun_name] = by_function.get(fun_name, 0) + 1

    jax.monitoring.register_event_duration_secs_listener(on_event)

    torch.manual_seed(0)
    model = llama()
    if case != "torch":
        config = {"mesh": {"data": 1}, "runtime": {"compilation_cache_dir": None}}
        if case == "buckets":
            config["inputs"] = {"pad_to_multiple_of": BUCKET_MULTIPLE}
        model, _ = zerojax.initialize(model, config=config)
    shapes: list[tuple] = []
    collator = transformers.DataCollatorForSeq2Seq(
        tokenizer(), padding="longest", pad_to_multiple_of=MAX_LEN if case == "fixed" else None
    )

    def collate(features):
        batch = collator(features)
        shapes.append(tuple(batch["input_ids"].shape))
        return batch

    step_secs: list[float] = []
    losses: list[float] = []

    class Timed(transformers.Trainer):
        def training_step(self, *args, **kwargs):
            start = time.perf_counter()
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))  # reads the loss: the step's work is done
            step_secs.append(time.perf_counter() - start)
            return loss

    args = transformers.TrainingArguments(
        output_dir="/tmp/zerojax-bench-varying-shapes", max_steps=STEPS,
        per_device_train_batch_size=BATCH, learning_rate=1e-3, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True, logging_strategy="no",
    )  # fmt: skip
    trainer = Timed(model=model, args=args, train_dataset=Rows(rows()), data_collator=collate)
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    return {
        "case": case,
        "steps": len(step_secs),
        "distinct_shapes": len(set(shapes)),
        # The shapes the model's program ran at: the collator's, padded to their bucket.
        "program_shapes": len(
            {(rows, -(-length // BUCKET_MULTIPLE) * BUCKET_MULTIPLE) for rows, length in shapes}
            if case == "buckets"
            else set(shapes)
        ),
        "exports": exports["count"],
        "export_secs": round(exports["secs"], 2),
        "xla_compiles": compiles["count"],
        "xla_compile_secs": round(compiles["secs"], 2),
        "compiled": dict(sorted(by_function.items(), key=lambda item: -item[1])),
        "median_step_secs": round(statistics.median(step_secs), 4),
        "train_secs": round(total, 2),
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--case", default="all", choices=["all", "varying", "fixed", "buckets", "torch"]
    )
    parser.add_argument("--json", action="store_true", help="one JSON line per case")
    ns = parser.parse_args()
    if ns.case != "all":
        print(json.dumps(run(ns.case)))
        return
    results = []
    for case in ("torch", "varying", "fixed", "buckets"):
        # One process per case: nothing cached in memory carries over.
        out = subprocess.run(
            [sys.executable, __file__, "--case", case],
            check=True, capture_output=True, text=True, cwd=REPO,
        )  # fmt: skip
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    reference = results[0]["losses"]
    for result in results:
        losses = result.pop("losses")
        if result["case"] != "torch":
            result["max_loss_rel_diff_vs_torch"] = float(
                f"{max(abs(a - b) / abs(b) for a, b in zip(losses, reference)):.2e}"
            )
        print(json.dumps(result) if ns.json else _line(result))


def _line(result: dict) -> str:
    return "  ".join(f"{key}={value}" for key, value in result.items())


if __name__ == "__main__":
    main()
