"""Damaged files met by readers: every file kind of a step, each item directory, and the
files `zerojax ckpt import` is given.

`step_file_kinds(step_dir)` groups the files of a real step by what they are; the suite takes
the largest file of each kind (in each item) as its representative and applies each of
`DAMAGES` to a fresh copy of the checkpoint. Grouping by pattern rather than listing names
keeps the suite honest as Orbax changes: a file of a kind not known here is its own kind,
"other: <name>", and is damaged like the rest.

`run_step_damage` (in the worker process) then meets the damaged step 2 with four readers:
`zerojax ckpt inspect --verify` and `zerojax ckpt export` of step 2, `restore(2)` and
`restore()` of the latest step, each restore into a freshly initialized engine. Step 1 stays
intact, so "latest" may fall back to it. A reader that changes the directory is flawed: a
read never writes or deletes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import shutil
import time
import warnings
from collections import defaultdict
from pathlib import Path

from tools.fault_injection.outcomes import (
    FLAWED,
    RECOVERED,
    SILENT,
    TOLERATED,
    Row,
    judge_cli,
    judge_error,
    names,
    one_line,
)
from zerojax.ckpt.layout import MANIFEST

DAMAGED_STEP = 2
GOOD_STEP = 1
DAMAGES = ("flip", "truncate", "delete", "empty", "garbage")
NO_MANIFEST_DAMAGES = ("flip", "delete")
"""The damages also applied to a step whose manifest is gone (fewer: the suite's time)."""
ITEM_DIRS = ("model", "optimizer", "train_state", "meta")

_KINDS = [  # (pattern on the path inside an item or the step, kind)
    (r"^_CHECKPOINT_METADATA$", "step metadata (_CHECKPOINT_METADATA)"),
    (r"^commit_success\.txt$", "commit marker (commit_success.txt)"),
    (r"^zerojax_manifest\.json$", "zerojax manifest"),
    (r"^ocdbt\.process_\d+/d/", "array data (ocdbt.process_N/d)"),
    (r"^d/", "array data, merged (d/)"),
    (r"^ocdbt\.process_\d+/manifest\.ocdbt$", "OCDBT process manifest"),
    (r"^manifest\.ocdbt$", "OCDBT root manifest"),
    (r"^_METADATA$", "PyTree metadata (_METADATA)"),
    (r"^_sharding$", "sharding metadata (_sharding)"),
    (r"^array_metadatas/", "array metadatas"),
    (r"^metadata$", "JSON item (metadata)"),
]


def file_kind(relative: str) -> str:
    """'<item>: <kind>' (or '<kind>' at the step's top level) of a file inside a step."""
    item, _, inner = relative.partition("/")
    if not inner:
        item, inner = "", relative
    kind = next((k for pattern, k in _KINDS if re.search(pattern, inner)), None)
    if kind is None:
        kind = f"other: {re.sub(r'[0-9a-f]{16,}', '*', inner)}"
    return f"{item}: {kind}" if item else kind


def step_file_kinds(step_dir: str | os.PathLike) -> dict[str, list[str]]:
    """{kind: [relative paths, largest first]} of every file in a step directory."""
    step_dir = Path(step_dir)
    kinds: dict[str, list[str]] = defaultdict(list)
    for path in step_dir.rglob("*"):
        if path.is_file():
            relative = path.relative_to(step_dir).as_posix()
            kinds[file_kind(relative)].append(relative)
    return {
        kind: sorted(files, key=lambda f: (-(step_dir / f).stat().st_size, f))
        for kind, files in sorted(kinds.items())
    }


def damage(path: Path, how: str, seed: int = 0) -> str:
    """Apply one damage to a file (or remove a directory); returns what was done."""
    if path.is_dir():
        shutil.rmtree(path)
        if how == "empty directory":
            path.mkdir()
            return "every file removed, the directory kept"
        if how == "replace by a file":
            path.write_bytes(b"")
            return "the directory replaced by an empty file"
        return "directory removed"
    data = path.read_bytes()
    if how == "flip":
        # The low bit of the middle byte: a digit in a JSON file becomes another digit, so
        # the file stays well-formed and only a checksum can tell.
        at = len(data) // 2
        if not data:
            path.write_bytes(b"\x01")
            return "empty file given one byte"
        path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])
        return f"bit 0 of byte {at} of {len(data)} flipped"
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
        return f"truncated {len(data)} -> {len(data) // 2} bytes"
    if how == "delete":
        path.unlink()
        return "deleted"
    if how == "empty":
        path.write_bytes(b"")
        return "emptied"
    if how == "garbage":
        path.write_bytes(random.Random(seed).randbytes(max(len(data), 16)))
        return f"replaced by {max(len(data), 16)} random bytes"
    raise ValueError(f"unknown damage {how!r}; use one of {DAMAGES} or a directory")


def listing(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        p.relative_to(directory).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
    }


@contextlib.contextmanager
def captured_warnings():
    """Every warning (warnings.warn or a logging WARNING+) raised inside, as strings."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
        messages.extend(str(w.message) for w in caught)
    finally:
        root.removeHandler(handler)


def run_cli(argv: list[str]) -> tuple[int | str, str, str, BaseException | None]:
    """(exit code, stdout, stderr, escaped exception) of `zerojax <argv>` run in process."""
    from zerojax.cli import main

    out, err = io.StringIO(), io.StringIO()
    escaped = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        except Exception as error:  # noqa: BLE001 - a traceback is what is being judged
            code, escaped = "traceback", error
    return code, out.getvalue(), err.getvalue(), escaped


# --------------------------------------------------------------------------- readers


def restore_row(
    directory: Path,
    step: int | None,
    values: dict,
    seed: int,
    damaged: list[str],
    *,
    step_gone: bool = False,
) -> tuple[str, str]:
    """(verdict, observed) of restoring `step` (None: latest) into a fresh engine.

    `step_gone`: step 2 is no longer a directory, which no reader can tell from a step that
    was never saved; falling back without a warning is then tolerated, not silent."""
    from tools.fault_injection.base import differences, make_model, state_values
    from zerojax.ckpt.checkpointer import Checkpointer

    model, optimizer = make_model(seed)
    paths = [str(directory / str(DAMAGED_STEP)), *damaged]
    with captured_warnings() as warned:
        ckpt = Checkpointer(directory, model, optimizer, max_to_keep=None)
        try:
            state = ckpt.restore(step)
        except Exception as error:  # noqa: BLE001 - judged
            return judge_error(error, DAMAGED_STEP, paths)
        finally:
            with contextlib.suppress(Exception):
                ckpt.close()
    diffs = differences(state_values(model), values[state.step]) if state.step in values else ["?"]
    named = [w for w in warned if names(w, DAMAGED_STEP, paths)]
    if diffs:
        return SILENT, one_line(
            f"restored step {state.step} with {len(diffs)} values not as saved: "
            f"{'; '.join(diffs[:3])}"
        )
    if state.step == DAMAGED_STEP:
        return TOLERATED, f"restored damaged step {state.step} without a word; values intact"
    if step is not None:
        return SILENT, f"asked for step {step}, restored step {state.step} instead"
    if not named and step_gone:
        return TOLERATED, (
            f"fell back to step {state.step} without a warning: step 2 is not a directory "
            f"(as if it had never been saved)"
        )
    if not named:
        return SILENT, f"fell back to step {state.step} without a warning naming step 2"
    return RECOVERED, one_line(f"fell back to step {state.step}, warning: {named[0]}")


def verify_row(directory: Path, damaged: list[str]) -> tuple[str, str]:
    code, _, err, escaped = run_cli(
        ["ckpt", "inspect", str(directory), "--step", str(DAMAGED_STEP), "--verify"]
    )
    if escaped is not None:
        return FLAWED, one_line(f"traceback: {type(escaped).__name__}: {escaped}")
    if code == 0:
        return SILENT, "exit 0: the damaged step verified OK"
    return judge_cli(code, err, DAMAGED_STEP, [str(directory / "2"), *damaged], in_process=True)


def export_row(directory: Path, out: Path, values: dict, damaged: list[str]) -> tuple[str, str]:
    from zerojax.ckpt.safetensors_io import read_safetensors

    code, _, err, escaped = run_cli(
        ["ckpt", "export", str(directory), str(out), "--step", str(DAMAGED_STEP), "--quiet"]
    )
    if escaped is not None:
        return FLAWED, one_line(f"traceback: {type(escaped).__name__}: {escaped}")
    leftovers = [p.name for p in out.parent.iterdir()]
    if code != 0:
        verdict, observed = judge_cli(
            code, err, DAMAGED_STEP, [str(directory / "2"), *damaged], in_process=True
        )
        if leftovers:
            return FLAWED, f"{observed}; left {leftovers} behind"
        return verdict, observed
    arrays, _ = read_safetensors(out)
    saved = {k.removeprefix("model/"): v for k, v in values[DAMAGED_STEP].items()}
    wrong = [n for n in saved.keys() & arrays.keys() if arrays[n].tobytes() != saved[n].tobytes()]
    missing = [n for n in saved if n.count("/") == 0 and n not in arrays]
    if wrong or missing:
        return SILENT, one_line(
            f"exit 0, exported wrong values for {wrong[:3]}, missing {missing[:3]}"
        )
    return TOLERATED, "exit 0, every exported value as saved (the damage was not read)"


def run_step_damage(spec: dict, base_root: Path, scratch: Path, seed: int) -> list[Row]:
    """The four readers on one damaged copy of the base checkpoint."""
    from tools.fault_injection.base import load_values

    values = {s: load_values(base_root, s) for s in (GOOD_STEP, DAMAGED_STEP)}
    work = scratch / f"f{seed}"
    shutil.rmtree(work, ignore_errors=True)
    directory = work / "ckpt"
    shutil.copytree(base_root / "ckpt", directory)
    target = directory / str(DAMAGED_STEP) / spec["target"]
    control = spec["damage"] == "none"
    did = "no damage" if control else damage(target, spec["damage"], seed)
    damaged = [str(target)]
    where = "step 2"
    if spec.get("without_manifest"):
        # A crash between Orbax's commit and the manifest's write left the step without one.
        (directory / str(DAMAGED_STEP) / MANIFEST).unlink(missing_ok=True)
        where = "step 2 without its manifest,"
    before = listing(directory)
    (work / "export").mkdir()
    readers = {
        "inspect --verify": lambda: verify_row(directory, damaged),
        "export": lambda: export_row(
            directory, work / "export" / "model.safetensors", values, damaged
        ),
        "restore(step=2)": lambda: restore_row(directory, DAMAGED_STEP, values, seed, damaged),
        "restore() latest": lambda: restore_row(
            directory,
            None,
            values,
            seed + 1,
            damaged,
            step_gone=not (directory / str(DAMAGED_STEP)).is_dir(),
        ),
    }
    expected = {
        "inspect --verify": "exit non-zero naming step 2 or the file",
        "export": "exit non-zero naming step 2 or the file, no output file",
        "restore(step=2)": "CheckpointError subclass naming step 2 or the file",
        "restore() latest": "CheckpointError naming step 2, or step 1 bit for bit with a "
        "warning naming step 2",
    }
    rows = []
    for reader, run in readers.items():
        start = time.perf_counter()
        try:
            verdict, observed = run()
        except Exception as error:  # noqa: BLE001 - the harness itself must not stop
            verdict, observed = FLAWED, one_line(f"harness error {type(error).__name__}: {error}")
        if control:
            verdict, observed = _as_control(reader, verdict, observed)
        after = listing(directory)
        if after != before and verdict != SILENT:
            changed = sorted(set(after) ^ set(before))[:3] or ["file contents"]
            verdict, observed = FLAWED, f"{observed}; the read changed the directory: {changed}"
            before = after
        rows.append(
            Row(
                fault=f"{where} {spec['label']}: {spec['damage']} | {reader}",
                group=spec["group"],
                expected=CONTROL_EXPECTED[reader] if control else expected[reader],
                observed=one_line(f"[{did}] {observed}"),
                verdict=verdict,
                seconds=round(time.perf_counter() - start, 3),
            )
        )
    shutil.rmtree(work, ignore_errors=True)
    return rows


CONTROL_EXPECTED = {
    "inspect --verify": "exit 0",
    "export": "exit 0, every value as saved",
    "restore(step=2)": "step 2 bit for bit, no warning",
    "restore() latest": "step 2 bit for bit, no warning",
}


def _as_control(reader: str, verdict: str, observed: str) -> tuple[str, str]:
    """The verdict of a reader of the undamaged copy: it must simply work. A reader that
    fails here would be "caught" on every damaged copy too, so the suite's counts hinge on
    these rows."""
    if reader == "inspect --verify":
        ok = verdict == SILENT  # verify_row's "exit 0"
        return (RECOVERED, "exit 0: verified") if ok else (FLAWED, f"false alarm: {observed}")
    if verdict == TOLERATED:
        observed = observed.replace(" (the damage was not read)", "")
        return RECOVERED, observed.replace(
            "damaged step 2 without a word; values intact", "step 2 bit for bit"
        )
    if verdict == SILENT:
        return SILENT, observed
    return FLAWED, f"false alarm: {observed}"


def step_damage_specs(step_dir: Path) -> list[dict]:
    """A control (the undamaged copy, which every reader must read as saved), one spec per
    (file kind, damage) and one per item directory removed."""
    specs = [{"type": "step", "group": "control", "label": "undamaged copy", "target": "",
              "damage": "none"}]  # fmt: skip
    for kind, files in step_file_kinds(step_dir).items():
        for how in DAMAGES:
            specs.append(
                {"type": "step", "group": "file", "label": f"{kind} [{files[0]}]",
                 "target": files[0], "damage": how}
            )  # fmt: skip
    for item in ITEM_DIRS:
        if (step_dir / item).is_dir():
            specs.append(
                {"type": "step", "group": "item", "label": f"{item}/ directory",
                 "target": item, "damage": "delete"}
            )  # fmt: skip
    for how in ("empty directory", "replace by a file"):
        specs.append({"type": "step", "group": "item", "label": "the step directory",
                      "target": "", "damage": how})  # fmt: skip
    # The same step as a crash between commit and manifest leaves it: nothing but the
    # restore's own checks stands between a damaged file and the model.
    for spec in list(specs):
        if (
            spec["group"] != "control"
            and MANIFEST not in spec["target"]
            and spec["damage"] in NO_MANIFEST_DAMAGES
        ):
            specs.append(
                {**spec, "group": f"{spec['group']}-no-manifest", "without_manifest": True}
            )
    return specs


# --------------------------------------------------------------------------- ckpt import


def import_specs() -> list[dict]:
    return [
        {"type": "import", "group": "import", "file": "model.safetensors", "damage": d}
        for d in ("truncate", "header offset digit", "drop last data byte")
    ] + [
        {"type": "import", "group": "import", "file": "model.pt", "damage": d}
        for d in ("truncate", "flip")
    ]


def run_import_damage(spec: dict, base_root: Path, scratch: Path, seed: int) -> list[Row]:
    """`zerojax ckpt import` of a damaged copy of a file exported from the base checkpoint:
    it must exit non-zero naming the file and write nothing, or import the exact values."""
    from tools.fault_injection.base import load_values
    from zerojax.ckpt.checkpointer import Checkpointer

    work = scratch / f"i{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    source = work / spec["file"]
    shutil.copy(base_root / spec["file"], source)
    data = source.read_bytes()
    if spec["damage"] == "header offset digit":
        # The first digit after "data_offsets": an offset off by one: well-formed JSON.
        at = data.index(b'"data_offsets":[') + len(b'"data_offsets":[')
        at += 0 if data[at : at + 1] != b"0" else data[at:].index(b",") + 1
        source.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])
        did = f"header byte {at} changed"
    elif spec["damage"] == "drop last data byte":
        source.write_bytes(data[:-1])
        did = "last byte removed"
    else:
        did = damage(source, spec["damage"], seed)
    target = work / "imported"
    start = time.perf_counter()
    code, _, err, escaped = run_cli(["ckpt", "import", str(source), str(target)])
    expected = "exit non-zero naming the file, no step written; or the exact values imported"
    if escaped is not None:
        verdict, observed = FLAWED, one_line(f"traceback: {type(escaped).__name__}: {escaped}")
    elif code != 0:
        verdict, observed = judge_cli(code, err, None, [str(source)], in_process=True)
        if (target / "0").exists():
            verdict, observed = FLAWED, f"{observed}; step 0 written anyway"
    else:
        # Imported: restore it and compare the weights with what was exported.
        from tools.fault_injection.base import make_model, state_values

        model, optimizer = make_model(seed)
        ckpt = Checkpointer(target, model, optimizer, max_to_keep=None)
        try:
            ckpt.restore()
        finally:
            ckpt.close()
        got = state_values(model)
        saved = load_values(base_root, DAMAGED_STEP)
        wrong = [
            k for k in saved if k.startswith("model/") and got[k].tobytes() != saved[k].tobytes()
        ]
        verdict, observed = (
            (SILENT, f"exit 0, imported wrong values for {wrong[:3]}")
            if wrong
            else (TOLERATED, "exit 0, every value as exported")
        )
    return [
        Row(
            fault=f"ckpt import {spec['file']}: {spec['damage']}",
            group="import",
            expected=expected,
            observed=one_line(f"[{did}] {observed}"),
            verdict=verdict,
            seconds=round(time.perf_counter() - start, 3),
        )
    ]
