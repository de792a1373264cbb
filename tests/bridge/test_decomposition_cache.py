"""The persistent cache of capture's decomposition step (bridge/decomposition_cache.py).

Run: .venv/bin/python -m pytest -q tests/bridge/test_decomposition_cache.py
Exists because a cached graph must be the graph decomposition would give, and a changed model
must never be served an old one: the key is the training-IR graph torch.export produces afresh
on every capture, so a changed module attribute, model code, input shape, decomposition table
or torch version changes it; what the key cannot describe (custom ops) is not cached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import operator
import os
import pickle
import re
import shlex
import stat
import types
import warnings

import jax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench.architectures import ARCHITECTURES
from zerojax.bridge import capture as capture_module
from zerojax.bridge import decomposition_cache
from zerojax.bridge.capture import capture
from zerojax.bridge.remat import CHECKPOINT_TAG
from zerojax.runtime import compilation_cache
from zerojax.runtime.compilation_cache import enable_compilation_cache
from zerojax.runtime.private_directory import UnsafeDirectoryError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache in a fresh directory; `cache.loads` lists the entries served from it."""
    monkeypatch.setattr(decomposition_cache, "cache_directory", lambda: str(tmp_path))
    loads = []
    load = decomposition_cache._load

    def counting_load(path, exported):
        loaded = load(path, exported)
        loads.append(path)
        return loaded

    monkeypatch.setattr(decomposition_cache, "_load", counting_load)

    class Cache:
        directory = tmp_path

        @staticmethod
        def entries():
            return sorted(p.name for p in tmp_path.iterdir())

    Cache.loads = loads
    return Cache


def uncached_capture(module, args, *, train, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(decomposition_cache, "cache_directory", lambda: None)
        return capture(module, args, {}, train=train)


def checkpoint_tag(node: torch.fx.Node):
    return (node.meta.get("custom") or {}).get(CHECKPOINT_TAG)


def assert_same_program(got: torch.export.ExportedProgram, want: torch.export.ExportedProgram):
    """Same code, signature, specs, constants and the node metadata zerojax reads."""
    assert got.graph_module.code == want.graph_module.code
    assert repr(got.graph_signature.input_specs) == repr(want.graph_signature.input_specs)
    assert repr(got.graph_signature.output_specs) == repr(want.graph_signature.output_specs)
    assert got.call_spec.in_spec == want.call_spec.in_spec
    assert got.call_spec.out_spec == want.call_spec.out_spec
    assert got.constants.keys() == want.constants.keys()
    for name, value in want.constants.items():
        torch.testing.assert_close(got.constants[name], value, rtol=0, atol=0)
    got_nodes, want_nodes = list(got.graph.nodes), list(want.graph.nodes)
    assert len(got_nodes) == len(want_nodes)
    for g, w in zip(got_nodes, want_nodes, strict=True):
        assert (g.op, g.name, g.target) == (w.op, w.name, w.target)
        for key in ("nn_module_stack", "stack_trace"):
            assert g.meta.get(key) == w.meta.get(key), (w.name, key)
        # The op each node was decomposed from (the index checks read it), by name: torch may
        # hand out a second OpOverload object for the same overload.
        assert str(g.meta.get("original_aten")) == str(w.meta.get("original_aten")), w.name
        # Of `custom`, zerojax reads its checkpoint tag; torch also notes there which function
        # its tracer was in (`_torchdynamo_disable_method`), which varies from call to call.
        assert checkpoint_tag(g) == checkpoint_tag(w), w.name
        g_val, w_val = g.meta.get("val"), w.meta.get("val")
        if isinstance(w_val, torch.Tensor):
            assert (g_val.shape, g_val.stride(), g_val.dtype) == (
                w_val.shape,
                w_val.stride(),
                w_val.dtype,
            ), w.name
        elif w.op != "output":  # the deserializer gives the output node a val of its own
            assert type(g_val) is type(w_val), w.name


@pytest.mark.parametrize(
    ("name", "train"),
    [(name, True) for name in ARCHITECTURES] + [("gpt2", False), ("cnn", False)],
)
def test_a_cached_decomposition_is_the_decomposition(name, train, cache, monkeypatch):
    torch.manual_seed(0)
    module, args = ARCHITECTURES[name]()
    fresh = uncached_capture(module, args, train=train, monkeypatch=monkeypatch)
    written = capture(module, args, {}, train=train)
    assert len(cache.entries()) == 1 and not cache.loads
    loaded = capture(module, args, {}, train=train)
    assert len(cache.loads) == 1
    assert_same_program(written, fresh)
    assert_same_program(loaded, fresh)
    # Exactly the deserializer's extra getitems were dropped: the loaded graph has none unused.
    assert all(
        node.users
        for node in loaded.graph.nodes
        if node.op == "call_function" and node.target is operator.getitem
    )


class Heads(nn.Module):
    """Attention whose head count is an attribute only: changing it keeps every parameter."""

    def __init__(self, width: int = 16, num_heads: int = 4):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.activation = F.gelu

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.activation(y.transpose(1, 2).reshape(batch, seq, width))


def changes(module: Heads):
    """(what changed, how) pairs, each applied to a fresh module or input."""
    return {
        "module attribute num_heads": lambda m, x: (setattr(m, "num_heads", 2), x)[1],
        "model code (the activation)": lambda m, x: (setattr(m, "activation", torch.tanh), x)[1],
        "input shape": lambda m, x: torch.randn(2, 6, 16),
        "input dtype": lambda m, x: (m.double(), x.double())[1],
    }


@pytest.mark.parametrize("change", list(changes(Heads())))
def test_a_changed_model_or_input_is_decomposed_afresh(change, cache, monkeypatch):
    module, x = Heads(), torch.randn(2, 5, 16)
    capture(module, (x,), {}, train=True)
    assert len(cache.entries()) == 1
    x = changes(module)[change](module, x)
    got = capture(module, (x,), {}, train=True)
    assert not cache.loads, f"{change}: served the old model's graph"
    assert len(cache.entries()) == 2
    assert_same_program(got, uncached_capture(module, (x,), train=True, monkeypatch=monkeypatch))


def test_torch_version_global_state_and_table_are_in_the_key(monkeypatch):
    module, x = Heads(), torch.randn(2, 5, 16)
    exported = torch.export.export(module, (x,), strict=False)
    table = capture_module.decomposition_table()
    key = decomposition_cache.cache_key(exported, table)
    assert key is not None and key == decomposition_cache.cache_key(exported, dict(table))
    smaller = dict(table)
    smaller.pop(torch.ops.aten.gelu.default, None)
    smaller.pop(next(iter(smaller)))
    assert decomposition_cache.cache_key(exported, smaller) != key
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert decomposition_cache.cache_key(exported, table) != key
    monkeypatch.undo()
    assert decomposition_cache.cache_key(exported, table) == key
    monkeypatch.setattr(torch, "get_default_dtype", lambda: torch.float64)
    assert decomposition_cache.cache_key(exported, table) != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert decomposition_cache.cache_key(exported, table) != key


def test_custom_ops_are_not_cached(cache):
    """A custom op's decomposition is the user's Python code, which the key cannot see."""
    library = torch.library.Library("zerojax_cache_test", "FRAGMENT")  # noqa: TOR901
    library.define("scale(Tensor x) -> Tensor")
    library.impl("scale", lambda x: x * 2, "CompositeExplicitAutograd")
    library.impl("scale", lambda x: torch.empty_like(x), "Meta")

    class UsesCustomOp(nn.Module):
        def forward(self, x):
            return torch.ops.zerojax_cache_test.scale(x) + 1

    x = torch.randn(3)
    exported = torch.export.export(UsesCustomOp(), (x,), strict=False)
    assert decomposition_cache.cache_key(exported, capture_module.decomposition_table()) is None
    capture(UsesCustomOp(), (x,), {}, train=False)
    assert cache.entries() == []


# --------------------------------------------------------------------------------------------
# Trust: an entry is data, never code (bridge/program_data.py, runtime/private_directory.py)


class _RunsAShellCommand:
    """Pickles to `os.system("touch <marker>")`: what unpickling it runs."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _document(entry_bytes: bytes) -> dict:
    return json.loads(entry_bytes.partition(b"\n")[2])


def _refiled(entry_bytes: bytes, document: dict) -> bytes:
    """`document` under the entry's header, with its digest recomputed, as a writer who means
    harm would (the digest finds damage, not intent)."""
    header = entry_bytes.partition(b"\n")[0].split(b" ")
    body = json.dumps(document).encode()
    header[3] = hashlib.sha256(body).hexdigest().encode()
    return b" ".join(header) + b"\n" + body


def _first_node(document):
    return document["program"]["graph_module"]["graph"]["nodes"][0]


def _shape_expression(entry_bytes, marker):
    """A tensor size as a symbolic expression: torch's reader evaluates its text (sympify)."""
    document = _document(entry_bytes)
    values = document["program"]["graph_module"]["graph"]["tensor_values"]
    sizes = next(iter(values.values()))["sizes"]
    command = f"__import__('os').system('touch {marker}')"
    sizes[0] = {"as_expr": {"expr_str": command, "hint": {"as_int": sizes[0]["as_int"]}}}
    return _refiled(entry_bytes, document)


def _target_outside_aten(entry_bytes, marker):
    document = _document(entry_bytes)
    _first_node(document)["target"] = "torch.load"
    return _refiled(entry_bytes, document)


def _carriage_return_in_a_stack_trace(entry_bytes, marker):
    """FX writes stack-trace summaries into generated code, where `\\r` ends a comment line."""
    document = _document(entry_bytes)
    code = f"x\rimport os; os.system('touch {marker}')"
    _first_node(document)["metadata"]["stack_trace"] = f'File "m.py", line 1, in f\n    {code}\n'
    return _refiled(entry_bytes, document)


PLANTED = {
    "a pickle under the entry's name": lambda entry, marker: pickle.dumps(
        _RunsAShellCommand(marker)
    ),
    "a shape that is a Python expression": _shape_expression,
    "a node target outside core ATen": _target_outside_aten,
    "a carriage return in a stack trace": _carriage_return_in_a_stack_trace,
}


def _assert_one_cache_warning(records, path):
    warned = [r for r in records if issubclass(r.category, decomposition_cache.CaptureCacheWarning)]
    assert len(warned) == 1, [str(r.message) for r in records]
    assert str(path) in str(warned[0].message)
    return str(warned[0].message)


def test_a_pickle_planted_under_the_old_name_runs_nothing(cache, tmp_path, monkeypatch):
    """The issue's attack: `<key>.pickle`, which the cache once loaded with pickle.load."""
    module, x = Heads(), torch.randn(2, 5, 16)
    capture(module, (x,), {}, train=True)
    (entry,) = cache.directory.iterdir()
    key = entry.name.split(".")[0]
    marker = tmp_path.parent / f"{tmp_path.name}-ran"
    (cache.directory / f"{key}.pickle").write_bytes(pickle.dumps(_RunsAShellCommand(marker)))
    got = capture(module, (x,), {}, train=True)
    assert not marker.exists(), "a planted cache entry ran a shell command"
    assert cache.loads == [str(entry)]
    assert_same_program(got, uncached_capture(module, (x,), train=True, monkeypatch=monkeypatch))


@pytest.mark.parametrize("planted", list(PLANTED))
def test_a_planted_entry_runs_nothing_warns_and_is_recaptured(
    planted, cache, tmp_path, monkeypatch
):
    module, x = Heads(), torch.randn(2, 5, 16)
    capture(module, (x,), {}, train=True)
    (entry,) = cache.directory.iterdir()
    marker = tmp_path.parent / f"{tmp_path.name}-ran"
    entry.write_bytes(PLANTED[planted](entry.read_bytes(), marker))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        got = capture(module, (x,), {}, train=True)
    assert not marker.exists(), f"{planted}: a planted cache entry ran a shell command"
    _assert_one_cache_warning(records, entry)
    assert not cache.loads
    assert_same_program(got, uncached_capture(module, (x,), train=True, monkeypatch=monkeypatch))
    # The entry was replaced by the program decomposition gives: served from now on.
    capture(module, (x,), {}, train=True)
    assert cache.loads == [str(entry)]


def test_a_shape_expression_is_code_to_torch_own_json_reader(cache, tmp_path):
    """Why a JSON format alone is not enough: torch's own reader (what torch.export.load uses)
    runs the planted shape expression that program_data refuses."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass

    module, x = Heads(), torch.randn(2, 5, 16)
    capture(module, (x,), {}, train=True)
    (entry,) = cache.directory.iterdir()
    marker = tmp_path.parent / f"{tmp_path.name}-ran"
    document = _document(_shape_expression(entry.read_bytes(), marker))
    exported = torch.export.export(module, (x,), strict=False)
    with contextlib.suppress(Exception):  # it fails after running the command
        ExportedProgramDeserializer().deserialize(
            _dict_to_dataclass(schema.ExportedProgram, document["program"]),
            exported.state_dict,
            {},
            exported.example_inputs,
        )
    assert marker.exists()


DAMAGED = {
    "empty": lambda data: b"",
    "truncated to half": lambda data: data[: len(data) // 2],
    "truncated by one byte": lambda data: data[:-1],
    "a digit changed": lambda data: data.replace(b'"as_int": 16', b'"as_int": 17', 1),
    "not a program": lambda data: b"not a program",
    "another key's entry": lambda data: data.replace(data.split(b" ")[2], b"0" * 64, 1),
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_entry_warns_and_is_recaptured(damage, cache, monkeypatch):
    module, x = Heads(), torch.randn(2, 5, 16)
    capture(module, (x,), {}, train=True)
    (entry,) = cache.directory.iterdir()
    damaged = DAMAGED[damage](entry.read_bytes())
    assert damaged != entry.read_bytes()
    entry.write_bytes(damaged)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        got = capture(module, (x,), {}, train=True)
    message = _assert_one_cache_warning(records, entry)
    assert "ProgramDataError" in message, message
    assert not cache.loads
    assert_same_program(got, uncached_capture(module, (x,), train=True, monkeypatch=monkeypatch))
    capture(module, (x,), {}, train=True)
    assert cache.loads == [str(entry)]


def test_an_entry_of_an_earlier_format_is_replaced_without_a_warning(cache, monkeypatch):
    """An upgrade leaves entries of the previous format: stale, not damaged (no warning per
    entry), captured again and replaced."""
    module, x = Heads(), torch.randn(2, 5, 16)
    capture(module, (x,), {}, train=True)
    (entry,) = cache.directory.iterdir()
    magic, number, rest = entry.read_bytes().split(b" ", 2)
    entry.write_bytes(b" ".join([magic, b"%d" % (int(number) - 1), rest]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = capture(module, (x,), {}, train=True)
    assert not cache.loads
    assert_same_program(got, uncached_capture(module, (x,), train=True, monkeypatch=monkeypatch))
    capture(module, (x,), {}, train=True)
    assert cache.loads == [str(entry)]


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o757], ids=lambda mode: f"{mode:04o}")
def test_a_cache_directory_others_can_write_is_refused(mode, cache, monkeypatch):
    """As ssh refuses a key others can write: a planted entry would change what trains."""
    module, x = Heads(), torch.randn(2, 5, 16)
    os.chmod(cache.directory, mode)
    with pytest.raises(UnsafeDirectoryError) as refused:
        capture(module, (x,), {}, train=True)
    message = str(refused.value)
    assert str(cache.directory) in message and f"mode {mode:04o}" in message, message
    assert "every user can write to it" in message
    assert cache.entries() == []
    os.chmod(cache.directory, 0o755)
    capture(module, (x,), {}, train=True)
    assert len(cache.entries()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_cache_directory_of_another_user_or_group_is_refused(cache, monkeypatch):
    module, x = Heads(), torch.randn(2, 5, 16)
    os.chown(cache.directory, 1, -1)  # uid 1: a system account (daemon)
    with pytest.raises(UnsafeDirectoryError, match=r"it is owned by .*uid 1\)"):
        capture(module, (x,), {}, train=True)
    os.chown(cache.directory, 0, 1)  # gid 1: a system group, not root's private group
    os.chmod(cache.directory, 0o770)
    with pytest.raises(UnsafeDirectoryError, match=r"the users of group .*gid 1\) can write"):
        capture(module, (x,), {}, train=True)
    assert cache.entries() == []


def test_jax_compilation_cache_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    """Its entries are compiled executables: code by nature, loaded by JAX as they are."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    before = jax.config.jax_compilation_cache_dir
    with pytest.raises(UnsafeDirectoryError, match=re.escape(f"{str(shared)!r} (mode 0777")):
        enable_compilation_cache(str(shared))
    assert jax.config.jax_compilation_cache_dir == before
    created = tmp_path / "new" / "jax"
    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # keep the suite's cache
    monkeypatch.setattr(compilation_cache.compilation_cache, "reset_cache", lambda: None)
    enable_compilation_cache(str(created))
    assert stat.S_IMODE(created.stat().st_mode) == 0o700


def test_a_graph_the_key_cannot_describe_is_decomposed_uncached(cache, monkeypatch):
    def fails(value):
        raise RuntimeError("no description")

    module, x = Heads(), torch.randn(2, 5, 16)
    monkeypatch.setattr(decomposition_cache, "_describe", fails)
    got = capture(module, (x,), {}, train=True)
    assert cache.entries() == []
    monkeypatch.undo()
    assert_same_program(got, uncached_capture(module, (x,), train=True, monkeypatch=monkeypatch))


def test_the_cache_lives_beside_the_compilation_cache_and_only_with_one(tmp_path, monkeypatch):
    def jax_with_cache_dir(directory):
        config = types.SimpleNamespace(jax_compilation_cache_dir=directory)
        monkeypatch.setattr(decomposition_cache, "jax", types.SimpleNamespace(config=config))

    jax_with_cache_dir(None)
    assert decomposition_cache.cache_directory() is None
    jax_with_cache_dir(str(tmp_path))
    assert decomposition_cache.cache_directory() == str(tmp_path / "zerojax-capture")


def test_the_directory_keeps_the_most_recently_used_entries_within_its_bound(cache, monkeypatch):
    """Each write evicts the least recently used entries (written or served) beyond max_bytes():
    a cache beside the compilation cache must not grow with every edit of every model."""
    module = Heads()
    inputs = {length: torch.randn(2, length, 16) for length in (3, 4, 5)}  # a graph each
    capture(module, (inputs[3],), {}, train=True)
    (first,) = cache.directory.iterdir()
    budget = int(2.5 * first.stat().st_size)  # two entries of this graph's size, not three
    monkeypatch.setattr(decomposition_cache, "max_bytes", lambda: budget)
    capture(module, (inputs[4],), {}, train=True)
    (second,) = set(cache.directory.iterdir()) - {first}
    os.utime(first, (1, 1))  # first is the older one...
    os.utime(second, (2, 2))
    capture(module, (inputs[3],), {}, train=True)  # ...until it is served again
    assert cache.loads == [str(first)]
    capture(module, (inputs[5],), {}, train=True)
    kept = set(cache.directory.iterdir())
    assert first in kept and second not in kept and len(kept) == 2
    assert sum(path.stat().st_size for path in kept) <= budget


def test_the_bound_is_jax_compilation_cache_bound_when_set(monkeypatch):
    def jax_with_max_size(size):
        config = types.SimpleNamespace(jax_compilation_cache_max_size=size)
        monkeypatch.setattr(decomposition_cache, "jax", types.SimpleNamespace(config=config))

    jax_with_max_size(-1)  # JAX's default: unbounded
    assert decomposition_cache.max_bytes() == decomposition_cache.DEFAULT_MAX_BYTES
    jax_with_max_size(10_000)
    assert decomposition_cache.max_bytes() == 10_000


class StridedView(nn.Module):
    def forward(self, x):
        return x[1:].as_strided((2, 2), (1, 2), 4)


def test_a_graph_whose_lowering_reads_storage_offsets_is_not_cached(cache):
    """torch's serializer records every view with storage offset 0, and `as_strided`'s lowering
    reads its input's offset (here 4, from `x[1:]`): served from the cache, the read would
    land on the wrong elements. Such a graph is decomposed every time; others still cache."""
    x = torch.randn(3, 4)
    for _ in range(2):
        program = capture(StridedView(), (x,), {}, train=False)
        offsets = {
            n.name: n.meta["val"].storage_offset()
            for n in program.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.slice.Tensor
        }
        assert list(offsets.values()) == [4], offsets
    assert cache.entries() == [] and not cache.loads
    capture(Heads(), (torch.randn(2, 5, 16),), {}, train=False)
    assert len(cache.entries()) == 1


@pytest.mark.parametrize(
    ("name", "fn", "error"),
    [
        ("cross_entropy", lambda x, t: F.cross_entropy(x, t), IndexError),
        ("one_hot", lambda x, t: x * F.one_hot(t, 5), RuntimeError),
    ],
)
def test_a_cached_program_keeps_its_index_checks(name, fn, error, cache):
    """The index checks know a cross_entropy or one_hot by the metadata of its decomposed
    nodes (`torch_fn`, `original_aten`: torch's serializer drops the latter, the entry keeps
    it, see `assert_same_program`): a cache hit must raise torch's error as a fresh capture
    does, not gather's or none."""
    from tests.bridge.test_index_bounds import run_checked

    x = torch.randn(4, 5)
    run_checked(fn, x, torch.tensor([0, 4, 2, 1]))  # written to the cache
    with pytest.raises(error) as caught:
        run_checked(fn, x, torch.tensor([0, 9, 2, 1]))
    assert len(cache.loads) == 1, f"{name}: the second capture was not served from the cache"
    with pytest.raises(error) as torch_error:
        fn(x, torch.tensor([0, 9, 2, 1]))
    assert str(caught.value).splitlines()[0] == str(torch_error.value).splitlines()[0]
