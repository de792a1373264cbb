"""Hugging Face's train-mode draws on the host: LayerDrop and SpecAugment (hf_train_randomness.py).

Run: .venv/bin/python -m pytest -q tests/bridge/test_hf_train_randomness.py
Why: wav2vec2-style encoders keep LayerDrop on by default (`config.layerdrop` 0.1) and draw it
in Python, which torch.export cannot capture; a user fine-tuning one got a CaptureError and had
to change the config. Under ZeRO-3 (`synced_gpus`) Hugging Face runs every layer, so the step
must compute what torch computes with `layerdrop = 0.0`, and leave the user's config alone.
Their SpecAugment (`mask_time_prob` 0.05 by default) samples masks with numpy: traced as it is,
every step would mask the same frames. The torch sampler that replaces it must draw the same
distribution, afresh at every call.
"""

from __future__ import annotations

import copy
import importlib
import logging

import jax
import numpy as np
import pytest
import torch

import zerojax
from tests.bridge.test_models import gradient_errors, relative_error
from zerojax.bridge.dtypes import from_torch
from zerojax.bridge.hf_train_randomness import compute_mask_indices

transformers = pytest.importorskip("transformers")

WAV2VEC2 = importlib.import_module("transformers.models.wav2vec2.modeling_wav2vec2")
HF_SAMPLER = WAV2VEC2._compute_mask_indices  # numpy's sampler, the reference
DRAWS = 3000
CONFIG = {"mesh": {"fsdp": 8}, "zero_stage": 3}
# fp32 through a 2-layer encoder with a 7-conv feature extractor, the same rounding as the
# model tests' bounds (test_hf_models.py).
FORWARD_RTOL = 1e-5
GRAD_RTOL = 1e-4


def wav2vec2(**overrides):
    """A tiny wav2vec2 classifier with the config's defaults but its dropouts (dropout draws
    differ between torch and JAX) and SpecAugment's time masks (random) off."""
    options = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "conv_dim": [32] * 7,
        "num_conv_pos_embeddings": 16,
        "classifier_proj_size": 32,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "feat_proj_dropout": 0.0,
        "final_dropout": 0.0,
        "mask_time_prob": 0.0,
    }
    config = transformers.Wav2Vec2Config(**(options | overrides))
    assert config.layerdrop == 0.1  # Hugging Face's default: LayerDrop is on
    return transformers.Wav2Vec2ForSequenceClassification(config)


@pytest.mark.long
def test_train_step_runs_every_layer_as_under_zero3_and_keeps_the_config(caplog):
    torch.manual_seed(0)
    model = wav2vec2()
    reference = copy.deepcopy(model)
    reference.config.layerdrop = 0.0  # what Hugging Face runs under DeepSpeed ZeRO-3 / FSDP
    reference.train()
    audio, labels = torch.randn(8, 3200), torch.randint(0, 2, (8,))
    expected = reference(audio, labels=labels).loss
    expected.backward()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, _ = zerojax.initialize(model, optimizer, config=CONFIG, seed=0)
    wrapped.train()
    with caplog.at_level(logging.WARNING, logger="zerojax"):
        loss = wrapped(audio, labels=labels).loss
    loss.backward()

    assert "runs every layer in train mode (config.layerdrop=0.1 is not applied)" in caplog.text
    assert model.config.layerdrop == 0.1
    assert relative_error(np.asarray(loss.detach()), expected.detach().numpy()) <= FORWARD_RTOL
    grads = {n: p.grad.numpy() for n, p in wrapped.named_parameters()}
    errors = gradient_errors(grads, dict(reference.named_parameters()))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"gradient of {worst}: relative error {errors[worst]:.2e}"


def test_a_failed_capture_puts_the_rate_and_the_sampler_back():
    """The config and the module get their own values back whatever happens in the capture."""
    torch.manual_seed(0)
    model = wav2vec2()
    with pytest.raises(zerojax.CaptureError):
        zerojax.convert(model, (torch.randn(2, 3200), "not a tensor"), train=True)
    assert model.config.layerdrop == 0.1
    assert WAV2VEC2._compute_mask_indices is HF_SAMPLER


def mask_frequencies(sample) -> tuple[np.ndarray, np.ndarray]:
    """Per-position masked frequency over DRAWS draws and its standard error."""
    masks = np.stack([np.asarray(sample(), dtype=np.float64) for _ in range(DRAWS)])
    frequency = masks.mean(axis=0)
    return frequency, np.sqrt(frequency * (1 - frequency) / DRAWS)


@pytest.mark.parametrize(
    "shape, mask_prob, mask_length, min_masks, lengths",
    [
        ((4, 49), 0.05, 10, 2, None),  # wav2vec2's defaults on 1 s of audio
        ((4, 120), 0.3, 10, 2, None),
        ((4, 60), 0.65, 10, 2, [60, 45, 30, 9]),  # padded rows; the last has no room at all
        ((3, 30), 0.5, 3, 0, [30, 17, 5]),
    ],
)
def test_torch_sampler_draws_hugging_faces_distribution(
    shape, mask_prob, mask_length, min_masks, lengths
):
    """Every position's masked frequency agrees with numpy's sampler within 5 standard errors
    of the difference (fixed seeds: the test is deterministic; 5 sigma over <= 240 positions
    would flag a true match once in ~10^4 seeds)."""
    attention_mask = None
    if lengths is not None:
        attention_mask = (torch.arange(shape[1]) < torch.tensor(lengths)[:, None]).long()
    options = {"mask_prob": mask_prob, "mask_length": mask_length, "min_masks": min_masks}
    np.random.seed(0)
    torch.manual_seed(0)
    ours, our_error = mask_frequencies(
        lambda: compute_mask_indices(shape, attention_mask=attention_mask, **options)
    )
    theirs, their_error = mask_frequencies(
        lambda: HF_SAMPLER(shape, attention_mask=attention_mask, **options)
    )
    difference = np.abs(ours - theirs)
    bound = 5 * np.sqrt(our_error**2 + their_error**2) + 1e-12
    assert np.all(difference <= bound), np.max(difference / bound)
    assert ours.mean() > 0
    if attention_mask is not None:  # padding is masked only where Hugging Face masks it
        padding = attention_mask.numpy() == 0
        assert np.all((ours[padding] == 0) == (theirs[padding] == 0))


def test_converted_model_draws_a_new_mask_each_call(caplog):
    """wav2vec2 with its default SpecAugment (dropouts off): the program's masks come from its
    key, so two keys give two outputs and one key the same; nothing is drawn on the host."""
    torch.manual_seed(0)
    model = wav2vec2(mask_time_prob=0.05)
    audio = torch.randn(2, 16000)  # 49 frames: the time mask applies
    with caplog.at_level(logging.WARNING, logger="zerojax"):
        converted = zerojax.convert(model, (audio,), train=True)
    assert "global random generator" not in caplog.text
    assert WAV2VEC2._compute_mask_indices is HF_SAMPLER
    apply = jax.jit(converted.apply)
    logits = [
        np.asarray(apply(converted.params, converted.buffers, from_torch(audio), rng=key)[0].logits)
        for key in (jax.random.key(0), jax.random.key(1), jax.random.key(0))
    ]
    assert not np.array_equal(logits[0], logits[1])
    np.testing.assert_array_equal(logits[0], logits[2])
