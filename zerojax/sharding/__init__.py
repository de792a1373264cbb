"""Sharding: the device mesh, name-based partition rules, and ZeRO stages as shardings."""

from zerojax.sharding.mesh import configure_devices, make_mesh
from zerojax.sharding.rules import PRESETS, match_rules
from zerojax.sharding.zero import ReplicatedParam, ShardingPlan, make_sharding_plan, zero_dims

__all__ = [
    "PRESETS",
    "ReplicatedParam",
    "ShardingPlan",
    "configure_devices",
    "make_mesh",
    "make_sharding_plan",
    "match_rules",
    "zero_dims",
]
