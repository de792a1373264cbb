"""The launcher's environment as zerojax reads it (no processes started; fast).

.venv/bin/python -m pytest -q tests/distributed/test_launcher.py
"""

from __future__ import annotations

import pytest
import torch

import zerojax
from zerojax.distributed import COORDINATOR_PORT_OFFSET, read_launcher_env

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "29500",
}


def test_torchrun_environment():
    env = read_launcher_env(TORCHRUN)
    assert (env.launcher, env.rank, env.world_size) == ("torchrun", 3, 4)
    assert (env.local_rank, env.local_world_size) == (1, 2)
    # JAX's coordinator next to torch's store, never on its port.
    assert env.coordinator_address == f"10.0.0.7:{29500 + COORDINATOR_PORT_OFFSET}"
    assert env.is_multiprocess


def test_coordinator_port_overrides():
    env = read_launcher_env({**TORCHRUN, "ZEROJAX_COORDINATOR_PORT": "41000"})
    assert env.coordinator_address == "10.0.0.7:41000"
    env = read_launcher_env({**TORCHRUN, "JAX_COORDINATOR_ADDRESS": "head:1234"})
    assert env.coordinator_address == "head:1234"


def test_slurm_environment():
    env = read_launcher_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS_PER_NODE": "4(x2)",
        }
    )
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("slurm", 5, 8, 1)
    assert env.local_world_size == 4
    assert env.coordinator_address is None  # JAX's own SLURM detection picks it


def test_torchrun_wins_over_slurm():
    """torchrun inside an srun allocation: torch's RANK/WORLD_SIZE describe the workers."""
    env = read_launcher_env({**TORCHRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (env.launcher, env.rank, env.world_size) == ("torchrun", 3, 4)


def test_plain_run_is_one_process():
    env = read_launcher_env({})
    assert (env.launcher, env.rank, env.world_size, env.is_multiprocess) == ("none", 0, 1, False)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT is not"),
        ({**TORCHRUN, "RANK": "4"}, r"RANK=4 must lie in \[0, WORLD_SIZE=4\)"),
        ({**TORCHRUN, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' must be an integer"),
        ({**TORCHRUN, "MASTER_PORT": "65535"}, "65536 .* is not a TCP port"),
    ],
)
def test_bad_environment_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        read_launcher_env(env)


def test_initialize_is_a_no_op_for_one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert zerojax.distributed.initialize().world_size == 1
    assert (zerojax.distributed.rank(), zerojax.distributed.world_size()) == (0, 1)
    assert not zerojax.distributed.is_initialized()


def test_num_cpu_devices_is_per_process(monkeypatch):
    """Under torchrun with 2 processes, 4 simulated devices each fill an 8-device mesh."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    config = zerojax.load_config(
        {"devices": {"num_cpu_devices": 4}, "mesh": {"data": 2, "fsdp": -1}}
    )
    assert config.mesh.shape == (2, 4)


def test_sampler_is_distributed_sampler(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    data = torch.utils.data.TensorDataset(torch.randn(20, 2))
    ours = zerojax.distributed.sampler(data, seed=3)
    torch_sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=3, rank=1, seed=3, drop_last=True
    )
    for epoch in (0, 1):
        ours.set_epoch(epoch)
        torch_sampler.set_epoch(epoch)
        assert list(ours) == list(torch_sampler)
    assert len(ours) == 20 // 3
