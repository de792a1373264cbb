"""zerojax: an ordinary PyTorch model and training loop as one sharded JAX/XLA program."""

from zerojax.runtime.gc_pause import collection_paused as _collection_paused
from zerojax.runtime.global_random import unchanged_global_random_state as _unchanged_random

# `import jax` draws from numpy's global random state; a script that seeded it before this
# import must draw what it would without zerojax (zerojax/runtime/global_random.py). The
# imports build long-lived objects only, so no full GC walks the process meanwhile (two took
# ~0.7 s of `import zerojax` at load 10: zerojax/runtime/gc_pause.py).
with _unchanged_random(), _collection_paused():
    from zerojax import distributed
    from zerojax.bridge import (
        CaptureError,
        Converted,
        UnsupportedOpError,
        convert,
        register_lowering,
    )
    from zerojax.ckpt import (
        CheckpointCorruptedError,
        Checkpointer,
        CheckpointError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointSaveError,
        CheckpointWarning,
        restore_checkpoint,
        save_checkpoint,
    )
    from zerojax.config import Config, ConfigError, ConfigWarning, load_config
    from zerojax.runtime.effective_time import effective_time
    from zerojax.sharding import ReplicatedParam, ShardingPlan, make_mesh, make_sharding_plan
    from zerojax.train import initialize
    from zerojax.train.memory_plan import memory_report

__version__ = "0.1.0"
__all__ = [
    "CaptureError",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointWarning",
    "Checkpointer",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "Converted",
    "ReplicatedParam",
    "ShardingPlan",
    "UnsupportedOpError",
    "convert",
    "distributed",
    "effective_time",
    "initialize",
    "load_config",
    "make_mesh",
    "make_sharding_plan",
    "memory_report",
    "register_lowering",
    "restore_checkpoint",
    "save_checkpoint",
]
