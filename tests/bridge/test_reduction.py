"""Parity of the reduction, scan, softmax and sort lowerings with torch eager.

Run: .venv/bin/python -m pytest -q tests/bridge/test_reduction.py -p no:cacheprovider

Each case exports a small torch callable, converts it with zerojax and compares the jitted JAX
result with torch (dtype, shape, values; indices exactly). Ties are built from small
integer-valued floats so that "first index wins" rules are exercised, and NaNs are planted in
the inputs. Several ops share one callable where that keeps the export/compile count down.
"""

import jax
import numpy as np
import pytest
import torch

import zerojax
from tests import tolerances
from tests.bridge.parity import (
    ATOL,
    GRAD_ATOL,
    GRAD_RTOL,
    Lambda,
    check,
    check_grad,
    run_both,
)
from zerojax.bridge.dtypes import from_torch, to_torch

NAN = float("nan")
F32 = torch.float32
U = tolerances.unit_roundoff(F32)
EXACT = {"rtol": 0, "atol": 0}
"""Selections (extrema, sorts, arg-indices, cummax, median, mode), integer/boolean results and
reductions of a single element (0-d: sum, mean, softmax 1, log_softmax 0, var 0) are exact."""


def reduction_tolerance(x, terms: int, *, relative: int = 1, squares: bool = False, divisor=1):
    """Results of sums, means, products and scans of x over at most `terms` elements, each side
    in float32 (tests/tolerances.py): two summation orders differ by at most
    reordered_sum(terms, sum|x_i|) with sum|x_i| <= terms max|x| (max x^2 for sums of squares,
    over `divisor` for a variance's n - correction); a product or scan of `terms` factors
    errs by (terms - 1) u relative per side, and a mean's division by one more: `relative`
    extra roundings per side."""
    magnitude = float(x.double().abs().max()) ** (2 if squares else 1)
    atol = tolerances.reordered_sum(F32, terms, terms * magnitude) / divisor
    return {"rtol": tolerances.ulps(F32, terms - 1 + relative), "atol": max(atol, ATOL)}


def softmax_tolerance(x, terms: int):
    """softmax / log_softmax / logcumsumexp of x over `terms` elements, per side: the rounded
    shift x - max errs by u 2 max|x|, which exp turns into that relative error, plus exp's and
    log's LIBM_ULPS and a `terms`-term sum ((terms + 1) u relative); the log results err by
    those absolutely plus log's ulps of |log-sum| <= 2 max|x| + log(terms). Two sides."""
    magnitude = float(x.double().abs().max())
    libm = tolerances.LIBM_ULPS * tolerances.eps(F32)
    relative = 2 * (2 * (2 * magnitude * U + libm) + (terms + 1) * U)
    absolute = (
        2 * (2 * magnitude * U + 2 * libm + (terms + 1) * U) * (1 + 2 * magnitude + np.log(terms))
    )
    return {"rtol": relative, "atol": max(absolute, ATOL)}


def rounded_to(dtype, tolerance: dict) -> dict:
    """A float32 result rounded once per side to `dtype`: plus one ulp of it, relative."""
    return {**tolerance, "rtol": tolerance["rtol"] + tolerances.ulps(dtype, 1)}


def ties(*shape):
    """Floats drawn from {-2, ..., 2}: plenty of equal values in every slice."""
    return torch.randint(-2, 3, shape).float()


def with_nans(x, *positions):
    x = x.clone()
    for position in positions:
        x[position] = NAN
    return x


# --- sums, means, products -----------------------------------------------------------------------


def test_sum_mean_over_dims():
    """dim None and [] mean all dims; negative and repeated-order dims; keepdim."""
    x = torch.randn(2, 3, 4)
    check(
        lambda x: (
            x.sum(),
            x.sum([], keepdim=True),
            x.sum(1),
            x.sum([0, 2]),
            x.mean(-1, keepdim=True),
            x.mean([-1, 0], keepdim=True),
            x.mean(),
        ),
        x,
        **reduction_tolerance(x, x.numel()),
    )


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_sum_of_integers_and_bools_is_int64(dtype):
    x = torch.randint(0, 3, (3, 5)).to(dtype)
    # Integer sums and products are exact.
    check(lambda x: (x.sum(), x.sum(1), x.sum(0, keepdim=True), x.prod(1), x.cumsum(1)), x, **EXACT)


def test_reductions_with_dtype_argument():
    x = torch.randn(3, 4)
    check(
        lambda x: (
            x.sum(1, dtype=torch.float64),
            x.mean(0, dtype=torch.float64),
            x.sum(1, dtype=torch.bfloat16),
            x.cumsum(0, dtype=torch.float64),
            x.prod(1, dtype=torch.float64),
        ),
        x,
        # float64 results come back as float32 (one more rounding); the bf16 sum rounds once.
        **rounded_to(torch.bfloat16, reduction_tolerance(x, 4, relative=2)),
    )


def test_bf16_reductions_accumulate_in_fp32():
    x = torch.randn(4, 64).bfloat16()
    # float32 accumulation (the mean over all 256), each result rounded once to bf16; the
    # variance's sum of squares over 64 (tolerances.normalization's (n + 3) u mean(x^2)).
    sums = reduction_tolerance(x, 256, relative=2)
    variance = reduction_tolerance(x, 64 + 3, squares=True, divisor=63)
    tolerance = {k: max(sums[k], variance[k]) for k in sums}
    check(
        lambda x: (x.sum(1), x.mean(), x.cumsum(1), x.var(1)),
        x,
        **rounded_to(torch.bfloat16, tolerance),
    )


def test_mean_of_all_dims_and_prod():
    x = torch.rand(3, 4) + 0.5
    check(
        lambda x: (x.mean(), x.prod(), x.prod(0, keepdim=True), x.prod(-1)),
        x,
        **reduction_tolerance(x, x.numel()),
    )


def test_var_and_var_mean():
    x = torch.randn(3, 5)
    check(
        lambda x: (
            torch.var(x),
            torch.var(x, 1),
            torch.var(x, [0, 1], correction=0, keepdim=True),
            torch.var_mean(x, -1, correction=2, keepdim=True),
            torch.var_mean(x, 0, correction=0.5),
            torch.var_mean(x),
        ),
        x,
        # Sums of squares over up to 15 (+ 3 roundings), divided by n - correction >= 3.
        **reduction_tolerance(x, x.numel() + 3, squares=True, divisor=3),
    )


def test_std_decomposes_to_var():
    x = torch.randn(3, 5)
    # std = sqrt(var): |sqrt(a) - sqrt(b)| <= sqrt(|a - b|), with var's bound (n = 5, n - 1).
    variance = reduction_tolerance(x, 5 + 3, squares=True, divisor=4)
    tolerance = {"rtol": variance["rtol"], "atol": variance["atol"] ** 0.5}
    check(lambda x: (torch.std(x, 1), torch.std_mean(x, 0, correction=0)), x, **tolerance)


@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")
def test_var_of_single_element_is_nan_like_torch():
    x = torch.randn(4, 1)
    check(lambda x: (torch.var(x, 1), torch.var(x, 1, correction=0)), x, **EXACT)  # nan and 0


# --- extrema -------------------------------------------------------------------------------------


def test_amax_amin():
    x = torch.randn(3, 4, 2)
    check(
        lambda x: (
            x.amax(),
            x.amin([], True),
            x.amax(1, True),
            x.amin([-1, 0]),
            x.amax(-2),
            x.max(),
            x.min(),
        ),
        x,
        **EXACT,
    )


def test_arg_extrema_first_index_on_ties():
    x = ties(5, 6)
    check(
        lambda x: (
            x.argmax(),
            x.argmin(None, True),
            x.argmax(1),
            x.argmin(-2, True),
            x.max(0),
            x.min(1, True),
            x.max(-1),
        ),
        x,
        **EXACT,
    )


def test_nan_is_the_extreme_of_both_ends():
    x = with_nans(torch.randn(4, 5), (0, 3), (2, 1), (2, 4))
    check(
        lambda x: (
            x.amax(1),
            x.amin(0),
            x.max(),
            x.min(),
            x.argmax(1),
            x.argmin(1),
            x.argmax(),
            x.max(1),
            x.min(1),
        ),
        x,
        **EXACT,
    )


def test_integer_and_bool_extrema():
    x = torch.randint(-3, 4, (4, 5))
    check(lambda x: (x.amax(1), x.argmax(0), x.max(1), x.min(0), x.max()), x, **EXACT)
    b = torch.rand(4, 5) > 0.5
    check(lambda b: (b.amax(1), b.max(1), b.max(), b.any()), b, **EXACT)


# --- logical -------------------------------------------------------------------------------------


def test_any():
    b = torch.rand(3, 4, 2) > 0.8
    check(
        lambda b: (
            b.any(),
            b.any(1),
            b.any(-1, keepdim=True),
            torch.any(b, dim=(0, 2)),
            torch.any(b, dim=()),
        ),
        b,
        **EXACT,
    )


def test_all_decomposes_to_any():
    b = torch.rand(3, 4) > 0.2
    check(lambda b: (b.all(), b.all(1), torch.all(b, dim=(0, 1))), b, **EXACT)


def test_any_of_numbers_counts_nan_as_true():
    x = with_nans(torch.randint(0, 2, (3, 4)).float(), (1, 1))
    check(lambda x: (x.any(1), torch.any(x, dim=(0, 1), keepdim=True)), x, **EXACT)
    u = torch.randint(0, 2, (3, 4), dtype=torch.uint8)
    check(lambda u: (u.any(), u.any(0)), u, **EXACT)


# --- scans ---------------------------------------------------------------------------------------


def test_cumsum_cumprod_logcumsumexp():
    x = torch.randn(3, 4)
    sums, logs = reduction_tolerance(x, 4), softmax_tolerance(x, 4)
    check(
        lambda x: (x.cumsum(0), x.cumsum(-1), x.cumprod(1), x.cumprod(-2), x.logcumsumexp(-1)),
        x,
        **{k: max(sums[k], logs[k]) for k in sums},
    )


def test_logcumsumexp_handles_large_and_infinite_values():
    x = torch.tensor([[1000.0, -1000.0, 999.0, float("-inf")], [float("-inf")] * 2 + [3.0, 4.0]])
    # Relative to the result (~1000): a shifted log-sum-exp of 4 terms, log's ulps.
    check(lambda x: x.logcumsumexp(1), x, rtol=softmax_tolerance(torch.ones(1), 4)["rtol"])


def test_cummax_cummin_latest_index_on_ties():
    x = ties(5, 6)
    check(lambda x: (x.cummax(0), x.cummin(1), x.cummax(-1), x.cummin(-2)), x, **EXACT)


def test_cummax_cummin_with_nan_and_ints():
    x = torch.tensor([[1.0, 3.0, 3.0, NAN, 2.0, NAN, 3.0], [3.0, 1.0, 1.0, 2.0, 1.0, -1.0, -1.0]])
    check(lambda x: (x.cummax(1), x.cummin(1)), x, **EXACT)
    check(lambda x: (x.cummax(1), x.cummin(0)), torch.randint(-2, 3, (3, 6)), **EXACT)


# --- softmax -------------------------------------------------------------------------------------


def test_softmax_log_softmax():
    x = torch.randn(3, 4, 5)
    check(
        lambda x: (x.softmax(0), x.log_softmax(1), x.softmax(-1), x.log_softmax(-1)),
        x,
        **softmax_tolerance(x, 5),
    )


def test_log_softmax_is_stable_for_large_logits():
    x = torch.randn(4, 8) * 1e4
    x[0, 0] = 1e30
    # Results ~1e4..1e30 in size: relative to them, x - max and the log-sum-exp (8 terms, of
    # arguments that underflow to 0 or are O(1)) round a few times: softmax_tolerance's relative
    # part at magnitude 1 bounds both.
    check(
        lambda x: (x.log_softmax(-1), x.softmax(-1)),
        x,
        rtol=softmax_tolerance(torch.ones(1), 8)["rtol"],
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_softmax(dtype):
    x = (torch.randn(4, 16) * 4).to(dtype)
    # float32 compute (as torch's CPU kernels), each result rounded once to the dtype.
    check(
        lambda x: (x.softmax(-1), x.log_softmax(0)),
        x,
        **rounded_to(dtype, softmax_tolerance(x, 16)),
    )


def test_half_to_float_softmax():
    """softmax(dtype=float32) on bf16 becomes a _to_copy then _softmax in fp32."""
    x = (torch.randn(4, 16) * 4).bfloat16()
    check(
        lambda x: (
            torch.softmax(x, 0, dtype=torch.float32),
            torch.log_softmax(x, 1, dtype=torch.float32),
        ),
        x,
        **softmax_tolerance(x, 16),
    )


# --- sort and selection --------------------------------------------------------------------------


@pytest.mark.parametrize("descending", [False, True])
def test_sort_is_stable(descending):
    x = ties(6, 7)
    check(
        lambda x: (
            torch.sort(x, dim=0, descending=descending),
            torch.sort(x, dim=-1, descending=descending, stable=True),
            torch.argsort(x, dim=1, descending=descending),
        ),
        x,
        **EXACT,
    )


@pytest.mark.parametrize("descending", [False, True])
def test_sort_puts_nan_last_and_merges_zeros(descending):
    x = torch.tensor([[2.0, NAN, -0.0, 0.0, -1.0, NAN, float("inf"), -0.0, float("-inf")]])
    x = torch.cat([x, -x])  # -NaN sorts as the largest too
    check(lambda x: torch.sort(x, descending=descending), x, **EXACT)


def test_sort_integers_and_bools():
    i = torch.randint(-3, 4, (3, 8))
    i[0, 0] = torch.iinfo(torch.int32).min  # ~x must not overflow where -x would
    check(lambda i: (torch.sort(i), torch.sort(i, 0, descending=True)), i, **EXACT)
    b = torch.rand(3, 8) > 0.5
    check(
        lambda b: (torch.sort(b, stable=True), torch.sort(b, descending=True, stable=True)),
        b,
        **EXACT,
    )


def _check_topk_on_ties(fn, x, dim):
    """torch's CPU topk orders tied values arbitrarily (its partial sort); zerojax puts the lower
    index first. Values must match exactly and each index must point at its value."""
    (expected, _), (got, got_index) = run_both(fn, x)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert got_index.dtype == torch.int32
    torch.testing.assert_close(x.gather(dim, got_index.long()), got, equal_nan=True)
    assert (got_index.sort(dim).values.diff(dim=dim) > 0).all(), "indices must be distinct"
    run = (got != got.roll(1, dim)).cumsum(dim)  # runs of equal values, numbered in order
    ordered = got_index.float() + x.shape[dim] * run
    assert (ordered.diff(dim=dim) > 0).all(), "tied values must come lowest index first"


@pytest.mark.parametrize("k, dim, largest", [(3, -1, True), (2, 0, False), (6, 1, True)])
def test_topk_on_ties(k, dim, largest):
    def fn(x):
        return tuple(torch.topk(x, k, dim=dim, largest=largest))

    _check_topk_on_ties(fn, ties(5, 6), dim)


def test_topk_distinct_values_match_torch_exactly():
    x = torch.randn(4, 7)
    i = torch.randperm(28).reshape(4, 7) - 10
    check(lambda x: (torch.topk(x, 3), torch.topk(x, 2, 0, largest=False)), x, **EXACT)
    check(lambda i: (torch.topk(i, 3), torch.topk(i, 2, largest=False)), i, **EXACT)


def test_topk_nan_and_signed_zero():
    x = torch.tensor([[0.5, NAN, 1.0, -0.0, 3.0, -NAN, -2.0]])
    check(lambda x: (torch.topk(x, 4), torch.topk(x, 4, largest=False)), x, **EXACT)


def test_topk_unsorted_holds_the_same_elements():
    x = torch.randn(3, 10)
    check(lambda x: torch.topk(x, 4, sorted=False).values.sort().values, x, **EXACT)


def test_median_kthvalue_distinct_values():
    x = torch.randperm(30).float().reshape(5, 6)
    check(
        lambda x: (
            x.median(),
            x.median(1),
            x.median(0, keepdim=True),
            x.nanmedian(),
            x.nanmedian(1),
            x.kthvalue(2, 1),
            x.kthvalue(5, 0, keepdim=True),
        ),
        x,
        **EXACT,
    )


def test_median_with_nan():
    x = with_nans(torch.randperm(24).float().reshape(4, 6), (0, 2), (0, 4), (2, 0))
    x[3] = NAN
    check(lambda x: (x.median(), x.median(1), x.nanmedian(), x.nanmedian(1).values), x, **EXACT)


def test_mode_smallest_value_last_index():
    x = torch.randint(0, 4, (5, 9)).float()
    check(lambda x: (x.mode(1), x.mode(0, keepdim=True)), x, **EXACT)
    check(lambda i: i.mode(), torch.randint(-2, 2, (3, 7)), **EXACT)


# --- 0-d inputs ----------------------------------------------------------------------------------


def test_zero_dim_inputs():
    x = torch.randn(())
    check(
        lambda x: (
            x.sum(),
            x.sum(0),
            x.mean(-1, keepdim=True),
            x.amax(0),
            x.argmax(),
            x.argmax(0, keepdim=True),
            x.max(0),
            x.min(-1, keepdim=True),
            x.cumsum(0),
            x.cummax(0),
            x.softmax(0),
            x.log_softmax(-1),
            torch.sort(x, 0),
            torch.topk(x, 1),
            torch.var(x, correction=0),
            x.any(0),
        ),
        x,
        **EXACT,
    )


# --- gradients -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, fn",
    [
        ("softmax", lambda x: (x.softmax(-1), x.log_softmax(0))),
        ("moments", lambda x: (x.sum(1), x.mean(), x.var(1), torch.var_mean(x, 0, correction=0))),
        ("extrema_ties", lambda x: (x.amax(1), x.amin(), x.max(), x.max(1).values)),
        ("sort_topk", lambda x: (x.sort(0).values, x.topk(2).values, x.median(1).values)),
        ("scans", lambda x: (x.cumsum(1), x.cumprod(0), x.logcumsumexp(1), x.cummax(1).values)),
    ],
)
def test_gradient_parity(name, fn):
    x = ties(4, 6) if name == "extrema_ties" else torch.randn(4, 6)
    check_grad(fn, x)  # tolerances.GRADIENT: elementwise chains, reductions over <= 24


@pytest.mark.parametrize("ord", [2, 1, 3, 0, float("inf"), float("-inf")])
@pytest.mark.parametrize("dim", [None, 1, (0, 2)])
def test_linalg_vector_norm(ord, dim):
    x = torch.randn(3, 4, 5)
    x[0, 0, 0] = 0.0
    # |x|^p summed over <= 60 positive terms ((60 - 1) u relative), pow and the root
    # (LIBM_ULPS each, twice for p = 3), per side; ord 0 and +-inf are exact.
    rtol = tolerances.ulps(F32, 60 + 4 * tolerances.LIBM_ULPS)
    check(
        lambda x: torch.linalg.vector_norm(x, ord=ord, dim=dim, keepdim=dim == 1),
        x,
        rtol=rtol,
        atol=ATOL,
    )


def test_vector_norm_gradient_at_zero_is_zero_like_torch():
    x = torch.randn(4, 6)
    x[1] = 0.0
    x.requires_grad_()
    torch.linalg.vector_norm(x, dim=1).sum().backward()
    converted = zerojax.convert(Lambda(lambda x: torch.linalg.vector_norm(x, dim=1)), (x.detach(),))
    grad = jax.grad(lambda x: converted.apply({}, {}, x)[0].sum())(from_torch(x.detach()))
    torch.testing.assert_close(to_torch(grad), x.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)
