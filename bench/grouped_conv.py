"""Grouped convolutions' kernel gradient on XLA:CPU: autodiff's vs zerojax's (tap by tap).

Autodiff's kernel gradient of a grouped convolution is a convolution with `batch_group_count`,
which XLA:CPU expands into a dense convolution over every channel pair, masked to the groups
and summed (groups times the work). zerojax forms it tap by tap instead
(zerojax/bridge/lowerings/conv.py). On one CPU device, fp32:

1. The kernel gradient alone (jitted, medians of --repeats interleaved calls) for ResNeXt's 3x3
   with 32 groups and ConvNeXt's depthwise 7x7, at this bench's batch 8 and at ImageNet's first
   stage (batch 32, 56x56; --quick skips those, each takes seconds), with both results'
   largest difference.
2. A training step (forward, cross-entropy, backward, SGD momentum 0.9) of torchvision's
   `resnext50_32x4d(num_classes=10)` on 8 random 64x64 images: torch eager, and zerojax's
   fused step (`model(x, y)` returns the loss) with its lowering and with autodiff's kernel
   gradient patched back in, interleaved.

Run: .venv/bin/python bench/grouped_conv.py [--repeats N] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp
import numpy as np
import torch
import torchvision

from bench.cnn_step import CLASSES, IMAGE, torch_step, zerojax_step
from bench.timing import interleaved_medians_ms
from zerojax.bridge.lowerings import conv

SHAPES = [
    # (what, batch, channels, size, groups, kernel)
    ("ResNeXt 3x3, 32 groups, bench stage 1", 8, 128, 16, 32, 3),
    ("ResNeXt 3x3, 32 groups, bench stage 2", 8, 256, 8, 32, 3),
    ("ConvNeXt depthwise 7x7, bench stage 1", 8, 48, 16, 48, 7),
    ("ConvNeXt depthwise 7x7, bench stage 2", 8, 96, 8, 96, 7),
    ("ResNeXt 3x3, 32 groups, ImageNet stage 1", 32, 128, 56, 32, 3),
    ("ConvNeXt depthwise 7x7, ImageNet stage 1", 32, 96, 56, 96, 7),
]


# What the lowering computed before: the plain grouped conv, differentiated by autodiff.
_autodiff_grouped = conv._groupwise


def kernel_gradient(grouped, groups, padding):
    def loss(w, x, g):
        out = grouped(x, w, (1, 1), ((padding, padding),) * 2, (1, 1), groups)
        return jnp.vdot(out, g)

    return jax.jit(jax.grad(loss))


def kernel_gradient_table(repeats: int, quick: bool) -> None:
    print("| kernel gradient (ms) | autodiff | zerojax | speed-up | max difference / max |")
    print("|---|---|---|---|---|")
    for what, batch, channels, size, groups, k in SHAPES:
        if quick and batch > 8:
            continue
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((batch, channels, size, size), np.float32))
        g = jnp.asarray(rng.standard_normal((batch, channels, size, size), np.float32))
        w = jnp.asarray(rng.standard_normal((channels, channels // groups, k, k), np.float32))
        forms = {
            "autodiff": kernel_gradient(_autodiff_grouped, groups, k // 2),
            "zerojax": kernel_gradient(conv._grouped_convolution, groups, k // 2),
        }
        results = {name: np.asarray(f(w, x, g)) for name, f in forms.items()}
        runs = {name: functools.partial(_block, f, w, x, g) for name, f in forms.items()}
        medians = interleaved_medians_ms(runs, repeats if batch == 8 else 3, warmup=1)
        autodiff = results["autodiff"]
        difference = np.abs(autodiff - results["zerojax"]).max() / np.abs(autodiff).max()
        print(
            f"| {what} | {medians['autodiff']:.2f} | {medians['zerojax']:.2f} | "
            f"{medians['autodiff'] / medians['zerojax']:.1f}x | {difference:.1e} |"
        )


def _block(f, *args):
    jax.block_until_ready(f(*args))


def zerojax_fused_step(net, x, y, autodiff_kernel_gradient: bool):
    run, _ = zerojax_step(net, x, y, fused=True)
    if not autodiff_kernel_gradient:
        return run
    traced = []

    def run_patched_first():
        """The first call traces (and compiles) the step: with the lowering patched then."""
        if traced:
            return run()
        lowering, conv._grouped_convolution = conv._grouped_convolution, _autodiff_grouped
        try:
            return run()
        finally:
            conv._grouped_convolution = lowering
            traced.append(True)

    return run_patched_first


def resnext_step_table(repeats: int) -> None:
    torch.manual_seed(0)
    net = torchvision.models.resnext50_32x4d(num_classes=CLASSES).train()
    x = torch.randn(8, 3, IMAGE, IMAGE)
    y = torch.randint(0, CLASSES, (8,))
    contenders = {
        "torch eager": torch_step(copy.deepcopy(net), x, y, torch.get_num_threads()),
        "zerojax fused, autodiff's kernel gradient": zerojax_fused_step(
            copy.deepcopy(net), x, y, autodiff_kernel_gradient=True
        ),
        "zerojax fused": zerojax_fused_step(copy.deepcopy(net), x, y, False),
    }
    losses = {name: [float(run()) for _ in range(2)] for name, run in contenders.items()}
    medians = interleaved_medians_ms(contenders, repeats, warmup=1)
    print("\n| resnext50_32x4d step | ms | first two losses |\n|---|---|---|")
    for name, ms in medians.items():
        print(f"| {name} | {ms:.1f} | {losses[name][0]:.6f}, {losses[name][1]:.6f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    kernel_gradient_table(args.repeats, args.quick)
    resnext_step_table(3 if args.quick else args.repeats)


if __name__ == "__main__":
    main()
