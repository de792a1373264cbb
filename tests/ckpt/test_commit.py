"""Checkpoints that cannot lie: a step is visible only with its manifest, a reader takes only
what verifies, and a save that fails says so, once, with the step and the path.

Run: `.venv/bin/python -m pytest -q -p no:cacheprovider tests/ckpt/test_commit.py`
Why: issue 41 item 3. The manifest used to be written 50-90 ms after Orbax's commit: a crash in
between left a step that restored with no check at all (a flipped byte restored a wrong
weight); a step missing `optimizer/` restored with fresh moments and reset counters; a damaged
newest step failed every restart; a failed async save ended the script with status 0, a failed
sync save or close() raised a bare OSError, and Orbax printed pages of tracebacks. Each test
below failed before its change (the crash test at "after-rename": the step appeared without
its manifest).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.ckpt.test_checkpointer import assert_state_equal, host, make, scramble
from zerojax import cli
from zerojax.ckpt import commit, layout
from zerojax.ckpt.checkpointer import Checkpointer
from zerojax.ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointSaveError,
    CheckpointWarning,
)
from zerojax.ckpt.manifest import manifest_problems, write_manifest

pytestmark = pytest.mark.multidevice

REPO = Path(__file__).resolve().parents[2]
CRASH = 86  # the exit status of a simulated crash


def run_child(function: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `tests.ckpt.test_commit.<function>(*args)` in a fresh interpreter."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        f"from tests.ckpt.test_commit import {function}; {function}(*sys.argv[2:])"
    )
    return subprocess.run(
        [sys.executable, "-c", script, str(REPO), *args],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def files_of(step_dir: Path) -> set[str]:
    return {
        p.relative_to(step_dir).as_posix()
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != layout.MANIFEST
    }


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def largest_file(root: Path) -> Path:
    return max((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- crash at each point


def _crash() -> None:
    sys.stdout.flush()
    os._exit(CRASH)


def arm_crash(point: str) -> None:
    """Make the process die (os._exit: no cleanup, no exit hook) at `point` of the next save."""
    import orbax.checkpoint as ocp

    from zerojax.ckpt import manifest

    if point.startswith("item:"):  # after the item's own rename inside the step's tmp dir
        item, plain = point.split(":")[1], ocp.path.atomicity.AtomicRenameTemporaryPath
        original = plain.finalize

        async def finalize(self, *args, **kwargs):
            await original(self, *args, **kwargs)
            if self.get_final().name == item:
                _crash()

        plain.finalize = finalize
    elif point == "before-commit-time":
        commit._stamp_commit_time = lambda *a: _crash()
    elif point == "before-manifest":
        commit.write_manifest = lambda *a: _crash()
    elif point == "mid-manifest":  # the manifest's own temporary file written, not renamed
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if os.path.basename(dst) == layout.MANIFEST:
                _crash()
            return real_replace(src, dst, *args, **kwargs)

        manifest.os.replace = replace
    elif point in ("after-manifest", "after-rename"):
        rename = commit._rename

        def crash_at_rename(tmp_dir, final_dir):
            if point == "after-rename":
                rename(tmp_dir, final_dir)
            _crash()

        commit._rename = crash_at_rename
    elif point == "after-commit":  # Orbax's save done, the Checkpointer not yet told
        commit_step = Checkpointer._commit

        def commit_then_crash(self, manager, step):
            commit_step(self, manager, step)
            _crash()

        Checkpointer._commit = commit_then_crash
    else:
        raise ValueError(point)


def save_and_crash(directory: str, point: str, mode: str) -> None:
    """The child: commit step 1, then die at `point` of the save of step 2."""
    model, optimizer = make()
    scramble(model, seed=1)
    ckpt = Checkpointer(directory, model, optimizer, async_save=mode == "async")
    ckpt.save(1)
    ckpt.wait()
    scramble(model, seed=2)
    arm_crash(point)
    ckpt.save(2)
    ckpt.wait()
    print("NO_CRASH", flush=True)
    os._exit(0)


POINTS = [
    "item:model",
    "item:optimizer",
    "item:train_state",
    "item:meta",
    "before-commit-time",
    "before-manifest",
    "mid-manifest",
    "after-manifest",
    "after-rename",
    "after-commit",
]


# One interpreter per crash (~5 s each here): these four, one on each side of each write that
# matters (items, manifest, rename), run by default; every point, and the synchronous save's
# path through the same commit, with the slow tests.
DEFAULT_POINTS = ("item:optimizer", "before-manifest", "after-manifest", "after-rename")


@pytest.mark.parametrize(
    ("point", "mode"),
    [
        pytest.param(p, "async", marks=() if p in DEFAULT_POINTS else pytest.mark.slow)
        for p in POINTS
    ]
    + [pytest.param(p, "sync", marks=pytest.mark.slow) for p in DEFAULT_POINTS],
)
@pytest.mark.long
def test_a_crash_at_any_point_of_a_save_never_leaves_a_step_that_restores_unverified(
    tmp_path, point, mode
):
    """The process dies at each point of saving step 2. Whatever it leaves, every numbered
    directory has a manifest covering every one of its files, restore() takes the newest
    step with the state saved there, and once a byte of that step is flipped it is never
    restored: restore() falls back with a warning, or raises."""
    directory = tmp_path / "ckpt"
    done = run_child("save_and_crash", str(directory), point, mode)
    assert done.returncode == CRASH, (done.returncode, done.stdout, done.stderr[-3000:])

    listing = commit.scan(directory)
    assert listing.uncommitted == [], "a numbered directory without its manifest"
    committed_2 = point in ("after-rename", "after-commit")
    latest = 2 if committed_2 else 1
    assert listing.committed == ([1, 2] if committed_2 else [1])
    assert bool(listing.partial) == (not committed_2)  # the dead save's tmp dir, if any
    for step in listing.committed:
        step_dir = directory / str(step)
        listed = set(json.loads((step_dir / layout.MANIFEST).read_text())["files"])
        assert listed == files_of(step_dir), "the manifest covers every file of the step"
        assert manifest_problems(step_dir) == []

    expected, _ = make()
    scramble(expected, seed=latest)
    model, optimizer = make(seed=3)
    with Checkpointer(directory, model, optimizer) as reader:
        assert reader.restore().step == latest
    assert_state_equal(host(model), host(expected))

    victim = largest_file(directory / str(latest) / layout.MODEL)
    flip_a_byte(victim)
    other, other_opt = make(seed=4)
    with Checkpointer(directory, other, other_opt) as reader:
        if committed_2:
            with pytest.warns(CheckpointWarning, match=f"step 2 .*{victim.name}.* changed"):
                assert reader.restore().step == 1
        else:
            with pytest.raises(CheckpointCorruptedError, match="changed since it was saved"):
                reader.restore()
        with pytest.raises(CheckpointCorruptedError, match=str(victim)):
            reader.restore(latest)


# --------------------------------------------------------------------------- reading


def test_restore_latest_falls_back_past_damaged_and_uncommitted_steps(tmp_path):
    model, optimizer = make()
    saved = {}
    with Checkpointer(tmp_path, model, optimizer, async_save=False, max_to_keep=None) as ckpt:
        for step in (1, 2, 3):
            scramble(model, seed=10 + step)
            saved[step] = host(model)
            ckpt.save(step)
    damaged = largest_file(tmp_path / "3" / layout.OPTIMIZER)
    flip_a_byte(damaged)
    shutil.copytree(tmp_path / "2", tmp_path / "4")  # a copy cut short: no manifest
    (tmp_path / "4" / layout.MANIFEST).unlink()
    (tmp_path / "5").write_text("not a step")  # a file where a step's directory should be
    before = {s: tree_bytes(tmp_path / s) for s in ("3", "4")}

    other, other_opt = make(seed=5)
    reader = Checkpointer(tmp_path, other, other_opt)
    assert reader.all_steps() == [1, 2, 3]
    with pytest.warns(CheckpointWarning) as caught:
        assert reader.restore().step == 2
    assert_state_equal(host(other), saved[2])
    messages = sorted(str(w.message) for w in caught if w.category is CheckpointWarning)
    assert len(messages) == 3, messages
    assert "step 3" in messages[0] and str(damaged) in messages[0]
    assert "changed since it was saved" in messages[0]
    assert "step 4" in messages[1] and "not committed" in messages[1]
    assert "step 5" in messages[2] and "not committed" in messages[2]
    assert all("left as it is" in m for m in messages)
    # A read deletes nothing and changes nothing.
    assert {s: tree_bytes(tmp_path / s) for s in ("3", "4")} == before
    assert (tmp_path / "5").read_text() == "not a step"

    # Asked for by number, a step that does not verify raises.
    with pytest.raises(CheckpointCorruptedError, match="changed since it was saved") as info:
        reader.restore(3)
    assert info.value.path == str(damaged)
    with pytest.raises(CheckpointCorruptedError, match="has no zerojax_manifest.json"):
        reader.restore(4)
    assert_state_equal(host(other), saved[2])  # neither touched the state

    # Nothing verifies: one error naming every step tried.
    for step in ("1", "2"):
        flip_a_byte(largest_file(tmp_path / step / layout.MODEL))
    with pytest.raises(CheckpointCorruptedError, match="no step of .* verifies") as info:
        reader.restore()
    assert all(f"step {s}:" in str(info.value) for s in (1, 2, 3))
    reader.close()


@pytest.mark.parametrize("item", [layout.OPTIMIZER, layout.TRAIN_STATE])
@pytest.mark.parametrize("recorded", ["meta", "orbax"])
def test_an_item_the_step_says_it_holds_must_be_there(tmp_path, item, recorded):
    """The step's manifest rewritten to agree (a copy made without the item and then
    re-manifested), so only the item check stands between the user and fresh optimizer
    moments or reset counters. `recorded`: the item list read from meta's `items`, or, for a
    step written before that key, from Orbax's step metadata."""
    model, optimizer = make()
    scramble(model, seed=1)
    with Checkpointer(tmp_path, model, optimizer, async_save=False) as ckpt:
        ckpt.save(1)
    step_dir = tmp_path / "1"
    shutil.rmtree(step_dir / item)
    if recorded == "orbax":
        meta_file = step_dir / layout.META / "metadata"
        meta = json.loads(meta_file.read_text())
        del meta["items"]
        meta_file.write_text(json.dumps(meta))
    write_manifest(step_dir)

    other, other_opt = make(seed=2)
    before = host(other)
    with pytest.raises(CheckpointCorruptedError, match=f"step 1 .*item '{item}' is missing"):
        Checkpointer(tmp_path, other, other_opt).restore()
    assert_state_equal(host(other), before)
    with pytest.raises(CheckpointCorruptedError) as info:
        Checkpointer(tmp_path, other, other_opt).restore(1)
    assert info.value.path == str(step_dir / item)


def inspect(*args: str, capsys) -> tuple[int, str, str]:
    code = cli.main(["ckpt", "inspect", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_verify_exits_non_zero_on_anything_it_could_not_verify(tmp_path, capsys):
    model, optimizer = make()
    with Checkpointer(tmp_path, model, optimizer, async_save=False, max_to_keep=None) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step)
    code, out, err = inspect(str(tmp_path), "--verify", capsys=capsys)
    assert code == 0 and "verified: every file" in out and err == ""

    # The model item's largest file is its sharding metadata: the description cannot be read
    # either, and both are reported.
    victim = largest_file(tmp_path / "3" / layout.MODEL)
    flip_a_byte(victim)
    code, out, err = inspect(str(tmp_path), "--verify", capsys=capsys)
    assert code == 1 and "verified:" not in out
    assert "step 3 of" in err and "is NOT verified (2 problems)" in err
    assert f"{victim}' changed since it was saved" in err
    assert "the metadata of item 'model' cannot be read" in err

    # Issue 41's case: no manifest, and every parameter MISSING (the model item gone).
    (tmp_path / "2" / layout.MANIFEST).unlink()
    shutil.rmtree(tmp_path / "2" / layout.MODEL)
    code, out, err = inspect(str(tmp_path), "--step", "2", "--verify", capsys=capsys)
    assert code == 1
    assert "UNCOMMITTED" in out and "MISSING" in out and "ignored: 2 (uncommitted" in out
    assert "has no zerojax_manifest.json" in err and "item 'model' is missing" in err
    assert "fc1.weight: listed in meta" in err
    # Without --verify inspect still describes it, and says so.
    code, out, _ = inspect(str(tmp_path), "--step", "2", capsys=capsys)
    assert code == 0 and "ABSENT: the step cannot be verified" in out
    code, out, err = inspect(str(tmp_path), "--json", "--verify", capsys=capsys)
    info = json.loads(out)
    assert code == 1 and info["step"] == 3 and info["verified"] is False
    assert info["uncommitted"] == [2] and info["steps"] == [1, 3]
    code, out, err = inspect(str(tmp_path), "--step", "1", "--verify", capsys=capsys)
    assert code == 0 and "verified: every file" in out


# --------------------------------------------------------------------------- failing saves


def orbax_noise(text: str) -> list[str]:
    """Lines of tracebacks, of Orbax's source files or of its (absl) log records."""
    marks = ("Traceback", "/orbax/checkpoint/", "absl", "Event loop is closed")
    return [line for line in text.splitlines() if any(m in line for m in marks)]


def test_a_failed_sync_save_is_a_checkpoint_save_error(tmp_path, capfd):
    """A path that cannot be created even by root: the checkpoint directory under a file."""
    (tmp_path / "file").write_text("x")
    directory = tmp_path / "file" / "ckpt"
    model, optimizer = make()
    ckpt = Checkpointer(directory, model, optimizer, async_save=False)
    with pytest.raises(CheckpointSaveError, match=f"step 1 was not saved to {directory}/1") as info:
        ckpt.save(1)
    assert info.value.step == 1 and info.value.path == str(directory / "1")
    assert isinstance(info.value.__context__, OSError | ValueError)  # Orbax's, for debugging
    ckpt.close()
    assert orbax_noise(capfd.readouterr().err) == []


@pytest.mark.parametrize("reported_by", ["close", "wait", "save", "restore"])
def test_a_failed_async_save_is_reported_once_and_its_directory_removed(
    tmp_path, capfd, reported_by
):
    """The commit fails as on a full disk. The next close(), wait(), save() or restore()
    raises a CheckpointSaveError naming the step and its directory (close() used to raise
    Orbax's bare OSError and leave its threads running), the failed step's temporary
    directory is gone, nothing of Orbax's reaches stderr, and the next save works."""
    model, optimizer = make()
    scramble(model, seed=1)
    ckpt = Checkpointer(tmp_path, model, optimizer)
    ckpt.save(1)
    ckpt.wait()
    real = commit._mark_success

    def disk_full(tmp_dir, final_dir):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_dir))

    commit._mark_success = disk_full
    report = {
        "close": ckpt.close,
        "wait": ckpt.wait,
        "save": lambda: ckpt.save(5),  # step 5 is not saved: the caller learns why first
        "restore": ckpt.restore,
    }[reported_by]
    try:
        ckpt.save(2)
        with pytest.raises(CheckpointSaveError, match="No space left on device") as info:
            report()
    finally:
        commit._mark_success = real
    assert info.value.step == 2 and info.value.path == str(tmp_path / "2")
    assert f"step 2 was not saved to {tmp_path / '2'}" in str(info.value)
    assert "the latest committed step is 1" in str(info.value)
    assert ckpt._manager is None  # the next save opens a fresh one
    if reported_by == "close":
        assert ckpt._executor is None
        assert not [t for t in threading.enumerate() if t.name.startswith("zerojax-save")]
    assert commit.scan(tmp_path) == commit.StepListing([1], [], [])
    assert orbax_noise(capfd.readouterr().err) == []

    ckpt.wait()  # reported once: waiting again is quiet
    scramble(model, seed=3)
    saved = host(model)
    ckpt.save(3)
    ckpt.wait()
    other, other_opt = make(seed=4)
    with Checkpointer(tmp_path, other, other_opt) as reader:
        assert reader.restore().step == 3
    assert_state_equal(host(other), saved)
    ckpt.close()


def test_an_interrupted_wait_leaves_the_save_pending_for_the_exit(tmp_path):
    """Ctrl-C while wait() blocks must not drop the save: it stays pending and held by the
    exit hook (`zerojax.ckpt.at_exit`), and the next wait, close or the exit finishes it."""
    import time

    from zerojax.ckpt import at_exit

    model, optimizer = make()
    ckpt = Checkpointer(tmp_path, model, optimizer)
    real = commit._mark_success
    commit._mark_success = lambda *a: (time.sleep(0.5), real(*a))
    try:
        ckpt.save(2)
        pending = ckpt._pending

        def interrupted(timeout=None):
            raise KeyboardInterrupt

        pending.result = interrupted
        with pytest.raises(KeyboardInterrupt):
            ckpt.wait()
        assert ckpt._pending is pending and id(ckpt) in at_exit._tracked
        del pending.result
        ckpt.close()
    finally:
        commit._mark_success = real
    assert id(ckpt) not in at_exit._tracked
    assert commit.scan(tmp_path).committed == [2]


def test_a_step_saved_but_an_older_one_not_deleted_is_a_warning(tmp_path):
    """Step 2 commits; then Orbax cannot delete step 1 for max_to_keep (a read-only step,
    say). That used to be reported as "step 2 was not saved", which was false."""
    import orbax.checkpoint as ocp

    model, optimizer = make()
    scramble(model, seed=1)
    ckpt = Checkpointer(tmp_path, model, optimizer, max_to_keep=1)
    ckpt.save(1)
    ckpt.wait()
    scramble(model, seed=2)
    saved = host(model)
    deleter = ocp.path.deleter.StandardCheckpointDeleter
    real = deleter.delete_steps

    def read_only(self, steps):
        raise PermissionError(13, "Permission denied", str(tmp_path / "1" / "_sharding"))

    deleter.delete_steps = read_only
    try:
        ckpt.save(2)
        with pytest.warns(CheckpointWarning, match=r"step 2 was saved .*max_to_keep=1\) failed"):
            ckpt.close()
    finally:
        deleter.delete_steps = real
    assert commit.scan(tmp_path).committed == [1, 2]
    other, other_opt = make(seed=3)
    with Checkpointer(tmp_path, other, other_opt) as reader:
        assert reader.restore().step == 2
    assert_state_equal(host(other), saved)


def test_export_refuses_a_step_it_cannot_verify(tmp_path, capsys):
    """Issue 41: `ckpt export` of a step without a manifest wrote its flipped byte out."""
    model, optimizer = make()
    with Checkpointer(tmp_path / "ckpt", model, optimizer, async_save=False) as ckpt:
        ckpt.save(1)
    step_dir = tmp_path / "ckpt" / "1"
    (step_dir / layout.MANIFEST).unlink()
    flip_a_byte(largest_file(step_dir / layout.MODEL / "d"))
    out = tmp_path / "model.safetensors"
    assert cli.main(["ckpt", "export", str(tmp_path / "ckpt"), str(out), "--quiet"]) == 2
    assert "no committed checkpoint step" in capsys.readouterr().err
    args = ["ckpt", "export", str(tmp_path / "ckpt"), str(out), "--step", "1", "--quiet"]
    assert cli.main(args) == 2
    assert "has no zerojax_manifest.json" in capsys.readouterr().err
    assert not out.exists()


def test_a_save_replaces_an_uncommitted_directory_of_its_step(tmp_path, caplog):
    model, optimizer = make()
    scramble(model, seed=1)
    with Checkpointer(tmp_path, model, optimizer, async_save=False) as ckpt:
        ckpt.save(1)
        shutil.copytree(tmp_path / "1", tmp_path / "2")
        (tmp_path / "2" / layout.MANIFEST).unlink()
        with pytest.raises(CheckpointError, match="step 1 already exists"):
            ckpt.save(1)
        scramble(model, seed=2)
        saved = host(model)
        ckpt.save(2)
    assert "replacing uncommitted step directory" in caplog.text
    other, other_opt = make(seed=3)
    with Checkpointer(tmp_path, other, other_opt) as reader:
        assert reader.all_steps() == [1, 2] and reader.restore().step == 2
    assert_state_equal(host(other), saved)


def fail_to_create_the_step_directory(directory: str) -> None:
    """The child: step 2's temporary directory cannot be created (as on a read-only
    checkpoint directory, which root could still write), and the script ends without
    close()."""
    model, optimizer = make()
    ckpt = Checkpointer(directory, model, optimizer)
    ckpt.save(1)
    ckpt.wait()
    create = commit.ManifestedRename.create

    async def refuse(self):
        if self.get_final().name.isdigit():
            raise PermissionError(13, "Permission denied", str(self.get()))
        return await create(self)

    commit.ManifestedRename.create = refuse
    ckpt.save(2)
    print("SAVE_STARTED", flush=True)


@pytest.mark.long
def test_a_step_directory_that_cannot_be_created_fails_the_save_and_the_exit_does_not_hang(
    tmp_path,
):
    """With Orbax's asynchronous directory creation the failed mkdir left the items' (non-
    daemon) threads waiting 600 s for the directory's signal: the interpreter hung at exit."""
    directory = tmp_path / "ckpt"
    done = run_child("fail_to_create_the_step_directory", str(directory), timeout=120)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr[-3000:])
    assert f"checkpoint step 2 was not saved to {directory / '2'}" in done.stderr
    assert "Permission denied" in done.stderr
    assert commit.scan(directory) == commit.StepListing([1], [], [])


def fail_last_save(directory: str, ending: str) -> None:
    """The child: commit step 1, then start step 2's async save on a "full disk" (files may
    not grow past 64 KB: RLIMIT_FSIZE, which binds root too) and end without close()."""
    import atexit
    import resource
    import signal

    atexit.register(lambda: print("USER_ATEXIT_RAN", flush=True))
    model, optimizer = make(hidden=4096)  # 128 KB weights, 256 KB of moments
    ckpt = Checkpointer(directory, model, optimizer)
    ckpt.save(1)
    ckpt.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    ckpt.save(2)
    print("SAVE_STARTED", flush=True)
    if ending == "sys.exit":
        sys.exit(0)


@pytest.mark.parametrize("ending", ["end", pytest.param("sys.exit", marks=pytest.mark.slow)])
@pytest.mark.long
def test_a_failed_final_async_save_exits_non_zero(tmp_path, ending):
    """Issue 41: the process exited 0 with a log line and the last checkpoint was lost. Now
    the exit waits for the save, prints one error naming the step and the path, runs the
    script's atexit callbacks, and exits with status 1."""
    directory = tmp_path / "ckpt"
    done = run_child("fail_last_save", str(directory), ending)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "SAVE_STARTED" in done.stdout and "USER_ATEXIT_RAN" in done.stdout
    assert f"checkpoint step 2 was not saved to {directory / '2'}" in done.stderr
    assert "File too large" in done.stderr
    assert "1 checkpoint save failed; exiting with status 1" in done.stderr
    assert orbax_noise(done.stderr) == [], done.stderr[-3000:]
    assert len(done.stderr.splitlines()) <= 4, done.stderr[-3000:]
    assert commit.scan(directory) == commit.StepListing([1], [], [])


def test_every_file_is_on_the_disk_before_the_commit_and_tensorstore_does_not_fsync_each_write(
    tmp_path, monkeypatch
):
    """The Checkpointer's saves (one process) write the arrays without TensorStore's fsync
    after each write (it cost a bench save ~0.6 s); the durability that made up for moves to the commit:
    the manifest pass flushes every file of the step (`fdatasync`) before the manifest and the
    rename. Other Orbax saves in the process keep TensorStore's default."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    commit._install_sync_at_commit()
    installed = tensorstore_utils.get_ts_context
    io_sync = []

    def recording_context(*args, **kwargs):
        context = installed(*args, **kwargs)
        io_sync.append((threading.current_thread().name, context["file_io_sync"].to_json()))
        return context

    monkeypatch.setattr(tensorstore_utils, "get_ts_context", recording_context)
    events = []
    fdatasync, rename = os.fdatasync, commit._rename

    def recording_fdatasync(fd):
        events.append(("synced", os.readlink(f"/proc/self/fd/{fd}")))
        fdatasync(fd)

    def recording_rename(tmp_dir, final_dir):
        events.append(("renamed", str(final_dir)))
        rename(tmp_dir, final_dir)

    monkeypatch.setattr(os, "fdatasync", recording_fdatasync)
    monkeypatch.setattr(commit, "_rename", recording_rename)
    model, opt = make(hidden=1024)
    scramble(model, seed=1)
    with Checkpointer(tmp_path, model, opt) as ckpt:
        ckpt.save(3)
    step_dir = tmp_path / "3"
    # Every item's context on the thread that writes the arrays: file_io_sync off (Orbax's
    # merge of the per-process b-trees, on its own thread, keeps fsyncing its few small files).
    writes = [sync for thread, sync in io_sync if thread.startswith("zerojax-write")]
    assert writes and not any(writes), io_sync
    assert events[-1] == ("renamed", str(step_dir))
    synced = {
        Path(path.replace(".orbax-checkpoint-tmp", "")).relative_to(step_dir).as_posix()
        for kind, path in events[:-1]
        if kind == "synced" and path.startswith(str(step_dir))
    }
    on_disk = {
        p.relative_to(step_dir).as_posix()
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != layout.MANIFEST
    }
    assert on_disk <= synced, on_disk - synced
    # Outside the Checkpointer's save: TensorStore's default (fsync each write) is untouched.
    assert tensorstore_utils.get_ts_context(use_ocdbt=True)["file_io_sync"].to_json() is True
