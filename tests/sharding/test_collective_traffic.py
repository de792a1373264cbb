"""All-to-all bytes per mesh axis from compiled HLO, and flat vs hierarchical MoE dispatch.

Run: `.venv/bin/python -m pytest -q tests/sharding/test_collective_traffic.py` (8 simulated
devices from tests/conftest.py)

`zerojax.sharding.collective_traffic` charges each chunk an all-to-all sends to the outermost
mesh axis on which sender and receiver differ. The first tests check it against all-to-alls
whose traffic is known by construction (both HLO forms, both replica-group notations); the last
is issue 12's bar: on `node: 2 x local: 4`, the hand-written 2-layer, 16-expert, top-2 MoE of
bench/moe.py trains to the same loss and gradients with flat and hierarchical dispatch, and the
hierarchical form's inter-node bytes are at most 1/local-size of the flat form's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch.nn.functional as F
from jax.sharding import AxisType, PartitionSpec

from bench.moe import LOCAL, NODES, dispatch_traffic, moe_bench_model
from tests.bridge.test_models import relative_error
from zerojax.sharding.collective_traffic import all_to_all_bytes_per_axis

pytestmark = pytest.mark.multidevice


def _mesh():
    return jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize(
    ("axes", "expected_chunks"),
    [
        (("node", "local"), {"node": 4, "local": 3}),  # 4 peers on the other node, 3 on mine
        ("node", {"node": 1, "local": 0}),
        ("local", {"node": 0, "local": 3}),
    ],
    ids=["both-axes", "node", "local"],
)
def test_bytes_per_axis_of_a_known_all_to_all(axes, expected_chunks):
    mesh = _mesh()
    members = 8 if axes == ("node", "local") else mesh.shape[axes]
    rows_per_chunk, width = 3, 5  # f32: one chunk is 60 bytes

    def exchange(x):
        return jax.lax.all_to_all(x, axes, 0, 0, tiled=True)

    program = jax.jit(
        jax.shard_map(
            exchange,
            mesh=mesh,
            in_specs=PartitionSpec(("node", "local")),
            out_specs=PartitionSpec(("node", "local")),
        )
    )
    x = jnp.zeros((8 * members * rows_per_chunk, width), jnp.float32)
    traffic = all_to_all_bytes_per_axis(program.lower(x).compile().as_text(), mesh)
    chunk = rows_per_chunk * width * 4
    assert traffic == {axis: n * chunk for axis, n in expected_chunks.items()}


@pytest.mark.parametrize(
    "line",
    [
        # Array form, split along dim 0, iota groups: {0,4},{1,5},{2,6},{3,7} (the node axis).
        (
            "%a = f32[8,10]{1,0} all-to-all(f32[8,10]{1,0} %x), channel_id=1, "
            "replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}"
        ),
        # Tuple form, listed groups.
        (
            "%a = (f32[4,10]{1,0}, /*index=1*/f32[4,10]{1,0}) all-to-all(%x, %y), channel_id=1, "
            "replica_groups={{0,4},{1,5},{2,6},{3,7}}"
        ),
    ],
    ids=["array-iota", "tuple-listed"],
)
def test_both_hlo_forms_and_group_notations_parse(line):
    # Each device sends one chunk of 4 x 10 f32 (160 bytes) to its peer on the other node.
    assert all_to_all_bytes_per_axis(line, _mesh()) == {"node": 160.0, "local": 0.0}


def test_an_unreadable_all_to_all_is_named():
    line = "%a = c64[8]{0} all-to-all(c64[8]{0} %x), replica_groups={{0,1}}, dimensions={0}"
    with pytest.raises(ValueError, match="element type 'c64'"):
        all_to_all_bytes_per_axis(line, _mesh())


# Flat and hierarchical dispatch multiply every row by the same expert weights in the same
# order; only where rows wait in between differs, and XLA may block the GEMMs differently per
# buffer size: fp32 reorder bounds as tests/bridge/test_expert_parallel.py's DOT_RTOL, through
# 2 layers and a softmax, a few times 1e-6. Gradients sum over up to ~300 rows per expert:
# 2 * 300 * 1.2e-7 = 7e-5 normwise at worst.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def test_hierarchical_dispatch_crosses_nodes_with_a_local_size_fraction_of_flat_bytes():
    flat_loss, flat_grads, flat, _ = dispatch_traffic(hierarchical=False, quick=True)
    hier_loss, hier_grads, hier, _ = dispatch_traffic(hierarchical=True, quick=True)

    # The same training step: against torch on one device, and flat against hierarchical.
    model, tokens, targets = moe_bench_model(quick=True)
    expected = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    assert relative_error(flat_loss, expected.detach().numpy()) <= LOSS_RTOL
    assert relative_error(hier_loss, flat_loss) <= LOSS_RTOL
    for name in flat_grads:
        assert relative_error(hier_grads[name], flat_grads[name]) <= GRAD_RTOL, name

    # Analytic, dropless buffers: flat sends R rows to each of the (nodes - 1) x local devices
    # on other nodes, hierarchical R rows to the one same-local peer on each other node.
    assert flat["node"] > 0 and hier["node"] > 0
    assert hier["node"] <= flat["node"] / LOCAL
    assert hier["node"] / flat["node"] == pytest.approx((NODES - 1) / ((NODES - 1) * LOCAL))
    # The fan-out moved onto the fast axis instead.
    assert hier["local"] > flat["local"]
