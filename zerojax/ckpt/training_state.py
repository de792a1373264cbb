"""The Engine's training state as checkpoint items, and abstract targets to restore it into.

Saving reads the engine (`gather_items`, `build_meta`); restoring compares the checkpoint's
`meta` with the current model (`parameter_differences`, `optimizer_differences`), builds
`jax.ShapeDtypeStruct` targets carrying the *current* engine's shardings and dtypes
(`model_target`, `optimizer_target`, `train_state_target`) so that Orbax reads each shard
straight onto the current mesh, and writes the result back (`apply_*`). The item names and
meta keys are those of `zerojax.ckpt.layout`.

    >>> items = gather_items(engine)              # {"model": {...}, "optimizer": ..., ...}
    >>> target, args = model_target(engine, meta["parameters"])
    >>> engine.load(apply_model(engine.state, restored_model, source))
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import torch

from zerojax.ckpt import layout
from zerojax.ckpt.errors import CheckpointError
from zerojax.train import late_optimizers, live_optimizer_state

log = logging.getLogger("zerojax")

# --------------------------------------------------------------------------- reaching the engine


def engine_of(model: Any):
    """The Engine behind the ZeroModule returned by `zerojax.initialize`."""
    engine = getattr(model, "engine", None)
    if engine is None or not hasattr(engine, "plan"):
        raise TypeError(
            f"zerojax checkpointing needs the model returned by zerojax.initialize (a ZeroModule),"
            f" got {type(model).__name__}"
        )
    return engine


def torch_optimizer_of(optimizer: Any, engine) -> torch.optim.Optimizer | None:
    """The user's torch optimizer behind the ZeroOptimizer (its param_groups hold the lr etc.),
    or a torch optimizer built on the model's parameters after initialize."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "torch_optimizer", None)
    if inner is None and isinstance(optimizer, torch.optim.Optimizer):
        # Built on the model's parameters after initialize (minGPT's trainer, the HF Trainer):
        # its state joins the engine's TrainState, as that of one handed to initialize --
        # the compiled update's (`late_optimizers`), or else as one running its own step.
        adopted = late_optimizers.compiled_for(optimizer)
        if adopted is None:
            engine.adopt_built_optimizer(optimizer)
            return optimizer
        inner, optimizer = optimizer, adopted  # its engine is checked below
    if inner is None or getattr(optimizer, "engine", None) is not engine:
        raise TypeError(
            f"zerojax checkpointing needs the optimizer returned by zerojax.initialize together "
            f"with the model it came with, got {type(optimizer).__name__}"
        )
    return inner


# --------------------------------------------------------------------------- JSON


def to_json(value: Any, where: str) -> Any:
    """`value` as plain JSON types (tensors/arrays -> numbers or lists, tuples -> lists);
    raises CheckpointError naming `where` (e.g. `extra['batch']`) for anything else."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        return np.asarray(array).tolist()
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise CheckpointError(
                    f"{where}: key {k!r} of type {type(k).__name__} cannot be stored as JSON; "
                    f"use str or int keys"
                )
            out[str(k) if isinstance(k, str) else k] = to_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise CheckpointError(
        f"{where} = {value!r} (type {type(value).__name__}) is not JSON-serialisable; checkpoint "
        f"metadata holds only numbers, strings, bools, None, lists, dicts and tensors/arrays"
    )


def config_as_json(config: Any) -> Any:
    """`dataclasses.asdict(config)` in JSON types; values JSON cannot hold become their repr."""
    raw = dataclasses.asdict(config)
    return json.loads(json.dumps(raw, default=repr))


# --------------------------------------------------------------------------- meta


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def parameter_table(engine) -> dict[str, dict]:
    """`meta["parameters"]` of the current model (see layout.py), in state_dict order."""
    state = engine.state
    weights = state.weights
    param_names = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    table = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        canonical = engine.alias.get(name, name)
        source = weights.get(canonical)
        if source is None:
            source = state.buffers[canonical]
        table[name] = {
            "shape": list(tensor.shape),
            "dtype": _torch_dtype_name(tensor.dtype),
            "stored_dtype": np.dtype(source.dtype).name,
            "kind": "parameter" if name in param_names else "buffer",
            "tied_to": canonical if canonical != name else None,
        }
    return table


def optimizer_meta(torch_optimizer: torch.optim.Optimizer | None, engine=None) -> dict | None:
    """`meta["optimizer"]`: the class name and every param group's options but `params`."""
    if torch_optimizer is None:
        return None
    groups = [
        to_json({k: v for k, v in group.items() if k != "params"}, f"param_groups[{i}]")
        for i, group in enumerate(torch_optimizer.param_groups)
    ]
    meta = {"type": type(torch_optimizer).__name__, "param_groups": groups}
    if engine is not None and engine.has_live_optimizers:
        # What its own step created: a restore into an optimizer that has not stepped yet
        # (no state to take the shapes from) builds its targets from this.
        meta["live_state"] = live_optimizer_state.describe(engine.live_optimizer_state())
    return meta


def build_meta(
    engine,
    torch_optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    *,
    step: int,
    extra: dict | None,
) -> dict:
    """The `meta` item of one step (layout.py lists its keys)."""
    if extra is not None and not isinstance(extra, Mapping):
        raise CheckpointError(f"extra must be a dict, got {type(extra).__name__}")
    extra_json = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise CheckpointError(f"extra: key {key!r} must be a str")
        extra_json[key] = to_json(value, f"extra[{key!r}]")
        try:
            json.dumps(extra_json[key], allow_nan=True)
        except (TypeError, ValueError) as e:  # pragma: no cover - to_json already checked
            raise CheckpointError(f"extra[{key!r}] is not JSON-serialisable: {e}") from e
    return {
        "format": layout.FORMAT,
        "step": int(step),
        "config": config_as_json(engine.config),
        "parameters": parameter_table(engine),
        "optimizer": optimizer_meta(torch_optimizer, engine),
        "scheduler": None if scheduler is None else to_json(scheduler.state_dict(), "scheduler"),
        "engine": engine_counters(engine.state),
        "torch_rng": torch.get_rng_state().tolist(),
        "extra": extra_json,
    }


# --------------------------------------------------------------------------- gathering


def is_empty(leaf: Any) -> bool:
    """A zero-element array: Orbax refuses to store one ("Cannot save arrays with zero
    size"), so checkpoints leave them out and restoring recreates them from their shape."""
    return getattr(leaf, "size", 1) == 0


def without_empty(tree: Any) -> Any:
    """`tree` without its zero-size arrays, dropped from the dicts that hold them (the engine's
    trees are dicts of arrays; a zero-size array elsewhere is kept and Orbax names it)."""
    if isinstance(tree, dict):
        return {k: without_empty(v) for k, v in tree.items() if not is_empty(v)}
    return tree


def engine_counters(state) -> dict[str, int]:
    """`meta["engine"]`: the TrainState's counters (rng stream position, micro-steps, updates,
    fp16-skipped updates)."""
    return {
        "num_calls": int(state.num_calls),
        "micro_step": int(state.micro_step),
        "step": int(state.step),
        "skipped_steps": int(state.skipped_steps),
    }


def gather_items(engine, *, with_optimizer: bool) -> dict[str, Any]:
    """The array items of one step: `model`, `optimizer` (if attached and wanted),
    `train_state`. Arrays stay on device: Orbax copies them to host when saving. Zero-size
    arrays are left out (`is_empty`); `meta.parameters` and the current optimizer state give
    their shapes back on restore."""
    state = engine.state
    if state.grads is not None and engine.in_accumulation_window():
        log.warning(
            "zerojax: checkpoint at micro-step %d, inside a gradient accumulation window: the "
            "gradients accumulated so far are not saved; save at accumulation boundaries",
            state.micro_step,
        )
    weights = state.weights
    model = {}
    for name in engine.module.state_dict(keep_vars=True):
        canonical = engine.alias.get(name, name)
        if canonical != name:
            continue  # a tied alias: stored once, under its canonical name
        model[name] = weights[canonical] if canonical in weights else state.buffers[canonical]
    items: dict[str, Any] = {layout.MODEL: without_empty(model)}
    if with_optimizer and state.opt_state is not None:
        items[layout.OPTIMIZER] = without_empty(state.opt_state)
    train_state: dict[str, Any] = {"rng": jax.random.key_data(state.rng)}
    if state.loss_scale is not None:
        train_state["loss_scale"] = state.loss_scale
    items[layout.TRAIN_STATE] = train_state
    return items


# --------------------------------------------------------------------------- comparing


def parameter_differences(saved: Mapping[str, dict], current: Mapping[str, dict]) -> list[str]:
    """One line per state_dict entry that is missing, unexpected, or differs in shape or torch
    dtype between the checkpoint (`saved`) and the current model. Storage dtypes (precision
    policy) may differ: restoring casts them."""
    differences = []
    for name, entry in current.items():
        if name not in saved:
            differences.append(
                f"{name}: missing from the checkpoint (current {entry['kind']} "
                f"{tuple(entry['shape'])} {entry['dtype']})"
            )
            continue
        was = saved[name]
        if list(was["shape"]) != list(entry["shape"]):
            differences.append(
                f"{name}: shape saved {tuple(was['shape'])} vs current {tuple(entry['shape'])}"
            )
        if was["dtype"] != entry["dtype"]:
            differences.append(f"{name}: dtype saved {was['dtype']} vs current {entry['dtype']}")
    for name, was in saved.items():
        if name not in current:
            differences.append(
                f"{name}: unexpected, in the checkpoint ({was['kind']} {tuple(was['shape'])} "
                f"{was['dtype']}) but not in the current model"
            )
    return differences


def path_key(path: tuple) -> tuple[str, ...]:
    """A jax key path as the tuple of strings Orbax records per leaf in its tree metadata
    (dict keys and sequence indices alike as str)."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def optimizer_differences(saved_paths: set[tuple[str, ...]], current_tree) -> list[str]:
    """Lines naming every optimizer-state leaf that is missing from the checkpoint or in it but
    not in the current state. `saved_paths`: the checkpoint's leaves as `path_key` tuples.
    Zero-size leaves are never stored, so they are not expected in the checkpoint."""
    leaves = jax.tree_util.tree_flatten_with_path(current_tree)[0]
    current = {path_key(p): jax.tree_util.keystr(p) for p, leaf in leaves if not is_empty(leaf)}
    every = {path_key(p) for p, _ in leaves}
    differences = [
        f"state{shown}: missing from the checkpoint"
        for key, shown in current.items()
        if key not in saved_paths
    ]
    differences += [
        f"state{''.join(f'[{k!r}]' for k in key)}: in the checkpoint, not in the current optimizer"
        for key in sorted(saved_paths)
        if key not in every
    ]
    return differences


# --------------------------------------------------------------------------- restore targets


def _abstract(shape, dtype, sharding) -> tuple[jax.ShapeDtypeStruct, ocp.ArrayRestoreArgs]:
    struct = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
    # dtype here makes Orbax cast while reading (fp32 on disk -> bf16 params, and back).
    return struct, ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype)


def _stored_key(name: str, saved: Mapping[str, dict], stored: set[str]) -> str:
    if name in stored:
        return name
    tied = saved.get(name, {}).get("tied_to")
    if tied in stored:
        return tied
    raise CheckpointError(f"{name}: no array for it in the checkpoint's model item")


def model_target(engine, saved: Mapping[str, dict]) -> tuple[dict, dict, dict[str, str]]:
    """(abstract tree, restore args, current canonical name -> stored key) for the `model` item.

    Each weight is read in the dtype and sharding the current run keeps its updated copy in
    (fp32 master weights on `plan.master_weights` when the policy has them, else the params on
    `plan.params`); buffers replicated in their current dtype."""
    stored = {n for n, e in saved.items() if e.get("tied_to") is None}
    state = engine.state
    abstract, args, source = {}, {}, {}
    for name, weight in state.weights.items():
        sharding = engine.plan.params[name]
        if state.master is not None and name in state.master:
            sharding = engine.plan.master_weights[name]
        dtype = weight.dtype
        key = _stored_key(name, saved, stored)
        source[name] = key
        if key not in abstract:
            abstract[key], args[key] = _abstract(engine.plan.shapes[name], dtype, sharding)
    state_dict_names = set(engine.module.state_dict(keep_vars=True))
    for name, value in state.buffers.items():
        if name not in state_dict_names:
            continue  # non-persistent buffers are not part of a checkpoint, as in torch
        key = _stored_key(name, saved, stored)
        source[name] = key
        if key not in abstract:
            abstract[key], args[key] = _abstract(value.shape, value.dtype, engine.replicated)
    return abstract, args, source


def apply_model(state, restored: Mapping[str, jax.Array], source: Mapping[str, str]):
    """`state` (a TrainState) with the restored weights and buffers: master, then params =
    master cast to the param dtype (exactly what the optimizer update does), or the params
    directly (`TrainState.with_weights`). `engine.load` places the result."""
    weights, buffers = {}, dict(state.buffers)
    for name, key in source.items():
        if name in state.params:
            weights[name] = restored[key]
        else:
            buffers[name] = restored[key].astype(buffers[name].dtype)
    return state.with_weights(weights).replace(buffers=buffers)


def optimizer_target(engine, saved: Mapping | None = None) -> tuple[Any, Any]:
    """Abstract optimizer-state tree with the current leaves' shapes, dtypes and shardings;
    for optimizers running their own step, the saved state's (`saved`: `meta["optimizer"]`)
    on the current plan's shardings, since such an optimizer may not have made its state yet."""
    if engine.has_live_optimizers and saved is not None and "live_state" in saved:
        current = live_optimizer_state.abstract(saved["live_state"], engine.plan)
        current = without_empty(current)
    else:
        current = engine.state.opt_state
    pairs = jax.tree.map(lambda x: _abstract(x.shape, x.dtype, x.sharding), current)
    is_pair = lambda x: (
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], jax.ShapeDtypeStruct)
    )
    abstract = jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair)
    args = jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)
    return abstract, args


def train_state_target(engine, *, saved_loss_scale: bool) -> tuple[dict, dict]:
    """`train_state` target: the rng key data to host numpy (it is re-wrapped into a key on the
    default device, as `jax.random.key` made it), the loss scale replicated when both the
    checkpoint and the current policy have one."""
    state = engine.state
    data = jax.random.key_data(state.rng)
    abstract: dict[str, Any] = {"rng": jax.ShapeDtypeStruct(data.shape, data.dtype)}
    args: dict[str, Any] = {"rng": ocp.RestoreArgs(restore_type=np.ndarray)}
    if saved_loss_scale and state.loss_scale is not None:
        pairs = {
            k: _abstract(v.shape, v.dtype, engine.replicated) for k, v in state.loss_scale.items()
        }
        abstract["loss_scale"] = {k: p[0] for k, p in pairs.items()}
        args["loss_scale"] = {k: p[1] for k, p in pairs.items()}
    return abstract, args


def apply_train_state(state, restored: Mapping[str, Any], engine_meta: Mapping):
    """`state` with the restored rng, loss scale and counters (`engine_counters`; checkpoints
    from before micro-step counting lack `micro_step` and `step`: 0)."""
    data = jnp.asarray(restored["rng"])
    changes: dict[str, Any] = {
        "rng": jax.random.wrap_key_data(data, impl=jax.random.key_impl(state.rng)),
        **{key: int(engine_meta.get(key, 0)) for key in engine_counters(state)},
    }
    if "loss_scale" in restored:
        changes["loss_scale"] = dict(restored["loss_scale"])
    return state.replace(**changes)


def apply_param_groups(torch_optimizer: torch.optim.Optimizer, saved: Mapping) -> None:
    """Restore the numeric hyperparameters (lr, betas, weight decay, initial_lr, ...) of every
    param group. Boolean/None options are compile-time choices of the current run and stay."""
    groups = torch_optimizer.param_groups
    for group, was in zip(groups, saved["param_groups"], strict=True):
        for key, value in was.items():
            current = group.get(key)
            if key not in group:
                group[key] = tuple(value) if isinstance(value, list) else value
            elif isinstance(current, bool) or current is None:
                continue
            elif isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple):
                group[key] = tuple(value)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                group[key] = value


def check_format(meta: Mapping) -> None:
    """Refuse a meta item of another format (a torch or foreign Orbax checkpoint)."""
    if not isinstance(meta, Mapping) or meta.get("format") != layout.FORMAT:
        found = meta.get("format") if isinstance(meta, Mapping) else type(meta).__name__
        raise CheckpointError(
            f"not a zerojax checkpoint: meta format {found!r}, expected {layout.FORMAT!r}"
        )
