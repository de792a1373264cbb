"""Parity of the pooling lowerings (max/avg/adaptive, 2-d/3-d, backwards, embedding_bag).

Run: .venv/bin/python -m pytest tests/bridge/test_pooling.py -q
Index outputs are compared exactly; gradients through the converted function are compared with
torch autograd, since max pooling's gradient must land on torch's chosen element.
"""

import jax
import pytest
import torch
import torch.nn.functional as F

import zerojax
from tests.bridge.parity import Lambda, assert_close, check, run_both
from zerojax.bridge.capture import capture
from zerojax.bridge.dtypes import to_torch

aten = torch.ops.aten


def assert_grad_parity(fn, *args, atol=1e-5):
    """d sum(fn(*args)) / d args: jax.grad of the converted function vs torch autograd."""
    module = Lambda(fn)
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    fn(*leaves).sum().backward()
    expected = [a.grad if a.requires_grad else None for a in leaves]
    converted = zerojax.convert(module, args)
    floats = [i for i, a in enumerate(args) if a.is_floating_point()]

    def loss(*float_args):
        inputs = list(args)
        for i, value in zip(floats, float_args):
            inputs[i] = value
        out, _ = converted.apply(converted.params, converted.buffers, *inputs)
        return out.sum()

    jax_args = [jax.numpy.asarray(args[i].numpy()) for i in floats]
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(floats)))))(*jax_args)
    got = [to_torch(g) for g in grads]
    assert_close([expected[i] for i in floats], got, atol=atol, what="grad")


def graph_targets(fn, *args):
    graph = capture(Lambda(fn), args, {}, train=False).graph
    return {n.target for n in graph.nodes if n.op == "call_function"}


MAX_POOL_CASES = [
    # kernel, stride, padding, dilation, ceil_mode
    (2, 2, 0, 1, False),
    (3, 2, 1, 1, False),
    (3, 2, 1, 1, True),
    (3, 1, 1, 2, False),
    ((2, 3), (2, 1), (1, 1), (1, 2), True),
    (3, 3, 0, 1, True),
    (2, [], 0, 1, False),  # empty stride = kernel
]


def test_max_pool2d_with_indices():
    """Every case in one graph: one export and one compile (each output is compared)."""
    check(
        lambda x: [aten.max_pool2d_with_indices(x, *case) for case in MAX_POOL_CASES],
        torch.randn(2, 3, 9, 10),
    )


def test_max_pool_1d_and_unbatched_and_3d():
    check(lambda x: F.max_pool1d(x, 3, 2, 1, return_indices=True), torch.randn(2, 3, 11))
    check(lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), torch.randn(3, 9, 10))
    check(
        lambda x: F.max_pool3d(x, 3, 2, 1, ceil_mode=True, return_indices=True),
        torch.randn(2, 2, 5, 6, 7),
    )


def test_max_pool2d_ties_pick_torchs_element():
    """After ReLU many windows are all zero: torch takes the first; so must index and grad."""
    x = torch.randn(2, 3, 8, 8).relu()
    check(lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), x)
    assert_grad_parity(lambda x: F.max_pool2d(x, 3, 2, 1), x)


def test_max_pool2d_grad():
    assert_grad_parity(
        lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True) * F.max_pool2d(x, 2, 1, dilation=2)[..., :5, :6],
        torch.randn(2, 3, 9, 10),
    )


def test_max_pool_backward_ops():
    x = torch.randn(2, 3, 9, 10)
    grad = torch.randn(2, 3, 5, 6)

    def backward2d(g, x):
        indices = aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], True)[1]
        return aten.max_pool2d_with_indices_backward(
            g, x, [3, 3], [2, 2], [1, 1], [1, 1], True, indices
        )

    check(backward2d, grad, x)

    def backward3d(g, x):
        indices = aten.max_pool3d_with_indices(x, [2, 2, 2], [2, 2, 2])[1]
        return aten.max_pool3d_with_indices_backward(
            g, x, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False, indices
        )

    check(backward3d, torch.randn(1, 2, 2, 3, 3), torch.randn(1, 2, 4, 6, 7))


AVG_POOL_CASES = [
    # kernel, stride, padding, ceil_mode, count_include_pad, divisor_override
    (2, 2, 0, False, True, None),
    (3, 2, 1, False, True, None),
    (3, 2, 1, True, True, None),
    (3, 2, 1, True, False, None),
    ((2, 3), (2, 1), (1, 1), True, False, None),
    (3, 2, 1, True, True, 5),
]


def test_avg_pool2d():
    check(lambda x: [F.avg_pool2d(x, *case) for case in AVG_POOL_CASES], torch.randn(2, 3, 9, 10))


def test_avg_pool_1d_and_3d():
    check(lambda x: F.avg_pool1d(x, 3, 2, 1, ceil_mode=True), torch.randn(2, 3, 11))
    check(
        lambda x: F.avg_pool3d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        torch.randn(2, 2, 5, 6, 7),
    )


def test_avg_pool2d_grad_and_backward_op():
    x = torch.randn(2, 3, 9, 10)
    assert_grad_parity(
        lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), x
    )
    check(
        lambda g, x: aten.avg_pool2d_backward(g, x, [3, 3], [2, 2], [1, 1], True, False, None),
        torch.randn(2, 3, 5, 6),
        x,
    )
    check(
        lambda g, x: aten.avg_pool3d_backward(g, x, [2, 2, 2], [2, 2, 2], [1, 0, 1], False, True, 3),
        torch.randn(1, 2, 3, 3, 4),
        torch.randn(1, 2, 4, 6, 7),
    )


def test_adaptive_pool2d():
    """Non-divisible sizes give overlapping windows [floor(i*in/out), ceil((i+1)*in/out))."""
    sizes = [(3, 4), (4, 5), (5, 3), (7, 7), (3, 5), (9, 2)]
    check(
        lambda x: [
            (F.adaptive_avg_pool2d(x, size), F.adaptive_max_pool2d(x, size, return_indices=True))
            for size in sizes
        ],
        torch.randn(2, 3, 9, 10),
    )


def test_adaptive_pool_3d_and_1d():
    x = torch.randn(2, 2, 5, 6, 7)
    check(lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)), x)
    check(lambda x: F.adaptive_max_pool3d(x, (2, 3, 4), return_indices=True), x)
    check(lambda x: F.adaptive_avg_pool1d(x, 4), torch.randn(2, 3, 10))


def test_adaptive_avg_pool2d_grad_and_backward_op():
    x = torch.randn(2, 3, 9, 10)
    assert_grad_parity(lambda x: F.adaptive_avg_pool2d(x, (4, 3)), x)
    assert_grad_parity(lambda x: F.adaptive_max_pool2d(x, (4, 3)), x)
    check(
        lambda g, x: aten._adaptive_avg_pool2d_backward(g, x), torch.randn(2, 3, 4, 3), x
    )
    check(
        lambda g, x: aten._adaptive_avg_pool3d_backward(g, x),
        torch.randn(1, 2, 2, 3, 4),
        torch.randn(1, 2, 5, 6, 7),
    )
    check(
        lambda g, x: aten.adaptive_max_pool2d_backward(g, x, aten.adaptive_max_pool2d(x, [4, 3])[1]),
        torch.randn(2, 3, 4, 3),
        x,
    )


@pytest.mark.parametrize("mode", [0, 1, 2])  # sum, mean, max
def test_embedding_bag(mode):
    weight, offsets = torch.randn(10, 3), torch.tensor([0, 2, 2, 5])  # bag 1 is empty
    indices = torch.randint(0, 10, (9,))

    def bags(w, i, o):
        return [
            op(w, i, o, False, mode, False, None, include_last_offset, -1)
            for op in (aten._embedding_bag, aten._embedding_bag_forward_only)
            for include_last_offset in (False, True)
        ]

    expected, got = run_both(bags, weight, indices, offsets)
    for case, (e, g) in enumerate(zip(expected, got)):
        assert_close(e[0], g[0], what=f"case {case}")
        # The auxiliary outputs need only torch's dtypes and shapes -- except that
        # _embedding_bag_forward_only's fake-tensor shapes (which the converted graph follows)
        # differ from its eager ones under include_last_offset.
        for aux_e, aux_g in zip(e[1:], g[1:]):
            assert aux_g.dtype == torch.int32
            assert case == 3 or tuple(aux_e.shape) == tuple(aux_g.shape)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_padding_idx_and_2d_input(mode):
    weight = torch.randn(10, 3)
    check(
        lambda w, i, o: F.embedding_bag(i, w, o, mode=mode, padding_idx=3),
        weight,
        torch.tensor([3, 1, 3, 4, 3, 3, 5]),
        torch.tensor([0, 2, 2, 5]),
    )
    check(lambda w, i: F.embedding_bag(i, w, mode=mode), weight, torch.randint(0, 10, (4, 3)))


def test_embedding_bag_per_sample_weights_and_module():
    indices, offsets = torch.randint(0, 10, (9,)), torch.tensor([0, 4, 6])
    check(
        lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p),
        torch.randn(10, 3),
        indices,
        offsets,
        torch.randn(9),
    )
    bag = torch.nn.EmbeddingBag(10, 4, mode="mean")
    assert aten._embedding_bag.default in graph_targets(bag, indices, offsets)
    check(bag, indices, offsets)
