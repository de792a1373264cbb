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
  by more than the default (a different but equally accurate algorithm or libm).

Keys of ENTRY_SKIPS and TOLERANCES are ``"name"`` (every dtype) or ``("name", torch.dtype)``.
"""

from __future__ import annotations

import torch

from zerojax.bridge import aten_gaps

# Default comparison tolerances per dtype: float32 is torch.testing's default; bfloat16 allows
# one bf16 ulp (2**-7 relative) plus accumulation-order differences of fp32-accumulated sums.
DEFAULT_TOLERANCE = {
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
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
TOLERANCES: dict = {
    # torch's CPU addbmm adds the b products one addmm at a time, rounding to bf16 after each;
    # zerojax contracts over b and k in fp32 and rounds once. Terms reach ~100 (make_tensor
    # draws from [-9, 9]), where one bf16 ulp is 0.5.
    ("addbmm", torch.bfloat16): (1.6e-2, 0.5),
    # torch's CPU _trilinear rounds the x1 * weight partial products to bf16 before contracting
    # with x2; zerojax contracts all three in fp32 and rounds once. Products reach 81.
    ("nn.functional.bilinear", torch.bfloat16): (1.6e-2, 0.5),
    # torch's CPU slow_conv_transpose accumulates its col2im partial sums in bf16; zerojax
    # accumulates in fp32 (preferred_element_type) and rounds once. Same magnitude argument.
    ("nn.functional.conv_transpose2d", torch.bfloat16): (1.6e-2, 0.5),
    ("nn.functional.conv_transpose3d", torch.bfloat16): (1.6e-2, 0.5),
}
# fp32 contractions: XLA's blocked dot sums K products of magnitude up to 81 in another order
# than torch's kernel; a few fp32 ulps at |sum| ~ 100..400 is ~1e-4.
for _entry in (
    "matmul", "mm", "bmm", "mv", "dot", "addmm", "addmm.decomposed", "addmv", "addbmm",
    "baddbmm", "einsum", "inner", "tensordot", "linalg.multi_dot", "nn.functional.linear",
    "nn.functional.bilinear", "__rmatmul__", "addr", "outer", "vdot", "kron",
    "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d",
    "nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
    "nn.functional.conv_transpose3d",
):  # fmt: skip
    TOLERANCES.setdefault((_entry, torch.float32), (1e-5, 1e-4))


def entry_skip(entry: str, dtype: torch.dtype) -> str | None:
    """The reason `entry` is skipped in `dtype`, or None."""
    return ENTRY_SKIPS.get((entry, dtype)) or ENTRY_SKIPS.get(entry)


def tolerance(entry: str, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing `entry` in `dtype` (exact for integer and bool results)."""
    found = TOLERANCES.get((entry, dtype)) or TOLERANCES.get(entry)
    if found is not None:
        return found
    return DEFAULT_TOLERANCE.get(dtype, DEFAULT_TOLERANCE[torch.float32])
