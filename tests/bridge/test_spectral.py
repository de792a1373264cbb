"""Parity of the FFT primitives (_fft_r2c, _fft_c2r, _fft_c2c) behind torch.fft.

Run: .venv/bin/python -m pytest tests/bridge/test_spectral.py -q
ATen's normalization codes (0 none, 1 1/sqrt(n), 2 1/n) apply in the op's own direction, unlike
numpy's `norm`; every code is checked in every direction.
"""

import math

import torch
import torch.utils._pytree as torch_pytree

from tests import tolerances
from tests.bridge.parity import run_both

aten = torch.ops.aten

DIMS = ([2], [1, 2], [0, 1, 2], [0, 2])


def fft_error(length: int, passes: int = 1) -> float:
    """Normwise relative error of one float32 side's FFT of `length` points (Higham, Accuracy
    and Stability, Thm 24.2: ||dy|| / ||y|| <= log2(n) eta for radix-2 Cooley-Tukey, eta =
    mu + gamma_4 (sqrt 2 + mu), mu ~ 2 u the twiddles' error). pocketfft (torch) and XLA:CPU's
    FFT take mixed radices and, for prime factors such as 7 and 13, Bluestein's algorithm: three
    FFTs of a power of two M >= 2n - 1 and two chirp products, so 3 log2(M) eta + 3 u bounds
    every variant; the normalization (1/n, 1/sqrt n) rounds once more. `passes`: FFTs chained."""
    u = tolerances.unit_roundoff(torch.float32)
    eta = 2 * u + 4 * u * (math.sqrt(2) + 2 * u)
    m = 2 ** math.ceil(math.log2(2 * length - 1))
    return passes * (3 * math.log2(m) * eta + 4 * u)


def check_fft(fn, x, length: int, passes: int = 1):
    """zerojax vs torch for each output: any element's error is at most the error vector's
    2-norm, so |dy_k| <= 2 sides x fft_error x ||y||_2 of that output (its transforms' norms
    summed into one: a looser, still valid bound). `length`: the longest transform (points)."""
    expected, got = run_both(fn, x)
    leaves = torch_pytree.tree_leaves(expected)
    got_leaves = torch_pytree.tree_leaves(got)
    assert len(leaves) == len(got_leaves)
    for i, (e, g) in enumerate(zip(leaves, got_leaves, strict=True)):
        assert g.dtype == e.dtype and g.shape == e.shape, (i, g.dtype, e.dtype, g.shape)
        wide = e.to(torch.complex128 if e.is_complex() else torch.float64)
        bound = 2 * fft_error(length, passes) * float(torch.linalg.vector_norm(wide))
        if e.is_complex():
            e, g = torch.view_as_real(e), torch.view_as_real(g)
        tolerances.assert_within(g, e, bound, f"output {i}")


def test_fft_r2c():
    check_fft(
        lambda x: [
            aten._fft_r2c(x, dims, norm, onesided)
            for norm in (0, 1, 2)
            for dims in DIMS
            for onesided in (True, False)
        ],
        torch.randn(2, 6, 7),
        length=2 * 6 * 7,
    )


def test_fft_c2c_and_c2r():
    check_fft(
        lambda z: [
            (
                aten._fft_c2c(z, dims, norm, True),
                aten._fft_c2c(z, dims, norm, False),
                aten._fft_c2r(z, dims, norm, 12),
                aten._fft_c2r(z, dims, norm, 13),
            )
            for norm in (0, 1, 2)
            for dims in DIMS
        ],
        torch.randn(2, 6, 7, dtype=torch.complex64),
        length=2 * 6 * 13,  # c2r to 13 points
    )


def test_torch_fft_functions():
    """The public API: rfft/irfft round trip, n= padding, 2-d ortho, >3 transformed dims."""
    check_fft(
        lambda x: (
            torch.fft.rfft(x),
            torch.fft.fft(x),
            torch.fft.rfft2(x, norm="ortho"),
            torch.fft.irfft(torch.fft.rfft(x), n=7),
            torch.fft.fftn(x, norm="forward"),
            torch.fft.rfft(x, n=10),
            torch.fft.fftn(x.reshape(2, 3, 2, 7, 1)),
        ),
        torch.randn(2, 6, 7),
        length=2 * 6 * 7,
        passes=2,  # irfft(rfft(x))
    )


def test_inverse_and_hermitian_ffts_through_conj_and_complex_views():
    x = torch.randn(4, 8)
    check_fft(lambda x: torch.view_as_real(torch.fft.ifft(torch.fft.fft(x))), x, 8, passes=2)
    check_fft(lambda x: torch.fft.hfft(torch.view_as_complex(x.reshape(4, 4, 2))), x, 6)
    check_fft(lambda x: torch.view_as_real(torch.fft.ihfft(x).resolve_conj()), x, 8)
