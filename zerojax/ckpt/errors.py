"""Errors raised by zerojax checkpointing.

Every error is a `CheckpointError`, so callers can catch one class:

    >>> try:
    ...     ckpt.restore()
    ... except CheckpointError as e:
    ...     print("cannot resume:", e)
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
