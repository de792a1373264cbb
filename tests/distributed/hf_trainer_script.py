"""One small Hugging Face Trainer run under torchrun: plain Trainer (DDP on gloo) or the same
script with `zerojax.initialize(model)` added, so the runs can be compared rank by rank.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/hf_trainer_script.py \
        --engine zerojax --out DIR

The Trainer builds its own AdamW and linear schedule, accumulates 2 micro-batches, clips at 1.0,
saves a checkpoint at step 2, evaluates, and saves with `save_model()` (then `from_pretrained`
loads that directory); a new model and Trainer then resume from the checkpoint. Each rank
writes DIR/<engine>_rank<r>.npz: the logged (loss, grad_norm) per step, the eval loss, the final
parameters of `trainer.model` (flattened, by sorted name), the reloaded saved ones, whether the
Trainer's training model was DDP-wrapped, and the resumed run's logs and final parameters. Run by tests/distributed/
test_hf_trainer_torchrun.py (not a test module itself).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import transformers

from tests.distributed.leave_together import leave_together

STEPS = 4
SAVE_AT = 2  # checkpoint-2 (model, optimizer, scheduler, RNG), resumed from at the end
CONFIG = {
    "devices": {"platform": "cpu", "num_cpu_devices": 4},
    "mesh": {"data": 2, "fsdp": 4},
    "zero_stage": 3,
    "runtime": {"compilation_cache_dir": None},
}


class Tokens(torch.utils.data.Dataset):
    """Random token rows; `labels` are the inputs (the model shifts them)."""

    def __init__(self, rows: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (rows, 32), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LogRecorder(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append((logs["loss"], logs["grad_norm"]))


def flat(state: dict) -> np.ndarray:
    return np.concatenate([state[k].detach().double().numpy().ravel() for k in sorted(state)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("torch", "zerojax"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)

    def trainer_of_a_new_model() -> tuple[transformers.Trainer, LogRecorder]:
        torch.manual_seed(0)  # the same initial model on every rank
        model_config = transformers.GPT2Config(
            vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(model_config)
        if args.engine == "zerojax":
            import zerojax

            model, _ = zerojax.initialize(model, config=CONFIG)
        recorder = LogRecorder()
        training_args = transformers.TrainingArguments(
            output_dir=str(out / args.engine), max_steps=STEPS, per_device_train_batch_size=4,
            gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-3,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="steps",
            save_steps=SAVE_AT, seed=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=model,
            args=training_args,
            train_dataset=Tokens(64, seed=1),
            eval_dataset=Tokens(16, seed=2),
            callbacks=[recorder],
        )
        return trainer, recorder

    trainer, recorder = trainer_of_a_new_model()
    trainer.train()
    ddp_wrapped = isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    evaluated = trainer.evaluate()["eval_loss"]
    final = flat(trainer.model.state_dict())
    saved = out / f"{args.engine}_final"
    trainer.save_model(str(saved))
    trainer.accelerator.wait_for_everyone()
    reloaded = flat(transformers.GPT2LMHeadModel.from_pretrained(saved).state_dict())
    # A new model and Trainer resumed from the checkpoint at step SAVE_AT: the last steps again.
    resumed, resumed_recorder = trainer_of_a_new_model()
    resumed.train(resume_from_checkpoint=str(out / args.engine / f"checkpoint-{SAVE_AT}"))
    resumed_final = flat(resumed.model.state_dict())

    rank = trainer.accelerator.process_index
    np.savez(
        out / f"{args.engine}_rank{rank}.npz",
        logs=np.array(recorder.logs),
        eval_loss=np.array(evaluated),
        final=final,
        reloaded=reloaded,
        resumed_logs=np.array(resumed_recorder.logs),
        resumed_final=resumed_final,
        ddp_wrapped=np.array(ddp_wrapped),
        num_processes=np.array(trainer.accelerator.num_processes),
    )
    leave_together()


if __name__ == "__main__":
    main()
