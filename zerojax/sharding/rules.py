"""Parameter name -> PartitionSpec: rule matching.

A rule is a regex searched in the state_dict name and a per-dimension list of mesh axes; the
first matching rule wins. The built-in presets live in `zerojax.config.presets` (the config
expands them while loading) and are re-exported here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from jax.sharding import PartitionSpec

from zerojax.config.presets import PRESETS

__all__ = ["PRESETS", "match_rules", "rule_partition_spec", "to_partition_spec"]


def rule_partition_spec(spec: tuple, mesh_axes: Iterable[str], *, drop_missing: bool) -> tuple:
    """A rule's spec as per-dim tuples of mesh axes; axes the mesh lacks are dropped when
    `drop_missing` (presets), which validation guarantees cannot happen for user rules."""
    mesh_axes = set(mesh_axes)
    dims = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if drop_missing:
            axes = tuple(a for a in axes if a in mesh_axes)
        assert all(a in mesh_axes for a in axes), (spec, mesh_axes)
        dims.append(axes)
    return tuple(dims)


def match_rules(names: Iterable[str], rules) -> tuple[dict[str, int | None], list[int]]:
    """First matching rule per name (index into `rules`, or None) and the indices of rules that
    matched no name at all."""
    compiled = [re.compile(rule.pattern) for rule in rules]
    chosen: dict[str, int | None] = {}
    used = set()
    for name in names:
        chosen[name] = None
        for index, regex in enumerate(compiled):
            if regex.search(name):
                chosen[name] = index
                used.add(index)
                break
    # "Matched nothing" counts any match, not only winning ones: a rule shadowed by an earlier
    # one is still a rule whose pattern is right.
    for name in chosen:
        for index, regex in enumerate(compiled):
            if index not in used and regex.search(name):
                used.add(index)
    return chosen, [i for i in range(len(rules)) if i not in used]


def to_partition_spec(dims: tuple[tuple[str, ...], ...]) -> PartitionSpec:
    """Per-dim axis tuples -> PartitionSpec, one entry per dim."""
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in dims))
