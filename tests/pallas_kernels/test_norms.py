"""LayerNorm and RMSNorm Pallas kernels against their jnp references (and the references against
PyTorch), forward and gradients, fp32 and bf16; CUDA lowering without a GPU; shard_map over rows.

Run: .venv/bin/python -m pytest -q tests/pallas_kernels/test_norms.py -p no:cacheprovider

The Pallas kernels run in interpret mode here (CPU), so operands stay small; the CUDA-lowering
tests are what catch GPU-only errors (illegal block shapes, unsupported primitives in Triton).
"""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from tests import tolerances
from zerojax.pallas_kernels.layer_norm import NormConfig, layer_norm, layer_norm_reference
from zerojax.pallas_kernels.rms_norm import rms_norm, rms_norm_reference

# Compared elementwise against tolerances.normalization / normalization_gradients: bounds
# derived from float32 rounding over the hidden dim (mean, variance, rsqrt) and, for dweight and
# dbias, over the rows they sum, on these inputs' magnitudes; in bf16 plus one bf16 rounding
# (unit roundoff u_bf16 = 2**-8, half the bf16 eps 2**-7) of each value the kernels or the
# reference's bf16 autodiff round (x_hat before HF's weight multiply, dy * w, the products
# summed into dweight, every result). XLA:CPU accumulates bf16 reductions in float32 (a
# 4096-term bf16 sum of ones is exact), so no sum is accumulated in bf16.


def _torch64(x) -> torch.Tensor | None:
    return (
        None
        if x is None
        else torch.tensor(np.asarray(jnp.asarray(x, jnp.float32)), dtype=torch.float64)
    )


def error_bounds(kind: str, args, cotangent, *, eps: float) -> tuple:
    """(output bound, [bound per present argument's gradient]) for layer_norm(x, w, b) or
    rms_norm(x, w) over the last dim, two sides (see the comment above)."""
    x, w = args[0], args[1] if len(args) > 1 else None
    b = args[2] if kind == "layer" and len(args) > 2 else None
    rms = kind == "rms"
    low = torch.float32 if x.dtype == jnp.float32 else torch.bfloat16
    # rms_norm's output follows a float32 weight (no rounding to bf16 then).
    out_dtype = torch.float32 if rms and w is not None and w.dtype == jnp.float32 else low
    tx, tw, tb, tg = (_torch64(a) for a in (x, w, b, cotangent))
    dims = (x.ndim - 1,)
    forward = tolerances.normalization(
        tx,
        dims,
        eps,
        weight=tw,
        bias=tb,
        rms=rms,
        normalized_dtype=low if rms else torch.float32,
        out_dtype=out_dtype,
    )["out"]
    grads = tolerances.normalization_gradients(
        tx,
        dims,
        eps,
        tg,
        weight=tw,
        bias_shape=None if b is None else b.shape,
        rms=rms,
        low_dtype=low,
    )
    return forward, [grads[name] for name, a in zip(("dx", "dw", "db"), (x, w, b)) if a is not None]


def assert_within(actual, expected, bound, what: str):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(np.asarray(actual.astype(jnp.float32))).all(), f"{what}: non-finite"
    tolerances.assert_within(_torch64(actual), _torch64(expected), bound, what)


# Small row blocks so even small test inputs span several forward programs and several backward
# programs of several tiles each.
SMALL_BLOCKS = NormConfig(block_rows=4, backward_block_rows=16, num_warps=4)

IMPLEMENTATIONS = [
    pytest.param({"implementation": "xla"}, id="xla"),
    pytest.param({"implementation": "pallas", "interpret": True}, id="pallas-interpret"),
]
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


def _seed(request) -> int:
    """A different seed per test case, stable across runs."""
    return zlib.crc32(request.node.name.encode())


def _normal(key, shape, dtype, scale=1.0, offset=0.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale + offset).astype(dtype)


def _compare_with_vjp(fn, reference, args, dtype, seed, *, kind, eps):
    """Forward and all gradients of ``fn`` vs ``reference`` under one random cotangent; None
    arguments (no weight / no bias) are passed through, not differentiated."""
    present = [i for i, a in enumerate(args) if a is not None]
    all_args = args

    def with_nones(f):
        def call(*diff_args):
            full = list(args)
            for i, a in zip(present, diff_args, strict=True):
                full[i] = a
            return f(*full)

        return call

    fn, reference, args = with_nones(fn), with_nones(reference), [args[i] for i in present]
    expected, ref_vjp = jax.vjp(reference, *args)
    cotangent = _normal(jax.random.key(seed + 1), expected.shape, expected.dtype)
    actual, vjp = jax.vjp(fn, *args)
    out_bound, grad_bounds = error_bounds(kind, all_args, cotangent, eps=eps)
    assert_within(actual, expected, out_bound, "forward")
    pairs = zip(vjp(cotangent), ref_vjp(cotangent), grad_bounds, strict=True)
    for i, (got, want, bound) in enumerate(pairs):
        assert_within(got, want, bound, f"grad of argument {i}")


def _lowered_cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _triton_calls(text: str) -> int:
    return len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text))


def _data_mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


# (x shape, with weight, with bias): 3-D [batch, seq, hidden]; rows not a multiple of the row
# block (111 rows); a non-power-of-two hidden (96, 768 -> padded and masked).
LAYER_NORM_CASES = [
    pytest.param((2, 24, 128), True, True, id="3d-h128-affine"),
    pytest.param((3, 37, 96), True, True, id="3d-h96-ragged-rows"),
    pytest.param((4, 8, 64), False, False, id="3d-h64-no-affine"),
    pytest.param((40, 768), True, False, id="2d-h768-weight-only"),
]


class TestLayerNorm:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("affine", [True, False])
    def test_reference_matches_torch(self, request, dtype, affine):
        k = jax.random.split(jax.random.key(_seed(request)), 3)
        x = _normal(k[0], (6, 10, 96), dtype, scale=3.0, offset=1.5)
        w = _normal(k[1], (96,), dtype) if affine else None
        b = _normal(k[2], (96,), dtype) if affine else None
        torch_dtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16

        def to_torch(a):
            return None if a is None else torch.from_numpy(np.array(a, np.float32)).to(torch_dtype)

        expected = torch.nn.functional.layer_norm(
            to_torch(x), (96,), to_torch(w), to_torch(b), 1e-5
        )
        actual = layer_norm_reference(x, w, b, eps=1e-5)
        bound, _ = error_bounds("layer", (x, w, b), jnp.zeros_like(x), eps=1e-5)
        expected = jnp.asarray(expected.float().numpy()).astype(dtype)
        assert_within(actual, expected, bound, "torch")

    @pytest.mark.parametrize("impl", IMPLEMENTATIONS)
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize(("shape", "with_weight", "with_bias"), LAYER_NORM_CASES)
    def test_matches_reference(self, request, impl, dtype, shape, with_weight, with_bias):
        seed = _seed(request)
        k = jax.random.split(jax.random.key(seed), 3)
        x = _normal(k[0], shape, dtype, scale=2.0, offset=0.5)
        params = [
            _normal(k[1], shape[-1:], dtype, offset=1.0) if with_weight else None,
            _normal(k[2], shape[-1:], dtype) if with_bias else None,
        ]
        config = None if shape[-1] == 768 else SMALL_BLOCKS  # one case on the default config

        def fn(x, *params):
            return layer_norm(x, *params, eps=1e-5, block_config=config, **impl)

        _compare_with_vjp(
            fn, layer_norm_reference, (x, *params), dtype, seed, kind="layer", eps=1e-5
        )

    @pytest.mark.parametrize("affine", [True, False])
    def test_lowers_for_cuda(self, affine):
        x = jnp.ones((4, 16, 768), jnp.bfloat16)
        params = (jnp.ones(768, jnp.bfloat16), jnp.zeros(768, jnp.bfloat16)) if affine else ()

        def fn(x, *params):
            return layer_norm(x, *params, implementation="pallas")

        def loss(x, *params):
            return fn(x, *params).astype(jnp.float32).sum()

        assert _triton_calls(_lowered_cuda_text(fn, x, *params)) == 1
        grad = jax.grad(loss, argnums=tuple(range(1 + len(params))))
        # forward-with-statistics + backward
        assert _triton_calls(_lowered_cuda_text(grad, x, *params)) == 2

    @pytest.mark.multidevice
    def test_shard_map_over_rows(self, request):
        seed = _seed(request)
        k = jax.random.split(jax.random.key(seed), 4)
        x = _normal(k[0], (16, 12, 96), jnp.float32, offset=0.5)
        w, b = _normal(k[1], (96,), jnp.float32), _normal(k[2], (96,), jnp.float32)
        g = _normal(k[3], x.shape, jnp.float32)

        def local(x, w, b, g):
            def fn(x, w, b):
                return layer_norm(
                    x, w, b, implementation="pallas", interpret=True, block_config=SMALL_BLOCKS
                )

            y, vjp = jax.vjp(fn, x, w, b)
            dx, dw, db = vjp(g)
            return y, dx, jax.lax.psum(dw, "data"), jax.lax.psum(db, "data")

        sharded = jax.shard_map(
            local,
            mesh=_data_mesh(),
            in_specs=(P("data"), P(), P(), P("data")),
            out_specs=(P("data"), P("data"), P(), P()),
            check_vma=False,  # the Pallas interpreter does not track varying manual axes
        )
        actual = jax.jit(sharded)(x, w, b, g)
        y, vjp = jax.vjp(layer_norm_reference, x, w, b)
        # psum of 8 shards' partial dw/db: the same row sums in another order.
        out_bound, grad_bounds = error_bounds("layer", (x, w, b), g, eps=1e-5)
        bounds = (out_bound, *grad_bounds)
        for got, want, bound, what in zip(
            actual, (y, *vjp(g)), bounds, ("y", "dx", "dw", "db"), strict=True
        ):
            assert_within(got, want, bound, what)

    def test_auto_uses_xla_on_cpu_and_pallas_when_interpreting(self):
        x = jnp.ones((4, 64), jnp.float32)
        auto = str(jax.make_jaxpr(lambda x: layer_norm(x))(x))
        interpreted = str(jax.make_jaxpr(lambda x: layer_norm(x, interpret=True))(x))
        assert "pallas_call" not in auto
        assert "pallas_call" in interpreted

    def test_too_wide_rows_fall_back_under_auto_and_raise_under_pallas(self):
        x = _normal(jax.random.key(3), (2, 16385), jnp.float32)
        with pytest.raises(ValueError, match="n_features=16385 exceeds the kernel maximum"):
            layer_norm(x, implementation="pallas", interpret=True)
        bound, _ = error_bounds("layer", (x,), jnp.zeros_like(x), eps=1e-5)
        assert_within(layer_norm(x, interpret=True), layer_norm_reference(x), bound, "auto")


# (x shape, weight: None / "same" dtype as x / "f32").
RMS_NORM_CASES = [
    pytest.param((2, 24, 128), "same", id="3d-h128"),
    pytest.param((3, 37, 96), "same", id="3d-h96-ragged-rows"),
    pytest.param((4, 8, 64), None, id="3d-h64-no-weight"),
    pytest.param((40, 768), "f32", id="2d-h768-f32-weight"),
]


class TestRMSNorm:
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_reference_matches_hf_and_torch(self, request, dtype):
        """The reference is HF's LlamaRMSNorm formula (rounding y to x.dtype before the weight
        multiply). torch.nn.functional.rms_norm multiplies in fp32 and rounds once: identical in
        fp32; in bf16 both within error_bounds, which counts the x_hat rounding on each side."""
        k = jax.random.split(jax.random.key(_seed(request)), 2)
        x = _normal(k[0], (6, 10, 96), dtype, scale=3.0)
        w = _normal(k[1], (96,), dtype, offset=1.0)
        torch_dtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16
        tx = torch.from_numpy(np.array(x, np.float32)).to(torch_dtype)
        tw = torch.from_numpy(np.array(w, np.float32)).to(torch_dtype)
        xf = tx.float()
        hf = tw * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch_dtype)
        fused = torch.nn.functional.rms_norm(tx, (96,), tw, 1e-6)
        actual = rms_norm_reference(x, w, eps=1e-6)
        bound, _ = error_bounds("rms", (x, w), jnp.zeros_like(x), eps=1e-6)
        for what, expected in (("hf", hf), ("torch.rms_norm", fused)):
            expected = jnp.asarray(expected.float().numpy()).astype(dtype)
            assert_within(actual, expected, bound, what)
        no_weight = torch.nn.functional.rms_norm(tx, (96,), None, 1e-6)
        bound, _ = error_bounds("rms", (x,), jnp.zeros_like(x), eps=1e-6)
        assert_within(
            rms_norm_reference(x, eps=1e-6),
            jnp.asarray(no_weight.float().numpy()).astype(dtype),
            bound,
            "no weight",
        )

    @pytest.mark.parametrize("impl", IMPLEMENTATIONS)
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize(("shape", "weight"), RMS_NORM_CASES)
    def test_matches_reference(self, request, impl, dtype, shape, weight):
        seed = _seed(request)
        k = jax.random.split(jax.random.key(seed), 2)
        x = _normal(k[0], shape, dtype, scale=2.0)
        args = (x,)
        if weight is not None:
            args += (_normal(k[1], shape[-1:], dtype if weight == "same" else jnp.float32, 1, 1),)
        config = None if shape[-1] == 768 else SMALL_BLOCKS

        def fn(*args):
            return rms_norm(*args, eps=1e-6, block_config=config, **impl)

        _compare_with_vjp(fn, rms_norm_reference, args, dtype, seed, kind="rms", eps=1e-6)

    def test_output_dtype_follows_weight(self):
        x = jnp.ones((8, 64), jnp.bfloat16)
        for w_dtype, out_dtype in ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32)):
            y = rms_norm(x, jnp.ones(64, w_dtype), implementation="pallas", interpret=True)
            assert y.dtype == out_dtype
        assert rms_norm(x, implementation="pallas", interpret=True).dtype == jnp.bfloat16

    @pytest.mark.parametrize("with_weight", [True, False])
    def test_lowers_for_cuda(self, with_weight):
        x = jnp.ones((4, 16, 4096), jnp.bfloat16)
        params = (jnp.ones(4096, jnp.bfloat16),) if with_weight else ()

        def fn(x, *params):
            return rms_norm(x, *params, implementation="pallas")

        def loss(x, *params):
            return fn(x, *params).astype(jnp.float32).sum()

        assert _triton_calls(_lowered_cuda_text(fn, x, *params)) == 1
        grad = jax.grad(loss, argnums=tuple(range(1 + len(params))))
        assert _triton_calls(_lowered_cuda_text(grad, x, *params)) == 2

    @pytest.mark.multidevice
    def test_shard_map_over_rows(self, request):
        seed = _seed(request)
        k = jax.random.split(jax.random.key(seed), 3)
        x = _normal(k[0], (16, 12, 96), jnp.float32)
        w = _normal(k[1], (96,), jnp.float32, offset=1.0)
        g = _normal(k[2], x.shape, jnp.float32)

        def local(x, w, g):
            def fn(x, w):
                return rms_norm(
                    x, w, implementation="pallas", interpret=True, block_config=SMALL_BLOCKS
                )

            y, vjp = jax.vjp(fn, x, w)
            dx, dw = vjp(g)
            return y, dx, jax.lax.psum(dw, "data")

        sharded = jax.shard_map(
            local,
            mesh=_data_mesh(),
            in_specs=(P("data"), P(), P("data")),
            out_specs=(P("data"), P("data"), P()),
            check_vma=False,  # the Pallas interpreter does not track varying manual axes
        )
        actual = jax.jit(sharded)(x, w, g)
        y, vjp = jax.vjp(rms_norm_reference, x, w)
        out_bound, grad_bounds = error_bounds("rms", (x, w), g, eps=1e-6)
        bounds = (out_bound, *grad_bounds)
        for got, want, bound, what in zip(
            actual, (y, *vjp(g)), bounds, ("y", "dx", "dw"), strict=True
        ):
            assert_within(got, want, bound, what)


class TestBadConfig:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"block_rows": 3}, r"block_rows=3 must be a power of two"),
            (
                {"block_rows": 4, "backward_block_rows": 48},
                r"backward_block_rows=48 must be a power",
            ),
            (
                {"block_rows": 16, "backward_block_rows": 8},
                r"backward_block_rows=8 must be a multiple of block_rows=16",
            ),
            ({"num_warps": 3}, r"num_warps=3 must be a power of two in \[1, 32\]"),
            ({"num_stages": 0}, r"num_stages=0 must be a positive integer"),
        ],
    )
    def test_config_validation(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            NormConfig(**kwargs)

    @pytest.mark.parametrize("op", [layer_norm, rms_norm])
    def test_tile_too_large_for_features(self, op):
        x = jnp.ones((2, 8192), jnp.float32)
        with pytest.raises(ValueError, match=r"16 \* 8192 exceeds 16384 elements per tile"):
            op(x, implementation="pallas", block_config=NormConfig(block_rows=16))

    @pytest.mark.parametrize("op", [layer_norm, rms_norm])
    def test_weight_shape_and_implementation_name(self, op):
        x = jnp.ones((2, 64), jnp.float32)
        with pytest.raises(ValueError, match=r"weight.shape=\(32,\) must be \(64,\)"):
            op(x, jnp.ones(32), implementation="pallas", interpret=True)
        with pytest.raises(ValueError, match="implementation='triton' must be one of"):
            op(x, implementation="triton")
