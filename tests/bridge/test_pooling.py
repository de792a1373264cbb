"""Parity of the pooling lowerings (max/avg/adaptive, 2-d/3-d, backwards, embedding_bag).

Run: .venv/bin/python -m pytest tests/bridge/test_pooling.py -q
Index outputs are compared exactly; gradients through the converted function are compared with
torch autograd, since max pooling's gradient must land on torch's chosen element. Many cases
share one graph (one export, one compile) to keep the file fast; each output is compared.
"""

import torch
import torch.nn.functional as F

from tests.bridge.parity import (
    Lambda,
    assert_close,
    check,
    check_grad,
    float64_gradient_errors,
    run_both,
)
from zerojax.bridge.capture import capture

aten = torch.ops.aten


def graph_targets(fn, *args):
    graph = capture(fn if isinstance(fn, torch.nn.Module) else Lambda(fn), args, {}, train=False)
    return {n.target for n in graph.graph.nodes if n.op == "call_function"}


MAX_POOL_CASES = [
    # kernel, stride, padding, dilation, ceil_mode
    (2, 2, 0, 1, False),
    (3, 2, 1, 1, False),
    (3, 2, 1, 1, True),
    (3, 1, 1, 2, False),
    ((2, 3), (2, 1), (1, 1), (1, 2), True),
    (3, 3, 0, 1, True),
    (2, [], 0, 1, False),  # an empty stride means stride = kernel
]


def test_max_pool2d_with_indices():
    check(
        lambda x: [aten.max_pool2d_with_indices(x, *case) for case in MAX_POOL_CASES],
        torch.randn(2, 3, 9, 10),
    )


def test_max_pool_1d_unbatched_and_3d():
    check(
        lambda x1, x2, x3: (
            F.max_pool1d(x1, 3, 2, 1, return_indices=True),
            F.max_pool2d(x2, 3, 2, 1, return_indices=True),
            F.max_pool3d(x3, 3, 2, 1, ceil_mode=True, return_indices=True),
        ),
        torch.randn(2, 3, 11),
        torch.randn(3, 9, 10),
        torch.randn(2, 2, 5, 6, 7),
    )


def test_max_pool2d_ties_pick_torchs_element():
    """After ReLU many windows are all zero: torch takes the first; so must index and grad."""
    x = torch.randn(2, 3, 8, 8).relu()
    check(lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), x)
    check_grad(lambda x: F.max_pool2d(x, 3, 2, 1), x)


def test_max_pool2d_grad():
    check_grad(
        lambda x, w: (
            F.max_pool2d(x, 3, 2, 1, ceil_mode=True) * w + F.max_pool2d(x, 2, 1, dilation=2).sum()
        ),
        torch.randn(2, 3, 9, 10),
        torch.randn(2, 3, 5, 6),
    )


def test_pool_backward_ops():
    def backwards(g2, x2, g3, x3, g_avg, g_adaptive):
        indices2 = aten.max_pool2d_with_indices(x2, [3, 3], [2, 2], [1, 1], [1, 1], True)[1]
        indices3 = aten.max_pool3d_with_indices(x3, [2, 2, 2], [2, 2, 2])[1]
        adaptive_indices = aten.adaptive_max_pool2d(x2, [4, 3])[1]
        return (
            aten.max_pool2d_with_indices_backward(
                g2, x2, [3, 3], [2, 2], [1, 1], [1, 1], True, indices2
            ),
            aten.max_pool3d_with_indices_backward(
                g3, x3, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False, indices3
            ),
            aten.avg_pool2d_backward(g2, x2, [3, 3], [2, 2], [1, 1], True, False, None),
            aten.avg_pool3d_backward(g_avg, x3, [2, 2, 2], [2, 2, 2], [1, 0, 1], False, True, 3),
            aten._adaptive_avg_pool2d_backward(g_adaptive, x2),
            aten._adaptive_avg_pool3d_backward(g3, x3),
            aten.adaptive_max_pool2d_backward(g_adaptive, x2, adaptive_indices),
        )

    check(
        backwards,
        torch.randn(2, 3, 5, 6),
        torch.randn(2, 3, 9, 10),
        torch.randn(1, 2, 2, 3, 3),
        torch.randn(1, 2, 4, 6, 7),
        torch.randn(1, 2, 3, 3, 4),
        torch.randn(2, 3, 4, 3),
    )


AVG_POOL_CASES = [
    # kernel, stride, padding, ceil_mode, count_include_pad, divisor_override
    (2, 2, 0, False, True, None),
    (3, 2, 1, False, True, None),
    (3, 2, 1, True, True, None),
    (3, 2, 1, True, False, None),
    ((2, 3), (2, 1), (1, 1), True, False, None),
    (3, 2, 1, True, True, 5),
]


def test_avg_pool():
    check(
        lambda x, x1, x3: (
            [F.avg_pool2d(x, *case) for case in AVG_POOL_CASES],
            F.avg_pool1d(x1, 3, 2, 1, ceil_mode=True),
            F.avg_pool3d(x3, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        ),
        torch.randn(2, 3, 9, 10),
        torch.randn(2, 3, 11),
        torch.randn(2, 2, 5, 6, 7),
    )


def test_avg_pool2d_grad():
    # The second pool's windows never reach the last row (floor mode crops it).
    check_grad(
        lambda x, w, w2: (
            (F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False) * w).sum()
            + (F.avg_pool2d(x, 2) * w2).sum()
        ),
        torch.randn(2, 3, 9, 10),
        torch.randn(2, 3, 5, 6),
        torch.randn(2, 3, 4, 5),
    )


def test_adaptive_pool():
    """Non-divisible sizes give overlapping windows [floor(i*in/out), ceil((i+1)*in/out))."""
    sizes = [(3, 4), (4, 5), (5, 3), (7, 7), (9, 2), (3, 5)]
    check(
        lambda x, x3, x1: (
            [
                (F.adaptive_avg_pool2d(x, s), F.adaptive_max_pool2d(x, s, return_indices=True))
                for s in sizes
            ],
            F.adaptive_avg_pool3d(x3, (2, 3, 4)),
            F.adaptive_max_pool3d(x3, (2, 3, 4), return_indices=True),
            F.adaptive_avg_pool1d(x1, 4),
        ),
        torch.randn(2, 3, 9, 10),
        torch.randn(2, 2, 5, 6, 7),
        torch.randn(2, 3, 10),
    )


def test_adaptive_pool2d_grad():
    check_grad(
        lambda x, w: (F.adaptive_avg_pool2d(x, (4, 3)) + F.adaptive_max_pool2d(x, (4, 3))) * w,
        torch.randn(2, 3, 9, 10),
        torch.randn(2, 3, 4, 3),
    )


def test_embedding_bag_raw_ops():
    """Every mode x include_last_offset x {_embedding_bag, _forward_only}; bag 1 is empty."""
    cases = [
        (op, mode, last)
        for op in (aten._embedding_bag, aten._embedding_bag_forward_only)
        for mode in (0, 1, 2)  # sum, mean, max
        for last in (False, True)
    ]
    expected, got = run_both(
        lambda w, i, o: [
            op(w, i, o, False, mode, False, None, last, -1) for op, mode, last in cases
        ],
        torch.randn(10, 3),
        torch.randint(0, 10, (9,)),
        torch.tensor([0, 2, 2, 5]),
    )
    for (op, mode, last), e, g in zip(cases, expected, got):
        assert_close(e[0], g[0], what=f"{op} mode={mode} include_last_offset={last}")
        # The auxiliary outputs need only torch's dtypes and shapes -- except that
        # _embedding_bag_forward_only's fake-tensor shapes (which the converted graph follows)
        # differ from its eager ones under include_last_offset.
        for aux_e, aux_g in zip(e[1:], g[1:]):
            assert aux_g.dtype == torch.int32
            if op is aten._embedding_bag or not last:
                assert tuple(aux_e.shape) == tuple(aux_g.shape)


def test_embedding_bag_padding_idx_2d_input_and_per_sample_weights():
    check(
        lambda w, i, o, i2, p: (
            [
                (
                    F.embedding_bag(i, w, o, mode=mode, padding_idx=3),
                    F.embedding_bag(i2, w, mode=mode),
                )
                for mode in ("sum", "mean", "max")
            ]
            + [F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p)]
        ),
        torch.randn(10, 3),
        torch.tensor([3, 1, 3, 4, 3, 3, 5]),
        torch.tensor([0, 2, 2, 5]),
        torch.randint(0, 10, (4, 3)),
        torch.randn(7),
    )


def test_embedding_bag_module():
    bag = torch.nn.EmbeddingBag(10, 4, mode="mean")
    indices, offsets = torch.randint(0, 10, (9,)), torch.tensor([0, 4, 6])
    assert aten._embedding_bag.default in graph_targets(bag, indices, offsets)
    check(bag, indices, offsets)


def test_fractional_max_pool():
    """The random window placement is an input (torch draws it with aten.rand), so it is fed."""
    check(
        lambda x, s, x3, s3: (
            aten.fractional_max_pool2d(x, [2, 3], [4, 5], s),
            aten.fractional_max_pool2d(x, [3, 3], [7, 1], s),
            aten.fractional_max_pool2d(x[0], [2, 2], [5, 5], s[:1]),
            aten.fractional_max_pool3d(x3, [2, 2, 3], [3, 4, 2], s3),
        ),
        torch.randn(2, 3, 9, 10),
        torch.rand(2, 3, 2),
        torch.randn(2, 2, 5, 6, 7),
        torch.rand(2, 2, 3),
    )


def test_avg_pool1d_and_adaptive_avg_pool1d_overloads():
    """Core-ATen 1-d overloads (F.avg_pool1d decomposes to the 2-d op; call them directly)."""
    x = torch.randn(2, 3, 11)
    check(lambda x: torch.ops.aten.avg_pool1d(x, [3], [2], [1], True, False), x)
    check(lambda x: torch.ops.aten.adaptive_avg_pool1d(x, [4]), x)


class ResNeStDownsamplePools(torch.nn.Module):
    """The pools of timm resnest14d's strided block on an odd map (layer3.0 at some input
    sizes): the shortcut's AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False), whose last
    window overhangs the input, and the avd AvgPool2d(3, 2, padding=1), each feeding a conv."""

    def __init__(self, channels=4):
        super().__init__()
        self.shortcut_pool = torch.nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
        self.shortcut_conv = torch.nn.Conv2d(channels, 8, 1, bias=False)
        self.avd_pool = torch.nn.AvgPool2d(3, 2, padding=1)
        self.avd_conv = torch.nn.Conv2d(channels, 8, 1)

    def forward(self, x):
        return self.shortcut_conv(self.shortcut_pool(x)) + self.avd_conv(self.avd_pool(x))


def test_resnest_downsample_pools_grad_against_float64():
    """Issue 15 suspected these pools for a resnest14d gradient error; the error was a ReLU
    pre-activation within fp32 rounding of 0 (the gate flips in any fp32 program), not the
    pools. Pinned against float64: every gradient entry is a sum of at most 2*4*4 = 32 products
    (the 1x1 conv weights over batch x 4x4 outputs) or 9 window shares x 8 channels, so fp32
    rounding stays below 64 eps = 7.6e-6 relative."""
    torch.manual_seed(0)
    errors = float64_gradient_errors(ResNeStDownsamplePools(), torch.randn(2, 4, 7, 7))
    assert set(errors) == {
        "input 0",
        "shortcut_conv.weight",
        "avd_conv.weight",
        "avd_conv.bias",
    }
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 64 * 1.2e-7, f"gradient of {worst}: relative error {errors[worst]:.2e}"
