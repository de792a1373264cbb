"""The step manifest: size and crc32 of every file of a step directory.

Orbax's commit (a rename) guarantees a step directory is complete when it appears; it says
nothing about what happens to the files afterwards -- a copy cut short, a disk error, an
edited file. The manifest is written inside the step's temporary directory, after every item
and Orbax's own metadata, just before the rename that commits the step
(`zerojax.ckpt.commit`): a step directory never exists without its manifest. It is checked
before a restore, an export or `inspect --verify`, so damage is reported by file name instead
of surfacing as a tensorstore error or, worse, as silently wrong weights. A step directory
without a manifest was not committed by zerojax (a copy cut short, a crash of an older
version, a deleted file): it is refused, never read unverified.

    >>> write_manifest("ckpt/100.orbax-checkpoint-tmp")   # before the commit's rename
    >>> verify_manifest("ckpt/100")     # raises CheckpointCorruptedError naming the file

Format (`layout.MANIFEST`): {"files": {relative posix path: {"size": int, "crc32": int}}}.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import zlib
from pathlib import Path

from zerojax.ckpt import layout
from zerojax.ckpt.errors import CheckpointCorruptedError

__all__ = [
    "file_crc32",
    "file_problem",
    "has_manifest",
    "manifest_problems",
    "read_manifest",
    "unreadable_problem",
    "verify_manifest",
    "write_manifest",
]

_CHUNK = 1 << 20  # streamed: a checkpoint file can be far larger than memory
_WRITE_THREADS = 2


def file_crc32(path: str | os.PathLike) -> int:
    """zlib.crc32 of a file's bytes, read in 1 MB chunks into one reused buffer."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
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


def has_manifest(step_dir: str | os.PathLike) -> bool:
    """Whether `step_dir` holds a manifest (a step committed by zerojax); nothing is read."""
    return os.path.isfile(os.path.join(step_dir, layout.MANIFEST))


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
    names = _files(step_dir)
    # Files hashed on _WRITE_THREADS threads, largest first (zlib.crc32 and the reads release
    # the GIL): a save's commit waits for this pass over every byte it wrote.
    largest_first = sorted(names, key=lambda rel: -(step_dir / rel).stat().st_size)
    with concurrent.futures.ThreadPoolExecutor(_WRITE_THREADS) as pool:
        crcs = dict(
            zip(largest_first, pool.map(lambda rel: file_crc32(step_dir / rel), largest_first))
        )
    files = {rel: {"size": (step_dir / rel).stat().st_size, "crc32": crcs[rel]} for rel in names}
    target = step_dir / layout.MANIFEST
    tmp = target.with_name(f"{layout.MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def verify_manifest(step_dir: str | os.PathLike, *, skip: frozenset[str] = frozenset()) -> None:
    """Check every file the manifest lists: present, same size, same crc32.

    Raises CheckpointCorruptedError naming the first file that differs and how, or the
    missing manifest itself: a step without one cannot be verified, and nothing unverified is
    read. Files added after the manifest was written are not checked (nothing reads them).
    `skip`: relative paths a caller checks itself as it reads them (`file_problem`, e.g.
    `zerojax.ckpt.direct_read`), so that no byte is hashed twice.

    >>> verify_manifest("ckpt/100")
    """
    for problem in manifest_problems(step_dir, first_only=True, skip=skip):
        raise problem


def read_manifest(step_dir: str | os.PathLike) -> dict[str, dict]:
    """{relative path: {"size": int, "crc32": int}} of `step_dir`'s manifest; raises
    CheckpointCorruptedError when it is missing or damaged (see `manifest_problems`)."""
    entries = _load(Path(step_dir))
    if isinstance(entries, CheckpointCorruptedError):
        raise entries
    return entries


def file_problem(
    path: str | os.PathLike, expected: dict, *, size: int, crc: int | None
) -> CheckpointCorruptedError | None:
    """The problem of a file whose `size` and crc32 (`crc`; None when the size already
    differs) were measured by the caller, against its manifest entry `expected`; None if it
    matches."""
    where = f"checkpoint file {str(path)!r}"
    if size != expected["size"]:
        kind = "truncated" if size < expected["size"] else "grown"
        problem = f"{where} is {kind}: size {size} bytes vs {expected['size']} when saved"
    elif crc is not None and crc != expected["crc32"]:
        problem = (
            f"{where} changed since it was saved: crc32 {crc:#010x} vs {expected['crc32']:#010x}"
        )
    else:
        return None
    return CheckpointCorruptedError(problem, path=str(path))


def unreadable_problem(
    path: str | os.PathLike, expected: dict, error: OSError
) -> CheckpointCorruptedError:
    """The problem of a file that could not be opened or read (`error`)."""
    where = f"checkpoint file {str(path)!r}"
    if isinstance(error, FileNotFoundError):
        problem = f"{where} is missing (listed in {layout.MANIFEST}, {expected['size']} bytes)"
    else:  # permissions, an I/O error: not verified
        problem = f"{where} cannot be read: {type(error).__name__}: {error.strerror or error}"
    return CheckpointCorruptedError(problem, path=str(path))


def _load(step_dir: Path) -> dict[str, dict] | CheckpointCorruptedError:
    manifest_path = step_dir / layout.MANIFEST
    if not manifest_path.is_file():
        return CheckpointCorruptedError(
            f"checkpoint step {str(step_dir)!r} has no {layout.MANIFEST}: it was not "
            "committed by zerojax (a save or copy cut short, or the manifest was deleted), "
            "so nothing vouches for its files; restore another step",
            path=str(manifest_path),
        )
    try:
        files = json.loads(manifest_path.read_text())["files"]
        # Every entry {"size": int, "crc32": int}; anything else is a damaged manifest (a
        # KeyError below would name nothing).
        for rel, expected in files.items():
            if not all(type(expected.get(k)) is int for k in ("size", "crc32")):
                raise ValueError(f"entry {rel!r}: {expected!r} is not {{size, crc32}}")
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise ValueError(f"entry {rel!r} lies outside the step directory")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        error = CheckpointCorruptedError(
            f"checkpoint manifest {str(manifest_path)!r} is unreadable ({exc}); the step "
            "directory was damaged after it was saved",
            path=str(manifest_path),
        )
        error.__cause__ = exc
        return error
    return files


def manifest_problems(
    step_dir: str | os.PathLike, *, first_only: bool = False, skip: frozenset[str] = frozenset()
) -> list[CheckpointCorruptedError]:
    """Every way `step_dir` differs from its manifest (empty: verified), one
    CheckpointCorruptedError each, naming the file; `verify_manifest` raises the first.
    Files in `skip` (relative paths) are left to the caller.

    >>> [str(p) for p in manifest_problems("ckpt/100")]
    ["checkpoint file 'ckpt/100/model/d/3f2a' changed since it was saved: crc32 ..."]
    """
    step_dir = Path(step_dir)
    files = _load(step_dir)
    if isinstance(files, CheckpointCorruptedError):
        return [files]
    problems = []
    for rel, expected in sorted(files.items()):
        if rel in skip:
            continue
        path = step_dir / rel
        problem: CheckpointCorruptedError | None
        try:
            if not path.is_file():
                problem = unreadable_problem(path, expected, FileNotFoundError(path))
            elif (size := path.stat().st_size) != expected["size"]:
                problem = file_problem(path, expected, size=size, crc=None)
            else:
                problem = file_problem(path, expected, size=size, crc=file_crc32(path))
            if problem is None:
                continue
        except OSError as exc:  # unreadable (permissions, an I/O error): not verified
            problem = unreadable_problem(path, expected, exc)
        problems.append(problem)
        if first_only:
            break
    return problems
