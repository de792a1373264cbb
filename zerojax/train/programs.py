"""The pure programs of one training step, and the compiled executables that ran them.

Training is five programs over the arrays of a `TrainState` (`zerojax.train.state`), each a pure
function of its inputs, jitted and compiled once per input signature:

- `forward`: the converted model on compute-dtype params (inference, no gradients);
- `forward_vjp`: outputs plus the pullback (`jax.vjp` inside jit returns it as a pytree of
  residuals, so `backward` is compiled once and the residuals stay on device), less the params
  among them, which `backward` takes as they are (`Residuals`);
- `loss_and_grads`: forward and backward fused, when the traced model returns its own loss
  (a scalar, `.loss` or `["loss"]`): nothing but the loss crosses into torch;
- `backward`: the pullback of torch's cotangents, gradients placed per `plan.grads`;
- `update`: unscale (fp16), clip, the torch-exact optimizer update, loss-scale bookkeeping.

The two gradient programs also say, once per compiled signature, which gradients the loss
reaches (`Program.last_reached`, `zerojax.train.gradient_reach`): the others are torch's `None`,
left out of the accumulated gradients, so the update (compiled per set of parameters with a
gradient) skips them as torch's optimizers do.

ZeRO is nothing but where arrays live, so each program is ordinary JAX with sharding
constraints where the stage decides: params -> `plan.compute_params` where an op of the model
reads them (stage 3 all-gathers there, per step, freed after use; each op reading one is a
checkpointed region, so the backward pass gathers again rather than keep it: FSDP's reshard
after forward, `bridge.remat.find_gather_regions`), gradients -> `plan.grads` (stage 2+
reduces them into shards), new params -> `plan.params`; the optimizer state stays on
`plan.opt_state`.

Offload (config `offload`) is where arrays live too: state on its ZeRO sharding in pinned host
memory. With the optimizer state and masters offloaded (or no masters) the update's
element-wise step runs on the host, as an XLA host computation on the host shards
(`zerojax.compat.jax_api.on_host`): new params (in their dtype) come out, and the device never
holds the state (`StepPrograms._host_update`). With only one of them offloaded the update moves
each offloaded shard to its device and back (`moved_state`). Offloaded gradients leave the
backward pass one transfer each (`as_grads`), accumulate on the host (`HOST_GRADIENT_OPS`) and
are unscaled and clipped there, the overflow check and the norm read from device copies
(`_gradient_checks`). Offloaded params are brought in where an op reads them (`apply`'s
`param_use`), inside that op's rematerialized region. The arithmetic is the non-offloaded
update's either way (`_stepped`), so on CPU results are bitwise the same.

Every program is compiled ahead of time (`Program`, with `xla_options.compiler_options`: on
CPU activation checkpointing's barriers kept, gradients reduced per layer, the update in
place), so what training ran can be inspected: `Program.last.memory_analysis()` is the
executable the last call used, which is what `zerojax.memory_report` reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from zerojax.bridge.convert import Converted
from zerojax.bridge.index_bounds import IndexBounds
from zerojax.compat.jax_api import on_host
from zerojax.config import Config
from zerojax.pallas_kernels.backend import auto_picks_pallas
from zerojax.parallel import ExpertLoadLog
from zerojax.runtime import gc_pause, program_cache
from zerojax.sharding.zero import HOST_MEMORY_KIND, ShardingPlan
from zerojax.train import optimizers
from zerojax.train.gradient_reach import flat_argument_marks, reached_outputs
from zerojax.train.precision import PrecisionPolicy, next_loss_scale_state
from zerojax.train.state import weights_of
from zerojax.train.xla_options import compiler_options

PROGRAM_NAMES = ("forward", "forward_vjp", "loss_and_grads", "backward", "update")


def is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def find_scalar_loss(outputs) -> Any:
    """Path to the loss in a model's outputs: () for a scalar output, 'loss' for `.loss` or
    `["loss"]`; None when the model returns no loss of its own.

    A tuple's first element is deliberately not taken as the loss: a model returning
    `(scalar, logits)` whose loop backpropagates something else would then be refused by the
    fused path; such models run the general path (`forward_vjp` + `backward`) instead."""
    if isinstance(outputs, jax.ShapeDtypeStruct | jax.Array):
        return () if outputs.ndim == 0 and is_float(outputs) else None
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if isinstance(loss, jax.ShapeDtypeStruct | jax.Array) and loss.ndim == 0:
        return "loss"
    return None


def pick_loss(outputs, path):
    if path == ():
        return outputs
    return outputs["loss"] if isinstance(outputs, dict) else outputs.loss


def _leaf_signature(leaf) -> tuple:
    if isinstance(leaf, jax.Array):
        # Key arrays (the rng) have no weak_type; their dtype names the key implementation.
        weak_type = getattr(leaf, "weak_type", False)
        return (leaf.shape, leaf.dtype, weak_type, _sharding_key(leaf.sharding, leaf.ndim))
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return (leaf.shape, leaf.dtype, leaf.weak_type, _sharding_key(leaf.sharding, leaf.ndim))
    return (type(leaf), np.shape(leaf), np.result_type(leaf))


@lru_cache(maxsize=4096)
def _sharding_key(sharding, ndim: int):
    """What a compiled executable requires of an argument's sharding: equivalence (the layout
    over the devices), not the object. The state's first params are placed with the plan's
    specs (`P(None, None)`), the update returns them as `P()`; keyed by the objects, the
    update compiled (or loaded from the cache) a second time in the second step, for the same
    program. A NamedSharding is keyed by its mesh and its spec with every dimension spelled
    out (`P()` == `P(None, None)`, `P(('data',))` == `P('data')`); other shardings by
    themselves. Cached: a step's hundreds of arguments share a few sharding objects, and this
    ran for each at every call (ConvNeXt's SGD update, 390 arguments: 0.5 -> 0.26 ms a call)."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    spec = tuple(axes[0] if isinstance(axes, tuple) and len(axes) == 1 else axes for axes in spec)
    return (sharding.mesh, spec, sharding.memory_kind)


class Program:
    """One jitted function compiled ahead of time, once per input signature (tree structure,
    shapes, dtypes, shardings: what `jax.jit` keys its own cache on). Calling it runs the
    compiled executable; `last` is the one the latest call ran, for `memory_analysis()`.

    With `reached_from=i`, each signature's traced jaxpr also says which outputs are computed
    from positional argument i (`zerojax.train.gradient_reach`): `last_reached` is that tree
    of booleans (the outputs' structure) for the latest call."""

    def __init__(
        self,
        name: str,
        fn: Callable,
        *,
        reached_from: int | None = None,
        cache_identity: Callable[[], str | None] | None = None,
        **jit_options,
    ):
        self.name = name
        self._jitted = jax.jit(fn, **jit_options)
        self._reached_from = reached_from
        # A description of everything `fn` closes over, by content (None: not describable):
        # with it the program is served from the persistent program cache when one is
        # configured (runtime/program_cache.py). Only for programs whose tracing computes
        # nothing else the caller reads, jitted with no options but donation.
        assert cache_identity is None or (
            reached_from is None and set(jit_options) <= {"donate_argnums"}
        ), "a cached program is traced for its module alone"
        self._cache_identity = cache_identity
        self._jit_options = jit_options
        # Signature -> (executable, reached tree or None).
        self._compiled: dict[Any, Any] = {}
        self._by_avals: dict[Any, Any] = {}
        self.last = None
        self.last_reached = None

    def __call__(self, *args):
        """Run the program; with `jax.ShapeDtypeStruct` arguments (an abstract engine) only
        compile it and return its results' shapes and shardings."""
        leaves, treedef = jax.tree.flatten(args)
        compiled, self.last_reached = self._executable(args, leaves, treedef)
        self.last = compiled
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            return compiled.out_info
        return compiled(*args)

    def prepare(self, *args):
        """The executable for these arguments' signature, compiled now if it is not yet (or
        loaded from the persistent cache); nothing runs, and no argument's value is read, so
        arrays still being computed can be passed."""
        return self._executable(args, *jax.tree.flatten(args))[0]

    def _executable(self, args, leaves, treedef):
        # A step's arguments are mostly the last step's outputs: the same avals and sharding
        # objects. Looked up by those first (equal avals and equal shardings have equal
        # signatures), a call skips `_leaf_signature`'s per-leaf work (ConvNeXt's SGD update,
        # 390 arguments: 0.39 -> 0.09 ms); a miss falls back to the signature, so a program
        # still compiles once per signature.
        quick = (
            treedef,
            tuple(
                [
                    (x.aval, x.sharding) if isinstance(x, jax.Array) else _leaf_signature(x)
                    for x in leaves
                ]
            ),
        )
        entry = self._by_avals.get(quick)
        if entry is not None:
            return entry
        key = (treedef, tuple(_leaf_signature(x) for x in leaves))
        entry = self._compiled.get(key)
        if entry is None:
            entry = self._compiled[key] = self._compile(args, leaves, treedef)
        self._by_avals[quick] = entry
        return entry

    def _compile(self, args, leaves, treedef):
        """(executable, reached tree or None) for these arguments: loaded from the program
        cache, or traced, lowered and compiled (and then stored in the cache)."""
        platform = _platform(leaves)
        options = compiler_options(platform)
        cache_key = None
        if self._cache_identity is not None and program_cache.cache_directory() is not None:
            identity = self._cache_identity()
            if identity is not None:
                cache_key = program_cache.program_key(
                    self.name, identity, treedef, leaves, self._jit_options, platform, options
                )
        # No full GC walks the process while tracing grows it (runtime/gc_pause.py).
        with gc_pause.collection_paused():
            if cache_key is not None:
                compiled = program_cache.load(
                    cache_key, self.name, args, self._jit_options, options
                )
                if compiled is not None:
                    return compiled, None
            traced = self._jitted.trace(*args)
            reached = None
            if self._reached_from is not None:
                marks = flat_argument_marks(args, self._reached_from)
                reached = jax.tree.unflatten(traced.out_tree, reached_outputs(traced.jaxpr, marks))
            if cache_key is not None:
                compiled = program_cache.export_and_store(
                    cache_key, self.name, traced, args, platform, self._jit_options, options
                )
                if compiled is not None:
                    return compiled, reached
            lowered = traced.lower()
        return lowered.compile(compiler_options=options or None), reached

    def num_compiled(self) -> int:
        """How many signatures this program has been compiled for."""
        return len(self._compiled)


# Runtime settings that say where caches and reports go, not what a program computes: a
# restarted job's new effective-time log must not miss its programs.
_NOT_PROGRAM_SETTINGS = ("compilation_cache_dir", "effective_time_log", "report_effective_time")


def _config_for_key(config: Config) -> dict:
    """The config's sections as a program cache key describes them (runtime's own
    `_NOT_PROGRAM_SETTINGS` left out; any other runtime setting is in)."""
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    runtime = sections.pop("runtime")
    sections["runtime"] = {
        f.name: getattr(runtime, f.name)
        for f in dataclasses.fields(runtime)
        if f.name not in _NOT_PROGRAM_SETTINGS
    }
    return sections


@jax.tree_util.register_pytree_node_class
class Residuals:
    """The forward program's pullback without the params it read: those stay the forward's
    own arrays (`params`) and are handed to the backward program beside the residuals.

    A jitted program copies every output, an input returned unchanged included: returned in
    the pullback, every weight an op differentiates through was copied by each forward."""

    def __init__(self, kept, layout):
        self.kept = kept
        self.layout = layout  # (the pullback's treedef, ((leaf index, param name), ...))

    @classmethod
    def of(cls, pullback, params) -> Residuals:
        leaves, treedef = jax.tree.flatten(pullback)
        names = {id(value): name for name, value in params.items()}
        holes = tuple((i, names[id(leaf)]) for i, leaf in enumerate(leaves) if id(leaf) in names)
        taken = {i for i, _ in holes}
        kept = [leaf for i, leaf in enumerate(leaves) if i not in taken]
        return cls(kept, (treedef, holes))

    def pullback(self, params):
        treedef, holes = self.layout
        leaves: list[Any] = list(self.kept)
        for i, name in holes:
            leaves.insert(i, params[name])
        return jax.tree.unflatten(treedef, leaves)

    def tree_flatten(self):
        return (self.kept,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)


@jax.custom_jvp
def _after(value, activations):
    """`value`, computed no earlier than `activations` (an optimization barrier over both)."""
    return jax.lax.optimization_barrier((value, activations))[0]


@_after.defjvp
def _after_jvp(primals, tangents):
    # The tangent is `value`'s alone. Differentiating the barrier itself would carry zero
    # tangents for `activations` through it, which the forward pass then returned as
    # residuals: zeros the size of each gathered weight's activations, kept for the backward.
    return _after(*primals), tangents[0]


def _cast_on_host(array, dtype):
    if array.dtype == dtype:
        return array
    return on_host(lambda a: a.astype(dtype))(array)


def _platform(leaves) -> str:
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.devices())).platform
        if isinstance(getattr(leaf, "sharding", None), jax.sharding.Sharding):
            return next(iter(leaf.sharding.device_set)).platform
    return jax.default_backend()


class StepPrograms:
    """The programs of one engine: its plan, precision policy, kernels and clipping baked in.
    Each builder returns a cached `Program`; see the module docstring. The parallelism the
    model runs under is the plan's (`plan.parallel`, a `zerojax.parallel.ParallelPlan`)."""

    def __init__(self, plan: ShardingPlan, policy: PrecisionPolicy, config: Config):
        self.plan = plan
        self.parallel = plan.parallel
        self.policy = policy
        self.config = config
        self.mesh = plan.mesh
        self.replicated = NamedSharding(plan.mesh, PartitionSpec())
        self._programs: dict[tuple, Program] = {}
        experts = self.parallel.experts
        # Each step's routing per grouped GEMM, as `Engine.moe_stats()` reports it.
        self.expert_load_log = (
            experts.load_log
            if experts is not None and experts.load_log is not None
            else ExpertLoadLog()
        )

    def compiled(self) -> dict[str, Any]:
        """Program name -> the compiled executable its latest call ran, in `PROGRAM_NAMES`
        order, for the programs that have run."""
        latest: dict[str, Any] = {}
        for program in self._programs.values():
            if program.last is not None:
                latest[program.name] = program.last
        return {name: latest[name] for name in PROGRAM_NAMES if name in latest}

    def forget(self, converted: Converted) -> None:
        """Drop the programs of `converted` (keyed by its id, which a later object may reuse)."""
        # Keys are (program name, id(converted), ...) for the model's programs.
        for key in [key for key in self._programs if key[1:2] == (id(converted),)]:
            del self._programs[key]

    def _cached(self, key: tuple, build: Callable[[], Program]) -> Program:
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    # --- the model on compute-layout params -------------------------------------------------

    def apply(self, converted: Converted, params, buffers, args, kwargs, rng):
        """(outputs, new_buffers, index flags): the converted model on compute-dtype,
        compute-layout params (stage 3 gathers here); `rng` is (base key, call number), as
        `Engine.next_rng` gives it. The flags are the out-of-range checks of the indices it
        read (`zerojax.bridge.index_bounds`, config `train.check_index_bounds`): one small
        int32 vector, or None when nothing is checked."""
        rng = jax.random.fold_in(*rng)
        policy = self.policy

        def param_use(name, value, activations):
            # Where an op reads the parameter, not up front: inside a checkpointed region the
            # stage-3 gather is then recomputed in the backward pass instead of kept.
            gathered = self.plan.compute_params[name]
            if activations and gathered != self.plan.params[name]:
                # ...and not before the op's activations exist: without this order XLA:CPU's
                # scheduler starts every layer's all-gather at the top of the program, so
                # all of them are live at once (measured: 0.8 GB per 6.7B-model layer).
                # The same holds for bringing in a host shard (parameter offload).
                value = _after(value, activations)
            if "params" in self.plan.offloaded:
                value = jax.device_put(value, self.plan.on_device(self.plan.params[name]))
            if gathered != self.plan.params[name]:
                # (Not where the param is read as it is: the constraint would be a new value,
                # kept for the backward pass as a copy of the param, `Residuals`.)
                value = jax.lax.with_sharding_constraint(value, gathered)
            if is_float(value) and policy.compute_override is not None:
                value = value.astype(policy.compute_dtype)
            return value

        index_bounds = IndexBounds() if self.config.train.check_index_bounds else None
        outputs, new_buffers = converted.apply(
            params,
            buffers,
            *args,
            rng=rng,
            float_dtype=policy.compute_override,
            kernels=self.config.kernels,
            parallel=self.parallel,
            remat=self.config.activation_checkpointing,
            param_use=param_use,
            # FSDP's reshard after forward (bridge/remat.py, find_gather_regions).
            regather_params=frozenset(
                n for n in params if self.plan.compute_params[n] != self.plan.params[n]
            ),
            index_bounds=index_bounds,
            **kwargs,
        )
        outputs = jax.tree.map(
            lambda x: x.astype(policy.output_dtype) if is_float(x) else x, outputs
        )
        flags = None if index_bounds is None else index_bounds.packed()
        if flags is not None:
            # Replicated: each process reads its own copy on the host, no gather.
            flags = jax.lax.with_sharding_constraint(flags, self.replicated)
        return outputs, new_buffers, flags

    def as_grads(self, grads):
        """Float gradients in the grad dtype, placed per `plan.grads` (stage 2+: in shards;
        with gradient offload, each then copied out to its host shard: XLA starts the copy
        when the backward pass has produced the gradient, not at the program's end)."""
        plan, dtype = self.plan, self.policy.grad_dtype

        def placed(name, grad):
            sharding = plan.grads[name]
            if "params" in plan.offloaded:
                # The pullback of bringing the shard in has already moved its gradient out, in
                # the compute dtype, on the parameter's shard (ZeRO-3: the gradient's shard).
                return jax.lax.with_sharding_constraint(_cast_on_host(grad, dtype), sharding)
            grad = jax.lax.with_sharding_constraint(grad.astype(dtype), plan.on_device(sharding))
            return jax.device_put(grad, sharding) if "grads" in plan.offloaded else grad

        return {n: placed(n, g) for n, g in grads.items() if is_float(g)}

    # --- forward / backward -----------------------------------------------------------------

    def forward(self, converted: Converted) -> Program:
        """(params, buffers, args, kwargs, rng) -> (outputs, new_buffers, index flags)."""

        def forward(params, buffers, args, kwargs, rng):
            return self.apply(converted, params, buffers, args, kwargs, rng)

        return self._cached(("forward", id(converted)), lambda: Program("forward", forward))

    def forward_vjp(self, converted: Converted, differentiable: tuple[bool, ...]) -> Program:
        """(params, buffers, args, kwargs, rng) -> (outputs, new_buffers, pullback, index
        flags); `differentiable[i]` says whether positional input i gets an input gradient."""

        def forward(params, buffers, args, kwargs, rng):
            def f(params, diff_args):
                merged = iter(diff_args)
                full = [next(merged) if d else a for a, d in zip(args, differentiable)]
                outputs, new_buffers, flags = self.apply(
                    converted, params, buffers, full, kwargs, rng
                )
                return outputs, (new_buffers, flags)

            diff_args = [a for a, d in zip(args, differentiable) if d]
            outputs, pullback, (new_buffers, flags) = jax.vjp(f, params, diff_args, has_aux=True)
            return outputs, new_buffers, Residuals.of(pullback, params), flags

        return self._cached(
            ("forward_vjp", id(converted), differentiable),
            lambda: Program("forward_vjp", forward),
        )

    def loss_and_grads(self, converted: Converted, loss_path) -> Program:
        """(params, buffers, args, kwargs, rng, scale) -> (outputs, new_buffers, grads, index
        flags): the gradients of `scale * loss` (fp16 loss scaling), the model's own loss at
        `loss_path`."""

        def fused(params, buffers, args, kwargs, rng, scale):
            def f(params):
                outputs, new_buffers, flags = self.apply(
                    converted, params, buffers, args, kwargs, rng
                )
                loss = pick_loss(outputs, loss_path)
                return loss.astype(jnp.float32) * scale, (outputs, new_buffers, flags)

            (_, (outputs, new_buffers, flags)), grads = jax.value_and_grad(f, has_aux=True)(params)
            return outputs, new_buffers, self.as_grads(grads), flags

        # Which gradients the loss reaches: those computed from `scale` (gradient_reach).
        return self._cached(
            ("loss_and_grads", id(converted), loss_path),
            lambda: Program("loss_and_grads", fused, reached_from=5),
        )

    def backward(self, converted: Converted, absent: tuple[bool, ...] = ()) -> Program:
        """(residuals, params, cotangents, scale) -> (grads, input grads); `params`: the
        arrays the forward program read. `absent[i]`: torch sent no gradient for output leaf
        i (its cotangent is zeros), so nothing reached through it alone gets a gradient
        (`Program.last_reached`, from `scale`: `zerojax.train.gradient_reach`)."""

        def backward(residuals, params, cotangents, scale):
            pullback = residuals.pullback(params)
            leaves, treedef = jax.tree.flatten(cotangents)
            leaves = [
                c if i < len(absent) and absent[i] else (c * scale).astype(c.dtype)
                for i, c in enumerate(leaves)
            ]
            param_grads, input_grads = pullback(jax.tree.unflatten(treedef, leaves))
            return self.as_grads(param_grads), input_grads

        return self._cached(
            ("backward", id(converted), absent),
            lambda: Program("backward", backward, reached_from=3),
        )

    # --- the optimizer update ---------------------------------------------------------------

    def update(self, spec: optimizers.OptimizerSpec) -> Program:
        """(params, master, opt_state, grads, hyper, loss_scale) ->
        (params, master, opt_state, loss_scale, finite). Params, master and optimizer state are
        donated. With fp16 loss scaling, skipped (state kept) when the gradients are not
        finite; `finite` is None without it."""
        return self._cached(("update", spec), lambda: self._build_update(spec))

    def _build_update(self, spec) -> Program:
        policy, plan = self.policy, self.plan
        loss_scale_config = policy.loss_scale
        clip = self.config.train.gradient_clipping
        adam_kernel = self._fused_adam_update() if spec.family == "adam" else None

        def update(params, master, opt_state, grads, hyper, loss_scale):
            host_update = self.updates_on_host(master)
            if not host_update:
                master, opt_state = self.moved_state(master, opt_state, to_host=False)
            scale = None if loss_scale is None else loss_scale["scale"]
            if "grads" in plan.offloaded:
                # Host gradients are processed on the host, in the host step; what needs all of
                # them at once (the overflow check, the clipping norm) reads device copies of
                # each, freed after its reduction.
                finite, clip_coef = self._gradient_checks(grads, scale, clip)
            else:
                grads = unscaled(grads, scale)
                # Without loss scaling torch steps whatever the gradients hold, and so does
                # this: the check and the state it keeps cost ResNet-18's SGD step 50 of its
                # 77 ms on CPU (a copy and a reduction per parameter, bench/cnn_step.py).
                finite = None if scale is None else all_finite(grads)
                if clip is not None:
                    grads, _ = clip_by_global_norm(grads, jnp.float32(1.0), clip, 2.0)
                scale = clip_coef = None  # applied
            new_loss_scale = (
                next_loss_scale_state(loss_scale_config, loss_scale, finite)
                if loss_scale is not None
                else None
            )
            if host_update:
                new_params, new_master, new_state = self._host_update(
                    spec, params, master, opt_state, grads, hyper, finite, scale, clip_coef
                )
                return new_params, new_master, new_state, new_loss_scale, finite
            weights = weights_of(params, master)
            new_weights, new_state = _stepped(
                spec, weights, grads, opt_state, hyper, finite, adam_kernel
            )
            if master is not None:
                new_master = {n: new_weights[n] for n in master}
                new_params = {
                    n: new_master[n].astype(p.dtype) if n in new_master else p
                    for n, p in params.items()
                }
            else:
                new_master, new_params = None, new_weights
            new_params = {
                n: jax.lax.with_sharding_constraint(p, plan.params[n])
                for n, p in new_params.items()
            }
            new_master, new_state = self.moved_state(new_master, new_state, to_host=True)
            return new_params, new_master, new_state, new_loss_scale, finite

        return Program(
            "update",
            update,
            cache_identity=lambda: self._update_identity(spec),
            donate_argnums=(0, 1, 2),
        )

    def _update_identity(self, spec: optimizers.OptimizerSpec) -> str | None:
        """What the update closes over, by content (`program_cache.describe`): the spec, the
        plan's shardings, the precision policy and the config. None (not cached) under
        offload: its host computations and memory kinds are not exported as they run."""
        plan = self.plan
        if plan.offloaded:
            return None
        try:
            return program_cache.describe(
                {
                    "spec": spec,
                    "policy": self.policy,
                    "config": _config_for_key(self.config),
                    "stage": plan.stage,
                    "mesh": plan.mesh,
                    **{
                        component: dict(getattr(plan, component))
                        for component in (
                            "params",
                            "compute_params",
                            "grads",
                            "opt_state",
                            "master_weights",
                            "shapes",
                        )
                    },
                }
            )
        except program_cache.Undescribable:
            return None

    def updates_on_host(self, master) -> bool:
        """Whether the update's element-wise step runs on the host (ZeRO-Offload's CPU
        optimizer): when the optimizer state and the master weights it reads are all offloaded.
        With the state offloaded but masters on the device (or the reverse) the state is moved
        to the device for the step instead (`moved_state`)."""
        offloaded = self.plan.offloaded
        return "opt_state" in offloaded and (master is None or "master_weights" in offloaded)

    def _gradient_checks(self, grads, scale, clip):
        """(finite, clip coefficient) of host gradients, each None where not configured: the
        device update's overflow check and clipping norm (same arithmetic), computed on a
        device copy of each gradient shard."""
        if scale is None and clip is None:
            return None, None
        plan = self.plan
        copies = unscaled(
            {n: jax.device_put(g, plan.on_device(plan.grads[n])) for n, g in grads.items()}, scale
        )
        finite = None if scale is None else all_finite(copies)
        coef = None if clip is None else clip_coefficient(global_norm(copies, 1.0, 2.0), clip)
        return finite, coef

    def _host_update(
        self, spec, params, master, opt_state, grads, hyper, finite, scale=None, clip_coef=None
    ):
        """(new params: on the device, or on the host under parameter offload; new master and
        optimizer state in host memory): the element-wise optimizer step computed as an XLA
        host computation (`on_host`) on the host-resident shards, so the device never holds
        optimizer state or master weights.

        What crosses: each fp32 gradient shard in, unless gradient offload has it there already
        (resharded to its optimizer state's layout first: under ZeRO-1 gradients are
        replicated, state sharded), then unscaled and clipped here with the device's
        coefficients (`scale`, `clip_coef`: see `_gradient_checks`); each new parameter shard
        out in the params' dtype (cast on the host, so bf16 crosses, not fp32), then gathered
        to `plan.params` on the device, or kept on the host under parameter offload. The
        arithmetic is `_stepped`, the device path's; XLA:CPU compiles both, so on CPU the
        results are bitwise equal. The
        fused Adam kernel is a device kernel and is not used here."""
        plan = self.plan
        replicated_host = self.replicated.with_memory_kind(HOST_MEMORY_KIND)

        def state_sharding(name):
            return plan.opt_state.get(name, replicated_host)

        def to_host(array, sharding, component):
            if component in plan.offloaded:  # host gradients or params: resharded there
                return jax.device_put(array, sharding)
            on_device = jax.lax.with_sharding_constraint(array, plan.on_device(sharding))
            return jax.device_put(on_device, sharding)

        host_grads = {n: to_host(g, state_sharding(n), "grads") for n, g in grads.items()}
        weights, weight_shardings = {}, {}
        for n, p in params.items():
            if master is not None and n in master:
                weights[n], weight_shardings[n] = master[n], plan.master_weights[n]
            elif n in spec.param_names:  # no master weight: the param itself is updated
                weight_shardings[n] = state_sharding(n)
                weights[n] = to_host(p, weight_shardings[n], "params")

        def host_scalar(value):
            return None if value is None else jax.device_put(value, replicated_host)

        host_hyper = jax.tree.map(host_scalar, hyper)
        host_finite, host_scale, host_coef = map(host_scalar, (finite, scale, clip_coef))
        param_dtypes = {n: params[n].dtype for n in weights}
        # The new step counts and Adam's per-parameter scalars from them: on the device (their
        # increments are a device constant; the corrections a fori_loop, whose counter XLA's
        # host computation rejects), then moved in as the hyperparameters.
        steps = optimizers.new_step_counts(
            spec, [jax.device_put(s, self.replicated) for s in opt_state["step"]], grads
        )
        corrections = None
        if spec.family == "adam":
            corrections = jax.tree.map(
                lambda c: jax.device_put(c, replicated_host),
                optimizers.adam_step_corrections(spec, steps, grads, hyper),
            )
        host_steps = tuple(jax.device_put(s, replicated_host) for s in steps)

        @on_host
        def step_on_host(
            weights, grads, opt_state, hyper, finite, scale, coef, corrections, new_steps
        ):
            if scale is not None or coef is not None:  # host gradients, as the device does it
                grads = unscaled(grads, scale)
                if coef is not None:
                    grads = {n: (g * coef).astype(g.dtype) for n, g in grads.items()}
            new_weights, new_state = _stepped(
                spec,
                weights,
                grads,
                opt_state,
                hyper,
                finite,
                bias_corrections=corrections,
                new_steps=new_steps,
            )
            new_low = {n: w.astype(param_dtypes[n]) for n, w in new_weights.items()}
            return new_weights, new_state, new_low

        new_weights, new_state, new_low = step_on_host(
            weights,
            host_grads,
            opt_state,
            host_hyper,
            host_finite,
            host_scale,
            host_coef,
            corrections,
            host_steps,
        )

        def new_param(name, param):
            if name not in new_low:
                return param
            if "params" in plan.offloaded:  # the new shard stays on the host
                return jax.device_put(new_low[name], plan.params[name])
            on_device = jax.device_put(new_low[name], plan.on_device(weight_shardings[name]))
            return jax.lax.with_sharding_constraint(on_device, plan.params[name])

        new_params = {n: new_param(n, p) for n, p in params.items()}
        new_master = (
            None
            if master is None
            else {n: jax.device_put(new_weights[n], plan.master_weights[n]) for n in master}
        )
        new_state = jax.tree.map(
            jax.device_put, new_state, plan.optimizer_state_shardings(new_state)
        )
        return new_params, new_master, new_state

    def moved_state(self, master, opt_state, *, to_host: bool):
        """(master, opt_state) with the components the plan offloads moved to their host
        sharding (`to_host`) or to its device-memory twin; the others as they are. Inside a
        program this is the transfer; XLA schedules it."""
        plan = self.plan

        def move(array, sharding):
            return jax.device_put(array, sharding if to_host else plan.on_device(sharding))

        if master is not None and "master_weights" in plan.offloaded:
            master = {n: move(m, plan.master_weights[n]) for n, m in master.items()}
        if opt_state is not None and "opt_state" in plan.offloaded:
            opt_state = jax.tree.map(move, opt_state, plan.optimizer_state_shardings(opt_state))
        return master, opt_state

    def _fused_adam_update(self):
        """The fused AdamW kernel applied shard by shard (config `kernels.optimizer`), or None.

        Each weight, its gradient and moments are updated where the optimizer state lives
        (the ZeRO shards): the update is elementwise, so no collective is needed.
        """
        choice = self.config.kernels.choice("optimizer")
        if choice is None:
            return None
        implementation, interpret = choice
        if implementation == "auto" and not auto_picks_pallas(interpret):
            # Off GPU, "auto" means the XLA reference, which is apply_update's own arithmetic
            # (bitwise): the per-shard wrapper would only add compile time (~2.5 s here).
            return None
        from zerojax.pallas_kernels.adamw import adamw_update_sharded

        def update(group, hyper, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
            specs = {n: self.plan.opt_state.get(n, self.replicated).spec for n in weights}
            results = adamw_update_sharded(
                weights,
                grads,
                exp_avgs,
                exp_avg_sqs,
                hyper,
                mesh=self.mesh,
                specs=specs,
                implementation=implementation,
                interpret=interpret,
                max_exp_avg_sqs=max_exp_avg_sqs,
                maximize=group.maximize,
                decoupled_weight_decay=group.decoupled_weight_decay,
            )
            weights, exp_avgs, exp_avg_sqs = results[:3]
            return weights, exp_avgs, exp_avg_sqs, results[3] if len(results) > 3 else None

        return update


def _stepped(spec, weights, grads, opt_state, hyper, finite, adam_kernel=None, **update_options):
    """(new weights, new optimizer state): `optimizers.apply_update` (which skips parameters
    without a gradient, as torch does), with fp16 loss scaling's skip of a non-finite step
    (`finite` a boolean scalar, or None). The element-wise part of the update, wherever it
    runs (device, or host under offload)."""
    new_weights, new_state = optimizers.apply_update(
        spec, weights, grads, opt_state, hyper, adam_kernel=adam_kernel, **update_options
    )
    if finite is not None:
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_weights, new_state = keep(new_weights, weights), keep(new_state, opt_state)
    return new_weights, new_state


# --- small gradient programs (elementwise, on the shards) ------------------------------------


def _add(a, b):
    return jax.tree.map(lambda x, y: x + y, a, b)


def _add_scaled(a, b, weight):
    """`_add(a, _scale(b, weight))` in one pass (same roundings)."""
    return jax.tree.map(lambda x, y: x + (y * weight).astype(y.dtype), a, b)


def _scale(grads, weight):
    return jax.tree.map(lambda g: (g * weight).astype(g.dtype), grads)


class GradientOps(NamedTuple):
    """How gradients accumulate (`Engine.accumulate`): on the device, or on the host where
    gradient offload keeps them (compiled to compute there, so the device never holds them)."""

    add: Callable
    add_scaled: Callable
    scale: Callable


def _on_host(fn):
    return jax.jit(on_host(fn))


DEVICE_GRADIENT_OPS = GradientOps(jax.jit(_add), jax.jit(_add_scaled), jax.jit(_scale))
HOST_GRADIENT_OPS = GradientOps(_on_host(_add), _on_host(_add_scaled), _on_host(_scale))


def zeros_like_grads(grads: dict) -> dict:
    """Zeros with each gradient's shape, dtype and sharding (host memory included), made by one
    program: `zero_grad(set_to_none=False)`."""
    if any(isinstance(g, jax.ShapeDtypeStruct) for g in grads.values()):
        return dict(grads)  # an abstract engine: zeros have the same shapes
    layout = tuple(sorted((n, g.shape, g.dtype, g.sharding) for n, g in grads.items()))
    return _zeros_program(layout)()


@lru_cache(maxsize=64)
def _zeros_program(layout: tuple) -> Callable[[], dict]:
    return jax.jit(
        lambda: {n: jnp.zeros(shape, dtype) for n, shape, dtype, _ in layout},
        out_shardings={n: sharding for n, _, _, sharding in layout},
    )


def unscaled(grads, scale):
    """Gradients in float32, divided by the fp16 loss scale (`scale`; None without one)."""
    grads = {n: g.astype(jnp.float32) for n, g in grads.items()}
    return grads if scale is None else {n: g / scale for n, g in grads.items()}


def all_finite(grads):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads.values()]))


def global_norm(grads, scale, norm_type: float):
    """torch's clip_grad_norm_ norm of the gradients divided by `scale`."""
    unscaled = [g.astype(jnp.float32) / scale for g in grads.values()]
    if norm_type == float("inf"):
        return jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in unscaled]))
    return sum(jnp.sum(jnp.abs(g) ** norm_type) for g in unscaled) ** (1.0 / norm_type)


def clip_coefficient(norm, max_norm):
    return jnp.minimum(max_norm / (norm + 1e-6), 1.0)


def clip_by_global_norm(grads, scale, max_norm, norm_type: float):
    """torch's clip_grad_norm_: norm of the unscaled gradients, then
    `grads *= min(max_norm / (norm + 1e-6), 1)`; returns (clipped grads, norm)."""
    norm = global_norm(grads, scale, norm_type)
    coef = clip_coefficient(norm, max_norm)
    return {n: (g * coef).astype(g.dtype) for n, g in grads.items()}, norm


clip_by_global_norm_jit = jax.jit(clip_by_global_norm, static_argnums=(3,))


@partial(jax.jit, static_argnums=(2, 3, 4))
def clip_host_grads(grads, scale, max_norm, norm_type: float, on_device: tuple):
    """`clip_by_global_norm` of gradients in host memory: the norm from a device copy of each
    shard (`on_device`: (name, its sharding in device memory) pairs), the scaling on the host."""
    placed = dict(on_device)
    copies = {n: jax.device_put(g, placed[n]) for n, g in grads.items()}
    norm = global_norm(copies, scale, norm_type)
    mesh = next(iter(placed.values())).mesh
    coef = jax.device_put(
        clip_coefficient(norm, max_norm),
        NamedSharding(mesh, PartitionSpec(), memory_kind=HOST_MEMORY_KIND),
    )
    scaled = on_host(_scale)(grads, coef)
    return scaled, norm
