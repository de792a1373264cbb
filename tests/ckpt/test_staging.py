"""Staging sharded arrays to host memory for an asynchronous save (zerojax.ckpt.staging).

Run: `.venv/bin/python -m pytest -q tests/ckpt/test_staging.py -p no:cacheprovider`
Why: issue 14 -- `Checkpointer.save` now copies the state off the devices itself, in a few
large copies into a reused host buffer, and hands Orbax numpy arrays it writes without copying
again. These tests pin what that must never get wrong: the staged tree is bit for bit what
`jax.device_get` returns, for every sharding the engine produces (sharded, partially and fully
replicated, single device, column-sharded, zero-size, scalars; fp32/bf16/int32/uint32), via
both ways off the device; the staged arrays own their memory (no view of a device buffer); the
reused buffer is only overwritten after `release()`; and a save followed at once by a training
step that donates the arrays still writes the pre-step values.
"""

from __future__ import annotations

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from torch import nn

import zerojax
from zerojax.ckpt import staging
from zerojax.ckpt.checkpointer import Checkpointer
from zerojax.ckpt.staging import HostStager, stage_to_host

pytestmark = pytest.mark.multidevice


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
        # Replicated over `data`: each block lives on 2 devices and is staged once.
        "partly_replicated": put((8, 3), jnp.bfloat16, NamedSharding(data_fsdp, P("fsdp"))),
        "both_axes": put((4, 8), np.int32, NamedSharding(data_fsdp, P("data", "fsdp"))),
        "replicated": put((7,), np.int32, NamedSharding(fsdp, P())),
        # Odd sizes (7, 5x3 bf16 = 30 bytes): the staging area's alignment padding.
        "odd_bf16": put((5, 3), jnp.bfloat16, NamedSharding(fsdp, P())),
        "empty": put((0, 4), np.float32, NamedSharding(fsdp, P("fsdp"))),
        "scalar": put((), np.float32, NamedSharding(fsdp, P())),
        "step": [put((), np.int32, NamedSharding(fsdp, P()))],
        "rng": put((2,), np.uint32, SingleDeviceSharding(jax.devices()[3])),
        "host": rs.standard_normal((3, 2)).astype(np.float32),
    }


def assert_bitwise(staged: dict, expected: dict) -> None:
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(staged)[0], jax.tree.leaves(expected), strict=True
    ):
        where = jax.tree_util.keystr(path)
        assert isinstance(got, np.ndarray), where
        assert (got.shape, got.dtype) == (want.shape, want.dtype), where
        assert got.tobytes() == np.asarray(want).tobytes(), where


def assert_owns_memory(staged: dict, tree: dict) -> None:
    """No staged array is a view of a device buffer (np.asarray of a CPU shard is one)."""
    for got, source in zip(jax.tree.leaves(staged), jax.tree.leaves(tree), strict=True):
        buffers = (
            [np.asarray(s.data) for s in source.addressable_shards]
            if isinstance(source, jax.Array)
            else [source]
        )
        assert not any(np.shares_memory(got, b) for b in buffers)


@pytest.mark.parametrize(
    ("method", "pack_bytes"),
    # 40 bytes: packed buffers of a few blocks, lone blocks and several rounds in flight.
    [("views", None), ("pack", None), ("pack", 40)],
)
def test_staged_tree_is_bitwise_device_get(method, pack_bytes, monkeypatch):
    if pack_bytes is not None:
        monkeypatch.setattr(staging, "_PACK_BUFFER_BYTES", pack_bytes)
    tree = mixed_tree()
    staged = HostStager(method=method).stage(tree)
    assert jax.tree.structure(staged) == jax.tree.structure(tree)
    assert_bitwise(staged, jax.device_get(tree))
    assert_owns_memory(staged, tree)


def test_threads_split_large_copies_and_other_leaves_pass_through(monkeypatch):
    # 1 KiB threshold: the (256, 8) fp32 shards (1 KiB each) go to the threads.
    monkeypatch.setattr(staging, "_MIN_PARALLEL_BYTES", 1024)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    value = np.random.default_rng(1).standard_normal((2048, 8)).astype(np.float32)
    key = jax.random.key(0)  # extended dtype: not stageable, kept as it is
    tree = {"big": jax.device_put(value, NamedSharding(mesh, P("fsdp"))), "key": key, "n": 3}
    staged = HostStager(method="views", num_threads=3).stage(tree)
    assert staged["key"] is key and staged["n"] == 3
    assert staged["big"].tobytes() == value.tobytes()


def test_a_replicated_block_is_copied_once():
    tree, stager = mixed_tree(), HostStager()
    blocks = stager.distinct_blocks(tree["partly_replicated"])  # 8 shards, 2 of each block
    assert sorted(b.index[0].start for b in blocks) == [0, 2, 4, 6]
    assert len(stager.distinct_blocks(tree["replicated"])) == 1
    assert len(stager.distinct_blocks(tree["both_axes"])) == 8
    # Cached per (sharding, shape): a new array placed alike reuses the plan.
    again = jax.device_put(np.zeros((8, 3), jnp.bfloat16), tree["partly_replicated"].sharding)
    assert stager.distinct_blocks(again) is blocks


def test_memory_is_reused_only_after_release():
    stager = HostStager(method="views")
    first_tree, second_tree, third_tree = mixed_tree(1), mixed_tree(2), mixed_tree(3)
    first = stager.stage(first_tree)
    # Not released: the first tree may still be being written, so it must stay intact.
    second = stager.stage(second_tree)
    assert not np.shares_memory(first["rows"], second["rows"])
    assert_bitwise(first, jax.device_get(first_tree))
    stager.release()
    third = stager.stage(third_tree)
    assert np.shares_memory(second["rows"], third["rows"])
    assert_bitwise(third, jax.device_get(third_tree))
    # Another layout never lands in the old area, released or not.
    stager.release()
    other = stager.stage({"x": jnp.ones((5,))})
    assert not np.shares_memory(other["x"], third["rows"])
    assert_bitwise(third, jax.device_get(third_tree))
    # reuse=False and the one-shot function: fresh memory every time.
    once = HostStager(reuse=False)
    a = once.stage(first_tree)
    once.release()
    assert not np.shares_memory(a["rows"], once.stage(first_tree)["rows"])
    assert not np.shares_memory(stage_to_host(first_tree)["rows"], first["rows"])


def test_several_processes_keep_the_device_arrays(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    tree = mixed_tree()
    staged = HostStager().stage(tree)
    assert all(a is b for a, b in zip(jax.tree.leaves(staged), jax.tree.leaves(tree)))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="method='fast'"):
        HostStager(method="fast")
    with pytest.raises(ValueError, match="num_threads=0"):
        HostStager(num_threads=0)


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


def engine_state(model) -> dict:
    engine = model.engine
    return jax.tree.map(np.array, {"params": engine.params, "opt": engine.opt_state})


def assert_state_equal(got: dict, want: dict) -> None:
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)


def test_save_then_step_writes_the_pre_step_values(tmp_path, monkeypatch):
    """The step right after `save` donates and overwrites the saved arrays; Orbax's writes are
    held back until that step has finished, so only a real copy can write the old values."""
    torch.manual_seed(0)
    net = Net()
    model, optimizer = zerojax.initialize(
        net,
        torch.optim.AdamW(net.parameters(), lr=1e-2),
        config={"mesh": {"fsdp": 8}, "zero": {"stage": 3}},
    )
    train_step(model, optimizer)
    step_done = threading.Event()
    writes = []
    write = ocp.type_handlers.NumpyHandler._open_and_write

    async def held_back_write(self, value, tspec, ts_context):
        writes.append(value.shape)
        while not step_done.is_set():
            await asyncio.sleep(0.005)
        await write(self, value, tspec, ts_context)

    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, "_open_and_write", held_back_write)
    with Checkpointer(tmp_path, model, optimizer) as ckpt:
        saved = {}
        for step in (1, 2):
            step_done.clear()
            saved[step] = engine_state(model)
            assert ckpt.save(step)
            area = ckpt._staging._area
            train_step(model, optimizer)  # donates the params and moments just saved
            jax.block_until_ready((model.engine.params, model.engine.opt_state))
            after = engine_state(model)
            assert any(
                a.tobytes() != b.tobytes()
                for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(saved[step]))
            ), "the step changed nothing: the test would prove nothing"
            step_done.set()
            ckpt.wait()
        # The second save staged into the first one's (released) area: reuse is exercised.
        assert ckpt._staging._area is area
        assert writes, "Orbax wrote no staged numpy array: the staging hook is not in use"
        for step in (1, 2):
            ckpt.restore(step)
            assert_state_equal(engine_state(model), saved[step])
