"""Expert parallelism: dispatch / local experts / combine, against the grouped GEMM run whole.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_expert_parallel.py` (8 simulated devices
from tests/conftest.py; add `-m slow` for Qwen2-MoE)

`zerojax.parallel.expert_parallel` splits the experts over the mesh's `expert` axis and moves each
routed row to its expert's device and back with all-to-alls. These tests check the sharded
grouped GEMM equals `ragged_dot` on one device (values and both gradients), that capacity mode
drops exactly the rows it counts, that a bad expert count is refused by name, and that HF
Mixtral and Qwen MoE models train through `zerojax.initialize` on `mesh: {data: 2, expert: 4}`
like torch on one device, with the all-to-alls in the compiled step.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import zerojax
from tests.bridge.test_models import relative_error
from tests.bridge.test_moe import EXPERTS, SEQ, VOCAB, mixtral, qwen2_moe, qwen3_moe
from zerojax.parallel.expert_parallel import (
    ExpertParallel,
    expert_parallel_ragged_dot,
    expert_parallel_ragged_dot_and_drops,
)

pytestmark = pytest.mark.multidevice

# fp32 dot products of length K = 16 on O(1) values. Sharded and whole runs compute each output
# row as the same K-term dot product, but XLA may block the two GEMMs differently: the sums'
# reorder bound is 2 K eps32 |A||B| / |AB| ~ 2 * 16 * 1.2e-7 * sqrt(16) = 1.5e-5 normwise at
# worst, typically sqrt(K) smaller. Gradients of the weight sum over all rows of a group (up to
# ~100 terms): 2 * 100 * 1.2e-7 = 2.4e-5. 3e-5 bounds both.
DOT_RTOL = 3e-5
E, K, N = 8, 16, 24


def _mesh(shape=(2, 4), names=("data", "expert")):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _routed(rows=100, routed=90, seed=0):
    """x (rows, K), w (E, K, N), cumulative group ends of `routed` rows sorted by expert
    uniformly at random; rows past `routed` belong to no expert (as transformers' padding)."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, E, routed))
    ends = np.cumsum(np.bincount(ids, minlength=E)).astype(np.int32)
    x = rng.standard_normal((rows, K)).astype(np.float32)
    w = rng.standard_normal((E, K, N)).astype(np.float32)
    return x, w, ends


def _whole(x, w, ends):
    return jax.lax.ragged_dot(x, w, jnp.diff(ends, prepend=0))


def _placement(capacity_factor=None):
    return ExpertParallel(
        mesh=_mesh(),
        expert_axes=("expert",),
        row_axes=("data", "expert"),
        capacity_factor=capacity_factor,
    )


def test_expert_parallel_ragged_dot_matches_ragged_dot_values_and_gradients():
    x, w, ends = _routed()
    placement = _placement()

    def sharded(x, w):
        return expert_parallel_ragged_dot(placement, x, w, jnp.asarray(ends), where="test")

    np.testing.assert_array_equal(np.asarray(sharded(x, w))[90:], 0)  # unrouted rows
    assert relative_error(jax.jit(sharded)(x, w), _whole(x, w, ends)) <= DOT_RTOL

    cotangent = np.random.default_rng(1).standard_normal((x.shape[0], N)).astype(np.float32)
    loss = lambda f: lambda x, w: (f(x, w) * cotangent).sum()
    grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1)))(x, w)
    expected = jax.grad(loss(lambda x, w: _whole(x, w, ends)), argnums=(0, 1))(x, w)
    for name, got, want in zip(("input", "weight"), grads, expected, strict=True):
        assert relative_error(got, want) <= DOT_RTOL, name

    # Dispatch and combine, forward and backward: four all-to-alls, no all-gather of weights.
    compiled = jax.jit(jax.grad(loss(sharded), argnums=(0, 1))).lower(x, w).compile()
    assert compiled.as_text().count("all-to-all(") == 4


@pytest.mark.parametrize("capacity_factor", [0.25, 0.5, 1.0, 2.0])
def test_capacity_mode_drops_exactly_the_rows_it_counts(capacity_factor):
    """A dropped row's output is zero; every other routed row equals the whole GEMM's."""
    x, w, ends = _routed()
    placement = _placement(capacity_factor)
    got, counted = jax.jit(
        lambda x, w: expert_parallel_ragged_dot_and_drops(placement, x, w, ends, where="t")
    )(x, w)
    got = np.asarray(got)
    expected = np.asarray(_whole(x, w, ends))
    zero = ~got.any(axis=1)[:90]
    assert int(counted) == int(zero.sum())
    kept = np.flatnonzero(~zero)
    assert relative_error(got[kept], expected[kept]) <= DOT_RTOL
    if capacity_factor >= 2.0:  # 12-13 rows per device, capacity 7 per peer: nothing dropped
        assert counted == 0
    if capacity_factor <= 0.5:
        assert counted > 0


def test_expert_count_not_divisible_by_the_expert_axis_is_refused_by_name():
    x, w, ends = _routed()
    w6 = w[:6]
    with pytest.raises(ValueError, match=r"6 experts do not split over mesh axis expert=4 "):
        expert_parallel_ragged_dot(_placement(), x, w6, ends[:6], where="layers.0.experts")


# --- HF MoE models through zerojax.initialize ------------------------------------------------

# Both sides run fp32; the sharded step differs from torch's single-device step only in
# reduction order (XLA's blocking, the data-parallel gradient sum over 8 shards), ~1e-7
# relative per step as in tests/bridge/test_moe.py's TRAIN_RTOL, whose argument carries over:
# Adam's normalised update keeps a relative gradient difference from growing across steps,
# and a top-2 routing flip would need two router logits within ~1e-7. 1e-5 is the bar.
TRAIN_RTOL = 1e-5
STEPS = 4
EP_CONFIG = {"mesh": {"data": 2, "expert": 4}, "rules": ["expert"]}


def _train_like_torch(module, config, steps=STEPS):
    """(our losses, torch's losses, compiled step text) after `steps` AdamW steps on one batch.

    The loss is the model's own (`labels=`), which includes the router's load-balancing term
    (`output_router_logits=True`)."""
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model, optimizer = zerojax.initialize(module, optimizer, config)
    tokens = torch.randint(0, VOCAB, (8, SEQ))  # one sequence per device
    ours, theirs, aux = [], [], []
    for _ in range(steps):
        for m, opt, losses in ((model, optimizer, ours), (reference, ref_optimizer, theirs)):
            out = m(input_ids=tokens, labels=tokens)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
            aux.append(out.aux_loss.item())
    step = model.engine.compiled_programs()["loss_and_grads"].as_text()
    return ours, theirs, (aux[0::2], aux[1::2]), step, model.engine


def _check_parity(ours, theirs, aux):
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= TRAIN_RTOL * abs(b), f"step {step}: loss {a} vs torch {b}"
    for step, (a, b) in enumerate(zip(*aux, strict=True)):
        assert abs(a - b) <= TRAIN_RTOL * abs(b), f"step {step}: aux loss {a} vs torch {b}"
    assert theirs[-1] < theirs[0]  # it trains at all


QWEN = {"qwen2-moe": qwen2_moe, "qwen3-moe": qwen3_moe}


@pytest.mark.parametrize(
    "name",
    [
        "mixtral",
        "qwen3-moe",
        pytest.param("qwen2-moe", marks=pytest.mark.slow),  # ~20 s; its shared expert is dense
    ],
)
@pytest.mark.long
def test_hf_moe_trains_expert_parallel_like_torch_on_one_device(name):
    torch.manual_seed(0)
    if name == "mixtral":
        module = mixtral(output_router_logits=True)
    else:
        module = QWEN[name]()
        module.config.output_router_logits = True
    ours, theirs, aux, step, engine = _train_like_torch(module, EP_CONFIG)
    _check_parity(ours, theirs, aux)
    # Dispatch and combine of both grouped GEMMs of both MoE layers, forward and backward.
    assert step.count("all-to-all(") >= 2 * 2 * 2 * 2, step.count("all-to-all(")
    experts = [n for n in engine.plan.params if ".experts." in n]
    assert experts and all(engine.plan.params[n].spec[0] == "expert" for n in experts)
    assert engine.plan.batch_axes == ("data", "expert")
    # The load histogram: each grouped GEMM (up and down, 2 layers) saw all 8 x 8 tokens x
    # top-2 pairs, none dropped.
    stats = engine.moe_stats()
    assert len(stats) == 4, sorted(stats)
    for site, routed in stats.items():
        assert routed["rows_per_expert"].shape == (4,), site
        assert routed["rows_per_expert"].sum() == 8 * SEQ * 2 and routed["dropped"] == 0, site


@pytest.mark.long
def test_expert_parallel_composes_with_zero3():
    """ZeRO-3 shards the experts' other dims over `data` and everything else over data x
    expert; the step gathers them where they are used and must still train like torch."""
    torch.manual_seed(0)
    config = {**EP_CONFIG, "zero": {"stage": 3}}
    ours, theirs, aux, step, engine = _train_like_torch(mixtral(output_router_logits=True), config)
    _check_parity(ours, theirs, aux)
    assert step.count("all-to-all(") >= 16
    specs = {n: engine.plan.params[n].spec for n in engine.plan.params}
    assert specs["model.layers.0.mlp.experts.gate_up_proj"] == P("expert", "data", None)
    assert specs["model.embed_tokens.weight"] == P(("data", "expert"), None)


@pytest.mark.long
def test_capacity_mode_reports_dropped_tokens_through_the_engine():
    torch.manual_seed(0)
    module = mixtral(output_router_logits=True)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    config = {**EP_CONFIG, "moe": {"capacity_factor": 0.5}}
    model, optimizer = zerojax.initialize(module, optimizer, config)
    tokens = torch.randint(0, VOCAB, (8, SEQ))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    assert np.isfinite(loss.item())
    stats = model.engine.moe_stats()
    assert len(stats) == 4
    # Half the balanced share per peer: at least half of the 128 pairs cannot be sent.
    for site, routed in stats.items():
        assert routed["rows_per_expert"].sum() == 8 * SEQ * 2, site
        assert 64 <= routed["dropped"] < 128, (site, routed["dropped"])


@pytest.mark.long
def test_checkpoint_restores_onto_another_expert_axis_size(tmp_path):
    """Experts saved from `expert: 4` restore onto `expert: 2` (each device now owns 2 of the
    4 experts, their optimizer moments with them) bitwise, and training goes on like torch's:
    the restored run's losses meet the same bar as an uninterrupted one (TRAIN_RTOL)."""
    from zerojax.ckpt.checkpointer import Checkpointer

    torch.manual_seed(0)
    module = mixtral(output_router_logits=True)
    reference = copy.deepcopy(module)
    fresh = copy.deepcopy(module)  # another run's start: every value comes from the checkpoint
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    tokens = torch.randint(0, VOCAB, (8, SEQ))

    def steps(model, optimizer, count):
        losses = []
        for _ in range(count):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    theirs = steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), STEPS)
    model, optimizer = zerojax.initialize(
        module, torch.optim.AdamW(module.parameters(), lr=1e-2), EP_CONFIG
    )
    ours = steps(model, optimizer, STEPS // 2)
    with Checkpointer(tmp_path / "ckpt", model, optimizer) as ckpt:
        ckpt.save(STEPS // 2, force=True)
    saved = {n: np.asarray(a) for n, a in model.engine.params.items()}

    narrower = {**EP_CONFIG, "mesh": {"data": 4, "expert": 2}}
    model, optimizer = zerojax.initialize(
        fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), narrower
    )
    with Checkpointer(tmp_path / "ckpt", model, optimizer) as ckpt:
        ckpt.restore()
    engine = model.engine
    assert dict(engine.mesh.shape) == {"data": 4, "expert": 2}
    for name, array in engine.params.items():
        np.testing.assert_array_equal(np.asarray(array), saved[name], err_msg=name)
        assert array.sharding == engine.plan.params[name], name
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert engine.params[experts].sharding.spec[0] == "expert"
    assert engine.params[experts].addressable_shards[0].data.shape[0] == EXPERTS // 2
    ours += steps(model, optimizer, STEPS - STEPS // 2)
    _check_parity(ours, theirs, ((), ()))
