"""A checkpoint's model as one torch or safetensors file, one tensor in memory at a time.

    zerojax ckpt export runs/gpt --format safetensors model.safetensors [--dtype bfloat16]

Every state_dict entry of the saved model is written, as `model.state_dict()` has it: tied
aliases included (sharing their storage in a torch file, a copy in safetensors, which has no
sharing), each in its torch dtype (`meta.parameters[...]["dtype"]`) -- int64 buffers come back
as int64 though JAX stored them as int32, bf16 params as bf16 though fp32 master weights were
stored -- or in `dtype` for floating-point entries when given.

Memory: the file header is computed from the metadata, then each stored array is restored
alone from Orbax (`PyTreeRestore(partial_restore=True)` to host numpy), cast, appended and
dropped; peak memory stays near the largest tensor (twice it while casting), never the model.

The file is written under a temporary name in the output's directory and renamed over OUT
only once complete: an interrupted export leaves no half file and never touches an existing
OUT. The step's manifest is verified first, so a damaged checkpoint is named, not exported.

    >>> export_checkpoint("runs/gpt", "gpt.pt", format="torch")
    PosixPath('gpt.pt')
    >>> torch.load("gpt.pt", weights_only=True)["lm_head.weight"].dtype
    torch.float32
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TextIO

import numpy as np

from zerojax.ckpt import layout
from zerojax.ckpt.errors import CheckpointCorruptedError, CheckpointError
from zerojax.ckpt.inspect import OpenedStep, human_bytes, open_step
from zerojax.ckpt.manifest import verify_manifest
from zerojax.ckpt.safetensors_io import SafetensorsWriter
from zerojax.ckpt.torch_io import (
    TensorSpec,
    TorchStateDictWriter,
    is_floating,
    numpy_dtype,
)

__all__ = ["EXPORT_DTYPES", "FORMATS", "export_checkpoint"]

FORMATS = ("safetensors", "torch")
EXPORT_DTYPES = ("float32", "bfloat16", "float16", "float64")
_SUFFIXES = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


class _Progress:
    """`exporting 12/148 tensors, 1.2 GiB/3.4 GiB` redrawn in place on stderr; silent unless
    enabled (the CLI enables it on a terminal without --quiet)."""

    def __init__(self, total_count: int, total_bytes: int, stream: TextIO | None):
        self.total_count, self.total_bytes, self.stream = total_count, total_bytes, stream
        self.count = self.bytes = 0
        self._last = 0.0

    def advance(self, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes
        now = time.monotonic()
        if self.stream is not None and (now - self._last > 0.1 or self.count == self.total_count):
            self._last = now
            width = 30
            filled = int(width * self.bytes / self.total_bytes) if self.total_bytes else width
            self.stream.write(
                f"\r[{'#' * filled}{'.' * (width - filled)}] {self.count}/{self.total_count} "
                f"tensors, {human_bytes(self.bytes)}/{human_bytes(self.total_bytes)}"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.count:
            self.stream.write("\n")
            self.stream.flush()


def _read_leaf(opened: OpenedStep, key: str, leaf) -> np.ndarray:
    """One stored array of the `model` item, restored alone to host memory."""
    import jax
    import orbax.checkpoint as ocp

    target = {key: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)}
    args = ocp.args.PyTreeRestore(
        target,
        restore_args={key: ocp.RestoreArgs(restore_type=np.ndarray)},
        partial_restore=True,
    )
    try:
        restored = opened.manager.restore(opened.step, args=ocp.args.Composite(model=args))
    except Exception as exc:  # tensorstore raises anything; here it means damaged files
        raise CheckpointCorruptedError(
            f"checkpoint {opened.step_dir}: array {key!r} of item {layout.MODEL!r} cannot be "
            f"read ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]})",
            path=str(opened.step_dir / layout.MODEL),
        ) from exc
    return np.asarray(restored[layout.MODEL][key])


def _plan(opened: OpenedStep, dtype: str | None) -> list[tuple[str, tuple, str, str]]:
    """(name, shape, output torch dtype, stored key) per state_dict entry, in order."""
    model_tree = opened.item_tree(layout.MODEL) or {}
    plan = []
    for name, entry in opened.meta["parameters"].items():
        shape = tuple(int(d) for d in entry["shape"])
        source = entry.get("tied_to") or name
        out_dtype = entry["dtype"]
        numpy_dtype(out_dtype)  # an unsupported torch dtype fails before any file is opened
        if dtype is not None and is_floating(out_dtype):
            out_dtype = dtype
        if source not in model_tree:
            if int(np.prod(shape, dtype=np.int64)) != 0:
                raise CheckpointCorruptedError(
                    f"checkpoint {opened.step_dir}: {name!r} ({entry['dtype']}{list(shape)}) "
                    f"has no array {source!r} in the {layout.MODEL!r} item",
                    path=str(opened.step_dir / layout.MODEL),
                )
        elif tuple(model_tree[source].shape) != shape:
            raise CheckpointCorruptedError(
                f"checkpoint {opened.step_dir}: {name!r} is {list(shape)} in meta but the "
                f"stored array {source!r} is {list(model_tree[source].shape)}",
                path=str(opened.step_dir / layout.MODEL),
            )
        plan.append((name, shape, out_dtype, source))
    return plan


def export_checkpoint(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    *,
    format: str | None = None,
    step: int | None = None,
    dtype: str | None = None,
    progress: TextIO | None = None,
) -> Path:
    """Write the model of checkpoint `directory` (step `step`, default the latest) to `out`.

    `format`: "safetensors" or "torch" (None: from the suffix, .safetensors / .pt .pth .bin).
    `dtype`: cast every floating-point entry to this torch dtype name (one of EXPORT_DTYPES);
    integer and bool entries keep theirs. `progress`: a stream for the progress bar (None:
    silent). Returns `out`. Raises ValueError for bad arguments, CheckpointNotFoundError,
    CheckpointCorruptedError (named file) for a damaged step.

    >>> export_checkpoint("runs/gpt", "gpt.safetensors", dtype="bfloat16")
    >>> safetensors.torch.load_file("gpt.safetensors")["transformer.wte.weight"].dtype
    torch.bfloat16
    """
    out = Path(out)
    if format is None:
        format = _SUFFIXES.get(out.suffix)
        if format is None:
            raise ValueError(
                f"export: cannot tell the format from {str(out)!r}; pass format= one of "
                f"{', '.join(FORMATS)} (or name the file .safetensors / .pt)"
            )
    if format not in FORMATS:
        raise ValueError(f"export: format={format!r}; use one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"export: dtype={dtype!r}; use one of {', '.join(EXPORT_DTYPES)}")
    if out.is_dir():
        raise ValueError(f"export: output {str(out)!r} is a directory; name a file")
    if not out.parent.is_dir():
        raise ValueError(f"export: the directory of {str(out)!r} does not exist")

    with open_step(directory, step) as opened:
        verify_manifest(opened.step_dir)
        plan = _plan(opened, dtype)
        model_tree = opened.item_tree(layout.MODEL) or {}
        tmp = out.with_name(f".{out.name}.zerojax-tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                if format == "torch":
                    _write_torch(f, opened, plan, model_tree, progress)
                else:
                    _write_safetensors(f, opened, plan, model_tree, progress)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except OSError as exc:  # reading errors are CheckpointCorruptedError by here
            tmp.unlink(missing_ok=True)
            raise CheckpointError(
                f"export: cannot write {str(out)!r} (step {opened.step}): {exc}"
            ) from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return out


def _reader(opened: OpenedStep, model_tree):
    """source key -> array in the given dtype: one restore per call, nothing kept."""

    def read(source: str, shape: tuple, out_dtype: str) -> np.ndarray:
        target = numpy_dtype(out_dtype)
        if source not in model_tree:  # zero-size: Orbax stores none, nothing to read
            return np.zeros(shape, target)
        array = _read_leaf(opened, source, model_tree[source])
        # int32 -> int64 (JAX stores no int64), fp32 master -> bf16, or the --dtype cast.
        return array.astype(target, copy=False)

    return read


def _write_torch(f, opened, plan, model_tree, stream) -> None:
    specs, first = [], {}
    for name, shape, out_dtype, source in plan:
        owner = first.get(source)
        alias = owner is not None and owner[1] == out_dtype
        specs.append(TensorSpec(name, shape, out_dtype, alias_of=owner[0] if alias else None))
        if owner is None:
            first[source] = (name, out_dtype)
    writer = TorchStateDictWriter(f, specs)
    by_name = {s.name: s for s in specs}
    sources = {name: source for name, _, _, source in plan}
    read = _reader(opened, model_tree)
    progress = _Progress(
        len(writer.storage_names), sum(by_name[n].nbytes for n in writer.storage_names), stream
    )
    for name in writer.storage_names:
        spec = by_name[name]
        array = read(sources[name], spec.shape, spec.dtype)
        writer.write(name, array)
        progress.advance(array.nbytes)
        del array  # before the next restore: one tensor in memory at a time
    writer.close()
    progress.close()


def _write_safetensors(f, opened, plan, model_tree, stream) -> None:
    entries = [(name, shape, numpy_dtype(out_dtype)) for name, shape, out_dtype, _ in plan]
    # Group entries reading the same stored array (tied aliases) so it is restored once and
    # written for each of them while in memory.
    groups: dict[str, list[int]] = {}
    for index, (_, _, _, source) in enumerate(plan):
        groups.setdefault(source, []).append(index)
    order = [plan[i][0] for indices in groups.values() for i in indices]
    writer = SafetensorsWriter(f, entries, data_order=order)
    read = _reader(opened, model_tree)
    progress = _Progress(len(plan), writer.total_bytes, stream)
    for source, indices in groups.items():
        cache: dict[str, np.ndarray] = {}
        for i in indices:
            name, shape, out_dtype, _ = plan[i]
            if out_dtype not in cache:
                cache[out_dtype] = read(source, shape, out_dtype)
            writer.write(name, cache[out_dtype])
            progress.advance(cache[out_dtype].nbytes)
        del cache
    writer.close()
    progress.close()


def return_large_frees_to_os() -> None:
    """Have glibc serve allocations >= 1 MiB by mmap, so each exported tensor's memory goes
    back to the OS when it is dropped.

    By default glibc raises its mmap threshold (up to 32 MiB) after the first large free,
    after which freed tensor buffers stay in the per-thread arenas of tensorstore's workers:
    exporting 12.5 MiB tensors then peaks ~8 tensors above the baseline instead of ~3. It is
    a process-wide setting, so the `zerojax ckpt export` command calls it, not the library.
    No-op where glibc's mallopt is not available.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold = -3
    mallopt(m_mmap_threshold, 1 << 20)


def progress_stream(quiet: bool) -> TextIO | None:
    """stderr when it is a terminal and not `quiet`, else None (no progress bar)."""
    if quiet or not sys.stderr.isatty():
        return None
    return sys.stderr
