"""Lowerings: pointwise ops."""

import torch

from zerojax.bridge.registry import lowering  # noqa: F401

aten = torch.ops.aten
