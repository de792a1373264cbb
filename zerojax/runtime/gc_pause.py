"""Python's cyclic garbage collector paused while a program is captured, traced and lowered.

A first step (and each restart's first step) builds a process's largest burst of long-lived
Python objects: torch.export's graph and fake tensors, then JAX's jaxprs, tracers and MLIR
modules for every program. CPython starts a full (generation 2) collection whenever the
objects that survived into the oldest generation grew by a quarter, and a full collection walks
every tracked object of the process: the model, torch's and JAX's modules, the engine. In a
warm restart of the bench GPT-2 (bench/effective_time_restart.py) three full collections fell
inside the first step and took 2.8-3.5 s of it at load 6-8 (~0.8 s each on the 2.2 GB
process), while the same step with the collector off left 40 unreachable objects behind:
collecting during it frees next to nothing and costs the walk.

So `collection_paused()` turns the collector off for the block and back on after it: around
zerojax's own imports (`zerojax/__init__.py`: two full collections, ~0.7 s of `import zerojax`
at load 10), torch.export's capture (`Engine.converted`) and each program's trace and lowering
(`Program._executable`); not around XLA's compile, which runs in C++ and may take minutes
cold, while other threads' garbage would wait. Nothing is left uncollected (cyclic garbage
made inside goes at the first collection after), and the first step's peak memory did not
change (2,209 vs 2,196 MB maxrss). It is a counter, not a flag: blocks may nest or run at once
on several threads (the training loop's trace beside a checkpoint's snapshot program), and the
collector comes back when the last one ends. A collector the process had turned off itself
(`gc.disable()`) stays off.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collection_paused"]

_lock = threading.Lock()
_depth = 0
_paused_here = False  # whether the outermost block turned the collector off


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The block runs with Python's cyclic GC off (see the module docstring)."""
    global _depth, _paused_here
    with _lock:
        if _depth == 0:
            _paused_here = gc.isenabled()
            if _paused_here:
                gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _paused_here:
                _paused_here = False
                gc.enable()
