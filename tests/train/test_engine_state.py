"""The engine's one TrainState: read as `engine.state`, replaced only through `engine.load`.

Run: .venv/bin/python -m pytest -q tests/train/test_engine_state.py
Exists because the state used to be a bag of attributes that checkpoints and the optimizer
wrote from outside: `load` must refuse a state that does not fit (naming the field and
path), place what it accepts on the plan's shardings, and be the path checkpoints and
`optimizer.load_state_dict` take.
"""

import dataclasses

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP
from zerojax.train.state import TrainState

pytestmark = pytest.mark.multidevice

CONFIG = {
    "mesh": {"data": 8},
    "zero_stage": 3,
    "precision": "params=bfloat16,compute=bfloat16,master=float32",
}


@pytest.fixture
def trained():
    torch.manual_seed(0)
    module = MLP()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    model, optimizer = zerojax.initialize(module, optimizer, config=CONFIG, seed=0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    return model, optimizer


def test_state_is_a_frozen_pytree_with_the_counters(trained):
    model, _ = trained
    state = model.engine.state
    assert isinstance(state, TrainState)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.params = {}
    with pytest.raises(AttributeError):
        model.engine.params = {}  # read-only views; writes go through load
    assert (state.num_calls, state.micro_step, state.step, state.skipped_steps) == (1, 1, 1, 0)
    assert state.grads is not None and state.opt_state["exp_avg"].keys() == state.master.keys()
    # weights: the master copy where the policy keeps one (fp32), never the bf16 params.
    assert {str(w.dtype) for w in state.weights.values()} == {"float32"}
    leaves = jax.tree.leaves(state)
    assert sum(isinstance(x, jax.Array) for x in leaves) > len(state.params) * 3


def test_load_places_host_arrays_on_the_plan(trained):
    model, _ = trained
    engine = model.engine
    state = engine.state
    host = jax.tree.map(np.asarray, state.replace(rng=None))  # numpy everywhere
    engine.load(host.replace(rng=state.rng, num_calls=5))
    loaded = engine.state
    assert loaded.num_calls == 5
    for name, array in loaded.params.items():
        assert array.sharding.is_equivalent_to(engine.plan.params[name], array.ndim), name
        np.testing.assert_array_equal(np.asarray(array), host.params[name])
    for name, array in loaded.master.items():
        assert array.sharding.is_equivalent_to(engine.plan.master_weights[name], array.ndim)
    for name, array in loaded.opt_state["exp_avg"].items():
        assert array.sharding.is_equivalent_to(engine.plan.opt_state[name], array.ndim), name
    for name, array in loaded.grads.items():
        assert array.sharding.is_equivalent_to(engine.plan.grads[name], array.ndim), name


def test_load_refuses_what_does_not_fit(trained):
    model, _ = trained
    engine = model.engine
    state = engine.state
    wrong_shape = {**state.params, "fc1.weight": np.zeros((3, 3), np.float32)}
    with pytest.raises(ValueError, match=r"state.params\['fc1.weight'\]: .*\(3, 3\), the engine"):
        engine.load(state.replace(params=wrong_shape))
    wrong_dtype = {n: np.asarray(a, np.float32) for n, a in state.params.items()}
    with pytest.raises(ValueError, match=r"state.params\['fc1.bias'\]: float32 .* holds bfloat16"):
        engine.load(state.replace(params=wrong_dtype))
    missing = {n: a for n, a in state.master.items() if n != "head.bias"}
    with pytest.raises(
        ValueError, match=r"state.master does not have .*missing \[\"\['head.bias'\]"
    ):
        engine.load(state.replace(master=missing))
    with pytest.raises(ValueError, match=r"state.grads: \['nope'\] are not float parameters"):
        engine.load(state.replace(grads={"nope": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match="state.rng must be a jax.random.key"):
        engine.load(state.replace(rng=np.zeros(2, np.uint32)))
    with pytest.raises(ValueError, match="state.micro_step must be a non-negative int"):
        engine.load(state.replace(micro_step=-1))
    with pytest.raises(TypeError, match="takes a TrainState"):
        engine.load({"params": state.params})
    assert engine.state is state  # nothing was changed by the refused loads


def test_optimizer_state_dict_round_trip_goes_through_load(trained):
    model, optimizer = trained
    saved = optimizer.state_dict()
    before = jax.tree.map(np.asarray, model.engine.state.opt_state)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.load_state_dict(saved)
    after = model.engine.state.opt_state
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, after), before)
    plan = model.engine.plan
    for name, array in after["exp_avg_sq"].items():
        assert array.sharding.is_equivalent_to(plan.opt_state[name], array.ndim), name
