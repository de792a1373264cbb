"""Joining the launcher's job: `jax.distributed.initialize` with what torchrun or SLURM set.

JAX's multi-controller runtime is the engine: every process runs the same program on the global
mesh (`jax.devices()` lists all processes' devices, `jax.local_devices()` this one's), and the
collectives between processes are XLA's (gloo on CPU, JAX's default
`jax_cpu_collectives_implementation`; NCCL on GPU). zerojax adds no rendezvous and no
collectives of its own; it only translates the launcher's environment (`launcher.py`).

`jax.distributed.initialize` must run before JAX starts its backends (the first jax.devices()
or array operation); `jax_num_cpu_devices` may be set before or after it, and counts this
process's devices.
"""

from __future__ import annotations

import logging
import os

from zerojax.distributed.launcher import LauncherEnv, read_launcher_env

__all__ = ["initialize", "is_initialized", "job", "local_rank", "rank", "world_size"]

log = logging.getLogger("zerojax")

_joined: LauncherEnv | None = None


def _auto_local_device_ids(env: LauncherEnv) -> list[int] | None:
    """torchrun's convention (and JAX's for SLURM): one accelerator per process, the one at
    LOCAL_RANK, unless the user already chose (CUDA_VISIBLE_DEVICES, JAX_LOCAL_DEVICE_IDS).
    On CPU JAX ignores it (it only narrows the CUDA/ROCm visible devices)."""
    if env.local_world_size <= 1:
        return None
    if os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    return [env.local_rank]


DEFAULT_HEARTBEAT_TIMEOUT = 100
"""JAX's default: seconds without a heartbeat before a process is declared dead."""


def _heartbeat_timeout_from_env() -> int:
    value = os.environ.get("ZEROJAX_HEARTBEAT_TIMEOUT")
    if not value:
        return DEFAULT_HEARTBEAT_TIMEOUT
    try:
        seconds = int(value)
    except ValueError:
        seconds = 0
    if seconds <= 0:
        raise ValueError(f"ZEROJAX_HEARTBEAT_TIMEOUT={value!r}: expected a positive integer (s)")
    return seconds


def _let_torchrun_stop_this_process() -> None:
    """Turn off JAX's preemption service under torchrun, unless the user set it.

    The service installs a SIGTERM handler (to agree on a checkpoint step when a cloud VM is
    preempted), so SIGTERM no longer stops the process. torchrun's agent stops the surviving
    ranks of a failed attempt with SIGTERM and sends SIGKILL only 30 s later: with the service
    on, every restart waited those 30 s (bench/multiprocess.py: detection 30.1 s, now
    0.05-0.2 s). A PyTorch worker dies on SIGTERM; so does ours. zerojax's Checkpointer saves
    on its interval and does not use the service's sync points."""
    import jax

    if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ:
        jax.config.update("jax_enable_preemption_service", False)


def initialize(
    *,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int | None = None,
) -> LauncherEnv:
    """Join the job this process was launched into (torchrun or SLURM); returns its `LauncherEnv`.

    A no-op for one process (a plain `python script.py`) and on every call after the first.
    `zerojax.initialize` calls it for you; call it yourself only to use JAX before that (then
    call it first thing, before any jax operation). `initialization_timeout`: seconds to wait for
    every process to connect; `heartbeat_timeout_seconds` (default: ZEROJAX_HEARTBEAT_TIMEOUT,
    else JAX's 100): how long a silent process is taken to be alive. It bounds how long the
    survivors of a dead process take to exit when no agent stops them (srun, a plain launch):
    their next collective fails at once, but JAX's shutdown waits for the dead one's heartbeat
    to time out before it aborts the process (both JAX's own parameters). torchrun's agent
    stops the other ranks itself as soon as one dies.

    Raises RuntimeError if JAX's backends already started (some jax call ran first).
    """
    global _joined
    if _joined is not None:
        return _joined
    import jax

    env = read_launcher_env()
    if jax.distributed.is_initialized():
        # Joined by the user's own jax.distributed.initialize: take JAX's word for the layout.
        log.info("zerojax.distributed: JAX's distributed runtime was already initialized")
        _joined = env
        return env
    if not env.is_multiprocess:
        return env  # nothing to join (and nothing cached: rank() keeps reading the environment)
    kwargs = {
        "initialization_timeout": initialization_timeout,
        "heartbeat_timeout_seconds": (
            _heartbeat_timeout_from_env()
            if heartbeat_timeout_seconds is None
            else heartbeat_timeout_seconds
        ),
    }
    if env.launcher == "torchrun":
        _let_torchrun_stop_this_process()
        kwargs.update(
            coordinator_address=env.coordinator_address,
            num_processes=env.world_size,
            process_id=env.rank,
            local_device_ids=_auto_local_device_ids(env),
            # Every value is given: no SLURM/MPI detection may override them (torchrun in srun).
            cluster_detection_method="deactivate",
        )
    elif env.coordinator_address is not None:  # SLURM with an explicit coordinator
        kwargs.update(coordinator_address=env.coordinator_address)
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as exc:
        if "before" in str(exc):
            raise RuntimeError(
                f"zerojax.distributed.initialize: process {env.rank} of {env.world_size} "
                f"({env.launcher}) cannot join the job: JAX already started its backends. Call "
                "zerojax.initialize (or zerojax.distributed.initialize()) before any jax "
                "operation (jax.devices(), jnp.array, ...)."
            ) from exc
        raise
    log.info(
        "zerojax.distributed: process %d of %d (%s, local %d of %d), coordinator %s",
        env.rank,
        env.world_size,
        env.launcher,
        env.local_rank,
        env.local_world_size,
        env.coordinator_address or "detected by JAX",
    )
    _joined = env
    return env


def is_initialized() -> bool:
    """Whether this process is part of a multi-process JAX job."""
    import jax

    return jax.distributed.is_initialized()


def job() -> LauncherEnv:
    """This process's place in the job: as joined, else as the launcher's environment says."""
    return _joined if _joined is not None else read_launcher_env()


def rank() -> int:
    """Global index of this process (torch's RANK, `jax.process_index()`); 0 for one process."""
    return job().rank


def world_size() -> int:
    """Number of processes in the job (torch's WORLD_SIZE, `jax.process_count()`)."""
    return job().world_size


def local_rank() -> int:
    """Index of this process on its host (torch's LOCAL_RANK)."""
    return job().local_rank
