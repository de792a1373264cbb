"""Parity of the convolution lowerings (forward, backward, gradients) with torch eager.

Run: .venv/bin/python -m pytest -q tests/bridge/test_conv.py -p no:cacheprovider

Covers 1d/2d/3d, strides, padding, dilation, groups and transposed convolution with
output_padding and groups (every form reaches zerojax as aten.convolution.default), bf16 with
fp32 accumulation, aten.convolution_backward called directly, and jax.grad of converted modules
against torch autograd.
"""

import jax
import jax.numpy as jnp
import pytest
import torch
from jax import lax
from torch import nn

from tests import tolerances
from tests.bridge.parity import Each, check, check_grad, float64_gradient_errors, run_both
from zerojax.bridge.dtypes import from_torch, to_torch
from zerojax.bridge.lowerings.conv import convolution

FP32 = {"rtol": 1e-5, "atol": 1e-5}
aten = torch.ops.aten


def test_convolution():
    cases = [
        (nn.Conv1d(3, 4, 3, stride=2, padding=1), (2, 3, 9)),
        (
            nn.Conv2d(4, 6, 3, stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2),
            (2, 4, 8, 9),
        ),
        (nn.Conv2d(3, 6, 3, groups=3, bias=False), (2, 3, 6, 6)),
        (nn.Conv3d(2, 4, (2, 3, 3), stride=2, padding=1), (1, 2, 5, 6, 7)),
    ]
    check(Each(*(m for m, _ in cases)), *(torch.randn(*s) for _, s in cases), **FP32)


def test_convolution_transposed():
    cases = [
        (nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), (2, 4, 5)),
        (
            nn.ConvTranspose2d(
                4,
                6,
                3,
                stride=(2, 3),
                padding=(1, 0),
                output_padding=(1, 2),
                groups=2,
                dilation=(2, 1),
            ),
            (2, 4, 5, 5),
        ),
        # padding > dilation * (kernel - 1): the equivalent plain conv crops its input.
        (nn.ConvTranspose2d(4, 2, 3, padding=3), (2, 4, 7, 7)),
        (nn.ConvTranspose3d(2, 4, 2, stride=2, bias=False), (1, 2, 3, 4, 3)),
    ]
    check(Each(*(m for m, _ in cases)), *(torch.randn(*s) for _, s in cases), **FP32)


def test_convolution_bf16():
    plain = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
    transposed = nn.ConvTranspose2d(3, 4, 3, stride=2, output_padding=1)
    module = Each(plain, transposed).bfloat16()
    inputs = torch.randn(2, 4, 8, 8).bfloat16(), torch.randn(2, 3, 5, 5).bfloat16()
    expected, got = run_both(module, *inputs)
    # Elementwise bound roundings x u x S, S = conv(|x|, |w|) + |b| (tolerances.py). zerojax
    # accumulates in fp32 and rounds once. torch's plain conv does too (oneDNN, or ATen's
    # im2col + fp32-accumulated gemm where oneDNN lacks bf16): 2 roundings. Its transposed conv
    # without oneDNN bf16 (e.g. an AMD EPYC) rounds each gemm column (1), each of up to
    # kernel-numel = 9 col2im adds (9) and the bias add (1): 12 with zerojax's.
    magnitude = tolerances.absolute(module)(*(x.abs().double() for x in inputs))
    for what, e, g, s, roundings in zip(("plain", "transposed"), expected, got, magnitude, (2, 12)):
        bound = tolerances.rounded_intermediates(torch.bfloat16, roundings, s)
        tolerances.assert_within(g, e, bound, what)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
def test_functional_forms():
    """Unbatched input, padding='same' (asymmetric: padded first) and aten._convolution."""
    x, w = torch.randn(3, 6, 6), torch.randn(2, 3, 2, 2)

    def fn(x, w):
        return (
            nn.functional.conv2d(x, w),
            nn.functional.conv2d(x[None], w, padding="same"),
            aten._convolution(
                x[None], w, None, [1, 1], [1, 0], [1, 1], False, [0, 0], 1, False, False, True, True
            ),
        )

    check(fn, x, w, **FP32)


def test_convolution_backward():
    def fn(grad, x, w, grad_t, x_t, w_t):
        plain = aten.convolution_backward(
            grad, x, w, [2], [2, 1], [1, 0], [1, 1], False, [0, 0], 1, [True, True, True]
        )
        # Transposed and grouped, grad_weight masked off (torch eager fills it anyway: skip it).
        transposed = aten.convolution_backward(
            grad_t, x_t, w_t, [6], [2], [1], [1], True, [1], 2, [True, False, True]
        )
        return plain, transposed[0], transposed[2]

    shapes = [(2, 2, 3, 3), (2, 3, 6, 5), (2, 3, 3, 3), (2, 6, 10), (2, 4, 5), (4, 3, 3)]
    check(fn, *(torch.randn(*s) for s in shapes), **FP32)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2), (2, 4, 9, 9)),
        (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, output_padding=1, groups=2), (2, 4, 5)),
    ],
)
def test_convolution_grad(make, shape):
    check_grad(make(), torch.randn(*shape), rtol=1e-4, atol=1e-4)


WINDOW_LARGER_THAN_INPUT_OR_OUTPUT = [
    # ResNet-18's last stage, ConvNeXt's depthwise 7x7 on 2x2; strided, dilated, grouped, 1-d, 3-d.
    (lambda: nn.Conv2d(6, 4, 3, padding=1), (2, 6, 2, 2)),
    (lambda: nn.Conv2d(4, 4, 7, padding=3, groups=4), (2, 4, 2, 3)),
    (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=(2, 1), dilation=(2, 1), groups=2), (2, 4, 3, 5)),
    (lambda: nn.Conv1d(3, 5, 5, padding=2, bias=False), (2, 3, 4)),
    (lambda: nn.Conv3d(2, 4, 3, padding=1), (1, 2, 2, 3, 4)),
    # Larger than the output: ResNet-18's stride-2 conv from 4x4 to 2x2; a valid 3x3 on 4x4.
    (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1), (2, 4, 4, 4)),
    (lambda: nn.Conv2d(4, 6, 3, bias=False), (2, 4, 4, 5)),
]


GROUPED = [
    # ConvNeXt's depthwise 7x7 (pad 3); MobileNet's depthwise 3x3 stride 2; a channel multiplier
    # of 2 with dilation and per-dim padding; ResNeXt's 3x3 with 4 channels per group; 1-d;
    # 3-d with a multiplier.
    (lambda: nn.Conv2d(6, 6, 7, padding=3, groups=6), (2, 6, 9, 9)),
    (lambda: nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4, bias=False), (2, 4, 9, 8)),
    (
        lambda: nn.Conv2d(3, 6, (3, 2), stride=(1, 2), padding=(2, 1), dilation=(2, 1), groups=3),
        (2, 3, 8, 9),
    ),
    (lambda: nn.Conv2d(8, 12, 3, padding=1, groups=2), (2, 8, 7, 6)),
    (lambda: nn.Conv1d(4, 4, 5, padding=2, groups=4), (2, 4, 11)),
    (lambda: nn.Conv3d(2, 4, 3, padding=1, groups=2), (1, 2, 4, 5, 6)),
]


@pytest.mark.parametrize("make, shape", WINDOW_LARGER_THAN_INPUT_OR_OUTPUT + GROUPED)
def test_cpu_convolution_forms(make, shape):
    """The forms conv.py takes on CPU: the patch product for a window larger than the input
    or output; for groups > 1, the kernel gradient formed tap by tap."""
    torch.manual_seed(0)
    module = make()
    check(module, torch.randn(*shape), **FP32)
    check_grad(module, torch.randn(*shape), rtol=1e-4, atol=1e-4)


def test_window_larger_than_input_backward_and_bf16():
    """convolution_backward through the patch product, and bf16 operands accumulated in fp32."""

    def fn(grad, x, w):
        return aten.convolution_backward(
            grad, x, w, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 2, [True, True, True]
        )

    check(fn, torch.randn(2, 4, 2, 2), torch.randn(2, 6, 2, 2), torch.randn(4, 3, 3, 3), **FP32)
    module = nn.Conv2d(6, 4, 3, padding=1).bfloat16()
    x = torch.randn(2, 6, 2, 2).bfloat16()
    (expected,), (got,) = run_both(Each(module), x)
    magnitude = tolerances.absolute(Each(module))(x.abs().double())[0]
    bound = tolerances.rounded_intermediates(torch.bfloat16, 2, magnitude)
    tolerances.assert_within(got, expected, bound, "window larger than input, bf16")


class MobileNetV4InvertedResidual(nn.Module):
    """timm mobilenetv4_conv_small's universal inverted residual without its ReLUs: depthwise
    5x5 stride 2 (dw_start), pointwise expansion, depthwise 3x3 (dw_mid), pointwise projection,
    on an odd 13x13 map (the stride-2 windows overhang the padding unevenly)."""

    def __init__(self, channels=8, expanded=16):
        super().__init__()
        self.dw_start = nn.Conv2d(channels, channels, 5, 2, 2, groups=channels, bias=False)
        self.pw_exp = nn.Conv2d(channels, expanded, 1, bias=False)
        self.dw_mid = nn.Conv2d(expanded, expanded, 3, 1, 1, groups=expanded, bias=False)
        self.pw_proj = nn.Conv2d(expanded, channels, 1)

    def forward(self, x):
        return self.pw_proj(self.dw_mid(self.pw_exp(self.dw_start(x))))


def test_mobilenetv4_depthwise_block_grad_against_float64():
    """Issue 15 suspected mobilenetv4's convs for a 6e-3 gradient error; the error was one ReLU
    pre-activation of -3.5e-8 (float64) in blocks.3.2.dw_mid, which fp32 programs round to
    either sign (torch -4e-6, XLA +3e-6): one gate flipped, the convs were exact to fp32. Pinned
    against float64: the longest fp32 chain is a depthwise weight gradient over batch x 7x7
    outputs (98 products) after 16 + 25 + 9 accumulations upstream: ~150 eps = 1.8e-5."""
    torch.manual_seed(0)
    errors = float64_gradient_errors(MobileNetV4InvertedResidual(), torch.randn(2, 8, 13, 13))
    assert len(errors) == 6  # the input and five parameters
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 150 * 1.2e-7, f"gradient of {worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_per_group", [1, 3])
def test_grouped_kernel_gradient_against_float64(dtype, channels_per_group):
    """Each kernel tap's gradient is one fp32 sum of T = batch x output-positions products
    (exact for bf16 operands, rounded once in fp32): |error| <= T u_fp32 S, S the same sum of
    |x| |grad|, plus u_bf16 S for rounding a bf16 result. Differentiating the lowering
    directly, so the bound is the lowering's alone. Depthwise with a channel multiplier of 2,
    and 3 channels per group."""
    torch.manual_seed(0)
    groups, stride, padding = 4, [2], [2]
    x = torch.randn(4, groups * channels_per_group, 15, 15).to(dtype)
    w = torch.randn(2 * groups, channels_per_group, 5, 5).to(dtype)
    out_shape = torch.nn.functional.conv2d(x.float(), w.float(), None, 2, 2, 1, groups).shape
    g = torch.randn(out_shape).to(dtype)

    def float64_kernel_gradient(x, g):
        w64 = w.double().requires_grad_()
        torch.nn.functional.conv2d(x, w64, None, 2, 2, 1, groups).backward(g)
        return w64.grad

    exact = float64_kernel_gradient(x.double(), g.double())
    magnitude = float64_kernel_gradient(x.double().abs(), g.double().abs())

    def conv(w):
        return convolution(from_torch(x), w, None, stride, padding, [1], False, [0], groups)

    out, pullback = jax.vjp(conv, from_torch(w))
    (got,) = pullback(from_torch(g).astype(out.dtype))  # fp32 for bf16: accumulated in fp32
    assert got.dtype == from_torch(w).dtype
    terms = 4 * out_shape[2] * out_shape[3]
    bound = terms * tolerances.unit_roundoff(torch.float32) * magnitude
    if dtype == torch.bfloat16:
        bound = bound + tolerances.unit_roundoff(torch.bfloat16) * magnitude
    tolerances.assert_within(to_torch(got), exact, bound, f"grouped kernel gradient, {dtype}")


@pytest.mark.parametrize("channels_per_group", [1, 4])
def test_grouped_kernel_gradient_is_not_a_dense_convolution(channels_per_group):
    """Autodiff's kernel gradient of a grouped convolution carries `batch_group_count`, which
    XLA:CPU runs as a dense convolution over all channel pairs (conv.py); the lowering's has
    no such convolution."""
    x = jnp.ones((2, 6 * channels_per_group, 9, 9))
    w = jnp.ones((6, channels_per_group, 7, 7))

    def autodiff_loss(w):
        dimension_numbers = ("NCHW", "OIHW", "NCHW")
        padding = [(3, 3)] * 2
        return lax.conv_general_dilated(
            x, w, (1, 1), padding, None, None, dimension_numbers, 6
        ).sum()

    def loss(w):
        return convolution(x, w, None, [1], [3], [1], False, [0], 6).sum()

    assert "batch_group_count = 6" in jax.jit(jax.grad(autodiff_loss)).lower(w).as_text()
    assert "batch_group_count" not in jax.jit(jax.grad(loss)).lower(w).as_text()
