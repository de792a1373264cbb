"""FX graph -> pure JAX function.

A `GraphFunction` walks one exported, core-ATen graph node by node, calling the registered
lowering of each ATen overload on JAX values. It is built once per exported program; calling it
under `jax.jit` traces the walk, so the Python loop costs nothing at run time.

Inputs come in the order of `graph_signature.input_specs` (torch 2.13 lifts constants before
buffers, so placeholder order is not "params, buffers, inputs"); parameter and buffer targets are
resolved through `alias` so that tied weights (GPT-2's wte / lm_head) read one array and their
gradients add up.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.export.graph_signature import InputKind, OutputKind

from zerojax.bridge import custom_ops, fusion, symbolic_shapes
from zerojax.bridge import remat as remat_regions
from zerojax.bridge.dtype_checks import check_operand_dtypes
from zerojax.bridge.dtypes import from_torch, to_jax_dtype
from zerojax.bridge.errors import MissingLoweringError, UnsupportedOpError, node_location
from zerojax.bridge.index_bounds import IndexBounds
from zerojax.bridge.registry import LoweringContext, get_lowering
from zerojax.config import ActivationCheckpointingConfig, KernelsConfig

if TYPE_CHECKING:
    from zerojax.parallel.plan import ParallelPlan

# Placement and layout arguments mean nothing to a JAX value (no per-op device, no strides).
_LAYOUT_KWARGS = ("device", "layout", "pin_memory", "memory_format", "non_blocking")

# Python-level functions torch.export leaves in the graph (tuple access, SymInt arithmetic).
_PYTHON_FUNCTIONS = {
    operator.getitem,
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.truediv,
    operator.mod,
    operator.neg,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    # Size arithmetic of a graph captured with symbolic shapes (symbolic_shapes.py): at trace
    # time the sizes are ints, and these are Python functions of ints.
    operator.pow,
    operator.and_,
    operator.or_,
    math.ceil,
    math.floor,
    torch.sym_max,
    torch.sym_min,
    torch.sym_not,
    torch.sym_float,
    torch.sym_int,
    torch.sym_ite,
}

RANDOM_OPS_NEED_RNG = "pass rng=jax.random.key(seed) to apply() (a fresh key per step)"


class GraphFunction:
    """One exported program as a JAX function of (params, buffers, user inputs, rng)."""

    def __init__(
        self,
        exported: torch.export.ExportedProgram,
        *,
        train: bool,
        alias: dict[str, str],
        model_name: str,
    ):
        self.graph = exported.graph_module.graph
        self.train = train
        self.model_name = model_name
        signature = exported.graph_signature
        self.inputs: list[tuple[InputKind, str | None]] = []
        for spec in signature.input_specs:
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                self.inputs.append((spec.kind, alias.get(spec.target, spec.target)))
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.USER_INPUT):
                self.inputs.append((spec.kind, spec.target))
            else:
                raise UnsupportedOpError(
                    f"{model_name}: graph input '{spec.arg.name}' is a {spec.kind.name}; zerojax "
                    f"supports parameters, buffers, constant tensors and user inputs"
                )
        self.constants = {
            name: _constant(value)
            for name, value in exported.constants.items()
            if isinstance(value, torch.Tensor)
        }
        self.outputs: list[tuple[OutputKind, str | None]] = []
        returned = {
            spec.arg.name
            for spec in signature.output_specs
            if spec.kind == OutputKind.USER_OUTPUT and hasattr(spec.arg, "name")
        }
        for spec in signature.output_specs:
            if spec.kind == OutputKind.BUFFER_MUTATION:
                self.outputs.append((spec.kind, alias.get(spec.target, spec.target)))
            elif spec.kind == OutputKind.USER_OUTPUT:
                self.outputs.append((spec.kind, None))
            elif spec.kind == OutputKind.USER_INPUT_MUTATION and spec.arg.name in returned:
                # Updated in place *and* returned (a Hugging Face StaticCache): the caller gets
                # the new value from the outputs; the pure function leaves its input as it was.
                self.outputs.append((spec.kind, spec.target))
            else:
                what = {
                    OutputKind.USER_INPUT_MUTATION: "mutates one of its inputs in place",
                    OutputKind.PARAMETER_MUTATION: "mutates a parameter in place",
                }.get(spec.kind, f"has a {spec.kind.name} output")
                raise UnsupportedOpError(
                    f"{model_name} {what} ('{spec.target}'); a converted model is a pure "
                    f"function — clone the tensor before modifying it"
                )
        self.num_user_inputs = sum(kind == InputKind.USER_INPUT for kind, _ in self.inputs)
        self.random_sites: dict[torch.fx.Node, int] = {}
        self._check_supported()
        # One rewritten graph per set of enabled pattern kernels (see fusion.py).
        self._graphs: dict[frozenset[str], torch.fx.Graph] = {frozenset(): self.graph}
        self._regions: dict[tuple, dict[torch.fx.Node, remat_regions.Region]] = {}
        # Precisions (compute dtypes) whose operand dtypes were checked (dtype_checks.py).
        self._dtypes_checked: set[str] = set()

    def output_shapes(self, sizes: symbolic_shapes.Sizes | None = None) -> list:
        """The user outputs as torch.export recorded them, without tracing: a
        `jax.ShapeDtypeStruct` per tensor output (its JAX dtype, as `__call__` returns it), the
        value itself for any other output. What a program's outputs look like (is there a scalar
        loss?) is known from the capture; an `eval_shape` of the whole model would trace it.
        `sizes` binds the symbols of a symbolic capture (`ShapeGuards.bind`)."""
        output = next(node for node in reversed(self.graph.nodes) if node.op == "output")
        shapes = []
        for value, (kind, _) in zip(output.args[0], self.outputs, strict=True):
            if kind != OutputKind.USER_OUTPUT:
                continue
            val = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
            if isinstance(val, torch.Tensor):
                shape = tuple(symbolic_shapes.concrete(d, sizes or {}) for d in val.shape)
                val = jax.ShapeDtypeStruct(shape, to_jax_dtype(val.dtype))
            shapes.append(val)
        return shapes

    def sizes_for(self, user_inputs: list) -> dict:
        """symbol -> size: what the symbols of a symbolic capture (symbolic_shapes.py) stand
        for with these user inputs; empty for a capture of fixed shapes."""
        placeholders = (n for n in self.graph.nodes if n.op == "placeholder")
        recorded = [
            node.meta.get("val")
            for node, (kind, _) in zip(placeholders, self.inputs, strict=False)
            if kind == InputKind.USER_INPUT
        ]
        return symbolic_shapes.bind(zip(recorded, user_inputs, strict=True))

    def graph_for(self, kernels: KernelsConfig | None) -> torch.fx.Graph:
        """The graph to run: patterns of the kernel families `kernels` enables fused."""
        kernels = kernels if kernels is not None else KernelsConfig()
        families = fusion.families_for(kernels)
        if families not in self._graphs:
            self._graphs[families] = fusion.rewrite(self.graph, families)
        return self._graphs[families]

    def regions_for(
        self, graph: torch.fx.Graph, remat: ActivationCheckpointingConfig | None
    ) -> dict[torch.fx.Node, remat_regions.Region]:
        """The activation-checkpointing regions of `graph` (see remat.py), by first node."""
        remat = remat if remat is not None else ActivationCheckpointingConfig()
        key = (id(graph), remat)
        if key not in self._regions:
            self._regions[key] = remat_regions.find_regions(graph, remat)
        return self._regions[key]

    def _check_supported(self) -> None:
        missing: dict[str, torch.fx.Node] = {}
        for node in self.graph.nodes:
            if node.op == "call_function":
                target = node.target
                if target in _PYTHON_FUNCTIONS:
                    continue
                if not isinstance(target, torch._ops.OpOverload) or get_lowering(target) is None:
                    missing.setdefault(str(target), node)
            elif node.op in ("call_module", "call_method", "get_attr"):
                missing.setdefault(f"{node.op} {node.target}", node)
        if missing:
            lines = "\n".join(
                f"  {op}  in {node_location(node)}{_custom_op_note(node)}"
                for op, node in sorted(missing.items())
            )
            raise MissingLoweringError(
                f"zerojax has no lowering for {len(missing)} op(s) in {self.model_name}:\n"
                f"{lines}\nzerojax.bridge.supported_ops() lists what is supported; the docs' "
                f"coverage page (docs/coverage.md, 'Op coverage') lists the known gaps and why.",
                ops=tuple(sorted(missing)),
            )

    def __call__(
        self,
        params: dict[str, jax.Array],
        buffers: dict[str, jax.Array],
        user_inputs: list,
        rng: jax.Array | None,
        float_dtype=None,
        kernels: KernelsConfig | None = None,
        parallel: ParallelPlan | None = None,
        remat: ActivationCheckpointingConfig | None = None,
        param_use: Callable[[str, jax.Array, list[jax.Array]], jax.Array] | None = None,
        regather_params: frozenset[str] = frozenset(),
        index_bounds: IndexBounds | None = None,
    ) -> tuple[list, dict[str, jax.Array]]:
        """Run the graph. `param_use(name, value, operands)` is applied to a parameter where an
        op reads it (not once up front), `operands` being the op's other array inputs (its
        activations; for an op on the parameter alone, such as `t`, its users'): a ZeRO-3
        all-gather there lands inside the checkpointed region that uses it, so the backward
        pass gathers again instead of keeping every layer's gathered weights (FSDP's reshard
        after forward), and can be ordered after the activations the op waits for anyway.
        For the parameters in `regather_params` (ZeRO-3's) every op that reads one is such a
        region of its own (`remat.find_gather_regions`). With `index_bounds` (an
        `IndexBounds`), every index an op reads is checked as torch checks it: the recorder
        then holds the program's flag vector (`index_bounds.packed()`)."""
        if len(user_inputs) != self.num_user_inputs:
            raise TypeError(
                f"{self.model_name} was traced with {self.num_user_inputs} tensor input(s), "
                f"got {len(user_inputs)}"
            )
        if str(float_dtype) not in self._dtypes_checked:
            # Products of operands torch refuses (a float64 input to a float32 Linear) raise
            # torch's error instead of being promoted: once per precision, on the captured graph.
            check_operand_dtypes(self.graph, float_dtype)
            self._dtypes_checked.add(str(float_dtype))
        graph = self.graph_for(kernels)
        env: dict[torch.fx.Node, object] = {}
        feed = iter(user_inputs)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        # A symbolic capture is specialised here: its size symbols are the arrays' sizes.
        sizes = self.sizes_for(user_inputs)
        param_names: dict[torch.fx.Node, str] = {}
        for node, (kind, name) in zip(placeholders, self.inputs, strict=True):
            if kind == InputKind.PARAMETER:
                env[node] = _lookup(params, name, "parameter", self.model_name)
                param_names[node] = name
            elif kind == InputKind.BUFFER:
                env[node] = _lookup(buffers, name, "buffer", self.model_name)
            elif kind == InputKind.CONSTANT_TENSOR:
                env[node] = self.constants[name]
            else:
                env[node] = next(feed)

        site_counter = iter(range(1 << 30))

        def read(values: dict, node: torch.fx.Node, consumer: torch.fx.Node | None = None):
            value = values[node]
            if param_use is None or node not in param_names:
                return value
            return param_use(param_names[node], value, activations_beside(consumer, values))

        def activations_beside(consumer: torch.fx.Node | None, values: dict) -> list:
            """The arrays other than parameters that `consumer` reads; for an op on the
            parameter alone (`t`, `permute`, a cast), those its users read, computed so far."""
            if consumer is None:
                return []
            nodes = [n for n in consumer.all_input_nodes if n not in param_names]
            if not nodes:
                nodes = [
                    n
                    for user in consumer.users
                    for n in user.all_input_nodes
                    if n is not consumer and n not in param_names
                ]
            return [values[n] for n in nodes if isinstance(values.get(n), jax.Array)]

        def context(node):
            return LoweringContext(
                node=node,
                train=self.train,
                rng_for_site=_site_rng(rng, site_counter, node, self.model_name),
                float_dtype=float_dtype,
                kernels=kernels,
                parallel=parallel,
                sizes=sizes,
            )

        regions = self.regions_for(graph, remat)
        if regather_params:
            constants = {
                node
                for node, (kind, _) in zip(placeholders, self.inputs, strict=True)
                if kind == InputKind.CONSTANT_TENSOR
            }
            gather_regions = remat_regions.find_gather_regions(
                graph, param_names, regather_params, constants, regions
            )
            regions = {**regions, **gather_regions}
        skip = set()
        for node in graph.nodes:
            if node.op == "placeholder" or node in skip:
                continue
            if node.op == "output":
                results = list(node.args[0])
                break
            region = regions.get(node)
            if region is not None:
                _run_region(region, env, context, read, index_bounds)
                skip.update(region.nodes)
                continue
            env[node] = _evaluate(node, env, context, read, index_bounds)
        outputs, new_buffers = [], dict(buffers)
        for value, (kind, name) in zip(results, self.outputs, strict=True):
            value = read(env, value) if isinstance(value, torch.fx.Node) else value
            if kind == OutputKind.BUFFER_MUTATION:
                # A buffer keeps its own dtype (e.g. int64 num_batches_tracked, fp32 stats).
                new_buffers[name] = jnp.asarray(value, dtype=buffers[name].dtype)
            elif kind == OutputKind.USER_OUTPUT:
                outputs.append(value)
        return outputs, new_buffers


def _constant(tensor: torch.Tensor):
    """A constant tensor of the graph as JAX. A model built on the `meta` device (planning its
    memory, `zerojax plan --devices`) has constants without values: zeros of their shape stand
    in, since such a program is compiled, never run."""
    if tensor.device.type == "meta":
        return jnp.zeros(tuple(tensor.shape), to_jax_dtype(tensor.dtype))
    return from_torch(tensor)


def _evaluate(
    node: torch.fx.Node,
    env: dict,
    context: Callable,
    read: Callable,
    index_bounds: IndexBounds | None = None,
) -> object:
    """One node's value from its inputs' values in `env` (each taken through `read`); the
    indices it reads recorded in `index_bounds` when given."""
    args = torch.fx.node.map_arg(node.args, lambda n: read(env, n, node))
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: read(env, n, node))
    if node.target in _PYTHON_FUNCTIONS:
        return node.target(*args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in _LAYOUT_KWARGS}
    ctx = context(node)
    fused = isinstance(node.target, fusion.FusedOp)
    lowering = node.target if fused else get_lowering(node.target)
    try:
        value = lowering(ctx, *args, **kwargs)
    except Exception as error:
        error.add_note(f"while lowering {node.target} in {node_location(node)}")
        raise
    if index_bounds is not None:
        index_bounds.record(node, args, kwargs)
    return _conform(value, node.meta.get("val"), ctx, node)


def _run_region(
    region: remat_regions.Region,
    env: dict,
    context: Callable,
    read: Callable,
    index_bounds: IndexBounds | None = None,
) -> None:
    """Evaluate a region's nodes as one function under `jax.checkpoint`; put its outputs in
    `env`. Values that are not arrays (sizes, None, flags) cross the boundary as static Python
    values, closed over on the way in and recorded at trace time on the way out. The region's
    index checks leave it as outputs too (values of the inner trace cannot be kept aside)."""
    leaves, tree = jax.tree.flatten([env[n] for n in region.inputs])
    traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    static_outputs: dict[str, object] = {}

    def body(*arrays):
        inner = static_outputs["index_bounds"] = None if index_bounds is None else IndexBounds()
        values = list(leaves)
        for i, array in zip(traced, arrays, strict=True):
            values[i] = array
        local = dict(zip(region.inputs, jax.tree.unflatten(tree, values), strict=True))
        for node in region.nodes:
            local[node] = _evaluate(node, local, context, read, inner)
        out_leaves, static_outputs["tree"] = jax.tree.flatten([local[n] for n in region.outputs])
        static_outputs["leaves"] = [
            _TRACED if isinstance(leaf, jax.Array) else leaf for leaf in out_leaves
        ]
        checks = [] if inner is None else inner.extremes
        return [leaf for leaf in out_leaves if isinstance(leaf, jax.Array)], checks

    policy = remat_regions.checkpoint_policy(region.policy, region.origin)
    arrays, checks = jax.checkpoint(body, policy=policy)(*(leaves[i] for i in traced))
    if index_bounds is not None:
        index_bounds.extend(static_outputs["index_bounds"].sites, checks)
    arrays = iter(arrays)
    out_leaves = [next(arrays) if leaf is _TRACED else leaf for leaf in static_outputs["leaves"]]
    outputs = jax.tree.unflatten(static_outputs["tree"], out_leaves)
    env.update(zip(region.outputs, outputs, strict=True))


_TRACED = object()  # marks an array output of a region (the others are static values)


def _custom_op_note(node: torch.fx.Node) -> str:
    """For a custom op: why it was not decomposed, and how to lower it."""
    if not custom_ops.is_custom(node.target):
        return ""
    name = node.target._schema.name
    reason = node.meta.get(custom_ops.NO_DECOMPOSITION, "it was not decomposed")
    return (
        f"\n    custom op: {reason}; lower it with "
        f'@zerojax.register_lowering("{name}") (see its docstring)'
    )


def _lookup(tree: dict, name: str, what: str, model_name: str):
    try:
        return tree[name]
    except KeyError:
        raise KeyError(
            f"{model_name}: {what} '{name}' missing from the {what}s passed to apply() "
            f"(got {len(tree)}: {', '.join(list(tree)[:5])}{', ...' if len(tree) > 5 else ''})"
        ) from None


def _site_rng(rng, counter, node, model_name) -> Callable[[], jax.Array]:
    """A thunk giving this node's key: fold_in(rng, site index), the index fixed at first use."""

    def key() -> jax.Array:
        if rng is None:
            raise ValueError(
                f"{model_name} draws random numbers ({node.target} in {node_location(node)}, "
                f"e.g. dropout in train mode); {RANDOM_OPS_NEED_RNG}"
            )
        return jax.random.fold_in(rng, next(counter))

    return key


def _is_static(dim) -> bool:
    return isinstance(dim, int) or (isinstance(dim, torch.SymInt) and dim.node.is_constant())


def _bound(dim: torch.SymInt, sizes: symbolic_shapes.Sizes, got: int) -> int:
    """A symbolic dim's size for the bound input sizes; `got` where no input binds it (an
    unbacked size, such as bincount's, sized by values: whatever the lowering chose)."""
    try:
        return symbolic_shapes.concrete(dim, sizes)
    except ValueError:
        return got


def _conform(value, meta, ctx: LoweringContext, node):
    """Cast a lowering's result to torch's recorded dtype and check torch's recorded shape."""
    if isinstance(meta, torch.Tensor):
        value = jnp.asarray(value)
        # A dim torch could only record as an unbacked symbol (bincount's length, sized by
        # values) is whatever the lowering chose; the static dims are checked.
        expected = tuple(
            int(d) if _is_static(d) else _bound(d, ctx.sizes, got)
            for d, got in zip(meta.shape, value.shape)
        )
        if value.ndim != meta.ndim or value.shape != expected:
            raise AssertionError(
                f"lowering of {node.target} returned shape {value.shape}, torch says {expected} "
                f"({node_location(node)})"
            )
        dtype = ctx.jax_dtype(meta.dtype)
        return value if value.dtype == dtype else value.astype(dtype)
    if isinstance(meta, (tuple, list)) and isinstance(value, (tuple, list)):
        return type(value)(_conform(v, m, ctx, node) for v, m in zip(value, meta, strict=True))
    if isinstance(value, (np.ndarray, np.generic)):
        return jnp.asarray(value)
    return value
