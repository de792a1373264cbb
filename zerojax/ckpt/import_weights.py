"""A torch or safetensors state_dict file as a zerojax checkpoint step.

    zerojax ckpt import model.safetensors runs/gpt [--step 0]

The step holds only the `model` and `meta` items (`zerojax.ckpt.layout`): no optimizer or
train state, `config`/`optimizer`/`scheduler`/`torch_rng` None, engine counters zero, `extra`
{}. `Checkpointer.restore` loads it onto any mesh like a saved step (weights only), so a
Hugging Face or plain torch checkpoint starts a zerojax run, and `zerojax ckpt export` turns it
back into the same file, bit for bit.

Tensors are stored in their own dtype (int64 stays int64 on disk; restoring casts to what the
engine holds). Entries that share storage in a torch file -- tied weights, as
`torch.save(model.state_dict())` writes GPT-2's wte/lm_head -- are stored once, the later
names with `tied_to` set to the first; equal values in separate storages are not ties.
safetensors has no shared storage, so its entries are never tied. A state_dict file does not
say which entries are parameters: floating-point entries get kind "parameter", the others
"buffer".

    >>> import_weights("gpt2.pt", "runs/gpt")          # -> 'runs/gpt/0'
"""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from zerojax.ckpt import layout
from zerojax.ckpt.errors import CheckpointError, CheckpointFormatError
from zerojax.ckpt.inspect import list_steps
from zerojax.ckpt.safetensors_io import read_safetensors
from zerojax.ckpt.torch_io import (
    NUMPY_DTYPES,
    is_floating,
    load_torch_file,
    tensor_to_numpy,
    torch_dtype_name,
)

__all__ = ["import_weights", "read_state_dict_file"]


def _check_zip_crcs(path: str) -> None:
    """A torch zip file's members against their crc32s: torch.load does not check them, so a
    flipped bit in a tensor's bytes loaded as a wrong value. One read of the file, in chunks,
    before torch.load memory-maps it (from the page cache by then)."""
    if not zipfile.is_zipfile(path):
        return  # legacy pickles carry no checksum; torch.load reports what it cannot read
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise CheckpointFormatError(
            f"import: {path!r} is a damaged zip file: {type(exc).__name__}: {exc}", path=path
        ) from exc
    if bad is not None:
        raise CheckpointFormatError(
            f"import: {path!r}: member {bad!r} fails its crc32 check: the file was damaged "
            f"after it was written",
            path=path,
        )


def read_state_dict_file(file: str | os.PathLike) -> list[tuple[str, np.ndarray, str, str | None]]:
    """(name, numpy array, torch dtype name, tied_to) per entry of a state_dict file, in order.

    `.safetensors` is read by zerojax's own reader, anything else by
    `torch.load(weights_only=True, mmap=True)`; arrays are views of the memory-mapped file.
    ValueError names the file and what is wrong: missing, unreadable, not a state_dict (with
    the offending keys), unsupported dtype or layout.

    >>> [(n, a.shape, d, t) for n, a, d, t in read_state_dict_file("tiny.pt")][:2]
    [('wte.weight', (50, 64), 'float32', None), ('lm_head.weight', (50, 64), 'float32',
      'wte.weight')]
    """
    path = os.fspath(file)
    if not os.path.isfile(path):
        raise ValueError(f"import: {path!r}: no such file")
    if path.endswith(".safetensors"):
        arrays, _ = read_safetensors(path)
        return [(name, array, array.dtype.name, None) for name, array in arrays.items()]

    import torch

    _check_zip_crcs(path)
    # Never runs code from the file: CheckpointFormatError naming it if it needs some.
    loaded = load_torch_file(path)
    if not isinstance(loaded, Mapping):
        raise ValueError(  # noqa: TRY004 - the file's content is wrong, not an argument's type
            f"import: {path!r} holds a {type(loaded).__name__}, not a state_dict (a dict of "
            "tensors); save model.state_dict()"
        )
    not_tensors = [k for k, v in loaded.items() if not isinstance(v, torch.Tensor)]
    if not_tensors or not all(isinstance(k, str) for k in loaded):
        shown = ", ".join(f"{k!r} ({type(loaded[k]).__name__})" for k in not_tensors[:5])
        nested = [k for k in not_tensors if isinstance(loaded[k], Mapping)]
        hint = (
            f"; it looks like a training checkpoint -- save its {nested[0]!r} entry alone"
            if nested
            else ""
        )
        raise ValueError(
            f"import: {path!r} is not a state_dict: entries that are not tensors: "
            f"{shown or 'non-string keys'}{hint}"
        )
    entries, owners = [], {}
    for name, tensor in loaded.items():
        dtype = torch_dtype_name(tensor.dtype)
        where = f"import: {path!r}: {name!r}"
        if dtype not in NUMPY_DTYPES:
            raise ValueError(f"{where} has dtype {dtype}; supported: {', '.join(NUMPY_DTYPES)}")
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise ValueError(f"{where} is a {tensor.layout} tensor; only dense tensors import")
        tied_to = None
        if tensor.numel() > 0:
            # Same storage, same view: the same tensor saved under two names (tied weights).
            identity = (
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
                tensor.dtype,
            )
            tied_to = owners.setdefault(identity, name)
            tied_to = None if tied_to == name else tied_to
        entries.append((name, tensor_to_numpy(tensor), dtype, tied_to))
    return entries


def import_weights(file: str | os.PathLike, directory: str | os.PathLike, *, step: int = 0) -> Path:
    """Write the state_dict in `file` as step `step` of checkpoint `directory`; returns the
    step directory. See the module docstring for what the step holds.

    Refuses (CheckpointError) when the step exists or a later one does (Orbax only appends
    steps); ValueError for an unreadable file or a step < 0 (CheckpointFormatError, also a
    CheckpointError, for a malformed safetensors file). A write that fails (a full disk, a
    read-only directory) raises CheckpointError and leaves nothing behind.

    >>> import_weights("gpt2.safetensors", "runs/gpt2")
    PosixPath('runs/gpt2/0')
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"import: step={step!r}; use an integer >= 0")
    directory = Path(directory).absolute()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"import: {str(directory)!r} exists and is not a directory")
    if directory.is_dir():
        steps, _ = list_steps(directory)
        if step in steps:
            raise CheckpointError(
                f"import: step {step} already exists in {directory}; not overwriting it. Pass "
                f"--step with a new number or another directory"
            )
        later = [s for s in steps if s > step]
        if later:
            raise CheckpointError(
                f"import: {directory} already holds step(s) {later} after step {step}; Orbax "
                f"only adds steps after the latest: pass --step {steps[-1] + 1} or use an "
                f"empty directory"
            )

    entries = read_state_dict_file(file)
    if not entries:
        raise ValueError(f"import: {os.fspath(file)!r} holds no tensors")
    parameters, tree = {}, {}
    for name, array, dtype, tied_to in entries:
        parameters[name] = {
            "shape": list(array.shape),
            "dtype": dtype,
            "stored_dtype": array.dtype.name,
            "kind": "parameter" if is_floating(dtype) else "buffer",
            "tied_to": tied_to,
        }
        # Orbax cannot store zero-size arrays; meta's shape is all an empty tensor needs.
        if tied_to is None and array.size > 0:
            tree[name] = array
    meta = {
        "format": layout.FORMAT,
        "step": step,
        "config": None,
        "parameters": parameters,
        "optimizer": None,
        "scheduler": None,
        "engine": {"num_calls": 0, "skipped_steps": 0},
        "torch_rng": None,
        "extra": {},
    }
    created = not directory.exists()
    try:
        _write_step(directory, step, tree, meta)
    except BaseException as exc:
        # Nothing half-written stays: this call's temporary directory, a step committed
        # without its manifest, the directory if this call created it. The step did not
        # exist before (checked above), so whatever carries its number is this call's.
        _remove_partial(directory, step, created)
        if not isinstance(exc, Exception):
            raise
        raise CheckpointError(
            f"import: writing step {step} of {directory} failed, nothing was kept: "
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        ) from exc
    return directory / str(step)


def _write_step(directory: Path, step: int, tree: dict, meta: dict) -> None:
    """Orbax's save of the `model` and `meta` items, committed with their manifest (the
    Checkpointer's commit: `commit.manager_options`), so a crash never leaves a visible step
    without one."""
    import orbax.checkpoint as ocp

    from zerojax.ckpt.commit import manager_options

    manager = ocp.CheckpointManager(
        directory,
        item_handlers={
            layout.MODEL: ocp.PyTreeCheckpointHandler(),
            layout.META: ocp.JsonCheckpointHandler(),
        },
        options=manager_options(enable_async_checkpointing=False, create=True),
    )
    try:
        saved = manager.save(
            step,
            args=ocp.args.Composite(
                **{layout.MODEL: ocp.args.PyTreeSave(tree), layout.META: ocp.args.JsonSave(meta)}
            ),
        )
        manager.wait_until_finished()
    finally:
        manager.close()
    if not saved:  # pragma: no cover - the step checks above make Orbax accept the save
        raise CheckpointError(f"import: Orbax declined to save step {step} in {directory}")


def _remove_partial(directory: Path, step: int, created: bool) -> None:
    if not directory.is_dir():
        return
    for name in os.listdir(directory):
        if name == str(step) or name.startswith(f"{step}.orbax-checkpoint-tmp"):
            shutil.rmtree(directory / name, ignore_errors=True)
    if created:
        shutil.rmtree(directory, ignore_errors=True)
