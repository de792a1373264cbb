"""Make the registry's torchvision importable beside the CPU torch (kept out of the package).

The registry's torchvision wheel is a CUDA build: its C extension cannot load beside the CPU
torch 2.13, and `import torchvision` then fails registering fake kernels for `torchvision::nms`
and `torchvision::qnms`, ops the missing extension would have defined. Its model definitions
are pure Python, so defining those two schemas first is enough for them (the detection ops
themselves stay unusable). transformers imports torchvision whenever it is installed, so with
the dev extra every `from transformers import ...` would fail. Beside torch 2.14.1's CUDA build
(`make test-torch-2.14`) the extension loads, and nothing here defines anything. Hence:

- `make` copies this file into the dev venv with a `.pth` line that calls `install_hook()`:
  every Python of that venv (the demo, the examples, a user's script) defines the schemas
  just before torchvision is first imported. Nothing is imported at start-up.
- tests/conftest.py and tools/model_zoo.py call `define_missing_schemas()` themselves, so they
  also work in an environment set up without the Makefile.
"""

from __future__ import annotations

import sys

_SCHEMAS = {
    # As torchvision's csrc/ops/nms.cpp defines them.
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _extension_loads() -> bool:
    """Whether torchvision's C extension loads beside this torch (torchvision is not imported).

    It does where the two builds match (torch 2.14.1 and torchvision 0.29.1, both CUDA builds,
    in `make test-torch-2.14`); then it must be the one to define the schemas: a second
    definition of `torchvision::nms` aborts the process when the extension loads. Loading it
    here first is harmless: torchvision's own load of the same file is then a no-op.
    """
    import importlib.util
    from pathlib import Path

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    # torchvision/extension.py loads `_C_stable` from 0.29 on, `_C` before.
    for directory in spec.submodule_search_locations:
        for library in ("_C_stable.so", "_C.so"):
            path = Path(directory) / library
            if path.exists():
                try:
                    torch.ops.load_library(str(path))
                except OSError:  # CUDA build beside a CPU torch: undefined symbols
                    return False
                return True
    return False


def define_missing_schemas() -> None:
    """Define the torchvision op schemas its C extension would have; a no-op where it loads."""
    import torch

    if _extension_loads():
        return
    for name, schema in _SCHEMAS.items():
        try:
            getattr(torch.ops.torchvision, name)
        except (AttributeError, RuntimeError):
            torch.library.define(f"torchvision::{name}", schema)


class _BeforeTorchvision:
    """A meta-path finder that only runs `define_missing_schemas` when torchvision is first
    imported, then steps aside (it finds nothing itself)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_missing_schemas()


def install_hook() -> None:
    sys.meta_path.insert(0, _BeforeTorchvision())
