"""Flash attention: the Pallas kernels (interpret mode) against the jnp reference, and the
reference against torch's scaled_dot_product_attention; forward and gradients, fp32 and bf16,
causal, grouped-query, bool/additive masks (and the additive mask's gradient, a learned bias),
segment ids, dropout; CUDA lowering without a GPU;
shard_map over the batch; bad configs.

Run: .venv/bin/python -m pytest -q tests/pallas_kernels/test_flash_attention.py -p no:cacheprovider

Interpret mode runs the kernels on CPU, so shapes stay small (seq 64-128) with 32-wide blocks to
give every grid several programs and every inner loop several tiles; each comparison is one
jitted forward + vjp (eager vjp through pallas_call re-traces op by op and is 3x slower).
"""

from __future__ import annotations

import functools
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec as P

from tests import tolerances
from zerojax.pallas_kernels.flash_attention import (
    FlashAttentionConfig,
    flash_attention,
    flash_attention_reference,
)
from zerojax.pallas_kernels.flash_attention.causal_blocks import causal_block_attention
from zerojax.pallas_kernels.flash_attention.reference import dropout_keep, dropout_seed

# Compared elementwise against tolerances.attention / attention_gradients: bounds derived from
# float32 rounding along each entry's computation (head_dim-term scores, exp, seq_k-term sums,
# P @ V, dS, the dq/dk/dv contractions) on the absolute values of these inputs, plus, in bf16,
# one bf16 rounding (unit roundoff u_bf16 = 2**-8, half the bf16 eps 2**-7) of each of P, dP,
# dS, O and the results that the kernels and the reference's autodiff round to bf16.


SMALL_BLOCKS = FlashAttentionConfig(
    block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32, block_q_dq=32, block_k_dq=32
)
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


def _seed(request) -> int:
    """A different seed per test case, stable across runs."""
    return zlib.crc32(request.node.name.encode())


def _normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _qkv(seed, *, batch=1, heads_q=2, heads_kv=2, seq_q=64, seq_k=64, head_dim=64, dtype):
    k = jax.random.split(jax.random.key(seed), 3)
    return (
        _normal(k[0], (batch, heads_q, seq_q, head_dim), dtype),
        _normal(k[1], (batch, heads_kv, seq_k, head_dim), dtype),
        _normal(k[2], (batch, heads_kv, seq_k, head_dim), dtype),
    )


def _torch64(x) -> torch.Tensor:
    return torch.tensor(np.asarray(jnp.asarray(x, jnp.float32)), dtype=torch.float64)


def error_bounds(q, k, v, d_out, dtype, *, sides=2, **kwargs) -> dict:
    """Bounds on |pallas - reference| for "out", "dq", "dk", "dv" and, for an additive float
    mask, "dbias" (tolerances.attention and attention_gradients; `sides=1` against float64) for
    flash_attention(q, k, v, **kwargs) under `d_out`."""
    heads_q, heads_kv = q.shape[1], k.shape[1]
    group = heads_q // heads_kv
    tq, tk, tv, tdo = (_torch64(a) for a in (q, k, v, d_out))
    tk, tv = (t.repeat_interleave(group, dim=1) for t in (tk, tv))
    mask = kwargs.get("mask")
    if "segment_ids" in kwargs:
        q_ids, kv_ids = (torch.tensor(np.asarray(i)) for i in kwargs["segment_ids"])
        mask = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    elif mask is not None:
        mask = torch.tensor(np.asarray(mask)) if mask.dtype == jnp.bool_ else _torch64(mask)
    common = {"mask": mask, "scale": kwargs.get("scale"), "causal": kwargs.get("causal", False)}
    low = torch.float32 if dtype == jnp.float32 else torch.bfloat16
    dropout_p = kwargs.get("dropout_p", 0.0)
    grads = tolerances.attention_gradients(
        tq, tk, tv, tdo, low_dtype=low, dropout_p=dropout_p, sides=sides, **common
    )
    out = tolerances.attention(tq, tk, tv, weights_dtype=low, out_dtype=low, sides=sides, **common)
    out = out / (1 - dropout_p)
    u = tolerances.unit_roundoff(torch.float32)
    for name in ("dk", "dv"):  # GQA: the group's heads summed, a group-term sum
        b, _, n, d = grads[name].shape
        grads[name] = grads[name].reshape(b, heads_kv, group, n, d).sum(2) * (1 + group * u)
    bounds = {"out": out} | {name: grads[name] for name in ("dq", "dk", "dv")}
    if mask is not None and mask.is_floating_point():
        # dbias: dS summed over the bias's broadcast dims, an n-term sum (n u relative).
        shape = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        dims = tuple(i for i, size in enumerate(shape) if size == 1)
        count = math.prod(grads["ds"].shape[i] for i in dims)
        summed = grads["ds"].sum(dims, keepdim=True) if dims else grads["ds"]
        bounds["dbias"] = (summed * (1 + count * u)).reshape(mask.shape)
    return bounds


def assert_within(actual, expected, bound, what: str):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(np.asarray(actual.astype(jnp.float32))).all(), f"{what}: non-finite"
    tolerances.assert_within(_torch64(actual), _torch64(expected), bound, what)


# The interpreted kernels unroll into large XLA programs whose CPU compile dominates these
# tests; backend optimization level 0 compiles them ~2.5x faster and they still run in ms.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _forward_and_grads(q, k, v, d_out, **kwargs):
    """(out, (dq, dk, dv)) of flash_attention(**kwargs), one jitted program."""

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **kwargs), q, k, v)
        return out, vjp(d_out)

    return run(q, k, v, d_out)


def _compare_pallas_with_reference(q, k, v, seed, dtype, **kwargs):
    """Pallas (interpret) vs the xla reference: forward and dq, dk, dv under a random cotangent."""
    d_out = _normal(jax.random.key(seed + 1), q.shape[:3] + v.shape[3:], q.dtype)
    want, want_grads = _forward_and_grads(q, k, v, d_out, implementation="xla", **kwargs)
    got, got_grads = _forward_and_grads(
        q,
        k,
        v,
        d_out,
        implementation="pallas",
        interpret=True,
        block_config=SMALL_BLOCKS,
        **kwargs,
    )
    bounds = error_bounds(q, k, v, d_out, dtype, **kwargs)
    assert_within(got, want, bounds["out"], "forward")
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads, strict=True):
        assert_within(g, w, bounds[name], name)
    return got, got_grads


def _forward_and_bias_grads(q, k, v, bias, d_out, **kwargs):
    """(out, (dq, dk, dv, dbias)) of flash_attention(mask=bias, **kwargs), one jitted program."""

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def run(q, k, v, bias, d_out):
        out, vjp = jax.vjp(
            lambda q, k, v, bias: flash_attention(q, k, v, mask=bias, **kwargs), q, k, v, bias
        )
        return out, vjp(d_out)

    return run(q, k, v, bias, d_out)


# A learned additive bias passed as the mask, in every broadcast shape torch accepts:
# name -> bias shape for q [batch, heads, seq_q, _] and k [_, _, seq_k, _].
BIAS_SHAPES = {
    "full": lambda b, h, sq, sk: (b, h, sq, sk),
    "per-head": lambda b, h, sq, sk: (1, h, sq, sk),  # Swin, T5: one table per head
    "per-batch": lambda b, h, sq, sk: (b, 1, sq, sk),
    "plane": lambda b, h, sq, sk: (sq, sk),
}


def _lowered_cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _triton_calls(text: str) -> int:
    return len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text))


def _data_mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _to_torch(a):
    return torch.tensor(np.asarray(a.astype(jnp.float32)))


class TestReferenceAgainstTorch:
    """The reference is the spec: it must be torch's SDPA (fp32, CPU)."""

    @pytest.mark.parametrize(
        "case",
        [
            "plain",
            "causal",
            "causal-short-q",
            "causal-long-q",
            "bool-mask",
            "additive-mask",
            "gqa-causal",
            "scale",
        ],
    )
    def test_forward_and_grads_match_torch_sdpa(self, request, case):
        seed = _seed(request)
        heads_kv = 2 if case.startswith("gqa") else 4
        seq_q = {"causal-short-q": 24, "causal-long-q": 80}.get(case, 48)
        q, k, v = _qkv(
            seed,
            batch=2,
            heads_q=4,
            heads_kv=heads_kv,
            seq_q=seq_q,
            seq_k=48,
            head_dim=32,
            dtype=jnp.float32,
        )
        keys = jax.random.split(jax.random.key(seed + 7), 2)
        kwargs, torch_kwargs = {}, {}
        if "causal" in case:
            kwargs["causal"] = torch_kwargs["is_causal"] = True
        if case == "bool-mask":
            mask = jax.random.bernoulli(keys[0], 0.6, (2, 1, seq_q, 48))
            mask = mask.at[0, 0, 5].set(False)  # a fully masked row: torch gives zeros
            kwargs["mask"], torch_kwargs["attn_mask"] = mask, torch.tensor(np.asarray(mask))
        if case == "additive-mask":
            mask = _normal(keys[0], (4, seq_q, 48)).at[1, 3].set(-jnp.inf)
            kwargs["mask"], torch_kwargs["attn_mask"] = mask, _to_torch(mask)
        if case.startswith("gqa"):
            torch_kwargs["enable_gqa"] = True
        if case == "scale":
            kwargs["scale"] = torch_kwargs["scale"] = 0.3
        d_out = _normal(keys[1], q.shape)

        out, grads = _forward_and_grads(q, k, v, d_out, implementation="xla", **kwargs)
        tq, tk, tv = (_to_torch(a).requires_grad_() for a in (q, k, v))
        t_out = F.scaled_dot_product_attention(tq, tk, tv, **torch_kwargs)
        t_out.backward(_to_torch(d_out))
        # torch's CPU SDPA is float32 throughout too: the same two-sided bounds.
        bounds = error_bounds(q, k, v, d_out, jnp.float32, **kwargs)
        tolerances.assert_within(_torch64(out), t_out.detach().double(), bounds["out"], "out")
        for name, got, want in zip(("dq", "dk", "dv"), grads, (tq, tk, tv), strict=True):
            tolerances.assert_within(_torch64(got), want.grad.double(), bounds[name], name)

    @pytest.mark.parametrize("bias_shape", list(BIAS_SHAPES))
    def test_bias_gradient_matches_torch_sdpa(self, request, bias_shape):
        """An additive float mask is a learned bias (Swin's relative position table, T5's
        relative attention bias): its gradient is dS summed over the broadcast dimensions, as
        torch autograd gives it. Against torch in float64: the one-sided (sides=1) bounds of
        error_bounds on the float32 reference's own rounding."""
        seed = _seed(request)
        q, k, v = _qkv(
            seed, batch=2, heads_q=4, heads_kv=2, seq_q=40, seq_k=48, head_dim=32, dtype=jnp.float32
        )
        keys = jax.random.split(jax.random.key(seed + 7), 2)
        bias = _normal(keys[0], BIAS_SHAPES[bias_shape](2, 4, 40, 48))
        d_out = _normal(keys[1], q.shape)
        out, grads = _forward_and_bias_grads(q, k, v, bias, d_out, implementation="xla")

        t_args = [torch.tensor(np.asarray(a), dtype=torch.float64) for a in (q, k, v, bias)]
        t_args = [a.requires_grad_() for a in t_args]
        t_out = F.scaled_dot_product_attention(*t_args[:3], attn_mask=t_args[3], enable_gqa=True)
        t_out.backward(torch.tensor(np.asarray(d_out), dtype=torch.float64))
        bounds = error_bounds(q, k, v, d_out, jnp.float32, sides=1, mask=bias)
        for name, got, want in zip(
            ("out", "dq", "dk", "dv", "dbias"), (out, *grads), (t_out, *t_args), strict=True
        ):
            want = (want if name == "out" else want.grad).detach()
            tolerances.assert_within(_torch64(got), want, bounds[name], name)
        assert float(np.abs(np.asarray(grads[3])).max()) > 0.01  # not a vanished gradient

    def test_fully_masked_rows_are_zero_like_torch(self):
        q, k, v = _qkv(3, seq_q=16, seq_k=16, head_dim=16, dtype=jnp.float32)
        mask = jnp.ones((16, 16), bool).at[2].set(False)
        out = jax.jit(flash_attention_reference)(q, k, v, mask=mask)
        torch_out = F.scaled_dot_product_attention(
            *(_to_torch(a) for a in (q, k, v)), attn_mask=torch.tensor(np.asarray(mask))
        )
        assert not torch_out[:, :, 2].any()
        assert not np.asarray(out[:, :, 2]).any()

    def test_dropout_keeps_about_one_minus_p(self):
        keep = jax.jit(
            lambda key: dropout_keep(
                dropout_seed(key),
                jnp.arange(2)[:, None, None, None],
                jnp.arange(4)[None, :, None, None],
                jnp.arange(128)[None, None, :, None],
                jnp.arange(128)[None, None, None, :],
                dropout_p=0.3,
            )
        )(jax.random.key(0))
        assert abs(float(keep.mean()) - 0.7) < 0.01
        # Neighbouring rows, heads and batches must not share a mask.
        assert float((keep[0, 0, 0] == keep[0, 0, 1]).mean()) < 0.7
        assert float((keep[0, 0] == keep[0, 1]).mean()) < 0.7
        assert float((keep[0] == keep[1]).mean()) < 0.7


# (name, shape overrides, attention kwargs builder): each runs pallas (interpret) vs reference.
def _bool_mask(key, batch, heads_q, seq_q, seq_k):
    mask = jax.random.bernoulli(key, 0.7, (batch, 1, seq_q, seq_k))
    return {"mask": mask.at[:, :, 3].set(False)}  # a fully masked row in every batch


def _additive_mask(key, batch, heads_q, seq_q, seq_k):
    mask = jax.random.normal(key, (1, heads_q, seq_q, seq_k)).at[0, 1, 7].set(-jnp.inf)
    return {"mask": mask}


def _segments(key, batch, heads_q, seq_q, seq_k):
    # Packed sequences: sorted ids, each batch cut at different places.
    q_ids = jnp.sort(jax.random.randint(key, (batch, seq_q), 0, 3), axis=1)
    kv_ids = jnp.sort(jax.random.randint(jax.random.fold_in(key, 1), (batch, seq_k), 0, 3), axis=1)
    return {"segment_ids": (q_ids, kv_ids)}


# name: (shape overrides, kwargs builder or None, extra kwargs, dtypes run by default, dtypes
# marked slow). The default set covers every feature in fp32 and bf16 once; `-m slow` adds the
# remaining combinations.
F32, BF16 = jnp.float32, jnp.bfloat16
KERNEL_CASES = {
    "plain": ({"batch": 2}, None, {}, (), (F32, BF16)),
    "causal-gqa-seq-q<seq-k": (
        {"heads_q": 4, "seq_k": 128},
        None,
        {"causal": True},
        (F32,),
        (BF16,),
    ),
    "causal-seq-q>seq-k": ({"seq_q": 128}, None, {"causal": True}, (BF16,), (F32,)),
    "bool-mask": ({"batch": 2}, _bool_mask, {}, (F32, BF16), ()),
    "additive-mask-per-head-gqa": (
        {"heads_q": 4, "heads_kv": 2},
        _additive_mask,
        {},
        (F32,),
        (BF16,),
    ),
    "segment-ids-causal": ({"batch": 2}, _segments, {"causal": True}, (BF16,), (F32,)),
    "head-dim-128-gqa": (
        {"heads_q": 4, "heads_kv": 1, "head_dim": 128},
        None,
        {"scale": 0.05},
        (F32,),
        (BF16,),
    ),
}
KERNEL_PARAMS = [
    pytest.param(
        name,
        dtype,
        id=f"{name}-{'f32' if dtype == F32 else 'bf16'}",
        marks=[pytest.mark.slow] if dtype in slow else [],
    )
    for name, (_, _, _, fast, slow) in KERNEL_CASES.items()
    for dtype in (*fast, *slow)
]


class TestFlashAttentionKernel:
    @pytest.mark.parametrize("name, dtype", KERNEL_PARAMS)
    def test_pallas_matches_reference(self, request, name, dtype):
        seed = _seed(request)
        shape, build, extra, _, _ = KERNEL_CASES[name]
        q, k, v = _qkv(seed, dtype=dtype, **shape)
        kwargs = dict(extra)
        if build is not None:
            batch, heads_q, seq_q, _ = q.shape
            kwargs |= build(jax.random.key(seed + 2), batch, heads_q, seq_q, k.shape[2])
        out, grads = _compare_pallas_with_reference(q, k, v, seed, dtype, **kwargs)
        if name == "bool-mask":  # the fully masked row: zeros, zero dq, like torch
            assert not np.asarray(out[:, :, 3].astype(jnp.float32)).any()
            assert not np.asarray(grads[0][:, :, 3].astype(jnp.float32)).any()
        if name.startswith("additive-mask"):  # a row of -inf: zeros, not NaN
            assert not np.asarray(out[0, 1, 7].astype(jnp.float32)).any()

    def test_dropout_mask_matches_reference(self, request):
        """Same hash-generated keep mask in the reference and the three kernels: one differing
        element would move the output or a gradient by about weight * |v| (~1e-2 here), three
        orders of magnitude beyond the fp32 tolerance."""
        seed = _seed(request)
        q, k, v = _qkv(seed, heads_q=4, heads_kv=2, seq_k=128, dtype=jnp.float32)
        kwargs = {"causal": True, "dropout_p": 0.25, "dropout_rng": jax.random.key(seed + 3)}
        out, _ = _compare_pallas_with_reference(q, k, v, seed, jnp.float32, **kwargs)
        no_dropout = flash_attention(q, k, v, causal=True, implementation="xla")
        assert float(jnp.abs(out - no_dropout).max()) > 0.1

    @pytest.mark.parametrize(
        "bias_shape, extra",
        [
            pytest.param("full", {}, id="full"),
            pytest.param("per-head", {"heads_q": 4, "heads_kv": 2}, id="per-head-gqa"),
            pytest.param("per-batch", {"causal": True}, id="per-batch-causal"),
            pytest.param("plane", {"dropout_p": 0.25}, id="plane-dropout"),
        ],
    )
    def test_bias_gradient_matches_reference(self, request, bias_shape, extra):
        """The dQ kernel's dbias tiles, summed over the bias's broadcast dims by the api, against
        the reference's autodiff. Causal checks the zeroed tiles of skipped key blocks, dropout
        that dS uses the dropped dP."""
        seed = _seed(request)
        extra = dict(extra)
        heads_q, heads_kv = extra.pop("heads_q", 2), extra.pop("heads_kv", 2)
        q, k, v = _qkv(seed, batch=2, heads_q=heads_q, heads_kv=heads_kv, dtype=jnp.float32)
        if extra.get("dropout_p"):
            extra["dropout_rng"] = jax.random.key(seed + 3)
        keys = jax.random.split(jax.random.key(seed + 1), 2)
        bias = _normal(keys[0], BIAS_SHAPES[bias_shape](*q.shape[:3], k.shape[2]))
        d_out = _normal(keys[1], q.shape)
        want, want_grads = _forward_and_bias_grads(
            q, k, v, bias, d_out, implementation="xla", **extra
        )
        got, got_grads = _forward_and_bias_grads(
            q,
            k,
            v,
            bias,
            d_out,
            implementation="pallas",
            interpret=True,
            block_config=SMALL_BLOCKS,
            **extra,
        )
        bounds = error_bounds(q, k, v, d_out, jnp.float32, mask=bias, **extra)
        assert_within(got, want, bounds["out"], "forward")
        for name, g, w in zip(("dq", "dk", "dv", "dbias"), got_grads, want_grads, strict=True):
            assert_within(g, w, bounds[name], name)
        assert float(jnp.abs(got_grads[3]).max()) > 0.01  # not a vanished gradient

    def test_auto_on_cpu_is_the_xla_implementation(self):
        """Off GPU, auto is "xla": the reference, or the causal blocks for plain causal
        self-attention (TestCausalBlocks compares those with the reference)."""
        q, k, v = _qkv(5, dtype=jnp.float32)
        np.testing.assert_array_equal(flash_attention(q, k, v), flash_attention_reference(q, k, v))
        np.testing.assert_array_equal(
            flash_attention(q, k, v, causal=True),
            causal_block_attention(q, k, v),
        )

    @pytest.mark.parametrize("head_dim", [64, 128])
    def test_lowers_for_cuda(self, head_dim):
        """Default block config, every feature on: forward is 1 Triton call, grad 3 (forward
        with lse, dK/dV, dQ)."""
        q = jnp.ones((2, 8, 256, head_dim), jnp.bfloat16)
        kv = jnp.ones((2, 2, 256, head_dim), jnp.bfloat16)
        mask = jnp.ones((2, 1, 256, 256), bool)
        ids = jnp.zeros((2, 256), jnp.int32)

        def fn(q, k, v, mask, ids, additive):
            return flash_attention(
                q,
                k,
                v,
                mask=mask,
                segment_ids=(ids, ids),
                causal=True,
                dropout_p=0.1,
                dropout_rng=jax.random.key(0),
                implementation="pallas",
            ) + flash_attention(q, k, v, mask=additive, implementation="pallas")

        def loss(q, k, v, *rest):
            return fn(q, k, v, *rest).astype(jnp.float32).sum()

        additive = jnp.zeros((1, 8, 256, 256), jnp.bfloat16)
        args = (q, kv, kv, mask, ids, additive)
        assert _triton_calls(_lowered_cuda_text(fn, *args)) == 2
        assert _triton_calls(_lowered_cuda_text(jax.grad(loss, argnums=(0, 1, 2)), *args)) == 6

    def test_bias_gradient_lowers_for_cuda(self):
        """The backward with a differentiated bias still lowers to the 3 Triton calls (the dQ
        kernel writes dbias as a second output); an undifferentiated one adds no output."""
        q = jnp.ones((2, 4, 128, 64), jnp.bfloat16)
        bias = jnp.zeros((1, 4, 128, 128), jnp.float32)

        def loss(q, bias):
            out = flash_attention(q, q, q, mask=bias, implementation="pallas")
            return out.astype(jnp.float32).sum()

        with_bias = _lowered_cuda_text(jax.grad(loss, argnums=(0, 1)), q, bias)
        without_bias = _lowered_cuda_text(jax.grad(loss), q, bias)
        assert _triton_calls(with_bias) == _triton_calls(without_bias) == 3
        dbias_tile = "tensor<2x4x128x128xf32>"  # the dQ kernel's [batch, heads_q, sq, sk] dS
        assert dbias_tile in with_bias
        assert dbias_tile not in without_bias

    @pytest.mark.multidevice
    def test_shard_map_over_batch(self, request):
        seed = _seed(request)
        q, k, v = _qkv(seed, batch=8, heads_q=2, heads_kv=1, dtype=jnp.float32)
        d_out = _normal(jax.random.key(seed + 1), q.shape)

        def local(q, k, v, d_out):
            def fn(q, k, v):
                return flash_attention(
                    q,
                    k,
                    v,
                    causal=True,
                    implementation="pallas",
                    interpret=True,
                    block_config=SMALL_BLOCKS,
                )

            out, vjp = jax.vjp(fn, q, k, v)
            return out, *vjp(d_out)

        sharded = jax.jit(
            jax.shard_map(
                local,
                mesh=_data_mesh(),
                in_specs=P("data"),
                out_specs=P("data"),
                check_vma=False,  # the Pallas interpreter does not track varying manual axes
            ),
            compiler_options=FAST_COMPILE,
        )
        got = sharded(q, k, v, d_out)
        assert got[0].sharding.spec == P("data")
        want, want_grads = _forward_and_grads(q, k, v, d_out, implementation="xla", causal=True)
        bounds = error_bounds(q, k, v, d_out, jnp.float32, causal=True)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, *want_grads), strict=True):
            assert_within(g, w, bounds[name], name)


class TestCausalBlocks:
    """The xla implementation of plain causal self-attention (causal_blocks.py): query blocks
    scored against the keys they may see, flash-style backward from the saved logsumexp."""

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
    def test_matches_the_reference(self, request, dtype, heads_kv):
        """Forward and dq, dk, dv within the same derived bounds the pallas kernel meets: both
        sum in another order than the reference and round the same operands to bf16."""
        seed = _seed(request)
        q, k, v = _qkv(
            seed,
            batch=2,
            heads_q=4,
            heads_kv=heads_kv,
            seq_q=128,
            seq_k=128,
            head_dim=32,
            dtype=dtype,
        )
        d_out = _normal(jax.random.key(seed + 1), q.shape, dtype)

        @jax.jit
        def reference(q, k, v, d_out):
            out, vjp = jax.vjp(
                lambda q, k, v: flash_attention_reference(q, k, v, causal=True), q, k, v
            )
            return out, vjp(d_out)

        want, want_grads = reference(q, k, v, d_out)
        got, got_grads = _forward_and_grads(q, k, v, d_out, implementation="xla", causal=True)
        bounds = error_bounds(q, k, v, d_out, dtype, causal=True)
        assert_within(got, want, bounds["out"], "forward")
        for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads, strict=True):
            assert_within(g, w, bounds[name], name)

    def test_scores_only_the_visible_keys(self):
        """4 query blocks: the score dots cover 1+2+3+4 of 16 block pairs, so the program does
        fewer FLOPs than the reference's full [seq, seq] scores (XLA's own count)."""
        q, k, v = _qkv(
            3, batch=2, heads_q=4, heads_kv=4, seq_q=256, seq_k=256, head_dim=32, dtype=jnp.float32
        )

        def flops(attention):
            grad = jax.grad(lambda q, k, v: attention(q, k, v).sum(), argnums=(0, 1, 2))
            return jax.jit(grad).lower(q, k, v).compile().cost_analysis()["flops"]

        blocked = flops(causal_block_attention)
        full = flops(lambda q, k, v: flash_attention_reference(q, k, v, causal=True))
        # Forward: QK^T and PV at 10/16; backward: QK^T again (recomputed) plus four dots at
        # 10/16; the reference: six [seq, seq] dots. 7 * 10/16 / 6 = 0.73 of the dot FLOPs.
        assert blocked < 0.8 * full, (blocked, full)

    def test_rejects_shapes_it_does_not_serve(self):
        q, k, v = _qkv(4, seq_q=40, seq_k=48, head_dim=16, dtype=jnp.float32)
        with pytest.raises(ValueError, match="seq_q == seq_k"):
            causal_block_attention(q, k, v)


class TestBadConfig:
    @pytest.mark.parametrize(
        "kwargs, message",
        [
            ({"block_q": 48}, r"block_q=48 must be a power of two >= 16"),
            ({"block_k_dq": 8}, r"block_k_dq=8 must be a power of two >= 16"),
            ({"num_warps": 3}, r"num_warps=3 must be None or one of"),
            ({"num_stages": 0}, r"num_stages=0 must be an int >= 1"),
        ],
    )
    def test_config_validation(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            FlashAttentionConfig(**kwargs)

    def test_sequence_not_a_multiple_of_the_block(self):
        q, k, v = _qkv(1, seq_q=96, seq_k=64, dtype=jnp.float32)
        with pytest.raises(ValueError, match=r"seq_q=96 must be a multiple of block_q=64"):
            flash_attention(
                q,
                k,
                v,
                implementation="pallas",
                interpret=True,
                block_config=FlashAttentionConfig(block_q=64),
            )
        # "auto" falls back to the reference instead.
        out = flash_attention(
            q, k, v, interpret=True, block_config=FlashAttentionConfig(block_q=64)
        )
        np.testing.assert_array_equal(out, flash_attention_reference(q, k, v))

    def test_unsupported_head_dim(self):
        q, k, v = _qkv(1, seq_q=32, seq_k=32, head_dim=80, dtype=jnp.float32)
        with pytest.raises(ValueError, match=r"head_dim=80 must be a power of two"):
            flash_attention(q, k, v, implementation="pallas", interpret=True)

    @pytest.mark.parametrize(
        "change, message",
        [
            (
                {"k": jnp.ones((1, 3, 32, 16)), "v": jnp.ones((1, 3, 32, 16))},
                r"heads_q=2 must be a multiple of heads_kv=3",
            ),
            ({"mask": jnp.ones((3, 32, 32), bool)}, r"mask.shape=\(3, 32, 32\) must broadcast"),
            ({"dropout_p": 0.1}, r"dropout_p=0.1 > 0 needs a dropout_rng"),
            ({"dropout_p": 1.0, "dropout_rng": jax.random.key(0)}, r"must be in \[0, 1\)"),
            ({"implementation": "cuda"}, r"implementation='cuda' must be one of"),
            ({"q": jnp.ones((2, 32, 16))}, r"must be \[batch, heads, seq, head_dim\]"),
            ({"segment_ids": (jnp.zeros((1, 32)), jnp.zeros((1, 16)))}, r"segment_ids must be"),
        ],
    )
    def test_bad_inputs(self, change, message):
        args = {
            "q": jnp.ones((1, 2, 32, 16)),
            "k": jnp.ones((1, 2, 32, 16)),
            "v": jnp.ones((1, 2, 32, 16)),
        } | change
        q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
        with pytest.raises(ValueError, match=message):
            flash_attention(q, k, v, **args)
