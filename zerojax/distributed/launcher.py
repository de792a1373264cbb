"""What the launcher says about this process: rank, world size, coordinator address.

Read from the environment only (never from JAX, whose backends must not start before
`jax.distributed.initialize`), in this order:

- torchrun (`python -m torch.distributed.run`, `torchrun`): RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. torch's store listens on MASTER_PORT (a script
  may also call `torch.distributed.init_process_group` on it), so JAX's coordinator takes
  MASTER_PORT + `COORDINATOR_PORT_OFFSET` (on rank 0's host, MASTER_ADDR).
- SLURM (`srun`): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID. The coordinator address is left to
  JAX's own SLURM detection (`jax._src.clusters.SlurmCluster`: first node of SLURM_NODELIST, a
  port derived from SLURM_JOB_ID).

Overrides: ZEROJAX_COORDINATOR_PORT (a port number: the coordinator binds it on MASTER_ADDR),
JAX's own JAX_COORDINATOR_ADDRESS (`host:port`, used as given) and JAX_LOCAL_DEVICE_IDS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["COORDINATOR_PORT_OFFSET", "LauncherEnv", "read_launcher_env"]

COORDINATOR_PORT_OFFSET = 1
"""JAX's coordinator port = MASTER_PORT + this, unless ZEROJAX_COORDINATOR_PORT is set. torch's
store owns MASTER_PORT itself; torchrun's default MASTER_PORT (29500) is below Linux's ephemeral
range (32768+), so 29501 is not handed to some other process's outgoing connection."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LauncherEnv:
    """One process's place in a job, as its launcher described it."""

    launcher: str
    """"torchrun", "slurm" or "none" (a plain `python script.py`: one process)."""

    rank: int
    """Global process index (torch's RANK; JAX's process_id)."""

    world_size: int
    """Number of processes in the job (JAX's num_processes)."""

    local_rank: int
    """Index of this process on its host."""

    local_world_size: int
    """Number of processes on this host."""

    coordinator_address: str | None
    """`host:port` for JAX's coordinator; None lets JAX detect it (SLURM)."""

    restart_count: int = 0
    """How many times the launcher restarted this job (torchrun's TORCHELASTIC_RESTART_COUNT,
    SLURM's SLURM_RESTART_COUNT for a requeued job); 0 on the first attempt."""

    @property
    def is_multiprocess(self) -> bool:
        return self.world_size > 1


def _int_env(name: str, env: dict[str, str]) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def _coordinator_from_master(env: dict[str, str]) -> str:
    explicit = env.get("JAX_COORDINATOR_ADDRESS")
    if explicit:
        return explicit
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ValueError(
            f"RANK and WORLD_SIZE are set but {' and '.join(missing)} is not: zerojax puts JAX's "
            "coordinator next to torch's store (MASTER_ADDR:MASTER_PORT+"
            f"{COORDINATOR_PORT_OFFSET}). Launch with torchrun, or set MASTER_ADDR and "
            "MASTER_PORT (or JAX_COORDINATOR_ADDRESS=host:port) yourself"
        )
    if env.get("ZEROJAX_COORDINATOR_PORT"):
        port = _int_env("ZEROJAX_COORDINATOR_PORT", env)
    else:
        port = _int_env("MASTER_PORT", env) + COORDINATOR_PORT_OFFSET
    if not 0 < port < 65536:
        raise ValueError(
            f"JAX coordinator port {port} (MASTER_PORT={env['MASTER_PORT']} + "
            f"{COORDINATOR_PORT_OFFSET}, or ZEROJAX_COORDINATOR_PORT) is not a TCP port; set "
            "ZEROJAX_COORDINATOR_PORT to a free port below 65536"
        )
    return f"{env['MASTER_ADDR']}:{port}"


def _restart_count(name: str, env: dict[str, str]) -> int:
    return _int_env(name, env) if env.get(name) else 0


def read_launcher_env(env: dict[str, str] | None = None) -> LauncherEnv:
    """This process's `LauncherEnv` from `env` (default `os.environ`).

    Raises ValueError naming the variable when the launcher's variables are inconsistent
    (RANK without MASTER_ADDR, RANK >= WORLD_SIZE, a non-integer value)."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world_size = _int_env("RANK", env), _int_env("WORLD_SIZE", env)
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} must lie in [0, WORLD_SIZE={world_size})")
        local_rank = _int_env("LOCAL_RANK", env) if "LOCAL_RANK" in env else 0
        local_world_size = (
            _int_env("LOCAL_WORLD_SIZE", env) if "LOCAL_WORLD_SIZE" in env else world_size
        )
        return LauncherEnv(
            launcher="torchrun",
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            coordinator_address=_coordinator_from_master(env) if world_size > 1 else None,
            restart_count=_restart_count("TORCHELASTIC_RESTART_COUNT", env),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world_size = _int_env("SLURM_PROCID", env), _int_env("SLURM_NTASKS", env)
        local_rank = _int_env("SLURM_LOCALID", env) if "SLURM_LOCALID" in env else 0
        per_node = env.get("SLURM_NTASKS_PER_NODE", "")
        # "4" or "4(x2)": tasks per node; a heterogeneous list leaves it unknown (= world size).
        local_world_size = int(per_node.split("(")[0]) if per_node[:1].isdigit() else world_size
        return LauncherEnv(
            launcher="slurm",
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            coordinator_address=env.get("JAX_COORDINATOR_ADDRESS") or None,
            restart_count=_restart_count("SLURM_RESTART_COUNT", env),
        )
    return LauncherEnv(
        launcher="none",
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        coordinator_address=None,
    )
