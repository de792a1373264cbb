"""A checkpoint written by two processes restores onto one process and onto two (issue 10,
item 3), and `zerojax ckpt inspect` and `export` read it from one process.

    .venv/bin/python -m pytest -q tests/distributed/test_checkpoints.py [-m '']

`ckpt_script.py save` trains two AdamW steps under torchrun (2 processes x 4 CPU devices,
ZeRO-3 over fsdp=8) and saves: Orbax writes each process's shards (`ocdbt.process_<i>`). The
restores rebuild the model on another mesh (data=2 x fsdp=4) and compare the restored model and
optimizer state with what the saving run held: exactly, since restoring only moves fp32 bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zerojax
from tests.distributed.ddp_script import MLP
from tests.distributed.torchrun import REPO, check_ok, torchrun
from zerojax.cli import main as cli_main

# Every test here shares one 2-process torchrun save (~18 s): left out of `make test`.
pytestmark = pytest.mark.long

SCRIPT = REPO / "tests" / "distributed" / "ckpt_script.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint directory, the state the two saving processes held)."""
    root = tmp_path_factory.mktemp("multiprocess_ckpt")
    directory, out = root / "ckpt", root / "out"
    out.mkdir()
    args = ["save", "--dir", str(directory), "--mesh", "fsdp=8", "--out", str(out)]
    check_ok(torchrun(SCRIPT, *args, timeout=240))
    states = [dict(np.load(out / f"save_rank{r}.npz")) for r in range(2)]
    for key in states[0]:  # both processes gathered the same global state
        np.testing.assert_array_equal(states[0][key], states[1][key])
    return directory, states[0]


def _assert_equal_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_each_process_writes_its_own_shards(saved):
    directory, _ = saved
    model_dir = directory / "2" / "model"
    assert (model_dir / "ocdbt.process_0").is_dir() and (model_dir / "ocdbt.process_1").is_dir()


def test_restore_on_one_process(saved):
    """In this pytest process: 8 devices, one process, another mesh."""
    directory, want = saved
    torch.manual_seed(1)  # another initialisation: everything must come from the checkpoint
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "mesh": {"data": 2, "fsdp": 4},
        "zero_stage": 3,
        "runtime": {"compilation_cache_dir": None},
    }
    model, optimizer = zerojax.initialize(model, optimizer, config=config)
    with zerojax.Checkpointer(directory, model, optimizer) as checkpointer:
        assert checkpointer.restore().step == 2
    got = {f"model/{k}": v.numpy() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            got[f"optimizer/{index}/{key}"] = np.asarray(value)
    _assert_equal_state(got, want)


def test_inspect_from_one_process(saved, capsys):
    directory, _ = saved
    assert cli_main(["ckpt", "inspect", str(directory)]) == 0
    printed = capsys.readouterr().out
    assert "steps 2 (latest 2)" in printed
    assert "fc1.weight   [64, 16]  float32" in printed


def test_export_from_one_process(saved, tmp_path):
    from safetensors.numpy import load_file

    directory, want = saved
    out = tmp_path / "model.safetensors"
    assert cli_main(["ckpt", "export", "--quiet", str(directory), str(out)]) == 0
    exported = load_file(out)
    assert {f"model/{k}" for k in exported} == {k for k in want if k.startswith("model/")}
    for name, value in exported.items():
        np.testing.assert_array_equal(value, want[f"model/{name}"], err_msg=name)


@pytest.mark.slow
def test_restore_on_two_processes_and_another_mesh(saved, tmp_path):
    directory, want = saved
    args = ["restore", "--dir", str(directory), "--mesh", "data=2,fsdp=4", "--out", str(tmp_path)]
    check_ok(torchrun(SCRIPT, *args, timeout=240))
    for rank in range(2):
        _assert_equal_state(dict(np.load(tmp_path / f"restore_rank{rank}.npz")), want)


@pytest.mark.slow  # ~15 s: one more 2-process job (make test-distributed runs it)
def test_async_save_leaves_the_loop_without_collectives(tmp_path):
    """Two processes: the save's Orbax work runs on the Checkpointer's thread and issues no
    device collective there (every `multihost_utils` collective is recorded by thread), and
    the step holds the state of save() time although the next steps ran at once
    (async_save_script.py asserts both on each rank)."""
    script = REPO / "tests" / "distributed" / "async_save_script.py"
    result = torchrun(script, "--dir", str(tmp_path / "ckpt"), "--mesh", "fsdp=8", timeout=240)
    check_ok(result)
    for rank in range(2):
        assert f"rank {rank}: " in result.stdout and "step 2 restored bitwise" in result.stdout
