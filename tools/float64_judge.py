"""Float64 references for a float32 gradient at the float32 run's own activation pattern.

A ReLU network's gradient is discontinuous wherever a pre-activation crosses zero (and a
max-pool's wherever two window entries swap order). A float32 forward pass differs from the
float64 one by its rounding, ~1e-6 relative, so the rare pre-activation that lies that close to
a kink takes the other branch in float32: the gradient then differs from float64's by that
element's whole contribution, not by rounding. On torchvision's ResNet-18 (batch 8 of 64x64
images, 1.5M ReLU inputs) that happened on 2 of 8 seeds to torch fp32 and on 3 of 8 to zerojax:
the worst per-tensor gradient error (2-norm) jumps from ~5e-6 to 5e-3..3e-2, 0.37 in max-norm
(bench/gradient_accuracy.py, BENCHMARKS.md "Gradient accuracy"). Either branch is a correct gradient of the float32 computation; comparing
them measures luck, not accuracy.

So the judge compares each float32 run with float64 *at that run's own branches*: the run
records the input of every kinked call (`KinkRecorder`: ReLU, ReLU6, hardtanh, leaky ReLU,
hardswish, hardsigmoid and max-pool, as modules or functions), and `float64_gradients_at`
evaluates the float64 twin with each such call on the branch the recorded input took. Where the
float64 input lies on the same piece (all but a handful of elements), nothing changes; where it
does not, the recorded piece is extended linearly to the float64 input, which for these
piecewise-linear functions is exactly that piece (Hardswish's quadratic middle: to first order,
at a few elements). A max-pool takes its float64 values at the window positions the recorded
input's maximum came from. What remains between a float32 gradient and its reference is
rounding, which is what a lowering or a custom backward can make better or worse.

Calls are seen through a `TorchFunctionMode`, which `torch.export` traces like any torch code,
so a zerojax program records its own values; calls are matched by order, which a forward
repeats exactly. Other kinks (`clamp`, `abs`, `max`, a router's top-k) keep float64's branch:
their flips, if any, show as errors.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


def _args(args, kwargs, names_and_defaults):
    """Positional-or-keyword arguments of a torch function call, by name."""
    values = dict(zip([n for n, _ in names_and_defaults], args))
    return [values.get(n, kwargs.get(n, d)) for n, d in names_and_defaults]


def _zero(args, kwargs) -> tuple[float, ...]:
    return (0.0,)


def _threes(args, kwargs) -> tuple[float, ...]:
    return (-3.0, 3.0)


def _six(args, kwargs) -> tuple[float, ...]:
    return (0.0, 6.0)


def _hardtanh_limits(args, kwargs) -> tuple[float, ...]:
    _, low, high = _args(args, kwargs, [("input", None), ("min_val", -1.0), ("max_val", 1.0)])
    return (float(low), float(high))


# Function -> where its pieces meet, from the call's arguments (nn.ReLU & co. call these).
_KINKS: dict[Callable, Callable] = {
    F.relu: _zero,
    F.relu_: _zero,
    torch.relu: _zero,
    torch.relu_: _zero,
    torch.Tensor.relu: _zero,
    torch.Tensor.relu_: _zero,
    F.leaky_relu: _zero,
    F.leaky_relu_: _zero,
    F.relu6: _six,
    F.hardtanh: _hardtanh_limits,
    F.hardtanh_: _hardtanh_limits,
    F.hardswish: _threes,
    F.hardsigmoid: _threes,
}
# Always in place; the others are when called with inplace=True (a keyword, or leaky_relu's
# third positional argument as nn.LeakyReLU passes it).
_IN_PLACE = {F.relu_, torch.relu_, torch.Tensor.relu_, F.leaky_relu_, F.hardtanh_}
_POOL_ARGS = [
    ("input", None),
    ("kernel_size", None),
    ("stride", None),
    ("padding", 0),
    ("dilation", 1),
    ("ceil_mode", False),
]
# Function -> (the function returning indices, number of pooled dims).
_POOLS: dict[Callable, tuple[Callable, int]] = {
    F.max_pool1d: (F.max_pool1d_with_indices, 1),
    F.max_pool2d: (F.max_pool2d_with_indices, 2),
    F.max_pool3d: (F.max_pool3d_with_indices, 3),
    F.max_pool1d_with_indices: (F.max_pool1d_with_indices, 1),
    F.max_pool2d_with_indices: (F.max_pool2d_with_indices, 2),
    F.max_pool3d_with_indices: (F.max_pool3d_with_indices, 3),
}


def _is_kinked(func) -> bool:
    return func in _KINKS or func in _POOLS


class _Recording(TorchFunctionMode):
    def __init__(self, seen: list[torch.Tensor]):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_kinked(func):
            # A copy: an in-place ReLU overwrites its input.
            self.seen.append(args[0].detach().clone())
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording_kinks():
    """Inside: every kinked call's input is appended, in call order, to the list it yields."""
    seen: list[torch.Tensor] = []
    with _Recording(seen):
        yield seen


class KinkRecorder(nn.Module):
    """`model` whose forward returns `(outputs, inputs)`: `inputs` holds the input of every
    kinked call, in call order. Run it where the float32 gradient is taken (torch, or
    `zerojax.initialize` / `zerojax.convert` of it: the recorded inputs are then that program's
    own values)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        # The model's mode, not nn.Module's default (train): `zerojax.convert` reads it from the
        # module it is given. Set on this wrapper alone, which `.train()` would not do.
        self.training = model.training

    def forward(self, *args, **kwargs):
        with recording_kinks() as seen:
            outputs = self.model(*args, **kwargs)
        return outputs, tuple(seen)


def _on_recorded_piece(func, args, kwargs, recorded: torch.Tensor):
    """`func(x, ...)` in float64, on the piece `recorded` lies on wherever `x` lies on another.
    An in-place call stays in place (on `x`, with the result)."""
    x, rest = args[0], args[1:]
    # Each evaluation gets its own copy: an in-place call would overwrite what `extended` reads.
    out = func(x.clone(), *rest, **kwargs)
    kinks = torch.tensor(_KINKS[func](args, kwargs), dtype=x.dtype)
    # contiguous(): channels_last activations would make bucketize copy them with a warning.
    other = torch.bucketize(x.detach().contiguous(), kinks) != torch.bucketize(
        recorded.contiguous(), kinks
    )
    if bool(other.any()):
        at = recorded.requires_grad_()
        value = func(at.clone(), *rest, **kwargs)
        (slope,) = torch.autograd.grad(value.sum(), at)
        extended = value.detach() + slope * (x - recorded.detach())
        out = torch.where(other, extended, out)
    if func in _IN_PLACE or kwargs.get("inplace", False) or any(a is True for a in rest):
        return x.copy_(out)
    return out


def _at_recorded_maxima(func, args, kwargs, recorded: torch.Tensor):
    """A max-pool's float64 values taken where the recorded input's window maxima are."""
    with_indices, dims = _POOLS[func]
    x, kernel, stride, padding, dilation, ceil_mode = _args(args, kwargs, _POOL_ARGS)
    _, indices = with_indices(recorded, kernel, stride, padding, dilation, ceil_mode)
    # torch's indices count positions in each (batch, channel) plane, flattened.
    picked = x.flatten(-dims).gather(-1, indices.flatten(-dims)).view_as(indices)
    returns_indices = (
        func is with_indices or _args(args, kwargs, [*_POOL_ARGS, ("return_indices", False)])[-1]
    )
    return (picked, indices) if returns_indices else picked


class _OnRecordedBranches(TorchFunctionMode):
    def __init__(self, recorded: Sequence[torch.Tensor]):
        super().__init__()
        self.queue = iter(recorded)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_kinked(func):
            return func(*args, **kwargs)
        at = next(self.queue).detach().to(args[0].dtype)
        if func in _POOLS:
            return _at_recorded_maxima(func, args, kwargs, at)
        return _on_recorded_piece(func, args, kwargs, at)


@contextlib.contextmanager
def on_recorded_branches(recorded: Sequence[torch.Tensor]):
    """Inside: the n-th kinked call takes the branch of `recorded[n]` (`recording_kinks`'s,
    from a float32 run of the same forward on the same inputs); all must be used."""
    branches = _OnRecordedBranches(recorded)
    with branches:
        yield
    leftover = sum(1 for _ in branches.queue)
    assert leftover == 0, f"{leftover} recorded kinked-call inputs were not consumed"


def float64_gradients_at(
    model: nn.Module,
    args: Sequence[torch.Tensor],
    loss_of: Callable[[object], torch.Tensor],
    recorded: Sequence[torch.Tensor],
) -> dict[str, np.ndarray]:
    """Parameter gradients of `loss_of(model(*args))` in float64, every kinked call on
    the branch of the matching `recorded` input (`KinkRecorder`'s, from a float32 run of the
    same model on the same args)."""
    twin = copy.deepcopy(model).double()
    wide = [a.double() if a.is_floating_point() else a for a in args]
    with on_recorded_branches(recorded):
        outputs = twin(*wide)
    loss_of(outputs).backward()
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


def torch_fp32_gradients(model: nn.Module, x: torch.Tensor, loss_of):
    """(parameter gradients by name, recorded kink inputs) of one float32 torch backward of
    `loss_of(model(x))`, on a copy of `model`."""
    recorder = KinkRecorder(copy.deepcopy(model))
    outputs, seen = recorder(x)
    loss_of(outputs).backward()
    grads = {n.removeprefix("model."): p.grad.numpy() for n, p in recorder.named_parameters()}
    return grads, seen


def zerojax_fp32_gradients(model: nn.Module, x: torch.Tensor, loss_of):
    """The same through `zerojax.initialize` (ZeRO-0) of a copy of `model`: the kink inputs are
    the zerojax program's own values."""
    import zerojax  # the judge itself needs only torch

    recorder = KinkRecorder(copy.deepcopy(model))
    optimizer = torch.optim.SGD(recorder.parameters(), lr=0.1)
    recorder, optimizer = zerojax.initialize(recorder, optimizer, config={"zero_stage": 0})
    outputs, seen = recorder(x)
    loss_of(outputs).backward()
    grads = {
        n.removeprefix("model."): p.grad.detach().numpy() for n, p in recorder.named_parameters()
    }
    return grads, [s.detach() for s in seen]
