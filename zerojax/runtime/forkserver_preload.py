"""Imported by the forkserver that starts DataLoader workers (zerojax.runtime.worker_processes):
import the main script once, as Python's forkserver means to, so workers are forks of a warm
process instead of each importing the script and torch again.

The parent passes what `multiprocessing.spawn.prepare` needs (sys.path, argv, working
directory, the main script) in the environment. The script is imported as `__mp_main__`, so
its `if __name__ == "__main__":` block does not run, and with the process marked as
inheriting, as spawn does, so an unguarded worker start raises instead of recursing. A
script that fails to import here is left for each worker to import itself, where its error
reaches the DataLoader.
"""

from __future__ import annotations

import json
import os
from multiprocessing import process, spawn

from zerojax.runtime.worker_processes import PREPARE_ENV


def _import_main() -> None:
    raw = os.environ.pop(PREPARE_ENV, None)
    if raw is None:
        return
    process.current_process()._inheriting = True
    try:
        spawn.prepare(json.loads(raw))
    except BaseException:  # noqa: BLE001 (each worker imports it again and reports it)
        pass
    finally:
        del process.current_process()._inheriting


_import_main()
