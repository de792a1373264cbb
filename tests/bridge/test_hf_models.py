"""Hugging Face `transformers` models, built from tiny configs in code (no downloads), converted.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_hf_models.py` (add `-m slow` for BERT/ViT)

Our own architectures (test_models.py) are written to be exportable; these are the models users
actually bring. Each is converted once with `labels`, so its output is a `ModelOutput` carrying
HF's own cross-entropy `.loss` next to `.logits`. We check the logits and the loss against torch
eager, the gradient of that loss w.r.t. every parameter against torch autograd, and that the
`ModelOutput` type survives `jax.jit`.

All models use `attn_implementation="sdpa"`: transformers' SDPA path exports as one
aten.scaled_dot_product_attention node, which zerojax lowers whole (see capture.KEPT_WHOLE).
The configs keep their defaults otherwise: GPT-2 and Llama return their KV cache (a
`DynamicCache`, see test_hf_caches.py) next to the loss and logits.
"""

from __future__ import annotations

import functools

import jax
import pytest
import torch

import zerojax
from tests.bridge.test_models import gradient_errors, relative_error
from zerojax.bridge.dtypes import from_torch

transformers = pytest.importorskip("transformers")

FORWARD_RTOL = 1e-5
GRAD_RTOL = 1e-4
VOCAB = 128
BATCH, SEQ = 2, 16


def _token_inputs():
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = input_ids.clone()
    labels[:, :3] = -100  # HF's ignore_index: these positions must not count in the loss
    return (input_ids,), {"labels": labels}


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        attn_implementation="sdpa",
    )
    return transformers.GPT2LMHeadModel(config), *_token_inputs()


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config), *_token_inputs()


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    (input_ids,), kwargs = _token_inputs()
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, SEQ // 2 + int(torch.randint(0, SEQ // 2, ())) :] = 0  # padded tail
    kwargs["attention_mask"] = attention_mask
    kwargs["token_type_ids"] = torch.randint(0, 2, (BATCH, SEQ))
    return transformers.BertForMaskedLM(config), (input_ids,), kwargs


def vit():
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=10,
        attn_implementation="sdpa",
    )
    images = torch.randn(BATCH, 3, 16, 16)
    labels = torch.randint(0, 10, (BATCH,))
    return transformers.ViTForImageClassification(config), (images,), {"labels": labels}


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit}
# > 10 s each on a 2-core CPU (export + two XLA compilations). GPT-2 stays in the default run;
# Llama's architecture (RoPE, RMSNorm, SwiGLU, GQA) keeps its default-run parity check in
# tests/bridge/test_models.py::test_forward_parity[llama] and the kernel tests.
SLOW = {"llama", "bert", "vit"}
PARAMS = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in MODELS]


@functools.cache
def _converted(name: str):
    """(torch model in eval mode, args, kwargs, converted) for one model, built once."""
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    model.eval()
    return model, args, kwargs, zerojax.convert(model, args, kwargs)


def _jax(tree):
    return {k: from_torch(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


@pytest.mark.parametrize("name", PARAMS)
def test_forward_logits_and_loss_match_torch(name):
    model, args, kwargs, converted = _converted(name)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    out, _ = jax.jit(converted.apply)(
        converted.params, converted.buffers, *(from_torch(a) for a in args), **_jax(kwargs)
    )
    # The ModelOutput class itself comes back through jax.jit, with jax.Array leaves.
    assert type(out) is type(expected)
    assert isinstance(out.logits, jax.Array)
    err = relative_error(out.logits, expected.logits.numpy())
    assert err <= FORWARD_RTOL, f"{name} logits: relative error {err:.2e}"
    err = relative_error(out.loss, expected.loss.numpy())
    assert err <= FORWARD_RTOL, f"{name} loss {float(out.loss)} vs {float(expected.loss)}"


@pytest.mark.parametrize("name", PARAMS)
def test_loss_gradient_matches_torch_for_every_parameter(name):
    model, args, kwargs, converted = _converted(name)
    model.zero_grad()
    model(*args, **kwargs).loss.backward()
    torch_params = dict(model.named_parameters())  # tied weights appear once, as in params
    assert set(converted.params) == set(torch_params)

    jax_args = [from_torch(a) for a in args]
    jax_kwargs = _jax(kwargs)

    def loss(params):
        out, _ = converted.apply(params, converted.buffers, *jax_args, **jax_kwargs)
        return out.loss

    grads = jax.jit(jax.grad(loss))(converted.params)
    errors = gradient_errors(grads, torch_params)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, (
        f"{name}: gradient of '{worst}' relative error {errors[worst]:.2e} > {GRAD_RTOL:.0e}"
    )


def test_gpt2_lm_head_is_tied_to_wte():
    _, _, _, converted = _converted("gpt2")
    assert converted.tied == {"lm_head.weight": "transformer.wte.weight"}
