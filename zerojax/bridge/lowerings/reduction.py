"""Lowerings: reductions, scans, softmax, sort and selection (top-k, median, mode).

torch semantics that differ from numpy's and are handled here:

- `dim=None` and `dim=[]` mean "every dim" for sum/mean/amax/var (but `any.dims(dim=[])` reduces
  nothing), negative dims count from the end, and a 0-d tensor accepts dim 0 / -1 as a no-op.
- Reduced-precision floats (bf16, fp16) accumulate in fp32, as torch's CPU kernels do; the
  interpreter casts the result back to torch's recorded dtype.
- Index results (argmax, max.dim, sort, topk, ...) pick the *first* index among equal values, and
  NaN ranks above every number; -0.0 and 0.0 are equal keys. cummax/cummin are the exception:
  torch moves their index to the *latest* equal value.
- Selected values are gathered at the chosen index, so gradients flow to that element only, as
  torch's backward of max.dim/sort/topk does (amax/max.default split ties evenly, as jnp.max does).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from zerojax.bridge.dtypes import is_bool, is_floating
from zerojax.bridge.lowerings.pointwise import torch_abs
from zerojax.bridge.registry import lowering

aten = torch.ops.aten


# --- helpers -------------------------------------------------------------------------------------


def _axes(ndim: int, dim) -> tuple[int, ...]:
    """Normalized reduction axes; None or [] means all (a 0-d tensor has none to reduce)."""
    if dim is None:
        return tuple(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return tuple(range(ndim))
    return tuple(sorted({_axis(ndim, d) for d in dims} - {None}))


def _axis(ndim: int, dim: int) -> int | None:
    """One normalized dim; None for a 0-d tensor, where torch accepts dim 0 and -1 as no-ops."""
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"dim {dim} out of range for a {ndim}-d tensor")
    return None if ndim == 0 else dim % rank


def _accumulation_dtype(dtype) -> np.dtype:
    """fp32 for bf16/fp16 (torch's CPU accumulation type); the dtype itself otherwise."""
    dtype = np.dtype(dtype)
    if is_floating(dtype) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def _as_accumulator(ctx, x):
    """`x` cast to torch's result dtype (a `dtype=` argument is applied to the input first),
    then widened to the accumulation dtype."""
    out = ctx.out_dtype
    return x.astype(out).astype(_accumulation_dtype(out))


def _float_compute(x):
    """`x` as a float of at least 32 bits (softmax/var/logcumsumexp compute in this)."""
    if not is_floating(x.dtype):
        return x.astype(jnp.float32)
    return x.astype(_accumulation_dtype(x.dtype))


def _order_keys(x, descending: bool) -> tuple[jax.Array, ...]:
    """Sort keys whose ascending lexicographic order is torch's order of `x`.

    XLA's total order puts -NaN first and -0.0 before 0.0; torch ranks every NaN above every
    number and treats the zeros as equal, so floats become (is_nan, value with zeros merged).
    Descending integers use bitwise-not, which reverses the order without overflowing at INT_MIN.
    """
    if is_floating(x.dtype):
        nan = jnp.isnan(x)
        value = -x if descending else x
        value = jnp.where(nan | (value == 0), jnp.zeros_like(value), value)
        rank = (~nan if descending else nan).astype(jnp.int8)
        return rank, value
    if is_bool(x.dtype):
        x = x.astype(jnp.uint8)
    return (~x if descending else x,)


def _sorted_indices(x, axis: int, descending: bool) -> jax.Array:
    """Stable argsort of `x` along `axis` in torch's order (ties keep the lower index first)."""
    keys = _order_keys(x, descending)
    iota = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return lax.sort((*keys, iota), dimension=axis, is_stable=True, num_keys=len(keys))[-1]


def _top_key(x, largest: bool) -> jax.Array:
    """One array whose descending order (as lax.top_k sees it) is torch's top-k order of `x`."""
    if is_floating(x.dtype):
        value = x if largest else -x
        value = jnp.where(value == 0, jnp.zeros_like(value), value)
        # XLA's total order ranks +NaN above and -NaN below every number; torch's NaN is the
        # largest value, so it is +NaN for top-k and -NaN for bottom-k (keys negated).
        nan = jnp.full_like(value, jnp.nan)
        return jnp.where(jnp.isnan(x), nan if largest else -nan, value)
    if is_bool(x.dtype):
        x = x.astype(jnp.uint8)
    return x if largest else ~x


def _take(x, index, axis: int, keepdim: bool):
    """x gathered at `index` (keepdims-shaped) along `axis`: (values, index), squeezed unless
    keepdim."""
    values = jnp.take_along_axis(x, index, axis=axis)
    if not keepdim:
        values, index = jnp.squeeze(values, axis), jnp.squeeze(index, axis)
    return values, index


def _scalar_pair(x):
    """(values, indices) of a selection along the only "dim" of a 0-d tensor: itself, index 0."""
    return x, jnp.zeros((), jnp.int32)


def _reduce_or_keep(x, fn, axes, keepdim):
    return fn(x, axis=axes, keepdims=keepdim) if axes else x


# --- sums, means, products -----------------------------------------------------------------------


@lowering(aten.sum.dim_IntList)
def lower_sum_dim_intlist(ctx, self, dim, keepdim=False, *, dtype=None):
    """Sum over `dim` (None/[] = all); bool and integer inputs sum as int64."""
    x = _as_accumulator(ctx, self)
    return _reduce_or_keep(x, jnp.sum, _axes(self.ndim, dim), keepdim)


@lowering(aten.mean.default)
def lower_mean_default(ctx, self, *, dtype=None):
    return jnp.mean(_as_accumulator(ctx, self))


@lowering(aten.mean.dim)
def lower_mean_dim(ctx, self, dim, keepdim=False, *, dtype=None):
    x = _as_accumulator(ctx, self)
    return _reduce_or_keep(x, jnp.mean, _axes(self.ndim, dim), keepdim)


@lowering(aten.prod.default)
def lower_prod_default(ctx, self, *, dtype=None):
    return jnp.prod(_as_accumulator(ctx, self))


@lowering(aten.prod.dim_int)
def lower_prod_dim_int(ctx, self, dim, keepdim=False, *, dtype=None):
    x = _as_accumulator(ctx, self)
    return _reduce_or_keep(x, jnp.prod, _axes(self.ndim, [dim]), keepdim)


def _var(x, dim, correction, keepdim):
    """(variance, mean) of `x` over `dim`; torch divides by max(N - correction, 0)."""
    x = _float_compute(x)
    axes = _axes(x.ndim, dim)
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    correction = 1 if correction is None else correction
    mean = jnp.mean(x, axis=axes, keepdims=True)
    squares = jnp.sum(jnp.square(x - mean), axis=axes, keepdims=keepdim)
    var = squares / max(count - correction, 0)
    return var, mean if keepdim else jnp.squeeze(mean, axes)


@lowering(aten.var.correction)
def lower_var_correction(ctx, self, dim=None, *, correction=None, keepdim=False):
    """Variance over `dim` (None/[] = all), dividing by N - correction (correction None = 1)."""
    return _var(self, dim, correction, keepdim)[0]


@lowering(aten.var_mean.correction)
def lower_var_mean_correction(ctx, self, dim=None, *, correction=None, keepdim=False):
    return _var(self, dim, correction, keepdim)


# --- extrema -------------------------------------------------------------------------------------


@lowering(aten.amax.default)
def lower_amax_default(ctx, self, dim=(), keepdim=False):
    """Max over `dim` ([] = all); NaN propagates, gradient splits evenly among ties."""
    return _reduce_or_keep(self, jnp.max, _axes(self.ndim, dim), keepdim)


@lowering(aten.amin.default)
def lower_amin_default(ctx, self, dim=(), keepdim=False):
    return _reduce_or_keep(self, jnp.min, _axes(self.ndim, dim), keepdim)


@lowering(aten.max.default)
def lower_max_default(ctx, self):
    return jnp.max(self)


@lowering(aten.min.default)
def lower_min_default(ctx, self):
    return jnp.min(self)


def _arg_extreme(x, dim, keepdim, pick):
    """argmax/argmin with torch's flattening for dim=None; lax's arg-reductions already return
    the first index of the extreme and rank NaN as the extreme of both."""
    if dim is None:
        index = pick(x.reshape(-1))
        return index.reshape((1,) * x.ndim) if keepdim else index
    axis = _axis(x.ndim, dim)
    if axis is None:
        return jnp.zeros((), jnp.int32)
    return pick(x, axis=axis, keepdims=keepdim)


@lowering(aten.argmax.default)
def lower_argmax_default(ctx, self, dim=None, keepdim=False):
    """Index of the first maximum along `dim` (None = of the flattened tensor); NaN is max."""
    return _arg_extreme(self, dim, keepdim, jnp.argmax)


@lowering(aten.argmin.default)
def lower_argmin_default(ctx, self, dim=None, keepdim=False):
    """Index of the first minimum along `dim` (None = of the flattened tensor); NaN is min."""
    return _arg_extreme(self, dim, keepdim, jnp.argmin)


def _extreme_along(x, dim, keepdim, pick):
    axis = _axis(x.ndim, dim)
    if axis is None:
        return _scalar_pair(x)
    return _take(x, pick(x, axis=axis, keepdims=True), axis, keepdim)


@lowering(aten.max.dim)
def lower_max_dim(ctx, self, dim, keepdim=False):
    """(values, indices) of the maximum along `dim`: first index on ties, NaN wins."""
    return _extreme_along(self, dim, keepdim, jnp.argmax)


@lowering(aten.min.dim)
def lower_min_dim(ctx, self, dim, keepdim=False):
    """(values, indices) of the minimum along `dim`: first index on ties, NaN wins."""
    return _extreme_along(self, dim, keepdim, jnp.argmin)


# --- logical -------------------------------------------------------------------------------------


def _any(x, axes, keepdim):
    nonzero = x if is_bool(x.dtype) else x != 0
    return _reduce_or_keep(nonzero, jnp.any, axes, keepdim)


@lowering(aten.any.default)
def lower_any_default(ctx, self):
    return _any(self, _axes(self.ndim, None), False)


@lowering(aten.any.dim)
def lower_any_dim(ctx, self, dim, keepdim=False):
    return _any(self, _axes(self.ndim, [dim]), keepdim)


@lowering(aten.any.dims)
def lower_any_dims(ctx, self, dim=None, keepdim=False):
    """any over `dim`; None = all dims, but unlike sum an empty list reduces nothing."""
    if dim is not None and len(dim) == 0:
        return _any(self, (), keepdim)
    return _any(self, _axes(self.ndim, dim), keepdim)


# --- scans ---------------------------------------------------------------------------------------


def _scan(x, dim, fn):
    axis = _axis(x.ndim, dim)
    return x if axis is None else fn(x, axis=axis)


def _two_sum(a, b):
    """(a + b rounded, its exact rounding error): Knuth's TwoSum, six float operations."""
    total = a + b
    b_part = total - a
    return total, (a - (total - b_part)) + (b - b_part)


def _compensated_cumsum(x, axis: int, reverse: bool = False):
    """Running sum of `x` along `axis` carried as (sum, rounding error) pairs, rounded once at
    the end: each prefix is within about one ulp of its exact value, like torch's CPU cumsum of
    float32, which accumulates in double (a float32 scan errs by up to log2(n) ulps of the
    running |sum|, n ulps sequentially)."""

    def combine(a, b):
        total, error = _two_sum(a[0], b[0])
        return total, error + a[1] + b[1]

    total, error = lax.associative_scan(combine, (x, jnp.zeros_like(x)), reverse=reverse, axis=axis)
    return total + error


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _float_cumsum(x, axis: int):
    """cumsum of floats with torch's backward: the reversed running sum of the cotangent,
    compensated (torch's CPU kernel sums it in double; autodiff's float32 reverse scan was 4-7x
    torch's error against float64 over 4096 elements)."""
    return jnp.cumsum(x, axis=axis)


def _float_cumsum_fwd(x, axis):
    return jnp.cumsum(x, axis=axis), None


def _float_cumsum_bwd(axis, _, cotangent):
    return (_compensated_cumsum(cotangent, axis, reverse=True),)


_float_cumsum.defvjp(_float_cumsum_fwd, _float_cumsum_bwd)


@lowering(aten.cumsum.default)
def lower_cumsum_default(ctx, self, dim, *, dtype=None):
    """Running sum along `dim`; bool and integer inputs accumulate as int64. Floats
    accumulate in fp32 at least (bf16/fp16 too, as torch)."""
    x = _as_accumulator(ctx, self)
    return _scan(x, dim, _float_cumsum if is_floating(x.dtype) else jnp.cumsum)


@lowering(aten.cumprod.default)
def lower_cumprod_default(ctx, self, dim, *, dtype=None):
    return _scan(_as_accumulator(ctx, self), dim, jnp.cumprod)


@lowering(aten.logsumexp.default)
def lower_logsumexp_default(ctx, self, dim, keepdim=False):
    """log(sum(exp(x))) over `dim`, kept whole by capture (capture.KEPT_WHOLE).

    torch's decomposition subtracts amax(x) for stability, and autodiff then sends
    g (1 - sum(softmax)), zero but for rounding, through amax to the max element: 3-14x torch's
    gradient error over 4096 elements (tests/bridge/test_gradient_accuracy.py). The shift here
    is a constant to autodiff, which leaves torch's backward g exp(x - result). Computed in fp32
    for bf16/fp16 and integers (torch returns the default float dtype for integers).
    """
    x = _float_compute(self)
    axes = _axes(self.ndim, dim)
    if self.ndim == 0:
        return x
    shift = lax.stop_gradient(jnp.max(x, axis=axes, keepdims=True))
    # An infinite max (all -inf, or a +inf) would give inf - inf = NaN: shift by 0 there.
    shift = jnp.where(jnp.isinf(shift), 0.0, shift).astype(x.dtype)
    out = jnp.log(jnp.sum(jnp.exp(x - shift), axis=axes, keepdims=True)) + shift
    out = out if keepdim else jnp.squeeze(out, axes)
    return out.astype(self.dtype) if is_floating(self.dtype) else out


@lowering(aten.logcumsumexp.default)
def lower_logcumsumexp_default(ctx, self, dim):
    return _scan(_float_compute(self), dim, lax.cumlogsumexp)


def _cumulative_extreme(x, dim, later_wins):
    """(values, indices) of a running max/min. torch moves the index to every later element
    that ties the running extreme or is NaN, which is a max over (value, index) pairs."""
    axis = _axis(x.ndim, dim)
    if axis is None:
        return _scalar_pair(x)
    index = lax.broadcasted_iota(jnp.int32, x.shape, axis)

    def combine(a, b):
        (a_value, a_index), (b_value, b_index) = a, b
        take_b = later_wins(b_value, a_value)
        if is_floating(x.dtype):
            take_b = take_b | jnp.isnan(b_value)
        return jnp.where(take_b, b_value, a_value), jnp.where(take_b, b_index, a_index)

    _, index = lax.associative_scan(combine, (x, index), axis=axis)
    return jnp.take_along_axis(x, index, axis=axis), index


@lowering(aten.cummax.default)
def lower_cummax_default(ctx, self, dim):
    """(running max, index of its latest occurrence) along `dim`; NaN sticks."""
    return _cumulative_extreme(self, dim, lambda new, old: new >= old)


@lowering(aten.cummin.default)
def lower_cummin_default(ctx, self, dim):
    """(running min, index of its latest occurrence) along `dim`; NaN sticks."""
    return _cumulative_extreme(self, dim, lambda new, old: new <= old)


# --- softmax -------------------------------------------------------------------------------------


def _along(x, dim, fn):
    """fn(x, axis) along `dim`, treating a 0-d tensor as a length-1 vector."""
    axis = _axis(x.ndim, dim)
    if axis is None:
        return fn(x[None], axis=0)[0]
    return fn(x, axis=axis)


@lowering(aten._softmax.default)
def lower__softmax_default(ctx, self, dim, half_to_float):
    """Softmax along `dim`, computed in fp32 for bf16/fp16 (half_to_float only sets the output
    dtype, which torch recorded)."""
    return _along(_float_compute(self), dim, jax.nn.softmax)


@lowering(aten._log_softmax.default)
def lower__log_softmax_default(ctx, self, dim, half_to_float):
    """log-softmax along `dim` as x - max - log(sum(exp(x - max))), in fp32 for bf16/fp16."""
    return _along(_float_compute(self), dim, jax.nn.log_softmax)


# --- sort and selection --------------------------------------------------------------------------


def _sort(x, dim, descending):
    axis = _axis(x.ndim, dim)
    if axis is None:
        return _scalar_pair(x)
    index = _sorted_indices(x, axis, descending)
    return jnp.take_along_axis(x, index, axis=axis), index


@lowering(aten.sort.default)
def lower_sort_default(ctx, self, dim=-1, descending=False):
    """(values, int64 indices) sorted along `dim`; stable, NaN sorts as the largest value."""
    return _sort(self, dim, descending)


@lowering(aten.sort.stable)
def lower_sort_stable(ctx, self, *, stable=None, dim=-1, descending=False):
    # Always stable: an unstable sort may return any order of ties, the stable one included.
    return _sort(self, dim, descending)


@lowering(aten.topk.default)
def lower_topk_default(ctx, self, k, dim=-1, largest=True, sorted=True):
    """(values, indices) of the k largest (smallest) along `dim`; ties give the lower index
    first and NaN ranks largest. sorted=False returns them sorted too (a valid order)."""
    axis = _axis(self.ndim, dim)
    if axis is None:
        return _scalar_pair(self)
    _, index = lax.top_k(_top_key(self, largest), k, axis=axis)
    return jnp.take_along_axis(self, index, axis=axis), index


def _select_sorted(x, dim, keepdim, position):
    """(values, indices) of the element at sorted position `position(n, nan_count)` of each
    slice along `dim`, in ascending torch order (NaN last); nan_count is keepdims-shaped."""
    axis = _axis(x.ndim, dim)
    if axis is None:
        return _scalar_pair(x)
    order = _sorted_indices(x, axis, descending=False)
    if is_floating(x.dtype):
        nans = jnp.sum(jnp.isnan(x), axis=axis, keepdims=True, dtype=jnp.int32)
    else:
        nans = jnp.zeros((1,) * x.ndim, jnp.int32)
    select = position(x.shape[axis], nans).astype(jnp.int32)
    return _take(x, jnp.take_along_axis(order, select, axis=axis), axis, keepdim)


def _median_position(n, nans):
    """torch's median is the lower middle element, or the first NaN if the slice has any."""
    return jnp.where(nans > 0, n - nans, (n - 1) // 2)


def _nanmedian_position(n, nans):
    """nanmedian is the lower middle of the non-NaN elements (a NaN if there are none)."""
    return jnp.maximum((n - nans - 1) // 2, 0)


@lowering(aten.median.default)
def lower_median_default(ctx, self):
    """Lower median of all elements; NaN if any element is NaN."""
    return _select_sorted(self.reshape(-1), 0, False, _median_position)[0]


@lowering(aten.nanmedian.default)
def lower_nanmedian_default(ctx, self):
    return _select_sorted(self.reshape(-1), 0, False, _nanmedian_position)[0]


@lowering(aten.median.dim)
def lower_median_dim(ctx, self, dim, keepdim=False):
    """(lower median, its index) along `dim`; the first NaN if the slice has one."""
    return _select_sorted(self, dim, keepdim, _median_position)


@lowering(aten.nanmedian.dim)
def lower_nanmedian_dim(ctx, self, dim, keepdim=False):
    return _select_sorted(self, dim, keepdim, _nanmedian_position)


@lowering(aten.kthvalue.default)
def lower_kthvalue_default(ctx, self, k, dim=-1, keepdim=False):
    """(k-th smallest, its index) along `dim`, k counted from 1; NaN ranks largest."""
    return _select_sorted(self, dim, keepdim, lambda n, nans: jnp.full_like(nans, k - 1))


@lowering(aten.mode.default)
def lower_mode_default(ctx, self, dim=-1, keepdim=False):
    """(most frequent value, index of its last occurrence) along `dim`; among equally frequent
    values the smallest wins, as in torch's CPU kernel."""
    axis = _axis(self.ndim, dim)
    if axis is None:
        return _scalar_pair(self)
    order = _sorted_indices(self, axis, descending=False)
    ordered = jnp.take_along_axis(self, order, axis=axis)
    position = lax.broadcasted_iota(jnp.int32, self.shape, axis)
    previous = jnp.roll(ordered, 1, axis=axis)
    same = ordered == previous
    if is_floating(self.dtype):
        same = same | (jnp.isnan(ordered) & jnp.isnan(previous))
    run_start = jnp.where(same & (position > 0), 0, position)
    # Length of the run of equal values so far; its maximum sits on the last element of the
    # longest run, and argmax picks the first such run, i.e. the smallest value. The stable
    # sort puts that value's last occurrence in the original tensor there.
    run_length = position - lax.cummax(run_start, axis=axis) + 1
    best = jnp.argmax(run_length, axis=axis, keepdims=True)
    return _take(self, jnp.take_along_axis(order, best, axis=axis), axis, keepdim)


# --- norms ----------------------------------------------------------------------------------------


@lowering(aten.linalg_vector_norm.default)
def lower_linalg_vector_norm(ctx, self, ord=2, dim=None, keepdim=False, *, dtype=None):
    """(sum |x|^ord)^(1/ord) over `dim`; ord inf/-inf = max/min |x|, ord 0 = count of nonzeros.

    Gradients at zero are torch's: 0 for an element that is 0 (|x| has derivative sgn(x), and
    |x|^ord is taken through a `where`, so ord < 1's infinite derivative at 0 is never
    evaluated) and 0 for a slice whose norm is 0 (the root likewise), never NaN.
    """
    x = _as_accumulator(ctx, self)
    x = torch_abs(x) if is_floating(x.dtype) else jnp.abs(x)
    axes = _axes(self.ndim, dim)

    def reduce(fn, value):
        return _reduce_or_keep(value, fn, axes, keepdim)

    if ord == float("inf"):
        return reduce(jnp.max, x)
    if ord == float("-inf"):
        return reduce(jnp.min, x)
    if ord == 0:
        return reduce(jnp.sum, (x != 0).astype(x.dtype))
    if ord == 1:
        return reduce(jnp.sum, x)
    if ord == 2:
        total = reduce(jnp.sum, x * x)
        nonzero = total != 0  # NaN and inf pass through sqrt
        return jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, total, 1.0)), 0.0)
    nonzero = x != 0
    # 0^ord is 0, or inf for a negative ord (whose norm is then 0, as torch's).
    powered = jnp.where(nonzero, jnp.where(nonzero, x, 1.0) ** ord, jnp.inf if ord < 0 else 0.0)
    total = reduce(jnp.sum, powered)
    nonzero = total != 0
    return jnp.where(nonzero, jnp.where(nonzero, total, 1.0) ** (1.0 / ord), 0.0)


@lowering(aten.var.dim)
def lower_var_dim(ctx, self, dim=None, unbiased=True, keepdim=False):
    """Legacy form of var.correction: unbiased=True is correction 1."""
    return _var(self, dim, 1 if unbiased else 0, keepdim)[0]
