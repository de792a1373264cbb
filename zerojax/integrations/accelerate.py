"""Hugging Face accelerate around a zerojax model, with `zerojax.initialize` before or after
`accelerator.prepare`.

    model, opt = zerojax.initialize(model, opt, config)                    # order A
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)   # order B
    model, opt = zerojax.initialize(model, opt, config)

Either way `accelerator.backward`, `clip_grad_norm_`, `gather`, `accumulate`,
`save_state`/`load_state` and prepared LR schedulers work as in a plain accelerate run:
accelerate only ever sees torch objects, and the model's tensors are live views of the engine's
(`zerojax.train.parameters`), so its calls become the engine's. Two things need help, and
`zerojax.initialize` calls this module for both:

- **No DDP around a zerojax model** (`install_prepare_hook`). With several processes
  (torchrun), `Accelerator.prepare_model` wraps every trainable model in
  `DistributedDataParallel`, and so does the HF Trainer, which prepares through it. zerojax
  already *is* the data parallelism (DDP's semantics: each process feeds its rows, the engine
  averages gradients over processes, `zerojax.parallel.placement`), so a DDP wrap is at best
  dead weight and at worst wrong: the engine's gradients never reach torch autograd's
  accumulators, so DDP's reducer sits idle while its buckets hold a host copy the size of
  every gradient (undoing ZeRO's memory split), it broadcasts rank 0's buffers before every
  forward, and any gradient that did reach it would be averaged a second time (measured on
  CPU: a DDP-wrapped zerojax MLP still trained to the same numbers, only paying for all that).
  accelerate has no hook for an engine that owns gradient reduction, so the narrowest one is
  made: `Accelerator.prepare_model` is wrapped once, process-wide, and for a `ZeroModule` calls
  accelerate's own code with `evaluation_mode=True`. That flag skips exactly the parallel
  wrappers (DDP, FSDP, XLA's) and keeps everything else prepare_model does: registering the
  model for save_state/load_state, the mixed-precision autocast around forward, FP8 wrapping,
  device placement (a no-op on live tensors) and torch.compile if configured. The wrap is
  installed by `zerojax.initialize` (when accelerate is installed), which in order A runs
  before any `prepare`; patching at import time instead would need an import hook
  (`sys.meta_path`) for a package the user may never use. Accelerate's own sharding engines
  (FSDP, Megatron, XLA; DeepSpeed only in order B, as its `prepare` never calls prepare_model)
  and its fp16 `GradScaler` are refused for a zerojax model: zerojax's config has the ZeRO
  stage and its own fp16 loss scaling.
- **Unwrapping what `prepare` made** (`unwrap_prepared`, order B). The model may be inside
  DDP (torchrun; the wrapper is dropped, since order A would never have made it, and the
  accelerator's list of models gets the model itself, so save_state writes the same keys as
  in order A) and its forward may be accelerate's autocast wrapper around the class's original
  forward (which would bypass the engine: it is re-made around zerojax's forward). The
  optimizer is an `AcceleratedOptimizer`: zerojax wraps the torch optimizer inside it and
  re-points the `AcceleratedOptimizer` at the `ZeroOptimizer`, and hands that same object
  back. Why that object and not a new one: the accelerator holds it (`save_state` and
  `load_state` iterate its optimizers, a prepared scheduler holds it and asks it whether the
  step was skipped, `accumulate`'s gradient state gates its `step`/`zero_grad`), so the one
  object the user and the accelerator both hold must drive the zerojax update.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import sys
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch

from zerojax.integrations import hf_trainer
from zerojax.train.module import ZeroModule

__all__ = ["Prepared", "install_prepare_hook", "unwrap_prepared"]

# accelerate's distributed types refused for a zerojax model: they shard or wrap the model
# themselves. Allowed: one process (NO) and the DDP-style MULTI_* types (the engine reduces).
_ENGINE_TYPES = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


def install_prepare_hook() -> None:
    """Wrap `accelerate.Accelerator.prepare_model` (once per process, if accelerate is installed)
    so that a zerojax model is prepared without a parallel wrapper (see the module docstring)."""
    if "accelerate" not in sys.modules and importlib.util.find_spec("accelerate") is None:
        return
    from accelerate import Accelerator

    original = Accelerator.prepare_model
    if getattr(original, "_zerojax_hook", False):
        return

    @functools.wraps(original)
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if isinstance(model, ZeroModule):
            _check_accelerator(self.distributed_type, self.scaler)
            # A Trainer imported after zerojax.initialize: its saving needs the hooks too.
            hf_trainer.install_trainer_hooks()
            # accelerate's own preparation minus its DDP/FSDP/XLA wrappers: zerojax already
            # averages gradients over processes inside the engine.
            evaluation_mode = True
        return original(self, model, device_placement, evaluation_mode)

    prepare_model._zerojax_hook = True
    Accelerator.prepare_model = prepare_model


def _check_accelerator(distributed_type: Any, scaler: Any) -> None:
    name = getattr(distributed_type, "value", str(distributed_type))
    if name in _ENGINE_TYPES:
        raise ValueError(
            f"zerojax: accelerate's distributed_type={name} shards or wraps the model itself, and "
            "zerojax already does (its config's mesh and zero_stage); launch accelerate without "
            "FSDP/DeepSpeed/Megatron/XLA (plain torchrun or `accelerate launch` with DDP settings)"
        )
    if scaler is not None:
        raise ValueError(
            "zerojax: Accelerator(mixed_precision='fp16') scales the loss with torch's "
            "GradScaler; a zerojax model scales it inside the engine: use "
            "mixed_precision='no' or 'bf16', and zerojax's config (precision: fp16) for fp16"
        )


@dataclass
class Prepared:
    """What `unwrap_prepared` took off the user's objects, to put back around the zerojax ones."""

    model: torch.nn.Module
    optimizer: Any
    # Per optimizer (or the one): the AcceleratedOptimizer it came in, or None.
    accelerated: list = field(default_factory=list)
    # The wrapper (DDP, torch.compile) prepare put around the model; it is dropped.
    parallel_wrapper: torch.nn.Module | None = None
    # Whether prepare had wrapped the model's forward in autocast (mixed precision).
    autocast: bool = False

    def rewrap(self, model: torch.nn.Module, optimizer: Any) -> Any:
        """The optimizer(s) to hand back: each AcceleratedOptimizer re-pointed at its
        ZeroOptimizer. Re-makes accelerate's autocast around `model`'s zerojax forward and puts
        `model` in place of the dropped wrapper in the accelerator's list of models."""
        if self.autocast:
            _wrap_forward_in_autocast(model)
        if self.parallel_wrapper is not None:
            model._is_accelerate_prepared = True
            _replace_in_accelerators(self.parallel_wrapper, model)
        if not self.accelerated:
            return optimizer
        several = isinstance(optimizer, list)
        handed_back = []
        for zero, outer in zip(
            optimizer if several else [optimizer], self.accelerated, strict=True
        ):
            if outer is None:
                handed_back.append(zero)
                continue
            inner = outer
            while isinstance(inner.optimizer, type(outer)):
                inner = inner.optimizer
            inner.optimizer = zero
            handed_back.append(outer)
        return handed_back if several else handed_back[0]


def unwrap_prepared(model: torch.nn.Module, optimizer: Any) -> Prepared:
    """Take accelerate's wrappers off a prepared model and optimizer(s) (order B); a no-op for
    objects accelerate has not prepared (and without importing accelerate if nothing has)."""
    prepared = Prepared(model=model, optimizer=optimizer)
    if "accelerate" not in sys.modules:
        return prepared
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import extract_model_from_parallel, is_compiled_module

    several = isinstance(optimizer, (list, tuple))
    torch_optimizers = []
    for each in list(optimizer) if several else [optimizer]:
        if not isinstance(each, AcceleratedOptimizer):
            torch_optimizers.append(each)
            prepared.accelerated.append(None)
            continue
        _check_accelerator(each.accelerator_state.distributed_type, each.scaler)
        prepared.accelerated.append(each)
        while isinstance(each, AcceleratedOptimizer):
            each = each.optimizer
        torch_optimizers.append(each)
    if not any(prepared.accelerated):
        prepared.accelerated = []
    prepared.optimizer = torch_optimizers if several else torch_optimizers[0]

    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    if isinstance(model, parallel) or is_compiled_module(model):
        # DDP/DataParallel, or accelerate's torch.compile: zerojax compiles the step itself.
        prepared.parallel_wrapper = model
        model = extract_model_from_parallel(model, keep_torch_compile=False)
    # accelerate's autocast: an instance `forward` that calls the class's forward (bound when
    # prepare ran), which after initialize would run torch on the live tensors instead of the
    # engine's program. Dropped here (as `extract_model_from_parallel(keep_fp32_wrapper=False)`
    # does) and made again around zerojax's forward in `rewrap`.
    if "_original_forward" in model.__dict__:
        del model.__dict__["_original_forward"]
        model.__dict__.pop("forward", None)
        prepared.autocast = True
    prepared.model = model
    return prepared


def _wrap_forward_in_autocast(model: torch.nn.Module) -> None:
    """What `Accelerator.prepare_model` does with native mixed precision, around `model`'s
    (zerojax) forward. The accelerator's `AutocastKwargs` handler, if the user gave one, is not
    reachable from the model; the autocast is the default one for the accelerator's state."""
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    autocast = get_mixed_precision_context_manager(native_amp=True)
    model._original_forward = model.forward
    forward = autocast(type(model).forward)
    model.forward = MethodType(convert_outputs_to_fp32(forward), model)


def _replace_in_accelerators(wrapper: torch.nn.Module, model: torch.nn.Module) -> None:
    """Put `model` where `wrapper` stands in any Accelerator's list of prepared models.

    accelerate keeps no registry of its Accelerators and the optimizer does not point back to
    one, so the lists holding the wrapper are found through the garbage collector's referrers
    (once, in order B under torchrun only): without this, save_state would save the dropped DDP
    wrapper's keys ("module."-prefixed, its per-module live tensors) instead of the model's."""
    from accelerate import Accelerator

    for holder in gc.get_referrers(wrapper):
        if not isinstance(holder, list):
            continue
        for owner in gc.get_referrers(holder):
            owned = owner.__dict__ if isinstance(owner, Accelerator) else owner
            if isinstance(owned, dict) and owned.get("_models") is holder:
                holder[:] = [model if m is wrapper else m for m in holder]
                break
