"""The engine's placement strategy, chosen once (`zerojax.parallel.placement`).

Run: `.venv/bin/python -m pytest -q tests/parallel/test_placement.py -p no:cacheprovider`.
Why: the engine and the torch front end no longer ask whether they are abstract or how many
processes feed them; they call one `Placement`. These tests pin what each kind does with the
state, inputs and cotangents in this process (the many-process kind runs in the torchrun jobs
of `make test-distributed`), and that an abstract engine reads no value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

from zerojax.config import load_config
from zerojax.parallel.placement import (
    Abstract,
    ManyProcesses,
    SingleProcess,
    placement_kind,
)
from zerojax.sharding import make_mesh
from zerojax.train.engine import Engine

pytestmark = pytest.mark.multidevice


def _engine(module: nn.Module, **kwargs) -> Engine:
    config = load_config({"mesh": {"data": 8}, "zero_stage": 3})
    return Engine(module, config, seed=0, mesh=make_mesh(config), **kwargs)


def test_the_kind_is_chosen_once_from_abstract_and_the_process_count():
    assert jax.process_count() == 1
    assert placement_kind(abstract=True) is Abstract
    assert placement_kind(abstract=False) is SingleProcess
    assert ManyProcesses.num_processes == 1  # a class default; an instance counts the job's


def test_an_abstract_engine_holds_shapes_on_the_plan_shardings():
    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32))
    engine = _engine(module, abstract=True)
    assert isinstance(engine.placement, Abstract)
    for name, struct in engine.state.params.items():
        assert isinstance(struct, jax.ShapeDtypeStruct)
        assert struct.sharding == engine.plan.params[name]
    assert all(isinstance(b, jax.ShapeDtypeStruct) for b in engine.state.buffers.values())
    engine.attach_optimizer(torch.optim.AdamW(module.parameters(), lr=1e-3))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(engine.opt_state))

    placement = engine.placement
    x = placement.shard_input(placement.value_of(torch.empty(8, 16, device="meta")))
    assert (x.shape, x.dtype, x.sharding) == ((8, 16), jnp.float32, engine.plan.input_sharding(2))
    like = jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=engine.replicated)
    assert placement.filled(like, 1) is like
    assert placement.all_finite(jnp.bool_(False))  # no value read: the update is planned
    with pytest.raises(TypeError, match="abstract engine"):
        placement.outputs_to_torch([like], (), None)


def test_one_process_places_copies_and_replicates_an_uneven_batch(caplog):
    module = nn.Linear(16, 4)
    engine = _engine(module)
    placement = engine.placement
    assert isinstance(placement, SingleProcess) and placement.num_processes == 1
    weight = engine.state.params["weight"]
    assert isinstance(weight, jax.Array) and weight.sharding == engine.plan.params["weight"]
    np.testing.assert_array_equal(np.asarray(weight), module.weight.detach().numpy())

    even = placement.shard_input(jnp.ones((8, 16)))
    assert even.sharding.is_equivalent_to(engine.plan.input_sharding(2), 2)
    uneven = placement.shard_input(jnp.ones((6, 16)))
    assert uneven.sharding.is_fully_replicated
    assert "dim 0 (size 6) does not split over data=8" in caplog.text

    spec = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    np.testing.assert_array_equal(placement.cotangent(spec, None, None), np.zeros((8, 4)))
    grad = torch.full((8, 4), 2.0, dtype=torch.float64)
    cotangent = placement.cotangent(spec, grad, None)
    assert cotangent.dtype == jnp.float32 and float(cotangent[0, 0]) == 2.0
    ints = jax.ShapeDtypeStruct((8,), jnp.int32)
    assert placement.cotangent(ints, torch.ones(8), None).dtype == jnp.int32
    assert placement.global_rows([even]) is None
    assert placement.loss_share({"num_items_in_batch": 3}) == 1.0
