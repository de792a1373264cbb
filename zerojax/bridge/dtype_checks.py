"""Operand dtypes torch refuses: refused here too, with torch's message.

torch's CPU kernels for matrix products, convolution and attention refuse operands of different
dtypes (a float64, float16, int64 or bool input to a float32 `nn.Linear`: `RuntimeError: mat1 and
mat2 must have the same dtype, but got Double and Float`). Their meta kernels do not check, so
torch.export captures such a graph, and the lowerings, which promote, would compute it in
float32 without a word. `check_operand_dtypes` walks a captured graph once per precision and
raises torch's error (type and first line, torch 2.13's CPU messages) for the first product
whose operands torch would refuse, naming the op and the module path.

Under a compute-dtype policy (`float_dtype`, zerojax's bf16/fp16 compute, which stands in for
torch autocast) the rule is autocast's: float16, bfloat16 and float32 operands are cast to the
compute dtype and so accepted together; float64 and non-float operands are not cast by
autocast, and torch then reports the other operand in the autocast dtype ("... but got Double
and BFloat16").

float64 inputs reach JAX as float32 (no x64), so a program captured for float32 would serve them
unchecked: `Converted.check_input_dtypes` captures the model once more with the inputs' real
torch dtypes and checks that graph (the program that runs stays the float32 one).
"""

from __future__ import annotations

import numpy as np
import torch

from zerojax.bridge.errors import node_location

aten = torch.ops.aten

# torch's ScalarType names (Python-side messages) and its C++ type names (kernel messages).
_SCALAR_NAMES = {
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float32: "Float",
    torch.float64: "Double",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}
_CPP_NAMES = {
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
    torch.float32: "float",
    torch.float64: "double",
    torch.int64: "long int",
    torch.int32: "int",
    torch.int16: "short int",
    torch.int8: "signed char",
    torch.uint8: "unsigned char",
    torch.bool: "bool",
    torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}
# What autocast casts to its dtype (torch.autocast's "lower precision fp" ops' inputs).
_AUTOCAST_CASTS = frozenset({torch.float16, torch.bfloat16, torch.float32})


def _name(dtype: torch.dtype) -> str:
    return _SCALAR_NAMES.get(dtype, str(dtype))


def _cpp(dtype: torch.dtype) -> str:
    return _CPP_NAMES.get(dtype, str(dtype))


def _mm(a, b) -> str:
    return f"expected m1 and m2 to have the same dtype, but got: {_cpp(a)} != {_cpp(b)}"


def _addmm(bias, m1, m2) -> str:
    if bias != m2:
        return f"self and mat2 must have the same dtype, but got {_name(bias)} and {_name(m2)}"
    return f"mat1 and mat2 must have the same dtype, but got {_name(m1)} and {_name(m2)}"


def _bmm(a, b) -> str:
    return f"expected scalar type {_name(a)} but found {_name(b)}"


def _baddbmm(bias, b1, b2) -> str:
    return (
        f"Input dtypes must be the same, got: input {_cpp(bias)}, batch1: {_cpp(b1)}, "
        f"batch2: {_cpp(b2)}"
    )


def _sdpa(q, k, v) -> str:
    return (
        f"Expected query, key, and value to have the same dtype, but got query.dtype: "
        f"{_cpp(q)} key.dtype: {_cpp(k)} and value.dtype: {_cpp(v)} instead."
    )


# op -> (positions of the operands that must agree, torch's message from their dtypes).
_RULES = {
    aten.mm.default: ((0, 1), _mm),
    aten.addmm.default: ((0, 1, 2), _addmm),
    aten.bmm.default: ((0, 1), _bmm),
    aten.baddbmm.default: ((0, 1, 2), _baddbmm),
    aten.convolution.default: ((0, 1), _bmm),  # input vs weight; torch accepts another bias
    aten._scaled_dot_product_flash_attention_for_cpu.default: ((0, 1, 2), _sdpa),
    aten.scaled_dot_product_attention.default: ((0, 1, 2), _sdpa),
}


def _dtype(arg) -> torch.dtype | None:
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def refused(node: torch.fx.Node, float_dtype=None) -> RuntimeError | None:
    """torch's error for `node`'s operand dtypes, or None when torch accepts them.
    `float_dtype`: the policy's compute dtype (None: torch's own dtypes, no autocast)."""
    rule = _RULES.get(node.target)
    if rule is None:
        return None
    positions, message = rule
    dtypes = [_dtype(node.args[i]) if i < len(node.args) else None for i in positions]
    if any(d is None for d in dtypes):
        return None
    if float_dtype is not None:
        autocast = _autocast_dtype(float_dtype)
        if all(d in _AUTOCAST_CASTS for d in dtypes):
            return None
        # Autocast casts the half/float operands and leaves the others: torch compares those.
        dtypes = [autocast if d in _AUTOCAST_CASTS else d for d in dtypes]
    if len(set(dtypes)) == 1:
        return None
    return RuntimeError(
        f"{message(*dtypes)}\nzerojax: {node.target} in {node_location(node)} receives operands "
        f"of dtypes {', '.join(_name(d) for d in dtypes)}, which torch refuses; cast the input "
        f"to the model's dtype (e.g. x.float())."
    )


def _autocast_dtype(float_dtype) -> torch.dtype:
    dtype = np.dtype(float_dtype)
    if dtype.name == "bfloat16":
        return torch.bfloat16
    return {np.dtype(np.float16): torch.float16}.get(dtype, torch.float32)


def check_operand_dtypes(graph: torch.fx.Graph, float_dtype=None) -> None:
    """Raise torch's RuntimeError for the first node of `graph` whose operand dtypes torch
    refuses (see the module docstring)."""
    for node in graph.nodes:
        if node.op == "call_function":
            error = refused(node, float_dtype)
            if error is not None:
                raise error
