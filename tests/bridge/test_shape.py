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


# name -> (fn returning related variants as a tuple, input factories); one export per group
# keeps the file fast. The comment names the overload each group exercises after decomposition.
CASES = {
    # view.default (incl. -1 and 0-d)
    "view": (lambda x, s: (x.view(12, 5), x.view(-1, 2, 5), s.reshape(1, 1)), _x(3, 4, 5), _x()),
    # expand.default: -1 keeps a dim, new leading dims
    "expand": (lambda x, s: (x.expand(2, 3, -1, 5), s.expand(2, 3)), _x(3, 1, 5), _x()),
    # permute.default, also from transpose/movedim
    "permute": (
        lambda x: (x.permute(2, 0, 1), x.permute(-1, -3, -2), x.transpose(0, 1), x.movedim(0, -1)),
        _x(3, 4, 5),
    ),
    # unsqueeze.default
    "unsqueeze": (lambda x, s: (x.unsqueeze(1), x.unsqueeze(-1), s.unsqueeze(0)), _x(3, 4), _x()),
    # squeeze.dims (torch leaves a named non-1 dim alone)
    "squeeze": (
        lambda x, y: (y.squeeze(1), x.squeeze(), y.squeeze(0), x.squeeze((0, -2))),
        _x(1, 3, 1, 5),
        _x(3, 1, 5),
    ),
    # select.int, negative index; unbind becomes select too
    "select": (lambda x: (x[1], x[:, -1], *x.unbind(1)), _x(3, 4)),
    # slice.Tensor: steps, negative and out-of-range bounds, empty result; narrow
    "slice": (
        lambda x: (x[:, 1:3], x[::2, 1::3], x[-3:-1], x[1:100], x[4:2], x.narrow(1, 1, 2)),
        _x(5, 7),
    ),
    # cat.default: negative dim, legacy (0,) tensors skipped, dtype promotion, stack
    "cat": (
        lambda x, y, e, i, j: (
            torch.cat([x, y], 0),
            torch.cat([x, y[:2], x], -1),
            torch.cat([x, e], 1),
            torch.cat([x, i]),
            torch.cat([i, j]),
            torch.stack([x, x], 1),
        ),
        _x(2, 3),
        _x(4, 3),
        _x(0),
        _ints(5, (1, 3)),
        _ints(5, (2, 3)),
    ),
    # split_with_sizes.default (split, split with sizes, chunk)
    "split": (lambda x: (x.split(2, 1), x.split([1, 3, 1], -1), x.chunk(2, 0)), _x(3, 5)),
    # flip.default, also under rot90; bool input
    "flip": (lambda x, b: (x.flip(0, -1), b.flip(1), x.rot90(1, (0, 1))), _x(3, 4), _bools(3, 4)),
    # repeat.default (extra leading dims), int input
    "repeat": (lambda x, i: (x.repeat(2, 1, 3), i.tile(2)), _x(3, 4), _ints(9, (3,))),
    # constant_pad_nd.default (negative pads crop), bool input
    "pad": (
        lambda x, b: (
            F.pad(x, (1, 2, 0, 3), value=1.5),
            F.pad(x, (-1, 2, 1, -2)),
            F.pad(b, (1, 1), value=True),
        ),
        _x(2, 3, 4),
        _bools(3, 4),
    ),
    # diagonal.default: offsets either side, negative dims, empty diagonal
    "diagonal": (
        lambda x, y: (x.diagonal(), y.diagonal(1, 0, 2), y.diagonal(-2, -1, 0), x.diagonal(7)),
        _x(3, 4),
        _x(4, 3, 5),
    ),
    # as_strided.default: storage offset, overlapping windows, views of a permuted/sliced input
    "as_strided": (
        lambda x: (
            x.as_strided((3, 2), (4, 1), 1),
            x.as_strided((4, 3), (1, 2)),
            x.t().as_strided((2, 3), (1, 4)),
            x[1:, 1:].as_strided((2, 2), (4, 1)),
        ),
        _x(3, 4),
    ),
    # unfold.default (Tensor.unfold)
    "unfold": (lambda x: (x.unfold(1, 3, 2), x.unfold(-1, 2, 1)), _x(2, 7, 3)),
    # alias.default, view.dtype (same, narrower, wider element size)
    "alias_view_dtype": (
        lambda x: (
            x.detach(),
            x.view(torch.int32),
            x.view(torch.bfloat16),
            x.view(torch.int16).view(torch.float32),
        ),
        _x(3, 4),
    ),
    # expand.default + view.default
    "meshgrid": (lambda x, y: torch.meshgrid(x, y, indexing="ij"), _x(3), _x(4)),
}

# These decompose into pointwise ops (abs/sub/clamp) around index.Tensor/arange.
PADS = {
    "reflect": (
        lambda x, y, z: (
            F.pad(x, (2, 1), mode="reflect"),
            F.pad(y, (1, 2, 2, 1), mode="reflect"),
            F.pad(z, (1, 1, 1, 0, 0, 1), mode="reflect"),
        ),
        _x(2, 3, 5),
        _x(2, 3, 4, 5),
        _x(1, 2, 3, 4, 5),
    ),
    "replicate": (
        lambda x, y, z: (
            F.pad(x, (2, 1), mode="replicate"),
            F.pad(y, (1, 2, 2, 1), mode="replicate"),
            F.pad(z, (1, 1, 1, 0, 0, 1), mode="replicate"),
        ),
        _x(2, 3, 5),
        _x(2, 3, 4, 5),
        _x(1, 2, 3, 4, 5),
    ),
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


def test_as_strided_outside_input_raises():
    """A read outside the input's own elements needs storage zerojax does not have."""
    with pytest.raises(NotImplementedError, match="outside its input"):
        check(lambda x: x[1:].as_strided((2, 2), (1, 2), 0), torch.randn(3, 4))


def test_copy_variants():
    x = torch.randn(2, 3, 4)
    check(lambda a: torch.ops.aten.view_copy(a, [6, 4]), x)
    check(lambda a: torch.permute_copy(a, (2, 0, 1)), x)
    check(lambda a: torch.narrow_copy(a, 2, 1, 2), x)
    check(lambda a: torch.unbind_copy(a, 1), x)
    check(lambda a: torch.as_strided_copy(a, (3, 2), (4, 1), 1), x)


@pytest.mark.parametrize("offset", [-1, 0, 2])
def test_diagonal_scatter(offset):
    x = torch.randn(3, 4, 5)
    src = torch.diagonal(x, offset, 2, 0).clone().normal_()
    check(lambda a, s: torch.diagonal_scatter(a, s, offset, 2, 0), x, src)


def test_as_strided_scatter():
    x = torch.randn(4, 5)
    check(lambda a, s: torch.as_strided_scatter(a, s, (2, 3), (5, 2), 1), x, torch.randn(2, 3))
    check(lambda a, s: torch.as_strided_scatter(a, s, (3,), (6,)), x, torch.randn(3))
