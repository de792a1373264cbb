"""torch <-> JAX dtype mapping and torch's type-promotion rules, evaluated on JAX values.

JAX runs with 32-bit defaults unless `jax_enable_x64` is set, so torch's int64/float64 map to
the widest dtype JAX currently allows (int64 -> int32, float64 -> float32). Token ids and
indices, the common int64 tensors, fit in int32 for every realistic vocabulary and shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

_TORCH_TO_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.uint16: np.uint16,
    torch.uint32: np.uint32,
    torch.uint64: np.uint64,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
}
_NUMPY_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_NUMPY.items()}


def to_jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype that holds values of torch `dtype` (64-bit types narrowed without x64)."""
    try:
        np_dtype = _TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise TypeError(f"zerojax has no JAX dtype for torch dtype {dtype}") from None
    return jax.dtypes.canonicalize_dtype(np_dtype)


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a JAX/numpy dtype."""
    try:
        return _NUMPY_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"zerojax has no torch dtype for JAX dtype {dtype}") from None


def _promotion_operand(x):
    """A stand-in torch value with the dtype and dimensionality that decide promotion."""
    if isinstance(x, (bool, int, float, complex)):
        return x
    shape = (1,) if np.ndim(x) > 0 else ()
    return torch.empty(shape, dtype=to_torch_dtype(jnp.result_type(x)))


def result_type(*operands) -> np.dtype:
    """torch.result_type over JAX arrays and Python scalars (0-d tensors count as scalars).

    Differs from jnp.result_type: int tensor + float scalar -> default float, bool + int scalar ->
    int64, 0-d float tensor + int tensor -> float, as torch does.
    """
    result = _promotion_operand(operands[0])
    for other in operands[1:]:
        # torch.result_type takes two operands; fold them pairwise, keeping scalar-ness.
        dtype = torch.result_type(result, _promotion_operand(other))
        keep_dim = any(
            not isinstance(o, (bool, int, float, complex)) and np.ndim(o) > 0
            for o in (result, other)
        )
        result = torch.empty((1,) if keep_dim else (), dtype=dtype)
    if isinstance(result, (bool, int, float, complex)):
        result = torch.tensor(result)
    return to_jax_dtype(result.dtype)


def is_floating(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def is_integer(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def is_bool(dtype) -> bool:
    return np.dtype(dtype) == np.bool_


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """The values of a (CPU) torch tensor as a numpy array of their JAX dtype (`to_jax_dtype`),
    a copy of its own; bf16 goes through its bit pattern.

    The cast (int64 -> int32 without x64) and the copy are numpy's, on the host: JAX's
    `jnp.array(x, dtype, copy=True)` does both as a compiled `convert_element_type`, one XLA
    compilation for every new shape and dtype, so each new input length of a run with varying
    shapes compiled a helper program beside its step program. A copy: on CPU, a JAX array may
    alias the numpy buffer it was made from, which torch can later change in place (an
    optimizer step, BatchNorm statistics), silently changing the JAX array too."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        array = tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        array = tensor.contiguous().numpy()
    return np.array(array, dtype=to_jax_dtype(tensor.dtype), copy=True)


def from_torch(tensor: torch.Tensor) -> jax.Array:
    """A JAX array with the values of a (CPU) torch tensor (`host_array`), on the default
    device: a transfer, no compiled program."""
    return jax.device_put(host_array(tensor))


def to_torch(array) -> torch.Tensor:
    """A torch tensor with the values of a JAX array (host copy)."""
    array = np.asarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())
