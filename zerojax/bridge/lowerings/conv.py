"""Lowerings: N-d convolution (plain, grouped, dilated, transposed) and its backward.

Every form becomes one `lax.conv_general_dilated` in torch's NC<spatial> layout. A transposed
convolution is the input-gradient of a plain one: the input is dilated by the stride
(`lhs_dilation`), padded by dilation * (kernel - 1) - padding (+ output_padding on the high
side), and convolved with the spatially flipped kernel whose in/out channels are swapped within
each group. Accumulation follows `matmul.product_options` (fp32 for bf16/fp16).

On XLA:CPU a convolution whose window is larger than its input in some spatial dim (a 3x3
pad-1 conv on ResNet-18's 2x2 last stage, ConvNeXt's 7x7 depthwise conv on 4x4 and 2x2) takes
a generic loop that runs at 0.4-0.7 GFLOP/s: ~180 ms forward, ~380 ms forward+backward for one
512-channel 3x3 conv at batch 8 on 2x2, where the same product as a matrix multiply takes 1.3
and 4.3 ms. A window larger than the output does the same to the backward: the input gradient
convolves the output-sized gradient (ResNet-18's 3x3 stride-2 conv from 4x4 to 2x2: 44 ms
forward+backward, 2.3 ms as a product). Such a conv is lowered as that product instead
(`_patch_convolution`): every kernel offset's strided view of the padded input, stacked,
contracted with the kernel.

A grouped convolution's kernel gradient (depthwise in MobileNet, EfficientNet and ConvNeXt;
32 groups in ResNeXt; RegNet's group widths) is, in autodiff's transpose, a convolution with
`batch_group_count`, which XLA:CPU expands into a dense convolution over all channel pairs,
masked to the groups and summed: groups times the work. On CPU a grouped conv takes
`_grouped_convolution`, whose backward forms that gradient directly, kernel tap by kernel tap:
the padded input's strided view times the output gradient, summed over batch and space (per
group, a product over the group's channels). bench/grouped_conv.py: ResNeXt's 3x3 with 32
groups on 128 channels of 16x16 at batch 8, 499 -> 5.5 ms; ConvNeXt's depthwise 7x7 on 96
channels of 8x8, 3.5 -> 1.5 ms; a resnext50_32x4d training step, 3.7 -> 0.42 s.

With the batch split over devices, a convolution whose groups hold more than one input channel
each runs per batch shard (`_split_over_batch`): XLA's partitioner would gather the batch for
it and convolve the whole batch on every device (`zerojax.bridge.kernel_sharding`).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import torch
from jax import lax

from zerojax.bridge.dtypes import result_type
from zerojax.bridge.kernel_sharding import on_batch_shards
from zerojax.bridge.lowerings.matmul import matmul_einsum, product_options
from zerojax.bridge.registry import lowering

aten = torch.ops.aten


def _per_dim(values, num_spatial: int) -> tuple[int, ...]:
    """torch accepts one value for every spatial dim ([2] means [2, 2] for a 2-d conv)."""
    values = tuple(int(v) for v in values)
    return values * num_spatial if len(values) == 1 else values


def _transposed_kernel(weight, groups: int):
    """(C_in, C_out/g, *k) transposed-conv weight -> flipped (C_out, C_in/g, *k) conv weight."""
    c_in, c_out_per_group, *kernel = weight.shape
    grouped = weight.reshape(groups, c_in // groups, c_out_per_group, *kernel)
    swapped = jnp.swapaxes(grouped, 1, 2).reshape(groups * c_out_per_group, c_in // groups, *kernel)
    return jnp.flip(swapped, axis=tuple(range(2, weight.ndim)))


def _window_exceeds_input_or_output(input_size, pads, kernel_size, strides, dilation) -> bool:
    """Whether XLA:CPU's convolution, or its input gradient, would take the slow loop (module
    docstring)."""
    if jax.default_backend() != "cpu":
        return False
    for n, (lo, hi), k, s, d in zip(input_size, pads, kernel_size, strides, dilation, strict=True):
        window = d * (k - 1) + 1
        if window > min(n, (n + lo + hi - window) // s + 1):
            return True
    return False


def _padded(input, pads):
    return lax.pad(
        input, jnp.zeros((), input.dtype), [(0, 0, 0)] * 2 + [(lo, hi, 0) for lo, hi in pads]
    )


def _output_size(spatial, pads, kernel_size, window_strides, dilation) -> list[int]:
    return [
        (size + lo + hi - d * (k - 1) - 1) // s + 1
        for size, (lo, hi), k, d, s in zip(spatial, pads, kernel_size, dilation, window_strides)
    ]


def _offset_views(padded, kernel_size, out_size, window_strides, dilation) -> list:
    """For every kernel offset (row-major), the (N, C, *out_size) strided view of the padded
    input that the offset's kernel tap multiplies."""
    n, c = padded.shape[:2]
    views = []
    for offsets in itertools.product(*(range(k) for k in kernel_size)):
        start = [0, 0] + [o * d for o, d in zip(offsets, dilation)]
        limit = [n, c] + [
            first + (o - 1) * s + 1 for first, o, s in zip(start[2:], out_size, window_strides)
        ]
        views.append(lax.slice(padded, start, limit, [1, 1, *window_strides]))
    return views


@functools.partial(jax.checkpoint, static_argnums=(2, 3, 4, 5))
def _patch_convolution(input, kernel, window_strides, pads, dilation, groups):
    """A plain (N, C_in, *s) x (C_out, C_in/g, *k) convolution as one contraction: the padded
    input's strided view for each kernel offset, stacked on a kernel-offset axis, times the
    kernel. Autodiff of the views (pads and slices) and the product is fast everywhere.

    Rematerialized: the backward pass stacks the views again rather than keep them, one copy of
    the input per kernel offset (49 for ConvNeXt's 7x7 depthwise convs on 4x4 and 2x2: 43 MB of
    the bench net's 95 MB of residuals). bench/cnn_step.py's ConvNeXt, interleaved A/B: the
    user's loop 164.4 -> 151.2 ms, the fused step 180.0 -> 164.7."""
    num_spatial = kernel.ndim - 2
    n, c_in, *spatial = input.shape
    c_out, c_per_group, *kernel_size = kernel.shape
    out_size = _output_size(spatial, pads, kernel_size, window_strides, dilation)
    views = _offset_views(_padded(input, pads), kernel_size, out_size, window_strides, dilation)
    spatial_letters = "xyz"[:num_spatial]
    if groups == 1:
        # The kernel as it is (its offsets row-major, as the views): the product's backward
        # then keeps the parameter itself, not a reshaped copy of it, for the input gradient.
        offset_letters = "ijk"[:num_spatial]
        patches = jnp.stack(views, axis=2).reshape(n, c_in, *kernel_size, *out_size)
        return matmul_einsum(
            f"nc{offset_letters}{spatial_letters},oc{offset_letters}->no{spatial_letters}",
            patches,
            kernel,
        )
    num_offsets = len(views)
    patches = jnp.stack(views, axis=2).reshape(n, groups, c_in // groups, num_offsets, *out_size)
    kernel = kernel.reshape(groups, c_out // groups, c_per_group, num_offsets)
    out = matmul_einsum(f"ngck{spatial_letters},gock->ngo{spatial_letters}", patches, kernel)
    return out.reshape(n, c_out, *out_size)


def _lax_convolution(input, kernel, window_strides, pads, lhs_dilation, dilation, groups):
    num_spatial = kernel.ndim - 2
    spatial = "DHW"[3 - num_spatial :]  # torch convolves over 1 to 3 spatial dims
    dimension_numbers = lax.conv_dimension_numbers(
        input.shape, kernel.shape, (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    )
    return lax.conv_general_dilated(
        input,
        kernel,
        window_strides=window_strides,
        padding=pads,
        lhs_dilation=lhs_dilation,
        rhs_dilation=dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=groups,
        **product_options(input.dtype),
    )


def _groupwise(input, kernel, window_strides, pads, dilation, groups):
    """The plain grouped convolution (no input dilation)."""
    no_lhs_dilation = (1,) * len(window_strides)
    return _lax_convolution(input, kernel, window_strides, pads, no_lhs_dilation, dilation, groups)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _grouped_convolution(input, kernel, window_strides, pads, dilation, groups):
    """A plain convolution with groups > 1 whose kernel gradient is formed tap by tap (module
    docstring)."""
    return _groupwise(input, kernel, window_strides, pads, dilation, groups)


def _grouped_forward(input, kernel, window_strides, pads, dilation, groups):
    out = _groupwise(input, kernel, window_strides, pads, dilation, groups)
    return out, (input, kernel)


def _grouped_backward(window_strides, pads, dilation, groups, residuals, grad_output):
    input, kernel = residuals
    _, input_pullback = jax.vjp(
        lambda x: _groupwise(x, kernel, window_strides, pads, dilation, groups), input
    )
    (grad_input,) = input_pullback(grad_output)
    # Products and sums in fp32 at least (torch's accumulation for bf16/fp16; float64 stays
    # float64), one reduction over batch and space per kernel tap.
    accumulation = jnp.promote_types(input.dtype, jnp.float32)
    padded = _padded(input, pads).astype(accumulation)
    gradient = grad_output.astype(accumulation)
    n, c_in, *_ = input.shape
    c_out, c_per_group, *kernel_size = kernel.shape
    out_size = grad_output.shape[2:]
    views = _offset_views(padded, kernel_size, out_size, window_strides, dilation)
    if c_per_group == 1:
        # Depthwise: output channel o reads input channel o // m. An elementwise product and a
        # sum, which XLA:CPU runs faster than a product with a 1-wide contraction.
        summed_axes = (0, *range(2, input.ndim))
        repeats = c_out // c_in
        taps = [jnp.sum(jnp.repeat(v, repeats, axis=1) * gradient, summed_axes) for v in views]
    else:
        gradient = gradient.reshape(n, groups, c_out // groups, -1)
        taps = [
            jnp.einsum(
                "ngis,ngos->goi",
                view.reshape(n, groups, c_per_group, -1),
                gradient,
                precision=lax.Precision.HIGHEST,
            ).reshape(c_out, c_per_group)
            for view in views
        ]
    grad_kernel = jnp.stack(taps, axis=-1).reshape(kernel.shape).astype(kernel.dtype)
    return grad_input, grad_kernel


_grouped_convolution.defvjp(_grouped_forward, _grouped_backward)


def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution on JAX arrays; input may be unbatched (C, *spatial)."""
    num_spatial = weight.ndim - 2
    unbatched = input.ndim == num_spatial + 1
    if unbatched:
        input = input[None]
    stride = _per_dim(stride, num_spatial)
    padding = _per_dim(padding, num_spatial)
    dilation = _per_dim(dilation, num_spatial)
    dtype = result_type(input, weight)
    input, weight = input.astype(dtype), weight.astype(dtype)
    kernel_size = weight.shape[2:]
    if transposed:
        output_padding = _per_dim(output_padding, num_spatial)
        kernel = _transposed_kernel(weight, groups)
        pads = [
            (d * (k - 1) - p, d * (k - 1) - p + extra)
            for k, p, d, extra in zip(kernel_size, padding, dilation, output_padding, strict=True)
        ]
        window_strides, lhs_dilation = (1,) * num_spatial, stride
    else:
        kernel = weight
        pads = [(p, p) for p in padding]
        window_strides, lhs_dilation = stride, (1,) * num_spatial
    if not transposed and _window_exceeds_input_or_output(
        input.shape[2:], pads, kernel_size, window_strides, dilation
    ):
        out = _patch_convolution(input, kernel, window_strides, tuple(pads), dilation, groups)
    elif not transposed and groups > 1 and jax.default_backend() == "cpu":
        out = _grouped_convolution(input, kernel, window_strides, tuple(pads), dilation, groups)
    else:
        out = _lax_convolution(input, kernel, window_strides, pads, lhs_dilation, dilation, groups)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((-1,) + (1,) * num_spatial)
    return out[0] if unbatched else out


def _split_over_batch(ctx, input, weight, bias, *conv_args):
    """`convolution(input, weight, bias, *conv_args)`, per batch shard when its groups have
    more than one input channel each (module docstring); depthwise and ungrouped convolutions
    XLA partitions over the batch itself."""
    groups = conv_args[-1]
    batched = input.ndim == weight.ndim
    if not batched or not 1 < groups < input.shape[1]:
        return convolution(input, weight, bias, *conv_args)
    return on_batch_shards(
        ctx,
        lambda input, weight, bias: convolution(input, weight, bias, *conv_args),
        (input, weight, bias),
        (True, False, False),
    )


@lowering(aten.convolution.default)
def lower_convolution_default(
    ctx, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
):
    """input (N, C_in, *s), weight (C_out, C_in/g, *k), or (C_in, C_out/g, *k) if transposed."""
    return _split_over_batch(
        ctx, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    )


@lowering(aten._convolution.default)
def lower__convolution_default(
    ctx,
    input,
    weight,
    bias,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    benchmark,
    deterministic,
    cudnn_enabled,
    allow_tf32,
):
    """aten.convolution plus backend hints (benchmark, cudnn, tf32) that mean nothing here."""
    return _split_over_batch(
        ctx, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    )


@lowering(aten.convolution_backward.default)
def lower_convolution_backward_default(
    ctx,
    grad_output,
    input,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
):
    """(grad_input, grad_weight, grad_bias), each None where output_mask is False."""

    def forward(x, w):
        return _split_over_batch(
            ctx, x, w, None, stride, padding, dilation, transposed, output_padding, groups
        )

    out, pullback = jax.vjp(forward, input, weight)
    grad_input, grad_weight = pullback(grad_output.astype(out.dtype))
    grad_bias = None
    if output_mask[2]:
        # Sum a bf16/fp16 gradient in fp32, as torch does, so many small terms are not lost.
        dtype = jnp.promote_types(grad_output.dtype, jnp.float32)
        spatial_axes = tuple(range(2, grad_output.ndim))
        grad_bias = jnp.sum(grad_output, axis=(0, *spatial_axes), dtype=dtype)
    return (
        grad_input if output_mask[0] else None,
        grad_weight if output_mask[1] else None,
        grad_bias,
    )
