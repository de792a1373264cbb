"""Lowerings: graph bookkeeping — runtime asserts, size queries, scalar reads.

zerojax traces one program per input shape, so sizes and strides are plain integers here.
"""

import numpy as np
import torch

from zerojax.bridge.registry import lowering

aten = torch.ops.aten


@lowering(aten._assert_tensor_metadata.default)
def lower_assert_tensor_metadata(ctx, a, size=None, stride=None, dtype=None, **_placement):
    """Export's check of an input's metadata; shapes are static here, so it holds by tracing."""
    return


@lowering(aten._assert_scalar.default)
def lower_assert_scalar(ctx, self, assert_msg):
    return None


@lowering(aten.sym_constrain_range_for_size.default)
def lower_sym_constrain_range_for_size(ctx, size, *, min=None, max=None):
    return None


@lowering(aten.sym_size.int)
def lower_sym_size_int(ctx, self, dim):
    return int(self.shape[dim])


@lowering(aten.sym_numel.default)
def lower_sym_numel(ctx, self):
    return int(np.prod(self.shape, dtype=np.int64))


@lowering(aten.sym_stride.int)
def lower_sym_stride_int(ctx, self, dim):
    """Strides of the contiguous layout: JAX values have no other."""
    dim = dim % max(len(self.shape), 1)
    return int(np.prod(self.shape[dim + 1 :], dtype=np.int64))


@lowering(aten.sym_storage_offset.default)
def lower_sym_storage_offset(ctx, self):
    return 0


@lowering(aten._local_scalar_dense.default)
def lower_local_scalar_dense(ctx, self):
    """`tensor.item()`: only a concrete value can become a Python scalar.

    Under jax.jit the value is a tracer; a data-dependent Python value cannot exist in a
    compiled program, so this raises there with the reason.
    """
    try:
        return np.asarray(self).item()
    except Exception as error:  # jax raises TracerArrayConversionError under jit
        raise ValueError(
            "tensor.item() reads a value computed inside the model; inside a compiled "
            "(jitted) program that value is not known until run time. Keep it a tensor "
            "(e.g. use torch.where instead of Python `if`)"
        ) from error


@lowering(aten.sym_is_contiguous.default)
def lower_sym_is_contiguous(ctx, self, memory_format=torch.contiguous_format):
    """JAX values have one (contiguous) layout."""
    return True


@lowering(aten._assert_async.default, aten._assert_async.msg)
def lower_assert_async(ctx, self, assert_msg=None):
    """torch's runtime check that `self` is nonzero (torch._assert on a tensor).

    The value is only known when the compiled program runs, and a jitted XLA program cannot
    raise, so the check is dropped: the converted function does not enforce it.
    """
    return
