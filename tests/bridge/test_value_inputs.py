"""Integer inputs whose values decide shapes: the program is specialised on their values.

    pytest -q tests/bridge/test_value_inputs.py

Why: Qwen2-VL splits its vision patches with `torch.split(x, lengths.tolist())`, the lengths
computed from the input `image_grid_thw`; torch.export cannot capture a host read of an input's
values, so the model did not convert. `Converted` now finds such inputs after the failed capture
and keys its programs by their values (zerojax/bridge/value_inputs.py). The same module as a
five-line stand-in runs here; the Qwen-VL models themselves run in the coverage matrix.
"""

import jax
import numpy as np
import pytest
import torch
from torch import nn

import zerojax
from zerojax.bridge import Static
from zerojax.bridge.errors import CaptureError


class SplitByGrid(nn.Module):
    """Qwen2-VL's vision attention in miniature: segments sized by an integer input's values."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, ids, x, grid):
        torch._check_tensor_all((ids >= 0).all())  # a check only: ids need no specialising
        lengths = grid[:, 0] * grid[:, 1]
        pooled = [self.proj(part).mean(0) for part in torch.split(x, lengths.tolist())]
        return torch.stack(pooled) + ids.float().mean(), torch.arange(int(grid.sum()))


def _inputs(grid):
    grid = torch.tensor(grid)
    total = int((grid[:, 0] * grid[:, 1]).sum())
    return torch.randint(0, 9, (2, 3)), torch.randn(total, 4), grid


def _check(outputs, model, ids, x, grid):
    (pooled, positions), _ = outputs
    expected_pooled, expected_positions = model(ids, x, grid)
    # Linear then mean over <= 6 rows, width 4: a few fp32 ulps.
    np.testing.assert_allclose(
        np.asarray(pooled), expected_pooled.detach().numpy(), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(positions), expected_positions.numpy())


def test_a_plain_capture_fails_on_the_host_read():
    with pytest.raises(CaptureError, match="data-dependent"):
        zerojax.bridge.capture.capture(SplitByGrid(), _inputs([[1, 2], [2, 2]]), {}, train=False)


def test_inputs_read_on_the_host_are_found_and_the_program_keyed_by_their_values():
    torch.manual_seed(0)
    model = SplitByGrid()
    ids, x, grid = _inputs([[1, 2], [2, 2]])
    converted = zerojax.convert(model, (ids, x, grid))
    assert converted.value_inputs == {"args[2]"}  # not `ids`, read only by a check

    _check(converted.apply(converted.params, converted.buffers, ids, x, grid), model, ids, x, grid)
    # New values, same shapes: a new program, traced for these values.
    ids, x, other = _inputs([[3, 1], [1, 1]])
    outputs = converted.apply(converted.params, converted.buffers, ids, x, other)
    assert len(converted._programs) == 2
    _check(outputs, model, ids, x, other)


def test_under_jit_the_value_input_is_static_and_a_tracer_is_refused():
    torch.manual_seed(0)
    model = SplitByGrid()
    ids, x, grid = _inputs([[1, 2], [2, 2]])
    converted = zerojax.convert(model, (ids, x, grid))
    with pytest.raises(TypeError, match=r"Static\(np.asarray\(args\[2\]\)\)"):
        jax.jit(converted.apply)(
            converted.params, converted.buffers, ids.numpy(), x.numpy(), grid.numpy()
        )

    outputs = jax.jit(converted.apply)(
        converted.params, converted.buffers, ids.numpy(), x.numpy(), Static(grid.numpy())
    )
    _check(outputs, model, ids, x, grid)


def test_static_arrays_compare_by_value():
    assert Static(np.array([1, 2])) == Static(np.array([1, 2]))
    assert hash(Static(np.array([1, 2]))) == hash(Static(np.array([1, 2])))
    assert Static(np.array([1, 2])) != Static(np.array([1, 3]))


def test_random_ops_on_constants_are_not_folded():
    """A random draw computed from host values must stay a random op of the program."""

    class NoiseBySize(nn.Module):
        def forward(self, x, n):
            return x[: int(n.sum())] + torch.rand(int(n.sum()), 1)

    x, n = torch.randn(5, 2), torch.tensor([1, 2])
    converted = zerojax.convert(NoiseBySize(), (x, n))
    assert converted.value_inputs == {"args[1]"}
    draws = [
        np.asarray(converted.apply({}, {}, x.numpy(), n, rng=jax.random.key(seed))[0])
        for seed in (0, 1)
    ]
    assert draws[0].shape == (3, 2) and not np.array_equal(draws[0], draws[1])


def test_a_guard_on_computed_values_is_not_blamed_on_token_ids():
    """`ids` is read (by a check), but the guard comes from float data: specialising on `ids`
    cannot help, and the error says that no input decides the value."""

    class CountsPositives(nn.Module):
        def forward(self, ids, x):
            torch._check_tensor_all((ids >= 0).all())
            return x * int((x > 0).sum())

    ids, x = torch.randint(0, 9, (2, 3)), torch.randn(2, 3)
    with pytest.raises(CaptureError) as raised:
        zerojax.convert(CountsPositives(), (ids, x))
    assert "no input decides this value" in "\n".join(raised.value.__notes__)
