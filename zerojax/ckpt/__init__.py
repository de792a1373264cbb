"""Checkpoints on Orbax: sharded async save, restore onto any mesh and ZeRO stage, and the
`zerojax ckpt` tools (inspect, export to safetensors/torch, import from them).

>>> ckpt = zerojax.Checkpointer("runs/ckpt", model, optimizer, scheduler=scheduler)
>>> ckpt.save(step, extra={"batch": i})      # returns at once; written in the background
>>> state = ckpt.restore()                   # latest complete step, onto the current mesh

The on-disk format is described in `zerojax.ckpt.layout`.
"""

from zerojax.ckpt.checkpointer import (
    Checkpointer,
    RestoredState,
    restore_checkpoint,
    save_checkpoint,
)
from zerojax.ckpt.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointWarning,
)

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointWarning",
    "Checkpointer",
    "RestoredState",
    "restore_checkpoint",
    "save_checkpoint",
]
