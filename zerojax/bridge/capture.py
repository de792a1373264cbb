"""Capture: torch.export, then decomposition to core ATen with a curated table.

The table is torch's core-ATen decomposition table minus the ops zerojax lowers whole:
scaled_dot_product_attention (torch's decomposition yields bad strides, pytorch#141107, and
keeping it whole lets the bridge route it to a fused attention kernel), and every op a user
registered a lowering for. Custom ops without a lowering are then traced through their Python
implementation where they have one (custom_ops.py). Last, runtime assertions and the values
computed only for them leave the graph (assertions.py): a compiled program cannot raise.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch._decomp import core_aten_decompositions

from zerojax.bridge import custom_ops
from zerojax.bridge.assertions import drop_assertions
from zerojax.bridge.errors import CaptureError
from zerojax.bridge.hf_cache import register_cache_pytrees

aten = torch.ops.aten

# Kept whole: each has a lowering of its own that is better than torch's decomposition.
KEPT_WHOLE = (
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_attention_math.default,
)


@functools.cache
def decomposition_table():
    table = core_aten_decompositions()
    for op in KEPT_WHOLE:
        table.pop(op, None)
    return table


@contextlib.contextmanager
def _training_mode(module: torch.nn.Module, train: bool):
    saved = {m: m.training for m in module.modules()}
    module.train(train)
    try:
        yield
    finally:
        for m, mode in saved.items():
            m.training = mode


def capture(module: torch.nn.Module, args: tuple, kwargs: dict, *, train: bool):
    """torch.export `module` on (args, kwargs) in train/eval mode and decompose to core ATen."""
    # A Hugging Face model returns (and takes) its KV cache: export must see into it.
    register_cache_pytrees(module)
    with _training_mode(module, train):
        try:
            exported = torch.export.export(module, args, kwargs, strict=False)
            with warnings.catch_warnings():
                # torch's own deepcopy of its pytree specs warns about its own deprecated API.
                warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
                table = custom_ops.without_kept_whole(decomposition_table())
                decomposed = exported.run_decompositions(table)
                decomposed = custom_ops.decompose_unlowered(decomposed, table)
        except Exception as error:  # torch raises many types here; all mean "cannot capture"
            reason = f"{type(error).__name__}: {error}"
            raise CaptureError(
                f"torch.export could not capture {type(module).__name__}; zerojax converts only "
                f"what torch.export can trace (no data-dependent Python control flow, no "
                f"untraceable calls). torch's reason:\n{reason}"
            ) from error
    if drop_assertions(decomposed.graph_module.graph):
        decomposed.graph_module.recompile()
    return decomposed
