"""Parity of indexing/scatter lowerings (zerojax/bridge/lowerings/indexing.py) with torch eager.

Run: .venv/bin/python -m pytest -q tests/bridge/test_indexing.py
Values are compared under jax.jit; for the differentiable ops, jax.grad of the summed outputs is
compared with torch autograd. Index tensors include negative entries where torch allows them
and duplicates where the op's result is still deterministic (accumulation).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.bridge.parity import assert_close, check, check_grad
from zerojax.bridge.dtypes import from_torch, to_torch
from zerojax.bridge.errors import UnsupportedOpError


def _x(*shape):
    return lambda: torch.randn(shape)


def _idx(low, high, shape):
    return lambda: torch.randint(low, high, shape)


def _bools(*shape):
    return lambda: torch.rand(shape) > 0.5


def _perm_index(n, shape_rest):
    """A scatter index along dim 0 without duplicates per column (torch's scatter with
    duplicates picks an arbitrary writer)."""
    return lambda: torch.stack([torch.randperm(n) for _ in range(int(np.prod(shape_rest)))], -1)


def _index_put(x, i, v, accumulate=False):
    return torch.ops.aten.index_put(x, [None, i], v, accumulate)


def _put_two(x, i, j, v):
    return x.index_put((i, j), v, accumulate=True)


def _setitem_mask(x, m):
    y = x.clone()
    y[m] = 0.5
    return y


def _setitem_mask_rows(x, m, v):
    y = x.clone()
    y[m] = v  # v broadcasts along the selected rows
    return y


def _setitem_mask_inner(x, m):
    y = x.clone()
    y[:, m] = 2.0  # not leading: goes through fixed-size positions and a dropping scatter
    return y


def _setitem_int(x, i):
    y = x.clone()
    y[:, i] = 3.0
    return y


# name -> (fn, input factories); the comment names the overload exercised.
CASES = {
    # gather.default: index smaller than self in the other dims, negative dim, take_along_dim
    "gather": (
        lambda x, i, y, j, k: (x.gather(1, i), y.gather(-1, j), torch.take_along_dim(x, k, 0)),
        _x(3, 5),
        _idx(0, 5, (2, 4)),
        _x(3, 4, 5),
        _idx(0, 5, (3, 4, 2)),
        _idx(-3, 3, (2, 5)),
    ),
    # index.Tensor: negative indices, None entries, adjacent index tensors (dims stay in
    # place) and separated ones (dims move to the front), int/bool values, take
    "index": (
        lambda x, y, i, j, k: (x[i], y[:, i], y[:, i, j], y[k, :, j], torch.take(x, i)),
        _x(4, 3),
        _x(3, 4, 5),
        _idx(-3, 3, (2, 5)),
        _idx(-5, 5, (2, 5)),
        _idx(-3, 3, (2, 1)),
    ),
    "index_dtypes": (
        lambda x, b, i: (x[i], b[:, i]),
        _idx(-9, 9, (5, 2)),
        _bools(3, 4),
        _idx(0, 4, (6,)),
    ),
    # index_put.default: set, accumulate with duplicates, broadcast values, bool masks
    "index_put": (lambda x, i, v: _index_put(x, i, v), _x(3, 5), _idx(0, 5, (2,)), _x(1)),
    "index_put_acc": (
        lambda x, i, v: _index_put(x, i, v, True),
        _x(3, 5),
        lambda: torch.tensor([1, -1, 1, 0]),
        _x(3, 4),
    ),
    "index_put_two": (
        _put_two,
        _x(4, 5),
        lambda: torch.tensor([0, 2, 0, -1]),
        lambda: torch.tensor([1, 3, 1, 4]),
        _x(4),
    ),
    "setitem_int": (_setitem_int, _x(3, 5), lambda: torch.tensor([0, -2])),
    "setitem_mask": (_setitem_mask, _x(3, 4), _bools(3, 4)),
    "setitem_mask_rows": (_setitem_mask_rows, _x(5, 3), _bools(5), _x(3)),
    "setitem_mask_inner": (_setitem_mask_inner, _x(3, 4, 2), _bools(4)),
    "index_fill_copy_add": (
        lambda x, i, v, j: (
            x.index_fill(1, i, -1.0),
            x.index_copy(0, torch.tensor([2, 0]), v[:2]),
            x.index_add(0, j, v),
        ),
        _x(3, 5),
        _idx(-5, 5, (3,)),
        _x(5, 5),
        _idx(0, 3, (5,)),
    ),
    # index_select.default, also from roll
    "index_select": (lambda x, i: x.index_select(1, i), _x(3, 5), _idx(0, 5, (7,))),
    "roll": (lambda x: x.roll((1, -2), (0, 1)), _x(3, 5)),
    # masked_scatter.default (mask broadcasts)
    "masked_scatter": (lambda x, m, s: x.masked_scatter(m, s), _x(3, 4), _bools(4), _x(15)),
    # scatter.src / scatter.value / scatter_add.default (duplicates accumulate)
    "scatter": (
        lambda x, i, s, y: (
            x.scatter(0, i, s),
            y.scatter(1, i.T[:, :2], s.T),
            y.scatter(1, i.T, 2.5),
            x.scatter_add(0, i.flip(0) % 2, s),
        ),
        _x(4, 3),
        _perm_index(4, (3,)),
        _x(5, 3),
        _x(3, 4),
    ),
    "scatter_add_int": (
        lambda x, i, s: x.scatter_add(1, i, s),
        _idx(-9, 9, (3, 4)),
        _idx(0, 4, (3, 6)),
        _idx(-9, 9, (3, 6)),
    ),
    # select_scatter / slice_scatter.default (step, negative bounds)
    "select_slice_scatter": (
        lambda x, a, b, c: (
            x.select_scatter(a, 1, -1),
            x.slice_scatter(b, 1, 1, 100, 2),
            x.slice_scatter(c, 0, -2, -1),
        ),
        _x(3, 6),
        _x(3),
        _x(3, 3),
        _x(1, 6),
    ),
    # embedding.default
    "embedding": (lambda w, i: F.embedding(i, w), _x(10, 4), _idx(0, 10, (2, 3))),
    # put.default
    "put": (
        lambda x, i, s, j, t: (x.put(i, s), x.put(j, t, accumulate=True)),
        _x(3, 4),
        lambda: torch.tensor([0, -1, 5]),
        _x(3),
        _idx(-12, 12, (8,)),
        _x(8),
    ),
    # nonzero_static.default
    "nonzero_static": (
        lambda x: (
            torch.nonzero_static(x > 0, size=8),
            torch.nonzero_static(x > 0, size=20, fill_value=-7),
        ),
        _x(3, 4),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_indexing_parity(name):
    fn, *makers = CASES[name]
    check(fn, *(make() for make in makers))


@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(include_self):
    """scatter_reduce.two for every reduction, float and int, duplicate indices, untouched
    positions."""

    def fn(x, i, s, xi, si):
        return [
            (
                x.scatter_reduce(0, i, s, reduce, include_self=include_self),
                xi.scatter_reduce(1, i.T, si, reduce, include_self=include_self),
            )
            for reduce in ("sum", "prod", "mean", "amax", "amin")
        ]

    index = torch.randint(0, 3, (5, 4))
    check(
        fn,
        torch.randn(4, 4),
        index,
        torch.randn(5, 4),
        torch.randint(-9, 9, (4, 4)),
        torch.randint(-9, 9, (4, 5)),
        rtol=1e-5,
    )


GRAD_CASES = {
    "gather": (lambda x, i: x.gather(1, i), (torch.randn(3, 5), torch.randint(0, 5, (3, 7)))),
    "index": (
        lambda x, i, j: x[i, :, j],
        (torch.randn(3, 4, 5), torch.tensor([0, -1, 0]), torch.tensor([4, 1, 4])),
    ),
    "index_put_acc": (
        lambda x, v: torch.ops.aten.index_put(x, [torch.tensor([1, 1, -1])], v, True),
        (torch.randn(3, 4), torch.randn(4)),
        (0, 1),
    ),
    "index_put_set": (
        lambda x, v: torch.ops.aten.index_put(x, [None, torch.tensor([0, 3])], v),
        (torch.randn(3, 4), torch.randn(3, 2)),
        (0, 1),
    ),
    "scatter_add": (
        lambda x, s: x.scatter_add(0, torch.tensor([[0, 1], [0, 0], [2, 0]]), s),
        (torch.randn(3, 2), torch.randn(3, 2)),
        (0, 1),
    ),
    "slice_scatter": (
        lambda x, s: x.slice_scatter(s, 1, 0, 5, 2) * torch.arange(5.0),
        (torch.randn(3, 5), torch.randn(3, 3)),
        (0, 1),
    ),
    "embedding": (
        lambda w, i: F.embedding(i, w),
        (torch.randn(6, 3), torch.tensor([[1, 5, 1], [0, 1, 2]])),
    ),
    "embedding_padding": (
        lambda w, i: F.embedding(i, w, padding_idx=1),
        (torch.randn(6, 3), torch.tensor([[1, 5, 1], [0, 1, 2]])),
    ),
    "embedding_freq": (
        lambda w, i: F.embedding(i, w, scale_grad_by_freq=True) * torch.arange(3.0),
        (torch.randn(6, 3), torch.tensor([[1, 5, 1], [0, 1, 2]])),
    ),
    "masked_scatter": (
        lambda x, s: x.masked_scatter(torch.tensor([True, False, True]), s) * torch.arange(3.0),
        (torch.randn(2, 3), torch.randn(5)),
        (0, 1),
    ),
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_indexing_grad(name):
    fn, args, *wrt = GRAD_CASES[name]
    check_grad(fn, *args, wrt=wrt[0] if wrt else (0,))


def test_embedding_dense_backward():
    """embedding_dense_backward.default, called directly: torch does not export backward ops."""
    from zerojax.bridge.registry import get_lowering

    overload = torch.ops.aten.embedding_dense_backward.default
    grad, indices = torch.randn(2, 3, 4), torch.tensor([[1, 5, 1], [0, 1, 2]])
    lower = get_lowering(overload)
    for padding_idx, scale in [(-1, False), (1, False), (-1, True), (5, True)]:
        got = lower(None, from_torch(grad), from_torch(indices), 6, padding_idx, scale)
        expected = overload(grad, indices, 6, padding_idx, scale)
        assert_close(expected, to_torch(got), what=f"{padding_idx=} {scale=}")


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda x: x[x > 0], id="bool_mask_index"),
        pytest.param(lambda x: torch.nonzero(x), id="nonzero"),
        pytest.param(lambda x: torch.masked_select(x, x > 0), id="masked_select"),
    ],
)
def test_data_dependent_shapes_raise(fn):
    """Ops with value-dependent output sizes fail with a message naming a static rewrite."""
    with pytest.raises(UnsupportedOpError, match="depends on the tensor's values"):
        check(fn, torch.randn(3, 4))


def test_bool_accumulate_is_logical():
    """torch accumulates bool as logical or (sum) / and (prod)."""
    x = torch.rand(4, 5) > 0.5
    src = torch.rand(4, 5) > 0.5
    index = torch.randint(0, 4, (4, 5))
    check(lambda a, s, i: a.scatter_add(0, i, s), x, src, index)
    check(lambda a, s, i: a.scatter_reduce(0, i, s, "prod"), x, src, index)
    check(lambda a, s, i: a.index_put((i[:, 0],), s, accumulate=True), x, src, index)
    check(lambda a, s, i: a.put(i[0], s[0], accumulate=True), x, src, index)


@pytest.mark.parametrize("reduce", ["add", "multiply"])
def test_scatter_legacy_reduce(reduce):
    x, src = torch.randn(4, 5), torch.randn(4, 5)
    index = torch.randint(0, 4, (3, 5))
    check(lambda a, s, i: a.scatter(0, i, s, reduce=reduce), x, src, index)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    x, src = torch.randn(4, 3), torch.randn(6, 3)
    index = torch.randint(0, 4, (6,))
    check(lambda a, s, i: a.index_reduce(0, i, s, reduce, include_self=include_self), x, src, index)
    xi, srci = torch.randint(-9, 9, (3, 4)), torch.randint(-9, 9, (3, 6))
    check(
        lambda a, s, i: a.index_reduce(1, i, s, reduce, include_self=include_self), xi, srci, index
    )


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_bucketize(right):
    boundaries = torch.randint(0, 6, (7,)).sort().values.float()
    values = torch.randint(-1, 7, (3, 4)).float()
    check(lambda b, v: torch.searchsorted(b, v, right=right), boundaries, values)
    check(lambda b, v: torch.bucketize(v, b, right=right, out_int32=True), boundaries, values)
    batched = torch.randn(2, 3, 5).sort(-1).values
    check(
        lambda b, v: torch.searchsorted(b, v, side="right" if right else "left"),
        batched,
        torch.randn(2, 3, 4),
    )
    unsorted = torch.randn(6)
    sorter = unsorted.argsort()
    check(lambda b, s, v: torch.searchsorted(b, v, sorter=s), unsorted, sorter, torch.randn(5))
    check(lambda a, b: torch.isin(a, b), torch.randint(0, 9, (4, 4)), torch.randint(0, 9, (6,)))
