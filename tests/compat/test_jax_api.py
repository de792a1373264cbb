"""zerojax.compat.jax_api on the jax this venv holds: jax 0.10 in `make test`, jax 0.11 in
`make test-gpu-stack`, so each branch runs somewhere.

    .venv/bin/python -m pytest -q tests/compat/test_jax_api.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import compute_on as compute_on_module
from jax.sharding import NamedSharding, PartitionSpec

from zerojax.compat import jax_api

JAX_0_11 = tuple(int(part) for part in jax.__version__.split(".")[:2]) >= (0, 11)


def test_the_function_form_of_compute_on_is_chosen_for_this_jax():
    """jax 0.10 spells the function form `compute_on2` (its `compute_on` is a context
    manager); jax 0.11 has only `compute_on`, in the function form."""
    chosen = jax_api._function_compute_on
    if JAX_0_11:
        assert not hasattr(compute_on_module, "compute_on2")
        assert chosen is compute_on_module.compute_on
    else:
        assert chosen is compute_on_module.compute_on2


def test_on_host_computes_on_the_host_and_leaves_its_outputs_there():
    """Inside a jitted program the host computation is one call marked for the host, its
    outputs placed in pinned host memory, and the values are the device computation's."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
    x = jax.device_put(np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32), host)

    def update(x):
        return x * 0.5 + jnp.sqrt(jnp.abs(x)), x.sum()

    program = jax.jit(jax_api.on_host(update), out_shardings=(host, host))
    lowered = program.lower(x).as_text()
    assert '_xla_compute_type = "host"' in lowered
    assert '_xla_buffer_placement = "pinned_host"' in lowered
    scaled, total = program(x)
    assert scaled.sharding.memory_kind == "pinned_host"
    expected_scaled, expected_total = jax.jit(update)(
        jax.device_put(x, host.with_memory_kind("device"))
    )
    np.testing.assert_array_equal(np.asarray(scaled), np.asarray(expected_scaled))
    np.testing.assert_array_equal(np.asarray(total), np.asarray(expected_total))
