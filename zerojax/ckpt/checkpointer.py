"""Save and restore the full training state of a wrapped model, onto any mesh.

    >>> model, optimizer = zerojax.initialize(model, optimizer, config="zero3.yaml")
    >>> ckpt = Checkpointer("runs/gpt", model, optimizer, scheduler=scheduler)
    >>> start = ckpt.restore().step + 1 if ckpt.latest_step() is not None else 0
    >>> for step in range(start, num_steps):
    ...     train_one_step()
    ...     ckpt.save(step, extra={"epoch": epoch})   # every save_interval_steps, in the background
    >>> ckpt.close()                                     # waits for the last save

What a step holds (`zerojax.ckpt.layout`): weights (fp32 master weights when the precision
policy keeps them) and buffers under torch state_dict names, the optimizer state, the torch
optimizer's param-group hyperparameters, the LR scheduler's state_dict, the fp16 loss scale,
the dropout RNG key and call count, torch's RNG state, the config of the saving run and the
user's `extra` dict. Zero-size arrays are not stored (Orbax refuses them): their shapes are
in `meta` and in the current model, and restoring recreates them. Restoring reads every
array straight into the *current* engine's shardings and dtypes, so a run saved on 8-way
ZeRO-3 resumes on a 4x2 data x fsdp ZeRO-1 mesh, or in bf16 with fp32 master weights; with
the same config it resumes bit for bit.

Concurrency contract:

- One writer per directory: one `Checkpointer` (one per process on multi-host, all calling
  `save` with the same steps) saves into a directory at a time. Its first `save` deletes
  temporary step directories left by a writer that died (`<step>.orbax-checkpoint-tmp*`), a
  failed save its own, and a save replaces an uncommitted directory of its step (numbered,
  without a manifest: `zerojax.ckpt.commit`); a Checkpointer that only restores never deletes
  anything.
- `save` is asynchronous by default. In a single process it only reads the state's arrays
  and hands them to the Checkpointer's thread, which enqueues a snapshot of them
  (`zerojax.ckpt.snapshot`: copies made on the devices, or into pinned host memory, that no
  donation can reach) and then writes it. Training goes on at once; the next optimizer
  update, the one program that donates those arrays, first waits until the snapshot is
  enqueued (`Engine.before_next_update`; usually long done, else the wait counts as
  checkpoint blocking time), after which the runtime orders its in-place writes after the
  snapshot's reads. The snapshot is one copy of the saved state, freed once the write has
  committed. With several processes `save` enqueues the snapshot itself (a program over every
  process's devices stays on the thread that enqueues the training steps) and the thread runs
  Orbax's save, whose barriers then wait on the JAX distributed client instead of running
  device collectives (`_use_distributed_barriers`: collectives enqueued by two threads can
  deadlock across processes). The files are written by a background thread; a step directory
  appears under its final name only when every item is committed (Orbax renames it), so a
  crash mid-save leaves the previous steps intact and the partial one invisible. The manifest
  (sizes and checksums) is written inside the temporary directory just before that rename
  (`zerojax.ckpt.commit`): a step never appears without it.
- `save` waits for the previous save to finish before starting another; `wait`, `restore`,
  `close` and leaving a `with` block wait too, and each raises CheckpointSaveError (naming the
  step and its directory) when that save failed; the interpreter's exit waits for a save still
  in flight, and a failed one makes the process exit with status 1 (`zerojax.ckpt.at_exit`).
  Orbax's own tracebacks of a failed save go to the `zerojax.orbax` logger at DEBUG
  (`zerojax.ckpt.quiet_orbax`): the user sees the one error. Call a Checkpointer from one thread.
- Readers (another process restoring or `zerojax ckpt inspect`) may run while a writer
  saves: they only ever see committed steps. A step deleted by `max_to_keep` while being read
  fails with CheckpointCorruptedError.
- `restore` checks every file against the manifest -- the arrays' data files as it reads
  them, once (one process: `zerojax.ckpt.direct_read`), the rest on a helper thread meanwhile
  -- and every item the step says it holds (a missing `optimizer/` would otherwise leave the
  moments as they are), and writes nothing into the model, optimizer or scheduler until all
  of it is done: a damaged file raises CheckpointCorruptedError (naming it) and leaves the
  current state untouched. `restore()` of the latest step takes the newest step that
  verifies, and names every newer step it skipped (damaged, or uncommitted) in a
  CheckpointWarning; it never deletes them. A step asked for by number that does not verify
  raises.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import threading
import warnings
from collections.abc import Mapping
from typing import Any, Self

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zerojax.ckpt import at_exit, commit, direct_read, layout, priority, quiet_orbax
from zerojax.ckpt import training_state as ts
from zerojax.ckpt.direct_read import DirectRead
from zerojax.ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointWarning,
)
from zerojax.ckpt.manifest import read_manifest, verify_manifest
from zerojax.ckpt.snapshot import Method, snapshot
from zerojax.runtime import gc_pause
from zerojax.runtime.effective_time import LEDGER

__all__ = ["Checkpointer", "RestoredState", "restore_checkpoint", "save_checkpoint"]

log = logging.getLogger("zerojax")

_UNSET: Any = object()
_ORBAX_TREE_METADATA = "_METADATA"  # an Orbax PyTree item's tree of leaf names (JSON)
_ORBAX_JSON_ITEM = "metadata"  # the file of an Orbax JSON item (JsonCheckpointHandler)

_HOST_READ = True
"""Single process: read arrays whole to host, then device_put (see `_read_arrays`). Tests turn
it off to run the multi-process path (Orbax reading each shard) on one process."""
_HOST_BATCH_BYTES = 1 << 30
"""Host memory one restore batch may take: arrays are read and placed this many bytes at a
time."""


class _Background:
    """`fn(*args)` on a daemon thread; `raise_error` joins it and re-raises what it raised."""

    def __init__(self, name: str, fn, *args) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised by raise_error
                self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def raise_error(self, cause: BaseException | None = None) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error from cause


def _pieces(tree: Any, prefix: tuple = ()):
    """(dict-key path, subtree) pieces of `tree`, descending through dicts only: any subset of
    them, nested back into dicts, is a valid Orbax partial-restore target."""
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from _pieces(value, (*prefix, key))
    else:
        yield prefix, tree


def _nest(pieces) -> dict:
    root: dict = {}
    for path, value in pieces:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return root


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _on_default_device(abstract: Any) -> Any:
    """`abstract` with every leaf that has no sharding placed on the default device (the
    direct read places what it reads: the train_state's rng key data, which Orbax hands back
    as a host array and `ts.apply_train_state` puts there)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda s: (
            s
            if getattr(s, "sharding", None) is not None
            else jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device)
        ),
        abstract,
    )


def _all_read(read: Mapping | None, abstract: Any) -> bool:
    """Whether the direct read took every piece of `abstract` (`_read_direct`'s answer)."""
    return read is not None and all(path in read for path, _ in _pieces(abstract))


def _keys(path: tuple):
    return (jax.tree_util.DictKey(k) for k in path)


def _is_one_count_per_group(
    item: str, path: tuple, where: tuple, value: np.ndarray, struct: Any
) -> bool:
    """Whether `value` is a param group's step count as zerojax saved it before counts were
    kept per parameter: a scalar where the optimizer state now holds a vector."""
    first = path[0] if path else getattr(where[0], "key", None) if where else None
    return (
        item == layout.OPTIMIZER
        and first == "step"
        and value.shape == ()
        and len(struct.shape) == 1
    )


@dataclasses.dataclass(frozen=True, slots=True)
class RestoredState:
    """What `restore` hands back besides the state it wrote into the model and optimizer."""

    step: int
    """The step restored."""
    extra: dict
    """The `extra` dict given to `save` ({} if none)."""
    config_at_save: dict | None
    """`dataclasses.asdict(config)` of the run that saved (None for an imported checkpoint)."""


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    # No zstd: fp32 weights and moments shrink by ~7% only, and compressing/decompressing
    # them took ~1 s of a 3 s background save and ~0.4 s of a 1 s restore (409 MB state).
    # Compressed checkpoints (older ones, `ckpt import`) still restore: each array's
    # metadata names its codec.
    tree = lambda: ocp.PyTreeCheckpointHandler(use_compression=False)
    return {
        layout.MODEL: tree(),
        layout.OPTIMIZER: tree(),
        layout.TRAIN_STATE: tree(),
        layout.META: ocp.JsonCheckpointHandler(),
    }


def _save_args(items: dict, meta: dict) -> ocp.args.Composite:
    args = {name: ocp.args.PyTreeSave(tree) for name, tree in items.items()}
    args[layout.META] = ocp.args.JsonSave(meta)
    return ocp.args.Composite(**args)


_DISTRIBUTED_BARRIER_FLAG = "experimental_orbax_use_distributed_barrier"


def _use_distributed_barriers() -> bool:
    """Make Orbax synchronise processes through the JAX distributed client's key-value
    barriers; returns whether it now does (the multi-process save may then leave the calling
    thread).

    Why: a device collective enqueued by a background thread while the main thread enqueues
    training steps (collectives across processes too) can be enqueued in different orders on
    different processes, and they deadlock. What `CheckpointManager` does with several
    processes (Orbax 0.12.8, read in its source): every barrier -- creating the directory, save
    start and end, the commit's rename, deleting old steps, `reload` -- goes through
    `multihost.sync_global_processes`, which runs `multihost_utils.sync_global_devices` (a
    device collective) unless this absl flag is set, and then waits at a barrier of the
    distributed client, no device work. Listing steps broadcasts from process 0
    (`broadcast_one_to_all`, a collective) only with `single_host_load_and_broadcast`, which
    the Checkpointer never sets. The rest of a save is per-device: copies of each process's
    own shards to host and TensorStore writes. Orbax's own commit thread already uses the
    distributed client's barriers. tests/distributed/test_checkpoints.py checks that no
    collective runs off the main thread.

    The flag is process-wide (every Orbax barrier of the process then uses the client, which
    has a timeout where a collective had none) and set here before any barrier of the
    Checkpointer's manager. absl refuses to read a flag before it parses the command line,
    and Orbax then silently falls back to collectives: the flag is marked present. Every
    process runs this same code, so all choose the same barriers."""
    from absl import flags

    holder = flags.FLAGS
    if _DISTRIBUTED_BARRIER_FLAG not in holder:
        return False  # another Orbax: keep the save on the calling thread
    flag = holder[_DISTRIBUTED_BARRIER_FLAG]
    if flag.value is not True:
        flag.value = True
        log.info("zerojax: Orbax barriers of this multi-process job use the distributed client")
    if not holder.is_parsed():
        flag.present = max(flag.present, 1)
    try:
        return getattr(holder, _DISTRIBUTED_BARRIER_FLAG) is True
    except flags.Error:
        return False


_WHOLE_BELOW_BYTES = 256 << 10
"""A snapshot array smaller than this is written as one host array, one chunk (see
`_small_arrays_whole`)."""


def _small_arrays_whole(items: dict) -> dict:
    """`items` with every jax.Array under `_WHOLE_BELOW_BYTES` replaced by its host value.

    Orbax writes a sharded jax.Array as one chunk per shard, and each chunk costs TensorStore
    and OCDBT about as much as a large one: the bench GPT-2's biases and norm weights (249 of
    375 arrays, 1% of the bytes) were 2,000 of its 2,978 chunks, and writing them whole took an
    Orbax save of the same state from 2.3 s to 1.2 s (BENCHMARKS.md). The stored array is the
    same zarr array either way (Orbax records it as a numpy array), restored onto any sharding.
    Only the snapshot's arrays come here: nothing donates them, and reading them to host waits
    for the snapshot's copy, on the writer thread."""

    def whole(leaf: Any) -> Any:
        if (
            isinstance(leaf, jax.Array)
            and leaf.nbytes < _WHOLE_BELOW_BYTES
            and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)
            and leaf.is_fully_addressable
        ):
            return np.asarray(leaf)
        return leaf

    return jax.tree.map(whole, items)


def _await_snapshot(enqueued: threading.Event, step: int) -> None:
    """Before an update donates the state: the snapshot of save(step) must be enqueued."""
    if not enqueued.is_set():
        with LEDGER.measure("checkpoint_blocking", step=step, waiting_for="snapshot"):
            enqueued.wait()


class Checkpointer:
    """Periodic, asynchronous checkpoints of one wrapped model (+ optimizer, LR scheduler).

    >>> with Checkpointer("runs/gpt", model, optimizer, scheduler=sched, max_to_keep=2) as ckpt:
    ...     ckpt.save(100, extra={"data_position": 12800})
    ...     state = ckpt.restore()            # latest complete step
    ...     state.step, state.extra["data_position"]
    (100, 12800)

    `model` and `optimizer` are what `zerojax.initialize` returned. `directory`,
    `max_to_keep` (None keeps all), `async_save` and `save_interval_steps` (0: save whenever
    `save` is called) default to the model's `config.checkpoint`. Without a model the
    Checkpointer can only list steps.

    Concurrency (in full in the module docstring): one writing Checkpointer per directory,
    called from one thread. `save` returns at once and snapshots and writes the state in the
    background (the next optimizer update waits until the snapshot is enqueued; with several
    processes `save` enqueues it); the next `save`, `wait`, `restore`, `close` or the end of a
    `with` block waits for it. A step appears only once committed, so readers in other
    processes and a crash mid-save never see a partial step.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        model: Any = None,
        optimizer: Any = None,
        *,
        scheduler: Any = None,
        max_to_keep: int | None = _UNSET,
        async_save: bool = _UNSET,
        save_interval_steps: int = _UNSET,
    ) -> None:
        self._engine = ts.engine_of(model) if model is not None else None
        self._optimizer = (
            ts.torch_optimizer_of(optimizer, self._engine) if optimizer is not None else None
        )
        self._scheduler = scheduler
        defaults = self._engine.config.checkpoint if self._engine is not None else None
        if directory is None:
            directory = defaults.directory if defaults is not None else None
        if directory is None:
            raise ValueError(
                "Checkpointer: no directory; pass one (Checkpointer('runs/x', model, ...)) or "
                "set checkpoint.directory in the zerojax config"
            )
        self.directory = os.path.abspath(os.fspath(directory))

        def pick(given: Any, field: str, fallback: Any) -> Any:
            return given if given is not _UNSET else getattr(defaults, field, fallback)

        self.max_to_keep = pick(max_to_keep, "max_to_keep", 3)
        self.async_save = bool(pick(async_save, "async_save", True))
        self.save_interval_steps = int(pick(save_interval_steps, "save_interval_steps", 0))
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"Checkpointer: max_to_keep={self.max_to_keep}; use >= 1 or None")
        if self.save_interval_steps < 0:
            raise ValueError(
                f"Checkpointer: save_interval_steps={self.save_interval_steps}; use >= 0 "
                f"(0 saves whenever save() is called)"
            )
        self._manager: ocp.CheckpointManager | None = None
        self._cleaned = False
        # The in-flight async save (snapshot, Orbax's save, the manifest and the commit) of
        # step `_pending_step`, on one thread kept for the Checkpointer's life: starting a
        # thread per save cost the loop 5-20 ms (Thread.start waits until the new thread runs;
        # longer under load).
        self._pending: concurrent.futures.Future | None = None
        self._pending_step: int | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # The single-process background write runs on a second thread at background priority
        # (`zerojax.ckpt.priority`): a thread's priority cannot be raised back, and the next
        # save's snapshot, on `_executor`'s thread, is what the next update may wait for.
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        # Where the snapshot of a single-process save lives (`zerojax.ckpt.snapshot`); tests
        # force each method.
        self._snapshot_method: Method = "auto"
        # Orbax's manager is not thread-safe: its save (on the background thread) and the
        # reload of `all_steps` (no barrier: each process lists the directory) take turns.
        self._orbax_lock = threading.Lock()
        quiet_orbax.install()  # a failed save is one CheckpointSaveError, not pages

    # --- Orbax ------------------------------------------------------------------------------

    def _mgr(self) -> ocp.CheckpointManager:
        if self._manager is None:
            options = commit.manager_options(
                max_to_keep=self.max_to_keep,
                enable_async_checkpointing=self.async_save,
                # The interval is ours (save() decides); Orbax saves whatever it is given.
                save_interval_steps=1,
                create=True,
            )
            self._manager = ocp.CheckpointManager(
                self.directory, item_handlers=_handlers(), options=options
            )
        return self._manager

    def step_dir(self, step: int) -> str:
        """The directory of one committed step."""
        return os.path.join(self.directory, str(step))

    # --- listing ----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Every committed step in the directory, ascending. Partial saves and uncommitted
        step directories (no manifest: `zerojax.ckpt.commit`) are not listed, nor is a save
        still in flight until it commits (`wait()` first to include it). Reads the directory
        listing only (each process its own, no barrier)."""
        return commit.scan(self.directory).committed

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # --- saving -----------------------------------------------------------------------------

    def save(self, step: int, *, extra: dict | None = None, force: bool = False) -> bool:
        """Save the training state as `step`; returns whether it saved.

        Skipped (False) unless `force` or `step` is a multiple of `save_interval_steps` (0:
        always saves). Asynchronous by default: returns at once; a snapshot of the arrays is
        enqueued (on the Checkpointer's thread in a single process: the next optimizer update
        waits until it is; by this call with several processes) and written in the background
        (see the module's concurrency contract).
        `extra` is any JSON-serialisable dict, handed back by `restore`.

        >>> ckpt.save(step, extra={"epoch": 3, "data_rng": generator.get_state()})
        """
        engine = self._require_model("save")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Checkpointer.save: step={step!r}; use an int >= 0")
        if not force and self.save_interval_steps and step % self.save_interval_steps:
            return False
        meta = ts.build_meta(engine, self._optimizer, self._scheduler, step=step, extra=extra)
        # What the training loop waits for: the previous save's commit (if still running), the
        # state's arrays gathered, with several processes the snapshot's dispatch too.
        with LEDGER.measure("checkpoint_blocking", step=step):
            self._save(engine, step, meta)
        return True

    def _save(self, engine, step: int, meta: dict) -> None:
        self._finish_pending()
        # One stat or two: all_steps() would list every step on the training loop's time.
        step_dir = self.step_dir(step)
        if commit.is_committed(step_dir):
            raise CheckpointError(
                f"step {step} already exists at {step_dir}; save under a new step number or "
                f"delete that directory first"
            )
        if not self._cleaned:
            self._clean_partial_saves()
        items = ts.gather_items(engine, with_optimizer=self._optimizer is not None)
        # What restore checks is there (`commit.check_items`).
        meta = {**meta, "items": sorted([*items, layout.META])}
        try:
            if os.path.isdir(step_dir) and jax.process_index() == 0:
                # Numbered, no manifest: never a step (an interrupted copy or import, or a
                # crash of an older zerojax between its commit and its manifest); this save
                # replaces it.
                log.warning("zerojax: replacing uncommitted step directory %s", step_dir)
                shutil.rmtree(step_dir)
            self._dispatch(engine, step, items, meta)
        except Exception as error:  # noqa: BLE001 - Orbax's, tensorstore's, the OS's: ours
            if failure := self._save_failed(step, error):
                raise failure from None

    def _dispatch(self, engine, step: int, items: dict, meta: dict) -> None:
        """Orbax's save of `items`: in the background (`_pending`) or, synchronously, here."""
        # Set before the manager exists: its creation synchronises the processes too.
        background = self.async_save and (jax.process_count() == 1 or _use_distributed_barriers())
        manager = self._mgr()
        if background and jax.process_count() > 1:
            # Several processes: the snapshot is a program over every process's devices, so it
            # is enqueued here, on the thread that enqueues the training steps, in the same
            # order on every process (no device program of several processes is ever enqueued
            # by a background thread). It precedes the next update, which needs no wait. The
            # reload, Orbax's save and its commit then run on the worker: with distributed
            # barriers they issue no device work but per-device copies to host
            # (`_use_distributed_barriers`).
            items = snapshot(items, method=self._snapshot_method)
            self._set_pending(
                step, self._worker().submit(self._write, manager, step, _save_args(items, meta))
            )
            return
        if background:
            # Even enqueueing the snapshot (~3,000 shard buffers: 20-50 ms of dispatch) runs
            # on the worker, and the next update waits for it, not this call.
            enqueued = threading.Event()
            self._set_pending(
                step,
                self._worker().submit(
                    self._snapshot_and_write, manager, step, items, meta, enqueued
                ),
            )
            engine.before_next_update(functools.partial(_await_snapshot, enqueued, step))
            return
        args = _save_args(items, meta)
        if self.async_save:
            # Several processes without distributed barriers: Orbax's save synchronises the
            # processes with device collectives, so it stays on the calling thread, in the same
            # order on every process; it copies each process's shards to host before returning
            # (on CPU devices a zero-copy view, which the runtime then declines to donate).
            self._start_write(manager, step, args)
            self._set_pending(step, self._worker().submit(self._commit, manager, step))
        else:
            self._write(manager, step, args)

    def _set_pending(self, step: int, future: concurrent.futures.Future) -> None:
        self._pending, self._pending_step = future, step
        at_exit.track(self)  # not lost if the script ends without wait() or close()

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="zerojax-save"
            )
        return self._executor

    def _snapshot_and_write(
        self, manager: ocp.CheckpointManager, step: int, items: dict, meta: dict, enqueued
    ) -> None:
        # Python's cyclic GC is paused from the snapshot to the commit. A save builds tens of
        # thousands of Python objects (Orbax's per-array handlers, args, futures, TensorStore
        # specs) that live until its commit; with the collector on, the collections meanwhile
        # promote them to the oldest generation, and every few saves that growth starts a full
        # collection of the whole process (650k objects for the bench GPT-2: 0.4-1.0 s at
        # load 4, holding the GIL, so the training thread stops too; 2 in 6 saves, none
        # paused: BENCHMARKS.md). Paused, they die by reference count at the commit. A slow
        # write keeps the collector off that long, as a program's trace does.
        with gc_pause.collection_paused():
            try:
                items = snapshot(items, method=self._snapshot_method)
            finally:
                # From here the update may donate the arrays: the snapshot's reads come first
                # (or, if it failed, this save fails and training goes on).
                enqueued.set()
            # Orbax's whole save (its per-shard copies to host: ~3,000 for the bench's state,
            # directories, metadata, thread starts) runs off the loop's time, on the writer
            # thread at background priority, so the training steps meanwhile get the cores
            # first.
            if self._writer is None:
                self._writer = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="zerojax-write", initializer=priority.lower_this_thread
                )
            args = _save_args(_small_arrays_whole(items), meta)
            self._writer.submit(self._background_write, manager, step, args).result()

    def _background_write(
        self, manager: ocp.CheckpointManager, step: int, args: ocp.args.Composite
    ) -> None:
        with priority.tensorstore_threads_lowered():  # its pool does the copies and writes
            self._write(manager, step, args)

    def _write(self, manager: ocp.CheckpointManager, step: int, args: ocp.args.Composite) -> None:
        self._start_write(manager, step, args)
        self._commit(manager, step)

    def _start_write(
        self, manager: ocp.CheckpointManager, step: int, args: ocp.args.Composite
    ) -> None:
        # One process writes every file of the step: TensorStore need not fsync each write,
        # the commit's manifest pass flushes every file before the rename.
        one_writer = commit.files_synced_at_commit() if jax.process_count() == 1 else None
        with self._orbax_lock, one_writer or contextlib.nullcontext():
            manager.reload()  # steps another process added, or someone deleted, since
            manager.save(step, args=args, force=True)

    def _commit(self, manager: ocp.CheckpointManager, step: int) -> None:
        # The manifest is written inside the temporary directory before Orbax's rename
        # (`commit.ManifestedRename`): once this returns, step `step` is there with it.
        manager.wait_until_finished()

    def _finish_pending(self) -> None:
        """Wait for the in-flight save; raise CheckpointSaveError if it failed."""
        pending, step = self._pending, self._pending_step
        if pending is None:
            return
        try:
            pending.result()
        except BaseException as error:
            if not pending.done():  # interrupted while waiting (Ctrl-C): still pending, tracked
                raise
            self._pending = self._pending_step = None
            at_exit.untrack(self)
            assert step is not None  # set together with `pending`
            if failure := self._save_failed(step, error):
                raise failure from None
            return
        self._pending = self._pending_step = None
        at_exit.untrack(self)

    def _save_failed(self, step: int, error: BaseException) -> CheckpointSaveError | None:
        """After a save of `step` failed: drop Orbax's manager (its threads and its view of
        the failed save; the next save opens a new one), remove the step's temporary
        directory (a full disk gets its space back), and name the step and the cause.

        None when the step did commit and what failed came after it (Orbax removing steps
        beyond `max_to_keep`, one of them read-only, say): the checkpoint is there, so that is
        a CheckpointWarning naming the steps kept, not an error."""
        log.debug("zerojax: checkpoint save of step %d failed", step, exc_info=error)
        manager, self._manager = self._manager, None
        if manager is not None:
            try:
                with self._orbax_lock:
                    manager.close()  # re-raises the failed save: already being reported
            except Exception:
                log.debug("zerojax: closing Orbax's manager after the failed save", exc_info=True)
        removed = []
        if jax.process_index() == 0:
            removed = commit.remove_temporary(self.directory, step, settle_s=3.0)
        self._cleaned = False  # the next save removes whatever a straggling write left
        step_dir = self.step_dir(step)
        if isinstance(error, CheckpointError):
            reason = str(error)
        else:
            lines = str(error).strip().splitlines()
            reason = f"{type(error).__name__}: {lines[0][:500] if lines else ''}"
        if commit.is_committed(step_dir):
            warnings.warn(
                f"checkpoint step {step} was saved to {step_dir}, but removing older steps "
                f"(max_to_keep={self.max_to_keep}) failed: {reason}; {self.directory} now "
                f"holds steps {self.all_steps()}",
                CheckpointWarning,
                stacklevel=5,
            )
            return None
        latest = self.latest_step()
        cleaned = f"; removed its partial directory {removed[0]}" if removed else ""
        return CheckpointSaveError(
            f"checkpoint step {step} was not saved to {step_dir}: {reason}{cleaned}; the "
            f"latest committed step is {latest if latest is not None else 'none'}",
            step=step,
            path=step_dir,
        )

    def _clean_partial_saves(self) -> None:
        """Remove step directories a dead writer left half-written (never listed as steps)."""
        self._cleaned = True
        # Several processes share the directory: only process 0 cleans, before it creates this
        # step's temporary directory (another process cleaning later would delete that).
        if jax.process_index() != 0:
            return
        for name in commit.remove_temporary(self.directory):
            log.warning("zerojax: removed partial checkpoint %s", name)

    def wait(self) -> None:
        """Block until the last save is committed (with its manifest); raise
        CheckpointSaveError if it failed."""
        if self._pending is None:
            return
        with LEDGER.measure("checkpoint_blocking"):
            self._finish_pending()

    def close(self) -> None:
        """Wait for the last save, then release Orbax's manager and the save thread (always,
        even when the save failed); raise CheckpointSaveError if it failed."""
        error: BaseException | None = None
        try:
            self._finish_pending()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the release
            error = e
        if self._pending is None:  # else interrupted: the exit still waits for it and reports
            at_exit.untrack(self)
        manager, self._manager = self._manager, None
        if manager is not None:
            try:
                manager.close()
            except Exception as e:
                log.debug("zerojax: closing Orbax's manager failed", exc_info=True)
                if error is None:
                    error = CheckpointError(
                        f"closing the checkpoint manager of {self.directory} failed: "
                        f"{type(e).__name__}: {e}"
                    )
                    error.__cause__ = e
        for executor in (self._executor, self._writer):
            if executor is not None:
                executor.shutdown()
        self._executor = self._writer = None
        if error is not None:
            raise error

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- restoring --------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, load_optimizer: bool = True) -> RestoredState:
        """Load a step (default: the latest committed one) into the model, optimizer and
        scheduler given at construction, on the *current* mesh, ZeRO stage and precision.

        Every file is checked against the step's manifest, and every item the step says it
        holds must be there. Without `step`, the newest step that verifies is restored: a
        newer one that does not (damaged, or uncommitted: no manifest) is named in a
        CheckpointWarning and left as it is, so a job that resumes from the latest step
        survives a damaged last checkpoint.

        Raises CheckpointNotFoundError (no such step), CheckpointMismatchError (parameters or
        optimizer state differ; every difference listed), CheckpointCorruptedError (a damaged
        or missing file or item, named; without `step`: no step verifies). `load_optimizer=
        False` loads weights, buffers and RNG only (fine-tuning with a different optimizer).
        A checkpoint made by `zerojax ckpt import` has weights only: the optimizer state
        stays as it is.

        >>> state = ckpt.restore()
        >>> start_step = state.step + 1
        """
        engine = self._require_model("restore")
        self.wait()
        with LEDGER.measure("checkpoint_restore", step=step):
            return self._restore(engine, step, load_optimizer)

    def _restore(self, engine, step: int | None, load_optimizer: bool) -> RestoredState:
        listing = commit.scan(self.directory)
        steps = listing.committed
        if step is not None:
            if step in listing.uncommitted:
                verify_manifest(self.step_dir(step))  # raises: it has none
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"step {step} not found in {self.directory}; available steps: {steps}"
                )
            return self._restore_step(engine, step, load_optimizer)
        if not steps:
            uncommitted = (
                f" (uncommitted step directories without a manifest: {listing.uncommitted})"
                if listing.uncommitted
                else ""
            )
            raise CheckpointNotFoundError(
                f"no complete checkpoint in {self.directory}{uncommitted}"
            )
        failed: list[tuple[int, CheckpointCorruptedError]] = []
        for candidate in reversed(steps):
            try:
                restored = self._restore_step(engine, candidate, load_optimizer)
            except CheckpointCorruptedError as error:
                failed.append((candidate, error))
                continue
            self._warn_skipped(candidate, failed, listing.uncommitted)
            return restored
        newest = failed[0][1]
        if len(failed) == 1:
            raise newest
        raise CheckpointCorruptedError(
            f"no step of {self.directory} verifies; each was tried, newest first:\n"
            + "\n".join(f"  step {s}: {e}" for s, e in failed),
            path=newest.path,
        ) from newest

    def _warn_skipped(
        self,
        restored: int,
        failed: list[tuple[int, CheckpointCorruptedError]],
        uncommitted: list[int],
    ) -> None:
        """Name every step newer than `restored` that `restore()` did not take."""
        for step in sorted({s for s in uncommitted if s > restored} | {s for s, _ in failed}):
            if step in uncommitted:
                why = "is not committed (no manifest: a save or copy cut short, or damage)"
            else:
                why = f"does not verify ({dict(failed)[step]})"
            warnings.warn(
                f"checkpoint step {step} at {self.step_dir(step)} {why}; restored step "
                f"{restored} instead. Step {step} is left as it is.",
                CheckpointWarning,
                stacklevel=4,
            )

    def _restore_step(self, engine, step: int, load_optimizer: bool) -> RestoredState:
        step_dir = self.step_dir(step)
        # The arrays' data files are checked against the manifest as they are read, once
        # (`direct_read`); the checksum pass over every other file runs meanwhile on a helper
        # thread (zlib releases the GIL). Nothing read is written into the engine before both
        # pass, and when the pass fails its error (naming the damaged file) wins over whatever
        # the read raised.
        direct = self._plan_direct(step_dir, load_optimizer)
        skip = direct.skip if direct is not None else frozenset()
        check = _Background(
            "zerojax-verify", functools.partial(verify_manifest, step_dir, skip=skip)
        )
        try:
            apply = self._read_step(engine, step, step_dir, load_optimizer, direct)
            if direct is not None:
                direct.verify_unread()
        except BaseException as error:
            check.raise_error(cause=error)
            raise
        check.raise_error()
        return apply()

    def _plan_direct(self, step_dir: str, load_optimizer: bool) -> DirectRead | None:
        """Where the model's (and optimizer's) chunks lie in their files, for the direct read
        of one process (`zerojax.ckpt.direct_read`); None when it does not apply."""
        if not (_HOST_READ and jax.process_count() == 1):
            return None
        try:
            files = read_manifest(step_dir)
        except CheckpointCorruptedError:
            return None  # the manifest pass names the problem
        plans = {}
        wanted = (layout.MODEL, layout.OPTIMIZER) if load_optimizer else (layout.MODEL,)
        for item in (*wanted, layout.TRAIN_STATE):
            if not os.path.isdir(os.path.join(step_dir, item)):
                continue  # `commit.check_items` decides whether that is damage
            try:
                plans[item] = direct_read.plan_item(step_dir, item, files)
            except direct_read.Unsupported as why:
                log.debug("zerojax: %s/%s is read through Orbax: %s", step_dir, item, why)
        return DirectRead(step_dir, files, plans)

    def _read_step(
        self, engine, step: int, step_dir: str, load_optimizer: bool, direct: DirectRead | None
    ):
        """Check the step against the current model and read every array it holds; returns the
        function that writes them into the engine, optimizer and scheduler."""
        meta = self._read_meta(step, step_dir)
        ts.check_format(meta)
        # A missing item would otherwise restore as "not saved": the optimizer moments, the
        # step counters and the RNG left as they are, without a word.
        items = commit.check_items(step_dir, meta)

        differences = ts.parameter_differences(meta["parameters"], ts.parameter_table(engine))
        if differences:
            raise CheckpointMismatchError(
                f"checkpoint {step_dir} does not fit the current model "
                f"({len(differences)} difference{'s' * (len(differences) > 1)}):",
                differences,
            )
        with_optimizer = (
            load_optimizer
            and self._optimizer is not None
            and engine.state.opt_state is not None
            and layout.OPTIMIZER in items
        )
        optimizer = self._optimizer
        if with_optimizer:
            assert optimizer is not None  # with_optimizer says so
            self._check_optimizer(step_dir, optimizer, meta)

        model_abstract, _, source = ts.model_target(engine, meta["parameters"])
        abstracts = {layout.MODEL: model_abstract}
        if with_optimizer:
            abstracts[layout.OPTIMIZER] = ts.optimizer_target(engine, meta.get("optimizer"))[0]
        train_abstract = None
        if layout.TRAIN_STATE in items:
            saved = self._saved_paths(step_dir, layout.TRAIN_STATE)
            train_abstract, train_args = ts.train_state_target(
                engine, saved_loss_scale=any(p[:1] == ("loss_scale",) for p in saved)
            )
            if direct is not None and layout.TRAIN_STATE in direct.plans:
                abstracts[layout.TRAIN_STATE] = _on_default_device(train_abstract)
        # Every item's data files in one pass of the direct read: the largest files of either
        # item are read at once, on both cores (item after item, the optimizer's largest
        # file alone was the end of the restore).
        read = self._read_direct(direct, abstracts)
        model = self._read_arrays(
            step, layout.MODEL, model_abstract, "model", read.get(layout.MODEL, {})
        )
        opt_state = None
        if with_optimizer:
            opt_state = self._read_arrays(
                step,
                layout.OPTIMIZER,
                abstracts[layout.OPTIMIZER],
                "state",
                read.get(layout.OPTIMIZER, {}),
            )
        train_state = None
        if train_abstract is not None and _all_read(read.get(layout.TRAIN_STATE), train_abstract):
            train_state = _nest(read[layout.TRAIN_STATE].items())
            # As Orbax hands it back: a host array, put on the device uncommitted by
            # `ts.apply_train_state` (committed, every program taking it would be keyed anew).
            train_state["rng"] = np.asarray(train_state["rng"])
        elif train_abstract is not None:
            train_state = self._read(
                step,
                {
                    layout.TRAIN_STATE: ocp.args.PyTreeRestore(
                        train_abstract, restore_args=train_args, partial_restore=True
                    )
                },
            )[layout.TRAIN_STATE]

        def apply() -> RestoredState:
            state = ts.apply_model(engine.state, model, source)
            if with_optimizer:
                state = state.replace(opt_state=opt_state)
            if train_state is not None:
                state = ts.apply_train_state(state, train_state, meta["engine"])
            engine.load(state)
            if with_optimizer and optimizer is not None:
                ts.apply_param_groups(optimizer, meta["optimizer"])
                if self._scheduler is not None and meta.get("scheduler") is not None:
                    self._scheduler.load_state_dict(meta["scheduler"])
            if meta.get("torch_rng") is not None:
                import torch

                torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
            return RestoredState(
                step=step, extra=dict(meta.get("extra") or {}), config_at_save=meta.get("config")
            )

        return apply

    def _check_optimizer(self, step_dir: str, optimizer, meta: Mapping) -> None:
        saved = meta.get("optimizer") or {}
        current = type(optimizer).__name__
        hint = (
            "; pass load_optimizer=False to restore the weights only and start the optimizer "
            "state fresh"
        )
        if saved.get("type") not in (None, current):
            raise CheckpointMismatchError(
                f"checkpoint {step_dir} holds {saved.get('type')} state, the current optimizer "
                f"is {current}{hint}"
            )
        groups = len(saved.get("param_groups") or [])
        if groups != len(optimizer.param_groups):
            raise CheckpointMismatchError(
                f"checkpoint {step_dir} has {groups} param groups, the current optimizer "
                f"{len(optimizer.param_groups)}{hint}"
            )
        # Leaf names only: shapes follow the parameters' (checked against meta) and are
        # checked again as the arrays are read.
        saved_paths = self._saved_paths(step_dir, layout.OPTIMIZER)
        engine = self._engine
        assert engine is not None  # an optimizer comes with its model's engine
        current_state = engine.state.opt_state
        if engine.has_live_optimizers and not current_state:
            # An optimizer running its own step makes its state at its first step: before it,
            # the saved state's own description is the target (`ts.optimizer_target`).
            current_state = ts.optimizer_target(engine, saved)[0]
        differences = ts.optimizer_differences(saved_paths, current_state)
        if differences:
            raise CheckpointMismatchError(
                f"checkpoint {step_dir}: the optimizer state does not fit the current "
                f"{current}{hint}:",
                differences,
            )

    def _read_meta(self, step: int, step_dir: str) -> dict:
        """The step's `meta` item: read as the JSON file Orbax's JsonCheckpointHandler wrote
        (`meta/metadata`), ~5 ms less than a restore through Orbax's manager; a file that is
        not there or not a JSON object goes through Orbax, which names the damage. Like
        every file of the step it is checked against the manifest before anything read is
        applied (`_restore_step`)."""
        try:
            with open(os.path.join(step_dir, layout.META, _ORBAX_JSON_ITEM)) as f:
                meta = json.load(f)
            if isinstance(meta, dict):
                return meta
        except (OSError, ValueError):
            pass
        return self._read(step, {layout.META: ocp.args.JsonRestore()})[layout.META]

    def _saved_paths(self, step_dir: str, item: str) -> set[tuple[str, ...]]:
        """The leaves an Orbax PyTree item holds, as `ts.path_key` tuples.

        Read from the item's `_METADATA` tree (a small JSON file) rather than through
        `CheckpointManager.item_metadata`, which opens every array's TensorStore for its
        shape (~0.2 s per item for a 400 MB state). A `_METADATA` of another form (another
        Orbax version) falls back to that slower call."""
        item_dir = os.path.join(step_dir, item)
        try:
            with open(os.path.join(item_dir, _ORBAX_TREE_METADATA)) as f:
                tree = json.load(f)["tree_metadata"]
            return {
                tuple(str(k["key"]) for k in entry["key_metadata"])
                for entry in tree.values()
                # Empty dicts/lists/None are recorded too, as leaves holding nothing.
                if not entry["value_metadata"].get("skip_deserialize", False)
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        try:
            metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item_dir))
        except Exception as e:  # any reader failure here means a damaged file
            raise self._corrupted(step_dir, e) from e
        tree = getattr(metadata, "tree", metadata) or {}
        return {ts.path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}

    def _read_arrays(
        self, step: int, item: str, abstract: Any, label: str, done: Mapping | None = None
    ) -> Any:
        """Read the arrays of `item` into the shapes, dtypes and shardings of `abstract` (a tree
        of jax.ShapeDtypeStruct with shardings); returns the same tree of jax.Arrays.

        Orbax's own sharded read costs ~0.3 ms of Python per (array, distinct shard) -- 3,000
        reads and device_puts for a 400 MB state on 8 devices. In a single process each
        array is read whole into host memory instead (one TensorStore read, cast on the way)
        and `jax.device_put` splits it onto the target sharding, in batches of at most
        `_HOST_BATCH_BYTES` so host memory stays bounded. With several processes every one
        would read every array whole, so there Orbax reads just the shards each process
        needs (a stored shape that differs then surfaces as Orbax's error, wrapped in
        CheckpointCorruptedError; on one process it is a CheckpointMismatchError listing every
        array). Zero-size arrays are not stored (`ts.is_empty`): they are created here.

        `done`: {piece path: tree of placed jax.Arrays} already read by the direct read
        (`_read_direct`); only the other pieces are read here."""
        pieces = list(_pieces(abstract))
        host = jax.process_count() == 1 and _HOST_READ
        budget = _HOST_BATCH_BYTES if host else float("inf")
        done = dict(done or {})
        batch: list[tuple[tuple, Any]] = []
        size = 0
        for path, sub in pieces:
            if path in done:
                continue
            if all(ts.is_empty(s) for s in jax.tree.leaves(sub)):
                done[path] = jax.tree.map(
                    lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), sub
                )
                continue
            nbytes = sum(s.size * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(sub))
            if batch and size + nbytes > budget:
                done.update(self._read_batch(step, item, batch, label, host))
                batch, size = [], 0
            batch.append((path, sub))
            size += nbytes
        if batch:
            done.update(self._read_batch(step, item, batch, label, host))
        if len(pieces) == 1 and pieces[0][0] == ():
            return done[()]
        return _nest((path, done[path]) for path, _ in pieces)

    def _read_direct(self, direct: DirectRead | None, abstracts: Mapping[str, Any]) -> dict:
        """{item: {piece path: tree of placed jax.Arrays}} for the pieces of each item's target
        (`abstracts`: {item: tree of jax.ShapeDtypeStruct}) that `direct` can read: in one
        process, the arrays stored as the target wants them (same shape and dtype), when the
        item's layout allows it, each data file read once and checked against the manifest
        as it is read (`direct_read`). The items are read together while their arrays fit in
        `_HOST_BATCH_BYTES`. An item missing from the answer is read by `_read_arrays`
        through Orbax (its files turned out not to be what the direct read knows)."""
        if direct is None or not (jax.process_count() == 1 and _HOST_READ):
            return {}
        chosen: dict[str, list] = {}
        wanted: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}
        passes: list[list[str]] = []
        pass_bytes = 0
        for item, abstract in abstracts.items():
            if item not in direct.plans:
                continue
            found = self._direct_pieces(direct.plans[item], abstract)
            if found is None:
                continue
            chosen[item], wanted[item], nbytes = found
            if not passes or pass_bytes + nbytes > _HOST_BATCH_BYTES:
                passes.append([])
                pass_bytes = 0
            passes[-1].append(item)
            pass_bytes += nbytes
        out: dict[str, dict] = {}
        for items in passes:
            try:
                arrays = direct.read_items({item: wanted[item] for item in items})
            except direct_read.Unsupported as why:
                log.debug("zerojax: %s %s read through Orbax: %s", direct.step_dir, items, why)
                continue
            for item in items:
                out[item] = {
                    path: jax.tree.unflatten(
                        jax.tree.structure(sub), [arrays[item][n] for n in sub_names]
                    )
                    for path, sub, sub_names in chosen[item]
                }
        return out

    @staticmethod
    def _direct_pieces(plan: direct_read.ItemPlan, abstract: Any):
        """(chosen pieces [(path, sub, names)], {name: struct}, bytes) of `abstract` that the
        direct read can take from `plan`; None when none fits or they exceed the budget."""
        names = ocp.tree.get_param_names(abstract, include_empty_nodes=False)
        wanted: dict[str, jax.ShapeDtypeStruct] = {}
        chosen = []
        for path, sub in _pieces(abstract):
            structs, sub_names = jax.tree.leaves(sub), jax.tree.leaves(_get(names, path))
            if len(structs) != len(sub_names) or not structs:
                continue
            if any(ts.is_empty(s) for s in structs):
                continue
            stored = [plan.arrays.get(n) for n in sub_names]
            if all(
                a is not None and a.shape == tuple(s.shape) and a.dtype == np.dtype(s.dtype)
                for a, s in zip(stored, structs, strict=True)
            ):
                chosen.append((path, sub, sub_names))
                wanted.update(zip(sub_names, structs, strict=True))
        nbytes = sum(s.size * np.dtype(s.dtype).itemsize for s in wanted.values())
        if not chosen or nbytes > _HOST_BATCH_BYTES:
            return None
        return chosen, wanted, nbytes

    def _read_batch(self, step: int, item: str, batch: list, label: str, host: bool) -> dict:
        target = batch[0][1] if batch[0][0] == () else _nest(batch)
        if host:
            restore_args = jax.tree.map(
                lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype), target
            )
        else:
            restore_args = jax.tree.map(
                lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, dtype=s.dtype), target
            )
        restored = self._read(
            step,
            {item: ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True)},
        )[item]
        if not host:
            return {path: _get(restored, path) for path, _ in batch}
        arrays, structs, shapes_wrong, treedefs = [], [], [], []
        for path, sub in batch:
            leaves, treedef = jax.tree_util.tree_flatten_with_path(sub)
            got = jax.tree.leaves(_get(restored, path))
            treedefs.append((path, treedef, len(leaves)))
            for (where, struct), value in zip(leaves, got, strict=True):
                value = np.asarray(value)
                if _is_one_count_per_group(item, path, where, value, struct):
                    # zerojax before per-parameter step counts (torch's) saved one count per
                    # param group; every parameter of the group had stepped that many times.
                    value = np.full(struct.shape, value, dtype=struct.dtype)
                if value.shape != struct.shape:
                    shapes_wrong.append(
                        f"{label}{jax.tree_util.keystr(tuple(_keys(path)) + where)}: shape "
                        f"saved {value.shape} vs current {struct.shape}"
                    )
                arrays.append(value)
                structs.append(struct)
        if shapes_wrong:
            raise CheckpointMismatchError(
                f"checkpoint {self.step_dir(step)}: {item} arrays differ in shape from the "
                f"current ones:",
                shapes_wrong,
            )
        # One call for the whole batch: JAX slices every array onto its devices.
        placed = iter(jax.device_put(arrays, [s.sharding for s in structs]))
        return {
            path: jax.tree_util.tree_unflatten(treedef, [next(placed) for _ in range(n)])
            for path, treedef, n in treedefs
        }

    def _read(self, step: int, args: dict) -> Any:
        try:
            return self._mgr().restore(step, args=ocp.args.Composite(**args))
        except CheckpointError:
            raise
        except Exception as e:  # tensorstore/Orbax errors: wrap, never leak
            raise self._corrupted(self.step_dir(step), e) from e

    @staticmethod
    def _corrupted(step_dir: str, error: BaseException) -> CheckpointCorruptedError:
        message = str(error)
        # Tensorstore names the file it failed on among other paths; prefer an existing file.
        found = re.findall(re.escape(step_dir) + r"[^\s'\"\]\)\\]*", message)
        files = [p for p in found if os.path.isfile(p)]
        path = files[0] if files else (found[0] if found else step_dir)
        first_line = message.strip().splitlines()[0] if message.strip() else ""
        return CheckpointCorruptedError(
            f"checkpoint {step_dir} cannot be read ({path}): {type(error).__name__}: "
            f"{first_line[:500]}",
            path=path,
        )

    def _require_model(self, what: str):
        if self._engine is None:
            raise ValueError(
                f"Checkpointer.{what} needs the model: Checkpointer(directory, model, optimizer)"
            )
        return self._engine


# --------------------------------------------------------------------------- one-shot functions

_in_flight: list[Checkpointer] = []


def _wait_all() -> None:
    while _in_flight:
        _in_flight.pop().close()


def save_checkpoint(
    directory: str | os.PathLike,
    model: Any,
    optimizer: Any = None,
    *,
    step: int,
    scheduler: Any = None,
    extra: dict | None = None,
    async_save: bool = False,
) -> None:
    """Save one step without keeping a Checkpointer; no older step is deleted.

    >>> save_checkpoint("runs/gpt", model, optimizer, step=1000, scheduler=sched)

    With `async_save=True` it returns at once, as `Checkpointer.save` does; the next
    save_checkpoint / restore_checkpoint call, or the interpreter's exit, waits for the write
    (and raises CheckpointSaveError, or at exit exits with status 1, if it failed).
    """
    _wait_all()
    ckpt = Checkpointer(
        directory,
        model,
        optimizer,
        scheduler=scheduler,
        max_to_keep=None,
        async_save=async_save,
        save_interval_steps=0,
    )
    try:
        ckpt.save(step, extra=extra, force=True)
    except BaseException:
        ckpt.close()
        raise
    if async_save:
        _in_flight.append(ckpt)
    else:
        ckpt.close()


def restore_checkpoint(
    directory: str | os.PathLike,
    model: Any,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    step: int | None = None,
) -> RestoredState:
    """Restore one step (default: the latest) into the model, optimizer and scheduler.

    >>> state = restore_checkpoint("runs/gpt", model, optimizer, scheduler=sched)
    """
    _wait_all()
    ckpt = Checkpointer(directory, model, optimizer, scheduler=scheduler, max_to_keep=None)
    try:
        return ckpt.restore(step)
    finally:
        ckpt.close()
