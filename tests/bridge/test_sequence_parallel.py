"""Sequence parallelism: Ulysses and ring attention against attention on one device.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_sequence_parallel.py` (8 simulated devices
from tests/conftest.py; about 2 minutes on 2 cores, mostly compiling)

`zerojax.parallel.sequence_parallel` runs SDPA with the sequence split over a `sequence` mesh
axis: Ulysses trades the split for a head split with all-to-alls, ring attention passes K/V
blocks around the axis with collective-permutes and merges them with an online softmax in
zig-zag order. These tests check the zig-zag relayout, the attention values and all three
gradients against the single-device reference (causal flag, boolean padding mask, additive
mask, grouped-query heads), that impossible splits are refused by name, and that HF Llama
(causal, GQA) and BERT (bidirectional, padded) at sequence 1024 on `mesh: {data: 2,
sequence: 4}` train through `zerojax.initialize` like torch on one device, with the expected
collectives in the compiled step.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import zerojax
from tests.bridge.test_models import GRAD_FLOOR, relative_error
from zerojax.bridge.lowerings.attention import attention_reference
from zerojax.parallel.sequence_parallel import (
    SequenceParallel,
    from_zigzag,
    sequence_parallel_attention,
    to_zigzag,
    zigzag_positions,
)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multidevice

MESH_SHAPE = {"data": 2, "sequence": 4}

# fp32 throughout. The split attention computes each output row as the same softmax-weighted
# sum over S = 64 keys as the reference, but in 2N = 8 blocks with rescaling (ring) or after
# exchanges that move no arithmetic (Ulysses): the reorder bound 2 (S - 1) u = 2 * 63 * 6e-8
# = 7.5e-6 relative to sum |p v| <= max |v|, normwise; the rescale factors exp(m_old - m_new)
# add one rounding per block (8 u). 1e-5 bounds the values. Gradients sum the same terms
# once more over the queries (another 64): 2e-5; the 1e-4 bar is kept, well above it.
VALUE_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _mesh():
    return jax.make_mesh(
        tuple(MESH_SHAPE.values()), tuple(MESH_SHAPE), axis_types=(AxisType.Auto,) * 2
    )


def _placement(attention):
    return SequenceParallel(
        mesh=_mesh(), axis="sequence", attention=attention, batch_axes=("data",)
    )


def test_zigzag_relayout_holds_chunks_j_and_2n_minus_1_minus_j_and_inverts():
    size, length = MESH_SHAPE["sequence"], 64
    chunk = length // (2 * size)

    def body(x):
        zig = to_zigzag(x, 0, "sequence", size)
        early, late = zigzag_positions(jax.lax.axis_index("sequence"), chunk, size)
        return zig, jnp.concatenate([early, late]), from_zigzag(zig, 0, "sequence", size)

    spec = P("sequence")
    zig, expected, back = jax.jit(
        jax.shard_map(body, mesh=_mesh(), in_specs=spec, out_specs=(spec, spec, spec))
    )(jnp.arange(length, dtype=jnp.int32))
    np.testing.assert_array_equal(zig, expected)
    # Device j holds chunk j then chunk 2N-1-j: the early and late halves of the causal work.
    first_device = np.asarray(zig[: 2 * chunk])
    assert list(first_device) == [*range(chunk), *range(length - chunk, length)]
    np.testing.assert_array_equal(back, np.arange(length))


def _attention_inputs(heads, kv_heads, mask_kind, batch=2, length=64, head_dim=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, length, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, length, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, length, head_dim)).astype(np.float32)
    causal, mask = False, None
    if mask_kind == "is_causal":
        causal = True
    elif mask_kind in ("padded_causal_bool", "padded_causal_additive"):
        # HF's form: an explicit causal mask with the second sequence's tail padded away.
        allowed = np.tril(np.ones((length, length), bool))[None, None].repeat(batch, 0)
        allowed[1, :, :, int(rng.integers(length // 2, length)) :] = False
        mask = allowed
        if mask_kind == "padded_causal_additive":
            mask = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)
    elif mask_kind == "per_head_bias":
        mask = rng.standard_normal((1, heads, length, length)).astype(np.float32)
    return q, k, v, mask, causal


def _reference(q, k, v, mask, causal):
    groups = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    return attention_reference(q, k, v, mask=mask, causal=causal)[0]


@pytest.mark.parametrize("attention", ["ulysses", "ring"])
@pytest.mark.parametrize(
    "heads, kv_heads, mask_kind",
    [
        (4, 2, "is_causal"),  # Ulysses: 2 kv heads < 4 devices are repeated before the split
        (8, 4, "padded_causal_bool"),  # Ulysses: 4 kv heads split over 4 devices as they are
        (4, 4, "padded_causal_additive"),
        (4, 1, "per_head_bias"),  # bidirectional with a per-head additive bias
        (4, 2, "none"),  # bidirectional (BERT-style)
    ],
)
def test_attention_matches_one_device_values_and_gradients(attention, heads, kv_heads, mask_kind):
    q, k, v, mask, causal = _attention_inputs(heads, kv_heads, mask_kind)
    placement = _placement(attention)

    def split(q, k, v):
        return sequence_parallel_attention(placement, q, k, v, mask, causal=causal, where="test")

    def whole(q, k, v):
        return _reference(q, k, v, mask, causal)

    compiled = jax.jit(split).lower(q, k, v).compile()
    assert relative_error(compiled(q, k, v), whole(q, k, v)) <= VALUE_RTOL

    # A random cotangent, so every output element's gradient path counts.
    cotangent = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.vdot(split(*a), cotangent), argnums=(0, 1, 2)))(q, k, v)
    expected = jax.grad(lambda *a: jnp.vdot(whole(*a), cotangent), argnums=(0, 1, 2))(q, k, v)
    for name, got, want in zip("qkv", grads, expected, strict=True):
        floor = GRAD_FLOOR * float(np.linalg.norm(want))
        assert relative_error(got, want, floor=floor) <= GRAD_RTOL, name

    text = compiled.as_text()
    if attention == "ulysses":
        # q, k, v to head-sharded and the output back; nothing goes around a ring.
        assert text.count("all-to-all(") == 4 and "collective-permute(" not in text
    else:
        # 3 zig-zag relayouts (2 each) + 2 for the output + K and V on N - 1 = 3 hops (the
        # mask's rows, when it has them, add 2 more); no all-to-all.
        permutes = text.count("collective-permute(")
        assert permutes >= 2 * 3 + 2 + 3, permutes
        assert "all-to-all(" not in text


def test_ulysses_runs_each_devices_heads_through_the_flash_kernel():
    """`kernels: {attention: pallas, interpret: true}`: the Pallas kernel (interpret mode on
    CPU) computes each device's heads over the whole sequence, between the all-to-alls."""
    q, k, v, mask, causal = _attention_inputs(4, 2, "padded_causal_bool", head_dim=16)

    def split(q, k, v):
        return sequence_parallel_attention(
            _placement("ulysses"), q, k, v, mask, kernel=("pallas", True), where="test"
        )

    assert "pallas_call" in str(jax.make_jaxpr(split)(q, k, v))  # the kernel, not the reference
    compiled = jax.jit(split).lower(q, k, v).compile()
    assert relative_error(compiled(q, k, v), _reference(q, k, v, mask, causal)) <= VALUE_RTOL
    assert compiled.as_text().count("all-to-all(") == 4
    cotangent = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.vdot(split(*a), cotangent), argnums=(0, 1, 2)))(q, k, v)
    expected = jax.grad(
        lambda *a: jnp.vdot(_reference(*a, mask, causal), cotangent), argnums=(0, 1, 2)
    )(q, k, v)
    for name, got, want in zip("qkv", grads, expected, strict=True):
        assert relative_error(got, want) <= GRAD_RTOL, name


def test_ulysses_refuses_heads_that_do_not_split_over_the_axis_and_auto_picks_ring():
    q, k, v, _, _ = _attention_inputs(6, 6, "is_causal")
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel.attention='ulysses': 6 attention heads do not split over mesh "
        r"axis sequence=4 \(layer 3\); .* Use attention: ring \(or auto\)",
    ):
        sequence_parallel_attention(_placement("ulysses"), q, k, v, causal=True, where="layer 3")
    out = jax.jit(
        lambda q, k, v: sequence_parallel_attention(
            _placement("auto"), q, k, v, causal=True, where="layer 3"
        )
    )
    assert "collective-permute(" in out.lower(q, k, v).compile().as_text()
    assert relative_error(out(q, k, v), _reference(q, k, v, None, True)) <= VALUE_RTOL


def test_sequence_that_does_not_split_into_chunks_is_refused():
    q, k, v, _, _ = _attention_inputs(4, 4, "none", length=60)
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel \(ring\): query sequence length 60 does not split into 8 "
        r"equal chunks over mesh axis sequence=4 \(attn\); pad the sequence to a multiple of 8",
    ):
        sequence_parallel_attention(_placement("ring"), q, k, v, where="attn")


# --- HF models through zerojax.initialize ------------------------------------------------

VOCAB, SEQ, BATCH, STEPS = 128, 1024, 2, 3
# The sharded step differs from torch's single-device step in reduction order only (attention
# as above, XLA's blocking of the projections, the gradient sum over 8 shards): ~1e-7 relative
# on the loss per step, and Adam's normalised update keeps a relative gradient difference from
# growing over 3 steps (tests/bridge/test_expert_parallel.py's argument). 1e-5 on the loss and
# 1e-4 on every gradient are the bars. Adam's first update is lr * g / |g| per element:
# an element whose gradient is float noise on both sides may step by +lr on one and -lr on the
# other, and the next gradients inherit that. Measured with plain data parallelism (no sequence
# split) on this model: gradient error 8.6e-5 after one step at lr 1e-2, 7.8e-6 at lr 1e-3 (and
# 6e-7 before any step, with or without the split); so lr 1e-3.
LOSS_RTOL = 1e-5
LR = 1e-3


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    return transformers.LlamaForCausalLM(config), {"input_ids": tokens, "labels": tokens}


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=SEQ,
        # Dropout draws differ between torch and JAX; the comparison needs none.
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, int(torch.randint(SEQ // 2, SEQ, ())) :] = 0  # padded tail
    inputs = {"input_ids": tokens, "labels": tokens, "attention_mask": attention_mask}
    return transformers.BertForMaskedLM(config), inputs


MODELS = {"llama": llama, "bert": bert}


# Each Llama decoder layer recomputed in the backward pass: the layout bench/long_context.py
# measures for the longest sequences.
CHECKPOINT_LAYERS = {"modules": {r"model\.layers\.\d+": "full"}}


def _train_like_torch(model, optimizer, reference, ref_optimizer, inputs):
    """STEPS AdamW steps of the wrapped model and its torch reference on `inputs`: every loss
    within LOSS_RTOL of torch's, every gradient within GRAD_RTOL (relative to the largest
    gradient's norm times GRAD_FLOOR at the least)."""
    engine = model.engine
    names = dict(reference.named_parameters())
    for step in range(STEPS):
        ours = model(**inputs).loss
        ours.backward()
        theirs = reference(**inputs).loss
        theirs.backward()
        a, b = ours.item(), theirs.item()
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {step}: loss {a} vs torch {b}"
        expected = {n: p.grad.numpy() for n, p in names.items() if p.grad is not None}
        floor = GRAD_FLOOR * max(np.linalg.norm(g) for g in expected.values())
        for param, want in expected.items():
            got = np.asarray(engine.grad_value(engine.alias.get(param, param), np.float32))
            err = relative_error(got, want, floor=floor)
            assert err <= GRAD_RTOL, f"step {step}: gradient of {param}: {err:.2e}"
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize(
    "name, attention, checkpointing",
    [
        ("llama", "ulysses", False),
        ("bert", "ulysses", False),
        ("llama", "ring", False),
        ("bert", "ring", False),
        ("llama", "ring", True),
    ],
)
@pytest.mark.long
def test_hf_model_trains_sequence_parallel_like_torch_on_one_device(name, attention, checkpointing):
    torch.manual_seed(0)
    module, inputs = MODELS[name]()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    config = {"mesh": MESH_SHAPE, "sequence_parallel": {"attention": attention}}
    if checkpointing:
        config["activation_checkpointing"] = CHECKPOINT_LAYERS
    model, optimizer = zerojax.initialize(module, optimizer, config)
    engine = model.engine
    _train_like_torch(model, optimizer, reference, ref_optimizer, inputs)
    # The tokens and every activation between attention blocks stay split over `sequence`.
    assert engine.plan.input_sharding(2).spec == P("data", "sequence")
    step = engine.compiled_programs()["loss_and_grads"].as_text()
    if attention == "ulysses":
        # q, k, v in and the output out, per layer (2), forward and backward.
        assert step.count("all-to-all(") >= 4 * 2 * 2, step.count("all-to-all(")
    else:
        assert step.count("collective-permute(") >= (2 * 3 + 2 + 3) * 2 * 2
    # No activation is gathered whole: sequence parallelism keeps every device's share (BERT's
    # boolean padding mask, a few hundred bytes, is the only thing XLA all-gathers).
    gathered = [line for line in step.splitlines() if "all-gather(" in line and "f32[" in line]
    assert not gathered, gathered[:3]


# --- per-module layouts: a sequence-parallel vision tower beside a tensor-parallel LM --------

IMAGE, PATCH = 24, 8  # 9 patches + CLS = 10 vision tokens: 5 per device of `sequence: 2`
LM_LAYER = r"^model\.language_model\.layers\.\d+\."
# Megatron's split of the language model only; the vision tower's weights stay whole.
LM_TENSOR_PARALLEL = [
    {"pattern": LM_LAYER + r"self_attn\.(q|k|v)_proj\.weight$", "spec": ["tensor", None]},
    {"pattern": LM_LAYER + r"self_attn\.o_proj\.weight$", "spec": [None, "tensor"]},
    {"pattern": LM_LAYER + r"mlp\.(gate|up)_proj\.weight$", "spec": ["tensor", None]},
    {"pattern": LM_LAYER + r"mlp\.down_proj\.weight$", "spec": [None, "tensor"]},
]


def llava():
    """LLaVA from tiny configs: CLIP vision tower, Llama language model (GQA)."""
    vision = transformers.CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE,
        patch_size=PATCH,
    )
    text = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    image_token, num_image_tokens = VOCAB - 1, (IMAGE // PATCH) ** 2
    config = transformers.LlavaConfig(
        vision_config=vision.to_dict() | {"model_type": "clip_vision_model"},
        text_config=text.to_dict() | {"model_type": "llama"},
        image_token_index=image_token,
        image_seq_length=num_image_tokens,
        attn_implementation="sdpa",
    )
    batch = 4
    tokens = torch.randint(4, image_token, (batch, 32 + num_image_tokens))
    tokens[:, 1 : 1 + num_image_tokens] = image_token
    labels = tokens.clone()
    labels[tokens == image_token] = -100
    inputs = {
        "input_ids": tokens,
        "pixel_values": torch.randn(batch, 3, IMAGE, IMAGE),
        "labels": labels,
    }
    return transformers.LlavaForConditionalGeneration(config), inputs


@pytest.mark.long
def test_llava_trains_with_a_sequence_parallel_vision_tower_and_tensor_parallel_lm():
    """Issue 13's per-module layout on one mesh: the vision tower's attention runs Ulysses over
    `sequence`, the language model is split over `tensor` by rules; one program, like torch."""
    torch.manual_seed(0)
    module, inputs = llava()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    config = {
        "mesh": {"data": 2, "sequence": 2, "tensor": 2},
        "rules": LM_TENSOR_PARALLEL,
        "sequence_parallel": {"attention": "ulysses", "modules": [r"model\.vision_tower"]},
    }
    model, optimizer = zerojax.initialize(module, optimizer, config)
    engine = model.engine
    _train_like_torch(model, optimizer, reference, ref_optimizer, inputs)
    # The text tokens are not split (the language model is tensor-parallel); the LM's weights
    # are split over `tensor`, the vision tower's are whole.
    assert engine.plan.input_sharding(2).spec == P("data", None)
    compute = engine.plan.compute_params
    assert compute["model.language_model.layers.0.self_attn.q_proj.weight"].spec[0] == "tensor"
    assert compute["model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"].spec[0] is None
    # Ulysses in both vision layers (XLA may fuse the q/k/v exchanges into one all-to-all, so
    # at least one in and one out per layer); the language model's attention runs whole.
    step = engine.compiled_programs()["loss_and_grads"].as_text()
    assert step.count("all-to-all(") >= 2 * 2, step.count("all-to-all(")
