"""Restore's direct read (zerojax/ckpt/direct_read.py): the arrays read straight from Orbax's
files, each data file read once and checked against the manifest as it is read.

Run: `.venv/bin/python -m pytest -q tests/ckpt/test_direct_read.py -p no:cacheprovider`
Why: issue 44 -- restore read every byte twice (Orbax's read, then the manifest's crc32 pass)
and spent most of its time in TensorStore's per-chunk path. These tests check that the direct
read (a) is the path a one-process restore takes, with no data file hashed twice, (b) restores
exactly what Orbax restores, onto the saving mesh and onto another one, (c) still names every
damaged data file (flipped byte, truncation, deletion) and leaves the state untouched, and (d)
leaves checkpoints it does not know (compressed chunks) to Orbax. The model is big enough for
its shards to live in data files (Orbax keeps values up to 1 KB inline in the b-tree).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch

from tests.ckpt.test_checkpointer import assert_state_equal, host, make, scramble
from zerojax.ckpt import checkpointer as checkpointer_module
from zerojax.ckpt import direct_read, layout, manifest
from zerojax.ckpt.checkpointer import Checkpointer
from zerojax.ckpt.errors import CheckpointCorruptedError

pytestmark = pytest.mark.multidevice

HIDDEN = 1024  # fc1.weight (1024, 8) fp32: 8 shards of 4 KB, stored out of line


@pytest.fixture(autouse=True)
def small_arrays_below_8_kb(monkeypatch):
    """Arrays under 8 KB are written whole (the default, 256 KB, would write every array of
    this small model whole): fc1.bias (4 KB) is one chunk, the weights (32 KB) a chunk per
    shard, so both ways of placing what is read are exercised."""
    monkeypatch.setattr(checkpointer_module, "_WHOLE_BELOW_BYTES", 8 << 10)


def saved_checkpoint(directory: Path, seed: int = 1):
    model, opt = make(hidden=HIDDEN)
    scramble(model, seed=seed)
    with Checkpointer(directory, model, opt) as ckpt:
        ckpt.save(3)
    return model, opt, host(model), directory / "3"


def watch_reads(monkeypatch) -> tuple[list, list]:
    """(items Orbax read arrays of, files the manifest pass hashed), recorded."""
    orbax_items, hashed = [], []
    read, checksum = Checkpointer._read, manifest.file_checksum

    def recording_read(self, step, args):
        orbax_items.extend(args)
        return read(self, step, args)

    def recording_checksum(path, *args):
        hashed.append(Path(path))
        return checksum(path, *args)

    monkeypatch.setattr(Checkpointer, "_read", recording_read)
    monkeypatch.setattr(manifest, "file_checksum", recording_checksum)
    return orbax_items, hashed


def data_files(step_dir: Path, item: str) -> set[Path]:
    plan = direct_read.plan_item(str(step_dir), item, manifest.read_manifest(step_dir))
    return {step_dir / f for f in plan.files}


def test_restore_reads_each_data_file_once_and_restores_every_array(tmp_path, monkeypatch):
    _, _, saved, step_dir = saved_checkpoint(tmp_path)
    files = set().union(
        *(data_files(step_dir, i) for i in (layout.MODEL, layout.OPTIMIZER, layout.TRAIN_STATE))
    )
    assert files, "the shards should be stored out of line"
    other, other_opt = make(hidden=HIDDEN, seed=5)
    assert not np.array_equal(host(other)["params"]["fc1.weight"], saved["params"]["fc1.weight"])
    orbax_items, hashed = watch_reads(monkeypatch)
    passes = []
    read_items = direct_read.DirectRead.read_items

    def recording_read_items(self, wanted):
        passes.append(sorted(wanted))
        return read_items(self, wanted)

    monkeypatch.setattr(direct_read.DirectRead, "read_items", recording_read_items)

    assert Checkpointer(tmp_path, other, other_opt).restore().step == 3

    # Every item's files in one pass (one item after the other, the optimizer's largest file
    # ended the restore alone).
    assert passes == [sorted([layout.MODEL, layout.OPTIMIZER, layout.TRAIN_STATE])]

    assert_state_equal(host(other), saved)
    # Nothing went through Orbax's read: the arrays and the train_state (rng) came from the
    # direct read, whose files the manifest pass did not hash a second time (it hashed every
    # other file), and `meta` was read as the JSON file it is.
    assert orbax_items == []
    assert not files & set(hashed)
    listed = {step_dir / rel for rel in manifest.read_manifest(step_dir)}
    assert set(hashed) == listed - files
    engine = other.engine
    # The rng as Orbax's read left it: uncommitted on the default device (a committed one
    # would give every program taking it another cache key).
    assert not engine.state.rng.committed
    for name, array in engine.params.items():
        assert array.sharding == engine.plan.params[name], name
    for name, array in engine.opt_state["exp_avg"].items():
        assert array.sharding == engine.plan.opt_state[name], name
    # The restored arrays are usable by the next update (which donates them).
    other_opt.step()
    jax.block_until_ready(engine.params)


def test_restore_onto_another_mesh_equals_what_orbax_reads(tmp_path, monkeypatch):
    """Shards of a data x fsdp ZeRO-1 mesh are not the chunks saved by fsdp=8 ZeRO-3: those
    arrays are assembled whole and sliced; replicated ones get a copy per device. Compared
    with Orbax's own read of the same step (direct read off)."""
    _, _, saved, _ = saved_checkpoint(tmp_path)
    config = {"mesh": {"data": 4, "fsdp": 2}, "zero": {"stage": 1}}
    direct, direct_opt = make(config, hidden=HIDDEN, seed=5)
    Checkpointer(tmp_path, direct, direct_opt).restore()
    monkeypatch.setattr(Checkpointer, "_plan_direct", lambda *_: None)
    through_orbax, orbax_opt = make(config, hidden=HIDDEN, seed=6)
    Checkpointer(tmp_path, through_orbax, orbax_opt).restore()
    assert_state_equal(host(direct), host(through_orbax))
    assert_state_equal(host(direct), saved)


def largest_data_file(step_dir: Path, item: str) -> Path:
    return max(data_files(step_dir, item), key=lambda p: p.stat().st_size)


def as_old_manifest(step_dir: Path) -> None:
    """Rewrite the step's manifest as zerojax wrote it before 2026-11-28: {size, crc32}."""
    path = step_dir / layout.MANIFEST
    files = json.loads(path.read_text())["files"]
    assert all(set(entry) == {"size", "xxh3_64"} for entry in files.values())
    old = {
        rel: {"size": e["size"], "crc32": zlib.crc32((step_dir / rel).read_bytes())}
        for rel, e in files.items()
    }
    path.write_text(json.dumps({"files": old}))


@pytest.mark.parametrize("old_manifest", [False, True], ids=["xxh3_64", "crc32"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_data_file_is_named_and_nothing_is_restored(tmp_path, damage, old_manifest):
    """Also with a manifest of crc32s (before 2026-11-28): the direct read checks each file
    with the checksum its entry holds."""
    _, _, _, step_dir = saved_checkpoint(tmp_path)
    if old_manifest:
        as_old_manifest(step_dir)
    victim = largest_data_file(step_dir, layout.OPTIMIZER)
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size - 1)
    else:
        victim.unlink()
    other, other_opt = make(hidden=HIDDEN, seed=5)
    before = host(other)
    kind = "crc32" if old_manifest else "xxh3_64"
    expected = {
        "flip": f"changed since it was saved: {kind}",
        "truncate": "truncated",
        "delete": "missing",
    }
    with pytest.raises(CheckpointCorruptedError, match=expected[damage]) as info:
        Checkpointer(tmp_path, other, other_opt).restore(3)
    assert info.value.path == str(victim)
    assert_state_equal(host(other), before)


def test_a_manifest_of_crc32s_still_restores(tmp_path, monkeypatch):
    """A checkpoint from before 2026-11-28 (manifest of crc32s) restores through the direct
    read, each file hashed once, with crc32."""
    _, _, saved, step_dir = saved_checkpoint(tmp_path)
    as_old_manifest(step_dir)
    kinds = []
    new_hasher = direct_read.new_hasher
    monkeypatch.setattr(
        direct_read, "new_hasher", lambda kind: kinds.append(kind) or new_hasher(kind)
    )
    other, other_opt = make(hidden=HIDDEN, seed=5)
    orbax_items, hashed = watch_reads(monkeypatch)
    Checkpointer(tmp_path, other, other_opt).restore(3)
    assert_state_equal(host(other), saved)
    assert layout.MODEL not in orbax_items and kinds and set(kinds) == {"crc32"}
    assert not (data_files(step_dir, layout.MODEL) | data_files(step_dir, layout.OPTIMIZER)) & set(
        hashed
    )


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child runs no JAX
def test_a_forked_child_starts_its_own_read_threads(tmp_path):
    """The read threads live for the process; a forked child (a DataLoader worker) has none of
    its parent's threads, so it must not reuse the parent's pool (its work would never run)."""
    assert direct_read._read_pool() is direct_read._read_pool()  # started once
    pid = os.fork()
    if pid == 0:  # the child: a pool of its own, which runs work
        ok = direct_read._pool is None and direct_read._read_pool().submit(int, 7).result() == 7
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_files_of_an_item_not_restored_are_still_checked(tmp_path):
    """load_optimizer=False reads no optimizer array: its data files are checked anyway (a
    step restores only when all of it verifies, as before the direct read)."""
    _, _, _, step_dir = saved_checkpoint(tmp_path)
    victim = largest_data_file(step_dir, layout.OPTIMIZER)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x80
    victim.write_bytes(bytes(data))
    other, other_opt = make(hidden=HIDDEN, seed=5)
    with pytest.raises(CheckpointCorruptedError, match="changed since it was saved") as info:
        Checkpointer(tmp_path, other, other_opt).restore(3, load_optimizer=False)
    assert info.value.path == str(victim)


def test_compressed_chunks_are_read_through_orbax(tmp_path, monkeypatch):
    """Orbax's default (zstd chunks: older zerojax saves, plain Orbax checkpoints) is not what
    the direct read knows: those items go through Orbax, and restore the same values."""
    compressed = lambda: ocp.PyTreeCheckpointHandler(use_compression=True)
    handlers = checkpointer_module._handlers
    monkeypatch.setattr(
        checkpointer_module,
        "_handlers",
        lambda: {
            **handlers(),
            layout.MODEL: compressed(),
            layout.OPTIMIZER: compressed(),
        },
    )
    _, _, saved, step_dir = saved_checkpoint(tmp_path)
    with pytest.raises(direct_read.Unsupported, match="chunk"):
        direct_read.plan_item(str(step_dir), layout.MODEL, manifest.read_manifest(step_dir))
    other, other_opt = make(hidden=HIDDEN, seed=5)
    orbax_items, _ = watch_reads(monkeypatch)
    Checkpointer(tmp_path, other, other_opt).restore()
    assert layout.MODEL in orbax_items and layout.OPTIMIZER in orbax_items
    assert_state_equal(host(other), saved)


def test_restored_parameters_match_torch(tmp_path):
    """The restored weights, read back through the torch module, are the saved ones."""
    model, _, _, _ = saved_checkpoint(tmp_path)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    other, other_opt = make(hidden=HIDDEN, seed=5)
    Checkpointer(tmp_path, other, other_opt).restore()
    for name, value in other.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_small_arrays_are_written_whole_and_restore_onto_their_shards(tmp_path):
    """Arrays under `_WHOLE_BELOW_BYTES` (biases, norm weights) are written as one chunk each
    instead of one per shard (each chunk costs the write about as much as a large one); the
    large ones keep a chunk per shard, which the direct read places without a copy."""
    _, _, saved, step_dir = saved_checkpoint(tmp_path)
    plan = direct_read.plan_item(str(step_dir), layout.MODEL, manifest.read_manifest(step_dir))
    assert len(plan.arrays["fc1.bias"].values) == 1  # 4 KB < 8 KB: whole
    assert len(plan.arrays["fc1.weight"].values) == 8  # 32 KB: a chunk per shard
    other, other_opt = make(hidden=HIDDEN, seed=5)
    Checkpointer(tmp_path, other, other_opt).restore()
    assert_state_equal(host(other), saved)
    engine = other.engine
    assert engine.params["fc1.bias"].sharding == engine.plan.params["fc1.bias"]


def test_shards_restored_onto_the_saving_mesh_are_one_block_without_copies(tmp_path):
    """Each device's shard of a ZeRO-3 array is a stored chunk: the chunks are read into one
    aligned allocation per array, consecutive, and each device's array is that memory (XLA's
    CPU client aliases an aligned host buffer), not a copy of it."""
    _, _, saved, _ = saved_checkpoint(tmp_path)
    other, other_opt = make(hidden=HIDDEN, seed=5)
    Checkpointer(tmp_path, other, other_opt).restore()
    assert_state_equal(host(other), saved)
    array = other.engine.params["fc1.weight"]  # (1024, 8) fp32 over 8 devices: 4 KiB a shard
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start)
    pointers = [s.data.unsafe_buffer_pointer() for s in shards]
    shard_bytes = shards[0].data.nbytes
    assert shard_bytes == 4096 and len(shards) == 8
    assert pointers == [pointers[0] + k * shard_bytes for k in range(8)]
    assert pointers[0] % 64 == 0
