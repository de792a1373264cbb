"""Random ops draw from the explicit rng key: per site, per key, reproducible.

Values cannot match torch's generator, so these tests check the contract (shapes, dtypes,
ranges, statistics, key behaviour) instead of parity.
Run: .venv/bin/python -m pytest tests/bridge/test_random.py -q
"""

import random

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from tests.bridge.parity import Lambda
from zerojax.bridge.dtypes import from_torch


def run(fn, *args, key=0, train=True):
    converted = zerojax.convert(Lambda(fn), args, train=train)
    jax_args = [from_torch(a) for a in args]
    out, _ = jax.jit(converted.apply)({}, {}, *jax_args, rng=jax.random.key(key))
    return jax.tree.map(np.asarray, out)


def test_dropout_scales_kept_values_and_drops_about_p():
    x = torch.rand(100, 100) + 0.5
    out = run(lambda x: F.dropout(x, 0.3, training=True), x)
    dropped = out == 0
    assert abs(dropped.mean() - 0.3) < 0.03
    np.testing.assert_allclose(out[~dropped], x.numpy()[~dropped] / 0.7, rtol=1e-6)


def test_dropout_same_key_same_mask_new_key_new_mask():
    x = torch.rand(64, 64) + 0.5
    fn = lambda x: F.dropout(x, 0.5, training=True)
    np.testing.assert_array_equal(run(fn, x, key=3), run(fn, x, key=3))
    assert not np.array_equal(run(fn, x, key=3), run(fn, x, key=4))


def test_two_dropout_sites_get_different_masks():
    x = torch.rand(64, 64) + 0.5
    a, b = run(lambda x: (F.dropout(x, 0.5, training=True), F.dropout(x, 0.5, training=True)), x)
    assert not np.array_equal(a == 0, b == 0)


def test_dropout_in_eval_mode_is_identity_and_needs_no_key():
    module = torch.nn.Sequential(torch.nn.Dropout(0.5)).eval()
    x = torch.randn(8, 8)
    converted = zerojax.convert(module, (x,))
    out, _ = converted.apply({}, {}, x)
    np.testing.assert_array_equal(np.asarray(out), x.numpy())


def test_train_mode_without_key_names_the_fix():
    module = torch.nn.Sequential(torch.nn.Dropout(0.5)).train()
    x = torch.randn(8, 8)
    converted = zerojax.convert(module, (x,))
    with pytest.raises(ValueError, match=r"rng=jax\.random\.key"):
        converted.apply({}, {}, x)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_edge_rates(p):
    x = torch.rand(16, 16) + 0.5
    out = run(lambda x: F.dropout(x, p, training=True), x)
    np.testing.assert_array_equal(out, x.numpy() if p == 0.0 else np.zeros_like(out))


def test_rand_randn_statistics_and_dtype():
    u, n = run(lambda x: (torch.rand(200, 200) + x, torch.randn(200, 200) + x), torch.zeros(()))
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert abs(n.mean()) < 0.01 and abs(n.std() - 1) < 0.01


def test_rand_like_bernoulli_randint_randperm():
    x = torch.rand(50, 50)
    u, b, i, perm = run(
        lambda x: (
            torch.rand_like(x),
            torch.bernoulli(x),
            torch.randint(3, 7, (100,)),
            torch.randperm(10),
        ),
        x,
    )
    assert u.shape == (50, 50)
    assert set(np.unique(b)) <= {0.0, 1.0}
    # bernoulli(x) is 1 with probability x: the mean of (b - x) is near 0
    assert abs((b - x.numpy()).mean()) < 0.03
    assert i.min() >= 3 and i.max() < 7
    np.testing.assert_array_equal(np.sort(perm), np.arange(10))


def test_init_style_inplace_normal_is_drawn_from_the_key():
    def fn(x):
        w = torch.empty(64, 64)
        w.normal_(0.0, 0.02)
        return x + w

    out = run(fn, torch.zeros(64, 64) + 1)
    assert abs(out.mean() - 1) < 0.01 and abs(out.std() - 0.02) < 0.002


@pytest.mark.parametrize("generator", ["numpy", "python"])
def test_a_host_random_draw_while_tracing_is_named(generator, caplog):
    """numpy's or Python's generator, drawn in the forward (an augmentation drawn with numpy,
    say), is a constant of the captured program: the capture says so; torch's draws do not."""
    draw = {"numpy": lambda: float(np.random.rand()), "python": random.random}[generator]
    fn = lambda x: F.dropout(x, 0.1, training=True) * (1.0 + draw())
    with caplog.at_level("WARNING", logger="zerojax"):
        zerojax.convert(Lambda(fn), (torch.rand(4, 4),), train=True)
    name = {"numpy": "numpy's", "python": "Python's"}[generator]
    assert f"drew from {name} global random generator while it was traced" in caplog.text

    caplog.clear()
    with caplog.at_level("WARNING", logger="zerojax"):
        zerojax.convert(Lambda(lambda x: F.dropout(x, 0.1, True)), (torch.rand(4, 4),), train=True)
    assert "global random generator" not in caplog.text
