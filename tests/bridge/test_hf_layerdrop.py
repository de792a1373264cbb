"""Hugging Face LayerDrop in train mode: every layer runs, as under DeepSpeed ZeRO-3 and FSDP.

Run: .venv/bin/python -m pytest -q tests/bridge/test_hf_layerdrop.py
Why: wav2vec2-style encoders keep LayerDrop on by default (`config.layerdrop` 0.1) and draw it
in Python, which torch.export cannot capture; a user fine-tuning one got a CaptureError and had
to change the config. Under ZeRO-3 (`synced_gpus`) Hugging Face runs every layer, so the step
must compute what torch computes with `layerdrop = 0.0`, and leave the user's config alone.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

import zerojax
from tests.bridge.test_models import gradient_errors, relative_error

transformers = pytest.importorskip("transformers")

CONFIG = {"mesh": {"fsdp": 8}, "zero_stage": 3}
# fp32 through a 2-layer encoder with a 7-conv feature extractor, the same rounding as the
# model tests' bounds (test_hf_models.py).
FORWARD_RTOL = 1e-5
GRAD_RTOL = 1e-4


def wav2vec2():
    """A tiny wav2vec2 classifier with the config's defaults but its dropouts (dropout draws
    differ between torch and JAX) and SpecAugment's time masks (drawn with numpy) off."""
    config = transformers.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=[32] * 7,
        num_conv_pos_embeddings=16,
        classifier_proj_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        mask_time_prob=0.0,
    )
    assert config.layerdrop == 0.1  # Hugging Face's default: LayerDrop is on
    return transformers.Wav2Vec2ForSequenceClassification(config)


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


def test_a_failed_capture_puts_the_rate_back():
    """The config gets its value back whatever happens inside the capture."""
    torch.manual_seed(0)
    model = wav2vec2()
    with pytest.raises(zerojax.CaptureError):
        zerojax.convert(model, (torch.randn(2, 3200), "not a tensor"), train=True)
    assert model.config.layerdrop == 0.1
