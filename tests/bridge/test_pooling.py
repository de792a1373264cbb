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


@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil_mode", MAX_POOL_CASES)
def test_max_pool2d_with_indices(kernel, stride, padding, dilation, ceil_mode):
    check(
        lambda x: aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode),
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


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_max_pool2d_grad(ceil_mode):
    assert_grad_parity(lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=ceil_mode), torch.randn(2, 3, 9, 10))


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


@pytest.mark.parametrize("kernel,stride,padding,ceil_mode,include_pad,divisor", AVG_POOL_CASES)
def test_avg_pool2d(kernel, stride, padding, ceil_mode, include_pad, divisor):
    check(
        lambda x: F.avg_pool2d(x, kernel, stride, padding, ceil_mode, include_pad, divisor),
        torch.randn(2, 3, 9, 10),
    )


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
        torch.randn(2, 3, 5, 5),
        x,
    )
    check(
        lambda g, x: aten.avg_pool3d_backward(g, x, [2, 2, 2], [2, 2, 2], [1, 0, 1], False, True, 3),
        torch.randn(1, 2, 3, 3, 4),
        torch.randn(1, 2, 4, 6, 7),
    )


@pytest.mark.parametrize("output_size", [(3, 4), (4, 5), (5, 3), (7, 7), (3, 5)])
def test_adaptive_pool2d(output_size):
    """Non-divisible sizes give overlapping windows [floor(i*in/out), ceil((i+1)*in/out))."""
    x = torch.randn(2, 3, 9, 10)
    check(lambda x: F.adaptive_avg_pool2d(x, output_size), x)
    check(lambda x: F.adaptive_max_pool2d(x, output_size, return_indices=True), x)


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


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag(mode, include_last_offset):
    weight, offsets = torch.randn(10, 3), torch.tensor([0, 2, 2, 5])  # bag 1 empty
    indices = torch.randint(0, 10, (9,))
    bag = lambda w, i, o: F.embedding_bag(i, w, o, mode=mode, include_last_offset=include_last_offset)  # noqa: E731
    check(bag, weight, indices, offsets)
    # The three auxiliary outputs only need torch's shapes and dtypes. (_embedding_bag_forward_only's
    # fake-tensor shapes differ from its eager ones with include_last_offset; the converted graph
    # follows the fake ones, so only the first output is compared for it.)
    mode_code = {"sum": 0, "mean": 1, "max": 2}[mode]
    for op in (aten._embedding_bag, aten._embedding_bag_forward_only):
        expected, got = run_both(
            lambda w, i, o: op(w, i, o, False, mode_code, False, None, include_last_offset, -1),
            weight,
            indices,
            offsets,
        )
        assert_close(expected[0], got[0], what=str(op))
        if op is aten._embedding_bag:
            for e, g in zip(expected[1:], got[1:]):
                assert tuple(e.shape) == tuple(g.shape) and g.dtype == torch.int32


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
