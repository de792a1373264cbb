"""Supervised fine-tuning with TRL's SFTTrainer, run by zerojax: one line added to the script.

The script is what TRL's docs show -- an `SFTConfig`, an `SFTTrainer` over a text dataset -- on
a tiny GPT-2 built from a config and a word-level tokenizer built here (no downloads; the data
are sentences of random words). The one zerojax line is `zerojax.initialize(model, config=...)`:
ZeRO-3 over 8 simulated CPU devices. The Trainer builds its own AdamW over the model's
parameters (live views of the sharded arrays), clips, accumulates and schedules as usual;
TRL's fused LM head (it patches `model.forward` to return per-token log-probs) is traced into
the engine's program like the model's own forward.

Run: .venv/bin/python examples/trl_sft.py [--steps N] [--output-dir DIR] [--plain] [--dropout P]
(`--plain`: the same run without zerojax, for comparison; with `--dropout 0` the two log the same
losses, else their dropout masks differ: zerojax draws them from JAX's generator.) About 30 s on
2 CPU cores.
"""

from __future__ import annotations

import argparse
import tempfile

import datasets
import tokenizers
import torch
import transformers
import trl

import zerojax

ZERO3 = {"devices": {"num_cpu_devices": 8}, "mesh": {"fsdp": -1}, "zero": {"stage": 3}}
WORDS = [f"w{i}" for i in range(120)]


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def sentences(num_rows: int, num_words: int, seed: int = 0) -> datasets.Dataset:
    """Rows of `num_words` random words; a word's successor is drawn near it, so there is
    something to learn."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        word = int(torch.randint(0, len(WORDS), (), generator=generator))
        row = []
        for _ in range(num_words):
            row.append(WORDS[word])
            word = (word + int(torch.randint(1, 4, (), generator=generator))) % len(WORDS)
        rows.append(" ".join(row))
    return datasets.Dataset.from_dict({"text": rows})


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--plain", action="store_true", help="without zerojax")
    parser.add_argument(
        "--dropout", type=float, default=0.1, help="GPT-2's; 0 to compare runs step by step"
    )
    args = parser.parse_args(argv)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="trl-sft-")

    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_positions=32, n_embd=64, n_layer=2, n_head=4,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, resid_pdrop=args.dropout,
        embd_pdrop=args.dropout, attn_pdrop=args.dropout,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    if not args.plain:
        model, _ = zerojax.initialize(model, config=ZERO3)

    training_args = trl.SFTConfig(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, learning_rate=3e-3, max_grad_norm=1.0, logging_steps=1,
        max_length=32, seed=0, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True,
        # SFTConfig turns bf16 autocast on by default. zerojax traces the forward under it
        # too, but its bfloat16 matmuls round differently from torch's CPU kernels: the runs
        # then differ by bfloat16 noise (~1e-5 relative in the loss here). float32 keeps this
        # example comparable with `--plain` step for step.
        bf16=False,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=sentences(256, num_words=15),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(f"{output_dir}/final")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}; model saved to {output_dir}/final")
    return losses


if __name__ == "__main__":
    main()
