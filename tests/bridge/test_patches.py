"""Parity of im2col (F.unfold) and col2im (F.fold) when a graph names them directly.

Run: .venv/bin/python -m pytest tests/bridge/test_patches.py -q
(Under export, F.unfold/F.fold decompose into index/index_put; these overloads only appear in
graphs that call them by name.)
"""

import torch
import torch.nn.functional as F

from tests.bridge.parity import check

aten = torch.ops.aten


def test_im2col_and_col2im():
    check(
        lambda x, x3, cols, cols2: (
            aten.im2col(x, [2, 3], [1, 2], [1, 0], [2, 1]),
            aten.im2col(x3, [2, 3], [1, 1], [1, 1], [1, 1]),
            aten.col2im(cols, [7, 8], [2, 3], [1, 2], [1, 0], [2, 1]),
            aten.col2im(cols2, [4, 5], [2, 2], [1, 1], [0, 0], [1, 1]),
            F.fold(cols2[None], (4, 5), 2),
        ),
        torch.randn(2, 3, 7, 8),
        torch.randn(3, 7, 8),
        torch.randn(2, 18, 16),
        torch.randn(12, 12),
    )
