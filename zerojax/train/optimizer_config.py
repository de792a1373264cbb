"""The config's `optimizer:` section against torch: build the optimizer, or check the user's.

`zerojax.initialize(model, None, config)` builds `torch.optim.<type>(model.parameters(),
**params)` (DeepSpeed's behaviour when the client passes no optimizer). When the user passes
an optimizer too, the two must agree: a differing type, or a hyperparameter the config sets
that no param group has, is a ValueError naming the key, the config value and the torch
value. An error, not a warning, because either choice would train with a value written in
one of the two places and silently ignore the other; the fix (drop one) is one line. Param
groups that override a value (nanoGPT's weight_decay=0 for biases) are torch's per-group
options and are accepted as long as some group has the config's value.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zerojax.config import OPTIMIZER_TYPES, OptimizerConfig

__all__ = ["build_optimizer", "check_optimizer_matches_config"]

# optimizer.type -> the torch.optim class (the schema's names are torch's, lower-cased).
_CLASSES = {
    name.lower(): cls
    for name, cls in vars(torch.optim).items()
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
    and name.lower() in OPTIMIZER_TYPES
}  # fmt: skip
# A float32 tensor lr holds the config's float64 value to within one float32 ulp (6e-8 rel).
_REL_TOL = 1e-6


def build_optimizer(config: OptimizerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """`torch.optim.<config.type>(model.parameters(), **config.params)`."""
    return _CLASSES[config.type](model.parameters(), **config.kwargs)


def _torch_type(optimizer: torch.optim.Optimizer) -> str:
    name = type(optimizer).__name__.lower()
    # torch's Adam with decoupled weight decay is AdamW (torch 2.13 documents them equal).
    if name == "adam" and optimizer.defaults.get("decoupled_weight_decay", False):
        return "adamw"
    return name


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


def _same(config_value: Any, torch_value: Any) -> bool:
    if isinstance(config_value, tuple):
        return (
            isinstance(torch_value, tuple)
            and len(config_value) == len(torch_value)
            and all(_same(a, b) for a, b in zip(config_value, torch_value))
        )
    if torch_value is None or isinstance(config_value, bool) or isinstance(torch_value, bool):
        return config_value == torch_value
    return math.isclose(config_value, torch_value, rel_tol=_REL_TOL, abs_tol=0.0)


def check_optimizer_matches_config(
    optimizer: torch.optim.Optimizer, config: OptimizerConfig
) -> None:
    """Raise ValueError if `optimizer` contradicts the config's `optimizer:` section."""
    torch_type = _torch_type(optimizer)
    if torch_type != config.type:
        hint = ""
        if (config.type, torch_type) == ("adamw", "adam"):
            hint = " (a DeepSpeed 'Adam' is AdamW unless optimizer.params.adam_w_mode is false)"
        raise ValueError(
            f"optimizer.type={config.type!r} in the config, but the torch optimizer passed to "
            f"zerojax.initialize is {type(optimizer).__name__}{hint}; pass optimizer=None to "
            "have zerojax build it from the config, or remove the config's optimizer section"
        )
    for key, value in config.params:
        # A scheduler built before initialize has already moved lr; its start is initial_lr.
        found = [
            _plain(group.get("initial_lr", group[key]) if key == "lr" else group.get(key))
            for group in optimizer.param_groups
        ]
        if not any(_same(value, v) for v in found):
            shown = found[0] if len(set(map(repr, found))) == 1 else found
            raise ValueError(
                f"optimizer.params.{key}={list(value) if isinstance(value, tuple) else value!r} "
                f"in the config, but the torch {type(optimizer).__name__} has {key}={shown!r} "
                f"in {'every param group' if len(found) > 1 else 'its param group'}; make them "
                "agree, or pass optimizer=None to have zerojax build it from the config"
            )
