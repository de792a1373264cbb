"""DataLoader worker processes after `zerojax.initialize` (zerojax/runtime/worker_processes.py):
real scripts in fresh processes, no fork of the JAX process unless the script needs one, and
then no warning; the batches are torch's.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/runtime/test_worker_processes.py

Why it exists: nearly every training script iterates a DataLoader with `num_workers > 0`,
after initialize, and JAX warns at every fork of its process that a deadlock is likely
(issue 43). Each script trains a step between epochs, so JAX's threads are running when the
workers start, and compares every batch with the same loader iterated in the main process.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from tests.fresh_python import run_fresh_python
from zerojax.runtime import worker_processes

FORK_WARNINGS = ("os.fork() was called", "use of fork() may lead to deadlocks")
TIMEOUT_S = 300

# A script as users write them: a dataset class of its own with a Python transform, a
# TensorDataset, two workers, a training step between epochs. BODY runs under the guard or
# at top level; it prints one JSON line: the batches matched, and each worker's parent pid.
SCRIPT = """
import json, os, sys
import torch
import zerojax
from torch.utils.data import DataLoader, Dataset, TensorDataset


class Squares(Dataset):
    def __init__(self, values):
        self.values = values

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        # A Python transform, and which process ran it.
        return torch.tensor([self.values[i] ** 2 + 1.0]), os.getppid()


def main():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = zerojax.initialize(model, opt, {{"mesh": {{"data": 1}}}})
    x, y = torch.randn(96, 8), torch.randn(96, 2)
    squares = Squares(torch.randn(40).tolist())
    loaders = [
        (DataLoader(TensorDataset(x, y), batch_size=16, num_workers=2, **{kwargs}),
         DataLoader(TensorDataset(x, y), batch_size=16)),
        (DataLoader(squares, batch_size=8, num_workers=2, **{kwargs}),
         DataLoader(squares, batch_size=8)),
    ]
    same, parents = True, set()
    for epoch in range(2):
        for loader, reference in loaders:
            got = list(loader)
            want = list(reference)
            same &= len(got) == len(want) and all(
                torch.equal(g[0], w[0])
                and (isinstance(loader.dataset, Squares) or torch.equal(g[1], w[1]))
                for g, w in zip(got, want)
            )
            if isinstance(loader.dataset, Squares):
                parents |= {{int(p) for batch in got for p in batch[1]}}
            # JAX busy between epochs: a step whose update may still run at the next start.
            loss = torch.nn.functional.mse_loss(model(x[:16]), y[:16])
            loss.backward(); opt.step(); opt.zero_grad()
    print(json.dumps({{"same": bool(same), "parents": sorted(parents), "pid": os.getpid(),
                      "context": [str(l.multiprocessing_context) for l, _ in loaders]}}))

"""


def _run(tmp_path, *, guarded: bool, kwargs: str = "{}") -> tuple[dict, str]:
    body = SCRIPT.format(kwargs=kwargs)
    body += 'if __name__ == "__main__":\n    main()\n' if guarded else "main()\n"
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    result = run_fresh_python([str(path)], timeout=TIMEOUT_S, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["same"], "a worker's batches differ from the main process's"
    return report, result.stderr


@pytest.mark.long
def test_guarded_script_starts_workers_from_the_forkserver(tmp_path):
    """The common case (minGPT, timm: `if __name__ == "__main__": main()`): workers come
    from the forkserver, not from a fork of the JAX process, and nothing is warned."""
    report, stderr = _run(tmp_path, guarded=True)
    assert not [w for w in FORK_WARNINGS if w in stderr], stderr[-4000:]
    # Every worker's parent is the one forkserver, never the script.
    assert len(report["parents"]) == 1 and report["pid"] not in report["parents"], report
    # The loaders keep the user's None.
    assert report["context"] == ["None", "None"], report


@pytest.mark.slow
def test_unguarded_script_forks_quietly(tmp_path):
    """A script without the guard would run again in a worker that imports it: its workers
    are forks of the script, as torch makes them, without the warnings."""
    report, stderr = _run(tmp_path, guarded=False)
    assert not [w for w in FORK_WARNINGS if w in stderr], stderr[-4000:]
    assert report["parents"] == [report["pid"]], report


@pytest.mark.slow
def test_a_loader_that_chose_fork_keeps_it(tmp_path):
    """`multiprocessing_context="fork"` is the user's: it stays a fork, and JAX's warning
    about it is the user's to see."""
    report, stderr = _run(tmp_path, guarded=True, kwargs='{"multiprocessing_context": "fork"}')
    assert report["parents"] == [report["pid"]], report
    assert FORK_WARNINGS[0] in stderr


class _Loader:
    """The attributes choose_start_method reads, for the in-process checks below."""

    def __init__(self, dataset, collate_fn=None, worker_init_fn=None, context=None):
        self.dataset, self.collate_fn, self.worker_init_fn = dataset, collate_fn, worker_init_fn
        self.multiprocessing_context = context


def test_dataset_that_does_not_pickle_or_is_large_keeps_the_fork(monkeypatch):
    """The verdict once the script is known to be guarded (pytest's own __main__ is)."""
    monkeypatch.setattr(worker_processes, "_main_not_importable", lambda: None)
    tensors = torch.utils.data.TensorDataset(torch.randn(1 << 17, 64))  # 32 MiB, sent in shm
    assert worker_processes.choose_start_method(_Loader(tensors))[0] == "forkserver"
    unpicklable = _Loader(tensors, collate_fn=lambda batch: batch)
    method, why = worker_processes.choose_start_method(unpicklable)
    assert method == "fork" and "does not pickle" in why, why
    large = _Loader([bytes(17 * 2**20)])  # over MAX_PICKLED_BYTES, pickled to every worker
    method, why = worker_processes.choose_start_method(large)
    assert method == "fork" and "MiB" in why, why
    assert worker_processes.choose_start_method(_Loader([1], context="spawn"))[0] == "user"


@pytest.mark.parametrize(
    ("source", "guarded"),
    [
        ('if __name__ == "__main__":\n    main()\n', True),
        ("if '__main__' == __name__:\n    main()\n", True),
        ('if __name__ != "__main__":\n    main()\n', False),
        ("if x == 1:\n    main()\n", False),
    ],
)
def test_main_guard_recognized(source, guarded):
    import ast

    assert worker_processes._is_main_guard(ast.parse(source).body[0]) is guarded
