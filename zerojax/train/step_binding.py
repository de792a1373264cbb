"""Whether an optimizer still holds what its last captured step found, told by identity alone.

Before each captured step (`zerojax.train.captured_step`) the live path puts new state
tensors on their shardings (`live_optimizer_state.place_state`), checks the step's layout
(which parameters each group holds, which have gradients, the state's keys and kinds) and looks
up each live tensor's source in the optimizer's state: three passes of Python per tensor, over
100-300 tensors that the step's program has pushed out of the caches (NAdam: ~0.5 ms of its
~5 ms step on the bench model). Between two steps a training loop changes none of it: the
same dicts hold the same tensors.

A `Binding`, made after a captured step, keeps those objects: the optimizer's param groups and
their keys, its parameters, which of them have gradients (their engine's entries), each one's
state dict and the keys and tensors in it. `held` compares them with the optimizer's by
identity (`map(operator.is_, ...)`: no tensor is read, no Python runs per tensor), and where
they are all the same objects the step uses what it found under that binding instead of looking
again. Any change -- a new state key, `load_state_dict`'s new tensors, a gradient set to None,
a parameter added to a group -- is a different object somewhere, and the step looks again.
"""

from __future__ import annotations

import itertools
import operator
import weakref

import torch

from zerojax.train.parameters import ShardedParameter

__all__ = ["Binding", "bind", "held"]

# optimizer -> the Binding of its last captured step
_bindings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# optimizers whose `load_state_dict` drops their binding (`bind`)
_hooked: weakref.WeakSet = weakref.WeakSet()


class Binding:
    """What one optimizer held after a captured step with layout `layout` (see the module
    docstring). `found`, filled by the steps bound to it: a captured program's number -> the
    sources of its live tensors, looked up under this binding."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: tuple, engine, names: list):
        self.layout = layout
        self.state = optimizer.state
        self.groups = list(optimizer.param_groups)
        self.group_keys = [tuple(group) for group in self.groups]
        self.params = _params(self.groups)
        self.grads_present, self.names = engine.grads_present, names
        self.grads = self.grads_present(names)
        # (the state's own order: no parameter is hashed to look it up)
        self.keys = list(self.state.keys())
        self.dicts = list(self.state.values())
        self.contents = _contents(self.dicts)
        self.found: dict[int, list] = {}

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        if (
            optimizer.state is not self.state
            or len(groups) != len(self.groups)
            or not all(map(operator.is_, groups, self.groups))
            or [tuple(group) for group in groups]
            != self.group_keys  # (keys: str, compared by `is` first)
        ):
            return False
        params = _params(groups)
        if not _same_objects(params, self.params):
            return False
        if self.grads_present(self.names) != self.grads:
            return False
        state = self.state
        dicts = list(state.values())
        if not (_same_objects(dicts, self.dicts) and _same_objects(list(state.keys()), self.keys)):
            return False
        lengths, keys, values = _contents(dicts)
        then_lengths, then_keys, then_values = self.contents
        return lengths == then_lengths and keys == then_keys and _same_objects(values, then_values)


def held(optimizer: torch.optim.Optimizer) -> Binding | None:
    """The binding of `optimizer`'s last captured step, where the optimizer still holds all it
    kept; else None."""
    binding = _bindings.get(optimizer)
    if binding is None or not binding.holds(optimizer):
        return None
    return binding


def bind(optimizer: torch.optim.Optimizer, layout: tuple) -> None:
    """Keep what `optimizer` holds after a captured step with `layout`, for the next step to
    compare (`held`). Only over the parameters of one engine (their gradients are its
    entries); else nothing is kept and each step looks again."""
    params = _params(optimizer.param_groups)
    engines = {id(getattr(p, "_zerojax_engine", None)) for p in params}
    if not params or len(engines) != 1 or not all(isinstance(p, ShardedParameter) for p in params):
        _bindings.pop(optimizer, None)
        return
    if optimizer not in _hooked:
        # A loaded state dict's tensors are new objects, which `holds` would tell; the binding
        # is dropped before they arrive, so that it does not keep the old ones in memory.
        optimizer.register_load_state_dict_pre_hook(_forget)
        _hooked.add(optimizer)
    names = [p._zerojax_name for p in params]
    _bindings[optimizer] = Binding(optimizer, layout, params[0]._zerojax_engine, names)


def _forget(optimizer: torch.optim.Optimizer, state_dict) -> None:
    _bindings.pop(optimizer, None)


def _params(groups: list[dict]) -> list:
    return list(itertools.chain.from_iterable(group["params"] for group in groups))


def _same_objects(now: list, then: list) -> bool:
    return len(now) == len(then) and all(map(operator.is_, now, then))


def _contents(dicts: list) -> tuple[list, list, list]:
    """The state dicts' lengths, keys and values, in order (None and empty dicts left out)."""
    present = list(filter(None, dicts))
    return (
        list(map(len, present)),
        list(itertools.chain.from_iterable(map(dict.keys, present))),
        list(itertools.chain.from_iterable(map(dict.values, present))),
    )
