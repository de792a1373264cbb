"""A fault-injection suite for zerojax checkpoints: damage a real step, fill the disk, take
write permission away, kill the writer mid-save, and judge what the user would see.

    .venv/bin/python -m tools.fault_injection --out /tmp/faults     # table + faults.json

The subject is a real checkpoint: a small MLP under `zerojax.initialize` on 8 simulated CPU
devices, ZeRO-3 and AdamW, trained 2 steps and saved after each with `Checkpointer`
(`base.py`); the values every step held are recorded beside it. Every fault then starts
from a fresh copy of it:

- `file_faults.py`: every file of a step, grouped by the kind Orbax (or zerojax) writes --
  array data in the OCDBT stores, their manifests, the PyTree `_METADATA`, `_sharding`,
  `array_metadatas`, commit markers, `_CHECKPOINT_METADATA`, the `meta` JSON, zerojax's
  manifest, and any file of a kind not known here -- is flipped, truncated, deleted,
  emptied or replaced by garbage; each item directory is removed, the step directory
  emptied or replaced by a file; and the damages are applied again to a step without its
  manifest (what a crash between Orbax's commit and the manifest's write would leave).
  Four readers meet each damaged step: `restore()` of the latest step, `restore(step)` of
  the damaged one, `zerojax ckpt inspect --verify` and `zerojax ckpt export`. The same
  readers on an undamaged copy are the control: they must simply work.
- `environment_faults.py`: a full disk (a 2 MB tmpfs in a private mount namespace) under
  synchronous and asynchronous saves, with and without `close()`, and under `ckpt import`
  and `ckpt export`; a read-only checkpoint directory and read-only steps (as an
  unprivileged user when run as root, who writes anywhere) and an unreadable array file;
  SIGKILL of an asynchronous save at random points, then a resume in a fresh process;
  damaged files for `ckpt import`; a process that hangs at exit.

Each fault is one row: what a correct system must do (`expected`), what happened
(`observed`), and a verdict (`outcomes.py`):

    caught     the operation failed with a CheckpointError subclass naming the step or path
               (or the CLI exited non-zero with one line saying so)
    recovered  the operation did the right thing despite the fault: the previous verified
               step restored bit for bit with a warning naming the damaged one, or a read
               that the fault should not affect returned exactly what was saved
    tolerated  no error, and every restored or exported value equals what was saved: the
               damage touched nothing that was read (not silent, but the step was never
               verified)
    flawed     not silent, not right: a bare exception type, a message naming neither step
               nor path, a traceback from the CLI, a leftover temporary directory, a crash
               or a hang
    SILENT     the worst: a restore or export that succeeded with values other than those
               saved, a failed save whose process exited 0, a damaged step that verified
               OK, or a fallback to an older step without a word
    skipped    the environment cannot inject this fault (no user namespaces, ...)

Readers run in worker processes (`worker.py`, two lanes), fault after fault, each restore
into a freshly initialized engine; a worker that crashes or hangs is replaced and the fault
is recorded as flawed. Faults that end a process run in their own (`runner.py` runs the
lanes side by side). The whole suite takes about 3-4 minutes on two busy cores.
"""
