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

from tests import tolerances
from zerojax.pallas_kernels.linear_cross_entropy import (
    LinearCrossEntropyConfig,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    linear_cross_entropy_xla,
)

# Compared elementwise against bounds derived per element (`error_bounds`), not one literal:
# logits of 32-term dots, a logsumexp over 200 vocabulary entries and gradients summed over the
# vocabulary (dhidden) or the tokens (dweight, dbias) have errors that scale with those lengths
# and with the magnitudes summed, which a single rtol/atol cannot follow.


def error_bounds(hidden, weight, bias, labels, ct, *, reduction, label_smoothing, dtype):
    """Bounds on |side1 - side2| for (loss, dhidden, dweight[, dbias]) of two implementations
    that compute logits and their softmax in float32 from the same (exactly representable)
    inputs, to first order (Higham ch. 3; u = float32 unit roundoff, tolerances.py):

    * logit z = h . w + b: |dz| <= (dim + 1) u A, A = |h| . |w| + |b| (a dim-term dot, the add);
    * logsumexp: within max_v |dz| + (vocab + 1) u (the vocab-term sum of exps, relative)
      + LIBM_ULPS ulps of exp (relative, so absolute in the log) and of log (times |lse|);
      the loss per token adds the target logit's |dz| (smoothing: the mean logit's, no more),
      a subtraction u |loss_t|, and "mean"/"sum" a (count)-term sum, count u sum|loss_t|;
    * softmax p = exp(z - lse) then has relative error eta_t <= 2 (max_v |dz| + logsumexp's)
      + LIBM_ULPS ulps, and dlogits = c_t (p - target) (c_t the cotangent, /count for "mean")
      errs by |c_t| eta_t p + 2 u |dlogits| (+ u_bf16 |dlogits| where the kernels round dlogits
      to bf16 before the matmuls);
    * dhidden = dlogits @ W and dweight = dlogits^T @ h, accumulated in float32 (XLA:CPU and
      torch both accumulate bf16 dots in float32): the dlogits errors times |W| or |h|, plus
      (K + 1) u |dlogits| @ |W| (K = vocab) or |dlogits|^T @ |h| (K = tokens); dbias likewise;
      the gradient's rounding to its dtype adds u_dtype |g|.
    Two sides differ by at most twice one side's bound. Returns float64 numpy arrays."""
    u = tolerances.unit_roundoff(np.float32)
    libm = tolerances.LIBM_ULPS * tolerances.eps(np.float32)
    h, w = np.asarray(hidden, np.float64), np.asarray(weight, np.float64)
    b = np.zeros(w.shape[0]) if bias is None else np.asarray(bias, np.float64)
    labels, ct = np.asarray(labels), np.asarray(ct, np.float64)
    tokens, dim = h.shape
    vocab = w.shape[0]
    valid = labels != IGNORE_INDEX
    count = int(valid.sum())
    z = h @ w.T + b
    dz = (dim + 1) * u * (np.abs(h) @ np.abs(w).T + np.abs(b))
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    p = np.exp(z - lse[:, None])
    target = np.zeros_like(z)
    target[np.arange(tokens)[valid], labels[valid]] = 1.0
    target = (1 - label_smoothing) * target + label_smoothing / vocab
    per_token = (lse - (target * z).sum(1)) * valid
    lse_error = dz.max(1) + (vocab + 1) * u + libm * (1 + np.abs(lse))
    loss_t = (lse_error + dz.max(1) + u * np.abs(per_token)) * valid
    if reduction == "none":
        loss, scale = loss_t, ct * valid
    else:
        divide = count if reduction == "mean" else 1
        loss = (loss_t.sum() + count * u * np.abs(per_token).sum()) / divide + u * abs(
            per_token.sum() / divide
        )
        scale = np.broadcast_to(ct / divide, (tokens,)) * valid
    dlogits = np.abs(scale[:, None] * (p - target))
    eta = 2 * lse_error + libm
    u_r = tolerances.unit_roundoff(dtype) if dtype != jnp.float32 else 0.0
    u_out = tolerances.unit_roundoff(dtype)
    d_err = np.abs(scale)[:, None] * eta[:, None] * p + (2 * u + u_r) * dlogits
    dh = d_err @ np.abs(w) + (vocab + 1) * u * (dlogits @ np.abs(w))
    dw = d_err.T @ np.abs(h) + (tokens + 1) * u * (dlogits.T @ np.abs(h))
    db = d_err.sum(0) + (tokens + 1) * u * dlogits.sum(0)
    exact = scale[:, None] * (p - target)
    dh, dw, db = (
        e + u_out * np.abs(g) for e, g in ((dh, exact @ w), (dw, exact.T @ h), (db, exact.sum(0)))
    )
    return 2 * loss, [2 * dh, 2 * dw] + ([] if bias is None else [2 * db])


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


def assert_within(actual, expected, bound, what: str):
    """|actual - expected| <= bound elementwise (tolerances.assert_within, in float64)."""
    tolerances.assert_within(
        torch.tensor(np.array(actual, np.float32)),
        torch.tensor(np.array(expected, np.float32)),
        torch.tensor(np.array(bound, np.float64)),
        what,
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
        loss_bound, grad_bounds = error_bounds(*args, labels, ct, dtype=dtype, **kwargs)
        assert_within(loss, ref_loss, loss_bound, "loss")
        present = [(g, r, a) for g, r, a in zip(grads, ref_grads, args) if a is not None]
        assert all(g is None for g, _, a in zip(grads, ref_grads, args) if a is None)
        for (grad, ref_grad, arg), bound, name in zip(present, grad_bounds, ("dh", "dw", "db")):
            assert grad.dtype == arg.dtype and grad.shape == arg.shape
            assert_within(grad, ref_grad, bound, name)

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
        loss_bound, grad_bounds = error_bounds(
            hidden, weight, bias, labels, ct, dtype=dtype, **kwargs
        )
        for fn in (linear_cross_entropy_reference, linear_cross_entropy_xla):

            def loss_fn(h, w, *b, fn=fn):
                return fn(h, w, labels, bias=b[0] if b else None, **kwargs)

            loss, vjp = jax.vjp(loss_fn, *args)
            assert_within(loss, torch_loss, loss_bound, f"{fn.__name__} loss")
            for grad, torch_grad, bound in zip(vjp(ct), torch_grads, grad_bounds, strict=True):
                assert_within(grad, torch_grad, bound, f"{fn.__name__} grad")

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
        bound, _ = error_bounds(
            hidden,
            weight,
            bias,
            labels,
            np.ones(48),
            reduction="none",
            label_smoothing=0.0,
            dtype=jnp.float32,
        )
        assert_within(per_token.reshape(-1), expected, bound, "per-token loss")
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
        # psum of 8 shard sums is the same 64-term sum in another order: the "mean" bound.
        loss_bound, grad_bounds = error_bounds(
            hidden,
            weight,
            bias,
            labels,
            1.0,
            reduction="mean",
            label_smoothing=0.0,
            dtype=jnp.float32,
        )
        assert_within(loss, ref_loss, loss_bound, "loss")
        for grad, ref_grad, bound in zip(grads, ref_grads, grad_bounds, strict=True):
            assert_within(grad, ref_grad, bound, "grad")


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
        bound, _ = error_bounds(
            hidden,
            weight,
            None,
            labels,
            1.0,
            reduction="mean",
            label_smoothing=0.0,
            dtype=jnp.float32,
        )
        assert_within(auto, linear_cross_entropy_reference(hidden, weight, labels), bound, "auto")

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
