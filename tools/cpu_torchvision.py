"""Make the registry's torchvision importable beside the CPU torch (kept out of the package).

The registry's torchvision wheel is a CUDA build: its C extension cannot load beside the CPU
torch 2.13, and `import torchvision` then fails registering fake kernels for `torchvision::nms`
and `torchvision::qnms`, ops the missing extension would have defined. Its model definitions
are pure Python, so defining those two schemas first is enough for them (the detection ops
themselves stay unusable). transformers imports torchvision whenever it is installed, so the
test suite calls `define_missing_schemas()` before anything imports transformers
(tests/conftest.py), and tools/model_zoo.py before it imports torchvision or timm.
"""

from __future__ import annotations

import torch

_SCHEMAS = {
    # As torchvision's csrc/ops/nms.cpp defines them.
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def define_missing_schemas() -> None:
    """Define the torchvision op schemas its C extension would have; a no-op where it loaded."""
    for name, schema in _SCHEMAS.items():
        if not _op_exists(name):
            torch.library.define(f"torchvision::{name}", schema)


def _op_exists(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False
