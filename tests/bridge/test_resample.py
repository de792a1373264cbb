"""Parity of upsampling (nearest, linear family, bicubic, antialiased) and grid_sample.

Run: .venv/bin/python -m pytest tests/bridge/test_resample.py -q
Source indices come from torch's float32 formulas, so scale-factor vs output-size calls and
align_corners both matter; cases share graphs to keep the file fast.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.bridge.parity import check, check_grad
from tests.bridge.test_pooling import graph_targets

aten = torch.ops.aten

SIZES = [
    {"scale_factor": 2},
    {"scale_factor": 1.7},
    {"scale_factor": (0.6, 2.3)},
    {"size": (7, 4)},
    {"size": (1, 1)},
]


def test_upsample_nearest2d_and_bilinear2d_stay_whole():
    x = torch.randn(1, 1, 4, 4)
    assert aten.upsample_nearest2d.vec in graph_targets(
        lambda x: F.interpolate(x, scale_factor=2), x
    )
    assert aten.upsample_bilinear2d.vec in graph_targets(
        lambda x: F.interpolate(x, size=(5, 7), mode="bilinear"), x
    )


# F.interpolate's bicubic, 'nearest-exact' and 1-d/3-d modes decompose into index arithmetic;
# only these reach resample.py (or pooling.py, for 'area').
@pytest.mark.parametrize("mode", ["nearest", "bilinear", "area"])
def test_interpolate(mode):
    align = [None] if mode in ("nearest", "area") else [False, True]
    check(
        lambda x: [
            F.interpolate(x, mode=mode, align_corners=a, **kw) for a in align for kw in SIZES
        ],
        torch.randn(2, 3, 5, 6),
    )


def test_interpolate_antialias():
    check(
        lambda x: [
            F.interpolate(x, mode=mode, align_corners=a, antialias=True, **kw)
            for mode in ("bilinear", "bicubic")
            for a in (False, True)
            for kw in ({"scale_factor": 2}, {"scale_factor": 0.4}, {"size": (3, 9)})
        ],
        torch.randn(1, 2, 9, 10),
    )


def test_upsample_overloads_called_directly():
    """1-d/3-d and bicubic overloads decompose under F.interpolate; a graph may still name them."""
    check(
        lambda x1, x2, x3, x8: (
            aten.upsample_nearest1d(x1, [11]),
            aten.upsample_nearest1d.vec(x1, None, [1.7]),
            aten.upsample_nearest2d(x2, [7, 3], 1.5, None),
            aten.upsample_nearest3d(x3, [7, 3, 8]),
            aten._upsample_nearest_exact2d(x2, [7, 3]),
            aten.upsample_linear1d(x1, [11], False),
            aten.upsample_linear1d(x1, [11], True),
            aten.upsample_bilinear2d(x2, [7, 9], False, 1.3, None),
            aten.upsample_trilinear3d(x3, [7, 3, 8], False),
            aten.upsample_trilinear3d.vec(x3, None, True, [1.5, 2.0, 0.7]),
            aten.upsample_bicubic2d(x2, [7, 9], False),
            aten.upsample_bicubic2d.vec(x2, None, True, [1.3, 2.5]),
            aten.upsample_nearest2d.vec(x8, None, [1.5, 2.0]),  # uint8 images
        ),
        torch.randn(2, 3, 5),
        torch.randn(1, 2, 5, 4),
        torch.randn(1, 2, 3, 5, 4),
        torch.randint(0, 255, (1, 2, 5, 4), dtype=torch.uint8),
    )


def test_upsample_bilinear2d_grad():
    check_grad(
        lambda x, w: (
            F.interpolate(x, size=(7, 9), mode="bilinear") * w
            + F.interpolate(x, scale_factor=1.5, mode="bilinear", align_corners=True).sum()
        ),
        torch.randn(2, 3, 5, 6),
        torch.randn(2, 3, 7, 9),
    )


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample(mode):
    # Points past [-1, 1] exercise every padding mode.
    cases = [(p, a) for p in ("zeros", "border", "reflection") for a in (False, True)]
    if mode == "bicubic":  # 16 taps per point: compile fewer of them
        cases = [("zeros", False), ("border", True), ("reflection", False), ("reflection", True)]
    check(
        lambda x, g: [
            F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align)
            for padding, align in cases
        ],
        torch.randn(2, 3, 5, 6),
        torch.rand(2, 4, 5, 2) * 2.4 - 1.2,
    )


def test_grid_sample_3d():
    check(
        lambda x, g: [
            F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align)
            for mode in ("bilinear", "nearest")
            for padding in ("zeros", "reflection")
            for align in (False, True)
        ],
        torch.randn(2, 3, 4, 5, 6),
        torch.rand(2, 3, 4, 2, 3) * 2.4 - 1.2,
    )


def test_grid_sample_grad():
    """Gradients reach both the image and the sampling grid."""
    check_grad(
        lambda x, g, w1, w2: (
            F.grid_sample(x, g, padding_mode="border", align_corners=False) * w1
            + F.grid_sample(x, g, padding_mode="reflection", align_corners=True) * w2
        ),
        torch.randn(2, 3, 5, 6),
        torch.rand(2, 4, 5, 2) * 2.4 - 1.2,
        torch.randn(2, 3, 4, 5),
        torch.randn(2, 3, 4, 5),
        atol=1e-4,
    )
