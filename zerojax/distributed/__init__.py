"""Many processes: the same training script under torchrun or SLURM, on `jax.distributed`.

    torchrun --nproc-per-node 2 train.py        # or: srun --ntasks 2 python train.py

`zerojax.initialize` joins the job itself (`initialize()` here) when the launcher's environment
says there is more than one process. Semantics are PyTorch DDP's: each process feeds its own
local batch (`sampler(dataset)` shards a dataset the way `DistributedSampler` does), `model(x)`
returns that process's rows, the loss it computes is its local loss, and `optimizer.step()`
applies the gradient averaged over processes. Modules: `launcher` (reading the environment),
`job` (joining it), `arrays` (process-local rows <-> global arrays).
"""

from __future__ import annotations

from zerojax.distributed.job import initialize, is_initialized, job, local_rank, rank, world_size
from zerojax.distributed.launcher import COORDINATOR_PORT_OFFSET, LauncherEnv, read_launcher_env

__all__ = [
    "COORDINATOR_PORT_OFFSET",
    "LauncherEnv",
    "initialize",
    "is_initialized",
    "job",
    "local_rank",
    "rank",
    "read_launcher_env",
    "sampler",
    "world_size",
]


def sampler(dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
    """`torch.utils.data.DistributedSampler` over this job's processes: this process's share of
    `dataset`, no torch process group needed (num_replicas and rank come from the launcher).

        loader = DataLoader(ds, batch_size=per_process_batch, sampler=zerojax.distributed.sampler(ds))
        for epoch in range(n):
            loader.sampler.set_epoch(epoch)   # a new shuffle per epoch, the same on every process

    `drop_last=True` (DistributedSampler's default is False) keeps every process's share the
    same length: a padded share repeats samples, which would count them twice in the average.
    Equivalent to `DistributedSampler(dataset, num_replicas=world_size(), rank=rank(), ...)`.
    """
    from torch.utils.data import DistributedSampler

    return DistributedSampler(
        dataset,
        num_replicas=world_size(),
        rank=rank(),
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
