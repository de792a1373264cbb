"""The "offload" section: optimizer offload (`offload_optimizer: {device: cpu}`, docs/offload.md)
trains a model the device cannot hold without it, and what its transfers cost a step.

1. **Does not fit without offload.** A GPT-2-style model (bf16 compute, fp32 master weights,
   gradients and AdamW moments, ZeRO-1 on one device) is planned with and without optimizer
   offload (`zerojax.memory_report(abstract=True)`, compiled for this device). Each run then
   gets the same device-memory budget (`choose_budget`), below what the run without offload
   must hold at once and above the offloaded run's planned peak: a child process whose JAX
   preallocates exactly that budget (`XLA_PYTHON_CLIENT_PREALLOCATE=true` with
   `XLA_CLIENT_MEM_FRACTION`, the BFC allocator, which never grows past what it
   preallocated). Without offload the run must fail with an out-of-memory error (caught in the
   child); with offload it must take steps with finite, decreasing loss. The two runs go side
   by side, each in its budget.
2. **What offload costs a step**, on the whole device (where both fit): the median step time
   with and without offload (interleaved), and the bytes each step moves between host and
   device memory (from the offload plan: the gradients out, in their accumulation dtype, and
   the new params in, in theirs; the optimizer state and master weights never cross) against
   the host<->device bandwidth measured there (`jax.device_put` of a large array to and from a
   `pinned_host` sharding): the share of the offloaded step that moving those bytes would take
   at that bandwidth, were nothing overlapped.

Every phase runs in a child process (`python -m tools.gpu_check.offload --child ...`, printing
JSON lines), so a phase that runs out of time is stopped and reported, never the section: the
plan; the runs under the budget; and the step timing, whose child builds and compiles while
the others run and times only once they are done (when this process closes its stdin).

On the CPU host and device are one memory and the CPU backend enforces no memory fraction:
the out-of-memory demonstration is planned only, the offloaded run trains without a budget,
and the "transfers" are copies within RAM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from tools.gpu_check.context import Context, prepare_environment
from tools.gpu_check.memory import (
    GB,
    collect_child,
    deepspeed_config,
    gpt2,
    lm_loss,
    plan,
    start_child,
)
from tools.gpu_check.report import SectionReport

NO_OFFLOAD, OFFLOAD = "no offload", "offload_optimizer: cpu"
ZERO = {NO_OFFLOAD: {"stage": 1}, OFFLOAD: {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
# GPT-2 shapes: (vocab, sequence, width, layers, heads, batch). On the GPU ~205M params, two
# wide layers (a short compile) and a small batch: the 18 bytes/param of state dominate the
# peak without offload, offload leaves 2 bytes/param (bf16 params) plus activations on the
# device, so the planned peaks are several x apart and a budget between them has room both
# ways.
GPU_SHAPE = (50257, 512, 2048, 2, 16, 2)
CPU_SHAPE = (256, 32, 32, 1, 2, 2)
BUDGET_STEPS = 4  # under the budget: the first compiles, the loss must fall over the rest
LR = 1e-3  # one batch, repeated: AdamW at this rate lowers its loss within a few steps
WARMUP_STEPS = 2  # compiles and settles the allocator, before the timing waits
TIMED_STEPS = {True: 2, False: 5}  # of each configuration, by ctx.cpu
TRANSFER_BYTES = {True: 2**24, False: 2**30}  # per direction, by ctx.cpu
FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def is_out_of_memory(error: BaseException | None) -> bool:
    """XLA's allocation failure (RESOURCE_EXHAUSTED: Out of memory ...), also as the cause
    or context of another exception."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = f"{type(error).__name__}: {error}".lower()
        if "resource_exhausted" in text or "out of memory" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


def initialize(name: str, shape, cache_dir: str):
    """(model, optimizer, tokens, targets): the GPT-2 under `zerojax.initialize` with the
    configuration `name`, the loss fused into the program."""
    import torch

    import zerojax

    model, tokens, targets = gpt2(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = deepspeed_config(ZERO[name], cache_dir)
    model, optimizer = zerojax.initialize(model, optimizer, config=config, loss_fn=lm_loss, seed=0)
    return model, optimizer, tokens, targets


def train_step(model, optimizer, tokens, targets) -> float:
    """One ordinary torch-loop step; its loss, read on the host once the update has run."""
    import jax

    loss = model(tokens, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    value = float(loss.detach())
    jax.block_until_ready(model.engine.state.params)
    return value


# --- the children ------------------------------------------------------------------------------


def plan_child(ctx: Context, shape, cache: str) -> dict:
    """Both configurations planned; the device's memory limit, for the budget's fraction."""
    reports = {name: plan(shape, deepspeed_config(zero, cache)) for name, zero in ZERO.items()}
    fraction = next((os.environ[n] for n in FRACTION_VARIABLES if n in os.environ), "0.75")
    return {
        "num_params": reports[NO_OFFLOAD].num_params,
        "peaks": {name: report.step_peak for name, report in reports.items()},
        "no_offload_states": reports[NO_OFFLOAD].device_total,
        # Per step each gradient leaves the device once (the grads component, on the host)
        # and the new params come back (the params component, on the device).
        "gradients_out": reports[OFFLOAD]["grads"].measured,
        "params_in": reports[OFFLOAD]["params"].measured,
        "bytes_limit": (ctx.device.memory_stats() or {}).get("bytes_limit"),
        # XLA's default fraction, or what this environment set: bytes_limit's share of the
        # device's memory.
        "memory_fraction": float(fraction),
    }


def budget_child(ctx: Context, name: str, shape, cache: str) -> dict:
    """Initialize and train BUDGET_STEPS steps; an out-of-memory error is a result."""
    stage = "initialize"
    losses: list[float] = []
    error = None
    try:
        model, optimizer, tokens, targets = initialize(name, shape, cache)
        for step in range(BUDGET_STEPS):
            stage = f"step {step + 1}"
            losses.append(train_step(model, optimizer, tokens, targets))
    except Exception as exc:  # an allocation failure is what part 1 looks for
        if not is_out_of_memory(exc):
            raise
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    stats = ctx.device.memory_stats() or {}
    return {
        "out_of_memory": error is not None,
        "error": error,
        "failed_at": stage if error else None,
        "losses": losses,
        "bytes_limit": stats.get("bytes_limit"),
        "peak": ctx.peak_bytes_in_use(),
    }


def steps_child(ctx: Context, shape, cache: str) -> None:
    """Build both configurations and take WARMUP_STEPS steps of each (the compiles), wait until
    stdin is closed (the other children are done: the device and the CPUs are quiet), then
    measure the bandwidth and time the steps. Prints its results after each measurement."""
    runs = {name: initialize(name, shape, cache) for name in ZERO}
    losses = {name: [train_step(*run) for _ in range(WARMUP_STEPS)] for name, run in runs.items()}
    sys.stdin.read()  # returns when the section closes it
    result: dict = {"losses": losses, "times": {name: [] for name in runs}}
    try:
        result["bandwidth"] = transfer_bandwidth(ctx)
    except Exception as exc:  # noqa: BLE001 (reported; the step times still run)
        result["bandwidth_error"] = f"{type(exc).__name__}: {exc}"[:300]
    print(json.dumps(result), flush=True)
    for _ in range(TIMED_STEPS[ctx.cpu]):
        round_start = time.monotonic()
        for name, run in runs.items():  # interleaved
            start = time.perf_counter()
            losses[name].append(train_step(*run))
            result["times"][name].append(time.perf_counter() - start)
        print(json.dumps(result), flush=True)
        if ctx.time_left() < 2 * (time.monotonic() - round_start):
            break


def transfer_bandwidth(ctx: Context) -> dict[str, float]:
    """GB/s of `jax.device_put` between device memory and a `pinned_host` sharding, each
    direction the median of 5 after one untimed transfer, on random data."""
    import jax
    from jax.sharding import SingleDeviceSharding

    device = ctx.device
    kinds = {memory.kind for memory in device.addressable_memories()}
    if "pinned_host" not in kinds:
        raise RuntimeError(f"{device} has no pinned_host memory (memory kinds: {sorted(kinds)})")
    on_device = SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
    on_host = SingleDeviceSharding(device, memory_kind="pinned_host")
    nbytes = TRANSFER_BYTES[ctx.cpu]
    x = jax.device_put(jax.random.uniform(jax.random.key(0), (nbytes // 4,)), on_device)
    x_host = jax.block_until_ready(jax.device_put(x, on_host))
    seconds: dict[str, list[float]] = {"device -> host": [], "host -> device": []}
    for repeat in range(6):
        for direction, (source, target) in {
            "device -> host": (x, on_host),
            "host -> device": (x_host, on_device),
        }.items():
            start = time.perf_counter()
            jax.block_until_ready(jax.device_put(source, target))
            if repeat:  # the first of each is a warm-up
                seconds[direction].append(time.perf_counter() - start)
    return {d: nbytes / statistics.median(s) / GB for d, s in seconds.items()}


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", required=True, choices=["plan", "budget", "steps"])
    parser.add_argument("--config", choices=list(ZERO), help="--child budget: which one")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)
    prepare_environment(args.cpu)
    ctx = Context(cpu=args.cpu, deadline=time.monotonic() + args.seconds, scratch_dir=args.cache)
    shape = CPU_SHAPE if args.cpu else GPU_SHAPE
    if args.child == "plan":
        print(json.dumps(plan_child(ctx, shape, args.cache)), flush=True)
    elif args.child == "budget":
        print(json.dumps(budget_child(ctx, args.config, shape, args.cache)), flush=True)
    else:
        steps_child(ctx, shape, args.cache)
    return 0


# --- the section -------------------------------------------------------------------------------


def budget_env(planned: dict, budget: int) -> dict[str, str]:
    """The environment that gives a child's JAX exactly `budget` bytes of device memory: it
    preallocates that fraction of the device's memory, and the BFC allocator never grows past
    what it preallocated."""
    total = planned["bytes_limit"] / planned["memory_fraction"]
    # The current name (jaxlib >= 0.10) alone: the older one beside it is an error.
    env = {k: v for k, v in os.environ.items() if k not in FRACTION_VARIABLES}
    env.update(
        XLA_PYTHON_CLIENT_ALLOCATOR="bfc",
        XLA_PYTHON_CLIENT_PREALLOCATE="true",
        XLA_CLIENT_MEM_FRACTION=f"{budget / total:.5f}",
    )
    return env


def run(ctx: Context, report: SectionReport) -> None:
    started = time.monotonic()
    deadline = started + max(10.0, ctx.time_left() - 5)  # 5 s left to write the report
    cache = os.path.join(ctx.scratch_dir, "offload_jax_cache")
    common = ["-m", "tools.gpu_check.offload", "--cache", cache]
    common += ["--seconds", f"{deadline - started:.0f}"] + (["--cpu"] if ctx.cpu else [])

    def start(child: str, *more: str, env=None, stdin=subprocess.DEVNULL):
        return start_child([*common, "--child", child, *more], env, stdin=stdin)

    # The planning and the step timing's setup start at once; on the CPU, where no budget is
    # enforced, the offloaded run too.
    planning = start("plan")
    timing = start("steps", stdin=subprocess.PIPE)
    budget_runs = {OFFLOAD: start("budget", "--config", OFFLOAD)} if ctx.cpu else {}
    planned = collect_child("plan", planning, deadline)
    print(f"offload: planned at {time.monotonic() - started:.1f} s", flush=True)

    shape = CPU_SHAPE if ctx.cpu else GPU_SHAPE
    vocab, sequence, width, layers, _, batch = shape
    model_text = (
        f"GPT-2-style ({layers} layers, width {width}, vocabulary {vocab}, "
        f"{planned.get('num_params', 0) / 1e6:.3g}M params), batch {batch} x {sequence} "
        f"tokens, bf16 compute + fp32 master/grads/AdamW, ZeRO-1, 1 device"
    )
    if "peaks" in planned:
        peaks = planned["peaks"]
        budget, budget_reason = choose_budget(planned)
        if not ctx.cpu:
            env = budget_env(planned, budget)
            budget_runs = {name: start("budget", "--config", name, env=env) for name in ZERO}
        results = {name: collect_child(name, p, deadline) for name, p in budget_runs.items()}
        print(f"offload: budget runs done at {time.monotonic() - started:.1f} s", flush=True)
        budget_results(ctx, report, model_text, peaks, (budget, budget_reason), results)
    else:
        for name, process in budget_runs.items():
            collect_child(name, process, time.monotonic())  # stops it
        why = planned.get("error", "?")
        if planned.get("timed_out"):
            report.notes.append(f"the budget runs skipped: the plan did not finish ({why})")
        else:
            report.check("planned with and without offload", False, why)

    timed = collect_child("steps", timing, deadline)  # closing its stdin starts the timing
    print(f"offload: steps timed at {time.monotonic() - started:.1f} s", flush=True)
    step_results(ctx, report, model_text, planned, timed)


def choose_budget(planned: dict) -> tuple[int, str]:
    """(device bytes both budget runs get, why that many).

    Without offload the update program's arguments (params, master weights, optimizer state,
    gradients: the planned device states, exact) are in device memory at once, whatever the
    activations: 95% of them cannot fit. That leaves the offloaded run the most room above its
    planned peak, the one uncertain figure (its in-flight transfers, activations, allocator
    fragmentation in a fixed pool). Where that room would be under 20%, the geometric mean of
    the two planned peaks instead: the same factor of room on both sides of the plan."""
    peaks = planned["peaks"]
    below_states = int(0.95 * planned["no_offload_states"])
    if below_states > 1.2 * peaks[OFFLOAD]:
        return below_states, "95% of the states the run without offload holds at once"
    mean = int(math.sqrt(peaks[NO_OFFLOAD] * peaks[OFFLOAD]))
    return mean, "the geometric mean of the planned peaks"


def budget_results(ctx, report, model_text, peaks, budget_and_reason, results) -> None:
    """Part 1's table and checks from the budget runs: each is budget_child's dict, or
    collect_child's {"error": ...} for a child that crashed or ran out of time."""
    budget, reason = budget_and_reason
    budget_text = f"{budget / GB:.4g} GB"
    table = report.table(
        f"Training under a device-memory budget between the two planned peaks: {model_text}. "
        f"Planned: `zerojax.memory_report(abstract=True)` step peak; each run in a child "
        f"process whose JAX preallocates only the budget ({budget_text}: {reason})"
        f"{'; NOT ENFORCED on the CPU' if ctx.cpu else ''}. GB = 1e9 bytes",
        ["config", "planned peak GB", "budget GB", "child's JAX limit GB", "outcome"]
        + ["measured peak GB", "losses"],
    )
    for name, peak in peaks.items():
        result = results.get(name)
        row = [name, peak / GB, budget / GB]
        if result is None:
            table.add(*row, None, "planned only (CPU)", None, "")
        elif "out_of_memory" not in result:
            table.add(*row, None, f"failed: {result['error']}", None, "")
        else:
            limit, measured = result["bytes_limit"], result["peak"]
            outcome = (
                f"out of memory at {result['failed_at']}: {result['error'][:160]}"
                if result["out_of_memory"]
                else f"trained {len(result['losses'])} steps"
            )
            table.add(
                *row,
                limit / GB if limit else "n/a",
                outcome,
                measured / GB if measured else "n/a",
                ", ".join(f"{x:.4f}" for x in result["losses"]),
            )
        if result is not None and result.get("timed_out"):  # out of time: a skip, no verdict
            report.notes.append(f"{name} under the budget: skipped, {result['error']}")

    no_offload = results.get(NO_OFFLOAD)
    if no_offload is None:
        report.notes.append(
            f"CPU: the out-of-memory demonstration is planned only (the CPU backend enforces no "
            f"memory fraction): planned peak {peaks[NO_OFFLOAD] / GB:.4g} GB without offload, "
            f"{peaks[OFFLOAD] / GB:.4g} GB with, budget {budget_text}; the offloaded run "
            f"trained without a budget"
        )
    elif not no_offload.get("timed_out"):
        if no_offload.get("out_of_memory"):
            outcome = f"out of memory at {no_offload['failed_at']}"
        elif "out_of_memory" in no_offload:
            outcome = f"it trained, losses {no_offload['losses']}, peak {no_offload['peak']} B"
        else:
            outcome = f"it failed otherwise: {no_offload['error']}"
        report.check(
            "without offload the model does not fit the budget",
            bool(no_offload.get("out_of_memory")),
            f"the run under {budget_text} (planned peak {peaks[NO_OFFLOAD] / GB:.4g} GB) must "
            f"fail allocating: {outcome}",
        )

    offload = results.get(OFFLOAD, {})
    if offload.get("timed_out"):
        return
    losses = offload.get("losses") or []
    trained = (
        offload.get("out_of_memory") is False
        and len(losses) == BUDGET_STEPS
        and all(math.isfinite(x) for x in losses)
        and losses[-1] < losses[0]
    )
    report.check(
        "with optimizer offload the model trains in the budget",
        trained,
        f"{BUDGET_STEPS} steps under {'no budget (CPU)' if ctx.cpu else budget_text} (planned "
        f"peak {peaks[OFFLOAD] / GB:.4g} GB), every loss finite and the last below the first "
        f"(one batch repeated, lr {LR}): losses {losses}"
        + (f"; {offload['error']}" if offload.get("error") else ""),
    )


def step_results(ctx, report, model_text, planned: dict, timed: dict) -> None:
    """Part 2's tables from the timing child's (possibly partial) results."""
    times = timed.get("times", {})
    done = min((len(values) for values in times.values()), default=0)
    if not done:  # a crash of training itself fails part 1's check; here it is a note
        why = timed.get("error", "no step timed")
        report.notes.append(f"step times with and without offload not measured: {why}")
    else:
        median = {name: statistics.median(values[:done]) for name, values in times.items()}
        table = report.table(
            f"Step time with and without optimizer offload: {model_text}; the whole device, "
            f"medians of {done} steps (after {WARMUP_STEPS} untimed), interleaved; a step = "
            f"forward + backward + AdamW update + the loss read on the host",
            ["config", "median step ms", "min step ms", "vs no offload", "losses"],
        )
        for name, values in times.items():
            table.add(
                name,
                median[name] * 1e3,
                min(values[:done]) * 1e3,
                median[name] / median[NO_OFFLOAD],
                ", ".join(f"{x:.4f}" for x in timed["losses"][name]),
            )
        pairs = list(zip(*(timed["losses"][name] for name in ZERO)))
        difference = max(abs(a - b) for a, b in pairs)
        report.target(
            "offloaded losses equal those without offload",
            difference == 0,
            f"largest |difference| over {len(pairs)} steps: {difference:.3g} (docs/offload.md: "
            f"bitwise equal on CPU; on a GPU the host update is XLA's host code, whose rounding "
            f"was never compared with the device's)",
        )
    bandwidth = timed.get("bandwidth")
    if timed.get("bandwidth_error"):
        report.notes.append(f"host<->device bandwidth not measured: {timed['bandwidth_error']}")
    if not bandwidth or "gradients_out" not in planned:
        return
    crossing = {
        "device -> host": ("gradients out", planned["gradients_out"]),
        "host -> device": ("new params in", planned["params_in"]),
    }
    table = report.table(
        f"Host<->device transfers of the offloaded step against the measured bandwidth: bytes "
        f"per step from the offload plan (gradients out in their accumulation dtype, new params "
        f"in theirs); bandwidth = `jax.device_put` of {TRANSFER_BYTES[ctx.cpu] / 2**20:.0f} MiB "
        f"to / from a pinned_host sharding, median of 5; share = transfer time / the offloaded "
        f"step's median time, were nothing overlapped"
        + (" (CPU: host and device are one memory, these are copies in RAM)" if ctx.cpu else ""),
        ["direction", "what", "bytes per step", "GB/s measured", "ms at that rate"]
        + ["share of step"],
    )
    step_seconds = statistics.median(times[OFFLOAD][:done]) if done else None
    for direction, (what, nbytes) in crossing.items():
        seconds = nbytes / GB / bandwidth[direction]
        share = seconds / step_seconds if step_seconds else None
        table.add(direction, what, nbytes, bandwidth[direction], seconds * 1e3, share)


if __name__ == "__main__":
    sys.exit(child_main())
