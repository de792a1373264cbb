"""The "checkpoints" section: zerojax's asynchronous checkpoint of a GPU training state against
`torch.save` / `torch.load` of the same state held on the GPU in plain torch.

The state: a GPT-2-style model (bench/architectures.py's `GPT2`, fp32, dropout off) after one
AdamW step, so the moments are non-zero, on one device:

- zerojax: `zerojax.initialize(model, AdamW, loss_fn=...)`, one `zerojax.Checkpointer` saving a
  new step directory per repeat (bench/checkpoint.py's way). Blocking = `save()` returning (it
  gathers the state's arrays and hands them to the Checkpointer's thread, which snapshots and
  writes them); total = until `wait()` returns (Orbax's commit and the manifest). Restore =
  `restore(step)` (manifest crc32 check included) until `jax.block_until_ready` on the params
  and optimizer state.
- torch: the same model and AdamW on cuda, after the same step; `torch.save({"model":
  state_dict, "optimizer": state_dict})` (blocking: it copies to the host and writes) and
  `torch.load(weights_only=True, map_location="cuda")` until `torch.cuda.synchronize()`.

Both write into the section's scratch directory on the machine's disk (a step is deleted after
its repeat, so the disk holds at most one of each); restores read what the save just wrote,
from the page cache. One untimed warm-up each, then interleaved repeats while time allows;
medians. Checks: the restored zerojax state equals the saved one bitwise (params and every
optimizer-state array, after zeroing them, so a restore that wrote nothing fails), and the
training step after the restore gives the loss the same step gave without save and restore.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

from tools.gpu_check.context import Context
from tools.gpu_check.report import SectionReport

# GPT-2 shapes: (vocab, sequence, width, layers, heads, batch). On the GPU GPT-2 small's
# parameter count (~134M: vocabulary 50,257, 2 layers of width 1536, where GPT-2 small has 12
# of 768: its bytes, with a much shorter compile of the one step), i.e. ~1.6 GB of fp32
# weights + AdamW moments.
GPU_SHAPE = (50257, 128, 1536, 2, 12, 4)
CPU_SHAPE = (256, 32, 32, 1, 2, 2)
LR = 1e-3
MAX_REPEATS = 5


def dir_bytes(path: str | os.PathLike) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def one_step(model, optimizer, tokens, targets) -> float:
    """One training step; `model` is plain torch, or zerojax's with the loss fused in
    (`initialize(..., loss_fn=lm_loss)`: `model(tokens, targets)` is the loss)."""
    from tools.gpu_check.memory import lm_loss

    fused = hasattr(model, "engine")
    loss = model(tokens, targets) if fused else lm_loss(model(tokens), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())  # a host sync: the step has run


def build_states(ctx: Context, cache_dir: str):
    """The torch model + AdamW on `ctx.torch_device` and the zerojax engine, from the same
    seed, each after one step on the same batch; and that batch."""
    import jax
    import torch

    import zerojax
    from tools.gpu_check.memory import gpt2, lm_loss

    shape = CPU_SHAPE if ctx.cpu else GPU_SHAPE
    model, tokens, targets = gpt2(shape)
    model = model.to(ctx.torch_device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    torch_loss = one_step(
        model, optimizer, tokens.to(ctx.torch_device), targets.to(ctx.torch_device)
    )
    if not ctx.cpu:
        torch.cuda.synchronize()

    z_model, _, _ = gpt2(shape)
    z_optimizer = torch.optim.AdamW(z_model.parameters(), lr=LR)
    config = {
        "mesh": {"data": 1},
        "runtime": {"compilation_cache_dir": cache_dir, "report_effective_time": False},
    }
    z_model, z_optimizer = zerojax.initialize(
        z_model, z_optimizer, config=config, loss_fn=lm_loss, seed=0
    )
    zerojax_loss = one_step(z_model, z_optimizer, tokens, targets)
    jax.block_until_ready((z_model.engine.state.params, z_model.engine.state.opt_state))
    return (model, optimizer, torch_loss), (z_model, z_optimizer, zerojax_loss), (tokens, targets)


def host_copy(engine) -> dict:
    """The params and optimizer state as numpy arrays (owned copies, out of the next update's
    reach), keyed by their tree paths."""
    import jax
    import numpy as np

    state = engine.state
    leaves = jax.tree_util.tree_leaves_with_path({"params": state.params, "opt": state.opt_state})
    return {jax.tree_util.keystr(path): np.array(leaf) for path, leaf in leaves}


def zero_state(engine) -> None:
    """Params and optimizer state set to zeros: a restore that writes nothing then shows."""
    import jax
    import numpy as np

    state = engine.state
    zeros = lambda tree: jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)
    engine.load(state.replace(params=zeros(state.params), opt_state=zeros(state.opt_state)))


class ZerojaxContender:
    name = "zerojax Checkpointer (async, Orbax)"

    def __init__(self, root: Path, model, optimizer):
        from zerojax import Checkpointer

        self.engine = model.engine
        self.ckpt = Checkpointer(root / "zerojax", model, optimizer, max_to_keep=None)

    def save(self, step: int) -> tuple[float, float, int]:
        """(blocking s, total s, bytes on disk)."""
        start = time.perf_counter()
        self.ckpt.save(step, force=True)
        blocking = time.perf_counter() - start
        self.ckpt.wait()
        return blocking, time.perf_counter() - start, dir_bytes(self.ckpt.step_dir(step))

    def restore(self, step: int) -> float:
        import jax

        start = time.perf_counter()
        self.ckpt.restore(step)
        jax.block_until_ready((self.engine.state.params, self.engine.state.opt_state))
        return time.perf_counter() - start

    def delete(self, step: int) -> None:
        shutil.rmtree(self.ckpt.step_dir(step), ignore_errors=True)


class TorchContender:
    name = "torch.save / torch.load"

    def __init__(self, root: Path, model, optimizer, device: str):
        self.root, self.model, self.optimizer = root / "torch", model, optimizer
        self.device = device
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        return self.root / f"{step}.pt"

    def synchronize(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def save(self, step: int) -> tuple[float, float, int]:
        import torch

        start = time.perf_counter()
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        torch.save(state, self.path(step))
        seconds = time.perf_counter() - start
        return seconds, seconds, dir_bytes(self.path(step))

    def restore(self, step: int) -> float:
        import torch

        start = time.perf_counter()
        state = torch.load(self.path(step), weights_only=True, map_location=self.device)
        self.synchronize()
        seconds = time.perf_counter() - start
        del state
        return seconds

    def delete(self, step: int) -> None:
        self.path(step).unlink(missing_ok=True)


def run(ctx: Context, report: SectionReport) -> None:
    root = Path(ctx.scratch_dir) / "checkpoints"
    (t_model, t_opt, t_loss), (z_model, z_opt, z_loss), batch = build_states(
        ctx, str(root / "jax_cache")
    )
    engine = z_model.engine
    if ctx.time_left() < 5:  # a save, a restore and a step each: seconds on the CPU
        report.notes.append(f"skipped after building the states: {ctx.time_left():.0f} s left")
        return
    zerojax_side = ZerojaxContender(root, z_model, z_opt)
    torch_side = TorchContender(root, t_model, t_opt, ctx.torch_device)
    # name -> {"blocking": [s], "total": [s], "restore": [s], "bytes": int}: the warm-up's
    # (first calls: setup included) and the timed repeats'.
    warm_up: dict[str, dict] = {}
    timed: dict[str, dict] = {}

    def measure(contender, step: int, into: dict) -> None:
        blocking, total, nbytes = contender.save(step)
        restore = contender.restore(step)
        result = into.setdefault(contender.name, {"blocking": [], "total": [], "restore": []})
        result["blocking"].append(blocking)
        result["total"].append(total)
        result["restore"].append(restore)
        result["bytes"] = nbytes

    # Warm-up (step 0) with the checks: the state is taken aside and saved, a step is taken
    # from it directly, then the state is zeroed, restored, compared, and the step retaken.
    saved = host_copy(engine)
    contenders = []
    try:
        blocking, total, nbytes = zerojax_side.save(0)
        direct_loss = one_step(z_model, z_opt, *batch)
        zero_state(engine)
        restore = zerojax_side.restore(0)
        warm_up[zerojax_side.name] = {
            "blocking": [blocking],
            "total": [total],
            "restore": [restore],
            "bytes": nbytes,
        }
        restored = host_copy(engine)
        differing = [
            key for key, value in saved.items() if not _bitwise_equal(value, restored[key])
        ]
        report.check(
            "restored zerojax state is bitwise the saved one",
            not differing,
            f"{len(saved)} arrays (params and every optimizer-state array), zeroed before the "
            f"restore; "
            + (f"{len(differing)} differ, e.g. {differing[:3]}" if differing else "all equal"),
        )
        restored_loss = one_step(z_model, z_opt, *batch)
        report.check(
            "the step after restore gives the loss of the step without save/restore",
            restored_loss == direct_loss,
            f"step 2's loss from the restored state {restored_loss!r} vs from the state in "
            f"memory {direct_loss!r}: bitwise, as the same program on bitwise-equal inputs "
            f"(dropout off, the rng restored) must give",
        )
        zerojax_side.delete(0)
        contenders.append(zerojax_side)
    except Exception as exc:  # noqa: BLE001 (reported; the torch side still runs)
        report.check("zerojax save / restore", False, f"{type(exc).__name__}: {exc}"[:500])
    try:
        measure(torch_side, 0, warm_up)
        torch_side.delete(0)
        contenders.append(torch_side)
    except Exception as exc:  # noqa: BLE001
        report.notes.append(f"torch.save / torch.load failed: {type(exc).__name__}: {exc}"[:500])
    print(f"checkpoints: warm-up {warm_up}", flush=True)

    # Timed repeats, interleaved, while one more fits in the time left (5 s to spare).
    repeat_seconds = sum(r["total"][0] + r["restore"][0] for r in warm_up.values())
    repeats = 0
    while repeats < MAX_REPEATS and contenders and ctx.time_left() > 2 * repeat_seconds + 5:
        repeats += 1
        start = time.monotonic()
        for contender in list(contenders):
            try:
                measure(contender, repeats, timed)
                contender.delete(repeats)
            except Exception as exc:  # noqa: BLE001 (the other contender goes on)
                report.notes.append(
                    f"{contender.name}, repeat {repeats}: {type(exc).__name__}: {exc}"[:500]
                )
                contenders.remove(contender)
                timed.pop(contender.name, None)
        repeat_seconds = time.monotonic() - start
    zerojax_side.ckpt.close()

    results = timed if repeats else warm_up
    vocab, _, width, layers, _, _ = CPU_SHAPE if ctx.cpu else GPU_SHAPE
    num_params = sum(p.numel() for p in t_model.parameters())
    state_bytes = sum(a.nbytes for a in saved.values())
    table = report.table(
        f"Checkpoint save / restore of a training state on the {ctx.torch_device}: GPT-2-style "
        f"({layers} layers, width {width}, vocabulary {vocab}: {num_params / 1e6:.3g}M params, "
        f"{state_bytes / 2**20:.3g} MiB of fp32 weights + AdamW moments) after one step; "
        + (
            f"medians of {repeats} interleaved repeats after one warm-up"
            if repeats
            else "NO timed repeat fitted in the time: the warm-up's first calls, setup included"
        )
        + f"; into {root.parent} ({filesystem_of(root)}); ms. zerojax: blocking = `save()` "
        f"returning, total = `wait()` returning, restore = `restore()` + block_until_ready; "
        f"torch: `torch.save` of the model + optimizer state_dicts (blocking = total), "
        f"`torch.load(map_location='{ctx.torch_device}')` + synchronize",
        ["contender", "blocking save ms", "total save ms", "restore ms", "bytes on disk"]
        + ["blocking vs torch.save", "total vs torch.save", "restore vs torch.load"],
    )
    keys = ("blocking", "total", "restore")
    medians = {
        name: {key: statistics.median(r[key]) for key in keys} for name, r in results.items()
    }
    base = medians.get(torch_side.name)
    for name, m in medians.items():
        ratios = [m[key] / base[key] if base else None for key in keys]
        table.add(name, *(m[key] * 1e3 for key in keys), results[name]["bytes"], *ratios)
    report.notes.append(
        f"first-step loss: plain torch on {ctx.torch_device} {t_loss:.5f}, zerojax {z_loss:.5f} "
        f"(same seed and batch; fp32)"
    )


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding `path` (ext4, xfs, tmpfs: RAM, overlay, ...), from
    /proc/mounts; "filesystem unknown" where there is none."""
    path = path.resolve()
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return "filesystem unknown"
    holding = [(point, kind) for point, kind in mounts if path.is_relative_to(point)]
    return max(holding, key=lambda m: len(m[0]))[1] if holding else "filesystem unknown"


def _bitwise_equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
