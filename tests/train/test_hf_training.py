"""Hugging Face models with their default config (KV cache on) train through zerojax.initialize.

Run: `.venv/bin/python -m pytest -q tests/train/test_hf_training.py -p no:cacheprovider`
(`-m slow` adds Llama at ZeRO-0, T5 at ZeRO-0 and ZeRO-3, and CLIP with `return_loss=True`).

Why: the most common training line,

    loss = model(input_ids=x, labels=x).loss; loss.backward(); optimizer.step()

used to raise CaptureError on a default-config causal LM, because the model returns a
`DynamicCache` (T5 an `EncoderDecoderCache`) and torch.export could not flatten it. Plain
PyTorch trains such a model unchanged; so must we, without the user ever setting
`use_cache=False`. Each case trains the model wrapped and as a plain-torch deep copy for STEPS
AdamW steps on 8 simulated devices, at ZeRO-0 and ZeRO-3 (config dicts, mesh axis `fsdp`).

Dropout is set to 0 where the config has it on by default (T5's `dropout_rate`) so that both
sides compute the same function; `use_cache` is left at its default (True).

Tolerances (fp32 on both sides):
- LOSS_RTOL = 1e-5 per step. The LM loss is a mean over BATCH * SEQ = 128 token cross-entropies
  of logits from reductions of length <= 64 (hidden 32, MLP 64, sequence 16, vocab 128) summed
  in a different order by XLA and torch: a few ulp (1.2e-7) each, ~1e-6 relative at worst per
  forward. Each AdamW update is normalized (m / sqrt(v)), so a gradient's rounding changes an
  update by about the same relative amount, which moves the next loss by well under that again.
  Measured: <= 2e-7 for Llama. 1e-5 leaves margin and still catches a real defect (a wrong
  mask, a dropped gradient term: >= 1e-3 relative by step 2). CLIP's contrastive loss has the
  same reduction lengths (8 x 8 similarities of 16-wide projections of 32-wide encoders).
- PARAM_ATOL = 0.1 * LR after STEPS steps. AdamW moves an element by ~LR per step whatever its
  gradient's size, so an element whose gradient is ~0 can flip part of an update on rounding
  alone (measured <= 3e-5 = 0.03 LR); a wrong gradient moves whole updates (>= LR).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

import zerojax

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multidevice

VOCAB, BATCH, SEQ, STEPS = 128, 8, 16, 4
LR = 1e-3
LOSS_RTOL = 1e-5
PARAM_ATOL = 0.1 * LR


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    assert config.attention_dropout == 0.0  # Llama's default: no dropout to switch off
    return transformers.LlamaForCausalLM(config), transformers.DynamicCache


def t5():
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
        dropout_rate=0.0,  # the default 0.1 would make the two sides differ by their masks
    )
    return transformers.T5ForConditionalGeneration(config), transformers.EncoderDecoderCache


MODELS = {"llama": llama, "t5": t5}
CASES = [(model, stage) for model in MODELS for stage in (0, 3)]
FAST = {("llama", 3)}  # the representative in the default run; the others take 20-40 s each


@dataclasses.dataclass
class Run:
    losses: list[tuple[float, float]]
    """(ours, torch's) loss per step."""
    param_error: float
    """Largest |ours - torch's| over every parameter after the last step."""
    output: object
    """Our last training output (a ModelOutput)."""
    reference_output: object
    """torch's last training output."""


@functools.cache
def trained(name: str, stage: int) -> Run:
    torch.manual_seed(0)
    module, cache_type = MODELS[name]()
    assert module.config.use_cache  # the default: caches on
    module.train()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    config = {"mesh": {"fsdp": 8}, "zero": {"stage": stage}}
    model, optimizer = zerojax.initialize(module, optimizer, config=config)

    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ))
        output = model(input_ids=x, labels=x)  # the unchanged training loop
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_output = reference(input_ids=x, labels=x)
        reference_output.loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append((output.loss.item(), reference_output.loss.item()))
    # torch's model really returns its cache in train mode: the case this file is about.
    assert isinstance(reference_output.past_key_values, cache_type)

    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    param_error = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    return Run(losses, param_error, output, reference_output)


@pytest.mark.parametrize(
    ("name", "stage"),
    [
        pytest.param(name, stage, marks=() if (name, stage) in FAST else pytest.mark.slow)
        for name, stage in CASES
    ],
)
def test_default_config_trains_like_torch(name, stage):
    run = trained(name, stage)
    for step, (ours, theirs) in enumerate(run.losses):
        assert abs(ours - theirs) <= LOSS_RTOL * abs(theirs), (
            f"{name} ZeRO-{stage} step {step}: loss {ours} vs torch {theirs}"
        )
    assert run.param_error <= PARAM_ATOL, f"{name} ZeRO-{stage}: params differ by {run.param_error}"
    # Train mode drops the cache from our outputs (see zerojax.Converted); torch's has one.
    assert run.output.past_key_values is None
    assert run.output.logits.shape == run.reference_output.logits.shape


@pytest.mark.slow
def test_clip_trains_with_return_loss_flag():
    """CLIP's training call passes `return_loss=True`, a non-tensor keyword: static, never a
    traced array (it decides in Python whether the contrastive loss is computed)."""
    torch.manual_seed(0)
    text = transformers.CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=1,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
    )
    config = transformers.CLIPConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16
    )
    module = transformers.CLIPModel(config).train()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    model, optimizer = zerojax.initialize(
        module, optimizer, config={"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
    )
    for step in range(2):
        tokens, images = torch.randint(2, VOCAB, (BATCH, SEQ)), torch.randn(BATCH, 3, 16, 16)
        losses = []
        for m, opt in ((model, optimizer), (reference, ref_optimizer)):
            loss = m(input_ids=tokens, pixel_values=images, return_loss=True).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        ours, theirs = losses
        assert abs(ours - theirs) <= LOSS_RTOL * abs(theirs), f"step {step}: {ours} vs {theirs}"
