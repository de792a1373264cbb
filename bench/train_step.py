"""Train-step benchmark: forward + backward + AdamW on the GPT-2 bench model, zerojax vs PyTorch.

1. Steady state: the median of --steps timed steps (after WARMUP_STEPS untimed ones) for
   - zerojax fused: `initialize(..., loss_fn=...)`, `model(x, y)` returns the loss, forward and
     backward run as one XLA program;
   - zerojax general: the model returns logits, the loss is computed in torch, `loss.backward()`
     runs the JAX pullback;
   - PyTorch eager and torch.compile (the model compiled; AdamW is torch's default foreach);
   each in fp32 and bf16 (zerojax precision `BF16_POLICY`; torch `torch.autocast("cpu",
   torch.bfloat16)` around forward and loss). A zerojax step ends when its updated params are
   ready (`jax.block_until_ready`), so asynchronous dispatch does not flatter it.
2. First-step latency (trace + compile + run) of zerojax, each case in a fresh subprocess so
   that no in-process cache helps: without the persistent compilation cache, with an empty
   cache (it is written) and with the cache the previous run wrote.

Everything runs on ONE CPU device (mesh {data: 1}): the contenders get the same cores, which a
simulated multi-device mesh would split. Dropout is off (`model.eval()`) so all contenders do
the same arithmetic; the first-step losses are printed as a check.

Run: make bench-train   (or .venv/bin/python bench/train_step.py [--steps N] [--quick]
     [--first-step-only] [--first-step-repeats N])
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import gpt2_bench_model

BF16_POLICY = "params=bfloat16,compute=bfloat16,master=float32"
PRECISIONS = {"fp32": "params=float32,compute=float32", "bf16": BF16_POLICY}
LR = 3e-4
WARMUP_STEPS = 5
"""Untimed steps first: compilation, allocator growth, and torch.compile's first few steps,
which run slow here (hundreds of ms) while its kernels finish compiling in the background."""


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(quick: bool):
    """A fresh model (same seed every time, dropout off) and one (tokens, targets) batch."""
    torch.manual_seed(0)
    if quick:
        model, (tokens,) = gpt2_bench_model(batch=2, seq_len=64, width=64, num_layers=2)
    else:
        model, (tokens,) = gpt2_bench_model()
    model.eval()
    return model, tokens, torch.roll(tokens, -1, dims=1)


# --- contenders: each returns a step function that trains one step and returns the loss ------


def zerojax_step(
    quick: bool,
    precision: str,
    fused: bool,
    cache_dir: str | None = None,
    train: dict | None = None,
):
    """The step function; its `engine` attribute is the engine (for its compiled programs).
    `train`: the config's train section (bench/index_check.py switches the index check)."""
    model, tokens, targets = build(quick)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = {
        "mesh": {"data": 1},
        "precision": precision,
        "train": train or {},
        # None: no persistent compilation cache (zerojax's default would use one).
        "runtime": {"compilation_cache_dir": cache_dir, "report_effective_time": False},
    }
    model, optimizer = zerojax.initialize(
        model, optimizer, config=config, loss_fn=lm_loss if fused else None
    )
    engine = model.engine

    def step():
        loss = model(tokens, targets) if fused else lm_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        jax.block_until_ready(engine.params)
        return loss

    step.engine = engine
    return step


def torch_step(quick: bool, precision: str, compiled: bool):
    model, tokens, targets = build(quick)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    forward = torch.compile(model) if compiled else model

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_loss(forward(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


CONTENDERS = {
    "zerojax fused": lambda quick, p: zerojax_step(quick, PRECISIONS[p], fused=True),
    "zerojax general": lambda quick, p: zerojax_step(quick, PRECISIONS[p], fused=False),
    "PyTorch eager": lambda quick, p: torch_step(quick, p, compiled=False),
    "torch.compile": lambda quick, p: torch_step(quick, p, compiled=True),
}


def time_steps(step, steps: int) -> tuple[float, float]:
    """(first loss, median seconds of `steps` steps after WARMUP_STEPS untimed ones)."""
    first_loss = step().item()
    for _ in range(WARMUP_STEPS - 1):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return first_loss, statistics.median(times)


def steady_state_table(quick: bool, steps: int) -> str:
    results = {}
    for precision in PRECISIONS:
        for name, make in CONTENDERS.items():
            print(f"  timing {name} {precision} ...", file=sys.stderr, flush=True)
            try:
                results[name, precision] = time_steps(make(quick, precision), steps)
            except Exception as exc:  # noqa: BLE001 (one broken contender must not hide the rest)
                message = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                print(f"  {name} {precision} failed: {message}", file=sys.stderr)
                results[name, precision] = None
    lines = [
        (
            "| implementation | fp32 step (ms) | fp32 speed-up vs eager | bf16 step (ms) "
            "| bf16 speed-up vs eager | first-step loss fp32 / bf16 |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for name in CONTENDERS:
        cells, losses = [], []
        for precision in PRECISIONS:
            result, eager = results[name, precision], results["PyTorch eager", precision]
            if result is None:
                cells += ["failed", "-"]
                losses.append("-")
                continue
            loss, seconds = result
            ratio = f"{eager[1] / seconds:.2f}x" if eager is not None else "-"
            cells += [f"{seconds * 1e3:.1f}", ratio]
            losses.append(f"{loss:.5f}")
        lines.append(f"| {name} | {' | '.join(cells)} | {' / '.join(losses)} |")
    return "\n".join(lines)


# --- first-step latency, in fresh processes ----------------------------------------------------


def first_step_child(quick: bool, fused: bool, cache_dir: str | None) -> None:
    """Runs in a subprocess: initialize + the first step, timed, printed as one JSON line."""
    jax.numpy.zeros(())  # backend start-up is not the compiler's time
    start = time.perf_counter()
    step = zerojax_step(quick, PRECISIONS["fp32"], fused=fused, cache_dir=cache_dir)
    initialized = time.perf_counter()
    step()
    done = time.perf_counter()
    step()
    second = time.perf_counter() - done
    print(
        json.dumps(
            {"initialize": initialized - start, "first": done - initialized, "second": second}
        )
    )


def first_step_table(quick: bool, repeats: int = 1) -> str:
    """One row per path and cache state; with `repeats` > 1 each cell is the median of that
    many fresh processes (the "empty" ones each with a cache directory of their own)."""

    def child(fused: bool, cache_dir: str | None) -> dict:
        command = [sys.executable, __file__, "--first-step-child", "fused" if fused else "general"]
        command += ["--quick"] if quick else []
        command += ["--cache-dir", cache_dir] if cache_dir else []
        start = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
        if out.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-2000:]}")
        return {
            **json.loads(out.stdout.strip().splitlines()[-1]),
            "process": time.perf_counter() - start,
        }

    lines = [
        (
            "| path | compilation cache | initialize (s) | first step (s) | second step "
            "| whole process (s) |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for fused in (True,) if quick else (True, False):
        path = "fused" if fused else "general"
        with tempfile.TemporaryDirectory(prefix="zerojax-bench-cache-") as root:
            directories = [os.path.join(root, str(i)) for i in range(repeats)]
            cases = [
                ("none", [None] * repeats),
                ("empty (written)", directories),
                ("warm", [directories[-1]] * repeats),
            ]
            for label, case_directories in cases:
                print(f"  first step, {path}, cache {label} ...", file=sys.stderr, flush=True)
                runs = [child(fused, directory) for directory in case_directories]
                r = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
                print(
                    f"    first steps: {[round(run['first'], 2) for run in runs]}", file=sys.stderr
                )
                lines.append(
                    f"| zerojax {path} | {label} | {r['initialize']:.2f} | {r['first']:.2f} | "
                    f"{r['second'] * 1e3:.0f} ms | {r['process']:.1f} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        help="timed steps per contender (>= 20 for the published table)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: a 2-layer width-64 model, batch 2 x 64, 3 steps",
    )
    parser.add_argument("--skip-first-step", action="store_true")
    parser.add_argument(
        "--first-step-only",
        action="store_true",
        help="only the first-step table (fresh processes; no steady-state timing)",
    )
    parser.add_argument(
        "--first-step-repeats",
        type=int,
        default=1,
        help="fresh processes per first-step cell; the table gives their median",
    )
    parser.add_argument("--first-step-child", choices=["fused", "general"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.first_step_child:
        first_step_child(options.quick, options.first_step_child == "fused", options.cache_dir)
        return
    steps = 3 if options.quick and "--steps" not in sys.argv else options.steps
    jax.numpy.zeros(())  # start the JAX backend before torch starts its threads

    if options.quick:
        shape = "GPT-2 2 layers, width 64, batch 2 x 64 tokens (--quick: not for publication)"
    else:
        shape = "GPT-2 4 layers, width 256, 8 heads, vocabulary 1024, batch 8 x 256 tokens"
    # Torch eager slows far more than XLA under CPU contention (issue 14: ~4x vs ~1.5x), which
    # flips the ratio: the load average says whether these numbers are fit to publish.
    print(f"load average (1, 5, 15 min) at start: {os.getloadavg()}", file=sys.stderr)
    num_params = sum(p.numel() for p in build(options.quick)[0].parameters())
    if not options.first_step_only:
        print(
            f"## Train step: forward + backward + AdamW ({shape}, {num_params / 1e6:.2f}M params)\n"
        )
        print(steady_state_table(options.quick, steps))
        print(f"\nLoad average (1, 5, 15 min) after the steady-state runs: {os.getloadavg()}")
        print(
            f"\nMedian of {steps} steps after {WARMUP_STEPS} untimed steps; one CPU device "
            f"(mesh data=1) for every contender; {torch.get_num_threads()} torch threads, "
            f"{os.cpu_count()} CPUs; torch {torch.__version__}, jax {jax.__version__}. bf16: "
            f'zerojax precision "{BF16_POLICY}", torch autocast(cpu, bfloat16). Speed-up = '
            "eager step time / step time, same precision."
        )
    if not options.skip_first_step:
        print(f"\n## First step: trace + compile + run (fresh process each, fp32, {shape})\n")
        print(first_step_table(options.quick, options.first_step_repeats))
        print(f"\nLoad average (1, 5, 15 min) after the first-step runs: {os.getloadavg()}")
        print(
            "\ninitialize: building the model and zerojax.initialize (state to JAX arrays); "
            "first step: torch.export "
            "trace, lowering, XLA compile (or persistent-cache load) and one run of the "
            "forward, backward and AdamW programs. Cache: jax_compilation_cache_dir with "
            "jax_persistent_cache_min_compile_time_secs=0 (and zerojax's capture cache, "
            "bridge/decomposition_cache.py, beside it). "
            "Whole process: python start to exit, imports included."
            + (
                f" Each cell: the median of {options.first_step_repeats} processes."
                if options.first_step_repeats > 1
                else ""
            )
        )


if __name__ == "__main__":
    main()
