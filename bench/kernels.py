"""Kernel benchmarks: the zerojax Pallas / chunked kernels against plain XLA.

One function per benchmark section; `main()` runs the sections named on the command line
(all of them when none is named). GPU sections print "no GPU available" on a machine without
one, so the script runs everywhere.

Sections:
- cpu-loss: linear cross-entropy forward + backward on CPU, the vocabulary-chunked XLA
  implementation vs the unfused loss (`h @ W.T` then softmax cross-entropy): compiled temp
  bytes (`memory_analysis().temp_size_in_bytes`) and median wall time.
- gpu-loss: the same loss on GPU: Pallas kernels vs chunked XLA vs unfused; time and achieved
  FLOP/s.
- gpu-attention: flash attention, Pallas vs the XLA reference (and jax.nn.dot_product_attention
  with cuDNN), bf16, forward and forward + backward: time, TFLOP/s, fraction of the measured
  peak matmul TFLOP/s.
- gpu-norms: LayerNorm and RMSNorm, Pallas vs XLA, bf16, forward and forward + backward: time,
  GB/s, fraction of the measured peak copy bandwidth.
- gpu-adamw: the fused AdamW step, Pallas vs XLA vs optax, fp32 master weights (with and
  without a bf16 parameter copy): time, GB/s, fraction of the measured peak bandwidth.

Timings are medians of --repeats runs after one untimed run (compilation), each ending in
`jax.block_until_ready` so asynchronous dispatch does not flatter anyone. The GPU kernel
sections (attention, norms, adamw) time --calls back-to-back calls per run and report the
mean per call: a kernel of tens of microseconds would otherwise measure the host's dispatch.
Peaks are measured once per run on the same device: a large bf16 `jnp.dot` (TFLOP/s) and
`x + 1` on a 1 GiB float32 array (GB/s, bytes read + written).

--smoke runs every section with tiny shapes on CPU, the Pallas kernels in interpret mode: it
proves each code path executes (the numbers and ratios mean nothing).

Run: .venv/bin/python bench/kernels.py --cpu-loss [--repeats 3] [--tokens 4096 --vocab 32768 --dim 768]
     .venv/bin/python bench/kernels.py --gpu-attention --gpu-norms --gpu-adamw [--calls 10]
     .venv/bin/python bench/kernels.py --smoke          # all sections, tiny, on CPU
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax
import jax.numpy as jnp

from tools.gpu_check.context import seconds_per_call
from zerojax.pallas_kernels.adamw import adamw_hyper, adamw_update
from zerojax.pallas_kernels.flash_attention import flash_attention
from zerojax.pallas_kernels.layer_norm import layer_norm
from zerojax.pallas_kernels.linear_cross_entropy import (
    LinearCrossEntropyConfig,
    linear_cross_entropy,
)
from zerojax.pallas_kernels.rms_norm import rms_norm

MiB = 2**20


def has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def median_seconds(fn: Callable, *args, repeats: int) -> float:
    """Median wall time of fn(*args) (jitted) after one untimed call that compiles it."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def temp_bytes(fn: Callable, *args) -> int:
    """Scratch memory XLA reserves for the compiled program (outputs and arguments excluded)."""
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print(
            "  "
            + "  ".join(
                c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))
            )
        )
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


# ---------------------------------------------------------------- linear cross-entropy


def unfused_loss(hidden, weight, labels):
    """What a model does without the fused kernel: full fp32 logits, then the loss."""
    logits = jnp.dot(hidden, weight.T, preferred_element_type=jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=-1))


def loss_inputs(tokens: int, vocab: int, dim: int, dtype, device=None):
    k = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k[0], (tokens, dim), jnp.float32).astype(dtype)
    weight = (jax.random.normal(k[1], (vocab, dim), jnp.float32) * dim**-0.5).astype(dtype)
    labels = jax.random.randint(k[2], (tokens,), 0, vocab)
    return jax.device_put((hidden, weight, labels), device)


def loss_contenders(
    implementations: list[str], vocab_chunk: int, interpret: bool = False
) -> dict[str, Callable]:
    """name -> loss(hidden, weight, labels); 'unfused' is the baseline."""
    config = LinearCrossEntropyConfig(vocab_chunk=vocab_chunk)
    contenders = {"unfused XLA": unfused_loss}
    for implementation in implementations:
        contenders[f"{implementation} (fused)"] = functools.partial(
            linear_cross_entropy,
            implementation=implementation,
            # interpret only applies to the Pallas kernels (--smoke runs them on CPU).
            interpret=interpret and implementation == "pallas",
            block_config=config,
        )
    return contenders


def bench_loss(
    args, *, implementations: list[str], dtype, device, title: str, interpret: bool = False
) -> None:
    tokens, vocab, dim = args.tokens, args.vocab, args.dim
    inputs = loss_inputs(tokens, vocab, dim, dtype, device)
    # fwd + bwd: the loss and the gradients wrt hidden and weight, as in training.
    flops = 2 * tokens * vocab * dim * 3  # logits, dh, dW (the fused paths also recompute)
    rows, baseline = [], None
    for name, loss_fn in loss_contenders(implementations, args.vocab_chunk, interpret).items():
        step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
        scratch = temp_bytes(step, *inputs)
        seconds = median_seconds(step, *inputs, repeats=args.repeats)
        loss = float(step(*inputs)[0])
        baseline = baseline or (scratch, seconds)
        rows.append(
            [
                name,
                f"{scratch / MiB:.1f}",
                f"{scratch / baseline[0]:.3f}",
                f"{seconds * 1e3:.1f}",
                f"{seconds / baseline[1]:.2f}",
                f"{flops / seconds / 1e12:.3f}",
                f"{loss:.5f}",
            ]
        )
    headers = [
        "fwd+bwd",
        "temp MiB",
        "temp ratio",
        "median ms",
        "time ratio",
        "model TFLOP/s",
        "loss",
    ]
    print_table(
        f"{title}: tokens={tokens} vocab={vocab} d={dim} {jnp.dtype(dtype).name}, "
        f"vocab_chunk={args.vocab_chunk}, {args.repeats} repeats "
        f"(ratios vs unfused XLA; logits alone are {tokens * vocab * 4 / MiB:.0f} MiB fp32)",
        headers,
        rows,
    )


def bench_cpu_loss(args) -> None:
    """Chunked XLA linear cross-entropy vs the unfused loss on CPU (fp32)."""
    bench_loss(
        args,
        implementations=["xla"],
        dtype=jnp.float32,
        device=jax.devices("cpu")[0],
        title="linear cross-entropy on CPU",
    )


def bench_gpu_loss(args) -> None:
    """Pallas kernels and chunked XLA vs the unfused loss on GPU (bf16)."""
    device = kernel_device(args, "gpu-loss")
    if device is None:
        return
    bench_loss(
        args,
        implementations=["pallas", "xla"],
        dtype=jnp.bfloat16,
        device=device,
        title="linear cross-entropy on GPU" + (" (smoke: CPU, interpret)" if args.smoke else ""),
        interpret=args.smoke,
    )


# ---------------------------------------------------------------- other kernels (GPU)


def kernel_device(args, section: str) -> jax.Device | None:
    """Where a GPU section runs: the GPU, the CPU under --smoke, or None (after saying so)."""
    if args.smoke:
        return jax.devices("cpu")[0]
    if not has_gpu():
        print(f"\n{section}: no GPU available")
        return None
    return jax.devices("gpu")[0]


@functools.cache
def measured_peaks(
    device: jax.Device, matmul_n: int, copy_bytes: int, repeats: int, calls: int
) -> tuple[float, float]:
    """(bf16 matmul TFLOP/s, memory GB/s) measured on device; printed on the first call.

    Matmul: one [n, n] @ [n, n] bf16 jnp.dot, 2 n^3 FLOPs. Bandwidth: `x + 1` on a float32
    array of copy_bytes, counting the read and the write.
    """
    k = jax.random.split(jax.random.key(1), 2)
    a, b = jax.device_put(
        [jax.random.normal(key, (matmul_n, matmul_n), jnp.bfloat16) for key in k], device
    )
    seconds = seconds_per_call(jax.jit(jnp.dot), a, b, repeats=repeats, calls=calls)
    tflops = 2 * matmul_n**3 / seconds / 1e12
    x = jax.device_put(jnp.zeros(copy_bytes // 4, jnp.float32), device)
    seconds = seconds_per_call(jax.jit(lambda x: x + 1), x, repeats=repeats, calls=calls)
    gbs = 2 * copy_bytes / seconds / 1e9
    print(
        f"\nmeasured peaks on {device.device_kind}: {tflops:.3g} TFLOP/s (bf16 jnp.dot "
        f"{matmul_n}^3), {gbs:.3g} GB/s (x + 1 on {copy_bytes / MiB:.0f} MiB float32, "
        "read + write)"
    )
    return tflops, gbs


def device_peaks(args, device: jax.Device) -> tuple[float, float]:
    """(peak bf16 matmul TFLOP/s, peak GB/s) of device, measured once per run."""
    matmul_n, copy_bytes = (256, MiB) if args.smoke else (8192, 2**30)
    return measured_peaks(device, matmul_n, copy_bytes, args.repeats, args.calls)


def max_abs_diff(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def with_backward(fn: Callable, num_inputs: int) -> Callable:
    """jit of out, grads = fn(*inputs) and its VJP with the cotangent passed last.

    The output is returned too, as in training (it feeds the next layer), so XLA cannot drop
    the forward pass of either contender.
    """

    def step(*args):
        out, pullback = jax.vjp(fn, *args[:num_inputs])
        return out, pullback(args[num_inputs])

    return jax.jit(step)


def shape_settings(args) -> argparse.Namespace:
    """The GPU sections' shapes: the command line's, or tiny ones under --smoke."""
    if args.smoke:
        return argparse.Namespace(
            attn_batch=1,
            attn_heads=2,
            attn_seq=64,
            attn_head_dims=[64, 128],
            norm_rows=64,
            norm_features=256,
            adamw_params=16384,
        )
    return args


def attention_contenders(causal: bool, smoke: bool) -> dict[str, tuple[Callable, bool]]:
    """name -> (attention(q, k, v), whether it takes [batch, seq, heads, head_dim]); xla first."""
    return {
        "xla (reference)": (
            functools.partial(flash_attention, causal=causal, implementation="xla"),
            False,
        ),
        "pallas": (
            functools.partial(
                flash_attention, causal=causal, implementation="pallas", interpret=smoke
            ),
            False,
        ),
        # cuDNN's fused attention is what a JAX user gets without zerojax; under --smoke (CPU)
        # the same call runs XLA's implementation.
        f"jax.nn {'xla' if smoke else 'cudnn'}": (
            functools.partial(
                jax.nn.dot_product_attention,
                is_causal=causal,
                implementation=None if smoke else "cudnn",
            ),
            True,
        ),
    }


def bench_gpu_attention(args) -> None:
    """Flash attention (bf16, fwd and fwd+bwd): Pallas vs the XLA reference vs cuDNN; TFLOP/s."""
    device = kernel_device(args, "gpu-attention")
    if device is None:
        return
    peak_tflops, _ = device_peaks(args, device)
    shapes = shape_settings(args)
    batch, heads, seq = shapes.attn_batch, shapes.attn_heads, shapes.attn_seq
    rows = []
    for head_dim in shapes.attn_head_dims:
        keys = jax.random.split(jax.random.key(head_dim), 4)
        q, k, v, d_out = (
            jax.device_put(
                jax.random.normal(key, (batch, heads, seq, head_dim), jnp.bfloat16), device
            )
            for key in keys
        )
        bthd = [jnp.swapaxes(x, 1, 2) for x in (q, k, v, d_out)]
        for causal in (False, True):
            # 2 matmuls of 2*s*s*d FLOPs per head forward; the backward does 2.5 times that
            # (5 matmuls; FlashAttention's convention); a causal mask skips half of them.
            fwd_flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
            reference_out, xla_seconds = None, {}
            for name, (attention, seq_major) in attention_contenders(causal, args.smoke).items():
                inputs = bthd if seq_major else [q, k, v, d_out]
                passes = {
                    "fwd": (jax.jit(attention), inputs[:3], fwd_flops),
                    "fwd+bwd": (with_backward(attention, 3), inputs, 3.5 * fwd_flops),
                }
                for pass_name, (step, step_inputs, flops) in passes.items():
                    label = [head_dim, causal, name, pass_name]
                    try:
                        seconds = seconds_per_call(
                            step, *step_inputs, repeats=args.repeats, calls=args.calls
                        )
                        out = step(*step_inputs)
                    # A failing contender (cuDNN rejecting a shape, an OOM) must not hide the rest.
                    except Exception as error:  # noqa: BLE001
                        rows.append(label + [f"failed: {type(error).__name__}"] + [""] * 4)
                        continue
                    out = out if pass_name == "fwd" else out[0]
                    if seq_major:
                        out = jnp.swapaxes(out, 1, 2)
                    if name.startswith("xla"):
                        xla_seconds[pass_name] = seconds
                        if pass_name == "fwd":
                            reference_out = out
                    tflops = flops / seconds / 1e12
                    rows.append(
                        label
                        + [
                            f"{seconds * 1e3:.3f}",
                            f"{tflops:.3g}",
                            f"{tflops / peak_tflops:.2f}",
                            f"{xla_seconds[pass_name] / seconds:.2f}"
                            if pass_name in xla_seconds
                            else "",
                            f"{max_abs_diff(out, reference_out):.1e}"
                            if reference_out is not None
                            else "",
                        ]
                    )
    print_table(
        f"flash attention: batch={batch} heads={heads} seq={seq} bf16, {args.repeats} x "
        f"{args.calls} calls (TFLOP/s counts 4*b*h*s*s*d forward, 3.5x that for fwd+bwd, "
        f"halved when causal; x peak vs the measured bf16 matmul {peak_tflops:.3g} TFLOP/s)",
        [
            "head_dim",
            "causal",
            "implementation",
            "pass",
            "median ms",
            "TFLOP/s",
            "x peak",
            "speedup vs xla",
            "max |out - xla|",
        ],
        rows,
    )


def bench_gpu_norms(args) -> None:
    """LayerNorm / RMSNorm (bf16, fwd and fwd+bwd): Pallas vs the XLA reference; GB/s."""
    device = kernel_device(args, "gpu-norms")
    if device is None:
        return
    _, peak_gbs = device_peaks(args, device)
    shapes = shape_settings(args)
    rows_n, features = shapes.norm_rows, shapes.norm_features
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(keys[0], (rows_n, features), jnp.float32).astype(dtype)
    weight = (1 + 0.1 * jax.random.normal(keys[1], (features,), jnp.float32)).astype(dtype)
    bias = (0.1 * jax.random.normal(keys[2], (features,), jnp.float32)).astype(dtype)
    d_out = jax.random.normal(keys[3], (rows_n, features), jnp.float32).astype(dtype)
    x, weight, bias, d_out = jax.device_put((x, weight, bias, d_out), device)
    # Minimum HBM traffic: the forward reads x and writes y; the backward re-reads x, reads dy
    # and writes dx. The [features] vectors and per-row statistics are negligible here.
    activation = x.size * x.dtype.itemsize
    ops = {
        "layer_norm": (layer_norm, [x, weight, bias]),
        "rms_norm": (rms_norm, [x, weight]),
    }
    table = []
    for op_name, (op, params) in ops.items():
        reference_out, xla_seconds = None, {}
        for implementation in ("xla", "pallas"):
            norm = functools.partial(
                op,
                implementation=implementation,
                interpret=args.smoke and implementation == "pallas",
            )
            passes = {
                "fwd": (jax.jit(norm), params, 2 * activation),
                "fwd+bwd": (with_backward(norm, len(params)), params + [d_out], 5 * activation),
            }
            for pass_name, (step, inputs, nbytes) in passes.items():
                seconds = seconds_per_call(step, *inputs, repeats=args.repeats, calls=args.calls)
                out = step(*inputs)
                out = out if pass_name == "fwd" else out[0]
                if implementation == "xla":
                    xla_seconds[pass_name] = seconds
                    reference_out = out if pass_name == "fwd" else reference_out
                gbs = nbytes / seconds / 1e9
                table.append(
                    [
                        op_name,
                        implementation,
                        pass_name,
                        f"{seconds * 1e6:.1f}",
                        f"{gbs:.3g}",
                        f"{gbs / peak_gbs:.2f}",
                        f"{xla_seconds[pass_name] / seconds:.2f}",
                        f"{max_abs_diff(out, reference_out):.1e}",
                    ]
                )
    print_table(
        f"norms: x [{rows_n}, {features}] {jnp.dtype(dtype).name}, {args.repeats} x {args.calls} "
        f"calls (GB/s counts x + y forward, 5 activations fwd+bwd; x peak vs the measured "
        f"{peak_gbs:.3g} GB/s)",
        [
            "op",
            "implementation",
            "pass",
            "median us",
            "GB/s",
            "x peak",
            "speedup vs xla",
            "max |y - xla|",
        ],
        table,
    )


def adamw_contenders(
    param_dtype, hyper_values: dict, interpret: bool
) -> dict[str, tuple[Callable, Callable]]:
    """name -> (init(weight, exp_avg, exp_avg_sq) -> state,
    step(state, grad, hyper) -> (state, new_param_or_None)); xla first. The state is donated.
    """

    def moments_state(weight, exp_avg, exp_avg_sq):
        return weight, exp_avg, exp_avg_sq

    def fused(implementation: str, interpret: bool) -> Callable:
        def step(state, grad, hyper):
            weight, exp_avg, exp_avg_sq = state
            weight, exp_avg, exp_avg_sq, param = adamw_update(
                weight,
                grad,
                exp_avg,
                exp_avg_sq,
                hyper,
                param_dtype=param_dtype,
                implementation=implementation,
                interpret=interpret,
            )
            return (weight, exp_avg, exp_avg_sq), param

        return step

    contenders = {
        "xla": (moments_state, fused("xla", False)),
        "pallas": (moments_state, fused("pallas", interpret)),
    }
    try:
        import optax
    except ImportError:
        return contenders
    transform = optax.adamw(
        hyper_values["lr"],
        b1=hyper_values["betas"][0],
        b2=hyper_values["betas"][1],
        eps=hyper_values["eps"],
        weight_decay=hyper_values["weight_decay"],
    )

    def optax_step(state, grad, hyper):
        del hyper  # baked into the transform
        weight, opt_state = state
        updates, opt_state = transform.update(grad, opt_state, weight)
        weight = optax.apply_updates(weight, updates)
        param = None if param_dtype is None else weight.astype(param_dtype)
        return (weight, opt_state), param

    def optax_state(weight, exp_avg, exp_avg_sq):
        # optax keeps its own moments (zeros at init): same traffic, different values.
        return weight, transform.init(weight)

    contenders["optax.adamw"] = (optax_state, optax_step)
    return contenders


def bench_gpu_adamw(args) -> None:
    """Fused AdamW step (fp32 master weights): Pallas vs the XLA reference vs optax; GB/s."""
    device = kernel_device(args, "gpu-adamw")
    if device is None:
        return
    _, peak_gbs = device_peaks(args, device)
    n = shape_settings(args).adamw_params
    hyper_values = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    hyper = jax.device_put(adamw_hyper(**hyper_values, step=1), device)
    cases = {
        "fp32 grad": (jnp.float32, None),
        "bf16 grad, bf16 param out": (jnp.bfloat16, jnp.bfloat16),
    }
    table = []
    for case, (grad_dtype, param_dtype) in cases.items():
        keys = jax.random.split(jax.random.key(3), 4)
        grad = jax.device_put(
            jax.random.normal(keys[1], (n,), jnp.float32).astype(grad_dtype), device
        )

        def fresh_state(keys=keys):
            # New buffers per contender: the previous contender's state was donated.
            weight = jax.random.normal(keys[0], (n,), jnp.float32)
            exp_avg = 0.1 * jax.random.normal(keys[2], (n,), jnp.float32)
            exp_avg_sq = jnp.abs(jax.random.normal(keys[3], (n,), jnp.float32))
            return jax.device_put((weight, exp_avg, exp_avg_sq), device)

        # Bytes moved: every operand read once and every result written once (32-bit moments).
        param_bytes = 0 if param_dtype is None else n * jnp.dtype(param_dtype).itemsize
        nbytes = 4 * n * 3 * 2 + grad.nbytes + param_bytes
        reference_weight, xla_seconds = None, None
        for name, (init, step) in adamw_contenders(param_dtype, hyper_values, args.smoke).items():
            state = jax.device_put(init(*fresh_state()), device)
            jitted = jax.jit(step, donate_argnums=0)
            # One step from the shared initial state: the correctness check and the compile.
            state, param = jitted(state, grad, hyper)
            new_weight = state[0]
            if name == "xla":
                reference_weight = jnp.copy(new_weight)
            diff = (
                "" if name == "optax.adamw" else f"{max_abs_diff(new_weight, reference_weight):.1e}"
            )
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(args.calls):
                    # The state is donated and threaded through, as in a training loop.
                    state, param = jitted(state, grad, hyper)
                jax.block_until_ready((state, param))
                times.append((time.perf_counter() - start) / args.calls)
            seconds = statistics.median(times)
            xla_seconds = xla_seconds or seconds
            gbs = nbytes / seconds / 1e9
            table.append(
                [
                    case,
                    name,
                    f"{seconds * 1e6:.1f}",
                    f"{gbs:.3g}",
                    f"{gbs / peak_gbs:.2f}",
                    f"{xla_seconds / seconds:.2f}",
                    diff,
                ]
            )
    print_table(
        f"AdamW: {n} float32 master weights, float32 moments, {args.repeats} x {args.calls} "
        f"donated steps (GB/s counts each operand read and each result written once; x peak "
        f"vs the measured {peak_gbs:.3g} GB/s; optax has its own moments, so no diff)",
        [
            "case",
            "implementation",
            "median us",
            "GB/s",
            "x peak",
            "speedup vs xla",
            "max |w - xla|",
        ],
        table,
    )


SECTIONS: dict[str, Callable] = {
    "cpu-loss": bench_cpu_loss,
    "gpu-loss": bench_gpu_loss,
    "gpu-attention": bench_gpu_attention,
    "gpu-norms": bench_gpu_norms,
    "gpu-adamw": bench_gpu_adamw,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="sections (all of them when none is named): " + ", ".join(SECTIONS),
    )
    for name, fn in SECTIONS.items():
        parser.add_argument(f"--{name}", action="store_true", help=fn.__doc__)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, GPU sections on CPU with the Pallas kernels in interpret mode: "
        "checks that every code path runs (numbers meaningless)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender")
    parser.add_argument(
        "--calls",
        type=int,
        default=10,
        help="back-to-back calls per timed run in gpu-attention, gpu-norms, gpu-adamw",
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument(
        "--vocab-chunk",
        type=int,
        default=4096,
        help="vocabulary columns per step of the chunked XLA loss",
    )
    parser.add_argument("--attn-batch", type=int, default=4)
    parser.add_argument("--attn-heads", type=int, default=16)
    parser.add_argument("--attn-seq", type=int, default=2048)
    parser.add_argument("--attn-head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--norm-rows", type=int, default=8192)
    parser.add_argument("--norm-features", type=int, default=4096)
    parser.add_argument(
        "--adamw-params", type=int, default=64 * 2**20, help="elements of the AdamW tensor"
    )
    args = parser.parse_args(argv)
    chosen = [name for name in SECTIONS if getattr(args, name.replace("-", "_"))]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    if args.smoke:
        # Interpret mode is slow: keep every grid to a few programs.
        args.tokens, args.vocab, args.dim, args.vocab_chunk = 64, 512, 64, 128
        args.repeats, args.calls = 1, 1
        print("smoke: tiny shapes, GPU sections on CPU, Pallas interpreted (timings meaningless)")
    for name in chosen or SECTIONS:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
