"""The subject of every fault: a small ZeRO-3 AdamW checkpoint, and the values it holds.

`build_base(root)` trains a 16-32-8 MLP for 2 steps under `zerojax.initialize` (8 simulated
CPU devices, ZeRO-3, AdamW with weight decay) and saves after each step with `Checkpointer`,
asynchronously, as a training loop does. The engine's values at each save are recorded in
`values_<step>.npz`; the faults compare what a reader hands back against them, bit for bit
(the same engine reading the same bytes must reproduce them exactly). Step 2 is also
exported as `model.safetensors` and `model.pt` for `ckpt import`.

    root/ckpt/{1,2}/...   root/values_1.npz   root/values_2.npz   root/model.safetensors

Every process that imports this module must have set up the 8 CPU devices first
(`simulated_devices`), before anything imports jax.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

ZERO3 = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
STEPS = (1, 2)


def simulated_devices() -> None:
    """8 CPU devices, as tests/conftest.py sets them; must run before jax is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def make_model(seed: int):
    """(model, optimizer) from `zerojax.initialize`; a different seed gives different
    initial weights, so a restore that writes nothing is seen."""
    import torch
    from torch import nn

    import zerojax

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    return zerojax.initialize(net, optimizer, config=ZERO3, seed=seed)


def state_values(model) -> dict[str, np.ndarray]:
    """Every value a checkpoint step holds, as host arrays: weights, AdamW moments and step,
    the RNG key, and the engine's counters. Keys are '/'-joined item paths."""
    import jax

    from zerojax.ckpt import training_state as ts

    engine = model.engine
    items = jax.device_get(ts.gather_items(engine, with_optimizer=True))
    flat: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(items):
        flat["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = np.asarray(
            leaf
        )
    for name, value in ts.engine_counters(engine.state).items():
        flat[f"engine/{name}"] = np.asarray(value)
    return flat


def differences(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> list[str]:
    """'name: why' for each value that is not bit-for-bit what was saved."""
    out = []
    for name in sorted(expected.keys() | got.keys()):
        if name not in got:
            out.append(f"{name}: missing")
        elif name not in expected:
            out.append(f"{name}: not saved")
        else:
            a, b = np.asarray(got[name]), np.asarray(expected[name])
            if a.shape != b.shape or a.dtype != b.dtype:
                out.append(f"{name}: {a.dtype}{list(a.shape)} vs saved {b.dtype}{list(b.shape)}")
            elif a.tobytes() != b.tobytes():
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                out.append(f"{name}: max |diff| {float(np.max(diff)):.3g}")
    return out


def load_values(root: str | os.PathLike, step: int) -> dict[str, np.ndarray]:
    with np.load(Path(root) / f"values_{step}.npz") as data:
        return {k: data[k] for k in data.files}


def restore_values_from(model, optimizer, directory: str | os.PathLike, step: int) -> None:
    """Load pristine `step` of `directory` into the engine (the starting state of the faults
    that need a live engine: no training, so no compilation)."""
    from zerojax.ckpt.checkpointer import Checkpointer

    reader = Checkpointer(directory, model, optimizer, max_to_keep=None)
    try:
        reader.restore(step)
    finally:
        reader.close()


def build_base(root: str | os.PathLike) -> Path:
    """Train, save steps 1 and 2, record their values, export step 2; returns root/ckpt."""
    import torch

    from zerojax.ckpt.checkpointer import Checkpointer
    from zerojax.ckpt.export import export_checkpoint

    root = Path(root)
    directory = root / "ckpt"
    model, optimizer = make_model(seed=0)
    generator = torch.Generator().manual_seed(1)
    with Checkpointer(directory, model, optimizer, max_to_keep=None) as ckpt:
        for step in STEPS:
            x = torch.randn(16, 16, generator=generator)
            y = torch.randn(16, 8, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.save(step)
            ckpt.wait()
            np.savez(root / f"values_{step}.npz", **state_values(model))
    for name in ("model.safetensors", "model.pt"):
        export_checkpoint(directory, root / name, step=STEPS[-1])
    return directory
