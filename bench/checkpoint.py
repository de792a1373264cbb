"""Checkpoint benchmark: zerojax's async save and restore vs torch.save and torch DCP, what a
save costs inside a training loop, the ways to take the state out of the next update's
reach, and the peak memory of `zerojax ckpt export`.

One training state (a GPT-2, ~36M params by default: fp32 weights + AdamW exp_avg and
exp_avg_sq, ~430 MB) taken after one optimizer step, so the moments are non-zero:

- zerojax: `zerojax.initialize(model, AdamW, {"mesh": {"fsdp": 8}, "zero": {"stage": 3}})` on 8
  simulated CPU devices, one `Checkpointer` (max_to_keep=None) saving one new step directory per
  repeat. Blocking = `Checkpointer.save` returning (it gathers the state's arrays and hands
  them to the Checkpointer's thread, which enqueues their snapshot, `zerojax.ckpt.snapshot`,
  and runs Orbax's save; the next optimizer update would wait until the snapshot is enqueued);
  total = until `wait()` returns (Orbax commit + manifest).
  Restore = `Checkpointer.restore(step)` into the same engine, manifest checksum check included,
  until `jax.block_until_ready` on the params and optimizer state.
- torch.save / torch.load(weights_only=True, map_location="cpu") of `{"model":
  model.state_dict(), "optimizer": optimizer.state_dict()}` of the same GPT-2 + AdamW in plain
  torch, after the same step; save is blocking, so blocking = total.
- torch.distributed.checkpoint (DCP), single process (`no_dist=True`, no process group):
  `dcp.save` / `dcp.load` (in place, into the live state_dict) of the same dict, and
  `dcp.async_save` (blocking = the call returning, total = its future's result); its default
  stager copies every tensor into staging memory before returning, so on CPU its blocking time
  is a full copy of the state.

Every save writes a fresh directory under --dir (same disk for everyone); each contender gets
one untimed warm-up save and restore, then the repeats run interleaved (repeat 1 of every
contender, then repeat 2, ...) so that load from other processes spreads over all of them.
Reported: medians. Restores read files the save just wrote, i.e. from the page cache. Bytes on
disk: Orbax compresses its chunks (zstd), DCP stores the tied wte/lm_head matrix twice.

A save inside the training loop (`--skip-step` leaves it out): above, `save()` is called on an
idle state; in a loop it follows a step whose update may still run on the devices, and on CPU
devices the snapshot's copy and Orbax's background write share the CPUs with the next step.
Timed, interleaved: one zerojax training step (forward, backward, AdamW update,
`loss.item()`) alone, `save()` right after a step, and the step right after that `save()` with
its write in flight; (step after - step alone) is what the save costs the loop beyond
`save()` itself.

Snapshot micro-benchmark (`--skip-snapshot` leaves it out): the same state (`gather_items` of
the engine: 374 arrays, 2,985 shards on 8 devices) put out of the next update's reach, each
way timed alone, interleaved, on fresh device arrays each repeat (a jax.Array caches its host
value): "returns" is how long the calling thread waits (the Checkpointer's own thread, not the
loop, since the snapshot moved there), "done" until the copy is complete. The ways:
`zerojax.ckpt.snapshot` on the device (a jitted copy) and into pinned host memory
(`jax.device_put`), one host copy per shard as Orbax does, `jax.device_get`; the floor is one
memcpy of as many bytes into reused memory.

Then `zerojax ckpt export DIR --format safetensors|torch OUT` runs in a subprocess on the
zerojax checkpoint, under /usr/bin/time -v (or, without it, a wrapper printing ru_maxrss), and
its peak RSS is compared with a baseline process that only imports jax, zerojax and the export
module's dependencies and starts the JAX backend: export streams one tensor at a time, so
(peak - baseline) should stay near the largest tensor, not the model.

Run: .venv/bin/python bench/checkpoint.py [--repeats 5] [--dir /tmp/somewhere] [--quick]
[--skip-export] [--skip-step] [--skip-snapshot]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import unittest.mock
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

# 8 simulated devices for the fsdp=8 mesh; the config flag (not XLA_FLAGS) so that the export
# subprocesses below run on the plain 1-device CPU backend a user's `zerojax ckpt export` gets.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import numpy as np
import orbax.checkpoint as ocp
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import zerojax
from bench.architectures import GPT2, GPT2Config
from zerojax.ckpt import Checkpointer, layout, priority
from zerojax.ckpt import training_state as ts
from zerojax.ckpt.direct_read import DirectRead, plan_item
from zerojax.ckpt.manifest import read_manifest, verify_manifest
from zerojax.ckpt.snapshot import snapshot

# DCP warns on every call that it "assumes" a single process, though no_dist=True says so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

ZEROJAX_MESH = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
ZEROJAX_CONFIG = {
    **ZEROJAX_MESH,
    "runtime": {"report_effective_time": False},  # no ledger report mixed into the tables
}
LR = 1e-3


# --- the training state ------------------------------------------------------------------------


def gpt2_config(quick: bool) -> GPT2Config:
    if quick:
        return GPT2Config(vocab_size=1024, max_seq_len=64, width=128, num_layers=2, num_heads=4)
    # 10 x 12 x 512^2 (blocks) + 8192 x 512 (tied wte/lm_head) ~ 36M params ~ 430 MB of state.
    return GPT2Config(vocab_size=8192, max_seq_len=64, width=512, num_layers=10, num_heads=8)


def one_step(model, optimizer, tokens, targets) -> float:
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())


def build_states(quick: bool):
    """The torch model + AdamW and the zerojax engine, both from the same seed, after one step;
    and that step's batch."""
    config = gpt2_config(quick)
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, config.max_seq_len))
    targets = torch.roll(tokens, -1, dims=1)

    def fresh():
        torch.manual_seed(1)
        model = GPT2(config)
        model.eval()  # dropout off: both sides do the same arithmetic
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    torch_model, torch_opt = fresh()
    torch_loss = one_step(torch_model, torch_opt, tokens, targets)

    model, optimizer = fresh()
    model, optimizer = zerojax.initialize(model, optimizer, config=ZEROJAX_CONFIG)
    zerojax_loss = one_step(model, optimizer, tokens, targets)
    engine = model.engine
    jax.block_until_ready((engine.params, engine.opt_state))
    batch = (tokens, targets)
    return config, (torch_model, torch_opt, torch_loss), (model, optimizer, zerojax_loss), batch


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def dir_bytes(path: str | os.PathLike) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# --- contenders: save(i) -> (blocking s, total s, path); restore(i) -> s -----------------------


class ZerojaxContender:
    name = "zerojax async (Orbax)"

    def __init__(self, root: Path, model, optimizer):
        self.engine = model.engine
        self.ckpt = Checkpointer(root / "zerojax", model, optimizer, max_to_keep=None)
        self.manifest_seconds: list[float] = []
        """verify_manifest alone, after each timed restore: how much of a restore it is."""
        self.orbax_restore_seconds: list[float] = []
        """The restore through Orbax (direct read off), right after each timed restore."""

    def save(self, i: int):
        start = time.perf_counter()
        self.ckpt.save(i, force=True)
        blocking = time.perf_counter() - start
        self.ckpt.wait()
        return blocking, time.perf_counter() - start, self.ckpt.step_dir(i)

    def restore(self, i: int) -> float:
        def run():
            self.ckpt.restore(i)
            jax.block_until_ready((self.engine.params, self.engine.opt_state))

        seconds = timed(run)[0]
        self.manifest_seconds.append(timed(lambda: verify_manifest(self.ckpt.step_dir(i)))[0])
        # The same restore through Orbax's read and the separate checksum pass (what restore did
        # before zerojax.ckpt.direct_read), interleaved with it.
        with unittest.mock.patch.object(Checkpointer, "_plan_direct", lambda *_: None):
            self.orbax_restore_seconds.append(timed(run)[0])
        return seconds

    def check(self, i: int) -> None:
        """Zero the params, restore, compare with the values before: a restore that did nothing
        would fail here (the check is untimed)."""
        before = {k: np.asarray(v) for k, v in self.engine.params.items()}
        state = self.engine.state
        zeros = {k: np.zeros(v.shape, v.dtype) for k, v in state.weights.items()}
        self.engine.load(state.with_weights(zeros))
        self.ckpt.restore(i)
        for k, v in before.items():
            if not np.array_equal(np.asarray(self.engine.params[k]), v):
                raise AssertionError(f"zerojax restore: {k} differs from what was saved")


class TorchSaveContender:
    name = "torch.save"

    def __init__(self, root: Path, model, optimizer):
        self.root, self.model, self.optimizer = root / "torch_save", model, optimizer

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def path(self, i: int) -> Path:
        return self.root / str(i) / "state.pt"

    def save(self, i: int):
        self.path(i).parent.mkdir(parents=True)
        seconds, _ = timed(lambda: torch.save(self.state(), self.path(i)))
        return seconds, seconds, self.path(i).parent

    def restore(self, i: int) -> float:
        return timed(lambda: torch.load(self.path(i), weights_only=True, map_location="cpu"))[0]

    def check(self, i: int) -> None:
        loaded = torch.load(self.path(i), weights_only=True, map_location="cpu")
        for k, v in self.model.state_dict().items():
            if not torch.equal(loaded["model"][k], v):
                raise AssertionError(f"torch.load: {k} differs from what was saved")


class DcpContender(TorchSaveContender):
    name = "torch DCP"
    is_async = False

    def __init__(self, root: Path, model, optimizer):
        super().__init__(root, model, optimizer)
        self.root = root / ("dcp_async" if self.is_async else "dcp")

    def path(self, i: int) -> Path:
        return self.root / str(i)

    def save(self, i: int):
        state = self.state()
        start = time.perf_counter()
        if self.is_async:
            future = dcp.async_save(state, checkpoint_id=self.path(i), no_dist=True)
            blocking = time.perf_counter() - start
            future.result()
        else:
            dcp.save(state, checkpoint_id=self.path(i), no_dist=True)
            blocking = time.perf_counter() - start
        return blocking, time.perf_counter() - start, self.path(i)

    def restore(self, i: int) -> float:
        # In place, into the live model's and optimizer's tensors: DCP's way to resume.
        return timed(lambda: dcp.load(self.state(), checkpoint_id=self.path(i), no_dist=True))[0]

    def check(self, i: int) -> None:
        target = {
            "model": {k: torch.zeros_like(v) for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
        }
        dcp.load(target, checkpoint_id=self.path(i), no_dist=True)
        for k, v in self.model.state_dict().items():
            if not torch.equal(target["model"][k], v):
                raise AssertionError(f"dcp.load: {k} differs from what was saved")


class DcpAsyncContender(DcpContender):
    name = "torch DCP async_save"
    is_async = True


def measure(contenders: list, repeats: int) -> dict:
    """{name: {"blocking": [s], "total": [s], "restore": [s], "bytes": int}}; a contender that
    fails is reported with its error and dropped."""
    results = {c.name: {"blocking": [], "total": [], "restore": [], "bytes": 0} for c in contenders}
    alive = []
    for c in contenders:
        print(f"  warm-up + check: {c.name} ...", file=sys.stderr, flush=True)
        try:
            c.save(0)
            c.restore(0)
            c.check(0)
            alive.append(c)
        except Exception as exc:  # noqa: BLE001 (one broken contender must not hide the rest)
            message = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            print(f"  {c.name} skipped: {message}", file=sys.stderr)
            results[c.name] = {"error": message}
    for i in range(1, repeats + 1):
        print(f"  repeat {i}/{repeats} ...", file=sys.stderr, flush=True)
        for c in alive:
            blocking, total, path = c.save(i)
            r = results[c.name]
            r["blocking"].append(blocking)
            r["total"].append(total)
            r["bytes"] = dir_bytes(path)
            r["restore"].append(c.restore(i))
    return results


def results_table(results: dict) -> str:
    base = results["torch.save"]

    def med(r: dict, key: str) -> float:
        return statistics.median(r[key])

    def ratio(r: dict, key: str) -> str:
        return f"{med(r, key) / med(base, key):.2f}x" if "error" not in base else "-"

    lines = [
        (
            "| format | blocking save (ms) | total save (ms) | restore (ms) | bytes on disk "
            "| blocking vs torch.save | total vs torch.save | restore vs torch.load |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | skipped: {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {name} | {med(r, 'blocking') * 1e3:.0f} | {med(r, 'total') * 1e3:.0f} "
            f"| {med(r, 'restore') * 1e3:.0f} | {r['bytes']:,} | {ratio(r, 'blocking')} "
            f"| {ratio(r, 'total')} | {ratio(r, 'restore')} |"
        )
    return "\n".join(lines)


# --- the training step after a save ------------------------------------------------------------


class _Priority:
    """Background priority of the save's threads (`zerojax.ckpt.priority`) on or off, for an
    interleaved A/B: off puts every thread of the process back at nice 0, which only a
    privileged process (root here) may do; `available` says whether it could."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.functions = (priority.lower_this_thread, priority.lower_tensorstore_threads)
        self.available = True

    def set(self, on: bool) -> None:
        if self.ckpt._writer is not None:  # a new writer thread takes the setting
            self.ckpt._writer.shutdown()
            self.ckpt._writer = None
        if on:
            priority.lower_this_thread, priority.lower_tensorstore_threads = self.functions
            return
        priority.lower_this_thread = priority.lower_tensorstore_threads = lambda: None
        for tid in os.listdir("/proc/self/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
            except PermissionError:
                self.available = False
            except OSError:
                pass


def step_after_save_table(contender, model, optimizer, batch, repeats: int) -> str:
    """In a training loop: `save()` called right after a step (whose update may still run on
    the devices), and the step after it (the save's write in flight), against a step alone;
    medians, interleaved, with the save's threads at background priority (the Checkpointer's
    way) and, interleaved with it, at normal priority. The saves go to steps after the timed
    contenders'."""
    alone, blocking, after, after_normal = [], [], [], []
    step = lambda: one_step(model, optimizer, *batch)  # ends in loss.item(): a host sync
    step()  # warm: the update program was compiled by build_states, this settles the rest
    switch = _Priority(contender.ckpt)
    try:
        for i in range(repeats):
            print(f"  step-after-save repeat {i + 1}/{repeats} ...", file=sys.stderr, flush=True)
            alone.append(timed(step)[0])
            switch.set(on=True)
            save = functools.partial(contender.ckpt.save, 10_000 + 2 * i, force=True)
            blocking.append(timed(save)[0])
            after.append(timed(step)[0])
            contender.ckpt.wait()
            switch.set(on=False)
            contender.ckpt.save(10_001 + 2 * i, force=True)
            after_normal.append(timed(step)[0])
            contender.ckpt.wait()
    finally:
        switch.set(on=True)
    med = statistics.median
    rows = [
        ("training step alone", alone),
        ("`save()` right after a step", blocking),
        ("training step right after `save()`, its write in flight", after),
        ("the same, the save's threads at normal priority (before issue 44)", after_normal),
    ]
    lines = [
        "| in the training loop | median (ms) | min (ms) | vs step alone (median) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {med(v) * 1e3:.0f} | {min(v) * 1e3:.0f} | "
        + ("" if v is blocking else f"{med(v) / med(alone):.2f}x")
        + " |"
        for name, v in rows
    ]
    normal = "" if switch.available else " (could not reset thread priorities: not privileged)"
    return "\n".join(lines) + (
        f"\n\nWhat a save costs the loop: `save()` plus (step after it - step alone) = "
        f"{med(blocking) * 1e3:.0f} + {(med(after) - med(alone)) * 1e3:.0f} ms; at normal "
        f"priority + {(med(after_normal) - med(alone)) * 1e3:.0f} ms{normal} (medians of "
        f"{repeats}; a step's own spread under load is in its min vs median)."
    )


# --- snapshot: out of the next update's reach ----------------------------------------------------


def per_shard_copies(tree) -> list:
    """One owned host copy per distinct shard, all transfers started first: what Orbax's save
    does with device arrays (its `transfer_arrays_to_host`; there `np.asarray`, zero-copy on
    CPU, so `np.array` here to own the memory the next update may donate)."""
    shards = [s for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.replica_id == 0]
    for s in shards:
        s.data.copy_to_host_async()
    return [np.array(s.data) for s in shards]


def snapshot_table(engine, repeats: int) -> str:
    tree = ts.gather_items(engine, with_optimizer=True)
    leaves = jax.tree.leaves(tree)
    nbytes = sum(x.nbytes for x in leaves)
    num_shards = sum(
        1
        for x in leaves
        if isinstance(x, jax.Array)
        for s in x.addressable_shards
        if s.replica_id == 0
    )
    source, floor = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    ways = {
        "`snapshot`, on the device (Checkpointer on CPU)": lambda t: snapshot(t, method="device"),
        "`snapshot`, into pinned host memory (Checkpointer on GPU)": lambda t: snapshot(
            t, method="pinned_host"
        ),
        "one host copy per shard, transfers started first (Orbax's way)": per_shard_copies,
        "`jax.device_get(tree)`": jax.device_get,
        "floor: one memcpy of the bytes into reused memory": lambda _: np.copyto(floor, source),
    }
    returns: dict[str, list[float]] = {name: [] for name in ways}
    done: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():  # warm-up: compiles the copy program
        jax.block_until_ready(way(jax.tree.map(jax.numpy.copy, tree)))
    for i in range(repeats):
        print(f"  snapshot repeat {i + 1}/{repeats} ...", file=sys.stderr, flush=True)
        for name, way in ways.items():
            fresh = jax.tree.map(jax.numpy.copy, tree)  # new arrays, no cached host value
            jax.block_until_ready(fresh)
            start = time.perf_counter()
            result = way(fresh)
            returns[name].append(time.perf_counter() - start)
            jax.block_until_ready(result)
            done[name].append(time.perf_counter() - start)
            del result
    base = statistics.median(
        returns["one host copy per shard, transfers started first (Orbax's way)"]
    )
    lines = [
        "| way out of the next update's reach | returns (ms) | done (ms) | returns vs one copy per shard |",
        "|---|---|---|---|",
    ]
    for name in ways:
        r, d = statistics.median(returns[name]), statistics.median(done[name])
        lines.append(f"| {name} | {r * 1e3:.0f} | {d * 1e3:.0f} | {r / base:.2f}x |")
    return "\n".join(lines) + (
        f"\n\n{nbytes / 2**20:.0f} MiB in {len(leaves)} arrays, {num_shards:,} distinct shards on "
        f"{jax.device_count()} devices; medians of {repeats}, interleaved, fresh device arrays "
        f"every repeat. Returns: until the call returns (in the Checkpointer: on its own thread, "
        f"not the loop's); done: until every copy is complete (`jax.block_until_ready`)."
    )


# --- where a restore's time goes -----------------------------------------------------------------


def _read_files(step_dir: str) -> int:
    """Every file of the step read once into one reused buffer: the page-cache floor."""
    total = 0
    buffer = bytearray(1 << 24)
    view = memoryview(buffer)
    for root, _, names in os.walk(step_dir):
        for name in names:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return total


class _Timers:
    """Wall time spent inside a few functions during one restore (patched while it runs)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, attr: str, label: str):
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, attr, timed_call)
        return lambda: setattr(owner, attr, original)


def restore_profile(contender: ZerojaxContender, repeats: int) -> str:
    """The restore of one saved step, taken apart: the whole restore, its phases (timed inside
    it), and each part alone (interleaved), then cProfile's top functions of one restore."""
    import cProfile
    import io
    import pstats

    from zerojax.ckpt import checkpointer as checkpointer_module

    ckpt, engine = contender.ckpt, contender.engine
    step = 20_000
    ckpt.save(step, force=True)
    ckpt.wait()
    step_dir = ckpt.step_dir(step)
    files = [p for p in Path(step_dir).rglob("*") if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    largest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:3]

    def whole():
        ckpt.restore(step)
        jax.block_until_ready((engine.params, engine.opt_state))

    meta = ckpt._mgr().restore(
        step, args=ocp.args.Composite(**{layout.META: ocp.args.JsonRestore()})
    )[layout.META]
    targets = {
        layout.MODEL: ts.without_empty(ts.model_target(engine, meta["parameters"])[0]),
        layout.OPTIMIZER: ts.without_empty(ts.optimizer_target(engine)[0]),
    }

    def orbax_to_host():
        # The same reads the restore makes, to numpy, nothing placed on the devices.
        args = {}
        for item, target in targets.items():
            restore_args = jax.tree.map(
                lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype), target
            )
            args[item] = ocp.args.PyTreeRestore(
                target, restore_args=restore_args, partial_restore=True
            )
        return ckpt._mgr().restore(step, args=ocp.args.Composite(**args))

    host = orbax_to_host()
    pairs = [
        pair
        for item, target in targets.items()
        for pair in jax.tree.leaves(
            jax.tree.map(lambda s, h: (h, s.sharding), target, host[item]),
            is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[-1], jax.sharding.Sharding),
        )
    ]
    host_leaves, shardings = [h for h, _ in pairs], [s for _, s in pairs]

    def place():
        jax.block_until_ready(jax.device_put(host_leaves, shardings))

    def direct():
        # zerojax's own read of the same arrays (what restore now does): each data file once,
        # its checksum checked as it is read, placed on the devices; both items in one pass.
        files = read_manifest(step_dir)
        reader = DirectRead(
            step_dir, files, {item: plan_item(step_dir, item, files) for item in targets}
        )
        wanted = {}
        for item, target in targets.items():
            names = jax.tree.leaves(ocp.tree.get_param_names(target, include_empty_nodes=False))
            wanted[item] = dict(zip(names, jax.tree.leaves(target), strict=True))
        jax.block_until_ready(reader.read_items(wanted))

    ways = {
        "`Checkpointer.restore(step)` (what the table above times)": whole,
        "read every file of the step once (page-cache floor)": lambda: _read_files(step_dir),
        "manifest checksum pass alone (`verify_manifest`)": lambda: verify_manifest(step_dir),
        "Orbax read of model + optimizer to host numpy, nothing placed": orbax_to_host,
        "`jax.device_put` of those host arrays onto the engine's shardings": place,
        "direct read of model + optimizer: read once, checksum checked, placed": direct,
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():
        way()  # warm
    for i in range(repeats):
        print(f"  restore-profile repeat {i + 1}/{repeats} ...", file=sys.stderr, flush=True)
        for name, way in ways.items():
            seconds[name].append(timed(way)[0])

    # Phases inside one restore (main thread; the checksum pass runs on its own thread).
    timers = _Timers()
    undo = [
        timers.wrap(checkpointer_module, "verify_manifest", "checksum pass (helper thread)"),
        timers.wrap(checkpointer_module.Checkpointer, "_plan_direct", "direct read: plan"),
        timers.wrap(
            checkpointer_module.DirectRead,
            "read_items",
            "direct read: read + checksum + place (arrays)",
        ),
        timers.wrap(checkpointer_module.Checkpointer, "_read", "Orbax restore calls (all items)"),
        timers.wrap(jax, "device_put", "jax.device_put"),
        timers.wrap(
            checkpointer_module.Checkpointer, "_check_optimizer", "optimizer check (leaf names)"
        ),
        timers.wrap(engine, "load", "engine.load"),
    ]
    phases: dict[str, list[float]] = {}
    try:
        for _ in range(repeats):
            timers.seconds = {}
            total = timed(whole)[0]
            for k, v in {"whole restore": total, **timers.seconds}.items():
                phases.setdefault(k, []).append(v)
    finally:
        for u in reversed(undo):
            u()

    profiler = cProfile.Profile()
    profiler.enable()
    whole()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
    stats.print_stats(25)
    top = "\n".join(
        line for line in out.getvalue().splitlines() if line.strip() and "{built-in" not in line[:0]
    )

    med = statistics.median
    base = med(seconds["read every file of the step once (page-cache floor)"])
    lines = [
        "| part of a restore, each alone | median (ms) | vs reading the files |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {med(s) * 1e3:.0f} | {med(s) / base:.2f}x |" for n, s in seconds.items()]
    lines += ["", "| inside one restore | median (ms) |", "|---|---|"]
    lines += [f"| {n} | {med(s) * 1e3:.0f} |" for n, s in phases.items()]
    sizes = ", ".join(
        f"{p.relative_to(step_dir)} {p.stat().st_size / 2**20:.1f} MiB" for p in largest
    )
    return "\n".join(lines) + (
        f"\n\nStep {step_dir}: {len(files)} files, {nbytes / 2**20:.1f} MiB (largest: {sizes}); "
        f"medians of {repeats}, interleaved.\n\ncProfile of one restore (main thread):\n\n```\n"
        f"{top}\n```"
    )


def save_profile(contender: ZerojaxContender, repeats: int) -> str:
    """One save taken apart: its phases on the Checkpointer's thread (timed inside it), and the
    floor of writing as many bytes to one file."""
    from zerojax.ckpt import checkpointer as checkpointer_module
    from zerojax.ckpt import commit as commit_module

    timers = _Timers()
    undo = [
        timers.wrap(checkpointer_module, "snapshot", "snapshot enqueued"),
        timers.wrap(checkpointer_module.Checkpointer, "_start_write", "Orbax `save()` call"),
        timers.wrap(checkpointer_module.Checkpointer, "_commit", "Orbax background write + commit"),
        timers.wrap(commit_module, "write_manifest", "manifest (checksum of every file)"),
    ]
    phases: dict[str, list[float]] = {}
    floor: list[float] = []
    nbytes = tree_bytes(ts.gather_items(contender.engine, with_optimizer=True))
    data = np.ones(nbytes, np.uint8)
    try:
        for i in range(repeats):
            print(f"  save-profile repeat {i + 1}/{repeats} ...", file=sys.stderr, flush=True)
            timers.seconds = {}
            _, total, path = contender.save(30_000 + i)
            for k, v in {"total save": total, **timers.seconds}.items():
                phases.setdefault(k, []).append(v)
            target = Path(path).parent / f"floor-{i}.bin"
            floor.append(timed(lambda: target.write_bytes(data.data))[0])  # noqa: B023
            target.unlink()
    finally:
        for u in reversed(undo):
            u()
    med = statistics.median
    lines = ["| inside one save (Checkpointer's thread) | median (ms) |", "|---|---|"]
    lines += [f"| {n} | {med(s) * 1e3:.0f} |" for n, s in phases.items()]
    lines.append(f"| floor: one write of as many bytes to one file | {med(floor) * 1e3:.0f} |")
    return "\n".join(lines) + (
        f"\n\n{nbytes / 2**20:.0f} MiB; medians of {repeats}. The manifest runs inside Orbax's "
        f"commit (part of the background write)."
    )


def save_sync_table(zerojax: ZerojaxContender, torch_save: TorchSaveContender, repeats: int) -> str:
    """Total save, interleaved: TensorStore's fsync after each write (zerojax before the flush
    moved to the commit), the flush at the commit (`commit.files_synced_at_commit`: what saves
    do now), and torch.save (no flush at all). Each save's directory is deleted after it."""
    from zerojax.ckpt import commit as commit_module

    install = commit_module._install_sync_at_commit
    ways = {
        "zerojax, TensorStore's fsync after each write (before)": False,
        "zerojax, every file flushed once at the commit (now)": True,
        "torch.save (no flush)": None,
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for i in range(repeats):
            print(f"  save-sync repeat {i + 1}/{repeats} ...", file=sys.stderr, flush=True)
            for j, (name, at_commit) in enumerate(ways.items()):
                step = 40_000 + 10 * i + j
                if at_commit is None:
                    seconds[name].append(torch_save.save(step)[1])
                    shutil.rmtree(torch_save.path(step).parent)
                    continue
                commit_module._install_sync_at_commit = install if at_commit else lambda: False
                seconds[name].append(zerojax.save(step)[1])
                shutil.rmtree(zerojax.ckpt.step_dir(step))
    finally:
        commit_module._install_sync_at_commit = install
    med = statistics.median
    base = med(seconds["torch.save (no flush)"])
    lines = ["| total save | median (ms) | min (ms) | vs torch.save |", "|---|---|---|---|"]
    lines += [
        f"| {n} | {med(v) * 1e3:.0f} | {min(v) * 1e3:.0f} | {med(v) / base:.2f}x |"
        for n, v in seconds.items()
    ]
    return "\n".join(lines) + f"\n\nMedians of {repeats}, interleaved."


# --- export peak RSS -----------------------------------------------------------------------------

_BASELINE = (
    "import jax, zerojax, zerojax.cli, zerojax.ckpt.export, orbax.checkpoint, torch; jax.devices()"
)
_WRAPPER = (
    "import resource, sys; from zerojax.cli import main; rc = main(sys.argv[1:]); "
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); "
    "sys.exit(rc)"
)


def peak_rss(argv: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes, wall seconds) of one child process running `argv`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if os.path.exists("/usr/bin/time"):
        command, pattern = (
            ["/usr/bin/time", "-v", *argv],
            r"Maximum resident set size \(kbytes\): (\d+)",
        )
    else:
        command, pattern = argv, r"PEAK_RSS_KB (\d+)"
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, check=False)
    wall = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{out.stderr[-2000:]}")
    found = re.search(pattern, out.stderr)
    if not found:
        raise RuntimeError(f"no peak RSS in the output of {shlex.join(command)}")
    return int(found.group(1)) * 1024, wall


def export_table(checkpoint_dir: Path, out_dir: Path, torch_model) -> str:
    python = sys.executable

    def cli(*args: str) -> list[str]:
        if os.path.exists("/usr/bin/time"):
            return [python, "-m", "zerojax.cli", *args]
        return [python, "-c", _WRAPPER, *args]  # prints its own ru_maxrss

    def mb(n: int) -> str:
        return f"{n / 2**20:.1f}"

    state = torch_model.state_dict()
    unique = {t.untyped_storage().data_ptr(): t for t in state.values()}
    model_bytes = sum(t.nbytes for t in unique.values())
    largest = max(state.items(), key=lambda kv: kv[1].nbytes)
    baseline, baseline_wall = peak_rss([python, "-c", _BASELINE])
    lines = [
        (
            "| export | peak RSS (MiB) | baseline RSS (MiB) | peak - baseline (MiB) | model (MiB) "
            "| largest tensor (MiB) | (peak - baseline) / largest | output file (MiB) | wall (s) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fmt, suffix in (("safetensors", "safetensors"), ("torch", "pt")):
        out = out_dir / f"model.{suffix}"
        argv = cli("ckpt", "export", str(checkpoint_dir), "--format", fmt, str(out), "--quiet")
        print(f"  export {fmt} ...", file=sys.stderr, flush=True)
        try:
            peak, wall = peak_rss(argv)
        except Exception as exc:  # noqa: BLE001 (report, keep the rest of the output)
            first = str(exc).strip().splitlines()
            lines.append(f"| {fmt} | failed: {first[-1][:150] if first else exc} | | | | | | | |")
            continue
        lines.append(
            f"| {fmt} | {mb(peak)} | {mb(baseline)} | {mb(peak - baseline)} | {mb(model_bytes)} "
            f"| {mb(largest[1].nbytes)} | {(peak - baseline) / largest[1].nbytes:.2f} "
            f"| {mb(out.stat().st_size)} | {wall:.1f} |"
        )
    how = "/usr/bin/time -v" if os.path.exists("/usr/bin/time") else "ru_maxrss at exit"
    return "\n".join(lines) + (
        f"\n\nPeak RSS by {how} of `python -m zerojax.cli ckpt export {checkpoint_dir} --format "
        f"FMT OUT --quiet` (1 CPU device, XLA_FLAGS unset). Baseline: a process running "
        f"`{_BASELINE}` (no checkpoint read; {baseline_wall:.1f} s). Model = the state_dict's "
        f"tensors, tied weights once; largest tensor = {largest[0]} "
        f"{tuple(largest[1].shape)} {str(largest[1].dtype).removeprefix('torch.')}."
    )


# --- main ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed saves/restores each")
    parser.add_argument(
        "--dir", help="where the checkpoints go (default: a new temp dir under /tmp, deleted)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    parser.add_argument("--skip-export", action="store_true")
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--skip-snapshot", action="store_true")
    parser.add_argument(
        "--profile-restore",
        action="store_true",
        help="also take a restore and a save apart: each part alone, their phases, cProfile",
    )
    parser.add_argument(
        "--skip-dcp", action="store_true", help="zerojax and torch.save only (a quicker A/B)"
    )
    parser.add_argument(
        "--save-sync-ab",
        action="store_true",
        help="also: total save with TensorStore's fsync per write vs the flush at the commit",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: a 2-layer width-128 GPT-2, 2 repeats"
    )
    options = parser.parse_args()
    repeats = 2 if options.quick and "--repeats" not in sys.argv else options.repeats
    python = (
        os.path.relpath(sys.executable)
        if sys.executable.startswith(os.getcwd())
        else sys.executable
    )
    print(f"Command: {shlex.join([python, *sys.argv])}")
    load_start = os.getloadavg()
    jax.numpy.zeros(())  # start the JAX backend before torch starts its threads

    print("  building the training states ...", file=sys.stderr, flush=True)
    config, (t_model, t_opt, t_loss), (z_model, z_opt, z_loss), batch = build_states(options.quick)
    engine = z_model.engine
    num_params = sum(p.numel() for p in t_model.parameters())
    state_bytes = tree_bytes((engine.params, engine.buffers, engine.opt_state))

    root = Path(options.dir or tempfile.mkdtemp(prefix="zerojax-bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        contenders = [
            ZerojaxContender(root, z_model, z_opt),
            TorchSaveContender(root, t_model, t_opt),
        ]
        if not options.skip_dcp:
            contenders += [
                DcpContender(root, t_model, t_opt),
                DcpAsyncContender(root, t_model, t_opt),
            ]
        results = measure(contenders, repeats)
        step = None
        if not options.skip_step:
            step = step_after_save_table(contenders[0], z_model, z_opt, batch, repeats)
        profile = None
        if options.profile_restore:
            profile = restore_profile(contenders[0], repeats)
            profile += "\n\n" + save_profile(contenders[0], repeats)
        sync_ab = None
        if options.save_sync_ab:
            sync_ab = save_sync_table(contenders[0], contenders[1], repeats)
        contenders[0].ckpt.close()
        snapshots = None if options.skip_snapshot else snapshot_table(engine, repeats)
        export = None
        if not options.skip_export:
            out_dir = root / "export"
            out_dir.mkdir(exist_ok=True)
            export = export_table(root / "zerojax", out_dir, t_model)
    finally:
        if not options.keep:
            shutil.rmtree(root, ignore_errors=True)
    load_end = os.getloadavg()

    print(
        f"\n## Checkpoint save / restore (GPT-2 {config.num_layers} layers, width "
        f"{config.width}, vocabulary {config.vocab_size}: {num_params / 1e6:.1f}M params, "
        f"{state_bytes / 2**20:.0f} MiB of fp32 weights + AdamW state)\n"
    )
    print(results_table(results))
    print(
        f"\nMedians of {repeats} saves and restores each (after one untimed warm-up), interleaved; "
        f"first-step loss torch {t_loss:.5f}, zerojax {z_loss:.5f}. zerojax on 8 simulated CPU "
        f"devices, config {ZEROJAX_MESH}; its restore includes the manifest checksum check "
        f"(alone: {statistics.median(contenders[0].manifest_seconds) * 1e3:.0f} ms); the same "
        f"restore through Orbax's read and a separate checksum pass (direct read off, as before "
        f"issue 44), interleaved: "
        f"{statistics.median(contenders[0].orbax_restore_seconds[1:]) * 1e3:.0f} ms. "
        f"Ratios: contender time / torch.save (torch.load for restores), lower is faster. "
        f"Checkpoints under {root} ({'kept' if options.keep else 'deleted after'}); restores "
        f"read from the page cache. {os.cpu_count()} CPUs, {torch.get_num_threads()} torch "
        f"threads; torch {torch.__version__}, jax {jax.__version__}."
    )
    if step is not None:
        print("\n## A save inside the training loop\n")
        print(step)
    if profile is not None:
        print("\n## Where a restore's (and a save's) time goes\n")
        print(profile)
    if sync_ab is not None:
        print("\n## Total save: where the disk flush happens\n")
        print(sync_ab)
    if snapshots is not None:
        print(
            f"\n## Out of the next update's reach: snapshot vs copies to host ({os.cpu_count()} CPUs)\n"
        )
        print(snapshots)
    if export is not None:
        print("\n## `zerojax ckpt export` peak memory\n")
        print(export)
    print(
        "\nLoad average (1/5/15 min) at start: "
        + " / ".join(f"{x:.2f}" for x in load_start)
        + "; at end: "
        + " / ".join(f"{x:.2f}" for x in load_end)
        + " (other processes share the CPUs)."
    )


if __name__ == "__main__":
    main()
