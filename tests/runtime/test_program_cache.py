"""The persistent program cache: a restarted job loads its update program instead of tracing it.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/runtime/test_program_cache.py
Exists for issue 44's "restarts in seconds" (zerojax/runtime/program_cache.py): a wrong hit
would train silently different numbers, so what a cached program computes is checked against
the traced one bitwise (in fresh processes, as a restart runs it) and against torch eager, and
every change the program depends on must miss: the model (a layer, a width), the dtypes, the
ZeRO stage, the mesh, and each part of an argument's signature.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import NamedSharding, PartitionSpec

import zerojax
from tests import tolerances
from tests.fresh_python import run_fresh_python
from tests.runtime import program_cache_script as script
from zerojax.runtime import program_cache
from zerojax.runtime.compilation_cache import enable_compilation_cache

pytestmark = pytest.mark.multidevice

SCRIPT = str(Path(script.__file__).resolve())


def run_script(cache: str, out: Path, home: Path) -> dict:
    """The script in a fresh Python whose home (the default cache's parent) is `home`."""
    env_home = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        done = run_fresh_python([SCRIPT, cache, str(out)], timeout=600, cwd=home)
    finally:
        if env_home is not None:
            os.environ["HOME"] = env_home
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def torch_eager_weights(num_steps: int) -> dict[str, torch.Tensor]:
    module, optimizer = script.model_and_optimizer()
    for tokens, targets in script.batches(num_steps):
        loss = F.cross_entropy(module(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in module.named_parameters()}


@pytest.mark.long
def test_a_restarted_process_loads_the_update_and_computes_the_same_bits(tmp_path):
    """Three fresh processes: no cache configured (nothing may be written), a first run that
    traces and stores the update, a restart that loads it. Same losses and weights, bitwise;
    the same output shardings; the update still consumes the params it was donated."""
    no_cache = run_script("none", tmp_path / "none.npz", tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["none.npz"], "wrote without a cache configured"
    cache = tmp_path / "cache"
    first = run_script(str(cache), tmp_path / "first.npz", tmp_path)
    entries = os.listdir(cache / program_cache.SUBDIRECTORY)
    assert len(entries) == 1 and entries[0].endswith(program_cache.SUFFIX), entries
    restart = run_script(str(cache), tmp_path / "restart.npz", tmp_path)

    assert no_cache["loaded"] == first["loaded"] == [] and restart["loaded"] == ["update"]
    assert no_cache["losses"] == first["losses"] == restart["losses"]
    assert no_cache["output_shardings"] == first["output_shardings"] == restart["output_shardings"]
    for run in (no_cache, first, restart):
        assert run["donated_params_consumed"] == [True, True]
    weights = {name: np.load(tmp_path / f"{name}.npz") for name in ("none", "first", "restart")}
    for param in weights["none"].files:
        np.testing.assert_array_equal(weights["first"][param], weights["none"][param], param)
        np.testing.assert_array_equal(weights["restart"][param], weights["none"][param], param)

    # ... and what they computed is torch's AdamW: each step moves a parameter by at most
    # lr * adam_step_bound(t) whatever its gradient (tests/tolerances.py), so gradients that
    # differ only by rounding may move it anywhere in that range on either side: the bound
    # is twice the sum over the steps (weight decay's lr * wd * |p| rounds to < 1 ulp).
    bound = sum(2 * script.LR * tolerances.adam_step_bound(t, 0.9, 0.999) for t in (1, 2))
    eager = torch_eager_weights(2)
    for name, expected in eager.items():
        if name in weights["restart"].files:
            got = torch.from_numpy(weights["restart"][name])
            tolerances.assert_within(got, expected, bound, name)


# --- in one process: hits, misses, damaged entries ------------------------------------------


@pytest.fixture
def restore_jax_cache():
    before = jax.config.jax_compilation_cache_dir
    yield
    enable_compilation_cache(before)


class ProgramLoads(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.programs: list[str] = []

    def emit(self, record):
        if "loaded from the program cache" in record.getMessage():
            self.programs.append(record.getMessage().split()[2])


def mlp(width: int, num_layers: int) -> torch.nn.Module:
    layers = [torch.nn.Linear(16, width), torch.nn.GELU()]
    for _ in range(num_layers - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.LayerNorm(width), torch.nn.Linear(width, 8))


def train(cache: Path, *, width=32, num_layers=2, stage=3, mesh=None, precision=None, train=None):
    """(programs loaded from the cache, weights) after two AdamW steps of a small MLP (the
    update program is what is cached: any model will do, a small one compiles fast)."""
    torch.manual_seed(0)
    module = mlp(width, num_layers)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1)
    settings = {
        "mesh": mesh or {"fsdp": 8},
        "zero": {"stage": stage},
        "runtime": {"compilation_cache_dir": str(cache)},
    }
    if precision is not None:
        settings["precision"] = precision
    if train is not None:
        settings["train"] = train
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=generator), torch.randn(8, 8, generator=generator))]
    loads = ProgramLoads()
    logger = logging.getLogger("zerojax")
    logger.addHandler(loads)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        model, optimizer = zerojax.initialize(module, optimizer, config=settings)
        for x, y in data * 2:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        weights = {n: np.asarray(v) for n, v in model.engine.state.weights.items()}
    finally:
        logger.removeHandler(loads)
        logger.setLevel(level)
    return loads.programs, weights


def entries(cache: Path) -> set[str]:
    directory = cache / program_cache.SUBDIRECTORY
    return set(os.listdir(directory)) if directory.exists() else set()


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache holding the base run's update, and that run's weights."""
    cache = tmp_path_factory.mktemp("programs")
    before = jax.config.jax_compilation_cache_dir
    try:
        loaded, weights = train(cache)
    finally:
        enable_compilation_cache(before)
    assert loaded == [] and len(entries(cache)) == 1
    (name,) = entries(cache)
    return cache, weights, name


def copy_with_base_entry(filled, destination: Path) -> Path:
    """A copy of the filled cache (JAX's executables too) with the base run's entry alone."""
    source, _, name = filled
    shutil.copytree(source, destination)
    for other in entries(destination) - {name}:
        os.unlink(destination / program_cache.SUBDIRECTORY / other)
    return destination / program_cache.SUBDIRECTORY / name


def test_the_same_run_again_loads_the_update(filled, restore_jax_cache):
    cache, weights, _ = filled
    loaded, again = train(cache)
    assert loaded == ["update"]
    for name, value in weights.items():
        np.testing.assert_array_equal(again[name], value, name)


CHANGES = {
    "one more layer": {"num_layers": 3},
    "another width": {"width": 48},
    "bf16 params, fp32 masters": {
        "precision": "params=bfloat16,compute=bfloat16,master=float32",
    },
    "ZeRO-2": {"stage": 2},
    # The arguments are the same: only the key's description of the config tells them apart.
    "gradient clipping": {"train": {"gradient_clipping": 1.0}},
    "another mesh": {"mesh": {"data": 2, "fsdp": 4}},
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_a_change_the_update_depends_on_misses(change, filled, restore_jax_cache):
    cache = filled[0]
    before = entries(cache)
    loaded, _ = train(cache, **CHANGES[change])
    assert loaded == [], f"{change}: served a cached update"
    assert len(entries(cache) - before) == 1, f"{change}: no entry of its own"


DAMAGES = {
    "truncated": lambda data: data[: len(data) // 2],
    "a payload byte flipped": lambda data: data[:-100] + bytes([data[-100] ^ 1]) + data[-99:],
    "not an entry": lambda data: b"garbage" + data,
    "empty": lambda data: b"",
}


# Each damage is a trace and a compile more (~2 s); the default run keeps two of them.
SLOW_DAMAGES = ("truncated", "empty")


@pytest.mark.parametrize(
    "damage",
    [pytest.param(d, marks=pytest.mark.slow) if d in SLOW_DAMAGES else d for d in DAMAGES],
)
def test_a_damaged_entry_warns_is_traced_again_and_replaced(
    damage, filled, tmp_path, restore_jax_cache
):
    cache = tmp_path / "cache"
    path = copy_with_base_entry(filled, cache)
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    weights = filled[1]
    with pytest.warns(program_cache.ProgramCacheWarning, match=path.name):
        loaded, again = train(cache)
    assert loaded == []
    for param, value in weights.items():
        np.testing.assert_array_equal(again[param], value, param)
    with warnings.catch_warnings():
        warnings.simplefilter("error", program_cache.ProgramCacheWarning)
        loaded, _ = train(cache)
    assert loaded == ["update"], "the damaged entry was not replaced"


@pytest.mark.long
def test_an_entry_filed_under_another_key_is_refused(filled, tmp_path, restore_jax_cache):
    """A valid entry of another program renamed to this one's key is not served."""
    cache = tmp_path / "cache"
    path = copy_with_base_entry(filled, cache)
    loaded, _ = train(cache, width=48)
    (other,) = entries(cache) - {path.name}
    shutil.copy(cache / program_cache.SUBDIRECTORY / other, path)
    with pytest.warns(program_cache.ProgramCacheWarning, match="filed under"):
        loaded, _ = train(cache)
    assert loaded == []


# --- the key --------------------------------------------------------------------------------


def key_of(leaves, **changes):
    arguments = {
        "name": "update",
        "identity": "spec",
        "treedef": jax.tree.structure(list(leaves)),
        "leaves": list(leaves),
        "jit_options": {"donate_argnums": (0,)},
        "platform": "cpu",
        "compiler_options": {"xla_cpu_copy_insertion_use_region_analysis": True},
    }
    arguments.update(changes)
    return program_cache.program_key(**arguments)


def test_every_part_of_an_argument_signature_is_in_the_key():
    devices = np.array(jax.devices()[:8])
    mesh = jax.sharding.Mesh(devices, ("fsdp",))
    reordered = jax.sharding.Mesh(devices[::-1], ("fsdp",))
    spec = NamedSharding(mesh, PartitionSpec("fsdp"))

    def leaf(shape=(8, 4), dtype=np.float32, sharding=spec, weak_type=False):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, weak_type=weak_type)

    base = key_of([leaf()])
    assert base is not None and base == key_of([leaf()])
    variants = {
        "shape": [leaf(shape=(16, 4))],
        "dtype": [leaf(dtype=jax.numpy.bfloat16)],
        "weak type": [leaf(weak_type=True)],
        "spec": [leaf(sharding=NamedSharding(mesh, PartitionSpec(None, "fsdp")))],
        "device order": [leaf(sharding=NamedSharding(reordered, PartitionSpec("fsdp")))],
        "memory kind": [leaf(sharding=spec.with_memory_kind("pinned_host"))],
        "tree": [leaf(), leaf()],
    }
    for what, leaves in variants.items():
        assert key_of(leaves) != base, what
    assert key_of([leaf()], identity="other spec") != base
    assert key_of([leaf()], name="forward") != base
    assert key_of([leaf()], jit_options={}) != base
    assert key_of([leaf()], compiler_options={}) != base
    assert key_of([leaf()], platform="cuda") != base
    # P() and P(None, None) are one layout for a rank-2 argument, as jit sees them.
    replicated = [leaf(sharding=NamedSharding(mesh, PartitionSpec()))]
    spelled = [leaf(sharding=NamedSharding(mesh, PartitionSpec(None, None)))]
    assert key_of(replicated) == key_of(spelled)


def test_zerojax_source_and_jax_configuration_are_in_the_key(monkeypatch):
    leaves = [np.zeros(3, np.float32)]
    base = key_of(leaves)
    monkeypatch.setattr(program_cache, "source_digest", lambda: "edited")
    assert key_of(leaves) != base
    monkeypatch.undo()
    with jax.default_matmul_precision("highest"):
        assert key_of(leaves) != base
    assert key_of(leaves) == base


def test_what_has_no_description_by_content_is_not_cached():
    with pytest.raises(program_cache.Undescribable):
        program_cache.describe({"fn": lambda x: x})
    with pytest.raises(program_cache.Undescribable):
        program_cache.describe(object())
    assert key_of([object()]) is None


def test_an_uncommitted_argument_has_its_own_key():
    """jit places an array made without a device (`jnp.zeros`) where the program wants it: the
    executable takes other input shardings than for the same array committed to device 0."""
    uncommitted = jax.numpy.zeros(4)
    committed = jax.device_put(jax.numpy.zeros(4), jax.devices()[0])
    assert not uncommitted.committed and committed.committed
    assert key_of([uncommitted]) != key_of([committed])


def test_an_executable_layout_is_compared_as_layouts_not_spellings():
    """A restored optimizer state may spell a replicated sharding `P(None)` where the writer's
    had `P()`: one layout, so a loaded entry must not be refused for it (it was: every load of
    a restored run warned and traced again)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    value = np.arange(8, dtype=np.float32)

    def layout(spec):
        x = jax.device_put(value, NamedSharding(mesh, spec))
        compiled = jax.jit(lambda x: x * 2).trace(x).lower().compile()
        return program_cache._executable_layout(compiled)

    assert layout(PartitionSpec()) == layout(PartitionSpec(None))
    assert layout(PartitionSpec("data")) == layout(PartitionSpec(("data",)))
    assert layout(PartitionSpec()) != layout(PartitionSpec("data"))
