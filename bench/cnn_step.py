"""The CNN training step without converter overhead: zerojax vs the same net hand-written in JAX.

Two nets, each trained for full steps (forward + cross-entropy + backward + SGD with momentum
0.9, lr 0.1; fp32, train mode: batch norm uses batch statistics and updates its running
stats) on a batch of 8 random 64x64 RGB images, 10 classes, on ONE CPU device:

- ResNet-18: torchvision `resnet18(num_classes=10)` (11.2M parameters);
- ConvNeXt: torchvision's ConvNeXt at half of convnext_tiny's width and depths 2-2-6-2
  (stem 4x4/4 patchify conv, blocks of depthwise 7x7 conv, LayerNorm over channels,
  pointwise MLP with GELU, layer scale, residual; LayerNorm + 2x2/2 conv downsampling;
  4.8M parameters).

Contenders, timed interleaved (one of each per round, so load on the shared machine hits
them alike; each round starts one contender later, so none always follows the same one),
medians of --repeats rounds after untimed warm-up steps:

- torch eager, on torch's default thread count (one per core) and on one thread (see
  `torch_step`: on a loaded machine the default can be 20x slower);
- zerojax general: `model, opt = zerojax.initialize(net, SGD)`, then the user's loop
  `loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad()`;
- zerojax fused: the same with a wrapper module whose forward returns the loss, so forward,
  loss and backward are one XLA program (the update is a second one);
- hand-written JAX, NHWC/HWIO and NCHW/OIHW: the same net written with `lax` ops, one jitted
  step (value_and_grad + SGD momentum, state donated), the torch weights copied in. Where
  XLA:CPU is slow, the hand-written net takes zerojax's forms (zerojax/bridge/lowerings/
  conv.py): a conv whose window is larger than its input or output is written as the product
  zerojax lowers it to (XLA:CPU runs such a conv, or its input gradient, at <1 GFLOP/s), and a
  depthwise conv's kernel gradient is summed tap by tap (autodiff's is a dense channels x
  channels conv on XLA:CPU);
  --plain-conv adds the same nets with every conv a `lax.conv_general_dilated` and autodiff.

Every JAX timing ends when the new parameters are ready (`jax.block_until_ready`). The first
two losses of every contender (same initial weights, same batch) are printed as the fairness
check: the second depends on the gradients and the update.
On ResNet-18 the hand-written second loss differs from torch's by ~4e-3: one ReLU gate at
layer3.0's output, float64 pre-activation -4.3e-6 (torch fp32 -1.3e-6), is +2.1e-6 in the
hand-written fp32 program, so it passes the gradient torch's blocks (the gradients from
layer3.1 on agree to <1e-4 relative; before it, by up to 13%).

With --phases it also times, interleaved, zerojax's two fused-path programs called directly
(`loss_and_grads`: forward + loss + backward; `update`: SGD) beside the hand-written step's
parts as programs of their own (value_and_grad; the SGD update alone and with zerojax's
all-finite guard): where zerojax's time over the hand-written step goes.

Prints per net the medians (ms), zerojax / hand-written (the faster layout by median) as the
median and quartiles of the per-round ratios (a round's two steps ran close together, so load
that drifts over the run divides out), and zerojax / torch (the faster thread count). With
--hlo DIR it also writes the optimized HLO of zerojax's programs and of the hand-written steps
there and prints an op census (convolutions, transposes, copies, reduces, fusions) of each.

Run: .venv/bin/python bench/cnn_step.py [--repeats N] [--nets resnet18,convnext] [--plain-conv]
     [--phases] [--hlo DIR]
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import os
import re
import statistics
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
import torch.nn.functional as F
import torchvision
from jax import lax
from torchvision.models.convnext import CNBlockConfig, ConvNeXt

import zerojax
from bench.timing import interleaved_medians_ms, interleaved_times_ms, paired_ratio
from zerojax.bridge.dtypes import from_torch
from zerojax.train import optimizers

BATCH, IMAGE, CLASSES = 8, 64, 10
LR, MOMENTUM = 0.1, 0.9
BN_EPS, BN_MOMENTUM, LN_EPS = 1e-5, 0.1, 1e-6
WARMUP = 5
"""Untimed steps per contender: torch's first CPU steps run 10-30x slow (oneDNN primitive
creation) and every JAX contender compiles on its first."""

CONVNEXT_STAGES = ((48, 2), (96, 2), (192, 6), (384, 2))
"""(width, depth) per stage: half of convnext_tiny's widths, fewer blocks."""


def build_net(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "resnet18":
        net = torchvision.models.resnet18(num_classes=CLASSES)
    else:
        widths = [w for w, _ in CONVNEXT_STAGES] + [None]
        config = [CNBlockConfig(w, widths[i + 1], d) for i, (w, d) in enumerate(CONVNEXT_STAGES)]
        net = ConvNeXt(config, num_classes=CLASSES)
        # torchvision starts layer scale at 1e-6, which makes every block nearly the identity
        # and the loss check blind to the blocks' arithmetic.
        with torch.no_grad():
            for name_, p in net.named_parameters():
                if name_.endswith("layer_scale"):
                    p.uniform_(0.5, 1.0)
    return net.train()


class WithLoss(torch.nn.Module):
    """The net and its loss as one module: zerojax fuses forward, loss and backward."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


# --- the nets hand-written in JAX ----------------------------------------------------------------
# Parameters and buffers are keyed by the torch state_dict names; `layout` is "NHWC" (activations
# NHWC, conv kernels HWIO) or "NCHW" (torch's NCHW / OIHW).


def _lax_conv(x, w, stride, padding, groups, layout):
    kernel = "HWIO" if layout == "NHWC" else "OIHW"
    return lax.conv_general_dilated(
        x,
        w,
        (stride, stride),
        [(padding, padding)] * 2,
        dimension_numbers=(layout, kernel, layout),
        feature_group_count=groups,
        precision=lax.Precision.HIGHEST,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _depthwise_conv(x, w, padding, layout):
    """A stride-1 depthwise conv whose kernel gradient is summed tap by tap: what zerojax
    lowers a grouped conv's backward to on CPU (XLA:CPU runs autodiff's `batch_group_count`
    kernel gradient as a dense channels x channels conv)."""
    return _lax_conv(x, w, 1, padding, x.shape[1 if layout == "NCHW" else -1], layout)


def _depthwise_conv_forward(x, w, padding, layout):
    return _depthwise_conv(x, w, padding, layout), (x, w)


def _depthwise_conv_backward(padding, layout, residuals, grad):
    x, w = residuals
    channels = x.shape[1 if layout == "NCHW" else -1]
    _, pullback = jax.vjp(lambda x: _lax_conv(x, w, 1, padding, channels, layout), x)
    spatial = (2, 3) if layout == "NCHW" else (1, 2)
    pads = [(0, 0)] * 4
    for a in spatial:
        pads[a] = (padding, padding)
    padded = jnp.pad(x, pads)
    kernel = w.shape[-1] if layout == "NCHW" else w.shape[0]
    height, width = (grad.shape[a] for a in spatial)
    taps = []
    for i in range(kernel):
        for j in range(kernel):
            window = [slice(None)] * 4
            window[spatial[0]], window[spatial[1]] = slice(i, i + height), slice(j, j + width)
            taps.append(jnp.sum(padded[tuple(window)] * grad, axis=(0, *spatial)))
    if layout == "NCHW":  # (C, 1, k, k)
        grad_w = jnp.stack(taps, axis=1).reshape(w.shape)
    else:  # (k, k, 1, C)
        grad_w = jnp.stack(taps, axis=0).reshape(w.shape)
    return pullback(grad)[0], grad_w


_depthwise_conv.defvjp(_depthwise_conv_forward, _depthwise_conv_backward)


class Layers:
    def __init__(self, layout: str, cpu_conv_forms: bool):
        self.layout = layout
        self.cpu_conv_forms = cpu_conv_forms
        self.channel = -1 if layout == "NHWC" else 1
        self.spatial = (1, 2) if layout == "NHWC" else (2, 3)

    def per_channel(self, v):
        return v if self.layout == "NHWC" else v[:, None, None]

    def conv(self, x, w, b=None, stride=1, padding=0, groups=1):
        kernel = w.shape[0] if self.layout == "NHWC" else w.shape[2]  # square kernels only
        size = min(x.shape[a] for a in self.spatial)
        if self.cpu_conv_forms and kernel > min(size, (size + 2 * padding - kernel) // stride + 1):
            out = self.patch_conv(x, w, stride, padding, groups)
        elif self.cpu_conv_forms and groups > 1:
            assert stride == 1 and groups == x.shape[self.channel] == w.size // kernel**2
            out = _depthwise_conv(x, w, padding, self.layout)
        else:
            out = _lax_conv(x, w, stride, padding, groups, self.layout)
        return out if b is None else out + self.per_channel(b)

    def patch_conv(self, x, w, stride, padding, groups):
        """The conv as one product of the kernel-offset views and the kernel: what zerojax
        lowers a conv to when its window is larger than its input or output (XLA:CPU's slow
        case)."""
        pads = [(0, 0)] * 4
        for a in self.spatial:
            pads[a] = (padding, padding)
        padded = jnp.pad(x, pads)
        kernel = w.shape[0] if self.layout == "NHWC" else w.shape[2]
        out_size = [(x.shape[a] + 2 * padding - kernel) // stride + 1 for a in self.spatial]
        views = []
        for i in range(kernel):
            for j in range(kernel):
                window = [slice(None)] * 4
                for a, start, size in zip(self.spatial, (i, j), out_size):
                    window[a] = slice(start, start + (size - 1) * stride + 1, stride)
                views.append(padded[tuple(window)])
        n, num_offsets = x.shape[0], kernel * kernel
        if self.layout == "NHWC":
            c_in, c_out = x.shape[-1], w.shape[-1]
            patches = jnp.stack(views, axis=3).reshape(
                n, *out_size, num_offsets, groups, c_in // groups
            )
            w = w.reshape(num_offsets, c_in // groups, groups, c_out // groups)
            out = jnp.einsum("nhwkgc,kcgo->nhwgo", patches, w, precision=lax.Precision.HIGHEST)
            return out.reshape(n, *out_size, c_out)
        c_in, c_out = x.shape[1], w.shape[0]
        patches = jnp.stack(views, axis=2).reshape(
            n, groups, c_in // groups, num_offsets, *out_size
        )
        w = w.reshape(groups, c_out // groups, c_in // groups, num_offsets)
        out = jnp.einsum("ngckhw,gock->ngohw", patches, w, precision=lax.Precision.HIGHEST)
        return out.reshape(n, c_out, *out_size)

    def batch_norm(self, x, p, buffers, prefix, new_buffers):
        axes = (0, *self.spatial)
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - self.per_channel(mean)), axis=axes)
        n = x.size // x.shape[self.channel]
        for name, batch_value in (("running_mean", mean), ("running_var", var * n / (n - 1))):
            old = buffers[prefix + name]
            new_buffers[prefix + name] = (1 - BN_MOMENTUM) * old + BN_MOMENTUM * batch_value
        new_buffers[prefix + "num_batches_tracked"] = buffers[prefix + "num_batches_tracked"] + 1
        scale = p[prefix + "weight"] * lax.rsqrt(var + BN_EPS)
        shift = p[prefix + "bias"] - mean * scale
        return x * self.per_channel(scale) + self.per_channel(shift)

    def layer_norm(self, x, weight, bias, axis):
        mean = jnp.mean(x, axis=axis, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=axis, keepdims=True)
        normed = (x - mean) * lax.rsqrt(var + LN_EPS)
        shape = [1] * x.ndim
        shape[axis] = -1
        return normed * weight.reshape(shape) + bias.reshape(shape)

    def pointwise(self, x, w, b):
        """A Linear over the channel axis of an image."""
        if self.layout == "NHWC":
            return jnp.dot(x, w.T, precision=lax.Precision.HIGHEST) + b
        out = jnp.einsum("nchw,oc->nohw", x, w, precision=lax.Precision.HIGHEST)
        return out + b[:, None, None]

    def max_pool_3x3_s2(self, x):
        window = [1, 1, 1, 1]
        strides = [1, 1, 1, 1]
        pads = [(0, 0)] * 4
        for a in self.spatial:
            window[a], strides[a], pads[a] = 3, 2, (1, 1)
        return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, pads)


def resnet18_jax(layers: Layers, p, buffers, x):
    new_buffers = {}

    def bn(h, prefix):
        return layers.batch_norm(h, p, buffers, prefix, new_buffers)

    h = jax.nn.relu(bn(layers.conv(x, p["conv1.weight"], stride=2, padding=3), "bn1."))
    h = layers.max_pool_3x3_s2(h)
    for stage in range(1, 5):
        for block in range(2):
            pre = f"layer{stage}.{block}."
            stride = 2 if stage > 1 and block == 0 else 1
            out = layers.conv(h, p[pre + "conv1.weight"], stride=stride, padding=1)
            out = jax.nn.relu(bn(out, pre + "bn1."))
            out = bn(layers.conv(out, p[pre + "conv2.weight"], padding=1), pre + "bn2.")
            if pre + "downsample.0.weight" in p:
                h = bn(
                    layers.conv(h, p[pre + "downsample.0.weight"], stride=stride),
                    pre + "downsample.1.",
                )
            h = jax.nn.relu(out + h)
    pooled = jnp.mean(h, axis=layers.spatial)
    logits = jnp.dot(pooled, p["fc.weight"].T, precision=lax.Precision.HIGHEST) + p["fc.bias"]
    return logits, new_buffers


def convnext_jax(layers: Layers, p, buffers, x):
    c = layers.channel

    def ln(h, prefix):
        return layers.layer_norm(h, p[prefix + "weight"], p[prefix + "bias"], c % h.ndim)

    h = layers.conv(x, p["features.0.0.weight"], p["features.0.0.bias"], stride=4)
    h = ln(h, "features.0.1.")
    for stage, (width, depth) in enumerate(CONVNEXT_STAGES):
        for block in range(depth):
            pre = f"features.{2 * stage + 1}.{block}."
            out = layers.conv(
                h, p[pre + "block.0.weight"], p[pre + "block.0.bias"], padding=3, groups=width
            )
            out = ln(out, pre + "block.2.")
            out = layers.pointwise(out, p[pre + "block.3.weight"], p[pre + "block.3.bias"])
            out = jax.nn.gelu(out, approximate=False)
            out = layers.pointwise(out, p[pre + "block.5.weight"], p[pre + "block.5.bias"])
            h = h + out * layers.per_channel(p[pre + "layer_scale"].reshape(-1))
        if stage + 1 < len(CONVNEXT_STAGES):
            pre = f"features.{2 * stage + 2}."
            h = ln(h, pre + "0.")
            h = layers.conv(h, p[pre + "1.weight"], p[pre + "1.bias"], stride=2)
    pooled = jnp.mean(h, axis=layers.spatial)
    pooled = layers.layer_norm(pooled, p["classifier.0.weight"], p["classifier.0.bias"], axis=1)
    logits = jnp.dot(pooled, p["classifier.2.weight"].T, precision=lax.Precision.HIGHEST)
    return logits + p["classifier.2.bias"], {}


HANDWRITTEN = {"resnet18": resnet18_jax, "convnext": convnext_jax}


def handwritten_step(net_name: str, net: torch.nn.Module, layout: str, cpu_conv_forms: bool, x, y):
    """(step() -> loss, () -> the lowered step, {phase name: run}): the torch weights copied
    in, conv kernels transposed to the layout once, here, as a JAX user would store them."""
    layers = Layers(layout, cpu_conv_forms)
    params, buffers = {}, {}
    for name, value in net.state_dict().items():
        array = value.detach().numpy()
        if array.ndim == 4 and layout == "NHWC":
            array = array.transpose(2, 3, 1, 0)  # OIHW -> HWIO
        is_param = name in dict(net.named_parameters())
        (params if is_param else buffers)[name] = jnp.asarray(array)
    forward = functools.partial(HANDWRITTEN[net_name], layers)

    def loss_fn(params, buffers, x, y):
        logits, new_buffers = forward(params, buffers, x)
        picked = jnp.take_along_axis(logits, y[:, None], axis=1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked), new_buffers

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, momentum, buffers, x, y):
        (loss, new_buffers), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, buffers, x, y
        )
        momentum = jax.tree.map(lambda m, g: MOMENTUM * m + g, momentum, grads)
        params = jax.tree.map(lambda w, m: w - LR * m, params, momentum)
        return params, momentum, {**buffers, **new_buffers}, loss

    x = jnp.asarray(x.numpy().transpose(0, 2, 3, 1) if layout == "NHWC" else x.numpy())
    y = jnp.asarray(y.numpy().astype(np.int32))
    state = {
        "params": params,
        "momentum": jax.tree.map(jnp.zeros_like, params),
        "buffers": buffers,
    }

    def run():
        params, momentum, buffers, loss = step(
            state["params"], state["momentum"], state["buffers"], x, y
        )
        state.update(params=params, momentum=momentum, buffers=buffers)
        jax.block_until_ready(params)
        return loss

    def lowered():
        return step.lower(state["params"], state["momentum"], state["buffers"], x, y)

    # Copies: the step donates its state.
    parts = _handwritten_phases(loss_fn, *jax.tree.map(jnp.copy, (params, buffers)), x, y)
    return run, lowered, parts


def _sgd_update(params, momentum, grads):
    momentum = jax.tree.map(lambda m, g: MOMENTUM * m + g, momentum, grads)
    return jax.tree.map(lambda w, m: w - LR * m, params, momentum), momentum


def _guarded_sgd_update(params, momentum, grads):
    """The update kept only when every gradient is finite, as zerojax's update program guards
    it (zerojax/train/programs.py, for fp16 loss scaling, in every precision)."""
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads.values()]))
    new = _sgd_update(params, momentum, grads)
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, (params, momentum))


def _handwritten_phases(loss_fn, params, buffers, x, y) -> dict:
    """The hand-written step's parts as programs of their own, on copies of the state."""
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    grads = value_and_grad(params, buffers, x, y)[1]
    phases = {
        "hand-written value_and_grad": lambda: jax.block_until_ready(
            value_and_grad(params, buffers, x, y)
        )
    }
    for name, update in (
        ("hand-written SGD update alone", _sgd_update),
        ("hand-written SGD update, all-finite guard", _guarded_sgd_update),
    ):
        jitted = jax.jit(update, donate_argnums=(0, 1))
        state = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.zeros_like, params)]

        def run(jitted=jitted, state=state):
            state[:] = jitted(state[0], state[1], grads)
            jax.block_until_ready(state[0])

        phases[name] = run
    return phases


# --- torch and zerojax ---------------------------------------------------------------------------


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


TORCH_THREADS = torch.get_num_threads()


def torch_step(net, x, y, num_threads: int):
    """torch's step on `num_threads` intra-op threads. On the shared 2-core machine torch's
    default (one per core) can collapse: with other processes running, its threads wait at
    every op's barrier for a descheduled peer (ResNet-18: 0.16-0.3 s a step, or 2.5 s for
    stretches of steps; one thread: a steady 0.12 s)."""
    optimizer = sgd(net.parameters())

    def run():
        torch.set_num_threads(num_threads)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.set_num_threads(TORCH_THREADS)
        return loss

    return run


ZEROJAX_CONFIG = {
    "mesh": {"data": 1},
    "zero_stage": 0,
    "runtime": {"compilation_cache_dir": None, "report_effective_time": False},
}


def zerojax_step(net, x, y, fused: bool):
    module = WithLoss(net) if fused else net
    model, optimizer = zerojax.initialize(module, sgd(module.parameters()), ZEROJAX_CONFIG)
    engine = model.engine

    def run():
        loss = model(x, y) if fused else F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        jax.block_until_ready(engine.params)
        return loss

    return run, engine


def zerojax_phases(net, x, y) -> dict:
    """The fused path's two programs called directly on an engine of their own (the timed
    step donates its engine's state): forward+backward, and the update."""
    run, engine = zerojax_step(net, x, y, fused=True)
    run()
    inputs = tuple(engine.shard_input(from_torch(t)) for t in (x, y))
    loss_and_grads = engine.programs.loss_and_grads(engine._converted[True], ())
    update = engine.programs.update(engine.optimizer_spec)
    hyper = optimizers.hyper_from_torch(engine._torch_optimizer, engine.optimizer_spec)
    state, one, rng = engine.state, jnp.float32(1.0), engine.next_rng()
    current = {"params": state.params, "master": state.master, "opt_state": state.opt_state}
    grads = loss_and_grads(state.params, state.buffers, inputs, {}, rng, one)[2]

    def forward_backward():
        jax.block_until_ready(
            loss_and_grads(current["params"], state.buffers, inputs, {}, rng, one)
        )

    def update_alone():
        params, master, opt_state, _, _ = update(
            current["params"], current["master"], current["opt_state"], grads, hyper, None
        )
        current.update(params=params, master=master, opt_state=opt_state)
        jax.block_until_ready(params)

    return {
        "zerojax loss_and_grads program": forward_backward,
        "zerojax update program": update_alone,
    }


# --- HLO census ----------------------------------------------------------------------------------

_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = \S+ ([\w\-]+)\(", re.MULTILINE)


def census(hlo_text: str) -> dict[str, int]:
    """Counts of the ops that tell layout work from compute, over every computation (inside
    fusions too), plus the entry computation's fusion kinds."""
    ops = collections.Counter(_OP.findall(hlo_text))
    keep = ("convolution", "transpose", "copy", "reduce", "reduce-window", "select-and-scatter")
    counts = {op: ops.get(op, 0) for op in keep}
    counts["dot"] = ops.get("dot", 0)
    counts["custom-call"] = ops.get("custom-call", 0)
    entry = hlo_text[hlo_text.find("ENTRY") :]
    counts["entry fusions"] = len(re.findall(r" fusion\(", entry))
    counts["entry copies"] = len(re.findall(r" copy\(", entry))
    counts["entry transposes"] = len(re.findall(r" transpose\(", entry))
    return counts


def write_hlo(directory: Path, name: str, text: str) -> dict[str, int]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.hlo.txt").write_text(text)
    return census(text)


# --- main ----------------------------------------------------------------------------------------


def bench_net(
    net_name: str, repeats: int, plain_conv: bool, phases: bool, hlo_dir: Path | None
) -> None:
    base = build_net(net_name)
    num_params = sum(p.numel() for p in base.parameters())
    torch.manual_seed(1)
    x = torch.randn(BATCH, 3, IMAGE, IMAGE)
    y = torch.randint(0, CLASSES, (BATCH,))
    general, general_engine = zerojax_step(copy.deepcopy(base), x, y, fused=False)
    fused, fused_engine = zerojax_step(copy.deepcopy(base), x, y, fused=True)
    contenders = {
        "torch eager": torch_step(copy.deepcopy(base), x, y, TORCH_THREADS),
        "torch eager, 1 thread": torch_step(copy.deepcopy(base), x, y, 1),
        "zerojax general": general,
        "zerojax fused": fused,
    }
    lowered, parts = {}, {}
    for cpu_conv_forms in (True, False) if plain_conv else (True,):
        for layout in ("NHWC", "NCHW"):
            name = f"hand-written JAX {layout}" + ("" if cpu_conv_forms else ", lax.conv only")
            contenders[name], lowered[name], parts[name] = handwritten_step(
                net_name, base, layout, cpu_conv_forms, x, y
            )
    losses = {name: [float(run()) for _ in range(2)] for name, run in contenders.items()}
    times = interleaved_times_ms(contenders, repeats, warmup=WARMUP - 2, rotate=True)
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    print(
        f"\n{net_name}: {num_params / 1e6:.2f}M parameters, batch {BATCH}x3x{IMAGE}x{IMAGE}, "
        f"median of {repeats} interleaved rounds, load average {os.getloadavg()[0]:.2f}"
    )
    print("| contender | step (ms) | first two losses |\n|---|---|---|")
    for name, ms in medians.items():
        print(f"| {name} | {ms:.1f} | {losses[name][0]:.6f}, {losses[name][1]:.6f} |")
    best_layout = min(("hand-written JAX NHWC", "hand-written JAX NCHW"), key=medians.get)
    best_torch = min(("torch eager", "torch eager, 1 thread"), key=medians.get)
    for path in ("zerojax general", "zerojax fused"):
        ratio, low, high = paired_ratio(times, path, best_layout)
        print(
            f"  {path}: {ratio:.3f}x {best_layout} (per-round ratios' median; quartiles "
            f"{low:.3f}-{high:.3f}), {medians[path] / medians[best_torch]:.2f}x {best_torch}"
        )
    if phases:
        # The fastest layout's parts beside zerojax's programs, interleaved again.
        phase_runs = zerojax_phases(copy.deepcopy(base), x, y) | {
            f"{name} ({best_layout[-4:]})": run for name, run in parts[best_layout].items()
        }
        phase_medians = interleaved_medians_ms(phase_runs, repeats, rotate=True)
        print(f"\nphases, median of {repeats} interleaved rounds")
        print("| phase | ms |\n|---|---|")
        for name, ms in phase_medians.items():
            print(f"| {name} | {ms:.1f} |")
    if hlo_dir is None:
        return
    texts = {
        f"{net_name}.{name.replace('hand-written JAX ', 'handwritten_').replace(', ', '_')}": (
            lower().compile().as_text()
        )
        for name, lower in lowered.items()
    }
    for path, engine in (("general", general_engine), ("fused", fused_engine)):
        for program, compiled in engine.compiled_programs().items():
            texts[f"{net_name}.zerojax_{path}.{program}"] = compiled.as_text()
    rows = {name: write_hlo(hlo_dir, name.replace(" ", "_"), text) for name, text in texts.items()}
    columns = list(next(iter(rows.values())))
    print(f"\nHLO op census (files in {hlo_dir})")
    print(f"| program | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}")
    for name, counts in rows.items():
        print(f"| {name} | {' | '.join(str(counts[c]) for c in columns)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--nets", default="resnet18,convnext")
    parser.add_argument("--hlo", type=Path, default=None, help="write optimized HLO here")
    parser.add_argument(
        "--plain-conv",
        action="store_true",
        help="also time the hand-written nets with every conv a lax.conv (slow on XLA:CPU)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time zerojax's two programs and the hand-written step's parts alone",
    )
    args = parser.parse_args()
    for net_name in args.nets.split(","):
        bench_net(net_name, args.repeats, args.plain_conv, args.phases, args.hlo)


if __name__ == "__main__":
    main()
