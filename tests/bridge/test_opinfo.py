"""Per-op parity with PyTorch eager, driven by PyTorch's own OpInfo samples.

Run:  .venv/bin/python -m pytest -q tests/bridge/test_opinfo.py            (first samples)
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
of the graph, so all samples of all dtypes of one entry are converted as *one* module (one
capture, one jit compile) and the result is cached for the entry's other dtype tests; failures
are re-run in smaller groups only to say which sample failed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import sys
import traceback
import warnings

import jax
import pytest
import torch
import torch.utils._pytree as torch_pytree

import zerojax
from tests.bridge import opinfo_table as table
from tests.bridge.parity import assert_close
from zerojax.bridge.capture import capture
from zerojax.bridge.dtypes import from_torch, to_torch
from zerojax.bridge.errors import CaptureError, UnsupportedOpError
from zerojax.bridge.interpreter import _PYTHON_FUNCTIONS
from zerojax.bridge.registry import get_lowering, supported_ops

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

# Samples per (entry, dtype) in the default run; the slow test takes all of them.
DEFAULT_MAX_SAMPLES = 3
# Cases converted as one module in the slow run (bounds graph size, e.g. max_pool2d has 1440).
MAX_CASES_PER_PROGRAM = 24


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

    dtype: torch.dtype
    index: int
    description: str
    leaves: list  # the sample's pytree leaves, tensors replaced by _SLOT
    spec: torch_pytree.TreeSpec
    tensors: list[torch.Tensor]

    @classmethod
    def from_sample(cls, dtype, index, sample) -> Case:
        leaves, spec = torch_pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        template = [_SLOT if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return cls(dtype, index, _describe(sample), template, spec, tensors)

    def call(self, op, tensors):
        feed = iter(tensors)
        leaves = [next(feed) if leaf is _SLOT else leaf for leaf in self.leaves]
        sample_input, args, kwargs = torch_pytree.tree_unflatten(leaves, self.spec)
        return op(sample_input, *args, **kwargs)

    @property
    def label(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} sample {self.index} ({self.description})"


def _describe(sample) -> str:
    def short(x):
        if isinstance(x, torch.Tensor):
            return f"Tensor{list(x.shape)}:{str(x.dtype).removeprefix('torch.')}"
        return repr(x)

    parts = [short(x) for x in torch_pytree.tree_leaves(sample.input)]
    parts += [str(torch_pytree.tree_map(short, a)) for a in sample.args]
    parts += [f"{k}={torch_pytree.tree_map(short, v)}" for k, v in sample.kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) < 200 else text[:197] + "..."


class SampleProgram(torch.nn.Module):
    """Calls the op once per case; every case's tensors are module inputs, flat, in order."""

    def __init__(self, op, cases: list[Case]):
        super().__init__()
        self.op = op
        self.cases = cases

    def forward(self, *tensors):
        outputs, start = [], 0
        for case in self.cases:
            end = start + len(case.tensors)
            outputs.append(case.call(self.op, tensors[start:end]))
            start = end
        return tuple(outputs)

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for case in self.cases for t in case.tensors)


def make_cases(info, dtype: torch.dtype, max_samples: int | None) -> list[Case]:
    torch.manual_seed(0)  # the same samples whichever test of the entry builds them
    samples = info.sample_inputs("cpu", dtype, requires_grad=False)
    return [
        Case.from_sample(dtype, i, sample)
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


def _capture_reason(error: CaptureError) -> str:
    """torch's own reason from a CaptureError, on one line."""
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
            f"tests/bridge/opinfo_table.py ATEN_GAPS (lower it, or list it there with why)",
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


def _compare(entry: str, case: Case, expected, got) -> Outcome:
    what = f"{entry} {case.label}"
    try:
        if entry in table.SHAPE_ONLY:
            for e, g in zip(
                torch_pytree.tree_leaves(expected), torch_pytree.tree_leaves(got), strict=True
            ):
                assert tuple(e.shape) == tuple(g.shape), f"{what}: shape {g.shape} vs {e.shape}"
        else:
            rtol, atol = table.tolerance(entry, case.dtype)
            assert_close(expected, got, rtol=rtol, atol=atol, what=what)
    except AssertionError as error:
        return _failed(case, str(error))
    return _passed(case)


def _split(cases: list[Case]) -> list[list[Case]]:
    """Smaller groups to re-run after a group failed: per dtype first, then per sample."""
    dtypes = list(dict.fromkeys(case.dtype for case in cases))
    if len(dtypes) > 1:
        return [[c for c in cases if c.dtype == d] for d in dtypes]
    return [[case] for case in cases]


def _narrow(entry: str, info, cases: list[Case], status: str, message: str) -> list[Outcome]:
    """`status` for a single case; for a group, re-run smaller groups to find the culprit."""
    if len(cases) == 1:
        return [Outcome(cases[0], status, message)]
    return [o for group in _split(cases) for o in evaluate(entry, info, group)]


def _eager(info, cases: list[Case]) -> tuple[list, list[Outcome]]:
    """torch eager's outputs for the cases, and skips for samples torch itself rejects."""
    expected, rejected = [], []
    for case in cases:
        clones = [t.clone() for t in case.tensors]  # an in-place op must not touch the inputs
        try:
            with torch.no_grad():
                expected.append(case.call(info.op, clones))
        except Exception as error:  # noqa: BLE001  (whatever torch raises, the sample is invalid)
            rejected.append(
                _skipped(case, f"torch eager rejects this sample: {_first_line(error)}")
            )
    return expected, rejected


def evaluate(entry: str, info, cases: list[Case]) -> list[Outcome]:
    """Convert and run `cases` as one module; on a failure, narrow it down to the cases."""
    if not cases:
        return []
    expected, rejected = _eager(info, cases)
    if rejected:
        rest = [c for c in cases if all(r.case is not c for r in rejected)]
        return rejected + evaluate(entry, info, rest)

    module = SampleProgram(info.op, cases)
    try:
        converted = zerojax.convert(module, module.inputs())
    except CaptureError as error:
        return _narrow(entry, info, cases, "skip", _capture_reason(error))
    except UnsupportedOpError as error:
        if "no lowering" not in str(error):  # mutates an input in place, or a similar form
            return _narrow(entry, info, cases, "skip", _first_line(error))
        outcomes, runnable = _attribute_unsupported(module)
        return outcomes + evaluate(entry, info, runnable)
    except Exception:  # noqa: BLE001  (a bridge bug: reported as a failure of the case)
        return _narrow(entry, info, cases, "fail", f"zerojax.convert raised {_error_text()}")

    try:
        inputs = [from_torch(t) for t in module.inputs()]
        got, _ = jax.jit(converted.apply)(converted.params, converted.buffers, *inputs)
        got = _to_torch_tree(got)
    except Exception:  # noqa: BLE001  (a lowering bug: reported as a failure of the case)
        return _narrow(entry, info, cases, "fail", f"running it raised {_error_text()}")
    return [_compare(entry, case, e, g) for case, e, g in zip(cases, expected, got, strict=True)]


@functools.cache
def entry_outcomes(entry: str, max_samples: int | None) -> dict[torch.dtype, list[Outcome]]:
    """Outcomes of every tested dtype of `entry`, converted together (one capture, one jit)."""
    info = ENTRIES[entry]
    cases = [
        case
        for dtype in dtypes_for(entry, info)
        if table.entry_skip(entry, dtype) is None
        for case in make_cases(info, dtype, max_samples)
    ]
    groups = [
        cases[i : i + MAX_CASES_PER_PROGRAM] for i in range(0, len(cases), MAX_CASES_PER_PROGRAM)
    ]
    outcomes = [o for group in groups for o in evaluate(entry, info, group)]
    by_dtype: dict[torch.dtype, list[Outcome]] = {}
    for outcome in outcomes:
        by_dtype.setdefault(outcome.case.dtype, []).append(outcome)
    return by_dtype


def check_entry(entry: str, dtype: torch.dtype, max_samples: int | None) -> None:
    reason = table.entry_skip(entry, dtype)
    if reason is not None:
        pytest.skip(reason)
    outcomes = entry_outcomes(entry, max_samples).get(dtype, [])
    if not outcomes:
        pytest.skip(f"OpInfo has no {dtype} samples for {entry}")
    failures = [o for o in outcomes if o.status == "fail"]
    if failures:
        by_message: dict[str, list[Outcome]] = {}
        for failure in failures:
            by_message.setdefault(failure.message, []).append(failure)
        pytest.fail(
            "\n\n".join(
                f"{entry} " + "; ".join(o.case.label for o in group) + f":\n{message}"
                for message, group in by_message.items()
            ),
            pytrace=False,
        )
    if all(o.status == "skip" for o in outcomes):
        reasons = list(dict.fromkeys(o.message for o in outcomes))
        pytest.skip(" | ".join(reasons))


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(autouse=True)
def _quiet_export_trace():
    """torch.export's structured trace log would fill every failure report with DEBUG lines."""
    trace_log = logging.getLogger("torch.__trace")
    saved, trace_log.disabled = trace_log.disabled, True
    yield
    trace_log.disabled = saved


def test_tables_name_real_entries():
    """Every key in the skip/tolerance tables names an OpInfo entry (catches typos/renames)."""
    keys = list(table.ENTRY_SKIPS) + list(table.TOLERANCES) + list(table.SHAPE_ONLY)
    names = {key[0] if isinstance(key, tuple) else key for key in keys} | table.BF16_ENTRIES
    assert sorted(names - set(ENTRIES)) == []


def test_gap_table_is_current():
    """ATEN_GAPS lists only unlowered ops: a newly lowered op must leave the table."""
    lowered = {str(op) for op in supported_ops()}
    stale = sorted(op for op in table.ATEN_GAPS if op in lowered)
    assert stale == [], f"lowered now, delete from opinfo_table.ATEN_GAPS: {stale}"


@pytest.mark.parametrize("entry, dtype", PARAMS, ids=PARAM_IDS)
def test_opinfo(entry, dtype):
    check_entry(entry, dtype, DEFAULT_MAX_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("entry, dtype", PARAMS, ids=PARAM_IDS)
def test_opinfo_all_samples(entry, dtype):
    check_entry(entry, dtype, None)
