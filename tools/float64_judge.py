"""Float64 references for a float32 gradient at the float32 run's own activation pattern.

A ReLU network's gradient is discontinuous wherever a pre-activation crosses zero (and a
max-pool's wherever two window entries swap order). A float32 forward pass differs from the
float64 one by its rounding, ~1e-6 relative, so the rare pre-activation that lies that close to
a kink takes the other branch in float32: the gradient then differs from float64's by that
element's whole contribution, not by rounding. On torchvision's ResNet-18 (batch 8 of 64x64
images, 1.5M ReLU inputs) that happens on about one draw in three, to torch fp32 and zerojax
alike: the worst per-tensor gradient error jumps from ~7e-6 to 0.02-0.4 (seeds 0-7, BENCHMARKS.md
"Gradient accuracy"). Either branch is a correct gradient of the float32 computation; comparing
them measures luck, not accuracy.

So the judge compares each float32 run with float64 *at that run's own branches*: the run
records the input of every kinked module call (`KinkRecorder`), and `float64_gradients_at`
evaluates the float64 twin with each such call on the branch the recorded input took. Where the
float64 input lies on the same piece (all but a handful of elements), nothing changes; where it
does not, the recorded piece is extended linearly to the float64 input, which for these
piecewise-linear functions is exactly that piece (Hardswish's quadratic middle: to first order,
at a few elements). A max-pool takes its float64 values at the window positions the recorded
input's maximum came from. What remains between a float32 gradient and its reference is
rounding, which is what a lowering or a custom backward can make better or worse.

Only modules are seen: a functional `F.relu` inside a forward keeps float64's branch (its
flips, if any, show as errors).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# Module type -> where its pieces meet, from the module's own attributes.
_KINKS: dict[type, Callable[[nn.Module], tuple[float, ...]]] = {
    nn.ReLU: lambda m: (0.0,),
    nn.LeakyReLU: lambda m: (0.0,),
    nn.ReLU6: lambda m: (0.0, 6.0),
    nn.Hardtanh: lambda m: (float(m.min_val), float(m.max_val)),
    nn.Hardswish: lambda m: (-3.0, 3.0),
    nn.Hardsigmoid: lambda m: (-3.0, 3.0),
}
_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)


def _kinks(module: nn.Module) -> tuple[float, ...] | None:
    for kind in type(module).__mro__:
        if kind in _KINKS:
            return _KINKS[kind](module)
    return None


def kinked_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose gradient jumps with their input: piecewise activations, max-pools."""
    return [m for m in model.modules() if _kinks(m) is not None or isinstance(m, _POOLS)]


class KinkRecorder(nn.Module):
    """`model` whose forward returns `(outputs, inputs)`: `inputs` holds the input of every
    kinked module call, in call order. Run it where the float32 gradient is taken (torch, or
    `zerojax.initialize` / `zerojax.convert` of it: the recorded inputs are then that program's
    own values)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        seen: list[torch.Tensor] = []

        def record(module, inputs):
            # A copy: an in-place ReLU overwrites its input.
            seen.append(inputs[0].clone())

        hooks = [m.register_forward_pre_hook(record) for m in kinked_modules(self.model)]
        try:
            outputs = self.model(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        return outputs, tuple(seen)


def _on_recorded_piece(module: nn.Module, x: torch.Tensor, recorded: torch.Tensor):
    """`module(x)` (float64), on the piece `recorded` lies on wherever `x` lies on another."""
    # `forward`, not `module(...)`: a call would run the hook that called this again.
    out = module.forward(x)
    kinks = torch.tensor(_kinks(module), dtype=x.dtype)
    other = torch.bucketize(x, kinks) != torch.bucketize(recorded, kinks)
    if not bool(other.any()):
        return out
    at = recorded.detach().requires_grad_()
    value = module.forward(at)
    (slope,) = torch.autograd.grad(value.sum(), at)
    extended = value.detach() + slope * (x - recorded)
    return torch.where(other, extended, out)


def _at_recorded_maxima(module: nn.Module, x: torch.Tensor, recorded: torch.Tensor):
    """A max-pool's float64 values taken where the recorded input's window maxima are."""
    pool, dims = {
        nn.MaxPool1d: (F.max_pool1d, 1),
        nn.MaxPool2d: (F.max_pool2d, 2),
        nn.MaxPool3d: (F.max_pool3d, 3),
    }[next(k for k in type(module).__mro__ if k in _POOLS)]
    _, indices = pool(
        recorded,
        module.kernel_size,
        module.stride,
        module.padding,
        module.dilation,
        ceil_mode=module.ceil_mode,
        return_indices=True,
    )
    # torch's indices count positions in each (batch, channel) plane, flattened.
    picked = x.flatten(-dims).gather(-1, indices.flatten(-dims))
    return picked.view_as(indices)


def float64_gradients_at(
    model: nn.Module,
    args: Sequence[torch.Tensor],
    loss_of: Callable[[object], torch.Tensor],
    recorded: Sequence[torch.Tensor],
) -> dict[str, np.ndarray]:
    """Parameter gradients of `loss_of(model(*args))` in float64, every kinked module call on
    the branch of the matching `recorded` input (`KinkRecorder`'s, from a float32 run of the
    same model on the same args)."""
    twin = copy.deepcopy(model).double()
    for module in twin.modules():
        if getattr(module, "inplace", False):
            module.inplace = False  # the hook below needs the input it was called with
    queue = iter(recorded)

    def consistent(module, inputs, output):
        x, at = inputs[0], next(queue).detach().to(torch.float64)
        if isinstance(module, _POOLS):
            return _at_recorded_maxima(module, x, at)
        return _on_recorded_piece(module, x, at)

    hooks = [m.register_forward_hook(consistent) for m in kinked_modules(twin)]
    try:
        wide = [a.double() if a.is_floating_point() else a for a in args]
        loss_of(twin(*wide)).backward()
    finally:
        for hook in hooks:
            hook.remove()
    leftover = sum(1 for _ in queue)
    assert leftover == 0, f"{leftover} recorded kinked-module inputs were not consumed"
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
        for name, p in twin.named_parameters()
    }


def relative_errors(got: dict, exact: dict[str, np.ndarray]) -> dict[str, float]:
    """Per tensor ||got - exact|| / ||exact|| (2-norms, float64)."""
    errors = {}
    for name, want in exact.items():
        diff = np.linalg.norm(np.asarray(got[name], np.float64) - want)
        errors[name] = float(diff / max(np.linalg.norm(want), np.finfo(np.float64).tiny))
    return errors
