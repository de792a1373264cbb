"""A multi-process asynchronous save runs off the training loop's thread without a single device
collective there, and writes the state of `save()` time (run by test_checkpoints.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/async_save_script.py \
        --dir CKPT --mesh fsdp=8

Every entry point of JAX's cross-process device collectives (`multihost_utils`:
`sync_global_devices`, `assert_equal`, `process_allgather`, `broadcast_one_to_all`, which
Orbax's barriers and step broadcasts call) is wrapped to record the thread calling it, and
Orbax's `multihost.sync_global_processes` (every barrier of a save) likewise. The script trains
two AdamW steps, gathers the state, saves step 2 and at once trains three more steps (each
donating the saved buffers) while the save runs, saves step 5, then restores step 2 and
compares it bitwise with the gathered state. It exits non-zero (AssertionError) when a
collective ran off the main thread, when no barrier ran off it (the save did not leave the
loop's thread, so the test proves nothing), or when a restored value differs.
"""

from __future__ import annotations

import argparse
import os
import threading

import numpy as np
import torch
import torch.nn.functional as F

import zerojax
from tests.distributed.ddp_script import MLP, dataset, zerojax_config

CALLS: list[tuple[str, bool]] = []  # (what, on the main thread)


def record(what: str, fn):
    def wrapper(*args, **kwargs):
        CALLS.append((what, threading.current_thread() is threading.main_thread()))
        return fn(*args, **kwargs)

    return wrapper


def instrument() -> None:
    from jax.experimental import multihost_utils
    from orbax.checkpoint._src.multihost import multihost

    for name in (
        "sync_global_devices",
        "assert_equal",
        "process_allgather",
        "broadcast_one_to_all",
    ):
        setattr(multihost_utils, name, record(name, getattr(multihost_utils, name)))
    multihost.broadcast_one_to_all = record(
        "orbax.broadcast_one_to_all", multihost.broadcast_one_to_all
    )
    multihost.sync_global_processes = record("barrier", multihost.sync_global_processes)


def state_of(model, optimizer) -> dict[str, np.ndarray]:
    """The global model and optimizer state, as numpy (gathering is a collective: main thread)."""
    arrays = {f"model/{k}": v.numpy().copy() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            arrays[f"optimizer/{index}/{key}"] = torch.as_tensor(value).numpy().copy()
    return arrays


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mesh", default="fsdp=-1")
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--devices-per-process", type=int, default=4)
    args = parser.parse_args()
    instrument()
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = zerojax.initialize(model, optimizer, config=zerojax_config(args))
    data = dataset(128)  # 2 ranks x 8 rows x 5 steps fit
    sampler = zerojax.distributed.sampler(data, shuffle=False)
    loader = iter(torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler))

    def train_step() -> None:
        x, y = next(loader)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    checkpointer = zerojax.Checkpointer(args.dir, model, optimizer, max_to_keep=None)
    for _ in range(2):
        train_step()
    at_save = state_of(model, optimizer)
    checkpointer.save(2, force=True)
    for _ in range(3):  # donate the saved buffers while the save is in flight
        train_step()
    after = state_of(model, optimizer)
    checkpointer.save(5, force=True)
    checkpointer.wait()
    saving_calls = list(CALLS)
    restored = checkpointer.restore(2)
    checkpointer.close()

    rank = zerojax.distributed.rank()
    off_main = [what for what, on_main in saving_calls if not on_main]
    assert "barrier" in off_main, f"rank {rank}: no Orbax barrier off the main thread: {CALLS}"
    collectives = [what for what in off_main if what != "barrier"]
    assert not collectives, f"rank {rank}: device collectives off the main thread: {collectives}"
    assert restored.step == 2
    assert any(not np.array_equal(at_save[k], after[k]) for k in at_save), (
        "training changed nothing"
    )
    got = state_of(model, optimizer)
    assert sorted(got) == sorted(at_save)
    for key, want in at_save.items():
        np.testing.assert_array_equal(got[key], want, err_msg=f"rank {rank}: {key}")
    barriers = sum(what == "barrier" for what in off_main)
    print(
        f"rank {rank}: {barriers} barriers off the main thread, no collective there; "
        f"step 2 restored bitwise",
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
