"""Bytes a compiled program's all-to-alls send over each mesh axis, read from its HLO text.

Expert parallelism's cost is its dispatch and combine all-to-alls, and which link they cross
matters more than their total: a hierarchical mesh (`node` x `local`) has a slow axis and a fast
one. This reads the optimized HLO (`compiled.as_text()`) instead of trusting a formula: each
`all-to-all` names its replica groups and the buffer it sends to each group member, so the bytes
one device sends every other device are known exactly, and each chunk is charged to the
outermost mesh axis on which sender and receiver differ (mesh axes are listed outermost, i.e.
slowest link, first: a chunk to another node crosses the inter-node link whatever its local
index). A device's chunk to itself is not sent.

XLA:CPU writes an all-to-all in two forms, both handled: a tuple of per-receiver chunks
(`(f32[16,16], f32[16,16]) all-to-all(a, b), replica_groups={{0,4},...}`), and one array split
along `dimensions={d}`. Replica groups come as lists or in iota form (`[4,2]<=[2,4]T(1,0)`).
Partition ids are positions in the mesh's device order (`mesh.devices.flat`), which is the
device assignment of a program jitted on that mesh.
"""

from __future__ import annotations

import math
import re

import numpy as np
from jax.sharding import Mesh

__all__ = ["all_to_all_bytes_per_axis"]

_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_DIMENSIONS = re.compile(r"dimensions=\{(\d+)\}")
# jax >= 0.11 (jax_use_rgv3): groups named by mesh axes, `mesh['node'=2,'local'=4] {'local'}`.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def all_to_all_bytes_per_axis(hlo_text: str, mesh: Mesh) -> dict[str, float]:
    """Bytes one device sends over each mesh axis in the program's all-to-alls, averaged over
    the devices (every axis of the mesh is a key, 0 when nothing crosses it).

    Raises ValueError for an all-to-all whose element type, replica groups or split dimension
    cannot be read, naming the instruction."""
    coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), 1)
    totals = dict.fromkeys(mesh.axis_names, 0.0)
    for line in hlo_text.splitlines():
        if " all-to-all(" not in line or "=" not in line:
            continue
        chunk_bytes, groups = _chunks_and_groups(line.strip(), mesh.devices.size)
        for group in groups:
            for sender in group:
                for receiver, size in zip(group, chunk_bytes, strict=True):
                    differ = np.flatnonzero(coords[sender] != coords[receiver])
                    if differ.size:  # else: the sender's own chunk, never sent
                        totals[mesh.axis_names[differ[0]]] += size
    return {axis: total / mesh.devices.size for axis, total in totals.items()}


def _chunks_and_groups(line: str, num_devices: int) -> tuple[list[int], list[list[int]]]:
    """(bytes of the chunk sent to each group member, in member order; the replica groups)."""
    result = line.split("=", 1)[1].split(" all-to-all(", 1)[0].strip()
    arrays = _ARRAY.findall(result)
    for dtype, _ in arrays:
        if dtype not in _ITEMSIZE:
            raise ValueError(f"all-to-all with element type {dtype!r} not understood: {line}")
    sizes = [
        _ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in arrays
    ]
    groups = _replica_groups(line, num_devices)
    members = len(groups[0])
    if result.startswith("("):  # tuple form: one chunk per group member
        if len(sizes) != members:
            raise ValueError(f"all-to-all with {len(sizes)} chunks for {members} members: {line}")
        return sizes, groups
    split = _DIMENSIONS.search(line)
    (dtype, dims), size = arrays[0], sizes[0]
    shape = [int(d) for d in dims.split(",") if d]
    if split is None or shape[int(split.group(1))] % members:
        raise ValueError(f"all-to-all split dimension not understood: {line}")
    return [size // members] * members, groups


def _replica_groups(line: str, num_devices: int) -> list[list[int]]:
    listed = _LIST_GROUPS.search(line)
    if listed is not None and listed.group(1):
        return [
            [int(i) for i in g.split(",") if i]
            for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
        ]
    iota = _IOTA_GROUPS.search(line)
    if iota is not None:
        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return ids.reshape(count, size).tolist()
    by_axes = _MESH_GROUPS.search(line)
    if by_axes is not None:
        axes = re.findall(r"'([^']+)'=(\d+)", by_axes.group(1))
        names = [name for name, _ in axes]
        ids = np.arange(num_devices).reshape([int(size) for _, size in axes])
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", by_axes.group(2))]
        rest = [i for i in range(len(names)) if i not in grouped]
        size = math.prod(ids.shape[i] for i in grouped)
        return ids.transpose(rest + grouped).reshape(-1, size).tolist()
    if listed is not None:  # replica_groups={}: one group of every device
        return [list(range(num_devices))]
    raise ValueError(f"all-to-all replica groups not understood: {line}")
