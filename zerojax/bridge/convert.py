"""zerojax.convert: a torch.nn.Module -> (params, buffers, pure apply function)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from torch.export._tree_utils import reorder_kwargs

from zerojax.bridge import symbolic_shapes
from zerojax.bridge.capture import SHAPE_ASSERTIONS, capture, find_host_read_inputs
from zerojax.bridge.dtype_checks import check_operand_dtypes
from zerojax.bridge.dtypes import from_torch, to_jax_dtype, to_torch, to_torch_dtype
from zerojax.bridge.errors import CaptureError
from zerojax.bridge.hf_cache import contains_cache, drop_caches, register_cache_pytrees
from zerojax.bridge.interpreter import GraphFunction
from zerojax.bridge.output_tree import register_output_types
from zerojax.bridge.value_inputs import (
    drop_value_known_leaves,
    input_key,
    reads_values_on_host,
)

if TYPE_CHECKING:
    from zerojax.bridge.index_bounds import IndexBounds
    from zerojax.config import ActivationCheckpointingConfig, KernelsConfig
    from zerojax.parallel.plan import ParallelPlan

log = logging.getLogger("zerojax")

MANY_SHAPES = 8
"""After this many distinct input shapes of one input structure, warn once (naming the dims that
keep changing and the fix)."""


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class Static:
    """A non-array argument (`return_loss=True`, a string) held in the JAX tree *structure*.

    Python scalars passed through `jax.jit` become traced arrays, strings are refused; wrapped in
    `Static`, a value becomes part of the treedef instead: static under jit, and a new value
    compiles a new program, as it traces a new one here. `Converted.apply` unwraps it.

    A numpy array in `Static` is compared by value: the way to pass an input whose values decide
    shapes (`Converted.value_inputs`, e.g. Qwen2-VL's `image_grid_thw`) under `jax.jit`.
    """

    value: Any

    def __eq__(self, other):
        if type(other) is not Static or type(other.value) is not type(self.value):
            return False
        if isinstance(self.value, np.ndarray):
            return self.value.dtype == other.value.dtype and np.array_equal(self.value, other.value)
        return bool(other.value == self.value)

    def __hash__(self):
        if isinstance(self.value, np.ndarray):
            return hash((self.value.dtype.str, self.value.shape, self.value.tobytes()))
        return hash((type(self.value), repr(self.value)))


class Converted:
    """A converted module: `params`, `buffers` and a pure `apply`.

    `apply(params, buffers, *args, rng=None, **kwargs) -> (outputs, new_buffers)` is jit- and
    grad-able. `outputs` has the structure of the torch module's output with jax.Array leaves;
    `new_buffers` holds every buffer, updated where the module mutates it (BatchNorm stats).
    A call with new input shapes or dtypes traces a new program, once, and caches it.

    Non-array arguments (`return_loss=True`, `output_hidden_states=True`) are static: their
    values are part of the program's cache key, as in torch.export, which specializes on them.
    Under `jax.jit` pass them as static arguments or wrapped in `Static`.

    A Hugging Face KV cache (`past_key_values`, see `zerojax.bridge.hf_cache`) is an ordinary
    pytree of arrays in and out. In train mode a cache the model builds on its own is dropped
    from the outputs (`past_key_values` is None): a training step would otherwise return every
    layer's keys and values. Passing `use_cache=True` or a cache keeps it.

    `value_inputs` names the integer inputs whose *values* the model reads on the host to decide
    shapes (Qwen2-VL's `image_grid_thw`: `torch.split(x, lengths.tolist())`). torch.export
    cannot trace such a read; when a capture fails on one, the inputs behind it are found and
    the program is specialised on their values: they are part of its cache key (new values
    trace a new program, as new shapes do) and must be concrete: outside `jax.jit`, or wrapped
    in `Static(np.asarray(x))` under it (`zerojax.initialize` does this itself).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        *,
        train: bool,
        read_values: bool = True,
    ):
        self.module = module
        self.train = train
        self.name = type(module).__name__
        # read_values=False: only the program (the caller holds the arrays, e.g. sharded).
        self.params, self.buffers, self.alias = state_arrays(module, read_values=read_values)
        self.value_inputs: frozenset[str] = frozenset()
        # Input signatures (torch dtypes) and precisions whose dtypes were checked.
        self._inputs_checked: set[tuple] = set()
        # Before the first program key is computed: a cache argument must flatten to its arrays.
        register_cache_pytrees(module)
        self._programs: dict[Any, tuple[GraphFunction, Any, Any]] = {}
        # Per input structure (`_structure_of`): the shapes seen, and the symbolic captures
        # with the shapes each admits (symbolic_shapes.py).
        self._shapes_seen: dict[Any, list[dict]] = {}
        self._symbolic: dict[Any, list[tuple[symbolic_shapes.ShapeGuards, Any]]] = {}
        self._symbolic_failed: set[tuple] = set()  # (structure, dims) whose capture failed
        self._program_for(args, kwargs, reason=None)

    @property
    def tied(self) -> dict[str, str]:
        """Names that share another entry's array: alias name -> canonical name in `params`."""
        return {name: to for name, to in self.alias.items() if name != to}

    def apply(
        self,
        params: Mapping[str, jax.Array],
        buffers: Mapping[str, jax.Array],
        *args: Any,
        rng: jax.Array | None = None,
        float_dtype: Any = None,
        kernels: KernelsConfig | None = None,
        parallel: ParallelPlan | None = None,
        remat: ActivationCheckpointingConfig | None = None,
        param_use: Callable[..., jax.Array] | None = None,
        regather_params: frozenset[str] = frozenset(),
        index_bounds: IndexBounds | None = None,
        **kwargs: Any,
    ) -> tuple[Any, dict[str, jax.Array]]:
        """Run the module as JAX: (outputs, new_buffers); see the class docstring.

        `kernels` (a `zerojax.config.KernelsConfig`) picks the fused kernels the bridge
        substitutes; None uses the defaults (Pallas on GPU, their XLA references elsewhere).
        `parallel` (a `zerojax.parallel.ParallelPlan`) is how the run is parallelised: Pallas
        kernels run per batch shard (`kernel_batch`) instead of on gathered arrays, the MoE
        grouped GEMMs expert-parallel (`experts`), attention sequence-parallel (`sequence`,
        Ulysses or ring); None runs every op whole. `remat` (a
        `zerojax.config.ActivationCheckpointingConfig`) picks the modules whose activations are
        recomputed in the backward pass; None honours the model's own torch.utils.checkpoint
        calls only (bridge/remat.py). `param_use(name, value)` is applied to a parameter at
        each op that reads it (the engine's ZeRO-3 gather and compute-dtype cast: see
        `GraphFunction.__call__`); an op that reads a parameter named in `regather_params`
        gathers it again in the backward pass instead of keeping it (ZeRO-3, same place).
        `index_bounds` (a `zerojax.bridge.index_bounds.IndexBounds`) records the out-of-range
        checks of the indices the model reads: its `packed()` flag vector, returned from the
        caller's jitted function, is what `raise_if_out_of_range` reads on the host.
        """
        args, kwargs = _unwrap_static((args, kwargs))
        self.check_input_dtypes(args, kwargs, float_dtype)
        program, in_spec, out_spec = self._program_for(
            args, kwargs, reason="new input shapes or non-tensor arguments"
        )
        leaves = drop_value_known_leaves(args, reorder_kwargs(kwargs, in_spec), self.value_inputs)
        # Non-array leaves are graph inputs too (export specialized on their values, which are
        # in the program's key): they are passed through as they are.
        inputs = [_as_jax(leaf) if _is_array(leaf) else leaf for leaf in leaves]
        outputs, new_buffers = program(
            params,
            buffers,
            inputs,
            rng,
            float_dtype=float_dtype,
            kernels=kernels,
            parallel=parallel,
            remat=remat,
            param_use=param_use,
            regather_params=regather_params,
            index_bounds=index_bounds,
        )
        outputs = torch_pytree.tree_unflatten(outputs, out_spec)
        if self.train and not _wants_cache(args, kwargs):
            outputs = drop_caches(outputs)
        return outputs, new_buffers

    __call__ = apply

    def check_input_dtypes(self, args, kwargs, float_dtype=None) -> None:
        """Raise torch's error if torch would refuse these inputs' dtypes (a float64 input to a
        float32 `nn.Linear`), for torch tensor inputs of a dtype JAX holds narrower (float64,
        complex128: `narrows_inputs`), whose program key is the narrower dtype's. The model is
        captured once more with the real dtypes and that graph checked
        (`zerojax.bridge.dtype_checks`), once per signature and precision; the program that
        runs stays the one for the narrower dtype, as JAX computes it (32-bit)."""
        if not narrows_inputs(args, kwargs):
            return
        leaves, spec = torch_pytree.tree_flatten((args, kwargs))
        key = (
            str(spec),
            tuple(
                (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x)
                for x in leaves
            ),
            str(float_dtype),
        )
        if key in self._inputs_checked:
            return
        exported = capture(
            self.module, args, kwargs, train=self.train, value_inputs=self.value_inputs
        )
        check_operand_dtypes(exported.graph, float_dtype)
        self._inputs_checked.add(key)

    def output_shapes(self, *args, **kwargs):
        """The structure of `apply`'s outputs for these inputs, with `jax.ShapeDtypeStruct`
        leaves for its arrays, read off the captured program (captured first if these input
        shapes are new), not traced: no lowering runs."""
        args, kwargs = _unwrap_static((args, kwargs))
        program, in_spec, out_spec = self._program_for(
            args, kwargs, reason="new input shapes or non-tensor arguments"
        )
        leaves = drop_value_known_leaves(args, reorder_kwargs(kwargs, in_spec), self.value_inputs)
        sizes = program.sizes_for(leaves)
        outputs = torch_pytree.tree_unflatten(program.output_shapes(sizes), out_spec)
        if self.train and not _wants_cache(args, kwargs):
            outputs = drop_caches(outputs)
        return outputs

    def _capture(self, args, kwargs):
        """capture(), specialised on the inputs the model reads on the host where needed.

        Needed when torch.export fails on a guard on values, or succeeds but leaves host reads
        (`item()`) of values in the graph, which a jitted program cannot run (module docstring
        of value_inputs.py). Without a specialisation that helps, the plain result stands.
        """
        if self.value_inputs:
            return capture(
                self.module, args, kwargs, train=self.train, value_inputs=self.value_inputs
            )
        try:
            exported = capture(self.module, args, kwargs, train=self.train)
        except CaptureError as error:
            if not _is_data_dependent(error):
                raise
            failure = error
        else:
            if not reads_values_on_host(exported.graph):
                return exported
            failure = None
        found = find_host_read_inputs(self.module, args, kwargs, train=self.train)
        if not found:
            if failure is not None:
                failure.add_note(
                    "zerojax: no input decides this value (specialising on input values cannot "
                    "help): the model computes it from a random draw or floating-point data, "
                    "and a traced program cannot hold Python control flow on such a value. "
                    "Write the choice as tensor ops (torch.where) to capture it."
                )
                raise failure
            return exported
        try:
            specialised = capture(self.module, args, kwargs, train=self.train, value_inputs=found)
        except CaptureError as specialised_error:
            if failure is None:
                return exported
            failure.add_note(
                f"zerojax also tried specialising the program on the values of "
                f"{', '.join(sorted(found))} (read on the host by the model); that capture "
                f"failed too: {specialised_error}"
            )
            raise failure from None
        log.warning(
            "zerojax: %s reads the values of input(s) %s on the host (Python control flow or "
            "shapes computed from them); the program is specialised on their values and traced "
            "again when they change",
            self.name,
            ", ".join(sorted(found)),
        )
        self.value_inputs = found
        return specialised

    def _program_for(self, args, kwargs, *, reason):
        """The program for these inputs: cached by signature; else a symbolic capture of the
        same inputs that admits their shapes (no torch.export: XLA compiles the new shape);
        else a new capture, with the dims that changed since the first shape symbolic
        (symbolic_shapes.py), or as they are if that capture fails."""
        key = _signature_key(args, kwargs, self.value_inputs, self.name)
        entry = self._programs.get(key)
        if entry is not None:
            return entry
        structure = _structure_of(key)
        seen = self._shapes_seen.setdefault(structure, [])
        seen.append(symbolic_shapes.input_shapes(args, dict(sorted(kwargs.items()))))
        changed = symbolic_shapes.changed_dims(seen)
        if len(seen) == MANY_SHAPES and changed:
            log.warning(
                "zerojax: %s has been called with %d distinct input shapes (changing: %s); "
                "each new shape compiles a new XLA program. Pad the inputs to a few sizes: "
                "`pad_to_multiple_of=` in the data collator (Hugging Face's "
                "DataCollatorWithPadding, DataCollatorForSeq2Seq), or zerojax's "
                "`inputs.pad_to_multiple_of` config option (zerojax.train.shape_buckets)",
                self.name,
                len(seen),
                symbolic_shapes.describe_dims(changed),
            )
        for guards, candidate in self._symbolic.get(structure, ()):
            leaves = drop_value_known_leaves(
                args, reorder_kwargs(kwargs, candidate[1]), self.value_inputs
            )
            shapes = [tuple(np.shape(x)) if _is_array(x) else None for x in leaves]
            if guards.bind(shapes) is not None:
                log.debug(
                    "zerojax: new input shapes for %s served by its symbolic capture (%s); "
                    "compiling, not capturing",
                    self.name,
                    ", ".join(str(k) for k in key[1] if k is not None),
                )
                self._programs[key] = candidate
                return candidate
        # Sizes 0 and 1 torch.export specialises (its 0/1 specialisation): such a dim is not
        # captured symbolic from this example; a later one can be.
        dynamic = {
            name: kept
            for name, dims in changed.items()
            if (kept := tuple(d for d in dims if seen[-1][name][d] >= 2))
        }
        dynamic = dynamic if len(seen) > 1 and not self.value_inputs else {}
        attempt = (structure, tuple(sorted(dynamic.items())))
        if attempt in self._symbolic_failed:
            dynamic = {}  # it failed with these dims once: a second try costs the same again
        if reason is not None:
            log.warning(
                "zerojax: %s for %s (%s); tracing and compiling a new program, cached "
                "for later calls with these shapes%s",
                reason,
                self.name,
                ", ".join(str(k) for k in key[1] if k is not None),
                f"; captured with {symbolic_shapes.describe_dims(dynamic)} symbolic, so later "
                "shapes that differ there compile without capturing again"
                if dynamic
                else "",
            )
        example_args, example_kwargs = torch_pytree.tree_map(_as_torch_example, (args, kwargs))
        # A new program can be traced inside the caller's jax.jit (new shapes, a new static
        # value): JAX work torch.export triggers on the side (it reads each parameter's
        # .grad, which a zerojax engine gathers) must stay concrete, not join that trace.
        with jax.ensure_compile_time_eval():
            symbolic = (
                self._capture_symbolic(example_args, example_kwargs, dynamic) if dynamic else None
            )
            if dynamic and symbolic is None:
                self._symbolic_failed.add(attempt)
            if symbolic is None:
                exported = self._capture(example_args, example_kwargs)
                program = GraphFunction(
                    exported, train=self.train, alias=self.alias, model_name=self.name
                )
            else:
                exported, program, guards = symbolic
        key = _signature_key(args, kwargs, self.value_inputs, self.name)
        out_spec = exported.call_spec.out_spec
        register_output_types(out_spec)
        entry = (program, exported.call_spec.in_spec, out_spec)
        self._programs[key] = entry
        if symbolic is not None:
            self._symbolic.setdefault(structure, []).append((guards, entry))
        return entry

    def _capture_symbolic(self, args, kwargs, dynamic):
        """(program, GraphFunction, ShapeGuards) of capture() with the `dynamic` dims symbolic,
        or None where that does not give a program serving other shapes: the capture fails (a
        guard on a size torch cannot keep symbolic; a symbolic graph the interpreter does not
        take), torch specialised every one of them (0/1, a guard on the value), or it leaves a
        host read of values (`_capture` specialises those)."""
        try:
            exported = capture(self.module, args, kwargs, train=self.train, dynamic=dynamic)
            program = GraphFunction(
                exported, train=self.train, alias=self.alias, model_name=self.name
            )
            guards = symbolic_shapes.ShapeGuards.of(
                exported, exported.graph_module.meta.get(SHAPE_ASSERTIONS, ())
            )
        except Exception as error:  # noqa: BLE001 - any failure: capture these shapes as they are
            log.debug(
                "zerojax: %s did not capture with %s symbolic (%s); capturing these shapes as "
                "they are",
                self.name,
                symbolic_shapes.describe_dims(dynamic),
                (str(error).strip().splitlines() or [type(error).__name__])[-1][:300],
            )
            return None
        if reads_values_on_host(exported.graph) or not symbolic_shapes.is_symbolic(exported):
            log.debug(
                "zerojax: %s's capture with %s symbolic specialised them or reads values on "
                "the host; capturing these shapes as they are",
                self.name,
                symbolic_shapes.describe_dims(dynamic),
            )
            return None
        return exported, program, guards


def convert(
    module: torch.nn.Module,
    args: Any = (),
    kwargs: dict | None = None,
    *,
    train: bool | None = None,
) -> Converted:
    """Convert `module` into a pure JAX function, tracing it on example `args`/`kwargs`.

    `train` defaults to `module.training` and decides dropout and BatchNorm behaviour.

    >>> converted = zerojax.convert(model, (tokens,))
    >>> logits, _ = jax.jit(converted.apply)(converted.params, converted.buffers, tokens)
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"convert() takes a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    train = module.training if train is None else bool(train)
    return Converted(module, args, dict(kwargs or {}), train=train)


def state_arrays(module: torch.nn.Module, *, read_values: bool = True):
    """(params, buffers, alias) of a module: JAX copies keyed by canonical state_dict name, and
    every name -> the canonical name holding its array (tied tensors share one)."""
    params, param_alias = _named_arrays(
        module.named_parameters(remove_duplicate=False), read_values
    )
    buffers, buffer_alias = _named_arrays(module.named_buffers(remove_duplicate=False), read_values)
    return params, buffers, {**param_alias, **buffer_alias}


def _named_arrays(named_tensors, read_values: bool = True):
    """{canonical name: jax array} and {every name: canonical name} (tied tensors share one)."""
    arrays: dict[str, Any] = {}
    alias: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in named_tensors:
        if tensor is None:
            continue
        canonical = first_name.setdefault(id(tensor), name)
        alias[name] = canonical
        if canonical == name and read_values:
            arrays[name] = from_torch(tensor)
    return arrays, alias


# torch dtypes JAX holds narrower here (no jax_enable_x64): their programs are the narrower
# dtype's, so torch's checks on them need a capture of their own (`check_input_dtypes`).
_NARROWER = {torch.float64: torch.float32, torch.complex128: torch.complex64}
_NARROWED = frozenset(_NARROWER)


def narrows_inputs(args, kwargs) -> bool:
    """Whether a torch tensor among the inputs has a dtype JAX holds narrower (float64)."""
    return any(
        isinstance(leaf, torch.Tensor) and leaf.dtype in _NARROWED
        for leaf in torch_pytree.tree_leaves((args, kwargs))
    )


def _unwrap_static(tree):
    return torch_pytree.tree_map_only(Static, lambda static: static.value, tree)


def _wants_cache(args, kwargs) -> bool:
    """Whether a train-mode caller asked for the KV cache: `use_cache=True` or a cache passed."""
    return kwargs.get("use_cache") is True or contains_cache((args, kwargs))


def _is_array(leaf) -> bool:
    return isinstance(leaf, (torch.Tensor, jax.Array, np.ndarray))


def _as_jax(leaf):
    return from_torch(leaf) if isinstance(leaf, torch.Tensor) else jnp.asarray(leaf)


def _as_torch_example(leaf):
    """A torch tensor with `leaf`'s shape and dtype, to trace with (values when concrete). A
    float64 tensor is traced as the float32 it runs as: its program is keyed, and serves, as
    float32 (`check_input_dtypes` checks what torch would say of the float64 itself)."""
    if isinstance(leaf, torch.Tensor):
        return leaf.to(_NARROWER[leaf.dtype]) if leaf.dtype in _NARROWER else leaf
    if not _is_array(leaf):
        return leaf
    dtype = jnp.result_type(leaf)
    # JAX holds torch's int64 (token ids, labels) as int32 unless x64 is on: trace as int64.
    torch_dtype = torch.int64 if dtype == jnp.int32 else to_torch_dtype(dtype)
    if isinstance(leaf, jax.core.Tracer):
        return torch.zeros(leaf.shape, dtype=torch_dtype)
    return to_torch(leaf).to(torch_dtype)


def _is_data_dependent(error: CaptureError) -> bool:
    """Whether torch.export failed on a guard on values (GuardOnDataDependentSymNode & co)."""
    text = str(error)
    return "data-dependent" in text or "data dependent" in text


def _signature_key(args, kwargs, value_inputs=frozenset(), model_name=""):
    """Cache key: the pytree structure plus (shape, dtype) of arrays / value of other leaves,
    and the values of `value_inputs`."""
    # jax.jit passes keyword arguments sorted by name: the key must not depend on their order.
    leaves, spec = torch_pytree.tree_flatten_with_path((args, dict(sorted(kwargs.items()))))
    described = []
    for path, leaf in leaves:
        if value_inputs and input_key(path) in value_inputs:
            described.append(_value_of(leaf, input_key(path), model_name))
        elif isinstance(leaf, torch.Tensor):
            described.append((tuple(leaf.shape), str(to_jax_dtype(leaf.dtype))))
        elif _is_array(leaf):
            described.append((tuple(leaf.shape), str(jnp.result_type(leaf))))
        else:
            described.append(repr(leaf))
    return str(spec), tuple(described)


def _structure_of(key) -> tuple:
    """A signature key with each array's shape replaced by its rank: the calls a symbolic
    capture may serve (same pytree, dtypes, ranks, non-array values, value inputs)."""
    spec, described = key
    return spec, tuple(
        (len(d[0]), d[1]) if isinstance(d, tuple) and len(d) == 2 else d for d in described
    )


def _value_of(leaf, key: str, model_name: str):
    """A value input's (shape, values) for the key: concrete, or an error saying how to pass it."""
    if isinstance(leaf, jax.core.Tracer):
        raise TypeError(
            f"{model_name} reads the values of input '{key}' on the host, so the program is "
            f"specialised on them; under jax.jit pass it as a static value: "
            f"zerojax.bridge.Static(np.asarray({key}))"
        )
    array = leaf.numpy(force=True) if isinstance(leaf, torch.Tensor) else np.asarray(leaf)
    # By value, not dtype: torch's int64 ids arrive as JAX int32 in later calls.
    return ("value", array.shape, array.astype(np.int64).tobytes())
