"""Lowerings: matrix products (mm, bmm and the fused add-and-multiply family).

Low-precision floats (bf16/fp16) multiply with fp32 accumulation (`preferred_element_type`), as
torch's CPU and CUDA kernels do; the interpreter then rounds the result to torch's dtype once.
fp32 products ask for `Precision.HIGHEST` because torch's default (`allow_tf32=False`) is a true
fp32 matmul, while XLA on GPU would otherwise use TF32 or bf16 passes.
Integer products stay integer, as torch's CPU kernels compute them (wrapping on overflow).
"""

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from zerojax.bridge.dtypes import is_floating, result_type
from zerojax.bridge.registry import lowering

aten = torch.ops.aten

_LOW_PRECISION = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def product_options(dtype) -> dict:
    """Keyword arguments for jnp.matmul/einsum/lax.conv that reproduce torch's accumulation."""
    dtype = np.dtype(dtype)
    if dtype in _LOW_PRECISION:
        return {"preferred_element_type": jnp.float32}
    if is_floating(dtype):
        return {"precision": lax.Precision.HIGHEST}
    return {}


def matmul_einsum(spec: str, a, b):
    """`spec` contraction of a and b in their common torch dtype, accumulated like torch."""
    dtype = result_type(a, b)
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), **product_options(dtype))


def _add_scaled(self, product, beta, alpha):
    """beta * self + alpha * product; beta == 0 ignores self (its NaN/inf too), as torch does."""
    if not is_floating(product.dtype):
        # torch casts the scalars to the integer dtype first: 0.6 -> 0.
        beta, alpha = int(beta), int(alpha)
    out = product if alpha == 1 else product * alpha
    if beta == 0:
        return out
    # Add in the accumulation dtype so a bf16 result is rounded once, like torch's fused kernel.
    return out + (self.astype(out.dtype) if beta == 1 else self.astype(out.dtype) * beta)


@lowering(aten.mm.default)
def lower_mm_default(ctx, self, mat2):
    return matmul_einsum("ij,jk->ik", self, mat2)


@lowering(aten.bmm.default)
def lower_bmm_default(ctx, self, mat2):
    return matmul_einsum("bij,bjk->bik", self, mat2)


@lowering(aten.addmm.default)
def lower_addmm_default(ctx, self, mat1, mat2, *, beta=1, alpha=1):
    """beta * self + alpha * (mat1 @ mat2); self broadcasts to the (n, p) result."""
    return _add_scaled(self, matmul_einsum("ij,jk->ik", mat1, mat2), beta, alpha)


@lowering(aten.addbmm.default)
def lower_addbmm_default(ctx, self, batch1, batch2, *, beta=1, alpha=1):
    """beta * self + alpha * sum_b(batch1[b] @ batch2[b])."""
    return _add_scaled(self, matmul_einsum("bij,bjk->ik", batch1, batch2), beta, alpha)


@lowering(aten.addmv.default)
def lower_addmv_default(ctx, self, mat, vec, *, beta=1, alpha=1):
    """beta * self + alpha * (mat @ vec)."""
    return _add_scaled(self, matmul_einsum("ij,j->i", mat, vec), beta, alpha)


@lowering(aten._trilinear.default)
def lower__trilinear_default(ctx, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over sumdim of i1 * i2 * i3, each first unsqueezed at its expand dims (bilinear)."""
    ndim = i1.ndim + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:ndim]
    specs = [
        "".join(c for d, c in enumerate(letters) if d not in e) for e in (expand1, expand2, expand3)
    ]
    present = set("".join(specs))
    # A dim expanded in all three inputs has size 1: einsum cannot name it, the reshape adds it.
    out = "".join(c for d, c in enumerate(letters) if d not in sumdim and c in present)
    dtype = result_type(i1, i2, i3)
    operands = [t.astype(dtype) for t in (i1, i2, i3)]
    result = jnp.einsum(
        f"{specs[0]},{specs[1]},{specs[2]}->{out}", *operands, **product_options(dtype)
    )
    return result.reshape(ctx.out_shape)
