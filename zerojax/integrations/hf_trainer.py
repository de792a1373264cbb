"""The Hugging Face Trainer (and TRL's trainers, built on it) around a zerojax model.

    model, _ = zerojax.initialize(model, config=...)     # the one added line
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...)
    trainer.train(); trainer.save_model(out)             # unchanged

Most of the Trainer needs nothing: the model stays itself (its class, `config`, `loss_type`,
the forward's signature), its tensors are live views of the engine's state, and the Trainer's
optimizer, clipping and schedule run on them; under torchrun the accelerate hook keeps the
model out of DDP (`zerojax.integrations.accelerate`), and a loss normalised by the Trainer's
`num_items_in_batch` is handed back as each process's share (`zerojax.train.data_parallel`).

What needs help is saving with several processes. The Trainer writes from the main process
only: `_save` returns on the others, and the main process reads `model.state_dict()` (in
`save_pretrained`) and `optimizer.state_dict()`. A zerojax model's state is sharded over every
process, so those reads are collectives, and one process alone would wait for the others
forever. `Trainer.save_model` and `Trainer._save_checkpoint` (which every process calls) are
wrapped, once, process-wide: every process gathers the model's and the optimizer's state dicts
first (`holding_state_dict`: the same collectives in the same order, one tensor at a time),
and the main process's reads inside are served from that copy. Installed by
`zerojax.initialize` when transformers' trainer module is loaded, and again when accelerate
prepares a zerojax model (which every Trainer does before it trains or evaluates), so a script
that imports the Trainer after `initialize` is covered too.
"""

from __future__ import annotations

import contextlib
import functools
import sys

from zerojax.train.module import ZeroModule
from zerojax.train.optimizer_shim import ZeroOptimizer

__all__ = ["install_trainer_hooks"]

# Trainer methods every process calls whose insides read the state on the main process only.
_SAVING_METHODS = ("save_model", "_save_checkpoint")


def install_trainer_hooks() -> None:
    """Wrap the Trainer's saving methods (once per process, if transformers' trainer module is
    loaded; see the module docstring)."""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None:
        return
    trainer_class = trainer_module.Trainer
    for name in _SAVING_METHODS:
        original = getattr(trainer_class, name, None)
        if original is None or getattr(original, "_zerojax_hook", False):
            continue
        wrapped = _gathering_first(original)
        wrapped._zerojax_hook = True
        setattr(trainer_class, name, wrapped)


def _gathering_first(method):
    @functools.wraps(method)
    def gathering_first(trainer, *args, **kwargs):
        with _held_on_every_process(trainer):
            return method(trainer, *args, **kwargs)

    return gathering_first


@contextlib.contextmanager
def _held_on_every_process(trainer):
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if not isinstance(model, ZeroModule) or model.engine.process_local is None:
        yield  # one process holds every shard: nothing to gather first
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(model.holding_state_dict())
        optimizer = _zero_optimizer(trainer.optimizer)
        if optimizer is not None:
            stack.enter_context(optimizer.holding_state_dict())
        yield


def _zero_optimizer(optimizer) -> ZeroOptimizer | None:
    """The ZeroOptimizer inside accelerate's AcceleratedOptimizer, if any."""
    while optimizer is not None and not isinstance(optimizer, ZeroOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer
