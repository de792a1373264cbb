"""Lowerings: mixture-of-experts routing — grouped GEMM and token counting.

Every modern MoE in transformers (Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE, GPT-OSS) runs its
experts as: sort the (token, expert) pairs by expert, count tokens per expert (`histc`), take a
running sum (`cumsum`) as group offsets, and multiply each group of rows by its expert's weight
(a grouped GEMM: `aten._grouped_mm`, or `transformers::grouped_mm_fallback`, the custom op
transformers uses when torch's kernel is unavailable, e.g. fp32 under export). The grouped GEMM
lowers to `jax.lax.ragged_dot`, JAX's native grouped matmul, which is also the form expert
parallelism shards (on a mesh with an `expert` axis, `zerojax.parallel.expert_parallel`). All shapes stay
static: groups have data-dependent *sizes*, not shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from zerojax.bridge.dtypes import is_floating, result_type
from zerojax.bridge.errors import DataDependentShapeError, node_location
from zerojax.bridge.lowerings.matmul import product_options
from zerojax.bridge.registry import lowering, register_lowering
from zerojax.parallel.expert_parallel import expert_parallel_ragged_dot

aten = torch.ops.aten


def _group_sizes(offs):
    """Cumulative group ends (torch's `offs`) -> group sizes, as ragged_dot wants them."""
    offs = offs.astype(jnp.int32)
    return jnp.diff(offs, prepend=jnp.zeros((1,), jnp.int32))


def _operands(lhs, rhs):
    """(lhs, rhs, options) in the dtype to multiply in, accumulated like torch.

    XLA:CPU has no bf16 x bf16 -> f32 kernel for every ragged_dot form (the transposes autodiff
    builds fail with "Unsupported element type for DotThunk"), so on CPU low-precision operands
    are widened to fp32 first: the same fp32 accumulation, the result rounded once as torch's.
    GPUs keep bf16 operands with fp32 accumulation.
    """
    dtype = result_type(lhs, rhs)
    options = product_options(dtype)
    if "preferred_element_type" in options and jax.default_backend() == "cpu":
        dtype, options = np.dtype(np.float32), product_options(np.float32)
    return lhs.astype(dtype), rhs.astype(dtype), options


def _ragged_rows(lhs, rhs, offs, ctx=None):
    """out[r] = lhs[r] @ rhs[g] for the rows r of group g; rows past offs[-1] are zero.

    lhs (M, K), rhs (G, K, N), offs (G,) cumulative row ends -> (M, N). Expert-parallel
    (zerojax/parallel/expert_parallel.py) when the run's parallel plan says so (`experts`).
    """
    lhs, rhs, options = _operands(lhs, rhs)
    parallel = None if ctx is None else ctx.parallel
    placement = None if parallel is None else parallel.experts
    if placement is not None:
        where = f"{ctx.node.target} in {node_location(ctx.node)}"
        stack = list((ctx.node.meta.get("nn_module_stack") or {}).values())
        site = f"{stack[-1][0]}:{ctx.node.name}" if stack else ctx.node.name
        return expert_parallel_ragged_dot(
            placement, lhs, rhs, offs, where=where, site=site, **options
        )
    return lax.ragged_dot(lhs, rhs, _group_sizes(offs), **options)


def _ragged_contraction(lhs, rhs, offs):
    """out[g] = lhs[:, k_g] @ rhs[k_g, :] over the K range k_g of group g (a weight gradient).

    lhs (M, K), rhs (K, N), offs (G,) cumulative K ends -> (G, M, N).
    """
    lhs, rhs, options = _operands(lhs, rhs)
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (0,)), ((), ())),
        lhs_ragged_dimensions=(1,),
        rhs_group_dimensions=(),
    )
    return lax.ragged_dot_general(lhs, rhs, _group_sizes(offs), numbers, **options)


@lowering(aten._grouped_mm.default)
def lower__grouped_mm_default(ctx, self, mat2, offs=None, bias=None, out_dtype=None):
    """torch's grouped GEMM; which dim `offs` splits follows from the operands' ranks.

    2D x 3D: rows of `self` grouped by expert (the MoE forward). 3D x 2D: columns of `mat2`.
    2D x 2D: the contracted dim (out[g] = self[:, k_g] @ mat2[k_g]). 3D x 3D: a batched matmul.
    Rows (columns) past offs[-1] come out zero; torch leaves them uninitialised.
    """
    if bias is not None:
        raise NotImplementedError(
            f"aten._grouped_mm with a bias is not lowered (torch's own kernels reject it too); "
            f"add the bias after the grouped matmul ({ctx.node.name})"
        )
    ranks = (self.ndim, mat2.ndim)
    if ranks == (3, 3):
        if offs is not None:
            raise ValueError(f"aten._grouped_mm: 3D x 3D takes no offs ({ctx.node.name})")
        dtype = result_type(self, mat2)
        return jnp.einsum(
            "gmk,gkn->gmn", self.astype(dtype), mat2.astype(dtype), **product_options(dtype)
        )
    if offs is None:
        raise ValueError(f"aten._grouped_mm: {ranks[0]}D x {ranks[1]}D needs offs")
    if ranks == (2, 3):
        return _ragged_rows(self, mat2, offs, ctx)
    if ranks == (3, 2):
        # Column groups: out.T[n] = mat2.T[n] @ self[g].T for the columns n of group g.
        return _ragged_rows(mat2.T, jnp.swapaxes(self, 1, 2), offs).T
    if ranks == (2, 2):
        return _ragged_contraction(self, mat2, offs)
    raise ValueError(f"aten._grouped_mm takes 2D or 3D operands, got {ranks[0]}D x {ranks[1]}D")


# transformers defines these ops only once its MoE integration is imported: registered by name.
@register_lowering("transformers::grouped_mm_fallback")
def lower_transformers_grouped_mm_fallback(ctx, input, weight, offs):
    """transformers' loop-over-experts grouped GEMM: input (S, K) sorted by expert, weight
    (E, K, N), offs (E,) cumulative token counts -> (S, N); rows past offs[-1] are zero, as
    transformers' own implementation leaves them."""
    return _ragged_rows(input, weight, offs, ctx)


@register_lowering("transformers::grouped_mm_fallback_backward")
def lower_transformers_grouped_mm_fallback_backward(ctx, input, weight, offs, grad_output):
    """(grad_input, grad_weight) of grouped_mm_fallback (appears in joint / backward graphs)."""
    grad_input = _ragged_rows(grad_output, jnp.swapaxes(weight, 1, 2), offs)
    grad_weight = _ragged_contraction(input.T, grad_output, offs)
    return grad_input, grad_weight


@lowering(aten.histc.default)
def lower_histc_default(ctx, self, bins=100, min=0, max=0):
    """Counts of `self` in `bins` equal-width bins over [min, max] (the data's own range when
    min == max); values outside are ignored, a value equal to max counts in the last bin.

    Mirrors torch's CPU kernel exactly, rounding included: the bin is
    floor((x - min) * bins / (max - min)) evaluated in the input dtype, left to right (torch's
    histc uses this linear formula without the edge search torch.histogram adds, so a value one
    ulp below an edge may land in the upper bin, as it does in torch). Not differentiable (torch
    has no derivative for histc either): the counts carry no gradient.
    """
    dtype = self.dtype if is_floating(self.dtype) else jnp.float32
    x = lax.stop_gradient(self.reshape(-1)).astype(dtype)
    lo, hi = jnp.asarray(min, dtype), jnp.asarray(max, dtype)
    if float(min) == float(max) and x.size > 0:
        lo, hi = jnp.min(x), jnp.max(x)  # torch reads the data's range
    # An empty range is widened by 1 either side, as torch does.
    lo, hi = jnp.where(lo == hi, lo - 1, lo), jnp.where(lo == hi, hi + 1, hi)
    position = jnp.floor((x - lo) * jnp.asarray(bins, dtype) / (hi - lo)).astype(jnp.int32)
    position = jnp.minimum(position, bins - 1)  # x == max belongs to the last bin
    inside = (x >= lo) & (x <= hi)  # NaN is outside
    counts = jnp.zeros((bins,), jnp.float32).at[jnp.where(inside, position, bins)]
    return counts.add(1.0, mode="drop").astype(ctx.out_dtype)


@lowering(aten.bincount.default)
def lower_bincount_default(ctx, self, weights=None, minlength=0):
    """Counts (or summed weights) of each value of a 1-D non-negative integer tensor.

    Its torch length, max(self) + 1 (at least minlength), depends on the values, so it lowers
    only with minlength: the output then has exactly minlength entries and values >= minlength
    are dropped (torch would lengthen the output instead; MoE routing passes the number of
    experts, which no expert id reaches). Not differentiable in torch; counts carry no gradient.
    """
    if not minlength:
        raise DataDependentShapeError(
            f"torch.bincount without minlength ({ctx.node.target} in node '{ctx.node.name}') "
            f"has an output length that depends on the tensor's values (max + 1); a jitted JAX "
            f"program needs static shapes. Pass minlength=<number of bins> (every value must be "
            f"smaller), or use torch.histc(x.float(), bins=n, min=0, max=n - 1)"
        )
    index = jnp.where(self >= 0, self, minlength).astype(jnp.int32)  # negative: dropped
    if weights is None:
        return jnp.zeros((minlength,), np.int32).at[index].add(1, mode="drop")
    accumulate = jnp.float32 if not is_floating(weights.dtype) else weights.dtype
    zeros = jnp.zeros((minlength,), accumulate)
    return zeros.at[index].add(weights.astype(accumulate), mode="drop")
