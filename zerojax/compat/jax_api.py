"""jax 0.10 and 0.11: the APIs zerojax uses whose spelling differs between the two.

- Host computation (`compute_on`). jax 0.10's `jax.experimental.compute_on.compute_on(type)` is
  a context manager (usable as a decorator) that marks the jitted calls inside it; jax 0.11
  removed that form and renamed 0.10's `compute_on2` to `compute_on`: a function transform
  that names the memory space of each output (from 0.11.1; 0.11.0 still has both). Every
  release has the function form (0.10 as `compute_on2`), so zerojax uses it on all.
- The Pallas kernels' tile products. `pl.dot` is gone in jax 0.11.2 and `plgpu.dot` (Triton)
  only exists from 0.10.2; both were `lax.dot_general` with an fp32 accumulator, which is what
  the kernels call (`tile_dot`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import compute_on as _compute_on_module

# jax 0.11 has only `compute_on`, in the function form; jax 0.10 has that form as `compute_on2`.
_function_compute_on = getattr(_compute_on_module, "compute_on2", None) or (
    _compute_on_module.compute_on
)


def on_host(fn: Callable) -> Callable:
    """`fn` compiled to run on the host's CPU (XLA's host computation), as a call inside the
    enclosing jitted program; its outputs stay in host memory (`pinned_host`), where zerojax's
    offloaded optimizer state and gradients live."""
    return _function_compute_on(
        fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host
    )


def tile_dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """The product of two 2-D tiles inside a Pallas kernel, accumulated in fp32 (Triton's
    `tl.dot`), optionally with either operand transposed."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
