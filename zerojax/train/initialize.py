"""zerojax.initialize: wrap a torch model and optimizer; the training loop stays as it is."""

from __future__ import annotations

from typing import Any

import torch

from zerojax import distributed
from zerojax.config import Config, apply_devices, load_config
from zerojax.integrations import accelerate as accelerate_integration
from zerojax.integrations import hf_trainer as hf_trainer_integration
from zerojax.runtime import effective_time, worker_processes
from zerojax.runtime.compilation_cache import enable_compilation_cache
from zerojax.train import (
    foreach_default,
    late_optimizers,
    recorded_adafactor,
    recorded_adam,
    replay,
)
from zerojax.train.engine import Engine
from zerojax.train.module import ZeroModule, zero_module
from zerojax.train.optimizer_config import build_optimizer, check_optimizer_matches_config
from zerojax.train.optimizer_shim import ZeroOptimizer
from zerojax.train.parameters import release_parameters


def initialize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    config: str | dict | Config | None = None,
    *,
    example_inputs: tuple | None = None,
    loss_fn=None,
    fused: bool | None = None,
    seed: int | None = None,
) -> tuple[ZeroModule, ZeroOptimizer | list[ZeroOptimizer] | None]:
    """Move `model`'s state into sharded JAX arrays; return the model itself (its forward now
    the engine's program) and the wrapped optimizer.

    >>> model, optimizer = zerojax.initialize(model, optimizer, config="mesh.yaml")
    >>> loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    >>> loss.backward(); optimizer.step(); optimizer.zero_grad()

    `config`: path (YAML/JSON/DeepSpeed JSON), dict or loaded Config; None = one data-parallel
    axis over all devices, ZeRO stage 0, fp32. Its `devices` section is applied to JAX here if
    JAX has not started yet (else it must match the running backend). With `optimizer=None`
    and an `optimizer:` section, the torch optimizer is built from it (and returned, wrapped);
    a passed optimizer must agree with that section. `optimizer` may be a list (Muon for the
    matrices beside AdamW for the rest, as torch's Muon docs advise): a list of wrapped
    optimizers comes back, each running torch's own step on the live tensors
    (`zerojax.train.optimizer_shim`). `example_inputs` traces now instead of on the
    first call. `loss_fn(outputs, target)` is traced into the program: call the model as
    `model(*inputs, target)` and it returns the loss, computed forward and backward in one
    fused program (as happens automatically when the model returns a scalar or `.loss`);
    `fused=False` turns that off. `seed` seeds dropout (default: drawn from torch's RNG state,
    which is left as it was: initialize never advances it).
    After this call the engine's sharded arrays are the parameters' only copy, and the torch
    parameters are live views of them (`zerojax.train.parameters`): `p.grad`, `p.data`,
    `model.module.state_dict()`, `torch.nn.utils.clip_grad_norm_` and in-place ops read and
    write the engine's state, on the shards. The config's `runtime` section turns on JAX's
    persistent compilation cache and the effective-training-time report (see
    `zerojax.train.effective_time`).

    Under torchrun or SLURM with several processes this joins the job first
    (`zerojax.distributed.initialize`), `devices.num_cpu_devices` counts each process's devices,
    and the semantics are DDP's: each process feeds its own rows, `model(x)` returns them, and the
    update uses the gradient averaged over processes (see `zerojax.parallel.placement`).

    Hugging Face accelerate works before or after this call (`zerojax.integrations.accelerate`):
    a model `accelerator.prepare` wrapped comes back unwrapped, and an `AcceleratedOptimizer`
    comes back as itself, now driving the ZeroOptimizer; a zerojax model is never DDP-wrapped.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize() takes a torch.nn.Module, got {type(model).__name__}")
    # Hugging Face accelerate in either order (zerojax.integrations.accelerate): never a DDP
    # wrap around the model from here on; objects `accelerator.prepare` made are unwrapped.
    accelerate_integration.install_prepare_hook()
    foreach_default.install()  # torch.optim picks its foreach steps for live parameters
    replay.install()  # recorded live-tensor work traced once, then replayed
    recorded_adam.install()  # ... and its foreach Adam/AdamW step is one recorded op
    recorded_adafactor.install()  # ... and Adafactor's step too, without its host reads
    late_optimizers.install()  # optimizers built after this call: state on the ZeRO plan
    prepared = accelerate_integration.unwrap_prepared(model, optimizer)
    model, optimizer = prepared.model, prepared.optimizer
    if isinstance(model, ZeroModule):
        raise ValueError(  # noqa: TRY004 (the right type, in a state it cannot be used in)
            f"zerojax.initialize: this {type(model)._zerojax_base.__name__} was already "
            f"initialized (its state lives in an engine); initialize a fresh model, or "
            f"copy.deepcopy(model) for an ordinary copy with the current values"
        )
    # Under torchrun/SLURM with several processes: join the job before anything starts JAX's
    # backends (load_config may, to count devices); a no-op for one process.
    distributed.initialize()
    # The one load: everything below takes this Config.
    config = load_config({"mesh": {"data": -1}} if config is None else config, trainer_autos=True)
    apply_devices(config.devices)  # before anything below starts JAX's backends
    # The Trainer's hooks (zerojax.integrations.hf_trainer); a config with "auto" values left
    # for a Trainer imports it now, so that the Trainer built next takes the model.
    hf_trainer_integration.install_trainer_hooks(import_trainer=bool(config.trainer_autos))
    several = isinstance(optimizer, (list, tuple))
    # One optimizer (or none), or several: each path below holds its own.
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else []
    single = None if isinstance(optimizer, (list, tuple)) else optimizer
    if several and (not optimizers or config.optimizer is not None):
        raise ValueError(
            "zerojax.initialize: a list of optimizers must be non-empty, and cannot be combined "
            "with the config's optimizer: section"
        )
    if several and config.train.gradient_accumulation_steps > 1:
        raise ValueError(
            "zerojax.initialize: several optimizers with train.gradient_accumulation_steps > 1 "
            "is not supported (each step() would count a micro-step); accumulate in the loop "
            "instead"
        )
    if config.optimizer is not None:
        if single is None:
            single = build_optimizer(config.optimizer, model)
        else:
            check_optimizer_matches_config(single, config.optimizer)
    runtime = config.runtime
    enable_compilation_cache(runtime.compilation_cache_dir)
    # DataLoader workers started from here on: forkserver where safe, never a warned fork.
    worker_processes.install()
    ledger = effective_time.LEDGER
    # Several processes: one report, rank 0's; the log is one file per rank, and `zerojax ett`
    # accounts for the job across ranks and restarts.
    ledger.begin(
        log_path=runtime.effective_time_log,
        report_at_exit=runtime.report_effective_time and distributed.rank() == 0,
        rank=distributed.rank(),
        world_size=distributed.world_size(),
        attempt=distributed.job().restart_count,
    )
    with ledger.measure("init", model=type(model).__name__):
        engine = Engine(model, config, loss_fn=loss_fn, fused=fused, seed=seed)
        ledger.attach(engine)
        wrapped_optimizer: ZeroOptimizer | list[ZeroOptimizer] | None = None
        if several:
            for each in optimizers:
                _check_optimizer_covers_model(model, each)
            wrapped_optimizer = [
                ZeroOptimizer(each, engine, compiled=False, reports_steps=i == 0)
                for i, each in enumerate(optimizers)
            ]
        elif single is not None:
            _check_optimizer_covers_model(model, single)
            wrapped_optimizer = ZeroOptimizer(single, engine)
        release_parameters(model, engine)
        wrapped = zero_module(model, engine)
    if example_inputs is not None:
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        engine.converted(model.training, args, {})
    return wrapped, prepared.rewrap(wrapped, wrapped_optimizer)


def _check_optimizer_covers_model(model: torch.nn.Module, optimizer: Any) -> None:
    model_params = {id(p) for p in model.parameters()}
    foreign = [
        i
        for i, group in enumerate(optimizer.param_groups)
        if any(id(p) not in model_params for p in group["params"])
    ]
    if foreign:
        raise ValueError(
            f"zerojax.initialize: optimizer param_groups {foreign} hold tensors that are not "
            f"parameters of {type(model).__name__}; build the optimizer from model.parameters()"
        )
