"""The optimizer handed back by `zerojax.initialize`: torch's interface, a sharded JAX update.

`ZeroOptimizer` is a `torch.optim.Optimizer` whose `param_groups` *are* the original
optimizer's (the same list), so an LR scheduler attached to either object drives the update:
every `step()` reads the current lr/betas/momentum/weight decay from them as traced values (no
recompilation). `state_dict()` / `load_state_dict()` speak torch's format.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import torch

from zerojax.runtime import effective_time
from zerojax.train import optimizers
from zerojax.train.engine import Engine


class ZeroOptimizer(torch.optim.Optimizer):
    """torch.optim interface over the engine's ZeRO-partitioned optimizer state."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine):
        # Optimizer.__init__ would rebuild param_groups; share the original's instead.
        self._optimizer = optimizer
        self._engine = engine
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = defaultdict(dict)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(optimizer).__name__}.zero_grad"
        engine.attach_optimizer(optimizer)

    @property
    def loss_scale(self) -> float | None:
        """Current fp16 loss scale (None without loss scaling)."""
        scale = self._engine.loss_scale
        return None if scale is None else float(scale["scale"])

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return self._engine.skipped_steps

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("zerojax: optimizer.step(closure) is not supported (LBFGS-style)")
        # An LR scheduler built on the original optimizer watches its step() for this flag.
        self._optimizer._opt_called = True
        hyper = optimizers.hyper_from_torch(self._optimizer, self._engine.optimizer_spec)
        self._engine.step(hyper)
        effective_time.LEDGER.step_done()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    def state_dict(self):
        engine = self._engine
        return optimizers.state_dict_from_jax(
            engine.optimizer_spec, engine.opt_state, self.param_groups
        )

    def load_state_dict(self, state_dict) -> None:
        engine = self._engine
        weights = engine.master if engine.master is not None else engine.params
        state = optimizers.load_state_dict_into_jax(
            engine.optimizer_spec,
            state_dict,
            weights,
            state_dtype=engine.policy.optimizer_state_dtype,
        )
        engine.opt_state = engine._place_opt_state(state)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def add_param_group(self, param_group) -> None:
        raise ValueError(
            "zerojax: add_param_group after initialize() is not supported; build the optimizer "
            "with all its groups before zerojax.initialize"
        )

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self._optimizer!r}, zero_stage={self._engine.plan.stage})"
