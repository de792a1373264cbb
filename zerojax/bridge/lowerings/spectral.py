"""Lowerings: the FFT primitives every torch.fft function decomposes into.

ATen's `normalization` code is fft_norm_mode (aten/src/ATen/native/SpectralOpsUtils.h):
0 = no scaling, 1 = 1/sqrt(n), 2 = 1/n, applied in whichever direction the op computes. numpy's
`norm` names the *forward* transform's scaling instead, so the mapping differs by direction.
Complex results are complex64 (complex128 without jax_enable_x64 narrows to it).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from zerojax.bridge.registry import lowering

aten = torch.ops.aten

_FORWARD_NORM = {0: "backward", 1: "ortho", 2: "forward"}
_INVERSE_NORM = {0: "forward", 1: "ortho", 2: "backward"}


def _axes(x, dim) -> list[int]:
    return [d % x.ndim for d in dim]


def _complex(x):
    return x.astype(jnp.promote_types(x.dtype, jnp.complex64))


@lowering(aten._fft_r2c.default)
def lower__fft_r2c_default(ctx, self, dim, normalization, onesided):
    """Real -> complex FFT over `dim`; onesided keeps the last dim's n//2 + 1 bins."""
    axes = _axes(self, dim)
    x = self.astype(jnp.promote_types(self.dtype, jnp.float32))
    norm = _FORWARD_NORM[normalization]
    if onesided:
        return jnp.fft.rfftn(x, axes=axes, norm=norm)
    return jnp.fft.fftn(_complex(x), axes=axes, norm=norm)


@lowering(aten._fft_c2r.default)
def lower__fft_c2r_default(ctx, self, dim, normalization, last_dim_size):
    """Inverse of a onesided r2c: complex (last dim n//2 + 1 bins) -> real, last dim
    last_dim_size."""
    axes = _axes(self, dim)
    sizes = [self.shape[a] for a in axes[:-1]] + [int(last_dim_size)]
    return jnp.fft.irfftn(_complex(self), s=sizes, axes=axes, norm=_INVERSE_NORM[normalization])


@lowering(aten._fft_c2c.default)
def lower__fft_c2c_default(ctx, self, dim, normalization, forward):
    """Complex -> complex FFT over `dim`, forward (e^-i) or inverse (e^+i)."""
    axes = _axes(self, dim)
    if not axes:
        return self
    if forward:
        return jnp.fft.fftn(_complex(self), axes=axes, norm=_FORWARD_NORM[normalization])
    return jnp.fft.ifftn(_complex(self), axes=axes, norm=_INVERSE_NORM[normalization])
