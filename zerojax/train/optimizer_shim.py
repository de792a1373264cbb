"""The optimizer handed back by `zerojax.initialize`: torch's interface, a sharded JAX update.

`ZeroOptimizer` is a `torch.optim.Optimizer` (built through `Optimizer.__init__`: step hooks
fire, `step(closure)` works) whose `param_groups` *are* the original optimizer's (the same
list), so an LR scheduler attached to either object drives the update: every `step()` reads the
current lr/betas/momentum/weight decay from them as traced values (no recompilation).
`state_dict()` / `load_state_dict()` speak torch's format.
"""

from __future__ import annotations

import torch

from zerojax.runtime import effective_time
from zerojax.train import optimizers
from zerojax.train.engine import Engine


class ZeroOptimizer(torch.optim.Optimizer):
    """torch.optim interface over the engine's ZeRO-partitioned optimizer state."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: Engine):
        self._optimizer = optimizer
        self._engine = engine
        # Optimizer.__init__ sets up the hooks (register_step_pre_hook/post_hook fire around
        # step()) and the state; the groups it builds are then replaced by the original's own
        # list, so an LR scheduler attached to either object drives the update.
        self._adopting_groups = True
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._adopting_groups = False
        self.param_groups = optimizer.param_groups
        engine.attach_optimizer(optimizer)

    @property
    def engine(self) -> Engine:
        """The engine whose TrainState holds this optimizer's state."""
        return self._engine

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The user's torch optimizer (its param_groups are this object's)."""
        return self._optimizer

    @property
    def loss_scale(self) -> float | None:
        """Current fp16 loss scale (None without loss scaling)."""
        scale = self._engine.state.loss_scale
        return None if scale is None else float(scale["scale"])

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return self._engine.state.skipped_steps

    def step(self, closure=None):
        """One update (see `Engine.step`). `closure`, as torch's optimizers take it (Lightning
        passes one), is called first with gradients enabled; its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # An LR scheduler built on the original optimizer watches its step() for this flag.
        self._optimizer._opt_called = True
        hyper = optimizers.hyper_from_torch(self._optimizer, self._engine.optimizer_spec)
        if self._engine.step(hyper):
            effective_time.LEDGER.step_done(self._engine.state.step)
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` applies the update: always without gradient accumulation,
        every `gradient_accumulation_steps`-th call with it (DeepSpeed's name and meaning).
        Step an LR scheduler only when this was True before `step()` to keep its schedule in
        optimizer updates rather than micro-batches."""
        return self._engine.is_gradient_accumulation_boundary()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients (ignored between the micro-steps of a gradient
        accumulation, as DeepSpeed does)."""
        self._engine.zero_grad()

    def state_dict(self):
        engine = self._engine
        return optimizers.state_dict_from_jax(
            engine.optimizer_spec, engine.state.opt_state, self.param_groups
        )

    def load_state_dict(self, state_dict) -> None:
        engine = self._engine
        opt_state = engine.optimizer_state_from_torch(state_dict)
        engine.load(engine.state.replace(opt_state=opt_state))
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def add_param_group(self, param_group) -> None:
        if getattr(self, "_adopting_groups", False):  # Optimizer.__init__, adopting the groups
            super().add_param_group(param_group)
            return
        raise ValueError(
            "zerojax: add_param_group after initialize() is not supported; build the optimizer "
            "with all its groups before zerojax.initialize"
        )

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self._optimizer!r}, zero_stage={self._engine.plan.stage})"
