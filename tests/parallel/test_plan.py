"""The parallel plan: which parallelism a run uses, decided once from the config and the mesh.

Run: .venv/bin/python -m pytest -q tests/parallel/test_plan.py
Exists because every parallelism decision (ZeRO axes, batch placement, sequence and expert
parallelism, offload) lives in `zerojax.parallel.plan`: these tests pin each rule there, and
that the ZeRO plan shards over exactly the axes the parallel plan gives it.
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from zerojax.config import load_config
from zerojax.parallel import ExpertLoadLog, ExpertParallel, ParallelPlan, make_parallel_plan
from zerojax.sharding import make_mesh, make_sharding_plan

pytestmark = pytest.mark.multidevice


def plan_for(raw: dict) -> ParallelPlan:
    config = load_config(raw, num_devices=8)
    return make_parallel_plan(config, make_mesh(config))


def test_data_parallel_run_splits_the_batch_and_zero_over_the_data_axes():
    plan = plan_for({"mesh": {"data": 4, "tensor": 2}, "zero_stage": 3})
    assert (plan.data_parallel_axes, plan.zero_axes, plan.batch_axes) == (
        ("data",),
        ("data",),
        ("data",),
    )
    assert plan.sequence is None and plan.experts is None and plan.offloaded == ()
    assert plan.input_sharding(2).spec == P("data", None)
    assert plan.kernel_batch == (plan.mesh, ("data",))


def test_sequence_axis_joins_the_zero_axes_but_not_the_batch_axes():
    """DeepSpeed-Ulysses' layout: ZeRO over data x sequence, the batch over data only."""
    plan = plan_for(
        {"mesh": {"data": 2, "sequence": 4}, "sequence_parallel": {"attention": "ring"}}
    )
    assert plan.zero_axes == ("data", "sequence")
    assert plan.batch_axes == ("data",)
    assert plan.input_sharding(2).spec == P("data", "sequence")
    sequence = plan.sequence
    assert (sequence.axis, sequence.attention, sequence.batch_axes) == (
        "sequence",
        "ring",
        ("data",),
    )


def test_axes_of_size_one_split_nothing():
    plan = plan_for(
        {"mesh": {"data": 8, "sequence": 1, "expert": 1}, "sequence_parallel": {}, "zero_stage": 1}
    )
    assert plan.zero_axes == ("data",)
    assert plan.sequence is None and plan.experts is None


def test_no_batch_split_means_kernels_run_on_whole_arrays():
    plan = plan_for({"mesh": {"tensor": 8}})
    assert plan.batch_axes == () and plan.kernel_batch is None
    assert plan.input_sharding(3).spec == P(None, None, None)


def test_expert_axis_splits_the_experts_and_the_routed_rows_with_the_batch():
    log = ExpertLoadLog()
    config = load_config(
        {"mesh": {"data": 2, "expert": 4}, "moe": {"capacity_factor": 1.5}}, num_devices=8
    )
    plan = make_parallel_plan(config, make_mesh(config), expert_load_log=log)
    assert plan.batch_axes == ("data", "expert")
    assert plan.experts == ExpertParallel(
        mesh=plan.mesh, expert_axes=("expert",), row_axes=("data", "expert"), capacity_factor=1.5
    )
    assert plan.experts.load_log is log
    assert plan.kernel_batch == (plan.mesh, ("data", "expert"))


def test_offloaded_components_are_the_offload_sections_host_entries():
    plan = plan_for({"mesh": {"data": 8}, "zero_stage": 2, "offload": {"optimizer": "host"}})
    assert plan.offloaded == ("opt_state",)


def test_zero_plan_shards_over_exactly_the_parallel_plans_axes():
    config = load_config({"mesh": {"data": 2, "sequence": 4}, "zero_stage": 3}, num_devices=8)
    mesh = make_mesh(config)
    params = {"w": jax.ShapeDtypeStruct((64, 8), "float32")}
    default = make_sharding_plan(params, config, mesh)
    assert default.parallel == make_parallel_plan(config, mesh)
    assert default.params["w"].spec == P("data", None)
    # The same config, told to shard over data x sequence (as sequence parallelism does).
    parallel = ParallelPlan(mesh=mesh, zero_axes=("data", "sequence"), batch_axes=("data",))
    plan = make_sharding_plan(params, config, parallel=parallel)
    assert plan.parallel is parallel and plan.mesh is mesh
    assert plan.params["w"].spec == P(("data", "sequence"), None)
    assert plan.data_parallel_axes == ("data", "sequence")


def test_zero_plan_refuses_a_parallel_plan_on_another_mesh():
    config = load_config({"mesh": {"data": 8}}, num_devices=8)
    other = jax.make_mesh((8,), ("data",), devices=jax.devices()[::-1])
    with pytest.raises(ValueError, match="the parallel plan's mesh"):
        make_sharding_plan({}, config, make_mesh(config), parallel=ParallelPlan(mesh=other))
