"""Per-op parity with PyTorch eager, driven by PyTorch's own OpInfo samples.

Run:  .venv/bin/python -m pytest -q tests/bridge/test_opinfo.py            (first sample)
      .venv/bin/python -m pytest -q -m slow tests/bridge/test_opinfo.py    (every sample)

Why: hand-written lowering tests cover the cases their author thought of; OpInfo's samples
(`torch.testing._internal.common_methods_invocations.op_db`) are the ones PyTorch tests its own
kernels with: broadcasting, 0-d and empty tensors, negative dims, keyword variants.

One test per (OpInfo entry, dtype): float32, int64 (or int32), bool where the op takes them,
and bfloat16 for the matmul/conv/norm/softmax families (`opinfo_table.BF16_ENTRIES`). Each
sample becomes a call inside a module whose inputs are all the sample's tensors (including
tensors inside args, kwargs and lists), so the converted function really receives them; the
module is converted with `zerojax.convert`, run under `jax.jit` and compared with torch eager.

An entry runs as soon as every ATen overload its samples decompose to has a lowering. A sample
that needs an unlowered overload is skipped only if `opinfo_table.ATEN_GAPS` says why; else it
fails with the UnsupportedOpError, so a regression or an undocumented gap is red. Samples that
torch.export cannot capture are skipped with torch's reason.

Cost: converting is dominated by a fixed ~0.3 s in torch's `run_decompositions`, independent
of the graph, so the samples of all dtypes of ENTRIES_PER_PROGRAM consecutive entries are
converted as *one* module (one capture, one jit compile), and the outcome is cached for the
batch's other tests (pytest-xdist hands out consecutive tests, so a batch stays on one worker).
A failing group is re-run split by entry, dtype and sample, only to say which sample failed;
a sample that needs an unlowered op is found from the graph without re-running.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import traceback
import warnings

import jax
import pytest
import torch
import torch.utils._pytree as torch_pytree
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import zerojax
from tests import tolerances
from tests.bridge import opinfo_table as table
from tests.bridge.parity import assert_close
from zerojax.bridge.capture import capture
from zerojax.bridge.dtypes import from_torch, to_torch
from zerojax.bridge.errors import CaptureError, MissingLoweringError, UnsupportedOpError
from zerojax.bridge.interpreter import _PYTHON_FUNCTIONS, RANDOM_OPS_NEED_RNG
from zerojax.bridge.registry import get_lowering, supported_ops

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

# OpInfo samples probe edge cases on purpose (std with one element, beta APIs): torch warns.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Samples per (entry, dtype) in the default run; the slow test (`make test-all`) takes all of
# them. Converting costs ~0.1-0.2 s of torch.export tracing per sample, so the default run takes
# OpInfo's first sample of each (entry, dtype): the plain case its authors list first.
DEFAULT_MAX_SAMPLES = 1
# OpInfo entries converted as one module (their tests share one capture and one jit compile).
ENTRIES_PER_PROGRAM = 8
# Most cases in one module (bounds graph size: max_pool2d alone has 1440 samples).
MAX_CASES_PER_PROGRAM = 64


def entry_name(info) -> str:
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


ENTRIES = {entry_name(info): info for info in op_db}


def dtypes_for(entry: str, info) -> list[torch.dtype]:
    """float32, one integer dtype (torch's default int64 if the op takes it), bool, bf16."""
    supported = info.supported_dtypes("cpu")
    dtypes = [torch.float32] if torch.float32 in supported else []
    integer = next((d for d in (torch.int64, torch.int32) if d in supported), None)
    if integer is not None:
        dtypes.append(integer)
    if torch.bool in supported:
        dtypes.append(torch.bool)
    if entry in table.BF16_ENTRIES and torch.bfloat16 in supported:
        dtypes.append(torch.bfloat16)
    return dtypes


PARAMS = [(entry, dtype) for entry, info in ENTRIES.items() for dtype in dtypes_for(entry, info)]
PARAM_IDS = [f"{entry}-{str(dtype).removeprefix('torch.')}" for entry, dtype in PARAMS]


# ---------------------------------------------------------------------------------------------
# Cases and the module that runs them


class _TensorSlot:
    """Marks where a module input goes in a sample's flattened (input, args, kwargs)."""


_SLOT = _TensorSlot()


@dataclasses.dataclass
class Case:
    """One OpInfo sample in one dtype, flattened so its tensors can be module inputs."""

    entry: str
    op: object  # the OpInfo's callable
    dtype: torch.dtype
    index: int
    description: str
    leaves: list  # the sample's pytree leaves, tensors replaced by _SLOT
    spec: torch_pytree.TreeSpec
    tensors: list[torch.Tensor]

    @classmethod
    def from_sample(cls, entry, op, dtype, index, sample) -> Case:
        leaves, spec = torch_pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        template = [_SLOT if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return cls(entry, op, dtype, index, _describe(sample), template, spec, tensors)

    def arguments(self, tensors) -> tuple:
        """(input, args, kwargs) of the sample with `tensors` in its tensors' places."""
        feed = iter(tensors)
        leaves = [next(feed) if leaf is _SLOT else leaf for leaf in self.leaves]
        return torch_pytree.tree_unflatten(leaves, self.spec)

    def call(self, tensors):
        sample_input, args, kwargs = self.arguments(tensors)
        return self.op(sample_input, *args, **kwargs)

    @property
    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.entry} {dtype} sample {self.index} ({self.description})"


class _TensorDescription:
    def __init__(self, tensor: torch.Tensor):
        self.text = f"Tensor{list(tensor.shape)}:{str(tensor.dtype).removeprefix('torch.')}"

    def __repr__(self) -> str:
        return self.text


def _describe(sample) -> str:
    """`input, args..., kwargs...` of a sample, tensors shown as shape and dtype."""

    def short(tree):
        return repr(
            torch_pytree.tree_map(
                lambda x: _TensorDescription(x) if isinstance(x, torch.Tensor) else x, tree
            )
        )

    parts = [short(sample.input)] + [short(a) for a in sample.args]
    parts += [f"{k}={short(v)}" for k, v in sample.kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) < 200 else text[:197] + "..."


class SampleProgram(torch.nn.Module):
    """Calls each case's op once; every case's tensors are module inputs, flat, in order."""

    def __init__(self, cases: list[Case]):
        super().__init__()
        self.cases = cases

    def forward(self, *tensors):
        outputs, start = [], 0
        for case in self.cases:
            end = start + len(case.tensors)
            outputs.append(case.call(tensors[start:end]))
            start = end
        return tuple(outputs)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for case in self.cases for t in case.tensors)


def make_cases(entry: str, dtype: torch.dtype, all_samples: bool) -> list[Case]:
    info = ENTRIES[entry]
    max_samples = None if all_samples else DEFAULT_MAX_SAMPLES
    torch.manual_seed(0)  # the same samples whichever test of the entry builds them
    samples = info.sample_inputs("cpu", dtype, requires_grad=False)
    return [
        Case.from_sample(entry, info.op, dtype, i, sample)
        for i, sample in enumerate(itertools.islice(samples, max_samples))
    ]


# ---------------------------------------------------------------------------------------------
# Outcomes


@dataclasses.dataclass
class Outcome:
    case: Case
    status: str  # "pass" | "skip" | "fail"
    message: str = ""


def _passed(case):
    return Outcome(case, "pass")


def _skipped(case, reason):
    return Outcome(case, "skip", reason)


def _failed(case, message):
    return Outcome(case, "fail", message)


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else text
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _error_text() -> str:
    """The exception being handled, its notes, and the innermost zerojax frame it came from."""
    error = sys.exc_info()[1]
    lines = "".join(traceback.format_exception_only(error)).splitlines()
    # JAX's note about its filtered traceback says nothing about the failure.
    text = "\n".join(
        line for line in lines if not line.startswith(("For simplicity, JAX", "-" * 20))
    ).strip()
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/zerojax/" in f.filename]
    if frames:
        text += f"\n  raised at {frames[-1].filename}:{frames[-1].lineno}  `{frames[-1].line}`"
    return text


def _capture_reason(error: BaseException) -> str:
    """torch's own reason from a CaptureError (or torch's error itself), on one line."""
    cause = error.__cause__ or error
    return f"torch.export cannot capture this sample: {_first_line(cause)}"


def _missing_ops(graph: torch.fx.Graph, nodes) -> set[str]:
    """Unlowered ATen overloads among `nodes` and their ancestors (as the interpreter sees them)."""
    seen, stack, missing = set(), list(nodes), set()
    while stack:
        node = stack.pop()
        if not isinstance(node, torch.fx.Node) or node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and node.target not in _PYTHON_FUNCTIONS:
            target = node.target
            if not isinstance(target, torch._ops.OpOverload) or get_lowering(target) is None:
                missing.add(str(target))
        elif node.op in ("call_module", "call_method", "get_attr"):
            missing.add(f"{node.op} {node.target}")
        stack.extend(node.all_input_nodes)
    return missing


def _gap_outcome(case: Case, missing: set[str]) -> Outcome:
    unknown = sorted(op for op in missing if op not in table.ATEN_GAPS)
    if unknown:
        return _failed(
            case,
            f"UnsupportedOpError: needs {', '.join(unknown)}: no lowering, and no reason in "
            f"zerojax/bridge/aten_gaps.py ATEN_GAPS (lower it, or list it there with why)",
        )
    return _skipped(case, "; ".join(f"needs {op}: {table.ATEN_GAPS[op]}" for op in sorted(missing)))


def _attribute_unsupported(module: SampleProgram) -> tuple[list[Outcome], list[Case]]:
    """Which cases need which unlowered ops: re-capture once and walk each case's outputs.

    Returns the skip/fail outcomes of the cases that need one, and the cases that need none.
    """
    exported = capture(module, module.inputs(), {}, train=False)
    graph = exported.graph_module.graph
    output_nodes = list(graph.output_node().args[0])
    user_outputs = [
        node
        for node, spec in zip(output_nodes, exported.graph_signature.output_specs, strict=True)
        if spec.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT
    ]
    counts = [spec.num_leaves for spec in exported.call_spec.out_spec.children_specs]
    per_case, start = [], 0
    for count in counts:
        per_case.append(_missing_ops(graph, user_outputs[start : start + count]))
        start += count
    # Unlowered nodes no output depends on (runtime asserts) stop every case.
    unattributed = _missing_ops(graph, graph.nodes) - set().union(*per_case)
    outcomes, runnable = [], []
    for case, missing in zip(module.cases, per_case, strict=True):
        missing |= unattributed
        if missing:
            outcomes.append(_gap_outcome(case, missing))
        else:
            runnable.append(case)
    return outcomes, runnable


# ---------------------------------------------------------------------------------------------
# Convert, run, compare


def _to_torch_tree(tree):
    return torch_pytree.tree_map(lambda x: to_torch(x) if isinstance(x, jax.Array) else x, tree)


def _narrow_dtypes(tree):
    """complex128 results as zerojax holds them (complex64 without x64), like int64/float64."""
    return torch_pytree.tree_map(
        lambda x: (
            x.to(torch.complex64)
            if isinstance(x, torch.Tensor) and x.dtype == torch.complex128
            else x
        ),
        tree,
    )


def _select_along(source: torch.Tensor, indices: torch.Tensor, dim: int) -> torch.Tensor:
    """source's values at `indices` along `dim` (indices may lack `dim`, as keepdim=False)."""
    if source.ndim == 0:
        return source.expand(indices.shape)
    if indices.ndim < source.ndim:
        return source.gather(dim, indices.unsqueeze(dim)).squeeze(dim)
    return source.gather(dim, indices)


def _compare_tied_indices(case: Case, expected, got) -> None:
    """Index outputs whose order among equal values is unspecified: compare what they select."""
    output, arg_position, default = table.TIED_INDEX_OUTPUTS[case.entry]
    source, args, kwargs = case.arguments(case.tensors)
    dim = kwargs.get("dim", args[arg_position] if len(args) > arg_position else default)
    exp_idx = expected if output is None else expected[output]
    got_idx = got if output is None else got[output]
    assert tuple(got_idx.shape) == tuple(exp_idx.shape), (
        f"{case.label}: indices shape {tuple(got_idx.shape)} vs {tuple(exp_idx.shape)}"
    )
    torch.testing.assert_close(
        _select_along(source, got_idx.to(torch.int64), dim),
        _select_along(source, exp_idx, dim),
        rtol=0,
        atol=0,
        msg=lambda m: f"{case.label}: values at the returned indices differ: {m}",
    )
    if output is not None:  # the other outputs (values) compare as usual
        expected = [e for i, e in enumerate(expected) if i != output]
        got = [g for i, g in enumerate(got) if i != output]
        assert_close(expected, got, rtol=0, atol=0, what=case.label)


def _magnitude(case: Case):
    """op(|inputs|) in float64: bounds every partial sum of a contraction, elementwise."""
    tensors = [t.abs().double() if t.is_floating_point() else t for t in case.tensors]
    sample_input, args, kwargs = torch_pytree.tree_map(
        lambda x: abs(x) if isinstance(x, float) else x, case.arguments(tensors)
    )
    with torch.no_grad():
        return case.op(sample_input, *args, **kwargs)


def _assert_within_rounding_bound(case: Case, expected, got) -> None:
    """|got - expected| <= roundings * u * op(|inputs|) elementwise (opinfo_table.ROUNDING_BOUNDS)."""
    assert_close(expected, got, rtol=0, atol=float("inf"), what=case.label)  # shapes, dtypes
    roundings = table.ROUNDING_BOUNDS[(case.entry, case.dtype)](case.tensors)
    leaves = zip(
        torch_pytree.tree_leaves(expected),
        torch_pytree.tree_leaves(got),
        torch_pytree.tree_leaves(_magnitude(case)),
        strict=True,
    )
    for i, (e, g, magnitude) in enumerate(leaves):
        bound = tolerances.rounded_intermediates(case.dtype, roundings, magnitude)
        tolerances.assert_within(
            torch.as_tensor(g), e, bound, f"{case.label}[{i}] ({roundings} roundings x u x S)"
        )


def _compare(case: Case, expected, got) -> Outcome:
    entry, what = case.entry, case.label
    expected = _narrow_dtypes(expected)
    try:
        if entry in table.SHAPE_ONLY:
            for e, g in zip(
                torch_pytree.tree_leaves(expected), torch_pytree.tree_leaves(got), strict=True
            ):
                assert tuple(e.shape) == tuple(g.shape), f"{what}: shape {g.shape} vs {e.shape}"
        else:
            try:
                if (entry, case.dtype) in table.ROUNDING_BOUNDS:
                    _assert_within_rounding_bound(case, expected, got)
                else:
                    rtol, atol = table.tolerance(entry, case.dtype)
                    assert_close(expected, got, rtol=rtol, atol=atol, what=what)
            except AssertionError:
                # Ties (integer or bool inputs) leave the order of equal elements unspecified.
                if entry not in table.TIED_INDEX_OUTPUTS or case.dtype.is_floating_point:
                    raise
                _compare_tied_indices(case, expected, got)
    except AssertionError as error:
        return _failed(case, str(error))
    return _passed(case)


def _split(cases: list[Case]) -> list[list[Case]]:
    """Smaller groups to re-run after a group failed: per entry, then dtype, then sample."""
    for key in (lambda c: c.entry, lambda c: c.dtype):
        values = list(dict.fromkeys(key(case) for case in cases))
        if len(values) > 1:
            return [[c for c in cases if key(c) == v] for v in values]
    return [[case] for case in cases]


def _narrow(cases: list[Case], status: str, message: str) -> list[Outcome]:
    """`status` for a single case; for a group, re-run smaller groups to find the culprit."""
    if len(cases) == 1:
        return [Outcome(cases[0], status, message)]
    return [o for group in _split(cases) for o in evaluate(group)]


def _eager(cases: list[Case]) -> tuple[list, list[Outcome]]:
    """torch eager's outputs for the cases, and skips for samples torch itself rejects."""
    expected, rejected = [], []
    for case in cases:
        clones = [t.clone() for t in case.tensors]  # an in-place op must not touch the inputs
        try:
            with torch.no_grad():
                expected.append(case.call(clones))
        except Exception as error:  # noqa: BLE001  (whatever torch raises, the sample is invalid)
            rejected.append(
                _skipped(case, f"torch eager rejects this sample: {_first_line(error)}")
            )
    return expected, rejected


def _is_torch_error(error: BaseException) -> bool:
    """Raised inside torch itself (export, decomposition), not by zerojax's own code."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and "/torch/" in frames[-1].filename


def _has_data_dependent_shapes(module: SampleProgram) -> bool:
    """Whether torch.export records a size computed from tensor values (an unbacked SymInt)."""
    exported = capture(module, module.inputs(), {}, train=False)
    return any(
        free_unbacked_symbols(node.meta.get("val"))
        for node in exported.graph_module.graph.nodes
        if node.meta.get("val") is not None
    )


def _run_failure(cases: list[Case], module: SampleProgram) -> list[Outcome]:
    """Classify an error raised while running the converted cases (inside `except`)."""
    error = sys.exc_info()[1]
    if isinstance(error, UnsupportedOpError):  # a lowering refuses, e.g. a data-dependent size
        return _narrow(cases, "skip", _first_line(error))
    if RANDOM_OPS_NEED_RNG in str(error):
        return _narrow(cases, "skip", table.RANDOM_SAMPLE)
    message = f"running it raised {_error_text()}"
    if len(cases) == 1 and _has_data_dependent_shapes(module):
        return [_skipped(cases[0], f"{table.DATA_DEPENDENT}: {_first_line(error, 200)}")]
    return _narrow(cases, "fail", message)


def evaluate(cases: list[Case]) -> list[Outcome]:
    """Convert and run `cases` as one module; on a failure, narrow it down to the cases."""
    if not cases:
        return []
    expected, rejected = _eager(cases)
    if rejected:
        rest = [c for c in cases if all(r.case is not c for r in rejected)]
        return rejected + evaluate(rest)

    module = SampleProgram(cases)
    try:
        converted = zerojax.convert(module, module.inputs())
    except CaptureError as error:
        return _narrow(cases, "skip", _capture_reason(error))
    except MissingLoweringError:
        outcomes, runnable = _attribute_unsupported(module)
        return outcomes + evaluate(runnable)
    except UnsupportedOpError as error:  # mutates an input in place, or a similar form
        return _narrow(cases, "skip", _first_line(error))
    except Exception as error:  # noqa: BLE001  (classified: torch's limit, or a bridge bug)
        if _is_torch_error(error):  # e.g. run_decompositions guarding on a data-dependent size
            return _narrow(cases, "skip", _capture_reason(error))
        return _narrow(cases, "fail", f"zerojax.convert raised {_error_text()}")

    if converted.value_inputs:
        # An op that reads integer input values on the host (a data-dependent output such as
        # torch.equal's bool, or a shape from values): torch.export cannot trace it with the
        # inputs as data, so convert specialised the program on their values. This table
        # checks ops on traced inputs; specialised programs are tested in test_value_inputs.py.
        reason = f"reads input values on the host (specialised on {sorted(converted.value_inputs)})"
        return _narrow(cases, "skip", reason)
    try:
        inputs = [from_torch(t) for t in module.inputs()]
        got, _ = jax.jit(converted.apply)(converted.params, converted.buffers, *inputs)
        got = _to_torch_tree(got)
    except Exception:  # noqa: BLE001  (classified: a deliberate refusal, or a lowering bug)
        return _run_failure(cases, module)
    return [_compare(case, e, g) for case, e, g in zip(cases, expected, got, strict=True)]


def _batches(entries: list[str], size: int) -> dict[str, tuple[str, ...]]:
    """entry -> the consecutive group of `size` entries it is converted with."""
    groups = [tuple(entries[i : i + size]) for i in range(0, len(entries), size)]
    return {entry: group for group in groups for entry in group}


BATCH_OF = _batches(list(dict.fromkeys(entry for entry, _ in PARAMS)), ENTRIES_PER_PROGRAM)


@functools.cache
def batch_outcomes(
    entries: tuple[str, ...], all_samples: bool
) -> dict[tuple[str, torch.dtype], list[Outcome]]:
    """Outcomes per (entry, dtype) of a batch of entries, converted together when they pass."""
    cases = [
        case
        for entry in entries
        for dtype in dtypes_for(entry, ENTRIES[entry])
        if table.entry_skip(entry, dtype) is None
        for case in make_cases(entry, dtype, all_samples)
    ]
    step = MAX_CASES_PER_PROGRAM
    outcomes = [o for i in range(0, len(cases), step) for o in evaluate(cases[i : i + step])]
    by_key: dict[tuple[str, torch.dtype], list[Outcome]] = {}
    for outcome in outcomes:
        by_key.setdefault((outcome.case.entry, outcome.case.dtype), []).append(outcome)
    return by_key


def check_entry(entry: str, dtype: torch.dtype, *, all_samples: bool) -> None:
    reason = table.entry_skip(entry, dtype)
    if reason is not None:
        pytest.skip(reason)
    outcomes = batch_outcomes(BATCH_OF[entry], all_samples).get((entry, dtype), [])
    if not outcomes:
        pytest.skip(f"OpInfo has no {dtype} samples for {entry}")
    failures = [o for o in outcomes if o.status == "fail"]
    if failures:
        by_message: dict[str, list[Outcome]] = {}
        for failure in failures:
            by_message.setdefault(failure.message, []).append(failure)
        pytest.fail(
            "\n\n".join(
                "; ".join(o.case.label for o in group) + f":\n{message}"
                for message, group in by_message.items()
            ),
            pytrace=False,
        )
    if all(o.status == "skip" for o in outcomes):
        reasons = list(dict.fromkeys(o.message for o in outcomes))
        pytest.skip(" | ".join(reasons))


# ---------------------------------------------------------------------------------------------
# Tests


def test_tables_name_real_entries():
    """Every key in the skip/tolerance tables names an OpInfo entry (catches typos/renames)."""
    keys = [
        *table.ENTRY_SKIPS,
        *table.TOLERANCES,
        *table.ROUNDING_BOUNDS,
        *table.SHAPE_ONLY,
        *table.TIED_INDEX_OUTPUTS,
    ]
    names = {key[0] if isinstance(key, tuple) else key for key in keys} | table.BF16_ENTRIES
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 12):
        # OpInfo entries torch added after 2.11 (this torch's database cannot name them).
        names -= {"bmm.triton_optimized", "native_group_norm"}
    assert sorted(names - set(ENTRIES)) == []


def test_gap_table_is_current():
    """ATEN_GAPS lists only unlowered ops: a newly lowered op must leave the table."""
    lowered = {str(op) for op in supported_ops()}
    stale = sorted(op for op in table.ATEN_GAPS if op in lowered)
    assert stale == [], f"lowered now, delete from zerojax/bridge/aten_gaps.py: {stale}"


@pytest.mark.parametrize("entry, dtype", PARAMS, ids=PARAM_IDS)
def test_opinfo(entry, dtype):
    check_entry(entry, dtype, all_samples=False)


@pytest.mark.slow
@pytest.mark.parametrize("entry, dtype", PARAMS, ids=PARAM_IDS)
def test_opinfo_all_samples(entry, dtype):
    check_entry(entry, dtype, all_samples=True)
