"""An optimizer's own `step()`, captured once by torch.compile on a stand-in and run as one
recorded op: no Python of the step runs per step.

An optimizer that runs its own step on live tensors (RMSprop, NAdam, Adafactor, a user's
subclass: `zerojax.train.optimizer_shim`, `zerojax.train.late_optimizers`) is replayed from a
trace (`zerojax.train.replay`), which still runs the step's Python every step: torch's
per-parameter loops and foreach calls, each dispatched to the live tensors. That Python alone
took longer than the compiled update's whole step for most of torch's optimizers.

Here the step runs on a *twin*: an optimizer of the same class over plain CPU tensors of the
same shapes and dtypes (`torch.empty`, never written: no memory is touched), with the live
optimizer's param groups and state keys. torch.compile (dynamo) traces the twin's step with a
backend of ours: the graph it hands us (the step's tensor ops, its Python evaluated) is made
functional core ATen by torch's own functionalization and the bridge's decompositions (its
in-place updates become new values of its inputs) and lowered with the bridge's table. Each
later `step()` calls the compiled twin step: dynamo's guards check that the twin's step would
trace the same graph (its param groups' values, which tensors have gradients), and our
backend's callable records the graph as one op on the *live* tensors the twin's tensors stand
for -- parameters, gradients, state -- and writes its results into them. So its program and
its sharded state are those of a recorded step; only the Python is gone.

- **Hyperparameters** are copied into the twin before each step. A float that changes is made
  a graph input by dynamo after its first change; the twin is traced a second time with its
  learning rate moved at capture, so a schedule never traces it again. Any other value that
  changes is a new trace, guarded by dynamo.
- **Without dynamo** (`_Shortcut`): while nothing its guards check has changed but the
  floats its graph takes as inputs (and values its guards passed changed once), the graph
  dynamo ran last runs again with those floats read afresh, and dynamo's frame and guards
  cost nothing. A graph whose guards test such a float (a branch on the learning rate)
  keeps dynamo at every step.
- **Run alone** (`_Program._run_alone`): with nothing recorded before it, the step runs at
  once as a program of its own (`deferred.run_alone`), its results written straight into the
  live tensors' arrays and the engine's entries, with no recording's bookkeeping per tensor.
  After recorded ops (torch's clip before an optimizer built after `initialize`) it is
  recorded as one op after them: one program for both.
- **Outputs apart** (`_computed_apart`): where two outputs share an expensive element-wise
  value (Adadelta's square roots), each output is computed on its own, so XLA:CPU does not
  write that value out and read it back.
- **Reductions apart** (`_reductions_apart`): several reductions of one input alone
  (Adafactor's row and column means of a gradient's squares) each read a copy of their own,
  so each computes its element-wise producer itself instead of reading it written out.
- **Step counts** (0-d host state of one dtype) are made views of one buffer in place
  (`_SharedHostState`): read and written at once.
- **Bound** (`zerojax.train.step_binding`): while the optimizer holds the very objects it
  held after its last captured step (groups, parameters, which have gradients, state dicts
  and tensors: compared by identity), the step's layout, its live tensors' sources and its
  host tensors are not looked up again, nor is its state placed again before it.
- **Host scalars.** What the step computes from its host state and hyperparameters alone
  (torch's step counts, bias corrections, Rprop's and ASGD's 0-d tensors, RAdam's
  rectification) is computed by a small program of its own in float64, as torch computes it
  from Python floats, and handed to the recorded op as inputs; the host state's new values are
  copied into the live optimizer's tensors at once, as torch's step leaves them. Each distinct
  per-parameter computation runs once over the vector of the parameters' values
  (`_HostOverParameters`), where that gives the same bits.
- **Our guard** (`_layout`): which parameters each group holds, which have gradients, the
  state's keys and kinds. Another layout captures another twin (a few are kept).
- **Not captured** (the step runs as before, replayed): the first step (it makes the state),
  a step given a closure, state that is not a tensor, host state of more than one element, a
  step dynamo cannot trace as one graph (a host read it branches on, a graph break), a graph
  that returns values or computes host state from device values, an op without a lowering.
  Each is logged once, with the reason.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import logging
import operator
import re
import types
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._dynamo.source import TensorPropertySource
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.weak import WeakIdKeyDictionary

from zerojax.bridge.capture import decomposition_table
from zerojax.bridge.dtypes import to_jax_dtype
from zerojax.bridge.interpreter import _evaluate
from zerojax.bridge.registry import LoweringContext
from zerojax.train import deferred, step_binding
from zerojax.train.live_tensor import LiveTensor, Owned
from zerojax.train.parameters import EngineEntry, live_of

__all__ = ["captures", "disabled", "run"]

log = logging.getLogger(__name__)

# optimizer -> {layout: its _Capture, or None where its step cannot be captured}: a few
# layouts each (a parameter without a gradient every other step would otherwise capture anew
# at every step).
_captures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_LAYOUTS = 4
_serials = itertools.count()
_enabled = [True]
_counts = {"captures": 0, "traces": 0, "steps": 0, "shortcuts": 0, "alone": 0, "bound": 0}
# How an input of the captured graph gets its value each step.
_PARAM, _GRAD, _STATE, _HOST_STATE, _ARGUMENT, _CONSTANT, _OWN = range(7)
# How dynamo traces a twin's step, at every call (dynamo guards on its config): `addcmul_`,
# `addcdiv_` and `add_` with a tensor alpha as they are, not as inductor's fused multiply-adds
# (one rounding; torch's eager kernels, which the live path matches, round each product); and
# past its limit of traces per code object an error, not the twin's step run eagerly.
_TRACING_CONFIG = {"enable_dynamo_decompositions": False, "fail_on_recompile_limit_hit": True}


class _Tracing:
    """dynamo's config as `_TRACING_CONFIG` says within, as it was after: set and restored
    attribute by attribute (`torch._dynamo.config.patch` costs twice as much, at every step)."""

    def __enter__(self):
        config = torch._dynamo.config
        self.before = [(key, getattr(config, key)) for key in _TRACING_CONFIG]
        for key, value in _TRACING_CONFIG.items():
            setattr(config, key, value)

    def __exit__(self, *exc):
        config = torch._dynamo.config
        for key, value in self.before:
            setattr(config, key, value)


# `.item()` in a traced step (Adafactor reads its step count so): the value, traced.
_ITEM = torch.ops.aten._local_scalar_dense.default
# torch's functions of Python scalars, which the values `.item()` read are in a traced step.
_SCALAR_FUNCTIONS = {
    torch.sym_min: jnp.minimum,
    torch.sym_max: jnp.maximum,
    torch.sym_float: lambda x: x * 1.0,  # the float type of the program: float64 on the host
    torch._sym_sqrt: jnp.sqrt,
}


# What a captured step's state tensors are: live ones, and host ones (0-d: `_Program`).
_STATE_KINDS = frozenset({LiveTensor, torch.Tensor})
# The sources a step run alone writes its results into itself (`_Program._run_alone`): a live
# tensor's own array (the optimizer's state) and an engine entry (a parameter).
_OWNERS = frozenset({Owned, EngineEntry})
# Group entries a twin keeps its own of: its tensors.
_NOT_COPIED = frozenset({"params"})


class NotCapturable(Exception):
    """Why a step runs as before (logged once per layout)."""


def captures() -> dict[str, int]:
    """How many twins were captured, how many graphs dynamo traced for them, how many steps
    ran a captured graph, how many of those without dynamo (`_Shortcut`), how many as a
    program of their own (`_Program._run_alone`: nothing was recorded before them) and how
    many found their tensors as an earlier step had (`step_binding`)."""
    return dict(_counts)


@contextlib.contextmanager
def disabled():
    """No step is captured meanwhile: each runs its Python, replayed (`zerojax.train.replay`),
    as a step that cannot be captured does."""
    _enabled[0] = False
    try:
        yield
    finally:
        _enabled[0] = True


def run(optimizer: torch.optim.Optimizer, binding: step_binding.Binding | None = None) -> bool:
    """Run `optimizer`'s step as its captured program; False where it cannot (run it as
    before then). `binding`: `step_binding.held(optimizer)`, where the optimizer holds what
    its last captured step found (its layout and state are not looked up again)."""
    if not _enabled[0]:
        return False
    if any(_is_zero(group.get("lr")) for group in optimizer.param_groups):
        # dynamo traces an optimizer's step with `capturable` set (torch's own choice for a
        # compiled step), and Adam's capturable step divides by the learning rate: at lr 0 (a
        # frozen group, a schedule that ends at 0) every parameter became NaN, where torch's
        # own step leaves them as they are. Such a step runs as before.
        return False
    known = _captures.get(optimizer)
    if known is None:
        known = _captures[optimizer] = {}
        if not _has_state(optimizer):  # its first step makes its state: the twin's could not
            return False
    layout = _layout(optimizer) if binding is None else binding.layout
    if layout is None:
        return False
    capture = known.get(layout, False)
    if capture is False:
        if len(known) >= _MAX_LAYOUTS:
            known.pop(next(iter(known)))  # the oldest
        try:
            capture = known[layout] = _Capture(optimizer, layout)
        except NotCapturable as why:
            log.info("zerojax: %s's step runs op by op: %s", type(optimizer).__name__, why)
            capture = known[layout] = None
    if capture is None:
        return False
    try:
        capture.step(binding)
    except NotCapturable as why:  # raised before anything was written
        log.info("zerojax: %s's step runs op by op: %s", type(optimizer).__name__, why)
        known[layout] = None
        return False
    if binding is None:
        step_binding.bind(optimizer, layout)
    return True


def _is_zero(value) -> bool:
    """Whether `value` is a Python number equal to 0 (a tensor is not looked at: no host read)."""
    return type(value) in (float, int) and value == 0


def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter with a gradient has state (made in the constructor, as
    Adagrad's; loaded, as a resumed run's): then even its first step can be captured, and a
    resumed run's steps are those of the run it resumes, bit for bit."""
    state = optimizer.state
    return all(
        state.get(p)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    )


def _layout(optimizer: torch.optim.Optimizer) -> tuple | None:
    """What a twin mirrors, beyond hyperparameter values: per group, each parameter, whether
    it has a gradient, its state's keys and kinds (a live tensor or a host one; `record`
    checks their shapes and dtypes). None where the step cannot be captured now: a parameter
    that is not live, state that is not a tensor. A parameter whose state its step makes (its
    first gradient) makes a twin whose graph writes the twin's state, which is not captured:
    that step runs as before, and the next is captured."""
    state = optimizer.state
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if live_of(p) is None:
                return None
            entries = state.get(p)
            kinds = () if not entries else tuple(map(type, entries.values()))
            if not set(kinds) <= _STATE_KINDS:
                return None
            params.append((id(p), p.grad is not None, tuple(entries or ()), kinds))
        groups.append((tuple(group), tuple(params)))
    return tuple(groups)


class _Capture:
    """One optimizer's twin, its compiled step and what each twin tensor stands for."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: tuple):
        if optimizer.defaults.get("differentiable"):
            raise NotCapturable("it is differentiable")
        if any(group.get("fused") for group in optimizer.param_groups):
            # torch's fused kernels, which dynamo does not trace (their step is recorded as
            # one op: `zerojax.train.fused_optimizer_ops`)
            raise NotCapturable("it is fused")
        self.optimizer = weakref.ref(optimizer)
        self.layout = layout
        # (The parameters, and what each twin tensor stands for, are the capture's: what dynamo
        # keeps of a trace, which is never freed, holds the capture weakly.)
        self.twin, self.params, self.stands_for = _twin(optimizer)
        self.sources: dict[int, list] = {}  # a program's number -> its live tensors' sources
        self.lowered: list[_Graph] = []
        self.called = False
        self.dry = True
        self.shortcut: _Shortcut | None = None
        self.writing = False  # (set by `_Program.record` once it writes the live tensors)
        self.binding: step_binding.Binding | None = None  # (during `step`: the step's)
        _counts["captures"] += 1
        # The step itself, without torch's wrappers (hooks; `_use_grad`, whose graph breaks
        # keep dynamo from seeing one graph): run under no_grad, as `_use_grad` runs it.
        step = _own_code(inspect.unwrap(type(optimizer).step))
        self.own_name = step.__code__.co_varnames[0]  # (`self`: dynamo's names start from it)
        self.compiled = torch.compile(step, backend=_Backend(self), fullgraph=True)
        # Traced twice before it runs: with the learning rate as it is, then moved, so that a
        # schedule's next value does not trace it again (dynamo makes a float that changed an
        # input of the graph).
        try:
            self._call()
            for group in self.twin.param_groups:
                if type(group.get("lr")) is float:
                    group["lr"] = group["lr"] * 0.5 + 1e-3
            self._call()
        except NotCapturable:
            raise
        except Exception as error:  # noqa: BLE001 (dynamo's own errors: not one graph)
            raise NotCapturable(_reason(error)) from None
        self.dry = False

    def _call(self) -> None:
        self.called = False
        with torch.no_grad(), _Tracing():
            self.compiled(self.twin)
        if not self.called:
            raise NotCapturable("dynamo ran the step without a graph of ours")

    def step(self, binding: step_binding.Binding | None) -> None:
        optimizer = self.optimizer()
        self.writing = False
        self.binding = binding
        try:
            with torch.no_grad():
                shortcut = self.shortcut
                args = None if shortcut is None else shortcut.args_for(optimizer.param_groups)
                if args is not None:
                    _counts["shortcuts"] += 1
                    shortcut.graph.program.record(self, args)
                    return
            twin_groups = self.twin.param_groups
            for group, twin_group in zip(optimizer.param_groups, twin_groups, strict=True):
                for key, value in group.items():
                    if key not in _NOT_COPIED:
                        twin_group[key] = value
            traces = _counts["traces"]
            self._call()
            if (
                shortcut is not None
                and _counts["traces"] == traces
                and self.shortcut is not None
                and self.shortcut.graph is shortcut.graph
            ):
                # dynamo's guards passed the same graph on the values that stopped the
                # shortcut: those its trace never read (Rprop's learning rate).
                shortcut.graph.unguarded |= shortcut.changed(optimizer.param_groups)
        except NotCapturable:
            raise
        except Exception as error:  # a new trace that dynamo or the lowering refused
            if self.writing:  # the step has begun to write: not run again as before
                raise
            raise NotCapturable(_reason(error)) from None
        finally:
            self.binding = None  # (it holds the state: `step_binding.bind`'s hook frees it)


def _reason(error: Exception) -> str:
    """An error's type, first line and notes (the op a lowering failed on, and where)."""
    first = (str(error).splitlines() or [""])[0]
    return "; ".join([f"{type(error).__name__}: {first}", *getattr(error, "__notes__", [])])


def _own_code(function):
    """`function` with a code object of its own: dynamo keeps its traces per code object, and
    each optimizer's twin is traced apart (its cache never holds another's graphs). Its name
    is its own too: what dynamo learns of a function's values across traces (which floats and
    sizes changed, and so become graph inputs: `torch._dynamo.pgo`) is keyed by file, line and
    name, and a capture that inherited an earlier one's (Adafactor captured with weight decay
    0 and then 0.1 in one process) took its weight decay as an input with a guard on it, which
    kept every later Adafactor capture of the process out of the shortcut past dynamo."""
    code = function.__code__.replace(co_name=f"{function.__code__.co_name}_{next(_serials)}")
    own = types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    own.__kwdefaults__ = function.__kwdefaults__
    return own


def _twin(optimizer: torch.optim.Optimizer):
    """An optimizer of `optimizer`'s class over plain CPU tensors standing for its live ones;
    its parameters, in order; {id(twin tensor): (kind, index of its parameter, state key)}."""
    twin = object.__new__(type(optimizer))
    # Its attributes (defaults, a user's own), not its hooks nor methods set on it (an LR
    # scheduler's wrapped `step`): those refer back to the optimizer, which the capture, a
    # value of `_captures` under it, must not keep alive.
    twin.__dict__.update(
        (k, v)
        for k, v in optimizer.__dict__.items()
        if not callable(v) and not k.endswith("_hooks")
    )
    # The optimizer's own tensors (a GradScaler's `grad_scale` and `found_inf`, a tensor
    # learning rate): their values change between steps, and the twin's step would read them
    # as constants of its graph. Such a step is not captured (`_Program`).
    stands_for: dict[int, tuple] = {
        id(value): (_OWN, None, name)
        for name, value in [
            *optimizer.__dict__.items(),
            *((k, v) for group in optimizer.param_groups for k, v in group.items()),
        ]
        if isinstance(value, torch.Tensor)
    }
    groups, state, originals = [], collections.defaultdict(dict), []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            index = len(originals)
            originals.append(p)
            stand_in = torch.nn.Parameter(
                torch.empty(tuple(p.shape), dtype=p.dtype), requires_grad=p.requires_grad
            )
            stands_for[id(stand_in)] = (_PARAM, index, None)
            if p.grad is not None:
                stand_in.grad = torch.empty(tuple(p.shape), dtype=p.dtype)
                stands_for[id(stand_in.grad)] = (_GRAD, index, None)
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, LiveTensor):
                    copy = torch.empty(tuple(value.shape), dtype=value.dtype)
                    stands_for[id(copy)] = (_STATE, index, key)
                else:
                    copy = value.clone()
                    stands_for[id(copy)] = (_HOST_STATE, index, key)
                state[stand_in][key] = copy
            params.append(stand_in)
        groups.append({**group, "params": params})
    twin.param_groups = groups
    twin.state = state
    return twin, originals, stands_for


class _Backend:
    """torch.compile's backend for one capture: each graph dynamo traces becomes a `_Graph`.
    It holds the capture weakly: dynamo keeps its backends as long as the traced code."""

    def __init__(self, capture: _Capture):
        self.capture = weakref.ref(capture)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        _counts["traces"] += 1
        capture = self.capture()
        graph = _Graph(capture, gm, _guards_values())
        capture.lowered.append(graph)
        return graph


def _guards_values() -> bool:
    """Whether dynamo's trace now ending guards the values of its float inputs (a branch on
    the learning rate: `lr > 0.05` holds for this graph only), or cannot say: then no
    `_Shortcut` runs its graph, which would skip that guard. (Its runtime asserts on values
    the graph computes, from `.item()`, are no guards: dynamo does not check them either.)
    Guards on the twin's tensor sizes alone do not count: a process that traced the same
    optimizer class on other shapes before makes them symbols, which the trace pins to the
    twin's sizes (`Eq(s84, 32)`), and the shortcut runs on the twin's own tensors."""
    try:
        shape_env = torch._guards.TracingContext.try_get().fake_mode.shape_env
        sources = shape_env.var_to_sources
        return any(
            not all(isinstance(s, TensorPropertySource) for s in sources.get(symbol, [None]))
            for guard in shape_env.guards
            for symbol in guard.expr.free_symbols
        )
    except AttributeError:  # (another torch's internals: dynamo runs every step)
        return True


class _Graph:
    """One graph dynamo traced of a twin's step: lowered at its first real call, then recorded
    on the live tensors at each call."""

    def __init__(self, capture: _Capture, gm: torch.fx.GraphModule, guards_values: bool):
        self.capture = weakref.ref(capture)  # (dynamo keeps this object as long as the code)
        self.gm = gm
        self.guards_values = guards_values
        # (group index, key) of hyperparameters whose values its guards do not check (a
        # `_Shortcut` checks only their types).
        self.unguarded: set[tuple[int, str]] = set()
        self.program = None
        # Where each float hyperparameter the graph takes as an input comes from
        # (`_float_inputs`); None: from somewhere else (no shortcut).
        self.floats: list[tuple] | None = None

    def __call__(self, *args):
        capture = self.capture()
        capture.called = True
        if capture.dry:
            return ()
        if self.program is None:
            self.program = _Program(capture, self.gm, args)
            self.floats = _float_inputs(self.gm, args, capture)
            self.gm = None
        self.program.record(capture, args)
        capture.shortcut = _Shortcut.taken(self, args, capture.optimizer().param_groups)
        return ()


class _Shortcut:
    """The graph dynamo ran last for a capture, run again without dynamo (its guards, its
    frame, the hyperparameters copied into the twin: a third of a step's Python) while what
    its guards check is as it was then: the twin (ours: never changed; another layout is
    another capture), torch's global state (grad mode, default dtype, ...: dynamo's own
    snapshot of it) and every hyperparameter of the live optimizer's groups, equal in type
    and value -- but for the floats the graph takes as inputs (a scheduled learning rate),
    which are read afresh, as dynamo would hand them over, and for those whose change dynamo's
    guards once passed on the same graph (its trace never read their values: Rprop's
    learning rate), which keep only their type. Anything else changed: dynamo runs the step
    (it may trace it again), and its graph is the next shortcut."""

    def __init__(self, graph: _Graph, args: tuple, groups: list[dict]):
        self.graph = graph
        self.args = list(args)
        self.groups = [{k: v for k, v in g.items() if k not in _NOT_COPIED} for g in groups]
        self.inputs = {(index, key) for _, index, key in graph.floats}
        self.global_state = torch._C._dynamo.guards.GlobalStateGuard()

    @classmethod
    def taken(cls, graph: _Graph, args: tuple, groups: list[dict]) -> _Shortcut | None:
        """The shortcut to `graph`, just run on `args` with hyperparameters `groups`; None where
        its inputs are not all the twin's tensors and hyperparameters."""
        if graph.floats is None or graph.guards_values:
            return None
        for position, index, key in graph.floats:  # (the name matched: the value must)
            value = groups[index].get(key)
            if type(value) is not float or args[position].item() != value:
                return None
        return cls(graph, args, groups)

    def changed(self, groups: list[dict]) -> set[tuple[int, str]]:
        """(group index, key) of the plain hyperparameters (numbers, strings, tuples of them)
        whose values in `groups` differ from this shortcut's, in the same type."""
        return {
            (index, key)
            for index, (group, seen) in enumerate(zip(groups, self.groups, strict=False))
            for key, value in seen.items()
            if type(group.get(key, _MISSING)) is type(value)
            and _same(value, value)  # a plain value: one `_same` can tell apart
            and not _same(group[key], value)
        }

    def args_for(self, groups: list[dict]) -> list | None:
        """The graph's arguments for a step with hyperparameters `groups`; None where dynamo
        must run it."""
        if len(groups) != len(self.groups) or not self.global_state.check():
            return None
        for index, (group, seen) in enumerate(zip(groups, self.groups, strict=True)):
            if len(group) != len(seen) + len(_NOT_COPIED):  # a key added
                return None
            for key, value in seen.items():
                now = group.get(key, _MISSING)
                if (index, key) in self.inputs:
                    if type(now) is not float:
                        return None
                elif (index, key) in self.graph.unguarded:
                    if type(now) is not type(value):
                        return None
                elif not _same(now, value):
                    return None
        args = list(self.args)
        for position, index, key in self.graph.floats:
            args[position] = groups[index][key]  # (a float: read as such by `_host_vector`)
        return args


_MISSING = object()
_PLAIN = (bool, int, float, str, type(None))


def _same(a, b) -> bool:
    """Whether hyperparameter values `a` and `b` are equal as dynamo's guards take them: plain
    values (and tuples of them: betas) of one type and equal. Anything else (a list, a tensor)
    could have changed in place: never the same (dynamo checks it)."""
    if type(a) is not type(b):
        return False
    if type(a) is tuple:
        return len(a) == len(b) and all(map(_same, a, b))
    return type(a) in _PLAIN and (a is b or a == b)


def _float_inputs(gm: torch.fx.GraphModule, args: tuple, capture: _Capture) -> list | None:
    """Where each input of `gm` that is not a twin tensor comes from, as (its position, group
    index, hyperparameter key): a float hyperparameter dynamo made an input after it
    changed, handed over as a 0-d tensor and named after its source (its placeholder's target
    is dynamo's `L['self'].param_groups[0]['lr']` with each run of other characters as one
    `_`). None where one is anything else."""
    own = capture.own_name
    names = {
        re.sub(r"[^a-zA-Z0-9]+", "_", f"L['{own}'].param_groups[{index}]['{key}']"): (index, key)
        for index, group in enumerate(capture.twin.param_groups)
        for key in group
        if key not in _NOT_COPIED
    }
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    floats = []
    for position, (node, arg) in enumerate(zip(placeholders, args, strict=True)):
        if id(arg) in capture.stands_for:
            continue
        source = names.get(node.target)
        if source is None or not isinstance(arg, torch.Tensor) or arg.dim() != 0:
            return None
        floats.append((position, *source))
    return floats


class _Program:
    """The graph as core ATen, in two programs: the host's -- the scalars the step computes
    from its host state and hyperparameters (bias corrections, step counts), in float64 as
    torch computes them from Python floats -- and the recorded op on the live tensors, which
    takes those scalars as inputs."""

    def __init__(self, capture: _Capture, gm: torch.fx.GraphModule, args: tuple):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        if any(v is not None for v in jax.tree.leaves(output.args[0])):
            raise NotCapturable("its graph returns values")
        lifted, examples, attrs = _lifted(gm, args)
        # Where each input's value comes from at each step: (kind, index of its parameter,
        # state key); a constant's value, an argument's position, in the index's place.
        inputs: list[tuple] = []
        for i, tensor in enumerate(examples):
            kind, param, key = capture.stands_for.get(id(tensor), (None, None, None))
            if kind is None:
                if not isinstance(tensor, torch.Tensor):
                    raise NotCapturable(f"an input of its graph is a {type(tensor).__name__}")
                kind, param = (
                    (_CONSTANT, tensor.detach().clone()) if i < attrs else (_ARGUMENT, i - attrs)
                )
            if kind == _OWN:
                raise NotCapturable(f"its step reads its tensor '{key}' (a value of each step)")
            if kind in (_HOST_STATE, _ARGUMENT, _CONSTANT) and tensor.dim() != 0:
                # (a constant of another shape: state dynamo made for the twin as it traced --
                # torch's `_init_group` for a parameter's first step -- which no live tensor
                # holds)
                raise NotCapturable(f"a host tensor of its graph has shape {tuple(tensor.shape)}")
            inputs.append((kind, param, key))
        self.graph = graph = _functional_aten(lifted, examples)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        after = next(n for n in graph.nodes if n.op == "output").args[0]
        written = {  # input index -> its new value
            i: node for i, node in enumerate(after) if node is not placeholders[i]
        }
        if any(inputs[i][0] == _CONSTANT for i in written):
            raise NotCapturable("its step writes a tensor no live one stands for")

        # The live inputs: (kind, index of its parameter, state key) each.
        self.live = [i for i, (kind, _, _) in enumerate(inputs) if kind in (_PARAM, _GRAD, _STATE)]
        self.live_nodes = [placeholders[i] for i in self.live]
        self.live_inputs = [inputs[i] for i in self.live]
        self.live_metadata = [(tuple(examples[i].shape), examples[i].dtype) for i in self.live]
        self.live_written = [k for k, i in enumerate(self.live) if i in written]
        live_avals = [
            jax.ShapeDtypeStruct(tuple(examples[i].shape), to_jax_dtype(examples[i].dtype))
            for i in self.live
        ]
        self.avals = [live_avals[k] for k in self.live_written]
        self.device_outputs = [written[self.live[k]] for k in self.live_written]
        self.apart = _computed_apart(self.device_outputs, set(self.live_nodes))
        self.reductions_apart = _reductions_apart(graph, set(self.live_nodes))

        # The host inputs (0-d), one vector per dtype.
        host_inputs = [
            i for i, (kind, _, _) in enumerate(inputs) if kind in (_HOST_STATE, _ARGUMENT)
        ]
        self.host_groups = _by_dtype(host_inputs, lambda i: examples[i].dtype)
        self.host_nodes = [[placeholders[i] for i in group] for _, group in self.host_groups]
        self.host_sources = [[inputs[i] for i in group] for _, group in self.host_groups]
        self.host_numpy_dtypes = [np.dtype(to_jax_dtype(dtype)) for dtype, _ in self.host_groups]
        self.constants = {
            placeholders[i]: param for i, (kind, param, _) in enumerate(inputs) if kind == _CONSTANT
        }
        on_host = {placeholders[i] for i in host_inputs}
        on_host |= {node for node, tensor in self.constants.items() if tensor.numel() <= 1}
        for node in graph.nodes:
            if (
                node.op == "call_function"
                and _is_scalar(node)
                and set(node.all_input_nodes) <= on_host
            ):
                on_host.add(node)
        # Host values the recorded op takes ("crossings"), one vector per dtype.
        crossing = [
            n
            for n in graph.nodes
            if n in on_host and any(u not in on_host and u.op != "output" for u in n.users)
        ]
        self.crossing_groups = _by_dtype(crossing, lambda n: _node_dtype(n))
        # Host tensors written, one vector per dtype.
        host_written = []
        for i in sorted(written):
            if i in host_inputs:
                if inputs[i][0] != _HOST_STATE:
                    raise NotCapturable("its step writes a tensor it was given")
                if written[i] not in on_host:
                    raise NotCapturable("it writes a host tensor from device values")
                host_written.append(i)
        written_groups = _by_dtype(host_written, lambda i: examples[i].dtype)
        self.host_written_groups = [
            (dtype, [written[i] for i in group]) for dtype, group in written_groups
        ]
        self.host_targets = [[inputs[i] for i in group] for _, group in written_groups]
        # Per host vector, its state tensors as views of one buffer, where they are this
        # step's (`_host_vector`); per written vector, the host vector of the same tensors.
        self.shared: list[_SharedHostState | None] = [None] * len(self.host_groups)
        self.written_from = [
            self.host_sources.index(t) if t in self.host_sources else None
            for t in self.host_targets
        ]
        self.host_program = jax.jit(self._host_values)
        # A number of its own (never reused, as an id is): recorded programs are cached by key.
        self.serial = next(_serials)
        self.what = f"{type(capture.optimizer()).__name__}'s captured step"  # (for the log)
        self.key = ("captured step", self.serial, tuple(self.live_metadata))
        # Traced now, so that an op without a lowering is known here, not when the step runs.
        host_vectors = [
            jax.ShapeDtypeStruct((len(group),), to_jax_dtype(dtype))
            for dtype, group in self.host_groups
        ]
        crossing_vectors = [
            jax.ShapeDtypeStruct((len(group),), to_jax_dtype(dtype))
            for dtype, group in self.crossing_groups
        ]
        try:
            with jax.enable_x64(True):
                jax.eval_shape(self._host_values, host_vectors)
            jax.eval_shape(self._device_values, live_avals + crossing_vectors, None)
        except Exception as error:  # noqa: BLE001 (an op the bridge cannot lower, and why)
            raise NotCapturable(_reason(error)) from None
        self.host_program = _HostOverParameters.checked(self, host_vectors) or self.host_program

    def _evaluated(self, env: dict, wanted: list[torch.fx.Node], context) -> list:
        needed = _ancestors(wanted, known=env)
        for node in self.graph.nodes:
            if node.op != "call_function" or node not in needed or node in env:
                continue
            if node.target is _ITEM:  # a host scalar the step read (a step count): its value
                env[node] = jnp.reshape(env[node.args[0]], ())
            elif node.target in _SCALAR_FUNCTIONS:  # torch's functions of such values
                args = [env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
                env[node] = _SCALAR_FUNCTIONS[node.target](*args)
            else:
                env[node] = _evaluate(node, env, context, _read)
        return [env[node] for node in wanted]

    def _host_values(self, host: list) -> tuple[list, list]:
        """(the crossings, the host tensors' new values), one vector per dtype each; computed
        in float64 (under `jax.enable_x64`), as torch's step computes them from Python floats."""
        env = {}
        for nodes, vector in zip(self.host_nodes, host, strict=True):
            wide = (
                vector.astype(jnp.float64) if jnp.issubdtype(vector.dtype, jnp.floating) else vector
            )
            env.update(zip(nodes, list(wide), strict=True))
        for node, tensor in self.constants.items():
            if tensor.numel() <= 1:
                env[node] = jnp.asarray(tensor.numpy())
        groups = [(d, nodes) for d, nodes in self.crossing_groups] + self.host_written_groups
        vectors = []
        for dtype, nodes in groups:
            values = self._evaluated(env, nodes, _host_context)
            vectors.append(
                jnp.stack([jnp.reshape(v, ()).astype(to_jax_dtype(dtype)) for v in values])
            )
        count = len(self.crossing_groups)
        return vectors[:count], vectors[count:]

    def _device_values(self, arrays: list, rng) -> tuple:
        live, crossings = arrays[: len(self.live)], arrays[len(self.live) :]
        env = dict(zip(self.live_nodes, live, strict=True))
        for (_, nodes), vector in zip(self.crossing_groups, crossings, strict=True):
            env.update(zip(nodes, list(vector), strict=True))
        for node, tensor in self.constants.items():
            if node not in env:
                env[node] = jnp.asarray(tensor.numpy())
        # Reductions that read one live input alone, each from its own copy of it
        # (`_reductions_apart`), before anything else is computed from it.
        for source, reductions in self.reductions_apart:
            copies = jax.lax.optimization_barrier([env[source]] * len(reductions))
            for reduction, copy in zip(reductions, copies, strict=True):
                own = {**env, source: copy}
                env[reduction] = self._evaluated(own, [reduction], _context)[0]
        if self.apart is None:
            values = self._evaluated(env, self.device_outputs, _context)
        else:  # each output from its own copy of the live inputs it reads (`_computed_apart`)
            live = {node: env.pop(node) for node in self.live_nodes}
            values = []
            for node, reads in zip(self.device_outputs, self.apart, strict=True):
                own = dict(env)
                own.update(zip(reads, jax.lax.optimization_barrier([live[n] for n in reads])))
                values.append(self._evaluated(own, [node], _context)[0])
        return [v.astype(a.dtype) for v, a in zip(values, self.avals, strict=True)], None

    def record(self, capture: _Capture, args: tuple) -> None:
        """Record the step on the live tensors (checked first: nothing is written where this
        raises NotCapturable)."""
        state = capture.optimizer().state
        params = capture.params
        binding = capture.binding
        # Under a binding that found them (`step_binding`): the same tensors, the same
        # sources, the host tensors still views of their shared buffers.
        found = None if binding is None else binding.found.get(self.serial)
        sources = self._sources(capture, state) if found is None else found
        _counts["bound"] += found is not None
        host = [
            self._host_vector(g, state, params, args, found is not None)
            for g in range(len(self.host_sources))
        ]
        if binding is not None and found is None:
            binding.found[self.serial] = sources
        with jax.enable_x64(True), jax.default_device(_host_device()):
            crossings, new_host = self.host_program(host)
        crossings = [np.asarray(v) for v in crossings]
        capture.writing = True
        _counts["steps"] += 1
        with deferred.exclusive():
            if deferred.idle() and all(type(sources[k]) in _OWNERS for k in self.live_written):
                self._run_alone(sources, crossings)
            else:
                outputs = deferred.record(
                    self.key,
                    self._device_values,
                    [s.value() for s in sources] + crossings,
                    self.avals,
                )
                for k, value in zip(self.live_written, outputs, strict=True):
                    sources[k].write(value)
        for targets, group, vector in zip(
            self.host_targets, self.written_from, new_host, strict=True
        ):
            shared = None if group is None else self.shared[group]
            if shared is not None:  # (read from it above, in this step)
                shared.array[...] = np.asarray(vector)
            else:
                tensors = [state[params[i]][key] for _, i, key in targets]
                torch._foreach_copy_(tensors, torch.from_numpy(np.array(vector)).unbind())

    def _sources(self, capture: _Capture, state) -> list:
        """The sources of the live tensors the step reads, in `self.live_inputs`' order."""
        params = capture.params
        entries = capture.sources.get(self.serial)
        if entries is None:
            # A parameter's or gradient's live tensor is the stand-in's own, over its engine
            # entry for good; a state tensor is looked up at each step (`load_state_dict`
            # replaces it).
            entries = capture.sources[self.serial] = [
                (live_of(params[i] if kind == _PARAM else params[i].grad)._source, None)
                if kind != _STATE
                else (None, key)
                for kind, i, key in self.live_inputs
            ]
        sources = []
        for (source, key), (_, i, _), (shape, dtype) in zip(
            entries, self.live_inputs, self.live_metadata, strict=True
        ):
            if source is None:
                tensor = state[params[i]][key]
                if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise NotCapturable(f"its state '{key}' changed shape or dtype")
                source = tensor._source
            sources.append(source)
        return sources

    def _run_alone(self, sources: list, crossings: list) -> None:
        """The step as a program of its own, run now, where nothing else is recorded (there is
        nothing to fuse it with): its results written straight into the live tensors' arrays
        and, one call per writer, the engine's entries."""
        _counts["alone"] += 1
        arrays = [deferred.resolve(s.value()) for s in sources]
        written = self.live_written
        results = deferred.run_alone(
            self.key,
            self._device_values,
            arrays,
            crossings,
            written,
            [sources[k].sharding for k in written],
            self.what,
        )
        by_writer: dict = {}
        for k, value in zip(written, results, strict=True):
            source = sources[k]
            if type(source) is Owned:  # (left on its sharding by the program)
                source.array = value
            else:
                by_writer.setdefault(source.writer, {})[source.name] = value
        for writer, values in by_writer.items():
            writer(values)

    def _host_vector(
        self, group: int, state, params: list, args: tuple, bound: bool = False
    ) -> np.ndarray:
        """The values of host vector `group`'s tensors: read at once from the buffer they are
        views of (made so the first time they are all the optimizer's 0-d state tensors).
        `bound`: they are the tensors they were when this program last read them."""
        shared = self.shared[group]
        if bound and shared is not None and not shared.moved:
            return shared.array
        sources = self.host_sources[group]
        tensors = [_host_tensor(state, params, args, *source) for source in sources]
        if shared is not None and shared.holds(tensors):
            return shared.array
        if all(kind == _HOST_STATE for kind, _, _ in sources) and all(map(_sharable, tensors)):
            self.shared[group] = shared = _SharedHostState(tensors)
            return shared.array
        self.shared[group] = None
        # (a float the graph takes as an input is a Python float in a shortcut's arguments)
        values = [t.item() if isinstance(t, torch.Tensor) else t for t in tensors]
        return np.array(values, self.host_numpy_dtypes[group])


class _HostOverParameters:
    """The host program (`_Program._host_values`) computed over vectors: a step computes the
    same scalars for each parameter from its own host state (NAdam's bias corrections and
    `mu_product` from each parameter's step count: ~300 loops of one element each in XLA, ~1
    ms of a step on this host), so each distinct computation runs once, over the vector of
    every parameter's values. Computations are told apart by their graphs' structure: ops,
    constant arguments, which host state each reads (by key); a value no parameter's state
    reaches (the learning rate) is computed once. Used only where it gives the same bits as
    the program it stands for on drawn inputs (`checked`)."""

    def __init__(self, program: _Program):
        self.program = program
        # A parameter's host state in the graph -> (host vector, position in it, its key).
        self.leaves = {
            node: (g, i, key)
            for g, (nodes, sources) in enumerate(
                zip(program.host_nodes, program.host_sources, strict=True)
            )
            for i, (node, (kind, _, key)) in enumerate(zip(nodes, sources, strict=True))
            if kind == _HOST_STATE
        }
        outputs = list(program.crossing_groups) + list(program.host_written_groups)
        self.dtypes = [to_jax_dtype(dtype) for dtype, _ in outputs]
        memo: dict = {}
        by_signature: dict = {}
        for v, (_, nodes) in enumerate(outputs):
            for i, node in enumerate(nodes):
                by_signature.setdefault(self._signature(node, memo), []).append((v, i, node))
        # Per distinct computation: a member's node, standing for all; per parameter state it
        # reads, (its node, host vector, each member's position in it); each member's output.
        self.groups = []
        for members in by_signature.values():
            first = members[0][2]
            reads: dict = {}
            for _, _, node in members:
                for leaf, theirs in _paired_leaves(first, node, self.leaves):
                    reads.setdefault(leaf, []).append(self.leaves[theirs][1])
            gathers = [
                (leaf, self.leaves[leaf][0], np.array(positions))
                for leaf, positions in reads.items()
            ]
            self.groups.append((first, gathers, [(v, i) for v, i, _ in members]))
        # Per output vector: (group, which of its members) in order, and the permutation that
        # puts their values in the vector's order.
        self.assembly = []
        for v in range(len(outputs)):
            pieces, order = [], []
            for index, (_, _, members) in enumerate(self.groups):
                mine = [k for k, (w, _) in enumerate(members) if w == v]
                if mine:
                    pieces.append((index, np.array(mine)))
                    order.extend(members[k][1] for k in mine)
            self.assembly.append((pieces, np.argsort(order)))
        self.crossings = len(program.crossing_groups)

    @classmethod
    def checked(cls, program: _Program, host_vectors: list) -> Callable | None:
        """The program over vectors, jitted (and compiled for `host_vectors`), where it gives
        the bits of `program`'s host program on drawn inputs (step counts and values in
        (0, 1)), else None."""
        try:
            by_parameters = jax.jit(cls(program))
            rng = np.random.default_rng(0)
            with jax.enable_x64(True), jax.default_device(_host_device()):
                for draw in (lambda n: rng.integers(1, 5000, n), lambda n: rng.random(n)):
                    host = [np.asarray(draw(v.shape[0])).astype(v.dtype) for v in host_vectors]
                    ours = jax.tree.leaves(by_parameters(host))
                    theirs = jax.tree.leaves(program.host_program(host))
                    if not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(ours, theirs)):
                        return None
        except Exception:  # noqa: BLE001 (an op whose lowering wants a scalar: element-wise)
            return None
        return by_parameters

    def _signature(self, node, memo: dict):
        """What `node` computes, as a hashable value equal for two parameters' nodes that
        compute the same from their own host state (an input that is no parameter's state,
        the learning rate, is itself: ("shared", node))."""
        known = memo.get(node)
        if known is not None:
            return known
        constants = self.program.constants
        if node in self.leaves:
            signature = ("state", self.leaves[node][0], self.leaves[node][2])
        elif node in constants and constants[node].numel() <= 1:
            tensor = constants[node]
            signature = ("constant", str(tensor.dtype), repr(tensor.item()))
        elif node.op != "call_function":
            signature = ("shared", node)
        else:
            signature = (
                str(node.target),
                tuple(self._argument(a, memo) for a in node.args),
                tuple(sorted((k, self._argument(a, memo)) for k, a in node.kwargs.items())),
            )
        memo[node] = signature
        return signature

    def _argument(self, value, memo: dict):
        if isinstance(value, torch.fx.Node):
            return self._signature(value, memo)
        if isinstance(value, (list, tuple)):
            return tuple(self._argument(v, memo) for v in value)
        return ("value", type(value).__name__, repr(value))  # (repr: -0.0 is not 0.0)

    def __call__(self, host: list) -> tuple[list, list]:
        program = self.program
        wide = [v.astype(jnp.float64) if jnp.issubdtype(v.dtype, jnp.floating) else v for v in host]
        env = {}
        for g, nodes in enumerate(program.host_nodes):
            for i, node in enumerate(nodes):
                if node not in self.leaves:  # (an argument: the learning rate)
                    env[node] = wide[g][i]
        for node, tensor in program.constants.items():
            if tensor.numel() <= 1:
                env[node] = jnp.asarray(tensor.numpy())
        results = []
        for first, gathers, members in self.groups:
            # One member's computation (the graph's scalars, as the lowerings want them),
            # mapped over every member's values.
            def computed(*values, first=first, leaves=tuple(leaf for leaf, _, _ in gathers)):
                own = dict(env)
                own.update(zip(leaves, values, strict=True))
                return program._evaluated(own, [first], _host_context)[0]

            if gathers:
                value = jax.vmap(computed)(*[wide[g][positions] for _, g, positions in gathers])
            else:
                value = computed()
            results.append(jnp.broadcast_to(value, (len(members),)))
        vectors = []
        for dtype, (pieces, order) in zip(self.dtypes, self.assembly, strict=True):
            values = jnp.concatenate([results[i][mine].astype(dtype) for i, mine in pieces])
            vectors.append(values[order])
        return vectors[: self.crossings], vectors[self.crossings :]


def _paired_leaves(first, other, leaves: dict):
    """(node of `first`'s computation, the matching node of `other`'s) for each parameter
    host state they read (their signatures are equal: their graphs have one shape)."""
    seen, stack = set(), [(first, other)]
    while stack:
        a, b = stack.pop()
        if not isinstance(a, torch.fx.Node):
            if isinstance(a, (list, tuple)):
                stack.extend(zip(a, b, strict=True))
            continue
        if (a, b) in seen:
            continue
        seen.add((a, b))
        if a in leaves:
            yield a, b
        elif a.op == "call_function":
            stack.extend(zip(a.args, b.args, strict=True))
            stack.extend((a.kwargs[k], b.kwargs[k]) for k in a.kwargs)


class _SharedHostState:
    """An optimizer's 0-d host state tensors of one dtype (its step counts), each made a view
    of one buffer in place (`Tensor.set_`: the same tensor objects, which its state dict holds
    and a user may keep, with the same values): read at once as that buffer and written at
    once into it, where stacking them and copying each back took ~0.3 ms of a step."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.buffer = torch.stack(tensors)
        self.moved = False
        storage = self.buffer.untyped_storage()
        for i, tensor in enumerate(tensors):
            tensor.set_(storage, i, (), ())
            # (another capture's program -- another layout: a parameter without its
            # gradient -- made it a view of its own buffer before: no longer)
            earlier = _views.get(tensor)
            if earlier is not None:
                earlier.moved = True
            _views[tensor] = self
        self.tensors = tensors
        self.array = self.buffer.numpy()

    def holds(self, tensors: list[torch.Tensor]) -> bool:
        """Whether `tensors` are these, still views of this buffer (a loaded state dict's are
        new ones; another program's vector may have taken some)."""
        return (
            not self.moved
            and len(tensors) == len(self.tensors)
            and all(map(operator.is_, tensors, self.tensors))
        )


# host state tensor -> the `_SharedHostState` whose buffer it is a view of
_views = WeakIdKeyDictionary()


def _sharable(tensor: torch.Tensor) -> bool:
    """Whether `tensor` can be made a view of a shared buffer: a plain 0-d CPU tensor that is
    no view itself and needs no gradient."""
    return (
        type(tensor) is torch.Tensor
        and tensor.dim() == 0
        and tensor.device.type == "cpu"
        and tensor._base is None
        and not tensor.requires_grad
    )


@functools.cache
def _host_device():
    """Where the host program runs: the CPU (on an accelerator too: its values are read on the
    host at once), or the default device where JAX was told of no CPU platform."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def _by_dtype(items: list, dtype_of) -> list[tuple]:
    groups: dict = {}
    for item in items:
        groups.setdefault(dtype_of(item), []).append(item)
    return list(groups.items())


def _is_scalar(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return not isinstance(value, torch.Tensor) or value.numel() <= 1


def _node_dtype(node: torch.fx.Node) -> torch.dtype:
    """The dtype of a graph value: a tensor's own; a Python scalar's as torch types it."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (bool, torch.SymBool)):
        return torch.bool
    if isinstance(value, (int, torch.SymInt)):
        return torch.int64
    return torch.float32


def _host_tensor(state, params: list, args: tuple, kind: int, index, key) -> torch.Tensor:
    if kind == _HOST_STATE:
        return state[params[index]][key]
    return args[index]  # an argument's position


def _functional_aten(module: torch.fx.GraphModule, examples: list) -> torch.fx.Graph:
    """`module`'s graph as functional core ATen (the bridge's decompositions), returning each
    input's value after it: the input itself where it is not written."""

    def functional(*inputs):
        # torch's Python functionalization, as export's: it decomposes composite in-place ops
        # (`square_`) before it functionalizes them, where `torch.func.functionalize` refuses.
        exclude = torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
        )
        with exclude, FunctionalTensorMode():
            wrapped = [
                FunctionalTensor.to_functional(x) if isinstance(x, torch.Tensor) else x
                for x in inputs
            ]
            module(*wrapped)
            after = []
            for x in wrapped:
                torch._sync(x)
                after.append(torch._from_functional_tensor(x.elem))
            return after

    with torch.no_grad():
        traced = make_fx(
            functional, decomposition_table=decomposition_table(), tracing_mode="fake"
        )(*examples)
    return traced.graph


def _lifted(gm: torch.fx.GraphModule, args: tuple):
    """`gm` with each tensor it holds as an attribute (the twin's parameters and state, which
    dynamo keeps as constants of the graph) made an input before its own; the example inputs;
    how many of them were attributes."""
    graph = torch.fx.Graph()
    env: dict = {}
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    examples = []
    for n in attrs:
        env[n] = graph.placeholder(f"attr_{len(examples)}")
        examples.append(operator.attrgetter(n.target)(gm))
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
    examples.extend(args)
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "get_attr"):
            env[n] = graph.node_copy(n, lambda m: env[m])
    return torch.fx.GraphModule(torch.nn.Module(), graph), examples, len(attrs)


# Element-wise ops that XLA:CPU computes once and writes out where two outputs read them (it
# duplicates only cheap ones into each consumer's loop, and fuses no sibling outputs).
_EXPENSIVE = frozenset(
    {
        torch.ops.aten.sqrt.default,
        torch.ops.aten.rsqrt.default,
        torch.ops.aten.div.Tensor,
        torch.ops.aten.reciprocal.default,
        torch.ops.aten.exp.default,
        torch.ops.aten.log.default,
        torch.ops.aten.pow.Tensor_Scalar,
        torch.ops.aten.pow.Tensor_Tensor,
    }
)


def _computed_apart(outputs: list[torch.fx.Node], live: set) -> list[list] | None:
    """Per output, the live inputs it reads, where each output is better computed on its own:
    an expensive element-wise value two outputs share (Adadelta's square roots and quotient,
    read by its accumulated update and by the parameter's) is otherwise written out and read
    back, a pass over a parameter-sized array each way. Computed from its own copy of its
    inputs (an optimization barrier apiece, which keeps XLA from merging the copies again),
    each output is one loop over its inputs, the shared value computed in each. None where
    nothing expensive is shared, or where a reduction is (computing it twice costs a pass of
    its own: Adafactor's row and column means)."""
    ancestry = [_ancestors([node], known={}) for node in outputs]
    shared = collections.Counter(node for nodes in ancestry for node in nodes)
    if not any(count > 1 and node.target in _EXPENSIVE for node, count in shared.items()) or any(
        _reduces(node) for node, count in shared.items() if count > 1
    ):
        return None
    return [[node for node in nodes if node in live] for nodes in ancestry]


def _reductions_apart(graph: torch.fx.Graph, live: set) -> list[tuple]:
    """(live input, the reductions computed from it alone), where several are: a row and a
    column mean of one gradient's squares (Adafactor's). XLA:CPU computes a shared
    element-wise value once and writes it out (the squares, a pass over a parameter-sized
    array each way), and a reduction's library fusion takes an element-wise producer in only
    where the producer has no other consumer. Each such reduction, computed from its own copy
    of its input (one optimization barrier over the copies, which keeps XLA from merging them
    again), is one pass over the input. Only reductions whose path from the input has no
    other tensor input: a value computed from more inputs costs more to compute twice."""
    readers = collections.defaultdict(list)
    for node in graph.nodes:
        if _reduces(node):
            source = _sole_source(node, live)
            if source is not None:
                readers[source].append(node)
    return [(source, nodes) for source, nodes in readers.items() if len(nodes) > 1]


def _sole_source(node: torch.fx.Node, live: set) -> torch.fx.Node | None:
    """The live input `node` is computed from through ops of one tensor input each (None where
    it is not)."""
    while True:
        tensors = [i for i in node.all_input_nodes if isinstance(i.meta.get("val"), torch.Tensor)]
        if len(tensors) != 1:
            return None
        (node,) = tensors
        if node in live:
            return node
        if node.op != "call_function" or _reduces(node):
            return None


def _reduces(node: torch.fx.Node) -> bool:
    """Whether `node` gives fewer elements than a tensor it reads (a sum, a mean, a norm)."""
    value = node.meta.get("val")
    if node.op != "call_function" or not isinstance(value, torch.Tensor):
        return False
    return any(
        isinstance(i.meta.get("val"), torch.Tensor) and i.meta["val"].numel() > value.numel()
        for i in node.all_input_nodes
    )


def _ancestors(nodes: list[torch.fx.Node], known: dict) -> set:
    """`nodes` and what they are computed from, back to the values `known`."""
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            if node not in known:
                stack.extend(node.all_input_nodes)
    return seen


def _context(node: torch.fx.Node) -> LoweringContext:
    return LoweringContext(node=node, train=True, rng_for_site=_no_random)


def _host_context(node: torch.fx.Node) -> LoweringContext:
    """The host program computes its floats in float64, as Python computes torch's scalars."""
    return LoweringContext(node=node, train=True, rng_for_site=_no_random, float_dtype=np.float64)


def _no_random():
    raise NotCapturable("its step draws random numbers")


def _read(env: dict, node: torch.fx.Node, consumer=None):
    return env[node]
