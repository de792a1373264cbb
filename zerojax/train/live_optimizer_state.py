"""The state of optimizers that run their own step, as the engine's `TrainState` holds it.

An optimizer that is not one of the compiled classes (RMSprop, Adafactor, Muon, Lion, a
user's own subclass: `zerojax.train.optimizer_shim`'s live path) keeps its state where torch
keeps it, in `optimizer.state[p]`: moments as live tensors on the plan's optimizer-state
sharding, step counts as host tensors, as torch's own step reads them (`.item()`, no host
sync). The engine's `TrainState.opt_state` is that state in the engine's terms, so that every
consumer of the TrainState sees it as it sees the compiled optimizers' state:

    {state key: {parameter name: jax.Array}}      e.g. {"step": {...}, "square_avg": {...}}

`gather` builds it from the torch optimizers (arrays as they are, host tensors placed
replicated); `scatter` writes such a tree back into them (a checkpoint restored, possibly onto
another mesh); `describe` and `abstract` are its shapes and dtypes without values (a checkpoint
records them, a restore into an optimizer that has not stepped yet builds its targets from
them); `state_shapes` finds what an optimizer will create without running it on real tensors
(the memory plan counts it): one step on `meta` parameters, host reads answering 1.

A parameter-shaped leaf takes its parameter's optimizer-state sharding (`plan.opt_state`:
ZeRO-1/2/3 partition it), everything else is replicated (`plan.optimizer_state_shardings`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerojax.bridge.dtypes import from_torch, host_array, to_jax_dtype, to_torch, to_torch_dtype
from zerojax.distributed.arrays import host_copy
from zerojax.train.live_tensor import LiveTensor, Owned

__all__ = [
    "abstract",
    "describe",
    "gather",
    "place_state",
    "scatter",
    "state_shapes",
    "unhooked_step",
]

# One optimizer on the live path: the torch optimizer and id(param) -> the engine's name.
LiveOptimizer = tuple[torch.optim.Optimizer, Mapping[int, str]]


def _named_states(optimizers: Iterable[LiveOptimizer]):
    """(parameter name, the param, its torch state dict) for every parameter with state."""
    for optimizer, names in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param)
                if state:
                    yield names[id(param)], param, state


def gather(optimizers: Iterable[LiveOptimizer], put, plan) -> dict[str, dict[str, jax.Array]]:
    """The optimizers' state as `{key: {name: array}}`. `put(array, sharding)` places a host
    value (a step count) on the engine's mesh; live tensors give their arrays (recorded work
    runs first). Raises ValueError for state torch's checkpoints hold but arrays cannot
    (a Python number, a float64 tensor), naming the parameter and key."""
    tree: dict[str, dict[str, jax.Array]] = {}
    for name, _param, state in _named_states(optimizers):
        for key, value in state.items():
            if isinstance(value, LiveTensor):
                array = value.array
            elif torch.is_tensor(value) and value.dtype not in (torch.float64, torch.complex128):
                array = host_array(value)  # placed by `put` below
            else:
                raise ValueError(
                    f"zerojax: optimizer state {key!r} of parameter {name!r} is "
                    f"{type(value).__name__}{_dtype_note(value)}; the engine holds optimizer "
                    f"state as tensors of float32 or narrower (keep it as a torch tensor, e.g. "
                    f"torch.tensor(value, dtype=torch.float32))"
                )
            tree.setdefault(key, {})[name] = array
    shardings = plan.optimizer_state_shardings(tree)
    return jax.tree.map(put, tree, shardings)


def _dtype_note(value) -> str:
    return f" of dtype {value.dtype}" if torch.is_tensor(value) else f" ({value!r})"


def scatter(
    tree: Mapping[str, Mapping[str, Any]], optimizers: Iterable[LiveOptimizer], put, plan
) -> None:
    """Write `tree` (`gather`'s layout) into the optimizers' state, each value on the plan's
    sharding. A key the torch state holds keeps its kind (a live tensor, or a host tensor as
    torch keeps step counts); a new one is a host tensor if 0-d, else a live tensor."""
    optimizers = list(optimizers)
    params = {
        names[id(p)]: (optimizer, p)
        for optimizer, names in optimizers
        for group in optimizer.param_groups
        for p in group["params"]
    }
    unknown = sorted({n for values in tree.values() for n in values} - set(params))
    if unknown:
        raise ValueError(
            f"zerojax: optimizer state for {unknown[:3]} (parameters the optimizers do not "
            f"update); the optimizers update {sorted(params)[:3]}..."
        )
    shardings = plan.optimizer_state_shardings(tree)
    for key, values in tree.items():
        for name, value in values.items():
            optimizer, param = params[name]
            state = optimizer.state[param]
            dtype = to_torch_dtype(value.dtype)
            current = state.get(key)
            host = (
                not isinstance(current, LiveTensor) if torch.is_tensor(current) else not value.ndim
            )
            if host:
                state[key] = to_torch(host_copy(value)).to(dtype)
            else:
                state[key] = LiveTensor.owning(put(value, shardings[key][name]), dtype)


def describe(tree: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, list]]:
    """`{key: {name: [shape, dtype name]}}` of a `gather` tree (JSON: a checkpoint's meta)."""
    return {
        key: {name: [list(v.shape), str(np.dtype(v.dtype))] for name, v in values.items()}
        for key, values in tree.items()
    }


def abstract(described: Mapping[str, Mapping[str, list]], plan) -> dict:
    """`jax.ShapeDtypeStruct`s of a `describe`d tree, on the plan's optimizer-state shardings."""
    shapes = {
        key: {name: jax.ShapeDtypeStruct(tuple(shape), to_jax_dtype(_torch_dtype(dtype)))
              for name, (shape, dtype) in values.items()}
        for key, values in described.items()
    }  # fmt: skip
    shardings = plan.optimizer_state_shardings(shapes)
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        shapes,
        shardings,
    )


def _torch_dtype(name: str) -> torch.dtype:
    return to_torch_dtype(np.dtype(name) if name != "bfloat16" else jax.numpy.bfloat16)


class _HostReadsAnswerOne(TorchDispatchMode):
    """`.item()` of a meta tensor returns 1: an optimizer's step reads values on the host
    (Adafactor's and ASGD's do) only to compute with them, not to decide what state exists."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1
        return func(*args, **(kwargs or {}))


def state_shapes(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str]
) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """`{key: {name: ShapeDtypeStruct}}` of the state `optimizer`'s own step creates, found by
    one step of a copy of it on `meta` parameters and gradients (no memory, no values;
    `optimizer` itself is untouched). Frozen parameters (no gradient in the step) get none."""
    twins = {}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            twin = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
            twin.grad = torch.empty_like(twin) if p.requires_grad else None
            twins[id(twin)] = names[id(p)]
            params.append(twin)
        # torch's fused kernels take CUDA tensors only; the state they make is foreach's.
        groups.append(
            {**group, "params": params, "fused": None}
            if group.get("fused")
            else {**group, "params": params}
        )
    copy = type(optimizer).__new__(type(optimizer))
    copy.__dict__.update(optimizer.__dict__)
    torch.optim.Optimizer.__init__(copy, groups, optimizer.defaults)
    with _HostReadsAnswerOne():
        unhooked_step(copy)()
    tree: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}
    for twin, state in copy.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                struct = jax.ShapeDtypeStruct(tuple(value.shape), to_jax_dtype(value.dtype))
                tree.setdefault(key, {})[twins[id(twin)]] = struct
    return tree


def place_state(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    plan,
    placed: dict[tuple[str, str], weakref.ref],
    on_device: bool = False,
    all_placed: bool = False,
) -> None:
    """Put each parameter-shaped state tensor (a moment, a momentum buffer) of `optimizer`'s
    parameters in `names` (id(param) -> the engine's name) on `plan`'s optimizer-state sharding
    of its parameter: ZeRO-1/2/3 partition it as they partition the compiled path's state, and
    `offload.optimizer: host` keeps it in host memory between steps (`on_device`: the same
    shards in device memory, where the step computes). Host tensors of that shape (from
    `load_state_dict`) become live ones; scalars (step counts) stay as torch keeps them.
    `placed`, kept by the caller between calls, notes the tensors placed already.
    `all_placed`: every state tensor was placed before -- after a captured step
    (`zerojax.train.captured_step`), which wrote into the tensors placed before it, or before
    a step bound to the last captured one's (`step_binding.held`): only offloaded ones move."""
    offloaded = "opt_state" in plan.offloaded
    if all_placed and not offloaded:
        return
    on_device = on_device and offloaded  # without offload the shards are on the devices
    # Without offload a state tensor once placed stays on its sharding (`Owned`): only
    # tensors not seen here before (a new state key, one `load_state_dict` put in) are
    # looked at.
    seen = None if offloaded else placed
    for param, state in optimizer.state.items():
        name = names.get(id(param))
        if name is None:
            continue
        sharding = plan.opt_state[name]
        if on_device:
            sharding = plan.on_device(sharding)
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            if seen is not None:
                known = seen.get((name, key))
                if known is not None and known() is value:
                    continue
            if tuple(value.shape) != tuple(param.shape):
                if seen is not None:  # a step count: stays as torch keeps it
                    seen[(name, key)] = weakref.ref(value)
                continue
            source = getattr(value, "_source", None)
            if isinstance(source, Owned):
                if source.sharding is not sharding:  # kept there from now on (`Owned`)
                    source.sharding = sharding
                    source.write(source.array)
                if seen is not None:
                    seen[(name, key)] = weakref.ref(value)
            elif isinstance(value, LiveTensor):
                if value.array.sharding != sharding:
                    value.write(jax.device_put(value.array, sharding))
            elif value.dim() > 0:
                array = jax.device_put(from_torch(value), sharding)
                state[key] = LiveTensor(Owned(array, sharding), value.shape, value.dtype)


def unhooked_step(optimizer: torch.optim.Optimizer):
    """`optimizer.step` without the step hooks torch's `Optimizer` wraps around it (its own and
    the global ones): the live path fires them around `ZeroOptimizer.step`, once; a twin's
    step fires none."""
    step = type(optimizer).step
    return functools.partial(getattr(step, "__wrapped__", step), optimizer)
