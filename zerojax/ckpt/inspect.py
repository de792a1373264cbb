"""What a checkpoint directory holds, read from `meta` and Orbax's metadata -- no array data.

`zerojax ckpt inspect DIR [--step S] [--json] [--verify]` prints
`format_description(describe(DIR))`: the committed steps (and uncommitted step directories and
partial saves, which restore and export ignore), then for one step every state_dict entry with
shape, torch dtype, dtype on disk and bytes, whether optimizer state is present, the step, the
`extra` dict and the saving run's config. `verify_checkpoint` adds everything about a step
that could not be verified (no manifest, a damaged file, a missing item or array, unreadable
metadata); `--verify` prints it and exits non-zero unless it is empty.

    >>> info = describe_checkpoint("runs/gpt")           # latest step
    >>> info["step"], info["total_bytes"], info["optimizer_state"]["present"]
    (200, 1093632, True)
    >>> print(format_description(info))

`open_step` is the reading entry point `zerojax.ckpt.export` shares: it resolves the step,
opens an Orbax manager that never writes, and reads and checks `meta`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import numpy as np

from zerojax.ckpt import commit, layout
from zerojax.ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
)
from zerojax.ckpt.manifest import manifest_problems, verify_manifest

__all__ = [
    "OpenedStep",
    "describe_checkpoint",
    "format_description",
    "list_steps",
    "open_step",
    "verify_checkpoint",
]


def list_steps(directory: str | os.PathLike) -> tuple[list[int], list[str]]:
    """(committed steps ascending, names of the other step directories) of a checkpoint dir.

    The others are never read: partial saves (`<step>.orbax-checkpoint-tmp`, a save that
    never committed: the process died mid-write) and uncommitted steps (numbered, without a
    manifest: `zerojax.ckpt.commit`).

    >>> list_steps("runs/gpt")
    ([100, 200], ['300', '400.orbax-checkpoint-tmp'])
    """
    listing = _scan(directory)
    return listing.committed, sorted([*map(str, listing.uncommitted), *listing.partial])


def _scan(directory: str | os.PathLike) -> commit.StepListing:
    directory = Path(directory)
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        raise CheckpointNotFoundError(f"checkpoint directory {str(directory)!r} {problem}")
    return commit.scan(directory)


@dataclasses.dataclass(frozen=True, slots=True)
class OpenedStep:
    """One committed step, ready to read: its `meta` (checked), and a read-only manager."""

    directory: Path
    step: int
    step_dir: Path
    meta: dict
    manager: Any
    """an `orbax.checkpoint.CheckpointManager` created with `create=False` that never saves"""

    def item_tree(self, item: str) -> Mapping | None:
        """Orbax's per-leaf metadata (shape, dtype) of one array item; None if absent."""
        if not (self.step_dir / item).is_dir():
            return None
        try:
            metadata = self.manager.item_metadata(self.step)[item]
        except Exception as exc:  # any reader failure: damaged files
            raise CheckpointCorruptedError(
                f"checkpoint {self.step_dir}: the metadata of item {item!r} cannot be read "
                f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]})",
                path=str(self.step_dir / item),
            ) from exc
        return getattr(metadata, "tree", metadata)

    def close(self) -> None:
        """Release the manager's resources (threads); the step stays as it is."""
        self.manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _handlers() -> dict:
    import orbax.checkpoint as ocp

    return {
        layout.MODEL: ocp.PyTreeCheckpointHandler(),
        layout.OPTIMIZER: ocp.PyTreeCheckpointHandler(),
        layout.TRAIN_STATE: ocp.PyTreeCheckpointHandler(),
        layout.META: ocp.JsonCheckpointHandler(),
    }


def open_step(
    directory: str | os.PathLike, step: int | None = None, *, uncommitted: bool = False
) -> OpenedStep:
    """Resolve `step` (None: the latest committed one) and read its `meta`.

    An uncommitted step (no manifest) is opened only when asked for by number with
    `uncommitted=True` (`zerojax ckpt inspect --step S` shows one; nothing reads it).

    Raises CheckpointNotFoundError (no directory, no steps, or not that step; lists the
    steps there are), CheckpointCorruptedError (an uncommitted step; no readable meta),
    CheckpointError (meta of another format).

    >>> opened = open_step("runs/gpt", 200)
    >>> opened.meta["parameters"]["lm_head.weight"]["tied_to"]
    'transformer.wte.weight'
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    listing = _scan(directory)
    steps = listing.committed
    if step is not None and step in listing.uncommitted:
        if not uncommitted:
            verify_manifest(directory / str(step))  # raises: it has none
    elif not steps:
        others = [*map(str, listing.uncommitted), *listing.partial]
        extra = f" (uncommitted or partial only: {', '.join(others)})" if others else ""
        raise CheckpointNotFoundError(f"no committed checkpoint step in {directory}{extra}")
    if step is None:
        step = steps[-1]
    elif step not in steps and step not in listing.uncommitted:
        raise CheckpointNotFoundError(
            f"step {step} not found in {directory}; available steps: {', '.join(map(str, steps))}"
        )
    step_dir = directory / str(step)
    meta_dir = step_dir / layout.META
    if not meta_dir.is_dir():
        raise CheckpointCorruptedError(
            f"checkpoint step {step_dir} has no {layout.META!r} item; it was not written by "
            "zerojax or was damaged",
            path=str(meta_dir),
        )
    # create=False: opening a manager must never create or clean anything in the directory.
    # Orbax's plain options: an uncommitted step (which `commit.manager_options` would refuse
    # to read) is opened only for `inspect`, and only when asked for by number.
    manager = ocp.CheckpointManager(
        directory, item_handlers=_handlers(), options=ocp.CheckpointManagerOptions(create=False)
    )
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta[layout.META]
    except Exception as exc:  # any reader failure: damaged files
        raise CheckpointCorruptedError(
            f"checkpoint {step_dir}: {layout.META!r} cannot be read ({type(exc).__name__}: "
            f"{str(exc).strip()[:300]})",
            path=str(meta_dir),
        ) from exc
    if not isinstance(meta, Mapping) or meta.get("format") != layout.FORMAT:
        found = meta.get("format") if isinstance(meta, Mapping) else type(meta).__name__
        raise CheckpointError(
            f"{step_dir} is not a zerojax checkpoint: meta format {found!r}, expected "
            f"{layout.FORMAT!r}"
        )
    if not isinstance(meta.get("parameters"), Mapping):
        raise CheckpointCorruptedError(
            f"checkpoint {step_dir}: meta has no parameter table", path=str(meta_dir)
        )
    return OpenedStep(directory, step, step_dir, dict(meta), manager)


def _leaf_bytes(leaf: Any) -> int:
    shape = tuple(getattr(leaf, "shape", ()) or ())
    dtype = getattr(leaf, "dtype", None)
    itemsize = np.dtype(dtype).itemsize if dtype is not None else 0
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _flat_leaves(tree: Any) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))


def describe_checkpoint(directory: str | os.PathLike, step: int | None = None) -> dict:
    """A JSON-serialisable description of one step (default: the latest) -- see the module
    docstring. Reads `meta` and Orbax's metadata files only.

    >>> describe_checkpoint("runs/gpt", 100)["parameters"][0]
    {'name': 'transformer.wte.weight', 'shape': [50, 64], 'dtype': 'float32',
     'stored_dtype': 'float32', 'kind': 'parameter', 'tied_to': None, 'bytes': 12800}
    """
    with open_step(directory, step, uncommitted=step is not None) as opened:
        return _describe(opened)


def verify_checkpoint(directory: str | os.PathLike, step: int | None = None) -> dict:
    """`describe_checkpoint` of the step, plus "verified" and "problems": everything about the
    step that could not be verified, one line each -- no manifest, a file that differs from
    it, an item the step says it holds that is missing, a stored entry without its array, or
    metadata that cannot be read (then the description holds the listing only, "described":
    False). Reads every file (checksums). Raises CheckpointNotFoundError only (no directory,
    step, or committed step).

    >>> verify_checkpoint("runs/gpt")["problems"]
    []
    """
    directory = Path(directory).absolute()
    listing = _scan(directory)
    if step is None:
        if not listing.committed:
            open_step(directory)  # raises CheckpointNotFoundError naming what there is
        step = listing.committed[-1]
    elif step not in listing.committed and step not in listing.uncommitted:
        open_step(directory, step)  # raises CheckpointNotFoundError listing the steps
    step_dir = directory / str(step)
    problems = [str(p) for p in manifest_problems(step_dir)]
    try:
        info = describe_checkpoint(directory, step)
    except CheckpointError as exc:  # unreadable meta or item metadata: damage, named
        problems.append(str(exc))
        info = {
            "directory": str(directory),
            "steps": listing.committed,
            "uncommitted": listing.uncommitted,
            "partial": listing.partial,
            "step": step,
            "described": False,
        }
    else:
        info["described"] = True
        problems += [
            f"item {item!r} is missing ({step_dir / item}), although the step says it holds it"
            for item in info["items"]
            if not (step_dir / item).is_dir()
        ]
        problems += [
            f"{p['name']}: listed in meta with shape {p['shape']}, no array in the model item"
            for p in info["parameters"]
            if p.get("missing")
        ]
    info["verified"], info["problems"] = not problems, problems
    return info


def _describe(opened: OpenedStep) -> dict:
    listing = _scan(opened.directory)
    meta = opened.meta
    model_tree = opened.item_tree(layout.MODEL) or {}
    entries, total, elements, tied = [], 0, 0, 0
    for name, entry in meta["parameters"].items():
        shape = [int(d) for d in entry["shape"]]
        row = {
            "name": name,
            "shape": shape,
            "dtype": entry["dtype"],
            "stored_dtype": entry.get("stored_dtype"),
            "kind": entry.get("kind"),
            "tied_to": entry.get("tied_to"),
            "bytes": 0,
        }
        if row["tied_to"] is not None:
            tied += 1
            row["stored_dtype"] = None  # no array of its own
        elif name in model_tree:
            leaf = model_tree[name]
            # Orbax's metadata is what is on disk; meta's stored_dtype is what was intended.
            row["stored_dtype"] = np.dtype(leaf.dtype).name
            row["bytes"] = _leaf_bytes(leaf)
            elements += int(np.prod(shape, dtype=np.int64))
        elif int(np.prod(shape, dtype=np.int64)) != 0:
            row["missing"] = True  # listed in meta, no array in the model item: damaged
        total += row["bytes"]
        entries.append(row)
    optimizer_tree = opened.item_tree(layout.OPTIMIZER)
    optimizer_leaves = _flat_leaves(optimizer_tree) if optimizer_tree is not None else []
    manifest = opened.step_dir / layout.MANIFEST
    return {
        "directory": str(opened.directory),
        "steps": listing.committed,
        "uncommitted": listing.uncommitted,
        "partial": listing.partial,
        "step": opened.step,
        "committed": opened.step in listing.committed,
        "format": meta.get("format"),
        "parameters": entries,
        "num_entries": len(entries),
        "num_tied": tied,
        "num_elements": elements,
        "total_bytes": total,
        "optimizer": meta.get("optimizer"),
        "optimizer_state": {
            "present": optimizer_tree is not None,
            "arrays": len(optimizer_leaves),
            "bytes": sum(_leaf_bytes(leaf) for leaf in optimizer_leaves),
        },
        "train_state": (opened.step_dir / layout.TRAIN_STATE).is_dir(),
        "items": commit.expected_items(opened.step_dir, meta),
        "scheduler": meta.get("scheduler"),
        "engine": meta.get("engine"),
        "extra": meta.get("extra"),
        "config": meta.get("config"),
        "manifest": manifest.is_file(),
    }


def human_bytes(num: int) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024 or unit == "GiB":
            return f"{num} B" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} TiB"  # pragma: no cover


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_description(info: dict) -> str:
    """The human-readable report `zerojax ckpt inspect` prints for `describe_checkpoint`."""
    steps = ", ".join(map(str, info["steps"])) or "none"
    latest = f" (latest {info['steps'][-1]})" if info["steps"] else ""
    lines = [f"checkpoint {info['directory']}: steps {steps}{latest}"]
    for step in info.get("uncommitted", []):
        lines.append(f"  ignored: {step} (uncommitted: no manifest; never restored)")
    for name in info["partial"]:
        lines.append(f"  ignored: {name} (partial save that never committed)")
    state = "" if info.get("committed", True) else ", UNCOMMITTED: no manifest"
    lines += ["", f"step {info['step']} ({info['format']}{state})"]
    rows = [["name", "shape", "dtype", "stored", "kind", "bytes"]]
    for p in info["parameters"]:
        if p["tied_to"] is not None:
            stored, size = "-", f"tied to {p['tied_to']}"
        elif p.get("missing"):
            stored, size = "-", "MISSING from the model item"
        else:
            stored, size = p["stored_dtype"] or "-", f"{p['bytes']:,}"
        rows.append([p["name"], str(p["shape"]), p["dtype"], stored, p["kind"] or "-", size])
    lines += _table(rows)
    tied = f" ({info['num_tied']} tied alias{'es' * (info['num_tied'] != 1)})"
    lines.append(
        f"  {info['num_entries']} entries{tied if info['num_tied'] else ''}, "
        f"{info['num_elements']:,} elements, {info['total_bytes']:,} bytes "
        f"({human_bytes(info['total_bytes'])}) stored"
    )
    lines.append("")
    optimizer, state = info["optimizer"], info["optimizer_state"]
    if state["present"]:
        kind = optimizer["type"] if optimizer else "unknown optimizer"
        groups = (optimizer or {}).get("param_groups") or []
        hyper = ""
        if groups:
            shown = {k: v for k, v in groups[0].items() if isinstance(v, int | float | list)}
            hyper = ", first group " + ", ".join(f"{k}={v}" for k, v in list(shown.items())[:6])
        lines.append(
            f"optimizer: {kind}, {len(groups)} param group{'s' * (len(groups) != 1)}{hyper}; "
            f"state {state['arrays']} arrays, {state['bytes']:,} bytes "
            f"({human_bytes(state['bytes'])})"
        )
    else:
        lines.append("optimizer: none (weights only)")
    lines.append(f"scheduler: {json.dumps(info['scheduler']) if info['scheduler'] else 'none'}")
    engine = info["engine"] or {}
    lines.append("engine: " + ", ".join(f"{k}={v}" for k, v in engine.items()))
    lines.append(f"extra: {json.dumps(info['extra'] or {}, sort_keys=True)}")
    lines.append(
        f"manifest: {'present' if info['manifest'] else 'ABSENT: the step cannot be verified'}"
    )
    if info["config"] is None:
        lines.append("config: none (imported weights)")
    else:
        lines.append("config:")
        pretty = json.dumps(info["config"], indent=2, sort_keys=False)
        lines += ["  " + line for line in pretty.splitlines()]
    return "\n".join(lines)
