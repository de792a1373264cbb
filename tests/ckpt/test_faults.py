"""Crashes and damaged files: a checkpoint directory never hands back a half-written step.

Run: `.venv/bin/python -m pytest -q tests/ckpt/test_faults.py -p no:cacheprovider`
Why: issue 5 -- a process SIGKILLed in the middle of an asynchronous save leaves the previous
step restorable and the partial one invisible (a later writer removes it; readers never touch
it); a truncated or altered file is reported as CheckpointCorruptedError naming the file (from
the manifest), and damage the manifest cannot see still gives a CheckpointCorruptedError, never
a raw tensorstore traceback. Issue 41: a step without its manifest is never read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import zerojax
from zerojax.ckpt import layout
from zerojax.ckpt.checkpointer import Checkpointer, save_checkpoint
from zerojax.ckpt.errors import CheckpointCorruptedError, CheckpointNotFoundError
from zerojax.ckpt.manifest import write_manifest

pytestmark = pytest.mark.multidevice

REPO = Path(__file__).resolve().parents[2]
ZERO3 = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
BIG = 4096
"""A BIG x BIG weight: 64 MB of params, 200 MB with AdamW's moments -- about half a second to
write here, a wide window to kill the writer in."""
TMP_MARKER = ".orbax-checkpoint-tmp"


def big_model(seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(BIG, BIG, bias=False))
    return zerojax.initialize(net, torch.optim.AdamW(net.parameters()), config=ZERO3)


def save_then_hang(directory: str) -> None:
    """The child: commit step 1, start the async save of step 2, say so, and wait to die."""
    model, optimizer = big_model()
    ckpt = Checkpointer(directory, model, optimizer)
    ckpt.save(1)
    ckpt.wait()
    print("STEP1_COMMITTED", flush=True)
    ckpt.save(2)
    print("STEP2_STAGED", flush=True)
    time.sleep(120)


def _partial_dirs(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if TMP_MARKER in n] if directory.exists() else []


@pytest.mark.long
def test_sigkill_during_async_save_keeps_the_previous_step(tmp_path):
    directory = tmp_path / "ckpt"
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from tests.ckpt.test_faults import save_then_hang; save_then_hang(sys.argv[2])"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(REPO), str(directory)],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = []
        for line in child.stdout:
            lines.append(line.strip())
            if line.startswith("STEP2_STAGED"):
                break
        assert lines[-2:] == ["STEP1_COMMITTED", "STEP2_STAGED"], lines
        # Orbax may create the temporary directory from its background thread: poll for it.
        deadline = time.monotonic() + 2.0
        while not _partial_dirs(directory) and time.monotonic() < deadline:
            time.sleep(0.001)
        partial = _partial_dirs(directory)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert partial, "step 2 was no longer being written when the child was killed"
    assert not (directory / "2").exists(), "step 2 committed before the kill"
    assert _partial_dirs(directory)  # the kill left it behind

    model, optimizer = big_model(seed=1)
    reader = Checkpointer(directory, model, optimizer)
    assert reader.all_steps() == [1]
    assert reader.restore().step == 1
    expected, _ = big_model(seed=0)  # the child's weights
    np.testing.assert_array_equal(
        np.asarray(model.engine.params["0.weight"]), np.asarray(expected.engine.params["0.weight"])
    )
    assert _partial_dirs(directory), "a reader must not delete anything"
    reader.close()

    with Checkpointer(directory, model, optimizer) as writer:
        assert writer.save(2)
    assert _partial_dirs(directory) == []  # the writer cleaned the dead writer's leftovers
    with Checkpointer(directory, model, optimizer) as ckpt:
        assert ckpt.all_steps() == [1, 2] and ckpt.restore().step == 2


def save_then_exit(directory: str, how: str) -> None:
    """The child: start an async save and let the script end without waiting for it."""
    model, optimizer = big_model()
    if how.startswith("checkpointer"):
        Checkpointer(directory, model, optimizer).save(1)  # never closed
    else:
        save_checkpoint(directory, model, optimizer, step=1, async_save=True)
    print("SAVE_STARTED", flush=True)
    if how == "checkpointer-sys.exit":
        sys.exit(0)


@pytest.mark.parametrize(
    "how",
    [
        "checkpointer",
        pytest.param("checkpointer-sys.exit", marks=pytest.mark.slow),
        pytest.param("save_checkpoint", marks=pytest.mark.slow),
    ],
)
@pytest.mark.long
def test_a_script_that_ends_during_an_async_save_still_commits_it(tmp_path, how):
    """Without `close()`, the interpreter's exit waits for the save (it used to lose it:
    Orbax could no longer start threads once concurrent.futures had shut down, and on Python
    3.12 not at all once finalization began: `zerojax.ckpt.at_exit` waits before it, when the
    main module returns or unwinds). `make test-gpu-stack` runs this on 3.12."""
    directory = tmp_path / "ckpt"
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from tests.ckpt.test_faults import save_then_exit; save_then_exit(sys.argv[2], sys.argv[3])"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(REPO), str(directory), how],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and "SAVE_STARTED" in done.stdout, done.stderr[-3000:]
    assert "cannot schedule new futures" not in done.stderr, done.stderr[-3000:]
    model, optimizer = big_model(seed=1)
    with Checkpointer(directory, model, optimizer) as reader:
        assert reader.all_steps() == [1] and reader.restore().step == 1
    expected, _ = big_model(seed=0)  # the child's weights
    np.testing.assert_array_equal(
        np.asarray(model.engine.params["0.weight"]), np.asarray(expected.engine.params["0.weight"])
    )


# --------------------------------------------------------------------------- damaged files


def small_checkpoint(directory: Path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    model, optimizer = zerojax.initialize(net, torch.optim.AdamW(net.parameters()), config=ZERO3)
    save_checkpoint(directory, model, optimizer, step=1)
    step_dir = directory / "1"
    assert (step_dir / layout.MANIFEST).is_file()
    return model, optimizer, step_dir


def largest_file(root: Path) -> Path:
    files = [p for p in root.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def test_truncated_file_is_named(tmp_path):
    model, optimizer, step_dir = small_checkpoint(tmp_path)
    victim = largest_file(step_dir / layout.MODEL)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(CheckpointCorruptedError, match="truncated") as info:
        Checkpointer(tmp_path, model, optimizer).restore()
    assert info.value.path == str(victim)
    assert str(victim) in str(info.value)


def test_flipped_bytes_are_named(tmp_path):
    model, optimizer, step_dir = small_checkpoint(tmp_path)
    victim = largest_file(step_dir / layout.OPTIMIZER)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match="changed since it was saved") as info:
        Checkpointer(tmp_path, model, optimizer).restore()
    assert info.value.path == str(victim)


# Orbax's failed read leaves a callback on its closed asyncio loop; nothing of ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damage_the_manifest_agrees_with_is_still_a_checkpoint_error(tmp_path):
    """Damage from before the manifest was written (a bad write the crc32s then recorded):
    Orbax's read fails, and the user sees a CheckpointCorruptedError naming the file."""
    model, optimizer, step_dir = small_checkpoint(tmp_path)
    # The model item's OCDBT data file (Orbax merges the per-process stores into `d/`).
    victim = largest_file(step_dir / layout.MODEL / "d")
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    write_manifest(step_dir)
    with pytest.raises(CheckpointCorruptedError) as info:
        Checkpointer(tmp_path, model, optimizer).restore()
    assert str(step_dir) in str(info.value)
    assert info.value.path == str(victim)  # tensorstore named it; we pass it on
    assert info.value.__cause__ is not None  # the Orbax/tensorstore error, kept for debugging
    assert not isinstance(info.value.__cause__, CheckpointCorruptedError)


def test_unreadable_meta_the_manifest_agrees_with(tmp_path):
    model, optimizer, step_dir = small_checkpoint(tmp_path)
    meta = largest_file(step_dir / layout.META)
    meta.write_text('{"format": ')
    write_manifest(step_dir)
    with pytest.raises(CheckpointCorruptedError, match=str(step_dir)):
        Checkpointer(tmp_path, model, optimizer).restore()


def test_a_step_without_manifest_is_never_restored(tmp_path):
    """Issue 41: a step whose manifest is gone (a crash of the zerojax that wrote it after
    the commit, a copy cut short) restored with no integrity check at all, a flipped byte
    included. Now it is no step: not listed, not restored as the latest, and refused by
    number, naming the missing manifest; the current weights stay as they are."""
    _, _, step_dir = small_checkpoint(tmp_path)
    (step_dir / layout.MANIFEST).unlink()
    victim = largest_file(step_dir / layout.MODEL / "d")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    other, other_opt = zerojax.initialize(net, torch.optim.AdamW(net.parameters()), config=ZERO3)
    before = {n: np.asarray(a) for n, a in other.engine.params.items()}
    ckpt = Checkpointer(tmp_path, other, other_opt)
    assert ckpt.all_steps() == [] and ckpt.latest_step() is None
    with pytest.raises(CheckpointNotFoundError, match=r"uncommitted .*\[1\]"):
        ckpt.restore()
    with pytest.raises(CheckpointCorruptedError, match="has no zerojax_manifest.json") as info:
        ckpt.restore(1)
    assert info.value.path == str(step_dir / layout.MANIFEST)
    for name, value in before.items():
        np.testing.assert_array_equal(np.asarray(other.engine.params[name]), value)
    assert victim.read_bytes() == bytes(data), "a read must not touch the step"
