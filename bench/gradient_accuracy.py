"""ResNet-18 gradient accuracy, torch fp32 and zerojax, against plain float64 and at own branches.

The issue-25 recipe: torchvision `resnet18(num_classes=10)` in train mode, batch 8 of 64x64
random images, cross-entropy, one backward; zerojax as a user runs it (`zerojax.initialize`,
`loss.backward()` on the returned logits). For each seed, the worst per-tensor relative error
(2-norms) of torch fp32's and zerojax's parameter gradients against

* plain float64 torch (the judge the issue used: every ReLU and max-pool on float64's branch),
* float64 at each run's own branches (tools/float64_judge.py, the judge the tests use),

and how many ReLU inputs of torch fp32's forward sit on the other side of zero from float64's.

Run: .venv/bin/python bench/gradient_accuracy.py [--seeds 8]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np
import torch
import torch.nn.functional as F

from tools.float64_judge import (
    float64_gradients_at,
    relative_errors,
    torch_fp32_gradients,
    zerojax_fp32_gradients,
)
from tools.model_zoo import import_torchvision


def worst(errors: dict[str, float]) -> tuple[float, str]:
    name = max(errors, key=errors.get)
    return errors[name], name


def relu_sign_flips(model, x) -> int:
    """ReLU inputs of torch fp32's forward on the other side of zero from float64's."""
    inputs: dict[torch.dtype, list[torch.Tensor]] = {torch.float32: [], torch.float64: []}

    def record(module, args):
        inputs[args[0].dtype].append(args[0].detach().clone())

    for dtype in inputs:
        twin = copy.deepcopy(model).to(dtype)
        for module in twin.modules():
            if isinstance(module, torch.nn.ReLU):
                module.register_forward_pre_hook(record)
        with torch.no_grad():
            twin(x.to(dtype))
    pairs = zip(inputs[torch.float32], inputs[torch.float64], strict=True)
    return sum(int(((a > 0) != (b > 0)).sum()) for a, b in pairs)


def run_seed(seed: int) -> dict:
    torchvision = import_torchvision()
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=10).train()
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

    def loss_of(out):
        return F.cross_entropy(out, y)

    twin = copy.deepcopy(model).double()
    loss_of(twin(x.double())).backward()
    plain = {n: p.grad.numpy() for n, p in twin.named_parameters()}

    torch_grads, torch_seen = torch_fp32_gradients(model, x, loss_of)
    zj_grads, zj_seen = zerojax_fp32_gradients(model, x, loss_of)
    return {
        "torch_plain": worst(relative_errors(torch_grads, plain)),
        "zerojax_plain": worst(relative_errors(zj_grads, plain)),
        "torch_own": worst(
            relative_errors(torch_grads, float64_gradients_at(model, (x,), loss_of, torch_seen))
        ),
        "zerojax_own": worst(
            relative_errors(zj_grads, float64_gradients_at(model, (x,), loss_of, zj_seen))
        ),
        "torch_relu_flips": relu_sign_flips(model, x),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    print(
        "| seed | torch fp32 vs plain float64 | zerojax vs plain float64 | torch fp32 at own "
        "branches | zerojax at own branches | ratio at own branches | torch fp32 ReLU flips |"
    )
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for seed in range(args.seeds):
        r = run_seed(seed)
        ratio = r["zerojax_own"][0] / r["torch_own"][0]
        ratios.append(ratio)
        print(
            f"| {seed} | {r['torch_plain'][0]:.1e} | {r['zerojax_plain'][0]:.1e} | "
            f"{r['torch_own'][0]:.1e} | {r['zerojax_own'][0]:.1e} ({r['zerojax_own'][1]}) | "
            f"{ratio:.2f} | {r['torch_relu_flips']} |",
            flush=True,
        )
    print(f"median ratio at own branches: {np.median(ratios):.2f}, worst {max(ratios):.2f}")


if __name__ == "__main__":
    main()
