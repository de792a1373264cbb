"""JAX's persistent compilation cache, so a restarted job loads its programs instead of
compiling them (docs/design.md: 1.5 s -> 0.04 s on CPU).

Trust: the cache holds serialized XLA executables, which JAX loads and runs as they are: an
entry is code by nature, and JAX verifies nothing but its key (a hash of the program and the
compile options). Whoever can write to the directory can therefore run code as the user of the
next job. So the directory must be writable by this user alone (`private_directory.py`): one
that other users can write to, or that another user owns, is refused with an error naming it
and its mode, and one zerojax creates is created 0700. The capture cache lives inside it
(`bridge/decomposition_cache.py`) and is held to the same rule.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from zerojax.runtime.private_directory import check_private_directory

__all__ = ["enable_compilation_cache"]


def enable_compilation_cache(directory: str | None) -> None:
    """Point JAX's persistent compilation cache at `directory` (None leaves JAX's setting).

    UnsafeDirectoryError (a PermissionError) if users other than this one can write to it."""
    if directory is None:
        return
    path = os.path.abspath(os.path.expanduser(directory))
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_private_directory(path, "the compilation cache directory")
    if jax.config.jax_compilation_cache_dir == path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program of a training run is worth keeping: a restart then skips all compiles.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    # JAX decides once per process whether the cache is in use; a process that compiled
    # something before this call must re-decide.
    compilation_cache.reset_cache()
