"""Which module of a LightningModule zerojax runs, and the guard on the ones it cannot.

`zerojax.initialize` turns one module's *forward* into the engine's compiled program; its
submodules keep their own forwards, whose parameters are live views of the engine's arrays
(`zerojax.train.parameters`). Called on their own with gradients on (the docs' LitAutoEncoder:
`z = self.encoder(x)` in `training_step`), they would run op by op on those views and return
tensors that autograd does not connect to the engine: `loss.backward()` then fails with torch's
"element 0 of tensors does not require grad". The guard turns that into an error naming the
module and what to do. Under `torch.no_grad()` (validation, prediction) a direct call is left
alone: the ops run on the live tensors, unrecorded, as they would in torch.
"""

from __future__ import annotations

import torch

from zerojax.train.parameters import ShardedParameter, is_plain

__all__ = ["check_submodule_calls", "training_module"]


def _has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def training_module(owner: torch.nn.Module, path: str | None) -> tuple[str, torch.nn.Module]:
    """The module of `owner` (a LightningModule) that zerojax initializes: (its path, itself).

    `path` given: that submodule ("" = `owner` itself). Otherwise, in this order: the one child
    holding all of `owner`'s parameters (`self.model = GPT(...)`: `self.model(x)` and a
    `forward` that calls it both run the engine's program); `owner` itself when its class
    defines `forward` (`training_step` must then call `self(x)`); else a ValueError naming the
    children and both ways out.
    """
    name = type(owner).__name__
    if path is not None:
        try:
            return path, owner.get_submodule(path) if path else owner
        except AttributeError as error:
            raise ValueError(
                f"zerojax.lightning: module={path!r}: {name} has no submodule {path!r} "
                f"({error}); its children are {[n for n, _ in owner.named_children()]}"
            ) from None
    holders = [(n, child) for n, child in owner.named_children() if _has_parameters(child)]
    if len(holders) == 1 and next(owner.parameters(recurse=False), None) is None:
        return holders[0]
    if _defines_forward(owner):
        return "", owner
    raise ValueError(
        f"zerojax.lightning: cannot tell which module of {name} to run as the compiled "
        f"program: its parameters are spread over {[n for n, _ in holders]} and {name} "
        f"defines no forward. zerojax compiles one module's forward, so training_step must call "
        f"one module for the whole model: define {name}.forward (calling "
        f"{' and '.join(n for n, _ in holders) or 'its layers'}) and call self(x) in "
        f"training_step, or keep the model as one child (self.model) and call self.model(...), "
        f"naming it with ZeroJaxStrategy(module='model') if needed."
    )


def _defines_forward(module: torch.nn.Module) -> bool:
    """Whether the module's class has a forward of its own (not LightningModule's or
    nn.Module's placeholder)."""
    owner = getattr(type(module).forward, "__module__", "") or ""
    return not owner.startswith(("lightning.", "pytorch_lightning.", "torch.nn."))


def check_submodule_calls(target: torch.nn.Module, label: str) -> None:
    """Make a direct call of any submodule of `target` (the initialized module, `label` its
    name for the user: "LitAutoEncoder", "LitGPT.model") with gradients on raise an error
    naming it, instead of running op by op outside the engine."""
    for path, submodule in target.named_modules():
        if path and _has_parameters(submodule):
            submodule.register_forward_pre_hook(_refuse_direct_call(label, path))


def _refuse_direct_call(label: str, path: str):
    def hook(module, args):
        # Inside the engine's forward (and while torch.export captures it) parameters are
        # plain: the call is part of the program.
        if is_plain() or not torch.is_grad_enabled():
            return
        # A copy.deepcopy of the model (an EMA copy) is ordinary torch, hooks and all.
        if not isinstance(next(module.parameters()), ShardedParameter):
            return
        raise RuntimeError(
            f"zerojax.lightning: {label}.{path} ({type(module).__name__}) was called on its own "
            f"with gradients on, but zerojax runs {label}'s forward as one compiled program and "
            f"its submodules cannot train outside it. Call {label} itself (for a "
            f"LightningModule: define forward to run the submodules and call self(x) in "
            f"training_step), or keep the trained model as one child and pass "
            f"ZeroJaxStrategy(module='<child>')."
        )

    return hook
