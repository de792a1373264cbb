"""Errors raised by zerojax checkpointing.

Every error is a `CheckpointError`, so callers can catch one class:

    >>> try:
    ...     ckpt.restore()
    ... except CheckpointError as e:
    ...     print("cannot resume:", e)

Each names the step and the path it is about. Orbax's and tensorstore's own exceptions never
reach the caller bare: they are the `__cause__` of the CheckpointError that reports them.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every checkpoint error."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The directory holds no complete checkpoint, or not the requested step."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the current model/optimizer.

    `differences` lists every difference, one human-readable line each
    ("name: saved ... vs current ...")."""

    def __init__(self, message: str, differences: list[str] | None = None) -> None:
        self.differences = list(differences or [])
        if self.differences:
            message = message + "\n" + "\n".join("  " + d for d in self.differences)
        super().__init__(message)


class CheckpointCorruptedError(CheckpointError):
    """A checkpoint file is missing, truncated or changed since it was written.

    `path` is the offending file (or the step directory when the file is unknown)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)


class CheckpointFormatError(CheckpointError, ValueError):
    """A file given to the checkpoint tools is not in the format it claims (a malformed
    safetensors header: bad offsets, shapes, dtypes, overlapping tensors, ...).

    `path` is the file; `tensor` the entry at fault, or None when the file as a whole is
    (a bad header length or JSON). A ValueError too, as the tools' other bad-input errors."""

    def __init__(self, message: str, path: str | None = None, tensor: str | None = None) -> None:
        self.path = path
        self.tensor = tensor
        super().__init__(message)


class CheckpointSaveError(CheckpointError):
    """A save did not commit: the step was not written (disk full, a path that cannot be
    created, Orbax refusing the state). Raised by `save` (synchronous saves), and for an
    asynchronous save by the next `save`, `wait`, `close` or `restore` -- or, when the script
    ended first, by the interpreter's exit (which then exits with status 1).

    `step` is the step that was not saved, `path` its directory (which does not exist: the
    save's temporary directory was removed)."""

    def __init__(self, message: str, *, step: int, path: str) -> None:
        self.step = step
        self.path = path
        super().__init__(message)


class CheckpointWarning(UserWarning):
    """Something a reader skipped: `restore()` fell back past a damaged or uncommitted newer
    step (named in the message; it stays on disk as it is)."""
