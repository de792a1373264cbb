"""The Hugging Face Trainer (and TRL's trainers, built on it) around a zerojax model.

    model, _ = zerojax.initialize(model, config=...)     # the one added line
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...)
    trainer.train(); trainer.save_model(out)             # unchanged

Most of the Trainer needs nothing: the model stays itself (its class, `config`, `loss_type`,
the forward's signature), its tensors are live views of the engine's state, and the Trainer's
optimizer, clipping and schedule run on them; under torchrun the accelerate hook keeps the
model out of DDP (`zerojax.integrations.accelerate`), and a loss normalised by the Trainer's
`num_items_in_batch` is handed back as each process's share (`zerojax.parallel.placement`).

Constructing a Trainer on a zerojax model (`Trainer.__init__` is wrapped) hands it the loop:
its gradient accumulation and clipping are the Trainer's, so a zerojax config that would also
accumulate is refused, and one that would also clip at another norm; and the DeepSpeed values
the config left "auto" (`Config.trainer_autos`) are the Trainer's own doing, filled from its
arguments as transformers fills them for DeepSpeed: its batch size, accumulation,
`max_grad_norm`, AdamW (`learning_rate`, `adam_beta1/2`, `adam_epsilon`, `weight_decay`) and
bf16 autocast (traced into the program). A model whose config has such values refuses to run
until a Trainer takes it, naming every one.

What needs help is saving with several processes. The Trainer writes from the main process
only: `_save` returns on the others, and the main process reads `model.state_dict()` (in
`save_pretrained`) and `optimizer.state_dict()`. A zerojax model's state is sharded over every
process, so those reads are collectives, and one process alone would wait for the others
forever. `Trainer.save_model` and `Trainer._save_checkpoint` (which every process calls) are
wrapped, once, process-wide: every process gathers the model's and the optimizer's state dicts
first (`holding_state_dict`: the same collectives in the same order, one tensor at a time),
and the main process's reads inside are served from that copy. Installed by
`zerojax.initialize` when transformers' trainer module is loaded (and, for a config with "auto"
values, after importing it), and again when accelerate prepares a zerojax model (which every
Trainer does before it trains or evaluates), so a script that imports the Trainer after
`initialize` still saves correctly.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys

import torch
import torch.utils._pytree as torch_pytree

from zerojax.train.live_tensor import LiveTensor, to_host
from zerojax.train.module import ZeroModule
from zerojax.train.optimizer_shim import ZeroOptimizer

__all__ = ["install_trainer_hooks"]

# Trainer methods every process calls whose insides read the state on the main process only.
_SAVING_METHODS = ("save_model", "_save_checkpoint")


def install_trainer_hooks(*, import_trainer: bool = False) -> None:
    """Wrap the Trainer's `__init__` and saving methods (once per process, if transformers'
    trainer module is loaded, or with `import_trainer` if transformers is installed; see the
    module docstring)."""
    if import_trainer and importlib.util.find_spec("transformers") is not None:
        importlib.import_module("transformers.trainer")
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None:
        return
    trainer_class = trainer_module.Trainer
    if not getattr(trainer_class.__init__, "_zerojax_hook", False):
        init = _taking_the_model(trainer_class.__init__)
        init._zerojax_hook = True
        trainer_class.__init__ = init
    for name in _SAVING_METHODS:
        original = getattr(trainer_class, name, None)
        if original is None or getattr(original, "_zerojax_hook", False):
            continue
        wrapped = _gathering_first(original)
        wrapped._zerojax_hook = True
        setattr(trainer_class, name, wrapped)


def _taking_the_model(init):
    @functools.wraps(init)
    def __init__(trainer, *args, **kwargs):
        init(trainer, *args, **kwargs)
        _take_the_model(trainer)

    return __init__


def _take_the_model(trainer) -> None:
    """The Trainer runs the loop: its accumulation and clipping, not also zerojax's; and the
    DeepSpeed "auto" values the config left for it are its arguments' (see the module
    docstring)."""
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if not isinstance(model, ZeroModule):
        return
    engine, args = model.engine, trainer.args
    train = engine.config.train
    if train.gradient_accumulation_steps > 1:
        raise ValueError(
            f"zerojax: the Trainer accumulates gradients itself (gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}); the zerojax config's "
            f"train.gradient_accumulation_steps={train.gradient_accumulation_steps} would "
            f'accumulate again on top: set it to 1 (in a DeepSpeed config: "auto")'
        )
    if train.gradient_clipping is not None and args.max_grad_norm not in (
        None,
        0,
        train.gradient_clipping,
    ):
        raise ValueError(
            f"zerojax: the Trainer clips gradients at max_grad_norm={args.max_grad_norm} and "
            f"the zerojax config at train.gradient_clipping={train.gradient_clipping}; "
            f'keep one (in a DeepSpeed config: gradient_clipping "auto")'
        )
    engine.in_trainer = True


def _gathering_first(method):
    @functools.wraps(method)
    def gathering_first(trainer, *args, **kwargs):
        with _held_on_every_process(trainer):
            return method(trainer, *args, **kwargs)

    return gathering_first


@contextlib.contextmanager
def _held_on_every_process(trainer):
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if not isinstance(model, ZeroModule) or model.engine.placement.num_processes == 1:
        yield  # one process holds every shard: nothing to gather first
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(model.holding_state_dict())
        optimizer = _zero_optimizer(trainer.optimizer)
        if optimizer is not None:
            stack.enter_context(optimizer.holding_state_dict())
        elif trainer.optimizer is not None:
            # The Trainer's own optimizer: its state is the engine's (adopted by the compiled
            # update: `late_optimizers`) or live tensors (it runs its own step), sharded over
            # the processes either way, and rank 0 alone pickles it.
            stack.enter_context(_holding_host_state_dict(_innermost(trainer.optimizer)))
        yield


def _innermost(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer (and the like)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


@contextlib.contextmanager
def _holding_host_state_dict(optimizer):
    """Within: `optimizer.state_dict()` returns a copy with its live tensors gathered to the
    host on entry -- on every process, in the same order, as the gather needs."""
    held = torch_pytree.tree_map_only(LiveTensor, to_host, optimizer.state_dict())
    attributes = optimizer.__dict__
    previous = attributes.get("state_dict")
    attributes["state_dict"] = lambda: held
    try:
        yield
    finally:
        if previous is None:
            attributes.pop("state_dict", None)
        else:
            attributes["state_dict"] = previous


def _zero_optimizer(optimizer) -> ZeroOptimizer | None:
    """The ZeroOptimizer inside accelerate's AcceleratedOptimizer, if any."""
    while optimizer is not None and not isinstance(optimizer, ZeroOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer
