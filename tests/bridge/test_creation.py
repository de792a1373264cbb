"""Parity of creation lowerings (zerojax/bridge/lowerings/creation.py) with torch eager.

Run: .venv/bin/python -m pytest -q tests/bridge/test_creation.py
Dtypes are torch's inference (int arange arguments -> int64 -> int32 here, any float -> float32);
`empty*` results are filled before use since torch leaves them uninitialized.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.bridge.parity import check
from zerojax.bridge.registry import get_lowering

CASES = {
    # arange.start_step: int args -> int64, float args/step -> float32, explicit dtype, negative
    # step, a length that float rounding decides
    "arange": lambda x: (
        torch.arange(5),
        torch.arange(-2, 7, 3),
        torch.arange(0, 1.2, 0.25),
        torch.arange(x.shape[0], dtype=torch.float32),
        torch.arange(5, -3, -2),
        torch.arange(0.1, 1.0, 0.1),
        torch.arange(3, dtype=torch.bfloat16),
        torch.arange(1, 4, dtype=torch.float16) + x[0, :3],
    ),
    # full.default (zeros/ones/new_* become full), bool and int fills
    "full": lambda x: (
        torch.full((2, 3), 2.5),
        torch.full((2,), 7),
        torch.full((), True),
        torch.zeros(2, 3, dtype=torch.int32),
        torch.ones(4),
        x.new_zeros(3),
        x.new_ones((2, 1)),
        x.new_full((3,), -1.5),
        torch.full((2,), float("-inf")),
    ),
    # full_like.default (zeros_like/ones_like/full_like with a dtype)
    "full_like": lambda x: (
        torch.zeros_like(x),
        torch.ones_like(x, dtype=torch.int32),
        torch.full_like(x, 3, dtype=torch.int64),
        torch.full_like(x, 0.5),
    ),
    # empty.memory_format / empty_strided / empty_permuted, filled: torch leaves them garbage
    "empty": lambda x: (
        torch.empty(2, 3).fill_(1.5),
        torch.empty_strided((3, 4), (1, 3)).fill_(2.0),
        torch.empty_like(x).fill_(-1.0) + x,
        x.new_empty((2,)).fill_(4),
    ),
    # scalar_tensor.default (from masked_fill / tril)
    "scalar_tensor": lambda x: (
        torch.scalar_tensor(3.5),
        torch.scalar_tensor(2, dtype=torch.int32),
        x.masked_fill(x > 0, 0.25),
        x.tril(),
    ),
    # linspace / logspace / eye decompose to arange + pointwise ops
    "ranges": lambda x: (
        torch.linspace(-1, 1, 7),
        torch.logspace(0, 2, 5),
        torch.eye(3, 4),
        torch.linspace(0, 10, 6, dtype=torch.int64),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_creation_parity(name):
    check(CASES[name], torch.randn(4, 5))


def test_empty_is_zeros():
    """empty.* lowers to zeros (JAX has no uninitialized memory); torch's values are arbitrary."""
    aten = torch.ops.aten

    class Ctx:
        out_dtype = np.dtype(np.float32)
        out_shape = (2, 3)

    for overload, args in [
        (aten.empty.memory_format, ([2, 3],)),
        (aten.empty_strided.default, ([2, 3], [1, 2])),
        (aten.empty_permuted.default, ([2, 3], [1, 0])),
        (aten.empty_like.default, (jnp.ones((2, 3)),)),
        (aten.new_empty.default, (jnp.ones(4), [2, 3])),
        (aten.new_empty_strided.default, (jnp.ones(4), [2, 3], [3, 1])),
    ]:
        out = get_lowering(overload)(Ctx(), *args)
        assert out.shape == (2, 3) and out.dtype == jnp.float32 and not out.any(), overload


def test_arange_overloads_direct():
    """arange.default / arange.start survive only when torch's table keeps them; call directly."""
    aten = torch.ops.aten

    class Ctx:
        out_dtype = np.dtype(np.int32)
        out_shape = (4,)

    np.testing.assert_array_equal(get_lowering(aten.arange.default)(Ctx(), 4), np.arange(4))
    np.testing.assert_array_equal(get_lowering(aten.arange.start)(Ctx(), 3, 7), np.arange(3, 7))


@pytest.mark.parametrize("row, col, offset", [(4, 3, 0), (3, 5, 1), (5, 4, -2), (0, 3, 0)])
def test_tril_triu_indices(row, col, offset):
    x = torch.randn(2)
    check(lambda a: a.sum() + torch.tril_indices(row, col, offset).sum(), x)
    check(lambda a: (torch.tril_indices(row, col, offset), torch.triu_indices(row, col, offset)), x)
