"""Lowerings: layer, group and batch normalization (the ops torch keeps whole in core ATen).

Statistics are computed in fp32 for bf16/fp16 inputs, as torch's kernels do, with the two-pass
variance mean((x - mean)^2), which is as accurate as torch's Welford sums. rms_norm,
instance_norm and the *_backward ops of these norms decompose before they reach zerojax.

BatchNorm in train mode exports as `_native_batch_norm_legit_functional`, whose new running
statistics become the module's updated buffers: running_var moves towards the *unbiased* batch
variance, new = (1 - momentum) * old + momentum * batch, exactly as torch updates them in place.

Gradients are JAX's autodiff of these decompositions, not torch's closed-form backward:
judged against float64 at each run's own ReLU branches (tests/train/test_cnn_gradients.py),
autodiff is as accurate as torch fp32 on centred inputs (Conv-BN-ReLU: 3e-7 vs 2e-7;
ResNet-18: 6e-6 vs 4.4e-6, the same with either backward) and 2-4x more accurate where the
normalized input has a large mean (conv output of mean ~17, spread ~0.6: conv weight gradient
8e-6 vs torch's 2-3e-5), where torch's formula written in JAX erred 3-8e-5.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zerojax.bridge.dtypes import is_floating
from zerojax.bridge.kernel_sharding import per_batch_shard
from zerojax.bridge.registry import lowering

aten = torch.ops.aten


def _compute_dtype(x):
    """fp32 for bf16/fp16 (torch's accumulation type), else x's own float dtype."""
    dtype = np.dtype(x.dtype)
    if not is_floating(dtype) or dtype.itemsize < 4:
        return np.dtype(jnp.float32)
    return dtype


def _moments(x, axes):
    """(mean, biased variance, x - mean) over `axes`, keeping dims."""
    mean = jnp.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    return mean, jnp.mean(jnp.square(centered), axis=axes, keepdims=True), centered


def _affine(out, weight, bias, shape):
    """out * weight + bias with the per-channel parameters reshaped to broadcast as `shape`."""
    if weight is not None:
        out = out * weight.astype(out.dtype).reshape(shape)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape(shape)
    return out


@lowering(aten.native_layer_norm.default)
def lower_native_layer_norm_default(ctx, input, normalized_shape, weight, bias, eps):
    """(out, mean, rstd) over the trailing len(normalized_shape) dims; stats keep those dims.

    Over the last dim, `out` comes from the layer-norm kernel (config `kernels.norm`); mean and
    rstd are recomputed here and vanish from the program when nothing reads them.
    """
    x = input.astype(_compute_dtype(input))
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    mean, var, centered = _moments(x, axes)
    rstd = lax.rsqrt(var + eps)
    choice = ctx.kernel("norm")
    if choice is not None and len(normalized_shape) == 1:
        from zerojax.pallas_kernels.layer_norm import layer_norm

        implementation, interpret = choice
        out = per_batch_shard(
            ctx,
            lambda x, w, b, axis_index: layer_norm(
                x, w, b, eps=eps, implementation=implementation, interpret=interpret
            ),
            (input, weight, bias),
            (True, False, False),
            family="norm",
        )
    else:
        out = _affine(centered * rstd, weight, bias, tuple(normalized_shape))
    return out, mean, rstd


@lowering(aten.native_group_norm.default)
def lower_native_group_norm_default(ctx, input, weight, bias, N, C, HxW, group, eps):
    """(out, mean (N, group), rstd (N, group)); input is (N, C, *spatial) with HxW = prod(spatial)."""
    x = input.astype(_compute_dtype(input)).reshape(N, group, -1)
    mean, var, centered = _moments(x, (2,))
    rstd = lax.rsqrt(var + eps)
    out = (centered * rstd).reshape(input.shape)
    out = _affine(out, weight, bias, (C,) + (1,) * (input.ndim - 2))
    return out, mean.reshape(N, group), rstd.reshape(N, group)


def _channel_shape(input) -> tuple[int, ...]:
    """Shape that broadcasts a (C,) vector over input (N, C, *spatial)."""
    return (input.shape[1],) + (1,) * (input.ndim - 2)


@functools.partial(
    jax.checkpoint,
    static_argnums=(3,),
    policy=jax.checkpoint_policies.save_only_these_names("batch_norm_statistics"),
)
def _batch_norm_train(input, weight, bias, eps):
    """Normalize with batch statistics: (out, mean, invstd, unbiased var), stats of shape (C,).

    Rematerialized but for the per-channel statistics: the backward pass keeps the input (as
    torch's does) and forms `x - mean` again, where autodiff would keep that difference too, a
    second input-sized array per batch norm. The gradients are the same arithmetic
    (bench/gradient_accuracy.py prints the same errors). torchvision's ResNet-50, batch 8 of
    224x224 (`memory_analysis()`): the general path's forward outputs 1,105 -> 749 MB with the
    backward's temporaries unchanged (439 MB); the fused program's temporaries 1,072 -> 723
    MB. The recomputation is kept from XLA's common-subexpression elimination (jax.checkpoint's
    default): with `prevent_cse=False` the fused program keeps the forward's differences after
    all (1,072 MB) and the general path's backward holds its recomputed ones at once (439 -> 667
    MB). Time: ResNet-18's fused program +4.6% (38.3 -> 39.9 ms), its general-path step -2.6%
    (bench/cnn_step.py's net)."""
    x = input.astype(_compute_dtype(input))
    axes = (0, *range(2, input.ndim))
    mean, var, _ = _moments(x, axes)
    invstd = lax.rsqrt(var + eps)
    # Kept: recomputing them would be two more reductions over the input.
    mean, var, invstd = (checkpoint_name(s, "batch_norm_statistics") for s in (mean, var, invstd))
    # torch's CPU kernel form (batch_norm_cpu_transform_input): one per-channel scale and shift,
    # so the output is one multiply-add per element and so is its autodiff backward; the
    # `centered * invstd * weight + bias` form cost ResNet-18's forward+backward 82 -> 71 ms
    # (bench/cnn_step.py) at the same gradient error against float64 (bench/gradient_accuracy.py).
    shape = _channel_shape(input)
    alpha = invstd if weight is None else invstd * weight.astype(x.dtype).reshape(shape)
    beta = -mean * alpha if bias is None else bias.astype(x.dtype).reshape(shape) - mean * alpha
    out = x * alpha + beta
    count = x.size // x.shape[1]
    # n / (n - 1) as a traced division: a single value per channel gives inf/nan like torch.
    unbiased = var * (count / jnp.asarray(count - 1, var.dtype))
    return out, mean.reshape(-1), invstd.reshape(-1), unbiased.reshape(-1)


def _batch_norm_eval(input, weight, bias, running_mean, running_var, eps):
    """Normalize with running statistics; torch returns empty (0,) save_mean/save_invstd."""
    dtype = _compute_dtype(input)
    shape = _channel_shape(input)
    mean = running_mean.astype(dtype).reshape(shape)
    invstd = lax.rsqrt(running_var.astype(dtype).reshape(shape) + eps)
    out = _affine((input.astype(dtype) - mean) * invstd, weight, bias, shape)
    empty = jnp.zeros((0,), dtype)
    return out, empty, empty


@lowering(aten._native_batch_norm_legit_functional.default)
def lower__native_batch_norm_legit_functional_default(
    ctx, input, weight, bias, running_mean, running_var, training, momentum, eps
):
    """(out, save_mean, save_invstd, new_running_mean, new_running_var); stats untouched in eval."""
    if not training:
        out, save_mean, save_invstd = _batch_norm_eval(
            input, weight, bias, running_mean, running_var, eps
        )
        return out, save_mean, save_invstd, running_mean, running_var
    out, mean, invstd, unbiased_var = _batch_norm_train(input, weight, bias, eps)
    new_mean = (1 - momentum) * running_mean.astype(mean.dtype) + momentum * mean
    new_var = (1 - momentum) * running_var.astype(mean.dtype) + momentum * unbiased_var
    return out, mean, invstd, new_mean, new_var


@lowering(aten._native_batch_norm_legit_no_training.default)
def lower__native_batch_norm_legit_no_training_default(
    ctx, input, weight, bias, running_mean, running_var, momentum, eps
):
    """Eval-mode batch norm with running statistics: (out, empty, empty)."""
    return _batch_norm_eval(input, weight, bias, running_mean, running_var, eps)


@lowering(aten._native_batch_norm_legit.no_stats)
def lower__native_batch_norm_legit_no_stats(ctx, input, weight, bias, training, momentum, eps):
    """Batch norm without running statistics (track_running_stats=False, instance norm).

    Batch statistics are used whatever `training` says: there are no others.
    """
    out, mean, invstd, _ = _batch_norm_train(input, weight, bias, eps)
    return out, mean, invstd


def _normalized_input_grad(g, x_hat, rstd, axes):
    """d(loss)/dx of x_hat = (x - mean) * rstd over `axes`, given g = d(loss)/dx_hat."""
    mean_g = jnp.mean(g, axis=axes, keepdims=True)
    mean_gx = jnp.mean(g * x_hat, axis=axes, keepdims=True)
    return rstd * (g - mean_g - x_hat * mean_gx)


@lowering(aten.native_layer_norm_backward.default)
def lower_native_layer_norm_backward_default(
    ctx, grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
):
    """(grad_input, grad_weight, grad_bias) from the saved mean/rstd; None where masked off."""
    dtype = _compute_dtype(input)
    x, dy = input.astype(dtype), grad_out.astype(dtype)
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    leading = tuple(range(input.ndim - len(normalized_shape)))
    x_hat = (x - mean.astype(dtype)) * rstd.astype(dtype)
    g = dy * weight.astype(dtype) if weight is not None else dy
    grad_input = _normalized_input_grad(g, x_hat, rstd.astype(dtype), axes)
    grad_weight = jnp.sum(dy * x_hat, axis=leading) if weight is not None else None
    grad_bias = jnp.sum(dy, axis=leading) if bias is not None else None
    return tuple(
        value if wanted else None
        for value, wanted in zip((grad_input, grad_weight, grad_bias), output_mask, strict=True)
    )


@lowering(aten.native_group_norm_backward.default)
def lower_native_group_norm_backward_default(
    ctx, grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask
):
    """(grad_input, grad_weight, grad_bias) of group norm from the saved (N, group) stats."""
    dtype = _compute_dtype(input)
    channel = (C,) + (1,) * (input.ndim - 2)
    dy = grad_out.astype(dtype)
    x = input.astype(dtype).reshape(N, group, -1)
    x_hat = (x - mean.astype(dtype)[..., None]) * rstd.astype(dtype)[..., None]
    g = dy * weight.astype(dtype).reshape(channel) if weight is not None else dy
    grad_input = _normalized_input_grad(
        g.reshape(N, group, -1), x_hat, rstd.astype(dtype)[..., None], (2,)
    ).reshape(input.shape)
    spatial = tuple(range(2, input.ndim))
    x_hat = x_hat.reshape(input.shape)
    grad_weight = jnp.sum(dy * x_hat, axis=(0, *spatial))
    grad_bias = jnp.sum(dy, axis=(0, *spatial))
    return tuple(
        value if wanted else None
        for value, wanted in zip((grad_input, grad_weight, grad_bias), output_mask, strict=True)
    )
