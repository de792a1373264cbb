"""`ZeroJaxFabricStrategy`: Lightning Fabric over a zerojax engine (see `zerojax.lightning`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl

from zerojax import distributed
from zerojax.config import Config
from zerojax.lightning import collectives
from zerojax.lightning.processes import ZeroJaxProcesses
from zerojax.lightning.target import check_submodule_calls
from zerojax.lightning.trainer import engine_of, precision_for_zerojax
from zerojax.train.initialize import initialize
from zerojax.train.module import ZeroModule

__all__ = ["ZeroJaxFabricStrategy"]


class ZeroJaxFabricStrategy(ZeroJaxProcesses, ParallelStrategy):
    """Fabric strategy: `fabric.setup(model, optimizer)` is `zerojax.initialize(model,
    optimizer, config)`. `Fabric(strategy=ZeroJaxFabricStrategy(config))` or
    `Fabric(strategy="zerojax")`, then `fabric.launch()` as for any parallel Fabric strategy
    (under torchrun it joins the job; Fabric refuses `setup` before it).

    `fabric.backward(loss)` is `loss.backward()` (the engine's pullback), the optimizer's step is
    the engine's update, `fabric.clip_gradients(model, opt, max_norm=...)` clips on the shards
    in one program, and `fabric.save/load` write and read torch-format state dicts (the
    module's gathered to the host, the optimizer's in torch.optim's layout). Call the set-up
    model itself: its submodules cannot train on their own (`zerojax.lightning.target`).
    Gradient accumulation: `fabric.no_backward_sync(model)` is accepted and does nothing (each
    backward adds its gradients into the engine's sharded accumulator inside its program; there
    is no separate all-reduce to skip).
    """

    strategy_name = "zerojax"

    def __init__(
        self,
        config: str | dict | Config | None = None,
        *,
        accelerator=None,
        checkpoint_io=None,
        precision: Precision | None = None,
    ):
        super().__init__(
            accelerator=accelerator,
            parallel_devices=[torch.device("cpu")],
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._zerojax_config = config
        self._backward_sync_control = _NothingToSkip()

    @property
    def precision(self) -> Precision:
        if self._precision is None:
            self._precision = Precision()
        return self._precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        # Fabric's "32-true" plugin is used as it is (clipping is this strategy's own); None
        # stays None until read, so Fabric hands its plugin for `precision=` here.
        self._precision = (
            None if precision is None else precision_for_zerojax(precision, Precision, Precision)
        )

    # --- processes: zerojax is the data parallelism -----------------------------------------

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        # None with one process: Fabric keeps the loader's own sampler (and its order).
        if distributed.world_size() == 1:
            return None
        return {"num_replicas": distributed.world_size(), "rank": distributed.rank()}

    def all_reduce(self, tensor, group=None, reduce_op="mean"):
        return collectives.reduce(tensor, reduce_op)

    # --- model and optimizers ---------------------------------------------------------------

    def module_to_device(self, module: torch.nn.Module) -> None:
        """The engine places the state."""

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        config = self.loaded_config()
        several = len(optimizers) > 1
        module, wrapped = initialize(module, optimizers if several else optimizers[0], config)
        check_submodule_calls(module, type(module)._zerojax_base.__name__)
        return module, list(wrapped) if several else [wrapped], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if isinstance(module, ZeroModule):
            return module
        module, _ = initialize(module, None, self.loaded_config())
        check_submodule_calls(module, type(module)._zerojax_base.__name__)
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise ValueError(
            "zerojax.lightning: set the model and its optimizers up together, "
            "fabric.setup(model, optimizer): zerojax.initialize takes both"
        )

    def clip_gradients_norm(
        self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite: bool = True
    ) -> torch.Tensor:
        """One program over all the engine's gradients (`ZeroModule.clip_grad_norm_`)."""
        norm = torch.tensor(
            float(engine_of(optimizer, module).clip_grad_norm(float(max_norm), float(norm_type)))
        )
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite")
        return norm

    def teardown(self) -> None:
        self.precision.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="zerojax: the model as one sharded JAX/XLA program (ZeRO 0-3)",
            override=True,
        )


class _NothingToSkip(_BackwardSyncControl):
    def no_backward_sync(self, module, enabled: bool):
        return contextlib.nullcontext()
