"""The Hugging Face Trainer, unchanged, training a model `zerojax.initialize` returned.

Run: .venv/bin/python -m pytest -q tests/train/test_hf_trainer.py -p no:cacheprovider
Why: issue 24's done-when names a Trainer run among the scripts that must run unchanged but
for the `initialize` line. The Trainer reads `model.loss_type` (missing on a wrapper, it scaled
every logged loss by 31/32), keeps only the dataset columns `inspect.signature(model.forward)`
names, passes `num_items_in_batch` under gradient accumulation, clips with
`torch.nn.utils.clip_grad_norm_` through accelerate and saves with `save_pretrained`: the model
staying itself and its tensors being live make all of that torch's. Plain Trainer on the same
data is the reference: logged losses and grad norms within 1e-5 relative (two float32 runs of
one loop: reordered sums, ~1e-7 per step); final weights normwise over all parameters within
1e-4 (AdamW turns ~1e-7 gradient differences into up to lr-sized steps on near-zero moments,
so per-tensor bounds on small tensors are not meaningful); `from_pretrained` reloads the saved
directory. (Issue 26 takes the rest of the Trainer: its own optimizer, DeepSpeed "auto"
configs, torchrun, TRL.)
"""

from __future__ import annotations

import pytest
import torch

import zerojax
from tests.test_config import HF_ZERO3_AUTO
from zerojax.config import ConfigError
from zerojax.train import late_optimizers

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (a dev dependency)")
# The torchrun Trainer test's data and log recorder (one definition for both).
from tests.distributed.hf_trainer_script import LogRecorder, Tokens

pytestmark = pytest.mark.multidevice

STEPS = 6


def train(out, config=None, *, zerojax_model=False, user_optimizer=True):
    """STEPS Trainer steps (gradient accumulation 2, clipping at 1.0), then `evaluate()` and
    `predict()` on 16 rows: (logs + [eval loss], predicted logits, saved dir, the Trainer's
    torch optimizer).

    `zerojax_model`: `zerojax.initialize(model, optimizer, config)` before the Trainer (with
    `user_optimizer=False`: `zerojax.initialize(model, config=config)` and the Trainer builds
    its own optimizer and scheduler, its default)."""
    torch.manual_seed(0)
    model_config = transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if user_optimizer else None
    if zerojax_model:
        model, optimizer = zerojax.initialize(model, optimizer, config)
    recorder = LogRecorder()
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8, logging_steps=1,
        gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-3, report_to=[],
        use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(64, seed=0),
        optimizers=(optimizer, None) if user_optimizer else (None, None),
        callbacks=[recorder],
    )
    trainer.train()
    held_out = torch.utils.data.Subset(Tokens(64, seed=0), range(16))
    evaluated = trainer.evaluate(held_out)["eval_loss"]
    predicted = torch.as_tensor(trainer.predict(held_out).predictions)
    trainer.save_model(str(out / "final"))
    torch_optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's
    return recorder.logs + [(evaluated, 0.0)], predicted, out / "final", torch_optimizer


@pytest.mark.parametrize(
    ("config", "user_optimizer"),
    [
        ({"mesh": {"data": -1}, "zero_stage": 3}, True),
        # The unchanged Trainer script: only `model = zerojax.initialize(model)[0]` added; the
        # Trainer builds its AdamW (over the live parameters) and its linear schedule.
        (None, False),
        # A DeepSpeed user's config: "auto" wherever the Trainer fills a value.
        (HF_ZERO3_AUTO, False),
    ],
    ids=["zero3-user-optimizer", "default-trainer-optimizer", "deepspeed-auto-config"],
)
@pytest.mark.long
def test_trainer_trains_a_zerojax_model_like_plain_trainer(tmp_path, config, user_optimizer):
    theirs, their_logits, their_dir, _ = train(tmp_path / "torch", user_optimizer=user_optimizer)
    ours, our_logits, our_dir, optimizer = train(
        tmp_path / "zerojax", config, zerojax_model=True, user_optimizer=user_optimizer
    )
    if not user_optimizer:  # the Trainer's own AdamW: the compiled update took it over
        assert late_optimizers.compiled_for(optimizer) is not None
        assert not optimizer.state
    assert len(ours) == len(theirs) == STEPS + 1
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    # Logits of O(1) after 6 steps whose weights agree to ~1e-6: float32 forward reorderings
    # (~1e-6 relative over a 32-wide contraction) on top; 1e-4 absolute has room for both.
    torch.testing.assert_close(our_logits, their_logits, rtol=0, atol=1e-4)
    mine = transformers.GPT2LMHeadModel.from_pretrained(our_dir).state_dict()
    reference = transformers.GPT2LMHeadModel.from_pretrained(their_dir).state_dict()
    names = sorted(reference)
    flat = lambda state: torch.cat([state[n].double().flatten() for n in names])
    error = float((flat(mine) - flat(reference)).norm() / flat(reference).norm())
    assert error <= 1e-4, error


def test_deepspeed_autos_need_a_trainer():
    """Outside a Trainer nothing fills the "auto" values: the first call names them all."""
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    )
    model, optimizer = zerojax.initialize(model, config=HF_ZERO3_AUTO)
    assert optimizer is None  # the Trainer's own AdamW, built from its arguments
    tokens = torch.randint(0, 128, (8, 32))
    with pytest.raises(ConfigError, match='13 value.s. "auto"(.|\n)*gradient_clipping'):
        model(tokens, labels=tokens)


def test_trainer_refuses_a_second_accumulation(tmp_path):
    """zerojax's own gradient accumulation on top of the Trainer's would update every
    4 x 2 micro-batches: refused when the Trainer takes the model."""
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    )
    config = {**HF_ZERO3_AUTO, "gradient_accumulation_steps": 4, "train_batch_size": 32}
    model, _ = zerojax.initialize(model, config=config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), gradient_accumulation_steps=4, report_to=[], use_cpu=True
    )
    with pytest.raises(ValueError, match="accumulate again on top"):
        transformers.Trainer(model=model, args=args, train_dataset=Tokens(64, seed=0))


class Audio(torch.utils.data.Dataset):
    """Random 1 s clips at 16 kHz with one of three labels (input_values, labels)."""

    def __init__(self, size: int):
        generator = torch.Generator().manual_seed(0)
        self.audio = torch.randn(size, 16000, generator=generator)
        self.labels = torch.randint(0, 3, (size,), generator=generator)

    def __len__(self):
        return len(self.audio)

    def __getitem__(self, i):
        return {"input_values": self.audio[i], "labels": self.labels[i]}


@pytest.mark.long
def test_trainer_fine_tunes_wav2vec2_with_its_default_layerdrop(tmp_path):
    """A speech classifier as Hugging Face configures it, LayerDrop on (0.1): the Trainer's
    steps on the zerojax model equal the plain Trainer's on the same model run as under
    DeepSpeed ZeRO-3, every layer (layerdrop 0.0), and the user's config keeps 0.1. (Dropouts
    and SpecAugment off: their draws differ between torch and JAX by design.)"""

    def fine_tune(layerdrop: float, zerojax_model: bool) -> list[tuple[float, float]]:
        torch.manual_seed(0)
        config = transformers.Wav2Vec2Config(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            conv_dim=[32] * 7, num_conv_pos_embeddings=16, classifier_proj_size=32, num_labels=3,
            hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            feat_proj_dropout=0.0, final_dropout=0.0, mask_time_prob=0.0, layerdrop=layerdrop,
        )  # fmt: skip
        model = transformers.Wav2Vec2ForSequenceClassification(config)
        if zerojax_model:
            model = zerojax.initialize(model)[0]
        recorder = LogRecorder()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(zerojax_model)), max_steps=3, logging_steps=1,
            per_device_train_batch_size=8, max_grad_norm=1.0, learning_rate=1e-3, report_to=[],
            use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=Audio(24), callbacks=[recorder]
        )
        trainer.train()
        assert model.config.layerdrop == layerdrop
        return recorder.logs

    ours = fine_tune(layerdrop=0.1, zerojax_model=True)
    theirs = fine_tune(layerdrop=0.0, zerojax_model=False)
    assert len(ours) == len(theirs) == 3
    # As the GPT-2 runs above: two float32 runs of one loop, reordered sums (~1e-7 per step).
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
