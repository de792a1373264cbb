"""Parity of torch.cdist (_cdist_forward) and F.pdist (_pdist_forward), values and gradients.

Run: .venv/bin/python -m pytest tests/bridge/test_distance.py -q
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.bridge.parity import check, check_grad

aten = torch.ops.aten

NORMS = (0.0, 1.0, 2.0, 3.0, 0.5, math.inf)


def test_cdist_every_p_and_compute_mode():
    # compute_mode None/0: matmul for p=2 only past 25 rows (x1 has 30); 1: always; 2: never.
    check(
        lambda a, b, big: (
            [
                (torch.cdist(a, b, p=p), aten._cdist_forward(big, b, p, mode))
                for p in NORMS
                for mode in (None, 1, 2)
            ]
            + [torch.cdist(a[:, None], b, compute_mode="use_mm_for_euclid_dist")]
        ),  # batch broadcast
        torch.randn(2, 5, 3),
        torch.randn(2, 4, 3),
        torch.randn(30, 3),
        atol=1e-5,
    )


def test_pdist_every_p():
    check(lambda x: [F.pdist(x, p) for p in NORMS], torch.randn(6, 4))


def test_distance_grads_are_zero_at_zero_distance():
    """Duplicate rows give distance 0, where torch's gradient is 0 rather than NaN."""
    x = torch.randn(5, 3)
    x[3] = x[1]
    check_grad(
        lambda x, y: torch.cdist(x, y).sum() + F.pdist(x).sum() + F.pdist(x, 3.0).sum(),
        x,
        torch.cat([x[:2], torch.randn(2, 3)]),
    )


@pytest.mark.parametrize("p", [0, 1, 2, 3.5, math.inf, -math.inf])
def test_dist(p):
    check(lambda a, b: torch.dist(a, b, p), torch.randn(3, 4), torch.randn(4))
