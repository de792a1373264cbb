"""How a step becomes visible, and which steps count as committed.

Orbax's `CheckpointManager` (0.12, a local or other POSIX path) writes step S into
`S.orbax-checkpoint-tmp`, each item into a temporary directory of its own inside it, and then,
on the primary process once every process has written its shards, finalizes it: the step's
`_CHECKPOINT_METADATA` gets its commit time, `commit_success.txt` is written, and the directory
is renamed to `S`. That rename is the commit. `ManifestedRename` -- the manager's
`temporary_path_class` -- does the same with the manifest (`zerojax.ckpt.manifest`) written
into the temporary directory between the last of those files and the rename, over every file
the step holds. So a step directory never exists without its manifest: a crash anywhere before
the rename leaves a temporary directory (never listed; the next writer removes it), a crash
after it a verifiable step. There is no window in which a step restores unverified.

A step is *committed* when its directory is named by its number and holds the manifest
(`is_committed`). A numbered directory without one -- an interrupted `ckpt import` or copy, a
crash of a zerojax that wrote the manifest after the rename, a deleted file -- is
*uncommitted*: never listed as a step or restored as the latest, shown as such by
`zerojax ckpt inspect`. Orbax's own listing agrees (`ManifestedRename.validate_final`), so
`max_to_keep` neither counts nor keeps it, and a save of the same step replaces it.

    >>> options = manager_options(max_to_keep=3, create=True)
    >>> scan("runs/gpt")
    StepListing(committed=[100, 200], uncommitted=[300], partial=['400.orbax-checkpoint-tmp'])
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from zerojax.ckpt import layout
from zerojax.ckpt.errors import CheckpointCorruptedError
from zerojax.ckpt.manifest import has_manifest, write_manifest

__all__ = [
    "TMP_MARKER",
    "ManifestedRename",
    "StepListing",
    "check_items",
    "expected_items",
    "files_synced_at_commit",
    "is_committed",
    "manager_options",
    "remove_temporary",
    "scan",
]

log = logging.getLogger("zerojax")

TMP_MARKER = ".orbax-checkpoint-tmp"
"""In the name of a step directory Orbax has not renamed yet (a save in flight or cut short)."""

_STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's per-step JSON: item handlers, timestamps
_atomicity = ocp.path.atomicity


# --------------------------------------------------------------------------- the commit


def _stamp_commit_time(store: Any, tmp_dir: epath.Path) -> None:
    """What Orbax's own finalize does first: the step metadata gets its commit time."""
    from orbax.checkpoint._src.metadata import checkpoint as step_metadata

    store.wait_until_finished()
    store.update(
        file_path=step_metadata.step_metadata_file_path(tmp_dir),
        commit_timestamp_nsecs=time.time_ns(),
    )
    store.wait_until_finished()


def _mark_success(tmp_dir: epath.Path, final_dir: epath.Path) -> None:
    (tmp_dir / _atomicity.COMMIT_SUCCESS_FILE).write_text(
        f"Checkpoint commit was successful to {final_dir}"
    )


def _rename(tmp_dir: epath.Path, final_dir: epath.Path) -> None:
    tmp_dir.rename(final_dir)


class ManifestedRename(_atomicity.AtomicRenameTemporaryPath):
    """Orbax's atomic-rename commit with the manifest written just before the rename.

    `finalize` runs Orbax 0.12's steps (commit time into the step metadata, then
    `commit_success.txt`, then the rename), each a module-level function so that a test can
    stop the process at every point, with `write_manifest` over the finished temporary
    directory before the rename. It runs on the primary process only, after every process's
    writes are done (Orbax's barrier), so the manifest covers every shard.

    Orbax hands the same class to the items inside the step (their own temporary directories,
    renamed into the step's before it is finalized): an item -- a directory not named by a
    number -- is finalized and validated as Orbax does, without a manifest of its own."""

    @staticmethod
    def _is_step(final_path: epath.Path) -> bool:
        return final_path.name.isdigit()

    @classmethod
    async def validate_final(cls, final_path: epath.Path) -> None:
        # How Orbax's manager decides that a directory is a step (listing, latest,
        # max_to_keep): named by its number, and, here, with its manifest.
        await super().validate_final(final_path)
        if cls._is_step(final_path) and not await asyncio.to_thread(has_manifest, final_path):
            raise _atomicity.ValidationError(
                f"{final_path} has no {layout.MANIFEST}: not a committed zerojax step"
            )

    async def finalize(self, *args: Any, **kwargs: Any) -> None:
        if getattr(self, "_snapshot", None) is not None:  # never configured by zerojax
            raise NotImplementedError("ManifestedRename does not finalize Orbax snapshots")
        tmp_dir, final_dir = self.get(), self.get_final()
        if not self._is_step(final_dir):
            await super().finalize(*args, **kwargs)
            return
        store = getattr(self, "_checkpoint_metadata_store", None)
        if store is not None:
            await asyncio.to_thread(_stamp_commit_time, store, tmp_dir)
        await asyncio.to_thread(_mark_success, tmp_dir, final_dir)
        await asyncio.to_thread(write_manifest, tmp_dir)
        log.debug("zerojax: committing %s as %s", tmp_dir, final_dir)
        await asyncio.to_thread(_rename, tmp_dir, final_dir)


_sync_at_commit = threading.local()


def _install_sync_at_commit() -> bool:
    """Wrap Orbax's TensorStore context factory (0.12: `tensorstore_utils.get_ts_context`,
    called once per item when a save starts) so that, on a thread inside
    `files_synced_at_commit`, the context turns TensorStore's `file_io_sync` off. Returns
    whether it is installed (another Orbax without that function: never, and every save keeps
    TensorStore's fsyncs)."""
    try:
        import tensorstore as ts
        from orbax.checkpoint._src.serialization import tensorstore_utils
    except ImportError:
        return False
    original = getattr(tensorstore_utils, "get_ts_context", None)
    if original is None:
        return False
    if getattr(original, "_zerojax_sync_at_commit", False):
        return True

    def get_ts_context(*args: Any, **kwargs: Any) -> Any:
        context = original(*args, **kwargs)
        if getattr(_sync_at_commit, "active", False):
            context = ts.Context(ts.Context.Spec({"file_io_sync": False}), parent=context)
        return context

    get_ts_context._zerojax_sync_at_commit = True  # type: ignore[attr-defined]
    tensorstore_utils.get_ts_context = get_ts_context
    return True


@contextlib.contextmanager
def files_synced_at_commit():
    """Orbax saves started inside this block, on this thread, write their files without
    TensorStore's fsync after each write; the commit's manifest pass (`write_manifest`)
    flushes every file of the step to the disk after hashing it, before the manifest and the
    rename. The guarantee is the same -- every byte of a committed step is on the disk before
    its directory is renamed -- but the disk writes are no longer waited for one write at a
    time, inside TensorStore's write path: a save of the bench state took 1,659 ms (median of
    7) with TensorStore's fsyncs and 1,057 ms with the flush at the commit, interleaved, on the
    shared 2-core host (BENCHMARKS.md). Other threads (Orbax's merge of the per-process
    b-trees writes a few small files on its own thread), and Orbax saves outside the
    Checkpointer, keep TensorStore's default.

    Only where one process writes the whole step: with several, process 0 writes the manifest
    over files other processes wrote, and on a network file system its fdatasync would not
    flush another host's writes."""
    if not _install_sync_at_commit():
        yield
        return
    previous = getattr(_sync_at_commit, "active", False)
    _sync_at_commit.active = True
    try:
        yield
    finally:
        _sync_at_commit.active = previous


def manager_options(**kwargs: Any) -> ocp.CheckpointManagerOptions:
    """`CheckpointManagerOptions(**kwargs)` whose steps commit with their manifest and whose
    listing holds committed steps only; the Checkpointer's manager uses these.

    The step's directories are created before its items are written, not beside them
    (`create_directories_asynchronously=False`): with Orbax's default, a directory that cannot
    be created (a read-only checkpoint directory) failed the save but left the items' threads
    waiting for the directory's signal -- non-daemon threads, for Orbax's 600 s timeout, so
    the interpreter hung at exit. The Checkpointer runs Orbax's save on its own thread
    anyway: the few mkdirs cost the training loop nothing."""
    kwargs.setdefault("async_options", ocp.AsyncOptions(create_directories_asynchronously=False))
    return ocp.CheckpointManagerOptions(temporary_path_class=ManifestedRename, **kwargs)


# --------------------------------------------------------------------------- listing


@dataclasses.dataclass(frozen=True, slots=True)
class StepListing:
    """What a checkpoint directory holds, by name; nothing is read but the listing."""

    committed: list[int]
    """Steps with their manifest, ascending: the only ones restore and export read."""
    uncommitted: list[int]
    """Numbered directories without a manifest (or numbered files), ascending (see the module
    docstring)."""
    partial: list[str]
    """Names of temporary directories of saves that never committed (in flight, or cut
    short: the next writer removes them)."""


def is_committed(step_dir: str | os.PathLike) -> bool:
    """Whether `step_dir` is a committed step: a directory holding its manifest."""
    return os.path.isdir(step_dir) and has_manifest(step_dir)


def scan(directory: str | os.PathLike) -> StepListing:
    """The committed and uncommitted steps and partial saves of a checkpoint directory
    (empty when it does not exist)."""
    committed, uncommitted, partial = [], [], []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for entry in entries:
        if entry.name.isdigit():
            # A file where a step's directory should be is damage too: named, never read.
            ok = entry.is_dir() and has_manifest(entry.path)
            (committed if ok else uncommitted).append(int(entry.name))
        elif TMP_MARKER in entry.name and entry.is_dir():
            partial.append(entry.name)
    return StepListing(sorted(committed), sorted(uncommitted), sorted(partial))


def _remove_once(directory: str | os.PathLike, prefix: str) -> tuple[list[str], bool]:
    """(names removed, whether any is left) for one pass over `directory`."""
    removed, left = [], False
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return removed, left
    for name in names:
        if TMP_MARKER not in name or not name.startswith(prefix):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
        if os.path.lexists(path):
            left = True
        else:
            removed.append(name)
    return removed, left


def remove_temporary(
    directory: str | os.PathLike, step: int | None = None, *, settle_s: float = 0.0
) -> list[str]:
    """Remove the temporary directories of saves that did not commit (of `step` only, or
    all); returns their names. Only a writer calls this: a read never deletes.

    With `settle_s`, right after a failed save: Orbax abandons the tensorstore writes still in
    flight when one fails (it closes their event loop), and those may still create files in
    the directory for a moment; it is removed again until it stays gone for 0.1 s, for at
    most `settle_s` seconds."""
    prefix = f"{step}{TMP_MARKER}" if step is not None else ""
    removed, left = _remove_once(directory, prefix)
    deadline = time.monotonic() + settle_s
    quiet_since = None if left else time.monotonic()
    while time.monotonic() < deadline:
        if quiet_since is not None and time.monotonic() - quiet_since >= 0.1:
            break
        time.sleep(0.02)
        again, left = _remove_once(directory, prefix)
        removed += [name for name in again if name not in removed]
        if again or left:
            quiet_since = None if left else time.monotonic()
        elif quiet_since is None:
            quiet_since = time.monotonic()
    return removed


# --------------------------------------------------------------------------- items


def expected_items(step_dir: str | os.PathLike, meta: Mapping) -> list[str]:
    """The items the step says it holds: `meta["items"]` (written since zerojax records it),
    else the item handlers in Orbax's step metadata (every Orbax save records the items it
    wrote), else the two every zerojax step has."""
    items = meta.get("items")
    if isinstance(items, list) and all(isinstance(i, str) for i in items):
        return list(items)
    try:
        with open(os.path.join(step_dir, _STEP_METADATA)) as f:
            handlers = json.load(f)["item_handlers"]
        if isinstance(handlers, Mapping) and handlers:
            return sorted(handlers)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return [layout.MODEL, layout.META]


def check_items(step_dir: str | os.PathLike, meta: Mapping) -> list[str]:
    """Raise CheckpointCorruptedError naming the step, the item and its path when an item the
    step says it holds is missing (a copy cut short: restoring would silently leave the
    optimizer moments, step counters or RNG as they are). Returns the items."""
    items = expected_items(step_dir, meta)
    for item in items:
        path = os.path.join(step_dir, item)
        if not os.path.isdir(path):
            raise CheckpointCorruptedError(
                f"checkpoint step {os.path.basename(os.fspath(step_dir))} ({step_dir}): item "
                f"{item!r} is missing ({path}), although the step's metadata says it was "
                f"saved (items {', '.join(items)}); the step was damaged or copied in part",
                path=path,
            )
    return items
