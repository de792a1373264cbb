"""What the OpInfo parity suite (test_opinfo.py) skips, and why; its per-op tolerances.

Three tables, read by tests/bridge/test_opinfo.py:

* `ATEN_GAPS` (defined in zerojax/bridge/aten_gaps.py): ATen overloads zerojax does not
  lower, each with the reason. An OpInfo sample
  whose decomposed graph needs one of these is skipped with that reason; a sample that needs an
  unlowered overload *not* listed here fails the suite, so a gap is never silent. Lowering one of
  these ops makes every OpInfo entry that uses it start running, and
  `test_gap_table_is_current` then asks for its line here to be deleted.
* `ENTRY_SKIPS`: OpInfo entries (``name`` or ``name.variant_test_name``; optionally per dtype)
  that are out of scope for value parity, with the reason.
* `TOLERANCES`: per-entry (rtol, atol) where zerojax's result legitimately differs from torch's
  by more than the default (a different but equally accurate algorithm or libm), and
  `ROUNDING_BOUNDS`: entries compared elementwise against a rounding-error bound computed from
  the sample (contractions, whose error scales with the operands, not with the result).

Keys of ENTRY_SKIPS and TOLERANCES are ``"name"`` (every dtype) or ``("name", torch.dtype)``.
"""

from __future__ import annotations

import torch

from tests import tolerances
from zerojax.bridge import aten_gaps

# Default comparison tolerances per dtype, (rtol, atol).
# float32: torch.testing's defaults. rtol 1.3e-6 is 11 fp32 ulps (eps 2^-23): zerojax's
# elementwise functions come from XLA's libm, torch's from Sleef/glibc, each a few ulps from the
# exact value, composed over a few ops in OpInfo's composite entries. atol 1e-5 is for results
# that cancel to ~0: ~20 roundings of unit roundoff 2^-24 at operands up to 9 (make_tensor's
# range) is 1.1e-5.
# bfloat16: zerojax computes in fp32 and rounds once; torch's bf16 CPU kernels also compute in
# fp32 (opmath) and round the output, plus at most one intermediate in the composite families
# tested in bf16 (softmax, norms): 2 ulps (eps 2^-7, so 1.6e-2) relative; atol 1e-2 (~2.5 unit
# roundoffs at magnitude 1) for outputs that cancel to ~0 from O(1) normalized intermediates.
# Contractions, whose error scales with the operands rather than the result, are in
# ROUNDING_BOUNDS.
DEFAULT_TOLERANCE = {
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (tolerances.ulps(torch.bfloat16, 2), 1e-2),
}

# OpInfo entries also tested in bfloat16 (the families where bf16 is the usual compute dtype).
BF16_ENTRIES = frozenset(
    {
        # matmul
        "matmul",
        "mm",
        "bmm",
        "mv",
        "dot",
        "addmm",
        "addmm.decomposed",
        "addmv",
        "addbmm",
        "baddbmm",
        "einsum",
        "inner",
        "tensordot",
        "linalg.multi_dot",
        "nn.functional.linear",
        "nn.functional.bilinear",
        "__rmatmul__",
        # conv
        "nn.functional.conv1d",
        "nn.functional.conv2d",
        "nn.functional.conv3d",
        "nn.functional.conv_transpose1d",
        "nn.functional.conv_transpose2d",
        "nn.functional.conv_transpose3d",
        # norms
        "nn.functional.layer_norm",
        "nn.functional.group_norm",
        "nn.functional.batch_norm",
        "nn.functional.batch_norm.without_cudnn",
        "nn.functional.instance_norm",
        "nn.functional.rms_norm",
        "nn.functional.normalize",
        "native_layer_norm",
        "native_group_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        # softmax
        "softmax",
        "softmax.with_dtype",
        "log_softmax",
        "log_softmax.with_dtype",
        "nn.functional.softmin",
        "nn.functional.softmin.with_dtype",
        "torch.ops.aten._safe_softmax.default",
    }
)

_RANDOM = (
    "draws random numbers: value parity is meaningless; covered by tests/bridge/test_random.py"
)
_UNINITIALIZED = "returns uninitialized memory; only shape and dtype are compared"
_SPARSE = "sparse tensor layouts have no JAX equivalent in zerojax"
_INPLACE = (
    "mutates its input in place (or its storage); a converted model is a pure function, "
    "clone before modifying"
)
_HOST_VALUE = (
    "returns a Python value computed from tensor data (bool/number), which torch.export "
    "cannot capture as a graph output"
)

ENTRY_SKIPS: dict = {
    # One sample's shape, (1, 2**63 - 1), overflows int32: JAX runs without 64-bit types.
    ("unravel_index", torch.int64): "a sample needs int64 values beyond int32 (JAX without x64)",
    # Random ops: torch and JAX draw from different generators.
    "bernoulli": _RANDOM,
    "cauchy": _RANDOM,
    "exponential": _RANDOM,
    "geometric": _RANDOM,
    "log_normal": _RANDOM,
    "multinomial": _RANDOM,
    "normal": _RANDOM,
    "normal.in_place": _RANDOM,
    "normal.number_mean": _RANDOM,
    "uniform": _RANDOM,
    "rand_like": _RANDOM,
    "randint": _RANDOM,
    "randint_like": _RANDOM,
    "randn": _RANDOM,
    "randn_like": _RANDOM,
    "nn.functional.dropout": _RANDOM,
    "nn.functional.dropout2d": _RANDOM,
    "nn.functional.dropout3d": _RANDOM,
    "nn.functional.alpha_dropout": _RANDOM,
    "nn.functional.feature_alpha_dropout.with_train": _RANDOM,
    "nn.functional.feature_alpha_dropout.without_train": _RANDOM,
    "nn.functional.rrelu": _RANDOM,
    "nn.functional.fractional_max_pool2d": _RANDOM,
    "nn.functional.fractional_max_pool3d": _RANDOM,
    "svd_lowrank": _RANDOM,
    "pca_lowrank": _RANDOM,
    # Test-only kernels that exist for CUDA code generation, not user-facing ops.
    "jiterator_unary": "CUDA jiterator test kernel; not an op models call",
    "jiterator_binary": "CUDA jiterator test kernel; not an op models call",
    "jiterator_4inputs_with_extra_args": "CUDA jiterator test kernel; not an op models call",
    "jiterator_binary_return_by_ref": "CUDA jiterator test kernel; not an op models call",
    "jiterator_2inputs_2outputs": "CUDA jiterator test kernel; not an op models call",
    "bmm.triton_optimized": "CUDA/Triton-specific sample set; `bmm` itself is tested",
    "hash_tensor": "bit-level hash of the tensor's storage; not a numerical op",
    # In-place ops and ops on storage.
    "resize_": _INPLACE,
    "resize_as_": _INPLACE,
    "zero_": _INPLACE,
    "as_strided.partial_views": (
        "as_strided on a view reads storage outside that view; zerojax holds tensor values, not "
        "storage (as_strided on a whole tensor is tested by `as_strided`)"
    ),
    "sparse.sampled_addmm": _SPARSE,
    "sparse.mm.reduce": _SPARSE,
    "to_sparse": _SPARSE,
    # Python values out of tensor data.
    "item": _HOST_VALUE,
    "chalf": "complex32 (chalf) has no JAX dtype",
    "equal": _HOST_VALUE,
    "allclose": _HOST_VALUE,
}

# Entries whose values are unspecified: compared on shape and dtype only.
SHAPE_ONLY = {
    "empty": _UNINITIALIZED,
    "empty_like": _UNINITIALIZED,
    "empty_strided": _UNINITIALIZED,
    "empty_permuted": _UNINITIALIZED,
    "new_empty": _UNINITIALIZED,
    "new_empty_strided": _UNINITIALIZED,
}

# Reasons the suite gives by itself (samples it recognizes at run time).
RANDOM_SAMPLE = (
    "this sample draws random numbers (dropout_p > 0 or training-mode dropout); value parity is "
    "covered by tests/bridge/test_random.py"
)
DATA_DEPENDENT = (
    "output shape depends on tensor values (torch.export records an unbacked size); a jitted "
    "XLA program needs static shapes"
)

# Entry -> (which output holds indices (None: the only output), position of `dim` in the
# sample's args, its default). With ties (integer/bool inputs) the order of equal elements is
# unspecified, so these indices are checked by the values they select, not compared directly.
TIED_INDEX_OUTPUTS = {
    "sort": (1, 0, -1),
    "argsort": (None, 0, -1),
    "topk": (1, 1, -1),
    "kthvalue": (1, 1, -1),
}

# ATen overload -> why zerojax lacks it: part of the package (tools/op_coverage.py reads it too).
ATEN_GAPS = aten_gaps.ATEN_GAPS

# Entry -> (rtol, atol), overriding DEFAULT_TOLERANCE. Say why next to each line.
TOLERANCES: dict = {}

# (entry, dtype) -> the number of roundings the two sides' results go through together, as a
# function of the sample's tensors; for these entries the comparison is elementwise against
#     |zerojax - torch| <= roundings * u * S            (tolerances.rounded_intermediates)
# where u is the dtype's unit roundoff and S = op(|inputs|), computed in float64 from the
# inputs' absolute values, bounds every partial sum and intermediate at that output element.
ROUNDING_BOUNDS: dict = {}

# fp32 contractions: XLA's blocked dot and torch's kernel sum the same products in different
# orders; each order is within (K - 1) u S of the exact result (tolerances.reordered_sum), so
# they differ by <= 2 (K - 1) u S. K (all contraction lengths, summed for chained or two-sided
# contractions like multi_dot and bilinear) is at most the inputs' total size.
for _entry in (
    "matmul", "mm", "bmm", "mv", "dot", "addmm", "addmm.decomposed", "addmv", "addbmm",
    "baddbmm", "einsum", "inner", "tensordot", "linalg.multi_dot", "nn.functional.linear",
    "nn.functional.bilinear", "__rmatmul__", "addr", "outer", "vdot", "kron",
    "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d",
    "nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
    "nn.functional.conv_transpose3d",
):  # fmt: skip
    ROUNDING_BOUNDS[(_entry, torch.float32)] = lambda tensors: 2 * sum(t.numel() for t in tensors)

# bf16 entries whose torch CPU kernel rounds intermediate partial results to bf16 (which ones
# depends on the CPU: oneDNN's bf16 kernels on AVX512-BF16/AMX hardware round once; ATen's
# fallbacks, used e.g. on an AMD EPYC, round partial sums), while zerojax accumulates in fp32
# and rounds once. Each rounding adds at most u |intermediate| <= u S (u = 2^-8).
ROUNDING_BOUNDS.update(
    {
        # torch's addbmm adds the b batch products one addmm at a time into the bf16 result:
        # the beta * input term, then b partial results, each rounded; + zerojax's rounding.
        ("addbmm", torch.bfloat16): lambda tensors: 1 + tensors[1].shape[0] + 1,
        # torch's _trilinear rounds the x1 * weight products and their sum over x1's features
        # to bf16 before contracting with x2; then the contraction's output and the bias add
        # are rounded: 4 on torch's side, 1 on zerojax's.
        ("nn.functional.bilinear", torch.bfloat16): lambda tensors: 5,
    }
)
for _entry in (
    "nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
    "nn.functional.conv_transpose3d",
):  # fmt: skip
    # torch's slow_conv_transpose (the kernel without oneDNN bf16) computes each column with an
    # fp32-accumulated gemm rounded to bf16 (1), adds up to T = kernel-numel columns into the
    # bf16 output in col2im (T), adds the bias (1); oneDNN rounds fewer. + zerojax's one.
    ROUNDING_BOUNDS[(_entry, torch.bfloat16)] = lambda tensors: (
        1 + tensors[1].shape[2:].numel() + 1 + 1
    )


def entry_skip(entry: str, dtype: torch.dtype) -> str | None:
    """The reason `entry` is skipped in `dtype`, or None."""
    return ENTRY_SKIPS.get((entry, dtype)) or ENTRY_SKIPS.get(entry)


def tolerance(entry: str, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing `entry` in `dtype` (exact for integer and bool results)."""
    found = TOLERANCES.get((entry, dtype)) or TOLERANCES.get(entry)
    if found is not None:
        return found
    return DEFAULT_TOLERANCE.get(dtype, DEFAULT_TOLERANCE[torch.float32])
