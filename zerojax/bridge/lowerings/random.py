"""Lowerings: random ops, all drawn from the explicit `rng` key passed to apply().

Each graph node gets its own key, `fold_in(rng, site index)`, so two dropout layers never share a
mask, the same key reproduces the same masks, and a new key per step gives new masks — unlike a
mask frozen into the program at trace time.
"""

import jax
import jax.numpy as jnp
import torch

from zerojax.bridge.registry import lowering

aten = torch.ops.aten


def _keep_mask(ctx, p: float, shape) -> jax.Array:
    return jax.random.bernoulli(ctx.rng_key(), 1.0 - p, shape)


@lowering(aten.native_dropout.default)
def lower_native_dropout(ctx, input, p, train):
    """(input * mask / (1 - p), mask); identity with an all-true mask when not training."""
    if train is False or p == 0.0:
        return input, jnp.ones(input.shape, dtype=bool)
    if p >= 1.0:
        return jnp.zeros_like(input), jnp.zeros(input.shape, dtype=bool)
    mask = _keep_mask(ctx, p, input.shape)
    scale = jnp.asarray(1.0 / (1.0 - p), dtype=input.dtype)
    return jnp.where(mask, input * scale, jnp.zeros_like(input)), mask


@lowering(aten.bernoulli.default)
def lower_bernoulli(ctx, self, *, generator=None):
    """Each element 1 with probability `self[i]`, in self's dtype."""
    draws = jax.random.uniform(ctx.rng_key(), self.shape, dtype=jnp.float32)
    return (draws < self.astype(jnp.float32)).astype(ctx.out_dtype)


@lowering(aten.bernoulli.p)
def lower_bernoulli_p(ctx, self, p=0.5, *, generator=None):
    return jax.random.bernoulli(ctx.rng_key(), p, self.shape).astype(ctx.out_dtype)


def _uniform(ctx, shape, low=0.0, high=1.0):
    dtype = ctx.out_dtype
    draw_dtype = dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    return jax.random.uniform(ctx.rng_key(), tuple(shape), draw_dtype, low, high).astype(dtype)


def _normal(ctx, shape):
    dtype = ctx.out_dtype
    draw_dtype = dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    return jax.random.normal(ctx.rng_key(), tuple(shape), draw_dtype).astype(dtype)


@lowering(aten.rand.default)
def lower_rand(ctx, size, *, dtype=None, generator=None):
    return _uniform(ctx, size)


@lowering(aten.randn.default)
def lower_randn(ctx, size, *, dtype=None, generator=None):
    return _normal(ctx, size)


@lowering(aten.rand_like.default)
def lower_rand_like(ctx, self, *, dtype=None):
    return _uniform(ctx, self.shape)


@lowering(aten.randn_like.default)
def lower_randn_like(ctx, self, *, dtype=None):
    return _normal(ctx, self.shape)


@lowering(aten.uniform.default)
def lower_uniform(ctx, self, low=0.0, high=1.0, *, generator=None):
    """Functional form of `tensor.uniform_(low, high)`: a fresh tensor of self's shape."""
    return _uniform(ctx, self.shape, low, high)


@lowering(aten.normal.Tensor_Tensor)
def lower_normal_tensor_tensor(ctx, mean, std, *, generator=None):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return mean + std * _normal(ctx, shape)


@lowering(aten.normal.Tensor_float)
def lower_normal_tensor_float(ctx, mean, std=1.0, *, generator=None):
    return mean + std * _normal(ctx, mean.shape)


@lowering(aten.normal.float_Tensor)
def lower_normal_float_tensor(ctx, mean, std, *, generator=None):
    return mean + std * _normal(ctx, std.shape)


@lowering(aten.normal_functional.default)
def lower_normal_functional(ctx, self, mean=0.0, std=1.0, *, generator=None):
    """Functional form of `tensor.normal_(mean, std)` (what export emits for init code)."""
    return mean + std * _normal(ctx, self.shape)


@lowering(aten.randint.default)
def lower_randint(ctx, high, size, *, dtype=None, generator=None):
    return jax.random.randint(ctx.rng_key(), tuple(size), 0, high, jnp.int32)


@lowering(aten.randint.low)
def lower_randint_low(ctx, low, high, size, *, dtype=None, generator=None):
    return jax.random.randint(ctx.rng_key(), tuple(size), low, high, jnp.int32)


@lowering(aten.randperm.default)
def lower_randperm(ctx, n, *, dtype=None, generator=None):
    return jax.random.permutation(ctx.rng_key(), n)
