"""Hugging Face KV caches through the bridge: models with their default config, caches on.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_hf_caches.py -p no:cacheprovider`
(`-m slow` adds train mode, StaticCache, the sliding-window cache, T5's and Whisper's
EncoderDecoderCache, and the optional-import check; the train-mode drop is also covered by the
fast Llama run in tests/train/test_hf_training.py).

Why: a `transformers` causal LM returns a `DynamicCache` by default (T5/Whisper an
`EncoderDecoderCache`); before `zerojax.bridge.hf_cache` torch.export could not flatten it and
users had to know to set `use_cache=False`. Here a generation step runs as JAX: prefill, then
one decode step with the returned cache fed back as a pytree of jax arrays, both under
`jax.jit`, compared with torch eager doing the same (logits and the cache's own arrays). In
train mode the cache is dropped from the outputs unless asked for (see `Converted`).

Tolerance: every comparison is fp32 against fp32 torch; logits come out of at most ~2 * 64-long
reductions per layer (hidden 32-64, sequence <= 13), torch and XLA summing in different orders:
a few ulp of 1.2e-7 each. FORWARD_RTOL = 1e-5 (relative to the largest |logit|) is the bridge's
tolerance for whole models (test_hf_models.py); measured errors here are 1e-7 to 1e-6.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

import zerojax
from tests.bridge.test_models import relative_error
from zerojax.bridge import hf_cache
from zerojax.bridge.dtypes import from_torch

transformers = pytest.importorskip("transformers")

FORWARD_RTOL = 1e-5
VOCAB = 128


def as_jax(tree):
    """A torch pytree (tensors, caches, ModelOutputs) with jax.Array leaves."""
    return jax.tree.map(from_torch, tree)


def llama(**overrides):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
    assert config.use_cache  # the default: the cache is the point of this file
    return transformers.LlamaForCausalLM(config)


def _prefill_and_decode(model, converted, prompt, next_token, **kwargs):
    """(torch prefill, torch decode, ours prefill, ours decode): our decode step is fed the cache
    our prefill returned; torch's the one torch returned (a copy: torch updates it in place)."""
    with torch.no_grad():
        expected = model(input_ids=prompt, **kwargs)
        expected_next = model(
            input_ids=next_token, past_key_values=copy.deepcopy(expected.past_key_values)
        )
    apply = jax.jit(converted.apply)
    out, _ = apply(converted.params, converted.buffers, input_ids=from_torch(prompt), **kwargs)
    out_next, _ = apply(
        converted.params,
        converted.buffers,
        input_ids=from_torch(next_token),
        past_key_values=out.past_key_values,
    )
    return expected, expected_next, out, out_next


def assert_cache_matches(ours, theirs, what: str):
    """Same cache class, same structure, and every key/value array equal within tolerance."""
    assert type(ours) is type(theirs)
    our_leaves, our_spec = torch.utils._pytree.tree_flatten(ours)
    their_leaves, their_spec = torch.utils._pytree.tree_flatten(theirs)
    assert our_spec == their_spec, f"{what}: cache structure differs"
    for i, (a, b) in enumerate(zip(our_leaves, their_leaves, strict=True)):
        assert isinstance(a, jax.Array), f"{what}: leaf {i} is {type(a).__name__}"
        err = relative_error(a, b.detach().numpy())
        assert err <= FORWARD_RTOL, f"{what}: cache leaf {i} relative error {err:.2e}"


def test_llama_generation_step_with_dynamic_cache_matches_torch():
    model = llama().eval()
    prompt = torch.randint(0, VOCAB, (2, 12))
    converted = zerojax.convert(model, (), {"input_ids": prompt})
    next_token = torch.randint(0, VOCAB, (2, 1))
    expected, expected_next, out, out_next = _prefill_and_decode(
        model, converted, prompt, next_token
    )
    cache = out.past_key_values
    assert isinstance(cache, transformers.DynamicCache)
    assert cache.layers[0].keys.shape[-2] == 12
    assert_cache_matches(cache, expected.past_key_values, "prefill")
    assert relative_error(out.logits, expected.logits.numpy()) <= FORWARD_RTOL
    assert out_next.past_key_values.layers[0].keys.shape[-2] == 13
    assert_cache_matches(out_next.past_key_values, expected_next.past_key_values, "decode")
    err = relative_error(out_next.logits, expected_next.logits.numpy())
    assert err <= FORWARD_RTOL, f"decode-step logits: relative error {err:.2e}"

    # `jax.tree.map(lambda _: False, out)` puts bools into the cache's leaf slots; flattening it
    # again must give the same slots back, not read a bool as static structure.
    marked = jax.tree.map(lambda _: False, out)
    assert jax.tree.structure(marked) == jax.tree.structure(out)
    assert len(jax.tree.leaves(marked)) == len(jax.tree.leaves(out)) == 3  # logits, keys, values


@pytest.mark.slow
def test_train_mode_drops_the_cache_unless_asked():
    """Train mode: the loss and logits are torch's, `past_key_values` is None (the step would
    otherwise return every layer's keys and values); `use_cache=True` keeps it."""
    torch.manual_seed(0)
    model = llama().train()  # attention_dropout defaults to 0: train mode is deterministic
    tokens = torch.randint(0, VOCAB, (2, 12))
    expected = model(input_ids=tokens, labels=tokens)
    assert isinstance(expected.past_key_values, transformers.DynamicCache)  # torch returns one
    converted = zerojax.convert(model, (), {"input_ids": tokens, "labels": tokens})
    out, _ = converted.apply(
        converted.params,
        converted.buffers,
        input_ids=from_torch(tokens),
        labels=from_torch(tokens),
        rng=jax.random.key(0),
    )
    assert out.past_key_values is None
    assert relative_error(out.loss, expected.loss.detach().numpy()) <= FORWARD_RTOL

    out, _ = converted.apply(
        converted.params,
        converted.buffers,
        input_ids=from_torch(tokens),
        labels=from_torch(tokens),
        use_cache=True,
        rng=jax.random.key(0),
    )
    assert_cache_matches(out.past_key_values, expected.past_key_values, "train, use_cache=True")


def test_cache_keys_name_the_graph_inputs():
    """torch.export names the cache's graph inputs after our key paths (identifiers)."""
    cache = transformers.DynamicCache()
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), layer_idx=0)
    hf_cache.register_cache_pytrees()
    paths, spec = torch.utils._pytree.tree_flatten_with_path(cache)
    names = [torch.utils._pytree.keystr(path) for path, _ in paths]
    assert names == [".layers_0_keys", ".layers_0_values"]
    rebuilt = torch.utils._pytree.tree_unflatten([leaf for _, leaf in paths], spec)
    assert type(rebuilt) is transformers.DynamicCache
    assert rebuilt.layers[0].keys is cache.layers[0].keys
    assert rebuilt.get_seq_length() == 3


def test_an_unflattenable_cache_field_is_named_in_the_error():
    cache = transformers.DynamicCache()
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), layer_idx=0)
    cache.layers[0].hook = {1, 2}  # a set: neither an array, a scalar nor a container we walk
    hf_cache.register_cache_pytrees()
    with pytest.raises(ValueError, match=r"DynamicCache\.layers\[0\]\.hook \(set\)"):
        torch.utils._pytree.tree_flatten(cache)


@pytest.mark.slow
def test_transformers_stays_an_optional_import():
    """Importing zerojax (and converting a plain module) never imports transformers."""
    code = (
        "import sys, torch, zerojax\n"
        "zerojax.convert(torch.nn.Linear(2, 3), (torch.randn(4, 2),))\n"
        "assert 'transformers' not in sys.modules, 'zerojax imported transformers'\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )


def test_an_input_updated_in_place_and_returned_comes_back_in_the_outputs():
    """What StaticCache does (index_copy_ into its keys, then returns them), in five lines: the
    pure function returns the new value and leaves the array passed in as it was."""

    class WritesSlot(torch.nn.Module):
        def forward(self, buffer, position, value):
            buffer.index_copy_(0, position, value)
            return buffer

    buffer, position, value = torch.zeros(4, 3), torch.tensor([2]), torch.randn(1, 3)
    converted = zerojax.convert(WritesSlot(), (buffer.clone(), position, value))
    ours = from_torch(buffer)
    out, _ = jax.jit(converted.apply)({}, {}, ours, from_torch(position), from_torch(value))
    expected = buffer.clone().index_copy_(0, position, value)
    np.testing.assert_array_equal(out, expected)
    assert not np.asarray(ours).any()


@pytest.mark.slow
def test_static_cache_generation_step_matches_torch():
    """StaticCache updates its arrays in place in torch (index_copy_, add_): as JAX the updated
    cache comes back in the outputs and the one passed in is unchanged."""
    torch.manual_seed(0)
    model = llama().eval()
    prompt, next_token = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 1))

    def empty_cache():
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        cache.early_initialization(
            batch_size=2, num_heads=2, head_dim=8, dtype=torch.float32, device="cpu"
        )
        return cache

    torch_cache = empty_cache()
    with torch.no_grad():
        expected = model(input_ids=prompt, past_key_values=torch_cache)
        expected_next = model(input_ids=next_token, past_key_values=torch_cache)
    converted = zerojax.convert(model, (), {"input_ids": prompt, "past_key_values": empty_cache()})
    apply = jax.jit(converted.apply)
    ours = as_jax(empty_cache())
    out, _ = apply(
        converted.params, converted.buffers, input_ids=from_torch(prompt), past_key_values=ours
    )
    assert not np.asarray(ours.layers[0].keys).any()  # the input cache is not modified
    assert int(out.past_key_values.layers[0].cumulative_length) == 8
    out_next, _ = apply(
        converted.params,
        converted.buffers,
        input_ids=from_torch(next_token),
        past_key_values=out.past_key_values,
    )
    assert relative_error(out.logits, expected.logits.numpy()) <= FORWARD_RTOL
    assert relative_error(out_next.logits, expected_next.logits.numpy()) <= FORWARD_RTOL
    assert_cache_matches(out_next.past_key_values, torch_cache, "StaticCache after decode")


@pytest.mark.slow
def test_sliding_window_cache_generation_step_matches_torch():
    """Mistral with a window shorter than the prompt: DynamicSlidingWindowLayer, whose
    `cumulative_length` (an int) is static structure and whose kept keys are a slice."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=8,
    )
    model = transformers.MistralForCausalLM(config).eval()
    prompt, next_token = torch.randint(0, VOCAB, (2, 12)), torch.randint(0, VOCAB, (2, 1))
    converted = zerojax.convert(model, (), {"input_ids": prompt})
    expected, expected_next, out, out_next = _prefill_and_decode(
        model, converted, prompt, next_token
    )
    layer = out_next.past_key_values.layers[0]
    assert type(layer).__name__ == "DynamicSlidingWindowLayer"
    assert layer.cumulative_length == 13 and layer.keys.shape[-2] == 7  # window - 1 kept
    assert_cache_matches(out_next.past_key_values, expected_next.past_key_values, "decode")
    assert relative_error(out.logits, expected.logits.numpy()) <= FORWARD_RTOL
    assert relative_error(out_next.logits, expected_next.logits.numpy()) <= FORWARD_RTOL


@pytest.mark.slow
def test_t5_encoder_decoder_cache_generation_step_matches_torch():
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config).eval()
    source, decoded = torch.randint(0, VOCAB, (2, 10)), torch.randint(0, VOCAB, (2, 4))
    next_token = torch.randint(0, VOCAB, (2, 1))
    with torch.no_grad():
        expected = model(input_ids=source, decoder_input_ids=decoded)
        expected_next = model(
            encoder_outputs=(expected.encoder_last_hidden_state,),
            decoder_input_ids=next_token,
            past_key_values=copy.deepcopy(expected.past_key_values),
        )
    converted = zerojax.convert(model, (), {"input_ids": source, "decoder_input_ids": decoded})
    apply = jax.jit(converted.apply)
    out, _ = apply(
        converted.params,
        converted.buffers,
        input_ids=from_torch(source),
        decoder_input_ids=from_torch(decoded),
    )
    assert isinstance(out.past_key_values, transformers.EncoderDecoderCache)
    assert_cache_matches(out.past_key_values, expected.past_key_values, "prefill")
    out_next, _ = apply(
        converted.params,
        converted.buffers,
        encoder_outputs=(out.encoder_last_hidden_state,),
        decoder_input_ids=from_torch(next_token),
        past_key_values=out.past_key_values,
    )
    assert_cache_matches(out_next.past_key_values, expected_next.past_key_values, "decode")
    assert relative_error(out.logits, expected.logits.numpy()) <= FORWARD_RTOL
    assert relative_error(out_next.logits, expected_next.logits.numpy()) <= FORWARD_RTOL


@pytest.mark.slow
def test_whisper_converts_with_its_encoder_decoder_cache():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=16,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    model = transformers.WhisperForConditionalGeneration(config).eval()
    features, decoded = torch.randn(2, 16, 32), torch.randint(0, VOCAB, (2, 4))
    with torch.no_grad():
        expected = model(input_features=features, decoder_input_ids=decoded)
    converted = zerojax.convert(
        model, (), {"input_features": features, "decoder_input_ids": decoded}
    )
    out, _ = jax.jit(converted.apply)(
        converted.params,
        converted.buffers,
        input_features=from_torch(features),
        decoder_input_ids=from_torch(decoded),
    )
    assert isinstance(out.past_key_values, transformers.EncoderDecoderCache)
    assert_cache_matches(out.past_key_values, expected.past_key_values, "Whisper")
    assert relative_error(out.logits, expected.logits.numpy()) <= FORWARD_RTOL
