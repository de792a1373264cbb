"""The kernels section: every Pallas kernel of `zerojax.pallas_kernels`, compiled for the GPU,
against XLA's own version of the same op, for accuracy and for speed.

Kernels, in the order they run: flash attention (forward, forward + backward; peers: the
kernel api's `implementation="xla"` and `jax.nn.dot_product_attention(implementation=
"cudnn")`), linear + cross-entropy (forward + backward; peers: the api's chunked "xla" and the
unfused `h @ W.T` + log-softmax), layer norm and RMS norm (forward, forward + backward; peer:
the api's "xla"), and the fused AdamW step (peers: the api's "xla" and `optax.adamw`). The
first shape of every kernel runs before any kernel's second, so a short budget drops the
least-needed work (skipped cases are named in a note).

Accuracy: every contender's outputs (and gradients) are compared with an fp32 reference, the
api's "xla" implementation on the same inputs upcast to fp32 with fp32 matmuls ("highest"
precision: on a GPU an fp32 matmul would otherwise run in TF32). The Pallas kernel passes
when its error is within a small multiple of XLA's own bf16 error plus a floor (`tolerance`).
Speed: ms per call (`seconds_per_call`), speed-up vs the api's "xla", achieved TFLOP/s or GB/s
as fractions of the measured and the data-sheet peaks, and one target per kernel and pass:
"at least as fast as XLA's own", against the fastest XLA-compiled peer.

Under --cpu the same code runs with tiny shapes and the kernels interpreted, and one more check
lowers each kernel for CUDA at the GPU run's shapes (no GPU needed): an API drift in the
Pallas Triton lowering, or a GPU shape the kernels reject, shows in CI.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels import adamw_contenders, attention_contenders, loss_contenders
from tools.gpu_check.context import Context, seconds_per_call
from tools.gpu_check.report import SectionReport, Table
from zerojax.pallas_kernels.adamw import adamw_hyper
from zerojax.pallas_kernels.flash_attention import flash_attention
from zerojax.pallas_kernels.layer_norm import layer_norm
from zerojax.pallas_kernels.linear_cross_entropy import linear_cross_entropy
from zerojax.pallas_kernels.rms_norm import rms_norm

# --- Tolerance of a Pallas kernel against the fp32 reference.
#
# The kernel and XLA's own version of the op compute the same formula from the same bf16
# inputs, both accumulating matmuls and reductions in fp32; each differs from the fp32
# reference by its bf16 roundings: of the output (<= 1/2 ulp each), and of the intermediates
# both round to bf16 (the attention probabilities before P @ V, dS and dP in its backward,
# dlogits in the loss's), each of which adds up to ~sqrt(K) half-ulps of the terms a K-long
# accumulation sums over. A kernel rounds at other places than XLA, not more often, so its
# error is of the same order as XLA's: it may be ERROR_MULTIPLE times XLA's max error and
# XLA's relative RMS error. The max catches a wrong element; the RMS a block of wrong rows
# that the causal rows' large outputs would hide in the max.
#
# A floor is added: one ulp of the output's dtype at the output's largest magnitude (eps x
# max |ref|, which bounds it; eps alone for the relative RMS), and at least FP32_FLOOR_ULPS
# fp32 ulps, for outputs that XLA computes as the reference does: AdamW is fp32 throughout
# (XLA's error is 0; the kernel may contract or round a multiply-add differently, +-1 ulp),
# and the fp32 loss sums the vocabulary's tiles in another order (~sqrt(number of partial
# sums) ulps, a few dozen tiles). For bf16 outputs the tolerance comes to ~2-3 ulps at the
# largest magnitude and ~5x XLA's relative RMS error; in interpret mode at seq 512, [1024,
# 2048] norms and a 4096-word vocabulary the kernels used a fifth of it.
ERROR_MULTIPLE = 2.0
FP32_FLOOR_ULPS = 8.0

# Seconds one case of a kernel (all its contenders, compiles included) is expected to take;
# a case is skipped, with a note, when less than this is left of the section's time.
CASE_SECONDS_GPU = {"attention": 14.0, "loss": 12.0, "norm": 7.0, "adamw": 5.0}
CASE_SECONDS_CPU = {"attention": 6.0, "loss": 3.0, "norm": 3.0, "adamw": 2.0}
# A contender is skipped (its row says so) when less than this is left.
CONTENDER_SECONDS = 3.0
LOWERING_SECONDS = 6.0

# XLA:CPU at optimization level 0 compiles the interpreted kernels' large unrolled programs
# ~2.5x faster (as tests/pallas_kernels do) and they still run in milliseconds; the GPU run
# compiles with XLA's defaults, as a user's program would.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def jit(ctx: Context, fn: Callable, **kwargs) -> Callable:
    if ctx.cpu:
        kwargs["compiler_options"] = CPU_COMPILER_OPTIONS
    return jax.jit(fn, **kwargs)


def vjp_step(fn: Callable, num_inputs: int) -> Callable:
    """`(out, grads)` of fn(*inputs) with the cotangent passed last, as bench.kernels'
    `with_backward` (un-jitted here, so the fp32 reference can upcast its inputs inside the
    same program). The output is returned too, as in training, so XLA cannot drop either
    contender's forward pass."""

    def step(*args):
        out, pullback = jax.vjp(fn, *args[:num_inputs])
        return out, pullback(args[num_inputs])

    return step


def with_backward(ctx: Context, fn: Callable, num_inputs: int) -> Callable:
    return jit(ctx, vjp_step(fn, num_inputs))


def in_fp32(fn: Callable) -> Callable:
    """fn with its floating inputs upcast to fp32 first, in the program (the reference: the
    same bf16 values, computed in fp32)."""

    def upcast(x):
        return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return lambda *args: fn(*(upcast(x) for x in args))


@contextlib.contextmanager
def fp32_matmuls():
    """fp32 matmuls in fp32 (not TF32, XLA:GPU's default) while the reference is traced."""
    with jax.default_matmul_precision("highest"):
        yield


# Arrays up to this many elements are made and compared on the host with numpy: XLA would
# compile a program per shape (~0.5 s each on this CI's CPU) for microseconds of work. Larger
# ones (the GPU run's) stay on the device: moving and converting them would take seconds.
HOST_ELEMENTS = 2**20


@jax.jit
def _device_error_stats(actual: jax.Array, reference: jax.Array) -> tuple[jax.Array, ...]:
    actual, reference = actual.astype(jnp.float32), reference.astype(jnp.float32)
    diff = actual - reference
    rms_ratio = jnp.sqrt(jnp.sum(diff * diff)) / jnp.sqrt(jnp.sum(reference * reference))
    return jnp.max(jnp.abs(diff)), rms_ratio, jnp.max(jnp.abs(reference))


def _host_error_stats(actual: jax.Array, reference: jax.Array) -> tuple[float, ...]:
    actual, reference = (np.asarray(x.astype(jnp.float32), np.float64) for x in (actual, reference))
    diff = actual - reference
    rms_ratio = np.sqrt(np.sum(diff * diff)) / np.sqrt(np.sum(reference * reference))
    return np.max(np.abs(diff)), rms_ratio, np.max(np.abs(reference))


@dataclasses.dataclass(frozen=True)
class Error:
    """One output's difference from the fp32 reference."""

    max_abs: float
    rel_rms: float  # ||actual - reference|| / ||reference||
    magnitude: float  # max |reference|

    @classmethod
    def of(cls, actual: jax.Array, reference: jax.Array) -> Error:
        if actual.shape != reference.shape:
            raise ValueError(f"output shape {actual.shape} != the reference's {reference.shape}")
        small = actual.size <= HOST_ELEMENTS
        stats = (_host_error_stats if small else _device_error_stats)(actual, reference)
        return cls(*(float(x) for x in stats))


def tolerance(xla: Error, dtype) -> tuple[float, float]:
    """(max |err|, relative RMS err) a Pallas output of `dtype` may have, given XLA's own
    error on the same output (see ERROR_MULTIPLE and FP32_FLOOR_ULPS)."""
    floor = max(float(jnp.finfo(dtype).eps), FP32_FLOOR_ULPS * float(jnp.finfo(jnp.float32).eps))
    return (
        ERROR_MULTIPLE * xla.max_abs + floor * xla.magnitude,
        ERROR_MULTIPLE * xla.rel_rms + floor,
    )


def failure(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"failed: {type(error).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _device_normal(key, scale, offset, *, shape, dtype):
    return (offset + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_normal(
    seed: int, shape: tuple[int, ...], dtype, scale: float = 1.0, offset: float = 0.0
) -> jax.Array:
    """N(offset, scale^2) values in `dtype`, made on the host when small (see HOST_ELEMENTS).
    Never zeros: a kernel timed on zeros can take shortcuts, and its errors vanish."""
    if math.prod(shape) <= HOST_ELEMENTS:
        values = np.random.default_rng(seed).standard_normal(shape, np.float32)
        return jnp.asarray((offset + scale * values).astype(dtype))
    return _device_normal(jax.random.key(seed), scale, offset, shape=shape, dtype=dtype)


@dataclasses.dataclass
class Contender:
    """One implementation of one pass of a case: `run()` compiles, times and returns
    (seconds per call, outputs to compare with the reference, or None: not comparable)."""

    name: str
    run: Callable[[], tuple[float, Sequence[jax.Array] | None]]
    is_pallas: bool = False
    is_peer: bool = True  # an XLA-compiled peer the speed target is measured against


@dataclasses.dataclass
class Timing:
    case: str
    pallas_seconds: float | None
    peers: dict[str, float]  # peer name -> seconds


class KernelCheck(abc.ABC):
    """One kernel: its cases, its speed and accuracy tables, its checks and targets.

    A subclass lists its cases (`cases`: (label, round, arguments)) and runs one
    (`run_case`) by building `Contender`s per pass and handing them to `compare`.
    """

    kind: str  # key of CASE_SECONDS_*
    title: str  # the kernel's name in tables, checks and targets
    unit: str  # "TFLOP/s" or "GB/s"
    baseline = "xla"  # the contender the speed-up column divides by

    def __init__(self, ctx: Context, report: SectionReport, peaks: dict):
        self.ctx, self.report, self.peaks = ctx, report, peaks
        self.timing = {"repeats": 1, "calls": 1} if ctx.cpu else {"repeats": 5, "calls": 10}
        self.speed: Table | None = None
        self.accuracy: Table | None = None
        self.timings: dict[str, list[Timing]] = {}

    # -- what a subclass provides

    @abc.abstractmethod
    def cases(self) -> list[tuple[str, int, dict]]:
        """Provided by each kernel's subclass."""

    @abc.abstractmethod
    def run_case(self, label: str, **arguments) -> None:
        """Provided by each kernel's subclass."""

    @abc.abstractmethod
    def speed_title(self) -> str:
        """Provided by each kernel's subclass."""

    # -- shared machinery

    def tables(self) -> None:
        if self.speed is not None:
            return
        peak_unit = "bf16 matmul" if self.unit == "TFLOP/s" else "memory bandwidth"
        self.speed = self.report.table(
            f"{self.title}: {self.speed_title()}; speed-up = XLA's ({self.baseline}) ms / this "
            f"ms; x measured / x data sheet = fraction of the measured {peak_unit} peak and of "
            "NVIDIA's data-sheet figure",
            [
                "case",
                "pass",
                "contender",
                "ms",
                "speed-up vs XLA",
                self.unit,
                "x measured peak",
                "x data sheet",
            ],
        )
        self.accuracy = self.report.table(
            f"{self.title}: error vs the fp32 reference (the api's 'xla' on fp32 inputs, fp32 "
            f"matmuls); Pallas tolerance = {ERROR_MULTIPLE:g} x XLA's error + 1 ulp of the "
            f"output dtype (>= {FP32_FLOOR_ULPS:g} fp32 ulps) at max |ref| (relative, for the RMS)",
            [
                "case",
                "pass",
                "output",
                "max |ref|",
                "contender",
                "max |err|",
                "max tolerance",
                "rel RMS err",
                "rel RMS tolerance",
            ],
        )

    def rate_cells(self, work: float, seconds: float) -> list:
        """[rate, fraction of the measured peak, fraction of the data-sheet peak]."""
        index = 0 if self.unit == "TFLOP/s" else 1
        scale = 1e12 if self.unit == "TFLOP/s" else 1e9
        rate = work / seconds / scale
        measured = self.peaks.get("measured")
        sheet = self.peaks.get("data sheet")
        return [
            rate,
            rate / measured[index] if measured else None,
            rate / sheet[index] if sheet else None,
        ]

    def compare(
        self,
        case: str,
        pass_name: str,
        contenders: list[Contender],
        *,
        work: float,
        output_names: Sequence[str],
        reference: Sequence[jax.Array] | None,
        reference_error: str | None = None,
    ) -> None:
        """Run each contender; add speed rows, accuracy rows, the Pallas kernel's check."""
        self.tables()
        errors: dict[str, list[Error]] = {}
        dtypes: list = []
        seconds_of: dict[str, float] = {}
        pallas_failure, skipped = None, False
        for contender in contenders:
            row = [case, pass_name, contender.name]
            if self.ctx.time_left() < CONTENDER_SECONDS:
                # Out of time is reported, not failed (as a section the runner skips).
                self.speed.add(*row, "skipped: the section's time is up", *[None] * 4)
                if contender.is_pallas:
                    skipped = True
                continue
            try:
                seconds, outputs = contender.run()
                if outputs is not None and reference is not None:
                    errors[contender.name] = [
                        Error.of(out, ref) for out, ref in zip(outputs, reference, strict=True)
                    ]
                    if contender.is_pallas:
                        dtypes = [out.dtype for out in outputs]
            # One contender failing (cuDNN refusing a shape, an OOM) must not hide the rest.
            except Exception as error:  # noqa: BLE001
                self.speed.add(*row, failure(error), *[None] * 4)
                if contender.is_pallas:
                    pallas_failure = failure(error)
                continue
            seconds_of[contender.name] = seconds
            baseline = seconds_of.get(self.baseline)
            self.speed.add(
                *row,
                seconds * 1e3,
                None if baseline is None else baseline / seconds,
                *self.rate_cells(work, seconds),
            )
        pallas = next(c.name for c in contenders if c.is_pallas)
        peers = {
            c.name: seconds_of[c.name] for c in contenders if c.is_peer and c.name in seconds_of
        }
        self.timings.setdefault(pass_name, []).append(Timing(case, seconds_of.get(pallas), peers))
        if skipped:
            self.report.notes.append(
                f"{self.title} {pass_name}, {case}: the Pallas kernel was not run (no time left)"
            )
            return
        self.judge(
            case, pass_name, output_names, errors, dtypes, pallas, pallas_failure, reference_error
        )

    def judge(
        self, case, pass_name, output_names, errors, dtypes, pallas, pallas_failure, reference_error
    ) -> None:
        """Accuracy rows for every contender that ran, and the Pallas kernel's check."""
        judged = pallas_failure is None and self.baseline in errors and pallas in errors
        tolerances = [
            tolerance(errors[self.baseline][index], dtypes[index]) if judged else (None, None)
            for index in range(len(output_names))
        ]
        for index, output in enumerate(output_names):
            for contender, contender_errors in errors.items():
                error = contender_errors[index]
                max_tol, rms_tol = tolerances[index] if contender == pallas else (None, None)
                self.accuracy.add(
                    case,
                    pass_name,
                    output,
                    error.magnitude,
                    contender,
                    error.max_abs,
                    max_tol,
                    error.rel_rms,
                    rms_tol,
                )
        name = f"{self.title} {pass_name}, {case}: Pallas kernel vs the fp32 reference"
        if pallas_failure is not None:
            self.report.check(name, False, f"the kernel {pallas_failure}")
            return
        if reference_error is not None:
            self.report.check(name, False, f"not judged: the fp32 reference {reference_error}")
            return
        if not judged:
            self.report.check(
                name,
                False,
                f"not judged: XLA's own version ({self.baseline}) "
                "did not run, and the tolerance is relative to its error",
            )
            return
        details, passed = [], True
        for output, mine, (max_tol, rms_tol) in zip(output_names, errors[pallas], tolerances):
            # A NaN compares False: it fails.
            within = mine.max_abs <= max_tol and mine.rel_rms <= rms_tol
            passed &= within
            details.append(
                f"{output}: max |err| {mine.max_abs:.3g} (tol {max_tol:.3g}), rel RMS "
                f"{mine.rel_rms:.3g} (tol {rms_tol:.3g}){'' if within else ' EXCEEDED'}"
            )
        details.append(
            f"tol = {ERROR_MULTIPLE:g} x XLA's own error + 1 ulp of the output dtype (>= "
            f"{FP32_FLOOR_ULPS:g} fp32 ulps) at max |ref| (the kernel rounds elsewhere than "
            "XLA, not more often)"
        )
        self.report.check(name, passed, "; ".join(details))

    def finish(self) -> None:
        """One target per pass: at least as fast as XLA's own (its fastest peer), every case."""
        for pass_name, timings in self.timings.items():
            met, parts = True, []
            for timing in timings:
                if not timing.peers:
                    parts.append(f"{timing.case}: no XLA peer ran")
                    continue
                peer, peer_seconds = min(timing.peers.items(), key=lambda item: item[1])
                if timing.pallas_seconds is None:
                    met = False
                    parts.append(f"{timing.case}: the Pallas kernel did not run")
                    continue
                ratio = peer_seconds / timing.pallas_seconds
                met &= ratio >= 1.0
                parts.append(
                    f"{timing.case}: {timing.pallas_seconds * 1e3:.3g} ms vs {peer} "
                    f"{peer_seconds * 1e3:.3g} ms ({ratio:.2f}x)"
                )
            self.report.target(
                f"{self.title} {pass_name} at least as fast as XLA's own", met, "; ".join(parts)
            )

    def timed(self, step: Callable, *args) -> float:
        return seconds_per_call(step, *args, **self.timing)


# --------------------------------------------------------------------------- attention


@jax.jit
def swap_seq_and_heads(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """[batch, heads, seq, d] <-> [batch, seq, heads, d] (cuDNN's layout), in one program."""
    return tuple(jnp.swapaxes(x, 1, 2) for x in arrays)


class AttentionCheck(KernelCheck):
    kind = "attention"
    title = "flash attention"
    unit = "TFLOP/s"
    baseline = "xla (reference)"  # bench.kernels.attention_contenders' name of the api's "xla"

    def __init__(self, ctx, report, peaks):
        super().__init__(ctx, report, peaks)
        # GPT-style layers at seq 2048 (GPT-2/GPT-3 head_dim 64, Llama head_dim 128); tiny on CPU.
        self.batch, self.heads, self.seq = (1, 2, 64) if ctx.cpu else (4, 16, 2048)
        self.head_dims = (64,) if ctx.cpu else (64, 128)
        # The CPU runs the causal case alone (the section's code is the same for both; the
        # CUDA lowering check and tests/pallas_kernels cover the kernel without the mask).
        self.causal_flags = (True,) if ctx.cpu else (True, False)

    def speed_title(self) -> str:
        return (
            f"bf16, batch {self.batch} x {self.heads} heads x seq {self.seq}, ms per call "
            f"({self.timing['repeats']} runs x {self.timing['calls']} calls, median); TFLOP/s "
            "counts 4*b*h*s*s*d forward, 3.5x that for fwd+bwd, halved when causal"
        )

    def cases(self):
        return [
            (
                f"head_dim {d}{', causal' if causal else ''}",
                1 if d == 64 else 2,
                {"head_dim": d, "causal": causal},
            )
            for d in self.head_dims
            for causal in self.causal_flags
        ]

    def run_case(self, label, *, head_dim, causal):
        shape = (self.batch, self.heads, self.seq, head_dim)
        q, k, v, d_out = (random_normal(seed, shape, jnp.bfloat16) for seed in range(4))
        seq_major = swap_seq_and_heads(q, k, v, d_out)
        reference, reference_error = None, None
        try:
            with fp32_matmuls():
                exact = functools.partial(flash_attention, causal=causal, implementation="xla")
                out, grads = jit(self.ctx, in_fp32(vjp_step(exact, 3)))(q, k, v, d_out)
                reference = [out, *grads]
        except Exception as error:  # noqa: BLE001 (reported in the checks)
            reference_error = failure(error)
        fwd_flops = 4 * self.batch * self.heads * self.seq**2 * head_dim / (2 if causal else 1)
        for pass_name, work, names in (
            ("fwd", fwd_flops, ("out",)),
            ("fwd+bwd", 3.5 * fwd_flops, ("out", "dq", "dk", "dv")),
        ):
            contenders = []
            for name, (attention, is_seq_major) in attention_contenders(
                causal, self.ctx.interpret
            ).items():
                inputs = seq_major if is_seq_major else (q, k, v, d_out)
                if pass_name == "fwd":
                    step, inputs = jit(self.ctx, attention), inputs[:3]
                else:
                    step = with_backward(self.ctx, attention, 3)

                def run(step=step, inputs=inputs, is_seq_major=is_seq_major):
                    seconds = self.timed(step, *inputs)
                    outputs = jax.tree.leaves(step(*inputs))
                    return seconds, swap_seq_and_heads(*outputs) if is_seq_major else outputs

                contenders.append(
                    Contender(name, run, is_pallas=name == "pallas", is_peer=name != "pallas")
                )
            self.compare(
                label,
                pass_name,
                contenders,
                work=work,
                output_names=names,
                reference=None if reference is None else reference[: len(names)],
                reference_error=reference_error,
            )


# ------------------------------------------------------------------ linear cross-entropy


class LossCheck(KernelCheck):
    kind = "loss"
    title = "linear cross-entropy"
    unit = "TFLOP/s"

    def speed_title(self) -> str:
        return (
            "bf16 hidden and weight, mean loss and its gradients wrt both (fwd+bwd), ms per "
            f"call ({self.timing['repeats']} runs x {self.timing['calls']} calls, median); "
            "TFLOP/s counts the model's 6*tokens*vocab*dim (logits, dh, dW; not the fused "
            "kernels' recomputed logits)"
        )

    def cases(self):
        if self.ctx.cpu:
            return [("tokens 64, vocab 512, dim 64", 1, {"tokens": 64, "vocab": 512, "dim": 64})]
        return [
            # GPT-2's head (vocab padded to 50304), a step of 8 x 1024 tokens.
            (
                "GPT-2: tokens 8192, vocab 50304, dim 768",
                1,
                {"tokens": 8192, "vocab": 50304, "dim": 768},
            ),
            # Llama 3.2 1B's head, 4096 tokens.
            (
                "Llama-3.2-1B: tokens 4096, vocab 128256, dim 2048",
                2,
                {"tokens": 4096, "vocab": 128256, "dim": 2048},
            ),
        ]

    def run_case(self, label, *, tokens, vocab, dim):
        # bench.kernels.loss_inputs' recipe: logits of about unit variance.
        hidden = random_normal(30, (tokens, dim), jnp.bfloat16)
        weight = random_normal(31, (vocab, dim), jnp.bfloat16, scale=dim**-0.5)
        labels = jnp.asarray(np.random.default_rng(32).integers(0, vocab, tokens, np.int32))
        reference, reference_error = None, None
        try:
            with fp32_matmuls():
                exact = functools.partial(linear_cross_entropy, implementation="xla")
                step = jit(self.ctx, in_fp32(jax.value_and_grad(exact, argnums=(0, 1))))
                reference = jax.tree.leaves(step(hidden, weight, labels))
        except Exception as error:  # noqa: BLE001 (reported in the checks)
            reference_error = failure(error)
        # bench.kernels' names: "unfused XLA", "xla (fused)" (the api's chunked "xla"),
        # "pallas (fused)"; XLA's own first, as the speed-up column divides by it.
        found = loss_contenders(["xla", "pallas"], vocab_chunk=4096, interpret=self.ctx.interpret)
        named = {
            "xla": found["xla (fused)"],
            "pallas": found["pallas (fused)"],
            "unfused XLA": found["unfused XLA"],
        }
        contenders = []
        for name, loss in named.items():
            step = jit(self.ctx, jax.value_and_grad(loss, argnums=(0, 1)))

            def run(step=step):
                seconds = self.timed(step, hidden, weight, labels)
                return seconds, jax.tree.leaves(step(hidden, weight, labels))

            contenders.append(
                Contender(name, run, is_pallas=name == "pallas", is_peer=name != "pallas")
            )
        self.compare(
            label,
            "fwd+bwd",
            contenders,
            work=6 * tokens * vocab * dim,
            output_names=("loss", "dhidden", "dweight"),
            reference=reference,
            reference_error=reference_error,
        )


# ------------------------------------------------------------------------------- norms


class NormCheck(KernelCheck):
    kind = "norm"
    unit = "GB/s"

    def __init__(self, ctx, report, peaks, *, title: str, op: Callable, with_bias: bool):
        super().__init__(ctx, report, peaks)
        self.title, self.op, self.with_bias = title, op, with_bias

    def speed_title(self) -> str:
        return (
            f"bf16 x, weight{' and bias' if self.with_bias else ''}, ms per call "
            f"({self.timing['repeats']} runs x {self.timing['calls']} calls, median); GB/s "
            "counts x read + y written forward, 5 activations fwd+bwd (x twice, y, dy, dx)"
        )

    def cases(self):
        if self.ctx.cpu:
            return [("[64, 256]", 1, {"rows": 64, "features": 256})]
        return [
            # A 7B-class model's hidden states (8 x 1024 tokens of 4096), and GPT-2-medium's.
            ("[8192, 4096]", 1, {"rows": 8192, "features": 4096}),
            ("[16384, 1024]", 2, {"rows": 16384, "features": 1024}),
        ]

    def run_case(self, label, *, rows, features):
        params = [
            random_normal(10, (rows, features), jnp.bfloat16),
            random_normal(11, (features,), jnp.bfloat16, scale=0.1, offset=1.0),
        ]
        if self.with_bias:
            params.append(random_normal(12, (features,), jnp.bfloat16, scale=0.1))
        d_out = random_normal(13, (rows, features), jnp.bfloat16)
        reference, reference_error = None, None
        try:
            exact = functools.partial(self.op, implementation="xla")
            out, grads = jit(self.ctx, in_fp32(vjp_step(exact, len(params))))(*params, d_out)
            reference = [out, *grads]
        except Exception as error:  # noqa: BLE001 (reported in the checks)
            reference_error = failure(error)
        activation = params[0].size * params[0].dtype.itemsize
        grad_names = ("dx", "dweight", "dbias")[: len(params)]
        for pass_name, work, names in (
            ("fwd", 2 * activation, ("y",)),
            ("fwd+bwd", 5 * activation, ("y", *grad_names)),
        ):
            contenders = []
            for implementation in ("xla", "pallas"):
                is_pallas = implementation == "pallas"
                norm = functools.partial(
                    self.op,
                    implementation=implementation,
                    interpret=self.ctx.interpret and is_pallas,
                )
                if pass_name == "fwd":
                    step, inputs = jit(self.ctx, norm), params
                else:
                    step, inputs = with_backward(self.ctx, norm, len(params)), [*params, d_out]

                def run(step=step, inputs=inputs):
                    seconds = self.timed(step, *inputs)
                    return seconds, jax.tree.leaves(step(*inputs))

                contenders.append(Contender(implementation, run, is_pallas, not is_pallas))
            self.compare(
                label,
                pass_name,
                contenders,
                work=work,
                output_names=names,
                reference=None if reference is None else reference[: len(names)],
                reference_error=reference_error,
            )


# ------------------------------------------------------------------------------- AdamW


# torch.optim.AdamW's defaults.
ADAMW_HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


class AdamWCheck(KernelCheck):
    kind = "adamw"
    title = "fused AdamW"
    unit = "GB/s"

    def speed_title(self) -> str:
        return (
            "fp32 master weights and moments, bf16 gradient, bf16 parameter copy out; state "
            f"donated and threaded through {self.timing['repeats']} runs x "
            f"{self.timing['calls']} steps (median ms per step); GB/s counts each operand read "
            "and each result written once"
        )

    def cases(self):
        if self.ctx.cpu:
            return [("16384 params", 1, {"size": 16384})]
        return [("64M params", 1, {"size": 64 * 2**20}), ("16M params", 2, {"size": 16 * 2**20})]

    def run_case(self, label, *, size):
        hyper = jax.device_put(adamw_hyper(**ADAMW_HYPER, step=10), self.ctx.device)
        grad = jax.device_put(random_normal(20, (size,), jnp.bfloat16), self.ctx.device)

        def fresh_state():
            # New buffers per call: a step donates its state. All operands are committed to
            # the device, as the steps' outputs are: a mix would compile each step twice.
            state = (
                random_normal(21, (size,), jnp.float32),
                random_normal(22, (size,), jnp.float32, scale=0.1),
                random_normal(23, (size,), jnp.float32, scale=1e-3, offset=1e-2),  # > 0
            )
            return jax.device_put(state, self.ctx.device)

        found = adamw_contenders(jnp.bfloat16, ADAMW_HYPER, self.ctx.interpret)

        def initial_state(init):
            return jax.device_put(init(*fresh_state()), self.ctx.device)  # optax's own too

        steps = {name: jit(self.ctx, step, donate_argnums=0) for name, (_, step) in found.items()}
        # The reference is XLA's own step: the api's "xla" is the fp32 spec (torch's AdamW,
        # bit for bit), so there is no lower-precision XLA version whose error could scale a
        # tolerance: the Pallas kernel gets the floor alone (see `tolerance`).
        reference, reference_error = None, None
        try:
            state, param = steps["xla"](initial_state(found["xla"][0]), grad, hyper)
            reference = [*state, param]
        except Exception as error:  # noqa: BLE001 (reported in the checks)
            reference_error = failure(error)

        contenders = []
        for name, (init, _) in found.items():
            comparable = name != "optax.adamw"  # optax keeps its own moments (zeros at init)

            def run(init=init, step=steps[name], comparable=comparable):
                state, param = step(initial_state(init), grad, hyper)  # compiles
                times = []
                for _ in range(self.timing["repeats"]):
                    start = time.perf_counter()
                    for _ in range(self.timing["calls"]):
                        state, param = step(state, grad, hyper)  # donated, as in training
                    jax.block_until_ready((state, param))
                    times.append((time.perf_counter() - start) / self.timing["calls"])
                if not comparable:
                    return statistics.median(times), None
                # One step from the reference's initial state, for the comparison.
                state, param = step(initial_state(init), grad, hyper)
                return statistics.median(times), [*state, param]

            contenders.append(
                Contender(name, run, is_pallas=name == "pallas", is_peer=name != "pallas")
            )
        # Each operand read once and each result written once: fp32 weight and moments in
        # and out, the bf16 gradient in, the bf16 parameter copy out.
        work = 4 * size * 3 * 2 + 2 * size + 2 * size
        self.compare(
            label,
            "step",
            contenders,
            work=work,
            output_names=("weight", "exp_avg", "exp_avg_sq", "bf16 param"),
            reference=reference,
            reference_error=reference_error,
        )


# ------------------------------------------------------------------------ CUDA lowering


def triton_calls(text: str) -> int:
    return len(re.findall(r"custom_call @[\w$.]*triton", text))


def check_cuda_lowering(ctx: Context, report: SectionReport, checks: list[KernelCheck]) -> None:
    """(CPU only) Each kernel lowered for CUDA at the GPU run's shapes, with its Pallas
    Triton calls counted: at least one per forward, at least two with the backward."""
    # The GPU run's cases: each kernel's check built for a GPU context (nothing of it runs).
    gpu = Context(cpu=False, deadline=ctx.deadline, scratch_dir=ctx.scratch_dir)
    table = report.table(
        "CUDA lowering at the GPU run's shapes (jit(...).trace(...).lower(lowering_platforms="
        "('cuda',)), no GPU needed): Pallas Triton calls in the lowered program",
        ["kernel", "case", "pass", "Triton calls"],
    )
    bf16 = jnp.bfloat16

    def spec(shape, dtype=bf16):
        return jax.ShapeDtypeStruct(shape, dtype)

    programs: list[tuple[str, str, str, Callable, list, int]] = []
    attention = AttentionCheck(gpu, report, {})
    for label, _, arguments in attention.cases():
        shape = (attention.batch, attention.heads, attention.seq, arguments["head_dim"])
        fn = attention_contenders(arguments["causal"], False)["pallas"][0]
        programs.append((attention.title, label, "fwd", jax.jit(fn), [spec(shape)] * 3, 1))
        programs.append(
            (attention.title, label, "fwd+bwd", with_backward(gpu, fn, 3), [spec(shape)] * 4, 2)
        )
    loss = LossCheck(gpu, report, {})
    for label, _, arguments in loss.cases():
        tokens, vocab, dim = arguments["tokens"], arguments["vocab"], arguments["dim"]
        fn = functools.partial(linear_cross_entropy, implementation="pallas")
        args = [spec((tokens, dim)), spec((vocab, dim)), spec((tokens,), jnp.int32)]
        programs.append((loss.title, label, "fwd", jax.jit(fn), args, 1))
        programs.append(
            (loss.title, label, "fwd+bwd", jax.jit(jax.value_and_grad(fn, argnums=(0, 1))), args, 2)
        )
    for check in checks:
        if not isinstance(check, NormCheck):
            continue
        for label, _, arguments in NormCheck(
            gpu, report, {}, title=check.title, op=check.op, with_bias=check.with_bias
        ).cases():
            rows, features = arguments["rows"], arguments["features"]
            fn = functools.partial(check.op, implementation="pallas")
            args = [spec((rows, features))] + [spec((features,))] * (2 if check.with_bias else 1)
            programs.append((check.title, label, "fwd", jax.jit(fn), args, 1))
            programs.append(
                (
                    check.title,
                    label,
                    "fwd+bwd",
                    with_backward(gpu, fn, len(args)),
                    [*args, spec((rows, features))],
                    2,
                )
            )
    adamw = AdamWCheck(gpu, report, {})
    _, step_fn = adamw_contenders(bf16, ADAMW_HYPER, False)["pallas"]
    hyper = jax.tree.map(jnp.asarray, adamw_hyper(**ADAMW_HYPER, step=10))
    for label, _, arguments in adamw.cases():
        state = [spec((arguments["size"],), jnp.float32)] * 3
        programs.append(
            (
                adamw.title,
                label,
                "step",
                jax.jit(step_fn, donate_argnums=0),
                [state, spec((arguments["size"],)), hyper],
                1,
            )
        )

    results: dict[tuple[str, str], list[str]] = {}
    for title, label, pass_name, program, args, least in programs:
        key = (title, pass_name)
        if ctx.time_left() < 1.0:  # out of time is reported, not failed
            report.notes.append(f"{title} {pass_name}, {label}: not lowered for CUDA (no time)")
            table.add(title, label, pass_name, "skipped: the section's time is up")
            continue
        try:
            lowered = program.trace(*args).lower(lowering_platforms=("cuda",))
            calls = triton_calls(lowered.as_text())
        except Exception as error:  # noqa: BLE001 (reported in the check)
            table.add(title, label, pass_name, failure(error))
            results.setdefault(key, []).append(f"{label}: {failure(error)}")
            continue
        table.add(title, label, pass_name, calls)
        if calls < least:
            results.setdefault(key, []).append(f"{label}: {calls} Triton calls, want >= {least}")
        else:
            results.setdefault(key, [])
    for (title, pass_name), problems in results.items():
        report.check(
            f"{title} {pass_name}: lowers for CUDA through Pallas Triton",
            not problems,
            "; ".join(problems) or "every GPU case lowered with its Triton calls (table above)",
        )


# --------------------------------------------------------------------------------- run


def run(ctx: Context, report: SectionReport) -> None:
    start = time.monotonic()
    peaks: dict = {"data sheet": ctx.data_sheet_peaks()}
    try:
        peaks["measured"] = ctx.measured_peaks()
    except Exception as error:  # noqa: BLE001 (the fractions of it are left blank)
        report.notes.append(f"measuring the device's peaks {failure(error)}")
    measured = peaks.get("measured")
    if measured:
        report.notes.append(
            f"measured peaks on {getattr(ctx.device, 'device_kind', ctx.device)}: "
            f"{measured[0]:.4g} TFLOP/s (bf16 jnp.dot), {measured[1]:.4g} GB/s (x + 1 on fp32)"
        )
    print(f"kernels: peaks: {time.monotonic() - start:.1f} s", flush=True)
    checks: list[KernelCheck] = [
        AttentionCheck(ctx, report, peaks),
        LossCheck(ctx, report, peaks),
        NormCheck(ctx, report, peaks, title="layer norm", op=layer_norm, with_bias=True),
        NormCheck(ctx, report, peaks, title="RMS norm", op=rms_norm, with_bias=False),
        AdamWCheck(ctx, report, peaks),
    ]
    case_seconds = CASE_SECONDS_CPU if ctx.cpu else CASE_SECONDS_GPU
    # Round 1 (every kernel's first shape, most important kernel first), then round 2.
    work = sorted(
        (
            (round_, order, check, label, arguments)
            for order, check in enumerate(checks)
            for label, round_, arguments in check.cases()
        ),
        key=lambda item: (item[0], item[1]),
    )
    skipped = []
    reserve = LOWERING_SECONDS if ctx.cpu else 0.0
    for _, _, check, label, arguments in work:
        if ctx.time_left() < case_seconds[check.kind] + reserve:
            skipped.append(f"{check.title} {label}")
            continue
        start = time.monotonic()
        check.run_case(label, **arguments)
        # The section's log shows where its time went (the GPU run is read, not watched).
        print(f"kernels: {check.title}, {label}: {time.monotonic() - start:.1f} s", flush=True)
    if skipped:
        report.notes.append(
            f"skipped for lack of the section's time ({ctx.time_left():.0f} s left): "
            + ", ".join(skipped)
        )
    for check in checks:
        check.finish()
    if ctx.cpu:
        start = time.monotonic()
        check_cuda_lowering(ctx, report, checks)
        print(f"kernels: CUDA lowering: {time.monotonic() - start:.1f} s", flush=True)
