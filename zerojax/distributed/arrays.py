"""Process-local data <-> global arrays, for batches split over processes, and the values every
process holds alike (a model's initial state).

With many processes each `jax.Array` is global: its shards live on every process's devices, and
a process can read only its own (`addressable_shards`). A batch input is assembled from each
process's rows with `jax.make_array_from_process_local_data` (no host ever holds the global
batch); a batch output goes back as this process's rows, the same rows its input fed.
Row order: a process's rows fill its devices' slices of dim 0 in ascending order, both ways.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

__all__ = [
    "batch_dim_sharding",
    "data_parallel_process_count",
    "global_from_local",
    "host_copy",
    "local_rows",
    "place_same_everywhere",
]


def batch_dim_sharding(sharding: NamedSharding, ndim: int) -> NamedSharding:
    """`sharding` with only its dim-0 split kept: every shard then holds whole rows."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(spec[0] if ndim else None))


def _rows_by_process(sharding: NamedSharding) -> dict[int, frozenset[int]]:
    """Process index -> the dim-0 shard numbers its devices hold."""
    axes = sharding.spec[0] if len(sharding.spec) else None
    num_shards = int(np.prod([sharding.mesh.shape[a] for a in np.atleast_1d(axes)])) if axes else 1
    rows: dict[int, set[int]] = defaultdict(set)
    for device, index in sharding.devices_indices_map((num_shards,)).items():
        rows[device.process_index].add(index[0].start or 0)
    return {process: frozenset(shards) for process, shards in rows.items()}


def data_parallel_process_count(sharding: NamedSharding) -> int:
    """How many processes feed distinct rows of a batch split by `sharding` (its dim 0).

    Raises ValueError unless every process holds its own rows, none shared with another: then
    the global batch is exactly the processes' local batches, one after the other (what
    `DistributedSampler` with num_replicas = world size assumes)."""
    by_process = _rows_by_process(batch_dim_sharding(sharding, 1))
    distinct = set(by_process.values())
    if len(distinct) != len(by_process) or len(by_process) != jax.process_count():
        mesh = sharding.mesh
        raise ValueError(
            f"the batch axes {sharding.spec[0]!r} of mesh {dict(mesh.shape)} do not give each of "
            f"the {jax.process_count()} processes its own rows (rows by process: "
            f"{ {p: sorted(r) for p, r in sorted(by_process.items())} }). With many processes "
            "the batch axes must span all of them (mesh axes used for tensor or sequence "
            "parallelism must lie within a process); put the data-parallel axes (data, fsdp) "
            "first in the mesh"
        )
    return len(distinct)


def global_from_local(local: np.ndarray, sharding: NamedSharding, num_processes: int) -> jax.Array:
    """The global array whose dim-0 rows on this process are `local`, laid out by `sharding`.

    Every dim but 0 is whole in `local` (each process feeds whole samples: a sequence axis in
    `sharding` splits them on the devices). Raises ValueError if this process's rows do not
    split evenly over its devices' shards."""
    local = np.asarray(local)
    if local.ndim == 0 or not sharding.spec or sharding.spec[0] is None:
        # Not split over the batch axes (scalars, a mesh without batch axes): the same value on
        # every process, as a replicated input must be.
        return jax.make_array_from_process_local_data(sharding, local, local.shape)
    local_shards = len(_rows_by_process(batch_dim_sharding(sharding, 1))[jax.process_index()])
    if local.shape[0] % local_shards:
        raise ValueError(
            f"this process's input of shape {local.shape}: its {local.shape[0]} rows do not split "
            f"over its {local_shards} batch shards ({sharding.spec[0]!r} of mesh "
            f"{dict(sharding.mesh.shape)}); use a per-process batch size that is a multiple of "
            f"{local_shards} (drop_last=True in the DataLoader avoids a short last batch)"
        )
    global_shape = (local.shape[0] * num_processes, *local.shape[1:])
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def local_rows(array: jax.Array, row_sharding: NamedSharding) -> np.ndarray:
    """This process's dim-0 rows of a global `array` as one host array; `array` is resharded to
    `row_sharding` (dim 0 split as the inputs were, nothing else) first if it is not so laid."""
    if not array.sharding.is_equivalent_to(row_sharding, array.ndim):
        array = jax.device_put(array, row_sharding)
    shards = {}
    for shard in array.addressable_shards:
        shards.setdefault(shard.index[0].start or 0, shard)
    return np.concatenate([np.asarray(shards[start].data) for start in sorted(shards)], axis=0)


def host_copy(array: jax.Array) -> np.ndarray:
    """The whole of a (possibly global) array on this host: `np.asarray` when this process holds
    it all, else an all-gather over the processes (every process must call it)."""
    if array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def place_same_everywhere(arrays: dict[str, np.ndarray], shardings: dict) -> dict[str, jax.Array]:
    """Host values that every process holds alike (a model's initial state, built from one seed)
    as global arrays laid out by `shardings` (same keys), in a job of several processes (one
    process places its values with `jax.device_put`: `zerojax.parallel.placement`).

    They are checked equal across processes first, all at once: one all-gather of each array's
    fingerprint. (`jax.device_put` of a host array checks it on its own, with a compiled
    all-gather per array: 0.9 s for the 18 arrays of a 5-layer MLP, paid by every restart of a
    job.) Each process then fills its devices' shards from its own copy. Raises ValueError
    naming the first array that differs between processes.
    """
    names = list(arrays)
    fingerprints = np.array(
        [np.frombuffer(_fingerprint(arrays[n]), np.uint32) for n in names], np.uint32
    ).reshape(len(names), 2)
    every_process = np.asarray(multihost_utils.process_allgather(fingerprints))
    differs = (every_process != every_process[:1]).any(axis=(0, 2))
    if differs.any():
        name = names[int(np.argmax(differs))]
        raise ValueError(
            f"zerojax: model tensor {name!r} (shape {np.shape(arrays[name])}) differs between "
            f"processes; build the model identically on every rank (torch.manual_seed before "
            f"constructing it), as DDP starts every rank from rank 0's parameters"
        )
    return {
        n: jax.make_array_from_callback(
            np.shape(arrays[n]), shardings[n], lambda index, host=arrays[n]: host[index]
        )
        for n in names
    }


def _fingerprint(array: np.ndarray) -> bytes:
    array = np.ascontiguousarray(array)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.view(np.uint8).reshape(-1).data if array.size else b"")
    return digest.digest()
