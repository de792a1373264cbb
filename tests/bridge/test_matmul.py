"""Parity of the matrix-product lowerings (mm, bmm, addmm, addbmm, addmv) with torch eager.

Run: .venv/bin/python -m pytest -q tests/bridge/test_matmul.py -p no:cacheprovider

The torch calls used here reach the graph as exactly these overloads (torch.matmul on batched
operands becomes expand/view/bmm; baddbmm, mv, dot and addr decompose to mul/sum).
"""

import pytest
import torch

from tests.bridge.parity import check

FP32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 2e-2, "atol": 2e-2}
NAN = float("nan")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
def test_mm_bmm(dtype, tol):
    a, b = torch.randn(5, 7, dtype=dtype), torch.randn(7, 3, dtype=dtype)
    c, d = torch.randn(2, 5, 7, dtype=dtype), torch.randn(2, 7, 4, dtype=dtype)
    check(lambda a, b, c, d: (torch.mm(a, b), torch.bmm(c, d)), a, b, c, d, **tol)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8])
def test_mm_integer(dtype):
    a, b = torch.randint(-9, 10, (3, 6), dtype=dtype), torch.randint(-9, 10, (6, 4), dtype=dtype)
    check(lambda a, b: (torch.mm(a, b), torch.bmm(a[None], b[None])), a, b)


def test_mm_mixed_dtypes_promote():
    check(lambda a, b: torch.mm(a, b.float()), torch.randn(3, 4), torch.randn(4, 5).bfloat16())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
def test_addmm(dtype, tol):
    bias, a, b = (torch.randn(*s, dtype=dtype) for s in [(4,), (3, 5), (5, 4)])
    full = torch.randn(3, 4, dtype=dtype)

    def fn(bias, full, a, b):
        return (
            torch.addmm(bias, a, b),
            torch.addmm(full, a, b, beta=0.5, alpha=-2.0),
            torch.addmm(full[:1], a, b, beta=3),
        )

    check(fn, bias, full, a, b, **tol)


def test_addmm_beta_zero_ignores_nan_self():
    self = torch.full((3, 4), NAN)
    check(lambda s, a, b: torch.addmm(s, a, b, beta=0), self, torch.randn(3, 5), torch.randn(5, 4))


def test_addmm_integer():
    self, a, b = (torch.randint(-5, 6, s) for s in [(3, 4), (3, 5), (5, 4)])
    check(lambda s, a, b: torch.addmm(s, a, b, beta=2, alpha=3), self, a, b)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32), (torch.bfloat16, BF16)])
def test_addbmm_addmv(dtype, tol):
    def fn(s, b1, b2, v_self, mat, vec):
        return (
            torch.addbmm(s, b1, b2),
            torch.addbmm(s, b1, b2, beta=0.5, alpha=2),
            torch.addmv(v_self, mat, vec, beta=-1, alpha=0.5),
            torch.addmv(v_self[:1], mat, vec),
        )

    shapes = [(3, 4), (2, 3, 5), (2, 5, 4), (3,), (3, 6), (6,)]
    check(fn, *(torch.randn(*s, dtype=dtype) for s in shapes), **tol)


def test_linear_and_matmul_graphs():
    """nn.Linear (permute + addmm/mm) and batched matmul (expand/view + bmm) end to end."""
    torch.manual_seed(0)
    check(torch.nn.Linear(6, 3), torch.randn(4, 6), **FP32)
    check(torch.nn.Linear(6, 3, bias=False), torch.randn(4, 6), **FP32)
    check(torch.matmul, torch.randn(2, 3, 4, 5), torch.randn(5, 2), **FP32)


def test_integer_add_products_truncate_scalars():
    """torch casts beta/alpha to the integer dtype (0.6 -> 0) before scaling."""
    m, v = torch.randint(-9, 9, (3, 4)), torch.randint(-9, 9, (4,))
    b1, b2 = torch.randint(-9, 9, (2, 3, 4)), torch.randint(-9, 9, (2, 4, 5))
    check(
        lambda s, a, b: torch.addmv(s, a, b, beta=0.2, alpha=0.6), torch.randint(-9, 9, (3,)), m, v
    )
    check(
        lambda s, a, b: torch.addmv(s, a, b, beta=2.7, alpha=1.6), torch.randint(-9, 9, (3,)), m, v
    )
    check(
        lambda s, a, b: torch.addbmm(s, a, b, beta=0.2, alpha=0.6),
        torch.randint(-9, 9, (3, 5)),
        b1,
        b2,
    )


def test_bilinear():
    x1, x2 = torch.randn(4, 3), torch.randn(4, 5)
    w, b = torch.randn(2, 3, 5), torch.randn(2)
    check(torch.nn.functional.bilinear, x1, x2, w, b)
    check(
        lambda a, c, d: torch.nn.functional.bilinear(a, c, d),
        torch.randn(2, 4, 3),
        torch.randn(2, 4, 5),
        w,
    )
