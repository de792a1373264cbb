"""Parity of the FFT primitives (_fft_r2c, _fft_c2r, _fft_c2c) behind torch.fft.

Run: .venv/bin/python -m pytest tests/bridge/test_spectral.py -q
ATen's normalization codes (0 none, 1 1/sqrt(n), 2 1/n) apply in the op's own direction, unlike
numpy's `norm`; every code is checked in every direction.
"""

import torch

from tests.bridge.parity import check

aten = torch.ops.aten

DIMS = ([2], [1, 2], [0, 1, 2], [0, 2])


def test_fft_r2c():
    check(
        lambda x: [
            aten._fft_r2c(x, dims, norm, onesided)
            for norm in (0, 1, 2)
            for dims in DIMS
            for onesided in (True, False)
        ],
        torch.randn(2, 6, 7),
        atol=1e-4,
    )


def test_fft_c2c_and_c2r():
    check(
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
        atol=1e-4,
    )


def test_torch_fft_functions():
    """The public API: rfft/irfft round trip, n= padding, 2-d ortho, >3 transformed dims."""
    check(
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
        atol=1e-4,
    )


def test_inverse_and_hermitian_ffts_through_conj_and_complex_views():
    x = torch.randn(4, 8)
    check(lambda x: torch.view_as_real(torch.fft.ifft(torch.fft.fft(x))), x, rtol=1e-5, atol=1e-5)
    check(
        lambda x: torch.fft.hfft(torch.view_as_complex(x.reshape(4, 4, 2))), x, rtol=1e-5, atol=1e-5
    )
    check(lambda x: torch.view_as_real(torch.fft.ihfft(x).resolve_conj()), x, rtol=1e-5, atol=1e-5)
