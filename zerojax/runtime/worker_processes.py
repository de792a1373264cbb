"""DataLoader worker processes started after JAX: forkserver where it is safe, else a quiet fork.

`DataLoader(num_workers > 0)` starts its workers with the default start method, which is
`fork` on Linux up to Python 3.13. After `zerojax.initialize` the process runs JAX's thread
pools, and forking a multithreaded process copies locks that threads which do not exist in
the child may hold: JAX warns at every fork ("os.fork() was called ... this will likely lead
to a deadlock"), and Python 3.12+ adds its own DeprecationWarning. Python 3.14 made
`forkserver` the default on Linux for the same reason: workers are forked from a small server
process that never started a thread.

`install()` (called by `initialize`) wraps torch's `_MultiProcessingDataLoaderIter.__init__`,
so every DataLoader, built before or after `initialize`, is covered without a change to the
user's code. When a loader's workers start, `choose_start_method` decides:

- The user's choice stands: a loader's own `multiprocessing_context`, a start method set
  with `multiprocessing.set_start_method`, or a platform whose default is not `fork`.
- `forkserver` when the worker arguments can go to a fresh process: `__main__` is a file
  whose running top-level statement sits under `if __name__ == "__main__":` (a worker
  imports the script, as under `spawn`; unguarded, it would run the training loop again),
  and the dataset, `collate_fn` and `worker_init_fn` pickle (torch sends tensors through
  shared memory) to at most `MAX_PICKLED_BYTES`: forkserver sends them to every worker at
  every epoch, where a fork shares them for free.
- Otherwise a fork, as torch would, with the two fork warnings silenced for the workers'
  start only, and one INFO log that says why. The child runs the dataset's Python and torch
  code, which never enters the XLA runtime; what would deadlock there is dataset code that
  calls JAX or a zerojax model (docs/training.md, "DataLoader worker processes").

The forkserver itself: Python 3.11-3.13's server is meant to import `__main__` once so that
workers start warm, but it looks the script up under a key the parent never sends
(`main_path`, where `spawn.get_preparation_data` writes `init_main_from_path`), so each
worker re-imports the script and its imports (torch, jax: seconds per worker per epoch on
a small host). The server here preloads `zerojax.runtime.forkserver_preload`, which imports
the script once with the parent's `sys.path`, argv and working directory; workers are forks of
that warm, single-threaded process (bench/dataloader_workers.py measures all three ways).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import sys
import threading
import warnings
import weakref
from multiprocessing import spawn
from typing import Any

import torch
from torch.utils.data import dataloader as torch_dataloader

__all__ = ["MAX_PICKLED_BYTES", "choose_start_method", "install"]

log = logging.getLogger("zerojax")

MAX_PICKLED_BYTES = 16 * 2**20
"""Above this, a dataset (with its collate_fn and worker_init_fn) keeps the fork: forkserver
would pickle it to every worker at every epoch (a NumPy array or a Python list of a million
file names; tensors travel through shared memory and do not count)."""

PREPARE_ENV = "ZEROJAX_FORKSERVER_PREPARE"
"""How the forkserver learns what to import: JSON of the parent's `sys.path`, `sys.argv`,
working directory and main script (read by `zerojax.runtime.forkserver_preload`)."""

PRELOAD_MODULE = "zerojax.runtime.forkserver_preload"

_lock = threading.Lock()
_installed = False
# loader -> (method, why, the dataset it was decided for)
_choices: weakref.WeakKeyDictionary[Any, tuple[str, str, Any]] = weakref.WeakKeyDictionary()
_logged: set[str] = set()


def install() -> None:
    """Route DataLoader worker starts through `choose_start_method` (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        iterator = torch_dataloader._MultiProcessingDataLoaderIter
        original = iterator.__init__

        @functools.wraps(original)
        def __init__(self, loader) -> None:
            _start_workers(original, self, loader)

        iterator.__init__ = __init__
        _installed = True


def choose_start_method(loader: torch.utils.data.DataLoader) -> tuple[str, str]:
    """("user" | "forkserver" | "fork", why) for `loader`'s next worker start."""
    if loader.multiprocessing_context is not None:
        return "user", "the loader's multiprocessing_context"
    # The first is the platform's default; get_context() would fix the default as chosen.
    methods = multiprocessing.get_all_start_methods()
    default = methods[0]
    # A start method the default context holds is set_start_method's, or was fixed by any
    # use of the default context (a Queue, a Pool): only one other than the default is known
    # to be the user's. To keep fork, a loader says multiprocessing_context="fork".
    if multiprocessing.get_start_method(allow_none=True) not in (None, default):
        return "user", "multiprocessing.set_start_method"
    if default != "fork" or "forkserver" not in methods:
        return "user", f"the platform's default start method, {default}"
    reason = _main_not_importable()
    if reason is not None:
        return "fork", reason
    cached = _choices.get(loader)
    if cached is None or cached[2] is not loader.dataset:
        cached = (*_pickled_size_verdict(loader), loader.dataset)
        _choices[loader] = cached
    return cached[0], cached[1]


def _start_workers(original, iterator, loader) -> None:
    method, why = choose_start_method(loader)
    if method == "user":
        original(iterator, loader)
    elif method == "forkserver":
        context = _forkserver_context()
        # The iterator reads the context once, to make its queues and start its workers;
        # the loader keeps the user's None.
        loader.multiprocessing_context = context
        try:
            original(iterator, loader)
        finally:
            loader.multiprocessing_context = None
    else:
        if why not in _logged:
            _logged.add(why)
            log.info(
                "DataLoader workers start by fork after JAX has started, because %s; the "
                "workers must not call JAX or the zerojax model (docs/training.md, 'DataLoader "
                "worker processes')",
                why,
            )
        with _fork_warnings_silenced():
            original(iterator, loader)


@contextlib.contextmanager
def _fork_warnings_silenced():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        warnings.filterwarnings("ignore", r".*multi-threaded, use of fork\(\)", DeprecationWarning)
        yield


def _main_not_importable() -> str | None:
    """Why a worker may not import `__main__` as spawn and forkserver do, or None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return "__main__ is not a file (interactive, notebook or -c): a worker cannot import it"
    frame = sys._getframe()
    while frame is not None and not (
        frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    if frame is None:
        return "the loader is not iterated from the main script's thread"
    try:
        tree = _parsed(path)
    except (OSError, SyntaxError, ValueError):
        return f"{path} cannot be read to check its __main__ guard"
    line = frame.f_lineno
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            if _is_main_guard(node) and any(
                s.lineno <= line <= (s.end_lineno or s.lineno) for s in node.body
            ):
                return None
            break
    return (
        f'{os.path.basename(path)}:{line} runs outside `if __name__ == "__main__":` (a '
        f"worker importing the script would run it again)"
    )


@functools.lru_cache(maxsize=8)
def _parsed(path: str) -> ast.Module:
    with open(path, "rb") as f:
        return ast.parse(f.read(), filename=path)


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


class _CountingSink(io.RawIOBase):
    def __init__(self) -> None:
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.size += len(b)
        return len(b)


class _SizePickler(pickle.Pickler):
    """Pickles as the worker start would, but tensors as nothing: torch sends them through
    shared memory (ForkingPickler itself is not used: it would hand out file descriptors)."""

    def reducer_override(self, obj):
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return (tuple, ())
        return NotImplemented


def _pickled_size_verdict(loader) -> tuple[str, str]:
    sink = _CountingSink()
    parts = (loader.dataset, loader.collate_fn, loader.worker_init_fn)
    try:
        _SizePickler(sink, protocol=pickle.HIGHEST_PROTOCOL).dump(parts)
    except Exception as e:  # noqa: BLE001 (any pickling failure means: keep the fork)
        return "fork", (
            f"the dataset, collate_fn or worker_init_fn does not pickle "
            f"({type(e).__name__}: {e}), which a forkserver worker needs"
        )
    if sink.size > MAX_PICKLED_BYTES:
        return "fork", (
            f"the dataset pickles to {sink.size / 2**20:.0f} MiB, which a forkserver would send "
            f"to every worker at every epoch (a fork shares it)"
        )
    return "forkserver", "the script is guarded and the dataset pickles"


def _forkserver_context():
    """The forkserver context, its server preloading the main script (module docstring)."""
    context = multiprocessing.get_context("forkserver")
    server = multiprocessing.forkserver._forkserver
    with _lock:
        # A server already running, or a preload list the user set, stays as it is.
        if server._forkserver_pid is None and server._preload_modules == ["__main__"]:
            data = spawn.get_preparation_data("zerojax-forkserver")
            keys = ("sys_path", "sys_argv", "dir", "init_main_from_path", "init_main_from_name")
            prepare = {k: data[k] for k in keys if k in data}
            context.set_forkserver_preload([PRELOAD_MODULE])
            # The server inherits the environment at its start; the user's sees no change.
            os.environ[PREPARE_ENV] = json.dumps(prepare)
            try:
                server.ensure_running()
            finally:
                del os.environ[PREPARE_ENV]
    return context
