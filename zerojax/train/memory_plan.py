"""`zerojax.memory_report`: the memory a config costs, measured on the engine training would run.

It builds the same `Engine` that `zerojax.initialize` builds (same plan, precision policy,
master weights, optimizer state layout, kernels) from the unwrapped module, runs one real
micro-batch through the programs training runs (the fused loss-and-gradients program when the
model returns its own loss, else forward-with-vjp and backward) and the optimizer update, then
reports the per-device bytes of each `TrainState` component beside the ZeRO formula
(`zerojax.sharding.memory`) and the `memory_analysis()` of each compiled program: the very
executables a training step calls, not a stand-in.

    >>> report = zerojax.memory_report(model, (tokens,), "examples/zero3.yaml")
    >>> print(report)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import torch

from zerojax.bridge.convert import Converted, Static
from zerojax.config import Config, load_config
from zerojax.sharding.memory import MemoryReport, measure_memory
from zerojax.train import live_optimizer_state, optimizers
from zerojax.train.engine import Engine
from zerojax.train.optimizer_config import build_optimizer
from zerojax.train.programs import find_scalar_loss, is_float

__all__ = ["memory_report"]


def memory_report(
    model: torch.nn.Module | Converted,
    args: tuple,
    config: Config | Mapping | str,
    *,
    mesh=None,
    loss_fn: Callable | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    run_step: bool = True,
    abstract: bool = False,
) -> MemoryReport:
    """Build the training engine `config` describes for `model` and measure its state.

    `model`: a torch module (not yet wrapped by `zerojax.initialize`) or a `zerojax.convert`
    result (its module is used). `args`: example inputs, batch dim first; a batch that does not
    split over the batch axes is repeated until it does (noted in the report). `loss_fn`: as in
    `zerojax.initialize`, a torch `loss_fn(outputs, target)` traced with the model, `target`
    being the last of `args`. `optimizer`: a torch optimizer over the module's parameters, or a
    callable `params -> optimizer`; default: the config's `optimizer:` section, as
    `zerojax.initialize` builds it, else `torch.optim.AdamW(params, lr=1e-3)`.

    With `run_step`, one micro-batch runs through the training programs and one optimizer
    update is applied (to the engine's copy; `model` is not changed), so `report.programs`
    holds each compiled program's `memory_analysis()` and the gradients are the ones the step
    produced. Without it nothing is compiled and the gradients are zeros placed per
    `plan.grads` in the policy's grad dtype (the same bytes).

    `abstract=True` plans without memory: the engine holds shapes and shardings, not arrays
    (`Engine(abstract=True)`), so `model` may live on the `meta` device and `args` be meta
    tensors; the step's programs are compiled for the mesh and never run, and each component's
    bytes per device are read off its shardings (the same numbers the arrays would have).
    """
    module = model.module if isinstance(model, Converted) else model
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"memory_report takes a torch.nn.Module or a zerojax.convert result, got "
            f"{type(model).__name__}"
        )
    if not isinstance(config, Config):
        config = load_config(config)
    engine = Engine(module, config, loss_fn=loss_fn, seed=0, mesh=mesh, abstract=abstract)
    torch_optimizer: torch.optim.Optimizer
    if optimizer is None and config.optimizer is not None:
        torch_optimizer = build_optimizer(config.optimizer, module)  # as initialize builds it
    elif optimizer is None:
        torch_optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    elif isinstance(optimizer, torch.optim.Optimizer):
        torch_optimizer = optimizer
    else:
        torch_optimizer = optimizer(module.parameters())
    notes: list[str] = []
    compiled = type(torch_optimizer) in optimizers.SUPPORTED_OPTIMIZERS.values()
    if compiled:
        engine.attach_optimizer(torch_optimizer)
        opt_state = None  # the engine's, after the step
    else:
        opt_state = _own_step_state(engine, module, torch_optimizer)
        notes.append(
            f"{type(torch_optimizer).__name__} runs its own step: its state is what one step of "
            f"it on meta tensors creates, on the plan's optimizer-state shardings"
        )
    if run_step:
        grads = _run_one_step(engine, module, torch_optimizer, tuple(args), notes, compiled)
    else:
        shardings, dtype = engine.plan.grads, engine.policy.grad_dtype
        grads = {
            n: engine.placement.filled(jax.ShapeDtypeStruct(p.shape, dtype), 0, shardings[n])
            for n, p in engine.state.params.items()
            if is_float(p)
        }
        notes.append("gradients placed per the plan; the step was not run")
    state = engine.state
    return measure_memory(
        engine.plan,
        params=state.params,
        grads=grads,
        opt_state=state.opt_state if opt_state is None else opt_state,
        master_weights=state.master,
        programs=engine.compiled_programs(),
        host_computed=("update",) if engine.programs.updates_on_host(state.master) else (),
        notes=tuple(notes),
    )


def _own_step_state(engine: Engine, module, optimizer: torch.optim.Optimizer) -> Any:
    """The state `optimizer` (one running its own step) makes, placed as training places it
    (`zerojax.train.live_optimizer_state`); abstract engines get shapes with shardings."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), engine.alias[name])
    shapes = live_optimizer_state.state_shapes(optimizer, names)
    shardings = engine.plan.optimizer_state_shardings(shapes)
    return jax.tree.map(
        lambda s, sharding: engine.placement.filled(s, 0, sharding), shapes, shardings
    )


def _run_one_step(
    engine: Engine, module, optimizer, args: tuple, notes: list[str], compiled: bool = True
) -> Any:
    """One micro-batch through the programs `zerojax.train.module.ZeroModule` would call, then
    one update (`compiled`: the engine's; an optimizer running its own step is left out, noted);
    returns the gradients the micro-batch produced."""
    args = _even_batch(args, engine, notes)
    converted = engine.converted(module.training, args, {})
    # As ZeroModule.forward feeds them: tensors batch-sharded, other arguments Static.
    placement = engine.placement
    jax_args = tuple(
        engine.shard_input(placement.value_of(a))
        if isinstance(a, torch.Tensor)
        else a
        if isinstance(a, np.ndarray | jax.Array)
        else Static(a)
        for a in args
    )
    loss_path = None
    if engine.fused is not False:

        def outputs_of(params, buffers, inputs):
            return converted.apply(params, buffers, *inputs, rng=jax.random.key(0))[0]

        # Shapes alone (no placement: offloaded params are in host memory, where no op runs).
        params = {n: jax.ShapeDtypeStruct(p.shape, p.dtype) for n, p in engine.state.params.items()}
        shapes = jax.eval_shape(outputs_of, params, engine.state.buffers, jax_args)
        loss_path = find_scalar_loss(shapes)
    if loss_path is not None:
        _, grads, _ = engine.fused_forward(converted, jax_args, {}, loss_path)
        engine.accumulate(grads)
    else:
        differentiable = (False,) * len(jax_args)
        outputs, pullback = engine.forward(converted, jax_args, {}, differentiable=differentiable)
        # torch's loss.backward() feeds the backward program one cotangent per output; ones
        # stand in for them (the values do not change any array's bytes; abstract: the
        # outputs' shapes, dtypes and shardings, all the program uses).
        cotangents = jax.tree.map(lambda x: placement.filled(x, 1 if is_float(x) else 0), outputs)
        engine.backward(converted, pullback, cotangents)
        notes.append(
            "the model returns no loss of its own: forward_vjp + backward, as under a torch loss"
        )
    grads = engine.state.grads
    if compiled:
        engine.update(optimizers.hyper_from_torch(optimizer, engine.optimizer_spec))
    else:
        notes.append("the optimizer's own step is not run: no update program to measure")
    return grads


def _even_batch(args: tuple, engine: Engine, notes: list[str]) -> tuple:
    """Example args with the batch dim repeated up to a multiple of the batch-axes size, so the
    report shows data-parallel programs (training replicates an uneven batch instead)."""
    plan = engine.plan
    split = math.prod(plan.mesh.shape[a] for a in plan.batch_axes)
    dim, out = plan.batch_dim, []
    for x in args:
        if isinstance(x, torch.Tensor) and x.ndim > dim and x.shape[dim] % split:
            size = x.shape[dim]
            target = math.lcm(size, split)
            x = torch.cat([x] * (target // size), dim=dim)
            notes.append(
                f"example batch {size} repeated to {target} to split over "
                f"{'x'.join(plan.batch_axes)}={split}"
            )
        out.append(x)
    return tuple(out)
