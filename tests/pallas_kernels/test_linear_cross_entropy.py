"""Fused linear cross-entropy: every implementation against the textbook reference and torch.

Why: the loss of an LM is computed here without the [tokens, vocab] logits; a wrong mask on
the vocabulary tail, the ignored tokens or the "mean" normaliser would silently train a
different model. The Pallas kernels run in interpret mode (CPU) and are lowered for CUDA to
catch GPU-only errors without a GPU.

Run: .venv/bin/python -m pytest -q tests/pallas_kernels/test_linear_cross_entropy.py
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec as P

from zerojax.pallas_kernels.linear_cross_entropy import (
    LinearCrossEntropyConfig,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    linear_cross_entropy_xla,
)

TOLERANCE = {
    jnp.float32: {"atol": 1e-5, "rtol": 1e-5},
    # bf16 gradients are rounded to bf16 (one ulp is 2**-8 relative) and the two sides feed
    # bf16-rounded dlogits to different matmul orders.
    jnp.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
LOSS_TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}  # the loss is fp32 in every dtype

# Small tiles so that interpret mode stays fast, the vocabulary (200) is not a multiple of the
# tile or chunk (64: a clamped, masked tail) and the tokens (50) are not a multiple of
# block_tokens (16: padded with ignored tokens).
TOKENS, DIM, VOCAB = 50, 32, 200
CONFIG = LinearCrossEntropyConfig(block_tokens=16, block_vocab=64, block_dim=16, vocab_chunk=64)
IGNORE_INDEX = -100


def make_inputs(seed: int, dtype, *, tokens=TOKENS, dim=DIM, vocab=VOCAB):
    """hidden, weight, bias, labels; every 7th label is ignore_index."""
    k = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(k[0], (tokens, dim), jnp.float32).astype(dtype)
    weight = (jax.random.normal(k[1], (vocab, dim), jnp.float32) * dim**-0.5).astype(dtype)
    bias = (0.5 * jax.random.normal(k[2], (vocab,), jnp.float32)).astype(dtype)
    labels = jax.random.randint(k[3], (tokens,), 0, vocab).at[3::7].set(IGNORE_INDEX)
    return hidden, weight, bias, labels


def run(implementation: str, hidden, weight, labels, **kwargs):
    """The api with interpret=True for the pallas implementation (CPU)."""
    return linear_cross_entropy(
        hidden,
        weight,
        labels,
        implementation=implementation,
        interpret=implementation == "pallas",
        block_config=CONFIG,
        **kwargs,
    )


def assert_close(actual, expected, tol):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), **tol
    )


def torch_loss_and_grads(hidden, weight, bias, labels, ct, **kwargs):
    """torch F.cross_entropy(F.linear(...)) in fp32 on the converted inputs."""

    def leaf(x):
        return torch.tensor(np.asarray(x, np.float32), requires_grad=True)

    h, w = leaf(hidden), leaf(weight)
    b = None if bias is None else leaf(bias)
    loss = F.cross_entropy(F.linear(h, w, b), torch.tensor(np.asarray(labels, np.int64)), **kwargs)
    loss.backward(torch.tensor(np.asarray(ct, np.float32)))
    grads = [h.grad.numpy(), w.grad.numpy()] + ([] if b is None else [b.grad.numpy()])
    return loss.detach().numpy(), grads


CASES = [
    # reduction, label_smoothing, with bias
    ("mean", 0.0, False),
    ("sum", 0.1, True),
    ("none", 0.0, True),
]


class TestLinearCrossEntropy:
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("reduction,label_smoothing,with_bias", CASES)
    @pytest.mark.parametrize("implementation", ["xla", "pallas"])
    def test_matches_reference(self, implementation, reduction, label_smoothing, with_bias, dtype):
        seed = CASES.index((reduction, label_smoothing, with_bias)) + 10 * (dtype == jnp.bfloat16)
        hidden, weight, bias, labels = make_inputs(seed, dtype)
        kwargs = {"reduction": reduction, "label_smoothing": label_smoothing}
        args = (hidden, weight, bias if with_bias else None)
        ct_shape = (TOKENS,) if reduction == "none" else ()
        ct = jax.random.normal(jax.random.key(seed + 1), ct_shape, jnp.float32)

        @jax.jit  # one compilation per side instead of op-by-op dispatch
        def loss_and_grads(args, ct):
            def ours(h, w, b):
                return run(implementation, h, w, labels, bias=b, **kwargs)

            def reference(h, w, b):
                return linear_cross_entropy_reference(h, w, labels, bias=b, **kwargs)

            loss, vjp = jax.vjp(ours, *args)
            ref_loss, ref_vjp = jax.vjp(reference, *args)
            return loss, ref_loss, vjp(ct), ref_vjp(ct)

        loss, ref_loss, grads, ref_grads = loss_and_grads(args, ct)
        assert loss.dtype == jnp.float32 and loss.shape == ref_loss.shape == ct_shape
        assert_close(loss, ref_loss, LOSS_TOLERANCE)
        for grad, ref_grad, arg in zip(grads, ref_grads, args):
            if arg is None:
                assert grad is None
                continue
            assert grad.dtype == arg.dtype and grad.shape == arg.shape
            assert_close(grad, ref_grad, TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("reduction,label_smoothing,with_bias", CASES)
    def test_reference_and_xla_match_torch(self, reduction, label_smoothing, with_bias, dtype):
        hidden, weight, bias, labels = make_inputs(7, dtype)
        bias = bias if with_bias else None
        kwargs = {"reduction": reduction, "label_smoothing": label_smoothing}
        ct = jax.random.normal(jax.random.key(8), (TOKENS,) if reduction == "none" else ())
        torch_loss, torch_grads = torch_loss_and_grads(
            hidden, weight, bias, labels, ct, ignore_index=IGNORE_INDEX, **kwargs
        )
        args = (hidden, weight) + (() if bias is None else (bias,))
        for fn in (linear_cross_entropy_reference, linear_cross_entropy_xla):

            def loss_fn(h, w, *b, fn=fn):
                return fn(h, w, labels, bias=b[0] if b else None, **kwargs)

            loss, vjp = jax.vjp(loss_fn, *args)
            assert_close(loss, torch_loss, LOSS_TOLERANCE)
            for grad, torch_grad in zip(vjp(ct), torch_grads):
                assert_close(grad, torch_grad, TOLERANCE[dtype])

    def test_leading_dims_and_auto(self):
        hidden, weight, bias, labels = make_inputs(3, jnp.float32, tokens=48)
        hidden3, labels3 = hidden.reshape(2, 24, DIM), labels.reshape(2, 24)
        per_token = jax.jit(
            lambda h, w, b, y: linear_cross_entropy(h, w, y, bias=b, reduction="none")
        )(hidden3, weight, bias, labels3)
        assert per_token.shape == (2, 24)
        expected = linear_cross_entropy_reference(
            hidden, weight, labels, bias=bias, reduction="none"
        )
        assert_close(per_token.reshape(-1), expected, LOSS_TOLERANCE)
        # "auto" on CPU is the xla path: identical to asking for it.
        auto = jax.jit(linear_cross_entropy)(hidden, weight, labels)
        xla = jax.jit(partial(linear_cross_entropy, implementation="xla"))(hidden, weight, labels)
        assert float(auto) == float(xla)

    def test_all_ignored_mean_is_nan_like_torch(self):
        hidden, weight, _, labels = make_inputs(4, jnp.float32)
        labels = jnp.full_like(labels, IGNORE_INDEX)
        assert np.isnan(float(linear_cross_entropy(hidden, weight, labels)))
        assert float(linear_cross_entropy(hidden, weight, labels, reduction="sum")) == 0.0

    @pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
    def test_lowers_for_cuda(self, dtype, with_bias):
        """Forward and backward Pallas kernels lower through Triton (no GPU needed)."""
        tokens, dim, vocab = 100, 128, 1000  # tokens and vocab not multiples of the blocks
        hidden = jax.ShapeDtypeStruct((tokens, dim), dtype)
        weight = jax.ShapeDtypeStruct((vocab, dim), dtype)
        bias = jax.ShapeDtypeStruct((vocab,), dtype) if with_bias else None
        labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)

        def loss_fn(h, w, b, y):
            return linear_cross_entropy(
                h, w, y, bias=b, implementation="pallas", label_smoothing=0.1
            )

        grad_fn = jax.grad(loss_fn, argnums=(0, 1, 2) if with_bias else (0, 1))
        for fn, n_kernels in ((loss_fn, 1), (grad_fn, 3)):
            lowered = (
                jax.jit(fn).trace(hidden, weight, bias, labels).lower(lowering_platforms=("cuda",))
            )
            assert lowered.as_text().count("linear_cross_entropy_") >= n_kernels

    def test_xla_chunks_use_less_temp_memory_than_unfused(self):
        """Compiled temp bytes of loss + grads: chunked [tokens, chunk] vs full logits."""
        tokens, dim, vocab = 1024, 64, 8192
        args = (
            jax.ShapeDtypeStruct((tokens, dim), jnp.float32),
            jax.ShapeDtypeStruct((vocab, dim), jnp.float32),
            jax.ShapeDtypeStruct((tokens,), jnp.int32),
        )

        def temp_bytes(loss_fn):
            step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
            return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

        config = LinearCrossEntropyConfig(vocab_chunk=1024)
        chunked = temp_bytes(
            lambda h, w, y: linear_cross_entropy(h, w, y, implementation="xla", block_config=config)
        )
        unfused = temp_bytes(lambda h, w, y: linear_cross_entropy_reference(h, w, y))
        logits_bytes = tokens * vocab * 4
        assert unfused >= logits_bytes  # the unfused program holds the full logits
        assert chunked < logits_bytes / 2, (chunked, unfused)
        assert chunked < unfused / 4, (chunked, unfused)

    @pytest.mark.multidevice
    @pytest.mark.parametrize("implementation", ["xla", "pallas"])
    def test_shard_map_over_tokens(self, implementation):
        """Data parallel: reduction="sum" per shard, psum of loss and count gives the mean."""
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        hidden, weight, bias, labels = make_inputs(11, jnp.float32, tokens=64)

        def sharded_mean(h, w, b, y):
            total = run(implementation, h, w, y, bias=b, reduction="sum")
            count = jnp.sum(y != IGNORE_INDEX).astype(jnp.float32)
            return jax.lax.psum(total, "data") / jax.lax.psum(count, "data")

        loss_fn = jax.shard_map(
            sharded_mean,
            mesh=mesh,
            in_specs=(P("data"), P(), P(), P("data")),
            out_specs=P(),
            check_vma=False,  # interpret-mode pallas_call has no vma rule
        )
        loss, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))(
            hidden, weight, bias, labels
        )
        ref_loss, ref_grads = jax.value_and_grad(
            lambda h, w, b: linear_cross_entropy_reference(h, w, labels, bias=b), argnums=(0, 1, 2)
        )(hidden, weight, bias)
        assert_close(loss, ref_loss, LOSS_TOLERANCE)
        for grad, ref_grad in zip(grads, ref_grads):
            assert_close(grad, ref_grad, TOLERANCE[jnp.float32])


class TestBadConfig:
    @pytest.mark.parametrize(
        "kwargs,message",
        [
            ({"block_vocab": 96}, "block_vocab=96 must be a power of two >= 16"),
            ({"block_tokens": 8}, "block_tokens=8 must be a power of two >= 16"),
            ({"block_dim": 0}, "block_dim=0 must be a power of two >= 16"),
            ({"num_warps": 3}, "num_warps=3 must be a power of two"),
            ({"num_stages": 0}, "num_stages=0 must be >= 1"),
            ({"vocab_chunk": 0}, "vocab_chunk=0 must be >= 1"),
        ],
    )
    def test_config_validation(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            LinearCrossEntropyConfig(**kwargs)

    def test_shapes_the_kernels_cannot_tile(self):
        hidden, weight, _, labels = make_inputs(5, jnp.float32, dim=48, vocab=100)
        with pytest.raises(ValueError, match=r"vocab=100 must be >= block_vocab=128"):
            linear_cross_entropy(hidden, weight, labels, implementation="pallas", interpret=True)
        config = LinearCrossEntropyConfig(block_vocab=64, block_dim=32)
        with pytest.raises(ValueError, match=r"dim=48 must be a multiple of block_dim=32"):
            linear_cross_entropy(
                hidden, weight, labels, implementation="pallas", interpret=True, block_config=config
            )
        # "auto" falls back to the chunked XLA path instead of raising.
        auto = linear_cross_entropy(hidden, weight, labels, interpret=True, block_config=config)
        assert_close(auto, linear_cross_entropy_reference(hidden, weight, labels), LOSS_TOLERANCE)

    @pytest.mark.parametrize(
        "kwargs,message",
        [
            ({"reduction": "avg"}, "reduction='avg' must be one of"),
            ({"implementation": "cuda"}, "implementation='cuda' must be one of"),
            ({"label_smoothing": 1.5}, r"label_smoothing=1.5 must be in \[0, 1\]"),
        ],
    )
    def test_bad_arguments(self, kwargs, message):
        hidden, weight, _, labels = make_inputs(6, jnp.float32)
        with pytest.raises(ValueError, match=message):
            linear_cross_entropy(hidden, weight, labels, **kwargs)

    def test_bad_shapes(self):
        hidden, weight, bias, labels = make_inputs(6, jnp.float32)
        with pytest.raises(ValueError, match="labels must have hidden's leading shape"):
            linear_cross_entropy(hidden, weight, labels[:-1])
        with pytest.raises(ValueError, match="hidden's last dim must equal weight's"):
            linear_cross_entropy(hidden[:, :-1], weight, labels)
        with pytest.raises(ValueError, match="bias must be"):
            linear_cross_entropy(hidden, weight, labels, bias=bias[:-1])
        with pytest.raises(ValueError, match="labels must be integer"):
            linear_cross_entropy(hidden, weight, labels.astype(jnp.float32))
