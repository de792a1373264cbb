"""Capture: torch.export, then decomposition to core ATen with a curated table.

The table is torch's core-ATen decomposition table minus the ops zerojax lowers whole:
scaled_dot_product_attention (torch's decomposition yields bad strides, pytorch#141107, and
keeping it whole lets the bridge route it to a fused attention kernel), and every op a user
registered a lowering for. Custom ops without a lowering are then traced through their Python
implementation where they have one (custom_ops.py). Last, runtime assertions and the values
computed only for them leave the graph (assertions.py): a compiled program cannot raise.
The model's torch.utils.checkpoint calls are tagged in the graph (torch_checkpoint.py); in train
mode Hugging Face's host-side draws (LayerDrop, SpecAugment) are made traceable
(hf_train_randomness.py). torch's own transformer modules decide `is_causal` from the caller's
hint and take their general path, not a native fast path (torch_transformer.py).
The decomposition step's result is cached on disk, keyed by the graph it decomposes, beside
JAX's persistent compilation cache (decomposition_cache.py); torch.export itself always runs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import random
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch._decomp import core_aten_decompositions

from zerojax.bridge import custom_ops, decomposition_cache, symbolic_shapes
from zerojax.bridge.assertions import drop_assertions
from zerojax.bridge.errors import CaptureError
from zerojax.bridge.hf_cache import register_cache_pytrees
from zerojax.bridge.hf_train_randomness import traceable_train_randomness
from zerojax.bridge.torch_checkpoint import tagging_checkpoint_calls
from zerojax.bridge.torch_transformer import transformer_modules_traceable
from zerojax.bridge.value_inputs import (
    FoldConstants,
    integer_inputs,
    mark_value_known,
    reads_values_on_host,
)
from zerojax.compat.torch_export import (
    correct_recorded_values,
    exporting,
    var_keywords_flattened,
)
from zerojax.runtime.private_directory import UnsafeDirectoryError

aten = torch.ops.aten
log = logging.getLogger("zerojax")

# graph_module.meta key of a symbolic capture's deferred size checks (symbolic_shapes.py).
SHAPE_ASSERTIONS = "zerojax_shape_assertions"

# Kept whole: each has a lowering of its own that is better than torch's decomposition.
KEPT_WHOLE = (
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_attention_math.default,
    # Its decomposition's amax shift, differentiated, costs 3-14x torch's gradient error
    # (lowerings/reduction.py, lower_logsumexp_default).
    aten.logsumexp.default,
    # torch >= 2.14 decomposes it to pow/sum/pow, whose gradient at a zero norm is NaN (the
    # root's derivative at 0 times 0); the lowering's gradient is 0 there, like torch's
    # backward (lowerings/reduction.py). On 2.13 the table has no entry to remove.
    aten.linalg_vector_norm.default,
)


@functools.cache
def decomposition_table():
    table = core_aten_decompositions()
    for op in KEPT_WHOLE:
        table.pop(op, None)
    return table


_AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def _keeping_autocast_state():
    """Put the process's autocast state back after torch.export: tracing a forward that enters
    autocast as a decorator (accelerate's mixed-precision wrapper, a forward patched on the
    instance: see zerojax.train.module) left it enabled afterwards (torch 2.13, measured), and
    every later torch op of the process would then run in bfloat16."""
    saved = [
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
    ]
    try:
        yield
    finally:
        for device, enabled, dtype in saved:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)


@contextlib.contextmanager
def _training_mode(module: torch.nn.Module, train: bool):
    """The module in train or eval mode, as zerojax runs it: in train mode with Hugging Face's
    host-side draws made traceable (hf_train_randomness.py)."""
    saved = {m: m.training for m in module.modules()}
    module.train(train)
    try:
        with traceable_train_randomness(module) if train else contextlib.nullcontext():
            yield
    finally:
        for m, mode in saved.items():
            m.training = mode


def capture(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    train: bool,
    value_inputs: frozenset[str] = frozenset(),
    dynamic: Mapping[str, Sequence[int]] | None = None,
):
    """torch.export `module` on (args, kwargs) in train/eval mode and decompose to core ATen.

    `value_inputs` names integer inputs (`value_inputs.input_key`) the program is specialised
    on: traced as constants, not taken as inputs (value_inputs.py). `dynamic` names, per input,
    the dims captured as symbols (`Dim.AUTO`: torch specialises one the model guards on); the
    size checks torch deferred to run time are kept in `graph_module.meta[SHAPE_ASSERTIONS]`
    before the graph's assertions are dropped (symbolic_shapes.py).
    """
    # A Hugging Face model returns (and takes) its KV cache: export must see into it.
    register_cache_pytrees(module)
    fold = contextlib.nullcontext()
    if value_inputs:
        args, kwargs = mark_value_known(args, kwargs, value_inputs)
        fold = FoldConstants()
    with _training_mode(module, train):
        try:
            with (
                fold,
                _quiet_failure(),
                tagging_checkpoint_calls(),
                transformer_modules_traceable(),
                _keeping_autocast_state(),
                _warning_on_host_random_draws(module),
                exporting(),
            ):
                exported = _export(module, args, kwargs, dynamic)
            with warnings.catch_warnings():
                # torch's own deepcopy of its pytree specs warns about its own deprecated API.
                warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
                table = custom_ops.without_kept_whole(decomposition_table())
                decomposed = decomposition_cache.decompose(exported, table, _run_decompositions)
                decomposed = custom_ops.decompose_unlowered(decomposed, table)
        except UnsafeDirectoryError:
            raise  # the cache's directory, not the model, is at fault
        except Exception as error:  # torch raises many types here; all mean "cannot capture"
            reason = f"{type(error).__name__}: {error}"
            raise CaptureError(
                f"torch.export could not capture {type(module).__name__}; zerojax converts only "
                f"what torch.export can trace (no data-dependent Python control flow, no "
                f"untraceable calls). torch's reason:\n{reason}"
            ) from error
    correct_recorded_values(decomposed.graph_module.graph)
    if dynamic:
        decomposed.graph_module.meta[SHAPE_ASSERTIONS] = symbolic_shapes.shape_assertions(
            decomposed.graph_module.graph
        )
    if drop_assertions(decomposed.graph_module.graph):
        decomposed.graph_module.recompile()
    return decomposed


def _export(module, args, kwargs, dynamic):
    if not dynamic:
        return torch.export.export(module, args, kwargs, strict=False)
    shapes = symbolic_shapes.dynamic_shapes(args, kwargs, dynamic)
    with var_keywords_flattened():
        return torch.export.export(module, args, kwargs, strict=False, dynamic_shapes=shapes)


def _run_decompositions(exported, table):
    return exported.run_decompositions(table)


@contextlib.contextmanager
def _warning_on_host_random_draws(module: torch.nn.Module):
    """Warn when the forward draws from numpy's or Python's global random generator while it
    is traced: the draw is a constant of the captured program, the same at every call, where
    torch's own random ops (dropout) are drawn afresh each step. (Hugging Face's SpecAugment
    sampler is such a draw; it is replaced before it runs, hf_train_randomness.py.)"""
    before = np.random.get_state(), random.getstate()
    yield
    after = np.random.get_state(), random.getstate()
    drawn = [
        name
        for name, old, new in (
            ("numpy's", before[0], after[0]),
            ("Python's", before[1], after[1]),
        )
        if not _same_state(old, new)
    ]
    if drawn:
        log.warning(
            "zerojax: %s drew from %s global random generator while it was traced; the "
            "program holds that one draw and reuses it at every call (torch's random ops, such "
            "as dropout, draw afresh each step): draw with torch to get a new value each step",
            type(module).__name__,
            " and ".join(drawn),
        )


def _same_state(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def find_host_read_inputs(
    module: torch.nn.Module, args: tuple, kwargs: dict, *, train: bool
) -> frozenset[str]:
    """The integer inputs the program must be specialised on to be captured (value_inputs.py).

    First every integer input is value-known and tagged, and the inputs whose values reach a
    host read are collected; then inputs are dropped from that set, largest first, while the
    capture still succeeds without them and leaves no host read in the graph: a read that only
    feeds a runtime check (LLaVA's token count over `input_ids`) does not need its input
    specialised, the check becomes an assertion that is dropped. Empty when no set of integer
    inputs gives such a capture (host reads of floating-point values, say).
    """
    sizes = integer_inputs(args, kwargs)
    candidates = list(sizes)
    if not candidates:
        return frozenset()
    with _training_mode(module, train):
        reads = _host_reads(module, args, kwargs, candidates)
        if not reads:
            return frozenset()
        needed = set(reads)
        if not _exports(module, args, kwargs, needed):
            return frozenset()
        for key in sorted(reads, key=lambda k: -sizes[k]):
            trial = needed - {key}
            if trial and _exports(module, args, kwargs, trial):
                needed = trial
    return frozenset(needed)


def _host_reads(module, args, kwargs, candidates) -> set[str]:
    """Export with every candidate value-known and tagged: the candidates read on the host."""
    marked_args, marked_kwargs = mark_value_known(args, kwargs, candidates, tag=True)
    fold = FoldConstants()
    try:
        with (
            fold,
            _quiet_failure(),
            tagging_checkpoint_calls(),
            transformer_modules_traceable(),
            exporting(),
        ):
            torch.export.export(module, marked_args, marked_kwargs, strict=False)
    except Exception:  # noqa: BLE001 - any failure: specialising would not help
        return set()
    return set(fold.host_reads)


def _exports(module, args, kwargs, value_inputs) -> bool:
    """Whether specialising on `value_inputs` captures a graph with no host read left."""
    marked_args, marked_kwargs = mark_value_known(args, kwargs, value_inputs)
    try:
        with (
            FoldConstants(),
            _quiet_failure(),
            tagging_checkpoint_calls(),
            transformer_modules_traceable(),
            exporting(),
        ):
            exported = torch.export.export(module, marked_args, marked_kwargs, strict=False)
    except Exception:  # noqa: BLE001 - any failure means "not without these"
        return False
    graph = exported.graph_module.graph
    drop_assertions(graph)
    return not reads_values_on_host(graph)


def _quiet_failure():
    """torch.export prints the partial graph of a failed export to stderr; a failed capture
    raises CaptureError with torch's reason, and the first capture of a model with value inputs
    fails by design: the graph (every parameter's shape) would bury the user's output."""
    return contextlib.redirect_stderr(io.StringIO())
