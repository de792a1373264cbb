"""DDP semantics beyond the plain loop, checked inside a 2-process torchrun job (run by
tests/distributed/test_semantics.py). Each check raises AssertionError with the numbers; the
script prints "rank R: all checks passed" at the end.

1. input gradients (a wrapped model feeding a torch loss, `x.requires_grad`) are each rank's
   own d(local loss)/d(local x), as under DDP: compared with torch eager on the same rows;
2. the fused path (`loss_fn=`, the loss computed in the program over the global batch) gives
   the same update as the general path, whose equality with DDP test_ddp_parity.py checks;
3. `p.grad` is readable on every rank (gathered) and equals torch's DDP-averaged gradient;
4. a local batch that does not split over this process's devices is a ValueError naming it;
5. a model built differently on the two ranks is refused when placed;
6. `model.load_state_dict` / `optimizer.load_state_dict` work with several processes.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

import zerojax
from tests.distributed.ddp_script import MLP, dataset

CONFIG = {
    "devices": {"platform": "cpu", "num_cpu_devices": 4},
    "mesh": {"data": 2, "fsdp": 4},
    "zero_stage": 3,
    "runtime": {"compilation_cache_dir": None},
}
LOCAL_BATCH = 8
# fp32 reduction-order differences over <= 64-term sums (see test_ddp_parity.py): 1e-5 relative.
RTOL = 1e-5


def close(name, got, want, rtol=RTOL):
    got, want = np.asarray(got), np.asarray(want)
    error = float(np.abs(got - want).max())
    scale = max(float(np.abs(want).max()), 1e-30)
    assert error <= rtol * scale, f"{name}: max |diff| {error:.3g} > {rtol} x {scale:.3g}"


def main() -> None:
    data = dataset(2 * LOCAL_BATCH)
    torch.manual_seed(0)
    reference = MLP()
    ours = copy.deepcopy(reference)
    model, optimizer = zerojax.initialize(
        ours, torch.optim.SGD(ours.parameters(), lr=0.1), config=CONFIG
    )
    rank, world_size = zerojax.distributed.rank(), zerojax.distributed.world_size()
    assert world_size == 2
    rows = list(zerojax.distributed.sampler(data, shuffle=False))
    x, y = data.tensors[0][rows], data.tensors[1][rows]

    # 1 + 3: input gradients per rank; p.grad = the DDP average of the ranks' gradients.
    x_ours = x.clone().requires_grad_(True)
    F.cross_entropy(model(x_ours), y).backward()
    x_torch = x.clone().requires_grad_(True)
    torch_grads = []
    for r in range(world_size):  # every rank's local loss, as DDP would compute them
        rank_rows = list(torch.utils.data.DistributedSampler(data, world_size, r, shuffle=False))
        xr = x_torch if r == rank else data.tensors[0][rank_rows]
        reference.zero_grad()
        F.cross_entropy(reference(xr), data.tensors[1][rank_rows]).backward()
        torch_grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    close(f"rank {rank} input grad", x_ours.grad, x_torch.grad)
    for name, param in model.module.named_parameters():
        averaged = sum(g[name] for g in torch_grads) / world_size
        close(f"rank {rank} p.grad {name}", param.grad, averaged)
    optimizer.step()
    optimizer.zero_grad()
    general_path = model.state_dict()

    # 2: the fused path's update equals the general path's.
    ours = copy.deepcopy(reference)  # its weights are still the initial ones (never stepped)
    fused, fused_optimizer = zerojax.initialize(
        ours,
        torch.optim.SGD(ours.parameters(), lr=0.1),
        config=CONFIG,
        loss_fn=F.cross_entropy,
    )
    loss = fused(x, y)
    assert loss.ndim == 0
    loss.backward()
    fused_optimizer.step()
    for name, value in fused.state_dict().items():
        close(f"rank {rank} fused {name}", value, general_path[name])

    # 6: state_dicts load back on every rank (host tensors -> global arrays).
    saved, saved_optimizer = fused.state_dict(), fused_optimizer.state_dict()
    fused.load_state_dict(general_path)
    for name, value in fused.state_dict().items():
        assert torch.equal(value, general_path[name]), name
    fused.load_state_dict(saved)
    fused_optimizer.load_state_dict(saved_optimizer)
    for name, value in fused.state_dict().items():
        assert torch.equal(value, saved[name]), name

    # 4: a local batch that does not split over this process's 4 devices.
    try:
        model(x[:6])
    except ValueError as error:
        assert "do not split" in str(error) and "(6, 16)" in str(error), error
    else:
        raise AssertionError("a 6-row local batch on 4 devices was accepted")

    # 5: different parameters on the two ranks.
    torch.manual_seed(100 + rank)
    try:
        zerojax.initialize(MLP(), config=CONFIG)
    except ValueError as error:
        # The first tensor that differs is named (LayerNorm's ones agree; fc1 is drawn first).
        assert "'fc1.weight'" in str(error) and "differs between processes" in str(error), error
    else:
        raise AssertionError("ranks with different parameters were accepted")
    print(f"rank {rank}: all checks passed", flush=True)


if __name__ == "__main__":
    main()
