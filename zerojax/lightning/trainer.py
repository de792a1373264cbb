"""`ZeroJaxStrategy`: Lightning's Trainer over a zerojax engine (see `zerojax.lightning`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from zerojax import distributed
from zerojax.config import Config
from zerojax.lightning import collectives
from zerojax.lightning.processes import ZeroJaxProcesses
from zerojax.lightning.target import check_submodule_calls, training_module
from zerojax.train.initialize import initialize
from zerojax.train.module import ZeroModule
from zerojax.train.optimizer_shim import ZeroOptimizer

__all__ = ["ZeroJaxPrecision", "ZeroJaxStrategy"]


def engine_of(*objects: Any):
    """The engine behind a wrapped module or optimizer (through Lightning's and Fabric's
    wrappers: LightningOptimizer is itself a subclass of the optimizer it wraps)."""
    for obj in objects:
        for candidate in (obj, *(getattr(obj, a, None) for a in _WRAPPED_ATTRIBUTES)):
            if isinstance(candidate, (ZeroModule, ZeroOptimizer)):
                return candidate.engine
    raise ValueError(
        f"zerojax.lightning: none of {[type(o).__name__ for o in objects]} belongs to a zerojax "
        f"engine (set the model up with the zerojax strategy first)"
    )


# Where Lightning's wrappers keep what they wrap (_FabricOptimizer.optimizer,
# _FabricModule._forward_module, LightningOptimizer._optimizer).
_WRAPPED_ATTRIBUTES = ("optimizer", "_forward_module", "_optimizer")


class ZeroJaxPrecision(Precision):
    """Lightning's full-precision plugin, with gradient-norm clipping done on the engine's
    shards in one program (`Engine.clip_grad_norm`) instead of torch's loop over `p.grad`.
    Mixed precision is zerojax's own policy (the config's `precision:` section), not a plugin."""

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        engine_of(optimizer).clip_grad_norm(float(clip_val))


def precision_for_zerojax(plugin: Any, precision_type: type, zerojax_type: type):
    """The plugin the zerojax strategy uses in place of `plugin` (Lightning's default for
    "32-true" becomes `zerojax_type`); any other precision is refused, naming the way."""
    if plugin is None or type(plugin) is precision_type:
        return zerojax_type()
    if isinstance(plugin, zerojax_type):
        return plugin
    raise ValueError(
        f"zerojax.lightning: precision plugin {type(plugin).__name__} is not supported; keep "
        f"Lightning's precision at '32-true' and set mixed precision in the zerojax config "
        f"(precision: {{param_dtype: bfloat16, ...}}), which the engine's programs apply"
    )


class ZeroJaxStrategy(ZeroJaxProcesses, ParallelStrategy):
    """Lightning Trainer strategy: the LightningModule's model runs as zerojax's sharded
    program. `Trainer(strategy=ZeroJaxStrategy(config))` or `Trainer(strategy="zerojax")`.

    `config`: as for `zerojax.initialize` (path, dict, Config; None = data-parallel over all
    devices, ZeRO-0, fp32). `module`: the path of the submodule `training_step` calls to run
    the model ("" for the LightningModule itself); None chooses as
    `zerojax.lightning.target.training_module` says (the one child holding all parameters,
    else the LightningModule when it defines forward). `configure_optimizers` runs first, on
    the plain model, then `zerojax.initialize(module, optimizers, config)`.
    """

    strategy_name = "zerojax"

    def __init__(
        self,
        config: str | dict | Config | None = None,
        *,
        module: str | None = None,
        accelerator=None,
        checkpoint_io=None,
        precision_plugin: Precision | None = None,
    ):
        super().__init__(
            accelerator=accelerator,
            # CPU: batches stay on the host (the engine shards them over its devices); this
            # also makes Lightning pick its CPU accelerator.
            parallel_devices=[torch.device("cpu")],
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._zerojax_config = config
        self._module_path = module

    # --- the engine's precision -------------------------------------------------------------

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroJaxPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # None stays None until read: the Trainer then hands its own plugin for its
        # `precision=` flag here, where anything but "32-true" is refused.
        self._precision_plugin = (
            None if plugin is None else precision_for_zerojax(plugin, Precision, ZeroJaxPrecision)
        )

    # --- processes: zerojax is the data parallelism -----------------------------------------

    @property
    def node_rank(self) -> int:
        job = distributed.job()
        return job.rank // max(job.local_world_size, 1)

    @property
    def num_processes(self) -> int:
        return distributed.world_size()

    @property
    def is_distributed(self) -> bool:
        """Lightning gives each process a DistributedSampler share with several processes."""
        return distributed.world_size() > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": distributed.world_size(), "rank": distributed.rank()}

    def set_world_ranks(self) -> None:
        """Ranks come from the launcher's environment (`zerojax.distributed`)."""

    def reduce(self, tensor, group=None, reduce_op="mean"):
        return collectives.reduce(tensor, reduce_op)

    # --- model and optimizers ---------------------------------------------------------------

    def model_to_device(self) -> None:
        """The engine places the state; before setup the module stays where it was built."""

    def setup(self, trainer) -> None:
        """Lightning's setup with `zerojax.initialize` after `configure_optimizers`: the user's
        optimizers and LR schedulers are built from the ordinary parameters as in any run, and
        initialize then takes both (the wrapped optimizers share the param groups, so the
        schedulers drive the engine's update)."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        lightning_module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        path, target = training_module(lightning_module, self._module_path)
        if fitting:
            self.setup_optimizers(trainer)
        optimizers = self.optimizers if fitting else []
        if isinstance(target, ZeroModule):  # a second fit/validate on the same model
            # As initialize wraps them: several optimizers each run their own step.
            several = len(optimizers) > 1
            wrapped = [
                ZeroOptimizer(each, target.engine, compiled=False if several else None,
                              reports_steps=i == 0)
                for i, each in enumerate(optimizers)
            ]  # fmt: skip
        else:
            label = type(lightning_module).__name__ + (f".{path}" if path else "")
            config = self.loaded_config()
            several = len(optimizers) > 1
            _, wrapped = initialize(
                target, (optimizers if several else optimizers[0]) if optimizers else None, config
            )
            wrapped = [] if wrapped is None else wrapped if several else [wrapped]
            check_submodule_calls(target, label)
        if fitting:
            self.optimizers = wrapped
        self.setup_precision_plugin()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # The engine places the state on its shardings; no device move afterwards.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(state)

    def teardown(self) -> None:
        """Lightning's teardown moves the model to the CPU; the engine's state stays put."""
        self.precision_plugin.teardown()
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
