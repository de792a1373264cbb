"""What the Trainer and the Fabric strategy share: zerojax is the data parallelism.

The launcher's processes (torchrun, SLURM) are Lightning's ranks; batches stay on the host (the
engine shards them over its JAX devices); Lightning's cross-process calls go over JAX
(`zerojax.lightning.collectives`); the config is loaded once, when the processes join.
"""

from __future__ import annotations

from typing import Any

import torch

from zerojax import distributed
from zerojax.config import Config, apply_devices, load_config
from zerojax.lightning import collectives


def prepare_config(config: str | dict | Config | None) -> Config:
    """The config, loaded once, its `devices` applied; gradient accumulation belongs to the
    framework's loop (each backward adds its gradients; the loop scales the loss)."""
    distributed.initialize()  # before anything starts JAX's backends (a no-op for one process)
    config = load_config({"mesh": {"data": -1}} if config is None else config)
    apply_devices(config.devices)
    if config.train.gradient_accumulation_steps > 1:
        raise ValueError(
            f"zerojax.lightning: train.gradient_accumulation_steps="
            f"{config.train.gradient_accumulation_steps} in the zerojax config; accumulate with "
            f"Lightning instead (Trainer(accumulate_grad_batches=N), or Fabric's "
            f"no_backward_sync loop), which scales the loss and steps the optimizer itself"
        )
    return config


class ZeroJaxProcesses:
    """Mixed in before Lightning's strategy base class (Trainer's or Fabric's); the strategy
    sets `_zerojax_config` (a path, dict, Config or None) in its `__init__`."""

    _zerojax_config: str | dict | Config | None

    def loaded_config(self) -> Config:
        if not isinstance(self._zerojax_config, Config):
            self._zerojax_config = prepare_config(self._zerojax_config)
        return self._zerojax_config

    @property
    def root_device(self) -> torch.device:
        # Batches stay on the host; the engine shards them over its devices.
        return torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return distributed.rank()

    @property
    def local_rank(self) -> int:
        return distributed.local_rank()

    @property
    def world_size(self) -> int:
        return distributed.world_size()

    def setup_environment(self) -> None:
        # Join the job now: Lightning broadcasts (the checkpoint directory) before `setup`.
        self.loaded_config()
        super().setup_environment()

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        collectives.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast(obj, src)

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return collectives.all_gather(tensor)
