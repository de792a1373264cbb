"""Hugging Face randomness drawn in Python in train mode, made something a traced program holds.

Two draws in the speech encoders of `transformers` (wav2vec2, wav2vec2-BERT/Conformer, HuBERT,
WavLM, SEW(-D), UniSpeech(-SAT), data2vec-audio; SpecAugment also in SpeechT5 and Whisper)
happen on the host, where torch.export sees a Python value, not an op:

- **LayerDrop**: `torch.rand([]) < self.config.layerdrop` (0.1 by default) decides in Python
  whether a layer runs, which no traced program can hold: torch.export fails. Under DeepSpeed
  ZeRO-3 or FSDP those forwards set `synced_gpus` and run every layer, keeping its output (each
  rank must join every layer's parameter gathers): LayerDrop is off there. zerojax partitions
  parameters as they do and runs these models as they do: the model is captured with
  `config.layerdrop = 0.0`, and the user's value is put back after. Only a config read at call
  time changes: a module that copied the rate at construction (BART's `encoder_layerdrop`,
  which Hugging Face keeps applying under ZeRO-3) still fails, with a `CaptureError` that names
  the line.
- **SpecAugment** (`mask_time_prob`, 0.05 by default; `mask_feature_prob`): the module-level
  `_compute_mask_indices` picks the masked spans with numpy's global generator. Traced, that
  draw would be a constant of the program, the same frames masked at every step. During the
  capture it is replaced by `compute_mask_indices`, the same sampling written as torch ops,
  which the program draws afresh from its key each step.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import warnings

import torch

log = logging.getLogger("zerojax")


@contextlib.contextmanager
def traceable_train_randomness(module: torch.nn.Module):
    """For a capture in train mode: LayerDrop off and SpecAugment's sampler in torch ops on
    every Hugging Face module under `module` (module docstring); everything is put back on
    exit, whatever happened inside."""
    with _every_layer_runs(module), _spec_augment_in_torch(module):
        yield


@contextlib.contextmanager
def _every_layer_runs(module: torch.nn.Module):
    """`config.layerdrop` at 0.0 on every config the module's submodules hold."""
    configs = {}
    for submodule in module.modules():
        config = getattr(submodule, "config", None)
        rate = getattr(config, "layerdrop", None)
        if isinstance(rate, float) and rate > 0.0:
            configs[id(config)] = (config, rate)
    if configs:
        rates = sorted({rate for _, rate in configs.values()})
        log.warning(
            "zerojax: %s runs every layer in train mode (config.layerdrop=%s is not applied), "
            "as Hugging Face runs them under DeepSpeed ZeRO-3 and FSDP",
            type(module).__name__,
            ", ".join(str(r) for r in rates),
        )
    try:
        for config, _ in configs.values():
            config.layerdrop = 0.0
        yield
    finally:
        for config, rate in configs.values():
            config.layerdrop = rate


@contextlib.contextmanager
def _spec_augment_in_torch(module: torch.nn.Module):
    """`_compute_mask_indices` replaced by `compute_mask_indices` in the `transformers`
    modules that define the classes under `module`."""
    patched = {}
    for submodule in module.modules():
        source = sys.modules.get(type(submodule).__module__)
        if source is None or not source.__name__.startswith("transformers."):
            continue
        original = getattr(source, "_compute_mask_indices", None)
        if inspect.isfunction(original) and source.__name__ not in patched:
            patched[source.__name__] = (source, original)
    try:
        for source, _ in patched.values():
            source._compute_mask_indices = compute_mask_indices
        with warnings.catch_warnings():
            # The caller wraps the sampler's result in torch.tensor(...), made for numpy's;
            # on a tensor torch warns to clone instead, about code that is not the user's.
            warnings.filterwarnings("ignore", message="To copy construct from a tensor")
            yield
    finally:
        for source, original in patched.values():
            source._compute_mask_indices = original


def compute_mask_indices(
    shape: tuple[int, int],
    mask_prob: float,
    mask_length: int,
    attention_mask: torch.Tensor | None = None,
    min_masks: int = 0,
) -> torch.Tensor:
    """Hugging Face's `_compute_mask_indices` (SpecAugment's span sampler) as torch ops with
    static shapes: a (batch, length) bool mask of `mask_length`-long spans.

    The same distribution: one uniform `epsilon` per call rounds `mask_prob * length /
    mask_length` up or down, clamped as Hugging Face clamps it, per row's length (the attention
    mask's sum); the span starts are a uniform sample without replacement from the row's
    `length - mask_length + 1` positions (the first `count` of a random permutation, here the
    argsort of uniform keys). Where Hugging Face pads each row's starts to the batch's largest
    count with a repeat of its first (or, in a row without any, the last frame), this keeps a
    static upper bound of starts, masks out those beyond the row's count, and masks the last
    frame of a row without spans.
    """
    batch_size, sequence_length = shape
    if mask_length < 1:
        raise ValueError("`mask_length` has to be bigger than 0.")
    if mask_length > sequence_length:
        raise ValueError(
            f"`mask_length` has to be smaller than `sequence_length`, but got `mask_length`: "
            f"{mask_length} and `sequence_length`: {sequence_length}`"
        )
    num_starts = sequence_length - (mask_length - 1)
    # The most spans any draw can ask for (epsilon < 1), after Hugging Face's clamps.
    bound = max(int(mask_prob * sequence_length / mask_length + 1), min_masks)
    bound = min(bound, sequence_length // mask_length, num_starts)
    if bound <= 0:
        return torch.zeros(shape, dtype=torch.bool)
    epsilon = torch.rand(())

    def spans_for(lengths):
        count = torch.floor(mask_prob * lengths / mask_length + epsilon)
        count = torch.clamp(count, min=min_masks)
        count = torch.where(
            count * mask_length > sequence_length,
            torch.full_like(count, sequence_length // mask_length),
            count,
        )
        return torch.minimum(count, torch.clamp(lengths - (mask_length - 1), min=0))

    if attention_mask is None:
        lengths = torch.full((batch_size,), float(sequence_length))
    else:
        lengths = attention_mask.sum(-1).to(torch.float32)
    count = spans_for(lengths)
    room = lengths - (mask_length - 1)  # a row's start positions
    positions = torch.arange(num_starts)
    # Uniform keys for a row's own start positions, 2 (after every uniform) for the rest.
    keys = torch.where(positions < room[:, None], torch.rand(batch_size, num_starts), 2.0)
    starts = keys.argsort(dim=-1)[:, :bound]
    kept = torch.arange(bound) < count[:, None]
    spans = starts[:, :, None] + torch.arange(mask_length)  # (batch, bound, mask_length)
    covered = (spans[..., None] == torch.arange(sequence_length)) & kept[:, :, None, None]
    mask = covered.flatten(1, 2).any(dim=1)
    # A row with no span while the full length has some: Hugging Face pads its starts with the
    # last frame (a padding frame, which the encoder zeroes after), masking that one frame.
    full_length_spans = spans_for(torch.full((1,), float(sequence_length)))
    padded_row = (count == 0) & (full_length_spans > 0)
    last = torch.arange(sequence_length) == sequence_length - 1
    return mask | (padded_row[:, None] & last)
