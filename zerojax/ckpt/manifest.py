"""The step manifest: size and checksum (xxh3_64) of every file of a step directory.

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

Format (`layout.MANIFEST`): {"files": {relative posix path: {"size": int, "xxh3_64": int}}}.
Manifests written before 2026-11-28 hold {"size": int, "crc32": int} (zlib's crc32) instead;
they are still verified, with crc32. Why the change: a restore reads every byte of the step
once and hashes it as it reads (`zerojax.ckpt.direct_read`), and a save hashes every byte it
wrote before its commit; zlib's crc32 ran at 1.1-4 GB/s on the 2-core bench host, xxh3_64 at
~32 GB/s (memcpy: 9 GB/s), so the checksum no longer costs a restore or a save more than the
read itself. Both are error-detecting checksums of the same kind (not cryptographic: nothing
here defends against a deliberate edit); xxh3_64's 64 bits make a random change missed with
probability 2**-64 against crc32's 2**-32. A zerojax from before this change refuses a new
manifest as unreadable (it names the file) rather than restoring it unverified.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import zlib
from pathlib import Path

import xxhash

from zerojax.ckpt import layout
from zerojax.ckpt.errors import CheckpointCorruptedError

__all__ = [
    "CHECKSUMS",
    "checksum_kind",
    "file_checksum",
    "file_problem",
    "has_manifest",
    "manifest_problems",
    "new_hasher",
    "read_manifest",
    "unreadable_problem",
    "verify_manifest",
    "write_manifest",
]

_CHUNK = 1 << 20  # streamed: a checkpoint file can be far larger than memory
_WRITE_THREADS = 2

CHECKSUMS = ("xxh3_64", "crc32")
"""The checksums a manifest entry may hold, the one new manifests record first; "crc32" is
read only (manifests written before 2026-11-28)."""


class _Crc32:
    """zlib.crc32 behind xxhash's streaming interface (`update`, `intdigest`)."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 0

    def update(self, data) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


def new_hasher(kind: str):
    """A streaming hasher (`update(bytes-like)`, `intdigest()`) for checksum `kind`, one of
    CHECKSUMS. Both release the GIL while they hash a large buffer."""
    if kind == "xxh3_64":
        return xxhash.xxh3_64()
    if kind == "crc32":
        return _Crc32()
    raise ValueError(f"checksum {kind!r} is not one of {CHECKSUMS}")


def checksum_kind(expected: dict) -> str:
    """Which checksum a manifest entry holds (xxh3_64 when it holds both)."""
    return next(kind for kind in CHECKSUMS if kind in expected)


def file_checksum(path: str | os.PathLike, kind: str = CHECKSUMS[0], *, sync: bool = False) -> int:
    """Checksum `kind` of a file's bytes, read in 1 MB chunks into one reused buffer; with
    `sync`, the file's data is then flushed to the disk (`os.fdatasync`) before this returns."""
    hasher = new_hasher(kind)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            hasher.update(view[:n])
        if sync:
            os.fdatasync(f.fileno())
    return hasher.intdigest()


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
    """Record size and xxh3_64 of every file under `step_dir` in `step_dir/layout.MANIFEST`.

    Written to a temporary name and renamed, so a crash leaves either no manifest (a step
    that is not verified) or a complete one, never a truncated manifest that would make a
    good checkpoint look corrupted. Every file is flushed to the disk (`fdatasync`) right
    after it is hashed, and the manifest after it is written: what the manifest vouches for
    is on the disk before the manifest is, and before the commit's rename that follows
    (`zerojax.ckpt.commit`). The Checkpointer's saves write their files without TensorStore's
    fsync after each write for that reason (`commit.files_synced_at_commit`).

    >>> write_manifest("ckpt/100")
    """
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise FileNotFoundError(f"write_manifest: {str(step_dir)!r} is not a directory")
    names = _files(step_dir)
    # Files hashed on _WRITE_THREADS threads, largest first (the hash and the reads release
    # the GIL): a save's commit waits for this pass over every byte it wrote.
    largest_first = sorted(names, key=lambda rel: -(step_dir / rel).stat().st_size)
    kind = CHECKSUMS[0]
    with concurrent.futures.ThreadPoolExecutor(_WRITE_THREADS) as pool:
        sums = dict(
            zip(
                largest_first,
                pool.map(lambda rel: file_checksum(step_dir / rel, sync=True), largest_first),
            )
        )
    files = {rel: {"size": (step_dir / rel).stat().st_size, kind: sums[rel]} for rel in names}
    target = step_dir / layout.MANIFEST
    tmp = target.with_name(f"{layout.MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def verify_manifest(step_dir: str | os.PathLike, *, skip: frozenset[str] = frozenset()) -> None:
    """Check every file the manifest lists: present, same size, same checksum.

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
    """{relative path: {"size": int, "xxh3_64" or "crc32": int}} of `step_dir`'s manifest; raises
    CheckpointCorruptedError when it is missing or damaged (see `manifest_problems`)."""
    entries = _load(Path(step_dir))
    if isinstance(entries, CheckpointCorruptedError):
        raise entries
    return entries


def file_problem(
    path: str | os.PathLike, expected: dict, *, size: int, checksum: int | None
) -> CheckpointCorruptedError | None:
    """The problem of a file whose `size` and checksum (of the kind its manifest entry
    `expected` holds, `checksum_kind`; None when the size already differs) were measured by
    the caller, against that entry; None if it matches."""
    where = f"checkpoint file {str(path)!r}"
    kind = checksum_kind(expected)
    if size != expected["size"]:
        change = "truncated" if size < expected["size"] else "grown"
        problem = f"{where} is {change}: size {size} bytes vs {expected['size']} when saved"
    elif checksum is not None and checksum != expected[kind]:
        digits = 18 if kind == "xxh3_64" else 10
        problem = (
            f"{where} changed since it was saved: {kind} {checksum:#0{digits}x} vs "
            f"{expected[kind]:#0{digits}x}"
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
        # Every entry {"size": int, and "xxh3_64" or "crc32": int}; anything else is a
        # damaged manifest (a KeyError below would name nothing).
        for rel, expected in files.items():
            if not (
                isinstance(expected, dict)
                and type(expected.get("size")) is int
                and any(type(expected.get(k)) is int for k in CHECKSUMS)
                and all(type(expected[k]) is int for k in CHECKSUMS if k in expected)
            ):
                raise ValueError(
                    f"entry {rel!r}: {expected!r} is not {{size, one of {'/'.join(CHECKSUMS)}}}"
                )
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
    ["checkpoint file 'ckpt/100/model/d/3f2a' changed since it was saved: xxh3_64 ..."]
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
                problem = file_problem(path, expected, size=size, checksum=None)
            else:
                checksum = file_checksum(path, checksum_kind(expected))
                problem = file_problem(path, expected, size=size, checksum=checksum)
            if problem is None:
                continue
        except OSError as exc:  # unreadable (permissions, an I/O error): not verified
            problem = unreadable_problem(path, expected, exc)
        problems.append(problem)
        if first_only:
            break
    return problems
