"""The step manifest: size and crc32 of every file of a committed step directory.

Orbax's commit (a rename) guarantees a step directory is complete when it appears; it says
nothing about what happens to the files afterwards -- a copy cut short, a disk error, an
edited file. The manifest is written once the step is committed and checked before a
restore or an export, so such damage is reported by file name instead of surfacing as a
tensorstore error or, worse, as silently wrong weights.

    >>> write_manifest("ckpt/100")      # after the save has committed
    >>> verify_manifest("ckpt/100")     # raises CheckpointCorruptedError naming the file

Format (`layout.MANIFEST`): {"files": {relative posix path: {"size": int, "crc32": int}}}.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from zerojax.ckpt import layout
from zerojax.ckpt.errors import CheckpointCorruptedError

__all__ = ["file_crc32", "verify_manifest", "write_manifest"]

_CHUNK = 1 << 20  # streamed: a checkpoint file can be far larger than memory


def file_crc32(path: str | os.PathLike) -> int:
    """zlib.crc32 of a file's bytes, read in 1 MB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: Path) -> list[str]:
    found = []
    for root, dirs, names in os.walk(step_dir):
        dirs.sort()
        for name in sorted(names):
            rel = (Path(root) / name).relative_to(step_dir).as_posix()
            if rel != layout.MANIFEST and not rel.startswith(layout.MANIFEST + "."):
                found.append(rel)
    return found


def write_manifest(step_dir: str | os.PathLike) -> None:
    """Record size and crc32 of every file under `step_dir` in `step_dir/layout.MANIFEST`.

    Written to a temporary name and renamed, so a crash leaves either no manifest (a step
    that is not verified) or a complete one, never a truncated manifest that would make a
    good checkpoint look corrupted.

    >>> write_manifest("ckpt/100")
    """
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise FileNotFoundError(f"write_manifest: {str(step_dir)!r} is not a directory")
    files = {}
    for rel in _files(step_dir):
        path = step_dir / rel
        files[rel] = {"size": path.stat().st_size, "crc32": file_crc32(path)}
    target = step_dir / layout.MANIFEST
    tmp = target.with_name(f"{layout.MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def verify_manifest(step_dir: str | os.PathLike) -> None:
    """Check every file the manifest lists: present, same size, same crc32.

    Raises CheckpointCorruptedError naming the first file that differs and how. A step
    directory without a manifest (older or foreign checkpoint) is accepted silently; files
    added after the manifest was written are not checked.

    >>> verify_manifest("ckpt/100")
    """
    step_dir = Path(step_dir)
    manifest_path = step_dir / layout.MANIFEST
    if not manifest_path.is_file():
        return
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptedError(
            f"checkpoint manifest {str(manifest_path)!r} is unreadable ({exc}); the step "
            "directory was damaged after it was saved",
            path=str(manifest_path),
        ) from exc
    for rel, expected in sorted(files.items()):
        path = step_dir / rel
        where = f"checkpoint file {str(path)!r}"
        if not path.is_file():
            raise CheckpointCorruptedError(
                f"{where} is missing (listed in {layout.MANIFEST}, {expected['size']} bytes)",
                path=str(path),
            )
        size = path.stat().st_size
        if size != expected["size"]:
            kind = "truncated" if size < expected["size"] else "grown"
            raise CheckpointCorruptedError(
                f"{where} is {kind}: size {size} bytes vs {expected['size']} when saved",
                path=str(path),
            )
        crc = file_crc32(path)
        if crc != expected["crc32"]:
            raise CheckpointCorruptedError(
                f"{where} changed since it was saved: crc32 {crc:#010x} vs "
                f"{expected['crc32']:#010x}",
                path=str(path),
            )
