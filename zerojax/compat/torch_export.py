"""torch 2.11 to 2.15: the parts of torch.export that zerojax uses whose API differs.

- Serializing a program without its weights (the capture cache, `bridge/decomposition_cache`).
  torch >= 2.12's `ExportedProgramSerializer.serialize` takes `serialize_state_dict=False` and
  `serialize_example_inputs=False`; torch 2.11's always serializes both, with `torch.save`,
  which for a 124M-parameter model is half a gigabyte per cache entry. There the program is
  handed over with its weights as meta tensors (names, shapes and dtypes; no bytes) and no
  example inputs: the cache reads neither (a loaded entry takes the fresh capture's).
- Values torch records wrongly. torch 2.11's fake kernel of `aten.bincount` with weights
  records an int64 result, where eager torch returns the weights' floating dtype; the
  interpreter casts each lowering's result to the recorded dtype, so the weighted counts would
  be truncated to integers without a word. `correct_recorded_values` fixes such records in a
  captured graph (on later torch nothing matches).
- Tensor checks. torch 2.11's torch.export records `torch._check_tensor_all(cond)` (Hugging
  Face LLaVA's and Qwen2-VL's input checks) as a chain that its own re-trace then fails on
  ("... is not tracked with proxy"), so such a model did not capture at all. zerojax drops
  runtime assertions from the captured graph anyway (`bridge/assertions.py`: a jitted program
  cannot raise), so under torch 2.11 `exporting()` makes the check a no-op while torch.export
  traces: the graph is the one later torch gives after the assertions are dropped.
- Symbolic shapes with keyword inputs the forward takes through `**kwargs` (Hugging Face's
  `num_items_in_batch`). torch 2.13's export with `dynamic_shapes` fails on them ("Must provide
  a tree_name when there might be a mismatch"): `_get_range_constraints` reorders the combined
  arguments by the call's keywords and so lists such an input twice, inside the `**kwargs` dict
  and at the top level. `var_keywords_flattened()` puts them at the top level wherever torch
  combines arguments, so every step sees one structure (the order it traces in).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch

TORCH_2_12 = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 12)


@contextlib.contextmanager
def exporting():
    """Around a `torch.export.export` call: what this torch needs to trace what later ones do
    (on torch >= 2.12, nothing)."""
    if TORCH_2_12:
        yield
        return
    check_tensor_all = torch._check_tensor_all
    torch._check_tensor_all = lambda cond, message=None: None
    try:
        yield
    finally:
        torch._check_tensor_all = check_tensor_all


@functools.cache
def _serializer_takes_parts() -> bool:
    # Imported here: torch's serializer pulls in torch._dynamo (~1 s), which `import zerojax`
    # should not pay for.
    from torch._export.serde.serialize import ExportedProgramSerializer

    return (
        "serialize_state_dict" in inspect.signature(ExportedProgramSerializer.serialize).parameters
    )


def serialize_without_weights(program: torch.export.ExportedProgram):
    """torch.export's serialized form of `program` (`_SerializedProgram`): the graph, its
    signature and constants, without the weights' or the example inputs' bytes."""
    from torch._export.serde.serialize import ExportedProgramSerializer

    serializer = ExportedProgramSerializer()
    if _serializer_takes_parts():
        return serializer.serialize(
            program, serialize_state_dict=False, serialize_example_inputs=False
        )
    light = copy.copy(program)  # shallow: the graph module is shared, only these two are replaced
    light._state_dict = {name: _on_meta(tensor) for name, tensor in program.state_dict.items()}
    light._example_inputs = None
    return serializer.serialize(light)


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    meta = tensor.detach().to("meta")
    # The verifier checks that a parameter input's state_dict entry is a Parameter.
    return (
        torch.nn.Parameter(meta, tensor.requires_grad)
        if isinstance(tensor, torch.nn.Parameter)
        else meta
    )


def correct_recorded_values(graph: torch.fx.Graph) -> None:
    """Replace the value metadata that a torch release records wrongly (see the module
    docstring) by what eager torch computes."""
    for node in graph.nodes:
        if node.target is not torch.ops.aten.bincount.default:
            continue
        weights = node.kwargs.get("weights", node.args[1] if len(node.args) > 1 else None)
        recorded = node.meta.get("val")
        if weights is None or recorded is None or recorded.dtype.is_floating_point:
            continue
        # ATen's bincount: float weights give their dtype, any other weights give double.
        weights_dtype = weights.meta["val"].dtype
        dtype = weights_dtype if weights_dtype.is_floating_point else torch.float64
        with recorded.fake_mode:
            node.meta["val"] = recorded.to(dtype)


_COMBINING_MODULES = (
    "torch.export.dynamic_shapes",
    "torch.export._trace",
    "torch._export.non_strict_utils",
)


@contextlib.contextmanager
def var_keywords_flattened():
    """Around a `torch.export.export` call with `dynamic_shapes` (see the module docstring)."""
    import importlib

    modules = [importlib.import_module(name) for name in _COMBINING_MODULES]
    originals = [module._combine_args for module in modules]
    combine = _flattening(originals[0])
    for module in modules:
        module._combine_args = combine
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            module._combine_args = original


def _flattening(combine_args):
    def combined(f, args, kwargs):
        arguments = combine_args(f, args, kwargs)
        try:
            function = f.module() if isinstance(f, torch.export.ExportedProgram) else f
            function = function.forward if isinstance(function, torch.nn.Module) else function
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            return arguments
        var = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
        if var is None or not isinstance(arguments.get(var), dict):
            return arguments
        flat = {name: value for name, value in arguments.items() if name != var}
        flat.update(arguments[var])
        return flat

    return combined
