"""The bridge routes hot ops of converted Hugging Face models to the Pallas kernels.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_kernel_substitution.py -p no:cacheprovider`
Why: issue 6 promises that a user changes nothing: SDPA, LayerNorm, the RMSNorm op pattern and
projection + log-softmax + NLL are found in the traced graph and replaced by the kernels, per
the config's `kernels:` section, with the same numbers as the plain lowerings. The Pallas
kernels run in interpret mode here (no GPU), so the models are tiny.
"""

from __future__ import annotations

import copy
import re

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import zerojax
from tests import tolerances
from zerojax.bridge import fusion
from zerojax.config import KernelsConfig

VOCAB, SEQ, BATCH = 256, 16, 2
PALLAS = KernelsConfig(
    attention="pallas", norm="pallas", optimizer="pallas", loss="pallas", interpret=True
)
OFF = KernelsConfig(attention="off", norm="off", optimizer="off", loss="off")


def llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,  # head_dim 64, a size the flash kernel takes
        num_key_value_heads=1,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=128,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


def _tokens(seed: int, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _loss_jaxpr(model: torch.nn.Module, kernels: KernelsConfig) -> str:
    x = _tokens(0)
    converted = zerojax.convert(model, (x,), {"labels": x}, train=True)

    def loss(params, x):
        outputs, _ = converted.apply(
            params, converted.buffers, x, labels=x, kernels=kernels, rng=jax.random.key(0)
        )
        return outputs.loss

    return str(jax.make_jaxpr(jax.grad(loss))(converted.params, x.numpy()))


def test_llama_training_step_jaxpr_holds_the_pallas_kernels():
    text = _loss_jaxpr(llama(), PALLAS)
    # pallas_call equations are named after their kernels: forward and backward of each op.
    names = set(re.findall(r"name=(\w+)", text))
    assert {
        "flash_attention_forward",
        "flash_attention_dkdv",
        "flash_attention_dq",
        "rms_norm_forward",
        "rms_norm_backward",
        "linear_cross_entropy_fwd",
        "linear_cross_entropy_dh",
        "linear_cross_entropy_dw",
    } <= names
    assert "pallas_call" in text


def test_kernels_off_leaves_the_plain_lowerings():
    text = _loss_jaxpr(llama(), OFF)
    assert "pallas_call" not in text
    assert "flash_attention" not in text and "linear_cross_entropy" not in text


def _fused_names(graph: torch.fx.Graph) -> list[str]:
    return [n.target.__name__ for n in graph.nodes if isinstance(n.target, fusion.FusedOp)]


def test_patterns_found_in_traced_graphs():
    x = _tokens(1)
    everything = frozenset({"norm", "loss", "loss_with_returned_logits"})
    for model, expected in ((llama(), {"rms_norm": 3}), (gpt2(), {"rms_norm": 0})):
        exported = zerojax.bridge.capture.capture(model, (x,), {"labels": x}, train=True)
        fused = _fused_names(fusion.rewrite(exported.graph, everything))
        assert fused.count("rms_norm") == expected["rms_norm"]
        assert fused.count("linear_cross_entropy") == 1
        # Hugging Face models return their logits too: plain "loss" leaves that projection whole
        # rather than repeat the vocabulary matmul inside the chunked kernel.
        fused = _fused_names(fusion.rewrite(exported.graph, frozenset({"norm", "loss"})))
        assert fused.count("linear_cross_entropy") == 0
        # Only the norm family on: the loss pattern stays as torch wrote it.
        graph = fusion.rewrite(exported.graph, frozenset({"norm"}))
        assert not any(
            isinstance(n.target, fusion.FusedOp) and n.target.__name__ == "linear_cross_entropy"
            for n in graph.nodes
        )


def _train(factory, kernels: KernelsConfig, steps: int = 3, batch: int = BATCH):
    torch.manual_seed(0)
    model = factory()
    # eps well above rounding noise: GPT-2's key bias has a zero true gradient, and Adam would
    # scale its noise up to a full lr-sized step.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.1)
    config = {
        "mesh": {"fsdp": 8},
        "zero": {"stage": 3, "max_replicated_fraction": 1.0},
        "kernels": {
            "attention": kernels.attention,
            "norm": kernels.norm,
            "optimizer": kernels.optimizer,
            "loss": kernels.loss,
            "interpret": kernels.interpret,
        },
        "runtime": {"report_effective_time": False},
    }
    model, optimizer = zerojax.initialize(model, optimizer, config, seed=0)
    losses = []
    for step in range(steps):
        x = _tokens(10 + step, batch)
        loss = model(x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    return np.array(losses), state


def _torch_train(factory, dtype, steps: int = 3, batch: int = BATCH):
    """_train's loop in torch eager, in `dtype`: (losses, parameters by name)."""
    torch.manual_seed(0)
    model = factory().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x = _tokens(10 + step, batch)
        loss = _causal_lm_loss(model, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return np.array(losses), {n: p.detach().double() for n, p in model.named_parameters()}


def _causal_lm_loss(model, x):
    """Hugging Face's causal-LM loss (next-token cross-entropy, mean) in the model's own dtype:
    `labels=` upcasts the logits with .float(), which would round a float64 run to float32."""
    logits = model(x).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


# A float32 forward's own rounding, per loss, to first order at these models' scale: the
# accumulation lengths along it (embedding 128, attention head_dim 64 and 16 keys, MLP 128 and
# 512, norms 128, the vocabulary's logsumexp 256, the token mean 32) and ~10 library functions
# (exp, log, tanh/erf, rsqrt), twice for two sides.
LOSS_ROUNDINGS = 2 * (128 + 64 + 16 + 128 + 512 + 128 + 256 + 32 + 10 * tolerances.LIBM_ULPS)


def _assert_matches_float64(losses, state, factory, steps, batch, what):
    """Losses and parameters err against torch's float64 run no more than its float32 run
    does (tolerances.TORCH_ERROR_FACTOR; losses also within their forward rounding floor):
    the kernels change reduction orders, which AdamW turns into steps of up to lr / eps times
    a gradient's rounding difference, so no elementwise bound between two runs is useful."""
    losses32, params32 = _torch_train(factory, torch.float32, steps, batch)
    losses64, params64 = _torch_train(factory, torch.float64, steps, batch)
    floor = tolerances.rounded_intermediates(np.float32, LOSS_ROUNDINGS, np.abs(losses64))
    tolerances.assert_within_torch_error(losses, losses32, losses64, f"{what} losses", floor)
    tolerances.assert_params_within_torch_error(state, params32, params64, f"{what} params")


@pytest.mark.multidevice
# Llama's kernels (RMSNorm, rotary attention) are trained in the default run by
# test_pallas_kernels_run_per_batch_shard_in_the_engine; its 3-step twin here is slow only.
@pytest.mark.parametrize(
    "factory", [gpt2, pytest.param(llama, marks=pytest.mark.slow)], ids=["gpt2", "llama"]
)
@pytest.mark.long
def test_training_with_pallas_kernels_matches_plain_lowerings(factory):
    """Three ZeRO-3 AdamW steps: every kernel in Pallas interpret mode, and all of them off,
    each within torch's own float32 error of a float64 run."""
    for kernels, what in ((PALLAS, "pallas"), (OFF, "off")):
        losses, state = _train(factory, kernels)
        _assert_matches_float64(losses, state, factory, 3, BATCH, what)


@pytest.mark.multidevice
@pytest.mark.long
def test_pallas_kernels_run_per_batch_shard_in_the_engine(monkeypatch):
    """A batch of 8 on fsdp=8 is split over the devices: each Pallas kernel runs on its own
    shard under shard_map (XLA cannot partition a Pallas call), with the same numbers."""
    wrapped = []
    shard_map = jax.shard_map

    def spy(f, **kwargs):
        wrapped.append(f.__qualname__)
        return shard_map(f, **kwargs)

    monkeypatch.setattr(jax, "shard_map", spy)
    losses, state = _train(llama, PALLAS, steps=2, batch=8)
    monkeypatch.undo()
    assert wrapped.count("on_batch_shards.<locals>.local") >= 3  # attention, norms, loss
    _assert_matches_float64(losses, state, llama, 2, 8, "per-shard pallas")


def test_default_kernels_match_torch_on_gpt2_loss_and_grads():
    """The default ("auto": the XLA references on CPU) against torch eager, fp32."""
    model = gpt2()
    torch_model = copy.deepcopy(model)
    x = _tokens(2)
    converted = zerojax.convert(model, (x,), {"labels": x}, train=False)

    def loss(params):
        outputs, _ = converted.apply(params, converted.buffers, x.numpy(), labels=x.numpy())
        return outputs.loss

    value, grads = jax.jit(jax.value_and_grad(loss))(converted.params)
    torch_model.eval()
    torch_loss = torch_model(x, labels=x).loss
    torch_loss.backward()
    exact_model = copy.deepcopy(model).double().eval()
    exact_loss = _causal_lm_loss(exact_model, x)
    exact_loss.backward()
    # Loss: within torch's float32 error of float64 plus its forward rounding floor; gradients
    # (all parameters at once, normwise): within torch's own float32 error.
    floor = tolerances.rounded_intermediates(np.float32, LOSS_ROUNDINGS, abs(exact_loss.item()))
    tolerances.assert_within_torch_error(
        [float(value)], [torch_loss.item()], [exact_loss.item()], "loss", floor
    )
    ours, theirs, exact = {}, {}, {}
    for (name, param), (_, param64) in zip(
        torch_model.named_parameters(), exact_model.named_parameters(), strict=True
    ):
        ours[name] = np.asarray(grads[converted.tied.get(name, name)])
        theirs[name], exact[name] = param.grad.double(), param64.grad
    tolerances.assert_params_within_torch_error(ours, theirs, exact, "gradients")


def test_cross_entropy_of_plain_module_is_fused_and_matches_torch():
    """A hand-written LM head + F.cross_entropy (mean, ignore_index) becomes the fused op."""

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 300)

        def forward(self, h, y):
            return F.cross_entropy(self.proj(h).flatten(0, 1), y.flatten(), ignore_index=7)

    torch.manual_seed(3)
    head = Head()
    h = torch.randn(4, 8, 64)
    y = torch.randint(0, 300, (4, 8))
    y[0, :3] = 7
    converted = zerojax.convert(head, (h, y))
    interpreter = converted._programs[next(iter(converted._programs))][0]
    # The logits feed the loss alone, so the plain "loss" family fuses them; on CPU the default
    # ("auto") does not substitute at all: whole logits are faster there (fusion.families_for).
    assert fusion.families_for(KernelsConfig()) == frozenset({"norm"})
    graph = interpreter.graph_for(KernelsConfig(loss="xla"))
    assert any(n.target is fusion.linear_cross_entropy_op for n in graph.nodes)
    graph = fusion.rewrite(interpreter.graph, frozenset({"loss"}))
    assert any(n.target is fusion.linear_cross_entropy_op for n in graph.nodes)
    kernels = KernelsConfig(loss="xla")
    value, _ = converted.apply(
        converted.params, converted.buffers, h.numpy(), y.numpy(), kernels=kernels
    )
    # Against float64 (one side): the fused loss's elementwise bound (64-term logits, the
    # 300-term logsumexp, the mean; tests/pallas_kernels/test_linear_cross_entropy.py).
    from tests.pallas_kernels.test_linear_cross_entropy import error_bounds

    exact = copy.deepcopy(head).double()(h.double(), y).item()
    flat = y.flatten().numpy()
    bound, _ = error_bounds(
        h.reshape(-1, 64).numpy(),
        head.proj.weight.detach().numpy(),
        head.proj.bias.detach().numpy(),
        np.where(flat == 7, -100, flat),
        1.0,
        reduction="mean",
        label_smoothing=0.0,
        dtype=jax.numpy.float32,
    )
    assert abs(float(value) - exact) <= float(bound) / 2
