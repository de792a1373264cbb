"""Hugging Face LayerDrop: every layer runs, as Hugging Face runs them under DeepSpeed ZeRO-3
and FSDP.

The speech encoders of `transformers` (wav2vec2, wav2vec2-BERT, wav2vec2-Conformer, HuBERT,
WavLM, SEW, UniSpeech(-SAT), data2vec-audio; `config.layerdrop` defaults to 0.1 in most) decide
per layer, in train mode and in Python, whether it runs: `torch.rand([]) <
self.config.layerdrop`. A traced program cannot hold random Python control flow, so
torch.export fails on it. Under DeepSpeed ZeRO-3 or FSDP those same forwards set `synced_gpus`
and run every layer, keeping its output (each rank must join every layer's parameter gathers):
LayerDrop is off there. zerojax partitions parameters as they do, and runs these models as they
do: the model is captured with `config.layerdrop = 0.0`, and the user's value is put back after.

Only a config read at call time is changed: a module that copied the rate into an attribute at
construction (BART's `encoder_layerdrop`, which Hugging Face keeps applying under ZeRO-3)
still fails to capture, with a `CaptureError` that names the line.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger("zerojax")


@contextlib.contextmanager
def every_layer_runs(module: torch.nn.Module):
    """`config.layerdrop` at 0.0 on every config the module's submodules hold, for a capture
    in train mode; each config gets its own value back on exit, whatever happened inside."""
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
