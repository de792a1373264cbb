"""ATen overloads zerojax does not lower, each with the reason: the documented gaps of the
lowering table (`zerojax.bridge.supported_ops()`).

Read by the OpInfo parity suite (an OpInfo sample that needs an unlowered overload not listed
here fails it, so a gap is never silent) and by tools/op_coverage.py (the gap table in docs/coverage.md).
Lowering one of these ops must delete its line (tests/bridge/test_opinfo.py checks).
"""

from __future__ import annotations

__all__ = ["ATEN_GAPS"]

_NOT_LOWERED = "not lowered, see the gap list in docs/coverage.md"

_LINALG = (
    "linear-algebra factorization/solver (LAPACK in torch): not lowered, see the gap list in docs/coverage.md "
    "(jax.numpy.linalg / jax.scipy.linalg have equivalents)"
)
_SPECIAL = "special function with no jax.scipy.special equivalent: not lowered, see the gap list in docs/coverage.md"
_DATA_DEPENDENT_OP = (
    "output shape depends on tensor values; a jitted XLA program needs static shapes"
)

# ATen overload (str(op), as it appears in an UnsupportedOpError) -> why zerojax lacks it.
ATEN_GAPS: dict[str, str] = {
    # In-place core overloads that a functionalized graph never contains.
    "aten._native_batch_norm_legit.default": (
        "updates running stats in place; torch.export's functional graph uses "
        "_native_batch_norm_legit_functional instead, which is lowered"
    ),
    "aten.resize_.default": "resizes a tensor's storage in place; JAX arrays are immutable",
    # Linear algebra.
    "aten._linalg_det.default": _LINALG,
    "aten._linalg_eigh.default": _LINALG,
    "aten._linalg_slogdet.default": _LINALG,
    "aten._linalg_solve_ex.default": _LINALG,
    "aten._linalg_svd.default": _LINALG,
    "aten.cholesky.default": _LINALG,
    "aten.cholesky_inverse.default": _LINALG,
    "aten.cholesky_solve.default": _LINALG,
    "aten.geqrf.default": _LINALG,
    "aten.linalg_cholesky_ex.default": _LINALG,
    "aten.linalg_eig.default": _LINALG + "; its results are complex",
    "aten.linalg_householder_product.default": _LINALG,
    "aten.linalg_inv_ex.default": _LINALG,
    "aten.linalg_ldl_factor_ex.default": _LINALG,
    "aten.linalg_ldl_solve.default": _LINALG,
    "aten.linalg_lu.default": _LINALG,
    "aten.linalg_lu_factor_ex.default": _LINALG,
    "aten.linalg_lu_solve.default": _LINALG,
    "aten.linalg_matrix_exp.default": _LINALG,
    "aten.linalg_matrix_sqrth.default": _LINALG + " (new in torch 2.14)",
    "aten.linalg_pinv.atol_rtol_tensor": _LINALG,
    "aten.linalg_polar.default": _LINALG + " (new in torch 2.14)",
    "aten.linalg_qr.default": _LINALG,
    "aten.linalg_solve_triangular.default": _LINALG,
    "aten.lu_unpack.default": _LINALG,
    "aten.ormqr.default": _LINALG,
    "aten.triangular_solve.default": _LINALG,
    # Data-dependent output shapes.
    "aten._unique2.default": _DATA_DEPENDENT_OP,
    "aten.unique_consecutive.default": _DATA_DEPENDENT_OP,
    "aten.histogram.bin_ct": _DATA_DEPENDENT_OP + " (bins span the data's range)",
    "aten.histogram.bins_tensor": _DATA_DEPENDENT_OP + " (bins span the data's range)",
    "aten._histogramdd_bin_edges.default": _DATA_DEPENDENT_OP,
    "aten._histogramdd_from_bin_cts.default": _DATA_DEPENDENT_OP,
    "aten._histogramdd_from_bin_tensors.default": _DATA_DEPENDENT_OP,
    "aten.segment_reduce.default": _DATA_DEPENDENT_OP + " (segment lengths are tensor values)",
    # Special functions.
    "aten.special_airy_ai.default": _SPECIAL,
    "aten.special_bessel_j0.default": (
        "jax.scipy.special.bessel_jn is not accurate enough: NaN for |x| < ~4 and wrong values "
        "elsewhere (j1 off by up to 0.16 absolute on |x| <= 20); not lowered"
    ),
    "aten.special_bessel_j1.default": (
        "jax.scipy.special.bessel_jn is not accurate enough: NaN for |x| < ~4 and wrong values "
        "elsewhere (j1 off by up to 0.16 absolute on |x| <= 20); not lowered"
    ),
    "aten.special_bessel_y0.default": _SPECIAL,
    "aten.special_bessel_y1.default": _SPECIAL,
    "aten.special_modified_bessel_k0.default": _SPECIAL,
    "aten.special_modified_bessel_k1.default": _SPECIAL,
    "aten.special_scaled_modified_bessel_k0.default": _SPECIAL,
    "aten.special_scaled_modified_bessel_k1.default": _SPECIAL,
    "aten.special_chebyshev_polynomial_t.default": _SPECIAL,
    "aten.special_chebyshev_polynomial_u.default": _SPECIAL,
    "aten.special_chebyshev_polynomial_v.default": _SPECIAL,
    "aten.special_chebyshev_polynomial_w.default": _SPECIAL,
    "aten.special_shifted_chebyshev_polynomial_t.default": _SPECIAL,
    "aten.special_shifted_chebyshev_polynomial_u.default": _SPECIAL,
    "aten.special_shifted_chebyshev_polynomial_v.default": _SPECIAL,
    "aten.special_shifted_chebyshev_polynomial_w.default": _SPECIAL,
    "aten.special_hermite_polynomial_h.default": _SPECIAL,
    "aten.special_hermite_polynomial_he.default": _SPECIAL,
    "aten.special_laguerre_polynomial_l.default": _SPECIAL,
    "aten.special_legendre_polynomial_p.default": _SPECIAL,
    # Ops of one test-only OpInfo entry.
    "torch_nn._linear_cross_entropy_batch_chunked.default": (
        "custom op (torch_nn namespace) of a prototype chunked loss; not ATen, not lowered"
    ),
    "torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default": (
        "custom op (torch_nn namespace) of a prototype chunked loss; not ATen, not lowered"
    ),
}
