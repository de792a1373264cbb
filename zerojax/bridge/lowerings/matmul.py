"""Lowerings: matrix products (mm, bmm and the fused add-and-multiply family).

Low-precision floats (bf16/fp16) multiply with fp32 accumulation (`preferred_element_type`), as
torch's CPU and CUDA kernels do; the interpreter then rounds the result to torch's dtype once.
fp32 products ask for `Precision.HIGHEST` because torch's default (`allow_tf32=False`) is a true
fp32 matmul, while XLA on GPU would otherwise use TF32 or bf16 passes.
Integer products stay integer, as torch's CPU kernels compute them (wrapping on overflow).
"""

import functools

import jax
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
    a, b = a.astype(dtype), b.astype(dtype)
    if np.dtype(dtype) in _LOW_PRECISION:
        return _low_precision_einsum(spec, a, b)
    return jnp.einsum(spec, a, b, **product_options(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _low_precision_einsum(spec: str, a, b):
    """bf16/fp16 operands, fp32 result; its backward multiplies in the operands' dtype too.

    Autodiff's own transpose would multiply the fp32 cotangent with the bf16 operand: a mixed
    product that XLA:CPU computes by converting both to fp32 (~280 GFLOP/s on the bench CPU),
    where bf16 x bf16 -> fp32 runs on its bf16 kernels (~1,100-1,500 GFLOP/s). Rounding the
    cotangent to the operand dtype first changes nothing: the interpreter rounds this product to
    torch's dtype, so the cotangent arriving here is that rounding's (bf16-valued), and torch
    holds the gradient of a bf16 tensor in bf16 as well. Products of two bf16 values are exact in
    fp32, so only the order of the fp32 sums differs from autodiff's.
    """
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _low_precision_einsum_forward(spec, a, b):
    return _low_precision_einsum(spec, a, b), (a, b)


def _low_precision_einsum_backward(spec, operands, cotangent):
    a, b = operands
    inputs, out = spec.split("->")
    a_spec, b_spec = inputs.split(",")
    cotangent = cotangent.astype(a.dtype)
    d_a = jnp.einsum(f"{out},{b_spec}->{a_spec}", cotangent, b, preferred_element_type=jnp.float32)
    d_b = jnp.einsum(f"{a_spec},{out}->{b_spec}", a, cotangent, preferred_element_type=jnp.float32)
    return d_a.astype(a.dtype), d_b.astype(b.dtype)


_low_precision_einsum.defvjp(_low_precision_einsum_forward, _low_precision_einsum_backward)


def add_scaled(self, product, beta, alpha):
    """beta * self + alpha * product; beta == 0 ignores self (its NaN/inf too), as torch does."""
    if not is_floating(product.dtype):
        # torch casts the scalars to the integer dtype first: 0.6 -> 0.
        beta, alpha = int(beta), int(alpha)
    out = product if alpha == 1 else product * alpha
    if beta == 0:
        return out
    # Add in the accumulation dtype so a bf16 result is rounded once, like torch's fused kernel.
    return out + (self.astype(out.dtype) if beta == 1 else self.astype(out.dtype) * beta)


def is_matrix_transpose(node) -> bool:
    """Whether an FX argument is `t(x)` or `permute(x, [1, 0])`: how nn.Linear's weight reaches
    mm/addmm after decomposition (also what the loss fusion looks for, bridge/fusion.py)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    return node.target is aten.t.default


def _matrix_product(a, b, b_node):
    """a @ b. When b is the transpose of a weight (nn.Linear's `t(W)`), multiply by the weight
    itself: XLA:CPU folds the double transpose, and a bf16 product whose operand is a transpose
    op is computed in fp32 (converted first), while one on the weight runs its bf16 kernels."""
    if is_matrix_transpose(b_node):
        return matmul_einsum("ij,kj->ik", a, b.T)
    return matmul_einsum("ij,jk->ik", a, b)


@lowering(aten.mm.default)
def lower_mm_default(ctx, self, mat2):
    return _matrix_product(self, mat2, ctx.node.args[1])


@lowering(aten.bmm.default)
def lower_bmm_default(ctx, self, mat2):
    return matmul_einsum("bij,bjk->bik", self, mat2)


@lowering(aten.addmm.default)
def lower_addmm_default(ctx, self, mat1, mat2, *, beta=1, alpha=1):
    """beta * self + alpha * (mat1 @ mat2); self broadcasts to the (n, p) result."""
    return add_scaled(self, _matrix_product(mat1, mat2, ctx.node.args[2]), beta, alpha)


@lowering(aten.addbmm.default)
def lower_addbmm_default(ctx, self, batch1, batch2, *, beta=1, alpha=1):
    """beta * self + alpha * sum_b(batch1[b] @ batch2[b])."""
    return add_scaled(self, matmul_einsum("bij,bjk->ik", batch1, batch2), beta, alpha)


@lowering(aten.addmv.default)
def lower_addmv_default(ctx, self, mat, vec, *, beta=1, alpha=1):
    """beta * self + alpha * (mat @ vec)."""
    return add_scaled(self, matmul_einsum("ij,j->i", mat, vec), beta, alpha)


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
