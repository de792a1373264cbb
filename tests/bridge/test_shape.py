"""Parity of view/shape lowerings (zerojax/bridge/lowerings/shape.py) with torch eager.

Run: .venv/bin/python -m pytest -q tests/bridge/test_shape.py
Each case is exported, decomposed to core ATen, lowered and run under jax.jit; the comment on a
case names the overload it exercises (checked with zerojax.bridge.capture.capture).
"""

import pytest
import torch
import torch.nn.functional as F

from tests.bridge.parity import check


def _x(*shape):
    """A float input drawn fresh for each test run."""
    return lambda: torch.randn(shape)


def _ints(high, shape):
    return lambda: torch.randint(-high, high, shape)


def _bools(*shape):
    return lambda: torch.rand(shape) > 0.5


def _make(args):
    return [make() for make in args]


CASES = {
    # view.default
    "view": (lambda x: x.view(12, 5), _x(3, 4, 5)),
    "view_infer": (lambda x: x.view(-1, 2, 5), _x(3, 4, 5)),
    "flatten_0d": (lambda x: x.reshape(1, 1), _x()),
    # expand.default: -1 keeps a dim, new leading dims
    "expand": (lambda x: x.expand(2, 3, -1, 5), _x(3, 1, 5)),
    "expand_0d": (lambda x: x.expand(2, 3), _x()),
    # permute.default
    "permute": (lambda x: x.permute(2, 0, 1), _x(3, 4, 5)),
    "permute_neg": (lambda x: x.permute(-1, -3, -2), _x(3, 4, 5)),
    # unsqueeze.default
    "unsqueeze": (lambda x: x.unsqueeze(1), _x(3, 4)),
    "unsqueeze_neg": (lambda x: x.unsqueeze(-1), _x(3, 4)),
    "unsqueeze_0d": (lambda x: x.unsqueeze(0), _x()),
    # squeeze.dims (torch leaves a non-1 dim alone)
    "squeeze_dim": (lambda x: x.squeeze(1), _x(3, 1, 5)),
    "squeeze_all": (lambda x: x.squeeze(), _x(1, 3, 1, 5)),
    "squeeze_non1": (lambda x: x.squeeze(0), _x(3, 1, 5)),
    "squeeze_dims": (lambda x: x.squeeze((0, -2)), _x(1, 3, 1, 5)),
    # select.int
    "select": (lambda x: x[1], _x(3, 4)),
    "select_neg": (lambda x: x[:, -1], _x(3, 4)),
    "unbind": (lambda x: x.unbind(1), _x(3, 4)),
    # slice.Tensor
    "slice": (lambda x: x[:, 1:3], _x(3, 4, 5)),
    "slice_step": (lambda x: x[::2, 1::3], _x(5, 7)),
    "slice_neg": (lambda x: x[-3:-1], _x(5, 2)),
    "slice_clamp": (lambda x: x[1:100], _x(5, 2)),
    "slice_empty": (lambda x: x[4:2], _x(5, 2)),
    "narrow": (lambda x: x.narrow(1, 1, 2), _x(3, 4)),
    # cat.default
    "cat": (lambda x, y: torch.cat([x, y], 0), _x(2, 3), _x(4, 3)),
    "cat_neg": (lambda x, y: torch.cat([x, y, x], -1), _x(2, 3), _x(2, 1)),
    "cat_legacy_empty": (lambda x, y: torch.cat([x, y], 1), _x(2, 3), _x(0)),
    "cat_promote": (
        lambda x, y: torch.cat([x, y]),
        _x(2, 3),
        _ints(5, (1, 3)),
    ),
    "cat_int": (lambda x, y: torch.cat([x, y]), _ints(9, (2,)), _ints(9, (3,))),
    "stack": (lambda x, y: torch.stack([x, y], 1), _x(2, 3), _x(2, 3)),
    # split_with_sizes.default
    "split": (lambda x: x.split(2, 1), _x(3, 5)),
    "split_sizes": (lambda x: x.split([1, 3, 1], -1), _x(3, 5)),
    "chunk": (lambda x: x.chunk(3, 0), _x(7, 2)),
    # flip.default
    "flip": (lambda x: x.flip(0, -1), _x(3, 4, 5)),
    "flip_bool": (lambda x: x.flip(1), _bools(3, 4)),
    "rot90": (lambda x: x.rot90(1, (0, 1)), _x(3, 4)),
    # repeat.default
    "repeat": (lambda x: x.repeat(2, 1, 3), _x(3, 4)),
    "tile_int": (lambda x: x.tile(2), _ints(9, (3,))),
    # constant_pad_nd.default (negative pads crop)
    "pad": (lambda x: F.pad(x, (1, 2, 0, 3), value=1.5), _x(2, 3, 4)),
    "pad_crop": (lambda x: F.pad(x, (-1, 2, 1, -2)), _x(2, 3, 4)),
    "pad_bool": (lambda x: F.pad(x, (1, 1), value=True), _bools(3, 4)),
    # diagonal.default
    "diagonal": (lambda x: x.diagonal(), _x(3, 4)),
    "diagonal_offset": (lambda x: x.diagonal(1, 0, 2), _x(3, 4, 5)),
    "diagonal_neg": (lambda x: x.diagonal(-2, -1, 0), _x(4, 3, 5)),
    "diagonal_empty": (lambda x: x.diagonal(7), _x(3, 4)),
    # as_strided.default
    "as_strided": (lambda x: x.as_strided((3, 2), (4, 1), 1), _x(3, 4)),
    "as_strided_overlap": (lambda x: x.as_strided((4, 3), (1, 2)), _x(12)),
    # unfold.default (Tensor.unfold)
    "unfold": (lambda x: x.unfold(1, 3, 2), _x(2, 7, 3)),
    "unfold_neg": (lambda x: x.unfold(-1, 2, 1), _x(2, 5)),
    # alias.default
    "detach": (lambda x: x.detach(), _x(3)),
    # view.dtype
    "view_dtype_same": (lambda x: x.view(torch.int32), _x(3, 4)),
    "view_dtype_narrow": (lambda x: x.view(torch.bfloat16), _x(3, 4)),
    "view_dtype_wide": (lambda x: x.view(torch.int16).view(torch.float32), _x(3, 4)),
    "meshgrid": (
        lambda x, y: torch.meshgrid(x, y, indexing="ij"),
        _x(3),
        _x(4),
    ),
}

# These decompose into pointwise ops (abs/sub/clamp) around index.Tensor/arange.
PADS = {
    "reflect1d": (lambda x: F.pad(x, (2, 1), mode="reflect"), _x(2, 3, 5)),
    "reflect2d": (lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), _x(2, 3, 4, 5)),
    "reflect3d": (lambda x: F.pad(x, (1, 1, 1, 0, 0, 1), mode="reflect"), _x(1, 2, 3, 4, 5)),
    "replicate1d": (lambda x: F.pad(x, (2, 1), mode="replicate"), _x(2, 3, 5)),
    "replicate2d": (lambda x: F.pad(x, (1, 2, 2, 1), mode="replicate"), _x(2, 3, 4, 5)),
    "replicate3d": (lambda x: F.pad(x, (1, 1, 1, 0, 0, 1), mode="replicate"), _x(1, 2, 3, 4, 5)),
    "circular": (lambda x: F.pad(x, (1, 2), mode="circular"), _x(2, 3, 5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_shape_parity(name):
    fn, *args = CASES[name]
    check(fn, *_make(args))


@pytest.mark.parametrize("name", sorted(PADS))
def test_padding_parity(name):
    fn, *args = PADS[name]
    check(fn, *_make(args))


@pytest.mark.parametrize("op", ["reflection_pad", "replication_pad"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_pad_overloads_direct(op, rank):
    """The whole reflection/replication overloads (torch decomposes them before we see them)."""
    import jax.numpy as jnp
    import numpy as np

    from zerojax.bridge.registry import get_lowering

    overload = getattr(torch.ops.aten, f"{op}{rank}d").default
    x = torch.randn(2, *(4,) * rank)
    padding = [1, 2, 2, 1, 0, 3][: 2 * rank]
    got = get_lowering(overload)(None, jnp.asarray(x.numpy()), padding)
    np.testing.assert_allclose(np.asarray(got), overload(x, padding).numpy())


def test_view_dtype_int64_raises():
    with pytest.raises(NotImplementedError, match="64-bit"):
        check(lambda x: x.view(torch.float64), torch.randint(9, (3,)))
