"""Snapshots of the train state for an asynchronous save (zerojax.ckpt.snapshot).

Run: `.venv/bin/python -m pytest -q tests/ckpt/test_snapshot.py -p no:cacheprovider`
Why: issue 14 -- `Checkpointer.save` no longer copies the state on the training loop's time:
it enqueues a copy (a snapshot) and returns, and Orbax's whole save runs on a background
thread. These tests pin what that must never get wrong, for both places a snapshot can live
(device memory, pinned host memory): it is bit for bit the arrays' values at `snapshot` time,
on the same shardings, in buffers of its own, for every placement the engine produces (sharded,
partially and fully replicated, single device, column-sharded, zero-size, scalars, PRNG keys;
fp32/bf16/int32/uint32); a donating program dispatched right after it cannot change it; and a
save whose whole write is held back until later training steps have donated and overwritten
the saved arrays still writes the values of the step it was called at.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from torch import nn

import zerojax
from zerojax.ckpt import checkpointer
from zerojax.ckpt import snapshot as snapshot_module
from zerojax.ckpt.checkpointer import Checkpointer
from zerojax.ckpt.snapshot import resolve_method, snapshot
from zerojax.runtime.effective_time import LEDGER

pytestmark = pytest.mark.multidevice

METHODS = ["device", "pinned_host"]


def mixed_tree(seed: int = 0) -> dict:
    """Fresh random arrays under every kind of placement the engine's state can have."""
    devices = np.array(jax.devices())
    fsdp = Mesh(devices, ("fsdp",))
    data_fsdp = Mesh(devices.reshape(2, 4), ("data", "fsdp"))
    rs = np.random.default_rng(seed)

    def put(shape, dtype, sharding):
        if np.issubdtype(np.dtype(dtype), np.integer):
            value = rs.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, shape, dtype=dtype)
        else:
            value = rs.standard_normal(shape).astype(dtype)
        return jax.device_put(value, sharding)

    return {
        "rows": put((16, 5), np.float32, NamedSharding(fsdp, P("fsdp"))),
        "cols": put((3, 24), np.float32, NamedSharding(fsdp, P(None, "fsdp"))),
        # Replicated over `data`: each block lives on 2 devices.
        "partly_replicated": put((8, 3), jnp.bfloat16, NamedSharding(data_fsdp, P("fsdp"))),
        "both_axes": put((4, 8), np.int32, NamedSharding(data_fsdp, P("data", "fsdp"))),
        "replicated": put((7,), np.int32, NamedSharding(fsdp, P())),
        # Odd sizes (7 int32, 5x3 bf16 = 30 bytes).
        "odd_bf16": put((5, 3), jnp.bfloat16, NamedSharding(fsdp, P())),
        "empty": put((0, 4), np.float32, NamedSharding(fsdp, P("fsdp"))),
        "scalar": put((), np.float32, NamedSharding(fsdp, P())),
        "step": [put((), np.int32, NamedSharding(fsdp, P()))],
        "rng": put((2,), np.uint32, SingleDeviceSharding(jax.devices()[3])),
        "key": jax.random.key(seed),  # extended dtype: copied on device whatever the method
        "host": rs.standard_normal((3, 2)).astype(np.float32),  # numpy: passes through
        "count": 3,
    }


def host_values(tree: dict) -> dict:
    """Owned host copies of every leaf (keys as their key data), read without leaving a numpy
    view on a device buffer (the CPU runtime declines to donate a buffer numpy views)."""

    def value(leaf):
        if isinstance(leaf, jax.Array):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
                leaf = jax.random.key_data(leaf)
            return np.array(jnp.copy(leaf))
        return np.array(leaf)

    return jax.tree.map(value, tree)


def assert_bitwise(got: dict, want: dict) -> None:
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), jax.tree_util.keystr(path)
        assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)


def buffer_pointers(tree: dict) -> set[int]:
    return {
        s.data.unsafe_buffer_pointer()
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array) and leaf.size
        for s in leaf.addressable_shards
    }


@pytest.mark.parametrize("method", METHODS)
def test_snapshot_is_a_bitwise_copy_on_the_same_shardings(method):
    tree = mixed_tree()
    frozen = snapshot(tree, method=method)
    assert jax.tree.structure(frozen) == jax.tree.structure(tree)
    assert_bitwise(host_values(frozen), host_values(tree))
    for (path, got), source in zip(
        jax.tree_util.tree_flatten_with_path(frozen)[0], jax.tree.leaves(tree), strict=True
    ):
        where = jax.tree_util.keystr(path)
        if not isinstance(source, jax.Array):
            assert got is source, where  # numpy and Python leaves pass through
            continue
        assert got is not source, where
        extended = jax.dtypes.issubdtype(source.dtype, jax.dtypes.extended)
        kind = "pinned_host" if method == "pinned_host" and not extended else "device"
        assert got.sharding == source.sharding.with_memory_kind(kind), where
    assert not buffer_pointers(frozen) & buffer_pointers(tree), "a snapshot shares a buffer"


@pytest.mark.parametrize("method", METHODS)
def test_a_donating_program_right_after_cannot_change_the_snapshot(method):
    """Donation deletes the arrays and lets XLA write into their buffers; the snapshot was
    enqueued first, so the runtime finishes reading them before that write."""
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    rs = np.random.default_rng(4)
    tree = {
        k: jax.device_put(rs.standard_normal((4096, 64)).astype(np.float32), sharding)
        for k, sharding in (
            ("sharded", NamedSharding(mesh, P("fsdp"))),
            ("replicated", NamedSharding(mesh, P())),
        )
    }
    before = host_values(tree)
    overwrite = jax.jit(lambda t: jax.tree.map(lambda x: x * 3.0 + 1.0, t), donate_argnums=0)
    frozen = snapshot(tree, method=method)
    after = overwrite(tree)  # dispatched before the snapshot has necessarily run
    assert all(x.is_deleted() for x in jax.tree.leaves(tree)), "nothing was donated"
    assert not any(x.is_deleted() for x in jax.tree.leaves(frozen)), "the snapshot was donated"
    assert not np.array_equal(np.asarray(after["sharded"]), before["sharded"])
    assert_bitwise(host_values(frozen), before)


def test_the_copy_program_is_compiled_once_per_signature():
    tree = mixed_tree(1)
    snapshot(tree, method="device")
    compiled = snapshot_module._copy_program.cache_info().currsize
    hits = snapshot_module._copy_program.cache_info().hits
    snapshot(mixed_tree(2), method="device")  # new arrays, same shardings
    info = snapshot_module._copy_program.cache_info()
    assert info.currsize == compiled and info.hits > hits


def test_auto_method_and_bad_method():
    cpu = jax.devices()
    assert resolve_method("auto", cpu) == "device"
    memories = lambda *kinds: lambda: [SimpleNamespace(kind=k) for k in kinds]
    gpu = SimpleNamespace(platform="gpu", addressable_memories=memories("device", "pinned_host"))
    old = SimpleNamespace(platform="tpu", addressable_memories=memories("device"))
    assert resolve_method("auto", [gpu]) == "pinned_host"
    assert resolve_method("auto", [gpu, old]) == "device"
    assert resolve_method("pinned_host", cpu) == "pinned_host"
    with pytest.raises(ValueError, match="method='fast'"):
        snapshot({"x": jnp.ones(3)}, method="fast")


# --------------------------------------------------------------------------- with the engine


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)))


def train_step(model, optimizer) -> None:
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def trained_model(seed: int):
    """Net under ZeRO-3 on 8 devices with AdamW, after one step (moments exist)."""
    torch.manual_seed(seed)
    net = Net()
    model, optimizer = zerojax.initialize(
        net,
        torch.optim.AdamW(net.parameters(), lr=1e-2),
        config={"mesh": {"fsdp": 8}, "zero": {"stage": 3}},
    )
    train_step(model, optimizer)
    return model, optimizer


def engine_state(model) -> dict:
    engine = model.engine
    return host_values({"params": engine.params, "opt": engine.opt_state})


@pytest.mark.parametrize("method", METHODS)
def test_save_then_steps_write_the_values_at_save(tmp_path, monkeypatch, method):
    """`save` returns before anything is copied to host or written; here its whole background
    write (Orbax's copies to host included) is held back until two more training steps have
    donated and overwritten the saved arrays, so only the snapshot can hold the saved values."""
    model, optimizer = trained_model(seed=0)
    steps_done = threading.Event()
    writes = []
    write = Checkpointer._write

    def held_back_write(self, manager, step, args):
        writes.append(step)
        assert steps_done.wait(60), "the test never released the write"
        write(self, manager, step, args)

    monkeypatch.setattr(Checkpointer, "_write", held_back_write)
    with Checkpointer(tmp_path, model, optimizer) as ckpt:
        ckpt._snapshot_method = method
        saved = {}
        for step in (1, 2):
            steps_done.clear()
            saved[step] = engine_state(model)
            engine = model.engine
            saved_arrays = jax.tree.leaves((engine.params, engine.opt_state))
            assert ckpt.save(step)
            train_step(model, optimizer)  # donates the params and moments just saved
            train_step(model, optimizer)
            assert all(a.is_deleted() for a in saved_arrays), (
                "the steps did not donate the saved arrays: the test would prove nothing"
            )
            after = engine_state(model)
            assert any(
                a.tobytes() != b.tobytes()
                for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(saved[step]))
            ), "the steps changed nothing: the test would prove nothing"
            steps_done.set()
            ckpt.wait()
        assert writes == [1, 2], "the held-back write was not the one used"
        for step in (1, 2):
            ckpt.restore(step)
            assert_bitwise(engine_state(model), saved[step])


def test_the_update_after_save_waits_until_the_snapshot_is_enqueued(tmp_path, monkeypatch):
    """`save` returns before the snapshot is even enqueued (that runs on the Checkpointer's
    thread); here it cannot be enqueued until the next update has asked to donate, so the
    update must wait for it (`Engine.before_next_update`) or the write sees deleted arrays."""
    model, optimizer = trained_model(seed=1)
    update_asked, seen_enqueued = threading.Event(), []
    real_snapshot, real_wait = checkpointer.snapshot, checkpointer._await_snapshot

    def late_snapshot(tree, **kwargs):
        assert update_asked.wait(30), "the update never waited for the snapshot"
        return real_snapshot(tree, **kwargs)

    def recording_wait(enqueued, step):
        seen_enqueued.append(enqueued.is_set())
        update_asked.set()
        real_wait(enqueued, step)

    monkeypatch.setattr(checkpointer, "snapshot", late_snapshot)
    monkeypatch.setattr(checkpointer, "_await_snapshot", recording_wait)
    with Checkpointer(tmp_path, model, optimizer) as ckpt:
        saved = engine_state(model)
        blocking = LEDGER.seconds["checkpoint_blocking"]
        assert ckpt.save(1)
        train_step(model, optimizer)  # its update waits here, then donates the saved arrays
        train_step(model, optimizer)  # no save in between: no wait
        assert seen_enqueued == [False]
        assert LEDGER.seconds["checkpoint_blocking"] > blocking
        ckpt.wait()
        ckpt.restore(1)
        assert_bitwise(engine_state(model), saved)
