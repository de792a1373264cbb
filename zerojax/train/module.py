"""The torch front end of a model after `zerojax.initialize`: `model(x)` runs JAX,
`loss.backward()` pulls back. The model stays itself: `zero_module` mixes `ZeroModule` into
its class (as FSDP2's `fully_shard` does), so only its forward and its tensors change.

The forward converts the torch inputs to (batch-sharded) JAX arrays, runs the engine's
forward program and hands back torch tensors (the engine's placement does both ways,
`zerojax.parallel.placement`: in one process on one CPU device the output buffers themselves,
through DLPack, so outputs a loop never reads -- the logits next to the loss -- cost no copy;
elsewhere host copies; with several processes this process's rows). When autograd is recording, those tensors come
out of `_JaxCall`, a `torch.autograd.Function` whose backward calls the JAX pullback: the
parameter gradients go into the engine's sharded accumulator, input gradients go back to torch
(so a wrapped model can feed another one, or a torch loss, as in GANs and distillation).

The original module's parameters keep their identity, names, shapes and dtypes but give their
memory up: the JAX state is the only copy, and torch code reaching them (`p.grad`, `p.data`,
`module.state_dict()`) reads and writes it live (`zerojax.train.parameters`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import types
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree

from zerojax.bridge.convert import Static
from zerojax.bridge.dtypes import from_torch, host_array, to_torch
from zerojax.bridge.value_inputs import input_key
from zerojax.config.deepspeed import autos_error
from zerojax.train.engine import Engine, named_state_tensors
from zerojax.train.live_tensor import LiveTensor, to_host
from zerojax.train.parameters import is_plain, plain_parameters
from zerojax.train.programs import find_scalar_loss
from zerojax.train.shape_buckets import padding_for


class _JaxCall(torch.autograd.Function):
    """Outputs of a JAX program as autograd-connected torch tensors (called through
    `_jax_call`).

    `anchor` is a scalar that requires grad, so outputs are connected even when no input
    requires grad; its gradient is never used.

    The backward's `_StepArrays` hold the step's device arrays (the fused program's gradients,
    or the pullback's residuals: every activation the backward pass needs). Torch keeps this
    node alive as long as any output is (the `loss` of a training loop lives until the next
    step reassigns it), so once a backward pass has freed the graph (no `retain_graph=True`)
    the node lets go of them; otherwise the next step's forward would run beside the last
    step's gradients and residuals.
    """

    @staticmethod
    def forward(ctx, run, step_arrays, anchor, *inputs):
        ctx.set_materialize_grads(False)
        leaves = run()
        ctx.step_arrays = step_arrays
        # Saved (through `_jax_call`'s pack hook) to learn when a backward pass frees the graph.
        ctx.save_for_backward(anchor)
        ctx.mark_non_differentiable(*[t for t in leaves if not t.is_floating_point()])
        return tuple(leaves)

    @staticmethod
    def backward(ctx, *grad_leaves):
        # Raises torch's own "backward through the graph a second time" once it was freed.
        _ = ctx.saved_tensors
        input_grads = ctx.step_arrays.backward(grad_leaves)
        return (None, None, None, *input_grads)


class _StepArrays:
    """A `_JaxCall` node's backward function, which holds the step's device arrays, until
    torch frees the node's graph. Torch drops what a node saved when a backward pass frees the
    graph; the anchor is saved packed in a `_Held`, whose deletion lets go of the backward.
    (Asking the node instead, by reading `ctx.saved_tensors` until it raises, cost 2-3.5 ms a
    step: torch unwinds a C++ backtrace through jaxlib's and torch's libraries for the error.)"""

    __slots__ = ("backward",)

    def __init__(self, backward):
        self.backward = backward

    def pack(self, anchor: torch.Tensor) -> _Held:
        return _Held(self, anchor)

    @staticmethod
    def unpack(held: _Held) -> torch.Tensor:
        return held.anchor


class _Held:
    """The anchor as a `_JaxCall` node saved it (see `_StepArrays`)."""

    __slots__ = ("anchor", "step_arrays")

    def __init__(self, step_arrays: _StepArrays, anchor: torch.Tensor):
        self.step_arrays = step_arrays
        self.anchor = anchor

    def __del__(self):
        self.step_arrays.backward = None


def _jax_call(run, backward, anchor, inputs) -> tuple:
    """`_JaxCall.apply`: `run()`'s torch leaves, whose backward calls `backward(grad_leaves)`
    (input gradients back) until a backward pass frees the graph."""
    step_arrays = _StepArrays(backward)
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
        # Inside torch's `disable_saved_tensors_hooks` (where entering hooks raises): the anchor
        # is saved as it is, and the step's arrays go when the node goes.
        return _JaxCall.apply(run, step_arrays, anchor, *inputs)
    with torch.autograd.graph.saved_tensors_hooks(step_arrays.pack, _StepArrays.unpack):
        return _JaxCall.apply(run, step_arrays, anchor, *inputs)


class ZeroModule(torch.nn.Module):
    """What `zerojax.initialize` mixes into the user's model: its forward runs as one sharded XLA
    program per step.

    The model stays itself, as FSDP2's `fully_shard` leaves it: `zero_module` changes the
    instance's class to a subclass of both (`ZeroModule`, then the model's own class), so
    `isinstance`, methods (`generate`, `save_pretrained`, `estimate_mfu`), attributes (`config`,
    `loss_type`) and `inspect.signature(model.forward)` are the model's own. What it adds:
    `forward` (the engine's program; the class's own forward while torch.export captures it),
    `engine`, `clip_grad_norm_`, a gathered `state_dict`/`load_state_dict`, `zero_grad` on the
    engine, `module` (for the DDP idiom `raw_model = model.module`, see `_module_view`) unless
    the model has its own, and `copy.deepcopy`/pickling as an ordinary instance of its class.
    The class keeps the model's name: `save_pretrained` writes `type(model).__name__` into
    `config.json`'s `architectures`, and transformers picks loss and label handling by it.
    """

    _zerojax_base: type
    _zerojax_engine: Engine

    @property
    def engine(self) -> Engine:
        return self._zerojax_engine

    def __deepcopy__(self, memo):
        """An ordinary instance of the model's class holding the current values (an EMA model):
        the engine and its program are not copied."""
        base = type(self)._zerojax_base
        copied = base.__new__(base)
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            if not key.startswith("_zerojax"):
                copied.__dict__[key] = copy.deepcopy(value, memo)
        return copied

    def __reduce_ex__(self, protocol):
        """torch.save(model), pickle: the ordinary model (see `__deepcopy__`), reduced as its
        class reduces it, so plain torch loads it without zerojax, `weights_only` included
        (whose unpickler builds a module only through NEWOBJ of an allowed class).

        Pickle refuses a `copyreg.__newobj__` whose class is not the pickled object's
        `__class__` ("args[0] from __newobj__ args has the wrong class"): this object's class
        is a zerojax subclass. So the next read of `__class__`, pickle's check, which follows
        at once, answers the model's own class (`_pickled_as_base`)."""
        copied = copy.deepcopy(self)
        reduced = copied.__reduce_ex__(protocol)
        if getattr(reduced[0], "__name__", None) in ("__newobj__", "__newobj_ex__"):
            _pickled_as_base.ids.add(id(self))
        return reduced

    @property
    def __class__(self):
        """The object's class; the model's own class once, for pickle's check (see
        `__reduce_ex__`)."""
        ids = _pickled_as_base.ids
        if ids and id(self) in ids:
            ids.discard(id(self))
            return type(self)._zerojax_base
        return type(self)

    @__class__.setter
    def __class__(self, cls) -> None:
        _OBJECT_CLASS.__set__(self, cls)

    def _zerojax_forward(self, *args, **kwargs):
        engine = self._zerojax_engine
        if engine.config.trainer_autos and not engine.in_trainer:
            raise autos_error(engine.config.trainer_autos, in_trainer=False)
        buckets = engine.config.inputs.pad_to_multiple_of
        if buckets and (padding := padding_for(self, dict(buckets), args, kwargs)) is not None:
            # Opt-in bucketing (shape_buckets.py): run padded, hand back the true shapes.
            return padding.unpad(self._zerojax_forward(*args, **padding.kwargs))
        converted = engine.converted(self.training, args, kwargs)
        flat_with_paths, spec = torch_pytree.tree_flatten_with_path((args, kwargs))
        flat = [leaf for _, leaf in flat_with_paths]
        # Inputs whose values the model reads on the host (Qwen2-VL's image_grid_thw) are part
        # of the program's key: static, by value, never sharded (Converted.value_inputs).
        value_positions = {
            i
            for i, (path, leaf) in enumerate(flat_with_paths)
            if isinstance(leaf, torch.Tensor) and input_key(path) in converted.value_inputs
        }
        tensor_positions = [
            i
            for i, leaf in enumerate(flat)
            if isinstance(leaf, torch.Tensor) and i not in value_positions
        ]
        # Non-tensor arguments (return_loss=True, output_hidden_states=True) ride in the JAX
        # tree structure, static under jit: a traced bool would break the model's `if`.
        jax_flat = [
            leaf if isinstance(leaf, (np.ndarray, jax.Array)) else Static(leaf) for leaf in flat
        ]
        for i in value_positions:
            jax_flat[i] = Static(flat[i].numpy(force=True))
        for i in tensor_positions:
            # Host values straight to the program's sharding: one transfer, nothing compiled
            # per input shape (dtypes.host_array).
            jax_flat[i] = engine.shard_input(host_array(flat[i]))
        jax_args, jax_kwargs = torch_pytree.tree_unflatten(jax_flat, spec)
        # Several processes: outputs with the batch's rows go back as this process's rows.
        self._zerojax_global_rows = engine.placement.global_rows(jax_flat)
        inputs_require_grad = any(flat[i].requires_grad for i in tensor_positions)
        recording = torch.is_grad_enabled() and (
            inputs_require_grad or any(p.requires_grad for p in self.parameters())
        )
        if not recording:
            outputs, _ = engine.forward(converted, tuple(jax_args), jax_kwargs)
            leaves, treedef = jax.tree.flatten(outputs)
            kept = (engine.params, engine.buffers, jax_args, jax_kwargs)
            share = _LossShare.of(outputs, engine.placement.loss_share(kwargs))
            return jax.tree.unflatten(treedef, share.value(self._zerojax_hand_over(leaves, kept)))

        tensor_inputs = [flat[i] for i in tensor_positions]
        # The fused program returns no input gradients: inputs that need one (a wrapped model
        # fed by another) take the general path, as do the calls of a model whose other
        # outputs were differentiated (see _zerojax_fused).
        loss_path = (
            None
            if inputs_require_grad or self._zerojax_outputs_differentiated
            else self._zerojax_fused_loss_path(converted, jax_args, jax_kwargs)
        )
        if loss_path is not None:
            return self._zerojax_fused(converted, jax_args, jax_kwargs, loss_path, tensor_inputs)
        return self._zerojax_general(converted, args, jax_args, jax_kwargs)

    def _zerojax_fused_loss_path(self, converted, jax_args, jax_kwargs):
        if self._zerojax_engine.fused is False:
            return None
        # Read off the captured program's outputs: no trace of the model (an eval_shape of it
        # cost ~0.05 s of the first step, on the general path too).
        return find_scalar_loss(converted.output_shapes(*jax_args, **jax_kwargs))

    def _zerojax_fused(self, converted, jax_args, jax_kwargs, loss_path, tensor_inputs):
        """The model computes its own loss: forward and backward ran as one program; the loss's
        backward only adds the (already computed) gradients, weighted by its cotangent."""
        engine = self._zerojax_engine
        outputs, grads, replay = engine.fused_forward(
            converted, tuple(jax_args), jax_kwargs, loss_path
        )
        leaves, treedef = jax.tree.flatten(outputs)
        loss_leaf = _loss_leaf_index(outputs, loss_path)
        global_rows = self._zerojax_global_rows
        share = _LossShare.of(outputs, engine.placement.loss_share(jax_kwargs))

        def backward(grad_leaves):
            grad_leaves = share.cotangents(grad_leaves)
            if any(grad is not None for i, grad in enumerate(grad_leaves) if i != loss_leaf):
                # The loss is not (only) the model's own: TRL's SFTTrainer, say, computes its
                # loss from the log-probs the forward returns. The fused gradients do not
                # apply; the call runs again as it was (its random draws, its buffers) with a
                # pullback, and the model's later calls take the general path from the start.
                object.__setattr__(self, "_zerojax_outputs_differentiated", True)
                _, pullback = engine.forward(
                    converted,
                    tuple(jax_args),
                    jax_kwargs,
                    differentiable=(False,) * len(jax_args),
                    replay=replay,
                )
                specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
                _backward_through(engine, converted, pullback, specs, treedef, global_rows)(
                    grad_leaves
                )
                return [None] * len(tensor_inputs)
            weight = grad_leaves[loss_leaf]
            # `loss.backward()` passes 1: no weight, so no separate pass over the gradients.
            weight = None if weight is None else weight.item()
            engine.accumulate(grads, None if weight in (None, 1.0) else jnp.float32(weight))
            return [None] * len(tensor_inputs)

        kept = (engine.params, engine.buffers, grads, jax_args, jax_kwargs)
        torch_leaves = _jax_call(
            lambda: share.value(self._zerojax_hand_over(leaves, kept)),
            backward,
            self._zerojax_anchor,
            tensor_inputs,
        )
        return jax.tree.unflatten(treedef, list(torch_leaves))

    def _zerojax_general(self, converted, args, jax_args, jax_kwargs):
        engine = self._zerojax_engine
        # Input gradients flow back for top-level positional tensors; nested or keyword inputs
        # are treated as constants.
        flat_positional = not jax_kwargs and not any(
            isinstance(a, (list, tuple, dict)) for a in args
        )
        differentiable = tuple(
            flat_positional
            and isinstance(a, torch.Tensor)
            and a.requires_grad
            and a.is_floating_point()
            for a in args
        )
        tensor_inputs = [a for a, d in zip(args, differentiable, strict=True) if d]
        outputs, pullback = engine.forward(
            converted, tuple(jax_args), jax_kwargs, differentiable=differentiable
        )
        leaves, treedef = jax.tree.flatten(outputs)
        # Shapes and dtypes only: holding the output arrays until the backward would keep
        # their device buffers (and, for sharded ones, the host copy NumPy caches) alive.
        specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]

        through = _backward_through(
            engine, converted, pullback, specs, treedef, self._zerojax_global_rows
        )
        share = _LossShare.of(outputs, engine.placement.loss_share(jax_kwargs))
        kept = (engine.params, engine.buffers, pullback, jax_args, jax_kwargs)
        torch_leaves = _jax_call(
            lambda: share.value(self._zerojax_hand_over(leaves, kept)),
            lambda grad_leaves: through(share.cotangents(grad_leaves)),
            self._zerojax_anchor,
            tensor_inputs,
        )
        return jax.tree.unflatten(treedef, list(torch_leaves))

    @torch._dynamo.disable
    def __call__(self, *args, **kwargs):
        """`Module.__call__` (hooks, then the engine's forward), never traced by torch.compile:
        the engine's program is already compiled, and dynamo tracing into it fails (fake
        tensors reach JAX). `torch.compile(model)` thus wraps a call that runs as it is (the
        same numbers), and `model.compile()`, before or after `initialize`, leaves the model as
        it is (its `_compiled_call_impl` is not called)."""
        # The forward `Module.__call__` reads first is the engine's, also where a forward was
        # set on the instance (see _EngineForward).
        _engine_call.pending = True
        try:
            if is_plain():
                # torch.export capturing the model: the model's own hooks run around the
                # program, on every call as torch runs them, not also traced into it.
                return self.forward(*args, **kwargs)
            return self._call_impl(*args, **kwargs)
        finally:
            _engine_call.pending = False

    def _zerojax_hand_over(self, leaves: list, kept) -> list[torch.Tensor]:
        """The outputs as torch tensors, by the engine's placement (one process: `hand_over`;
        several: this process's rows of each)."""
        engine = self._zerojax_engine
        handed = engine.placement.outputs_to_torch(leaves, kept, self._zerojax_global_rows)
        # The hand-over waited for the program: its index flags are read now, for free.
        engine.raise_index_errors(wait=False)
        return handed

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients (`set_to_none=False`: set those that exist to zeros,
        as torch does). nn.Module's version would read (gather) every `p.grad` first."""
        self._zerojax_engine.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the accumulated gradients' global norm to `max_norm`, on the shards (as FSDP's
        `clip_grad_norm_`); returns the total norm before clipping, as torch's does."""
        from zerojax.train.clipping import clip_engine_grad_norm_

        return clip_engine_grad_norm_(self._zerojax_engine, max_norm, norm_type)

    # --- torch-format state ----------------------------------------------------------------

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The model's state_dict gathered to the host as ordinary tensors (`keep_vars=True`:
        the live stand-ins themselves). As a submodule of a bigger model it fills the parent's
        `destination` under `prefix`, as nn.Module's does."""
        if args:  # nn.Module's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (*args, prefix, keep_vars)[:3]
        if keep_vars:
            return _module_state_dict(self, destination=destination, prefix=prefix, keep_vars=True)
        destination = OrderedDict() if destination is None else destination
        held: dict[str, torch.Tensor] | None = self._zerojax_held_state  # type: ignore[assignment]
        if held is not None:
            for name, tensor in held.items():
                destination[prefix + name] = tensor
            return destination
        host = {
            name: to_torch(array).to(dtype)
            for name, (array, dtype) in self._zerojax_engine.state_dict_arrays().items()
        }
        names = {id(tensor): name for name, tensor in named_state_tensors(self)}
        # nn.Module's own walk, on the stand-ins: each submodule's `_save_to_state_dict` and
        # extra state, the version metadata, and the state_dict hooks the user registered
        # (which may rename, add or drop entries) run once, as in torch; then each stand-in
        # becomes its gathered host value (a live tensor a hook computed, its host copy).
        _module_state_dict(self, destination=destination, prefix=prefix, keep_vars=True)
        for key, value in destination.items():
            own = names.get(id(value))
            if own is not None:
                destination[key] = host[own]
            elif isinstance(value, LiveTensor):
                destination[key] = to_host(value)
        return destination

    @contextlib.contextmanager
    def holding_state_dict(self):
        """Within: `state_dict()` returns the host copy gathered on entry.

        With several processes the state is sharded over all of them, so reading it is a
        collective: every process must enter, in the same order. A framework that saves from
        one process only (the HF Trainer) gathers this way on all of them first
        (`zerojax.integrations.hf_trainer`). Nested entries reuse the outer copy."""
        if self._zerojax_held_state is not None:
            yield
            return
        object.__setattr__(self, "_zerojax_held_state", self.state_dict())
        try:
            yield
        finally:
            object.__setattr__(self, "_zerojax_held_state", None)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        own = dict(named_state_tensors(self))
        # Modules with extra state (`get_extra_state`) take theirs back through
        # `set_extra_state`, as torch's `_load_from_state_dict` does.
        extra = {
            f"{prefix}.{_EXTRA_STATE}" if prefix else _EXTRA_STATE: module
            for prefix, module in self.named_modules()
            if type(module).get_extra_state is not torch.nn.Module.get_extra_state
        }
        expected = set(own) | set(extra)
        missing, unexpected = expected - set(state_dict), set(state_dict) - expected
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"zerojax: load_state_dict: missing keys {sorted(missing)}, unexpected keys "
                f"{sorted(unexpected)}"
            )
        for name, value in state_dict.items():
            if name in own and tuple(value.shape) != tuple(own[name].shape):
                raise RuntimeError(
                    f"zerojax: load_state_dict: '{name}' has shape {tuple(value.shape)}, "
                    f"the model expects {tuple(own[name].shape)}"
                )
        self._zerojax_engine.load_state_dict_arrays(
            {n: from_torch(v) for n, v in state_dict.items() if n in own}
        )
        for name, module in extra.items():
            if name in state_dict:
                module.set_extra_state(state_dict[name])
        return torch.nn.modules.module._IncompatibleKeys(sorted(missing), sorted(unexpected))


class _LossShare:
    """This process's share of a loss the model computed over the global batch, where the
    caller adds the processes' losses up: see "loss kwargs" in `zerojax.parallel.placement`.
    `value` scales the handed-over loss by `factor` (`Placement.loss_share`: 1/P there, else
    1), `cotangents` its gradient alike."""

    __slots__ = ("factor", "index")

    def __init__(self, index: int | None, factor: float):
        self.index, self.factor = index, factor

    @classmethod
    def of(cls, outputs, factor: float) -> _LossShare:
        if factor == 1.0:
            return cls(None, 1.0)
        path = find_scalar_loss(outputs)
        index = None if path is None else _loss_leaf_index(outputs, path)
        return cls(index, factor)

    def value(self, torch_leaves: list) -> list:
        if self.index is not None:
            torch_leaves[self.index] = torch_leaves[self.index] * self.factor
        return torch_leaves

    def cotangents(self, grad_leaves) -> list:
        grad_leaves = list(grad_leaves)
        if self.index is not None and grad_leaves[self.index] is not None:
            grad_leaves[self.index] = grad_leaves[self.index] * self.factor
        return grad_leaves


def _backward_through(engine: Engine, converted, pullback, specs, treedef, global_rows):
    """The general path's backward: output cotangents (torch tensors, None where an output got
    no gradient) through `pullback` into the gradient accumulator; returns the inputs'
    gradients."""

    def backward(grad_leaves):
        placement = engine.placement
        cotangents = [
            placement.cotangent(spec, grad, global_rows)
            for spec, grad in zip(specs, grad_leaves, strict=True)
        ]
        # Outputs torch sent no gradient: what reaches the loss only through them gets none.
        absent = tuple(
            grad is None or not jnp.issubdtype(spec.dtype, jnp.floating)
            for spec, grad in zip(specs, grad_leaves, strict=True)
        )
        input_grads = engine.backward(
            converted, pullback, jax.tree.unflatten(treedef, cotangents), absent
        )
        return placement.input_grads_to_torch(input_grads, global_rows)

    return backward


_EXTRA_STATE = torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX


def _module_state_dict(module: torch.nn.Module, **kwargs):
    """nn.Module's own state_dict (names and stand-ins), past `ZeroModule.state_dict`."""
    return torch.nn.Module.state_dict(module, **kwargs)


# (model class, whether it gets a `module`) -> its zerojax class; model class -> the class of
# its `module` view.
_CLASSES: dict[tuple[type, bool], type] = {}
_VIEW_CLASSES: dict[type, type] = {}


def _zero_class(base: type, namespace: dict) -> type:
    """A subclass of `ZeroModule` and `base` that keeps `base`'s name (see ZeroModule)."""
    namespace = {"_zerojax_base": base, "forward": _EngineForward(_forward_of(base)), **namespace}
    cls = type(base.__name__, (ZeroModule, base), namespace)
    cls.__module__ = base.__module__
    cls.__qualname__ = base.__qualname__
    return cls


def _module_view(self) -> ZeroModule:
    """`model.module`: what DDP's `.module` is to a script (`raw_model = model.module`,
    `model.module.state_dict()`, `model.module(x)`), and where every unwrap loop stops.

    timm's `unwrap_model`, transformers' (without accelerate) and accelerate's recursive one
    unwrap `while hasattr(model, "module")`; Lightning and accelerate unwrap by class (DDP, FSDP,
    `OptimizedModule._orig_mod`), which a zerojax model is not. So `.module` cannot be the model
    itself (the loop never ends): it is a view of it, an object of a sibling class without
    `module` that shares the model's `__dict__` -- its parameters, submodules, hooks, `training`,
    attributes and engine -- so everything done through either is done to the model, and its
    forward is the engine's program too. One view per model (`model.module is model.module`).
    """
    view = self.__dict__.get("_zerojax_module_view")
    if view is None:
        base = type(self)._zerojax_base
        view_class = _VIEW_CLASSES.get(base)
        if view_class is None:
            view_class = _VIEW_CLASSES[base] = _zero_class(base, {})
        view = object.__new__(view_class)
        object.__setattr__(view, "__dict__", self.__dict__)
        self.__dict__["_zerojax_module_view"] = view
    return view


def zero_module(module: torch.nn.Module, engine: Engine) -> ZeroModule:
    """Make `module` (the same object) run through `engine`: its class becomes a subclass of
    `ZeroModule` and its own class (see ZeroModule). Returns `module`."""
    base = type(module)
    # A `module` of the model's own (a submodule, an attribute of its class) wins.
    with_module = "module" not in module._modules and not hasattr(base, "module")
    cls = _CLASSES.get((base, with_module))
    if cls is None:
        namespace = {"module": property(_module_view)} if with_module else {}
        cls = _CLASSES[base, with_module] = _zero_class(base, namespace)
    module.__class__ = cls
    object.__setattr__(module, "_zerojax_engine", engine)
    object.__setattr__(module, "_zerojax_anchor", torch.zeros((), requires_grad=True))
    object.__setattr__(module, "_zerojax_global_rows", None)
    object.__setattr__(module, "_zerojax_held_state", None)
    object.__setattr__(module, "_zerojax_outputs_differentiated", False)
    object.__setattr__(module, "_zerojax_instance_forward", module.__dict__.pop("forward", None))
    assert isinstance(module, ZeroModule)  # its class is now one
    return module


class _EngineCall(threading.local):
    pending = False  # ZeroModule.__call__ is about to read `forward`
    running_instance_forward = False  # the engine's trace is inside the instance's forward


_engine_call = _EngineCall()


class _PickledAsBase(threading.local):
    """Ids of zerojax models whose next `__class__` read is pickle's check of the reduction
    `ZeroModule.__reduce_ex__` just returned."""

    def __init__(self):
        self.ids: set[int] = set()


_pickled_as_base = _PickledAsBase()
_OBJECT_CLASS = object.__dict__["__class__"]


class _EngineForward:
    """`forward` on a zerojax model's class: the engine's program, composing with a forward
    set on the instance.

    Libraries patch `model.forward` on the instance, wrapping what they read there: TRL's
    SFTTrainer (a fused LM head returning per-token log-probs), accelerate (autocast, fp32
    outputs). Plain torch would then run the patch eagerly, around the engine, on live tensors.
    Instead the patch is kept aside (`_zerojax_instance_forward`) and the engine traces it:
    `model(...)` runs the engine's program, whose capture calls the patch, whose own call of
    the forward it wrapped runs the class's code. Reading `model.forward` gives the patch, as
    in torch, so patches stack; setting it drops the traced programs (traced again on the next
    call), and setting the engine's forward back removes the patch.
    """

    def __init__(self, engine_forward):
        self.engine_forward = engine_forward

    def __get__(self, module, owner=None):
        if module is None:
            return self.engine_forward
        patch = module.__dict__.get("_zerojax_instance_forward")
        if patch is None or _engine_call.pending:
            _engine_call.pending = False
            return types.MethodType(self.engine_forward, module)
        return patch

    def __set__(self, module, value) -> None:
        own = getattr(value, "__self__", None) is module and (
            getattr(value, "__func__", None) is self.engine_forward
        )
        module.__dict__["_zerojax_instance_forward"] = None if own else value
        module._zerojax_engine.forget_programs()

    def __delete__(self, module) -> None:
        self.__set__(module, None)


def _forward_of(base: type[torch.nn.Module]):
    """The class's forward, with its signature (the HF Trainer keeps only the dataset columns
    the forward names): the engine's program, or the class's own code while torch.export
    traces the model (`plain_parameters`)."""
    own_forward = base.forward

    @functools.wraps(own_forward)
    def forward(self, *args, **kwargs):
        if is_plain():
            patch = self._zerojax_instance_forward
            if patch is None or _engine_call.running_instance_forward:
                return own_forward(self, *args, **kwargs)
            # The forward set on the instance, once: its call of the forward it wrapped (the
            # engine's, read before it was set) runs the class's own code.
            _engine_call.running_instance_forward = True
            try:
                return patch(*args, **kwargs)
            finally:
                _engine_call.running_instance_forward = False
        # torch.export, when a new signature is captured, must see ordinary parameters.
        with plain_parameters():
            return self._zerojax_forward(*args, **kwargs)

    return forward


def _loss_leaf_index(outputs, loss_path) -> int:
    if loss_path == ():
        return 0
    marked = jax.tree.map(lambda _: False, outputs)
    if isinstance(marked, dict):
        marked["loss"] = True
    else:
        marked.loss = True
    return jax.tree.leaves(marked).index(True)
