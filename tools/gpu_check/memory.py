"""The "memory" section: zerojax's planned per-device step peak against the peak a real
training step reaches on the device.

A GPT-2-style model (bench/architectures.py's `GPT2`, the loss fused into the program through
`loss_fn`), bf16 compute with fp32 master weights, gradients and AdamW moments (DeepSpeed's
`bf16: {enabled: true}`), on one device, in three configurations (CONFIGS): ZeRO-0, ZeRO-0
with every block checkpointed (`activation_checkpointing.modules`), and ZeRO-1 with
`offload_optimizer: {device: cpu}` (optimizer state, master weights and gradients in pinned
host memory, the update computed there; docs/offload.md).

- **planned**: `zerojax.memory_report(model on meta, args, config, abstract=True)`, what
  `zerojax plan` prints: the step's programs compiled for the process's own device (the GPU
  here, with shapes and shardings only, nothing allocated) and their `memory_analysis()`, plus
  the state each program leaves resident beside it (`MemoryReport.step_peak`).
- **measured**: JAX's `peak_bytes_in_use` on the device after a few real steps
  (`zerojax.initialize`, `loss.backward()`, `optimizer.step()`, `zero_grad()`).

The high-water mark cannot be reset within a process, so each configuration runs in a fresh
child process (`python -m tools.gpu_check.memory --child NAME`, printing JSON lines): it
trains first, reads the peak, and only then plans, so that the plan's compile cannot raise
the peak it is compared with. The children run side by side: each has its own allocator, so
one's peak does not count another's memory.

On the CPU the backend keeps no memory statistics: the plan is reported, the measurement 'n/a'.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from tools.gpu_check.context import Context, prepare_environment
from tools.gpu_check.report import SectionReport

GB = 1e9  # decimal, as DeepSpeed and `zerojax plan` report
STEPS = 3  # the first compiles; the later ones reach the steady-state peak

CHECKPOINT_BLOCKS = {"modules": {r"blocks\.\d+": "full"}}
CONFIGS = {
    # name -> (zero_optimization, the `zerojax` section's activation_checkpointing or None)
    "ZeRO-0": ({"stage": 0}, None),
    "ZeRO-0 + activation checkpointing": ({"stage": 0}, CHECKPOINT_BLOCKS),
    # Offload needs stage >= 1 (each rank offloads its own shard); on one device stage 1 holds
    # the same bytes as stage 0.
    "ZeRO-1 + offload_optimizer: cpu": ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, None),
}

# GPT-2 shapes: (vocab, sequence, width, layers, heads, batch). On the GPU ~306M params,
# wide rather than deep (4 layers of width 2048): an XLA compile grows with the number of
# layers, and each child compiles the step twice (training, then the plan), while activations
# (batch 4 x 1024 tokens) and states (18 bytes/param) are both gigabytes.
GPU_SHAPE = (50257, 1024, 2048, 4, 16, 4)
CPU_SHAPE = (256, 32, 32, 1, 2, 2)

# measured / planned peak: the plan is XLA's own buffer assignment of each program plus the
# state resident beside it, so it should miss only what no program holds: the batch and rng
# arrays, transient copies while `initialize` places the state, and the allocator's rounding
# (256-byte granules); on a GPU also the autotuner's trial buffers while the first step
# compiles, when the state is resident but no activations are. 10% covers those with room;
# below 0.95 the plan counts buffers that are never live at once. Never compared on a GPU
# before this check: a target, not a check.
RATIO_TARGET = (0.95, 1.10)


def deepspeed_config(
    zero: Mapping, cache_dir: str | None, checkpointing: Mapping | None = None
) -> dict:
    """A DeepSpeed-style config (zerojax's native sections under `zerojax`): bf16 compute with
    fp32 master weights, gradients and Adam moments; `zero` is its `zero_optimization`."""
    native: dict = {"runtime": {"compilation_cache_dir": cache_dir, "report_effective_time": False}}
    if checkpointing:
        native["activation_checkpointing"] = checkpointing
    return {"zero_optimization": zero, "bf16": {"enabled": True}, "zerojax": native}


def lm_loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt2(shape: Sequence[int]):
    """(model, tokens, targets) of the given shape, seeded, dropout off (so that every run of a
    configuration does the same arithmetic); the model honours an enclosing
    `torch.device("meta")`."""
    import torch

    from bench.architectures import GPT2, GPT2Config

    vocab, sequence, width, layers, heads, batch = shape
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab,
        max_seq_len=sequence,
        width=width,
        num_layers=layers,
        num_heads=heads,
        dropout=0.0,
    )
    model = GPT2(config)
    # Drawn on the CPU even under "meta" (the generator's device).
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, sequence), generator=generator, device="cpu")
    return model, tokens, torch.roll(tokens, -1, dims=1)


def plan(shape: Sequence[int], config: Mapping):
    """`zerojax.memory_report` as `zerojax plan --devices` runs it: the model on the meta
    device, the step compiled for this process's devices and never run. The config's
    persistent compilation cache is switched on as `zerojax.initialize` does (memory_report
    leaves it alone): the optimizer update, the one program plan and training share, then
    compiles once."""
    import torch

    import zerojax
    from zerojax.runtime.compilation_cache import enable_compilation_cache

    enable_compilation_cache(zerojax.load_config(config).runtime.compilation_cache_dir)

    with torch.device("meta"):
        model, tokens, targets = gpt2(shape)
    args = (tokens.to("meta"), targets.to("meta"))  # the model's device: shapes alone
    return zerojax.memory_report(model, args, config, loss_fn=lm_loss, abstract=True)


def state_bytes(engine) -> dict[str, int]:
    """Bytes one device holds of each state component of a live engine (device or host
    memory alike), named as `MemoryReport` names them."""
    from zerojax.sharding.memory import measured_bytes_per_device

    state = engine.state
    return {
        "params": measured_bytes_per_device(state.params),
        "opt_state": measured_bytes_per_device(state.opt_state),
        "master_weights": measured_bytes_per_device(state.master or {}),
    }


def device_resident_bytes(engine) -> int:
    """Bytes of params, master weights and optimizer state one device holds in its own
    memory (offloaded arrays, in pinned host memory, left out)."""
    import jax

    from zerojax.sharding.memory import measured_bytes_per_device

    state = engine.state
    leaves = jax.tree.leaves((state.params, state.master or {}, state.opt_state))
    return measured_bytes_per_device(
        [x for x in leaves if getattr(x.sharding, "memory_kind", None) != "pinned_host"]
    )


# --- the child process: one configuration --------------------------------------------------------


def measure(name: str, shape: Sequence[int], cache_dir: str, ctx: Context) -> None:
    """Train STEPS steps of one configuration and read the device's peak, then plan it if the
    time left allows: prints a JSON line after each (the last is the result; a child stopped
    while planning still leaves its measurement)."""
    import jax
    import torch

    import zerojax

    started = time.monotonic()
    zero, checkpointing = CONFIGS[name]
    config = deepspeed_config(zero, cache_dir, checkpointing)
    model, tokens, targets = gpt2(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = zerojax.initialize(model, optimizer, config=config, loss_fn=lm_loss, seed=0)
    engine = model.engine
    losses = []
    for _ in range(STEPS):
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))  # a host sync: the step has run
    jax.block_until_ready(engine.state.params)
    result: dict = {
        "losses": losses,
        "measured_peak": ctx.peak_bytes_in_use(),
        "bytes_in_use_after_steps": (ctx.device.memory_stats() or {}).get("bytes_in_use"),
        "live_state": state_bytes(engine),
        "live_device_resident": device_resident_bytes(engine),
        "compiled_for": f"{jax.default_backend()}: {ctx.device.device_kind}",
    }
    del model, optimizer, engine
    print(json.dumps(result), flush=True)
    trained = time.monotonic() - started
    # The plan captures and compiles the step again: about what training took.
    if ctx.time_left() < trained:
        result["plan_skipped"] = f"{ctx.time_left():.0f} s left, training took {trained:.0f} s"
        print(json.dumps(result), flush=True)
        return
    report = plan(shape, config)
    print(
        f"{name}: trained in {trained:.1f} s, planned in {time.monotonic() - started - trained:.1f} s",
        file=sys.stderr,
    )
    result["num_params"] = report.num_params
    result["planned"] = {
        "step_peak": report.step_peak,
        # Params, master weights and optimizer state (the gradients live only within a step).
        **{
            f"{where}_states": sum(
                c.measured for c in report.components if c.name != "grads" and c.host == host
            )
            for where, host in (("device", False), ("host", True))
        },
        "host_step_peak": report.host_step_peak,
        "components": {c.name: {"bytes": c.measured, "host": c.host} for c in report.components},
    }
    print(json.dumps(result), flush=True)


def child_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", required=True, choices=list(CONFIGS))
    parser.add_argument("--cache", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)
    prepare_environment(args.cpu)
    ctx = Context(cpu=args.cpu, deadline=time.monotonic() + args.seconds, scratch_dir=args.cache)
    measure(args.child, CPU_SHAPE if args.cpu else GPU_SHAPE, args.cache, ctx)
    return 0


# --- child processes, run side by side ------------------------------------------------------------


_RUNNING: set[subprocess.Popen] = set()


@atexit.register
def _stop_running_children() -> None:
    """A section stopped by the runner (SIGTERM exits through atexit) must not leave children
    running on the device into the next section's measurements."""
    for process in _RUNNING:
        process.kill()


def start_child(
    command: list[str], env: Mapping[str, str] | None = None, *, stdin=subprocess.DEVNULL
) -> subprocess.Popen:
    """`python *command` in its own process (`env`: its whole environment, default this
    process's), its output kept for `collect_child`; `stdin=subprocess.PIPE` lets a child wait
    for `collect_child`, which closes it."""
    process = subprocess.Popen(
        [sys.executable, *command],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ if env is None else env),
    )
    _RUNNING.add(process)
    return process


def collect_child(name: str, process: subprocess.Popen, deadline: float) -> dict:
    """The last JSON object the child printed on a line of its own (what it had when it
    stopped), with "error" added when it failed and "timed_out" when it was still running at
    `deadline` (`time.monotonic()`; it is then killed). Its stderr goes to this process's
    output (the section's log)."""
    timed_out = False
    try:
        out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        timed_out = True
    _RUNNING.discard(process)
    status = "killed at its deadline" if timed_out else f"exit {process.returncode}"
    print(f"--- child {name}: {status}, stderr tail:\n{err[-4000:]}", flush=True)
    printed = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    result = printed[-1] if printed else {}
    if timed_out:
        result.update(error="not finished by the section's deadline (killed)", timed_out=True)
    elif process.returncode or not printed:
        last = (err.strip().splitlines() or ["(no output)"])[-1]
        result["error"] = f"exit status {process.returncode}: {last[:300]}"
    return result


def run_children(commands: Mapping[str, list[str]], deadline: float) -> dict[str, dict]:
    """Every command started at once, each collected as `collect_child` does."""
    processes = {name: start_child(command) for name, command in commands.items()}
    return {name: collect_child(name, process, deadline) for name, process in processes.items()}


# --- the section ----------------------------------------------------------------------------------


def run(ctx: Context, report: SectionReport) -> None:
    cache = os.path.join(ctx.scratch_dir, "memory_jax_cache")
    seconds = max(10.0, ctx.time_left() - 5)  # 5 s left to write the report
    deadline = time.monotonic() + seconds
    cpu = ["--cpu"] if ctx.cpu else []
    commands = {
        name: ["-m", "tools.gpu_check.memory", "--child", name, "--cache", cache]
        + ["--seconds", f"{seconds:.0f}", *cpu]
        for name in CONFIGS
    }
    report_results(report, run_children(commands, deadline), cpu=ctx.cpu)


def report_results(report: SectionReport, results: Mapping[str, dict], *, cpu: bool) -> None:
    """The table, checks and targets from each configuration's child: `measure`'s last JSON
    line, with "error" / "timed_out" where `collect_child` added them."""
    shape = CPU_SHAPE if cpu else GPU_SHAPE
    vocab, sequence, width, layers, _, batch = shape
    first = next((r for r in results.values() if "num_params" in r), {})
    table = report.table(
        f"Planned vs measured device peak per training step: GPT-2-style ({layers} layers, width "
        f"{width}, vocabulary {vocab}, {first.get('num_params', 0) / 1e6:.3g}M params), batch "
        f"{batch} x {sequence} tokens, bf16 compute + fp32 master/grads/AdamW, 1 device. Planned: "
        f"`zerojax.memory_report(abstract=True)` (`MemoryReport.step_peak`); measured: JAX's "
        f"peak_bytes_in_use after {STEPS} steps, each configuration in a fresh process. GB = 1e9 "
        f"bytes; states = params + master weights + optimizer state of one device, in its own "
        f"memory (planned; live: the arrays after the steps) or its host's (offloaded); 'in "
        f"use' = JAX's bytes_in_use after the steps",
        [
            "config",
            "planned peak GB",
            "measured peak GB",
            "measured / planned",
            "planned device states GB",
            "live device-resident states GB",
            "host states GB",
            "measured in use after steps GB",
            "loss first -> last",
        ],
    )
    for name, result in results.items():
        measured = result.get("measured_peak")
        if "planned" not in result:
            # Out of time (killed, or the plan left out) is a skip; anything else a failure.
            why = result.get("plan_skipped") or result.get("error", "?")
            in_use = result.get("bytes_in_use_after_steps")
            resident = result.get("live_device_resident")
            table.add(
                name,
                None,
                measured / GB if measured else "n/a",
                None,
                None,
                resident / GB if resident is not None else None,
                None,
                in_use / GB if in_use else "n/a",
                f"no plan: {why}",
            )
            if result.get("timed_out") or "plan_skipped" in result:
                report.notes.append(f"{name}: not planned for lack of time ({why})")
            else:
                report.check(f"{name}: planned and measured", False, why)
            continue
        planned = result["planned"]
        ratio = measured / planned["step_peak"] if measured and planned["step_peak"] else None
        in_use = result["bytes_in_use_after_steps"]
        losses = result["losses"]
        table.add(
            name,
            planned["step_peak"] / GB,
            measured / GB if measured else "n/a",
            ratio if ratio is not None else "n/a",
            planned["device_states"] / GB,
            result["live_device_resident"] / GB,
            planned["host_states"] / GB,
            in_use / GB if in_use else "n/a",
            f"{losses[0]:.4f} -> {losses[-1]:.4f}",
        )
        report.check(
            f"{name}: planned and measured",
            planned["step_peak"] > 0 and (cpu or (measured or 0) > 0),
            f"planned peak {planned['step_peak']:,} B (compiled for {result['compiled_for']}), "
            f"measured peak {measured if measured is not None else 'n/a (the CPU keeps no statistics)'}"
            f"; both must be there and positive",
        )
        # Component bytes are shape x itemsize on each component's sharding, the same for the
        # abstract plan and the live arrays: any difference is a planning bug, so no tolerance.
        differing = {
            component: (result["live_state"][component], planned["components"][component]["bytes"])
            for component in result["live_state"]
            if result["live_state"][component] != planned["components"][component]["bytes"]
        }
        if result["live_device_resident"] != planned["device_states"]:
            differing["in device memory"] = (
                result["live_device_resident"],
                planned["device_states"],
            )
        report.check(
            f"{name}: planned state bytes = the live arrays' bytes",
            not differing,
            "params, master weights, optimizer state per device, and of them in device memory: "
            + (
                f"differ (live, planned): {differing}"
                if differing
                else ", ".join(f"{c} {b:,} B" for c, b in result["live_state"].items())
                + f"; in device memory {planned['device_states']:,} B (exact: both are shape x "
                f"itemsize on the same shardings and memory kinds)"
            ),
        )
        if ratio is not None:
            low, high = RATIO_TARGET
            report.target(
                f"{name}: planned peak within {low}-{high}x of the measured one",
                low <= ratio <= high,
                f"measured / planned = {ratio:.3f} (measured {measured / GB:.3f} GB, planned "
                f"{planned['step_peak'] / GB:.3f} GB); the bound allows for the batch, the rng, "
                f"transient copies at initialize, allocator rounding and the autotuner's trial "
                f"buffers, which no program holds",
            )
    if cpu:
        report.notes.append(
            "CPU: the backend keeps no memory statistics (peak_bytes_in_use is None), so only "
            "the plan is reported; tiny shapes, numbers meaningless"
        )
    compiled_for = {r["compiled_for"] for r in results.values() if "compiled_for" in r}
    report.notes.append(
        f"the plan compiled the step for {', '.join(sorted(compiled_for)) or '?'}: the "
        f"process's own device, from abstract arrays, after the training steps (a compile of "
        f"its own: the plan's program, captured from the meta-device model, differs from the "
        f"training one, so the persistent compilation cache does not carry it over)"
    )


if __name__ == "__main__":
    sys.exit(child_main())
