"""Restart time: from a fresh process's start to its first training step after a restore, with
a warm compilation cache, each part measured (issue 44's "restarts in seconds").

The bench's GPT-2 (bench/checkpoint.py: 35.8M params, AdamW, ZeRO-3 on 8 simulated CPU
devices). One cold child process runs two steps, saves a checkpoint and fills the persistent
compilation cache (and zerojax's capture cache inside it); then `--restarts` warm children, one
after another, each do what a restarted job does: import, build the model and optimizer,
`zerojax.initialize`, `Checkpointer.restore()`, one training step (capture and compile from
the caches, then the step itself; the update program is loaded from zerojax's program cache,
not traced), and a second step for reference. Each child reports wall
times from the OS's start of the process (Linux /proc), and its effective-time ledger (init,
trace_compile, checkpoint_restore) with the goodput terms (`zerojax.runtime.effective_time`).
One process: no `jax.distributed` join (bench/multiprocess.py measures restarts under
torchrun). The first step's parts are the ledger's trace_compile records by source: in a warm
restart all of them fall in the first step; in the cold run they also count the second step's
compiles, so its "rest" is approximate.

Run: .venv/bin/python bench/effective_time_restart.py [--restarts 3] [--dir /tmp/somewhere]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PARTS = (
    ("interpreter start -> first line of the script", "script_start"),
    ("import torch", "import_torch"),
    ("import jax, zerojax (+ bench model code)", "import_zerojax"),
    ("build the torch model + AdamW", "build"),
    ("`zerojax.initialize`", "initialize"),
    ("`Checkpointer.restore()` (manifest checked)", "restore"),
    ("first step: capture + compile (caches) + run", "first_step"),
)


FIRST_STEP_PARTS = (
    ("torch.export", "torch.export (runs every time: no key can list what the model code reads)"),
    ("jaxpr_trace_duration", "JAX tracing of the programs"),
    ("jaxpr_to_mlir_module_duration", "lowering"),
    ("backend_compile_duration", "compile, or load from the persistent cache"),
    ("program_cache_load", "read programs from the program cache (instead of tracing them)"),
)


def med_part(runs: list[dict], source: str) -> float:
    return statistics.median(r["compile_by_source"].get(source, 0.0) for r in runs)


def child(directory: Path, cold: bool) -> None:
    start = time.time()
    import torch

    after_torch = time.time()
    sys.path.insert(0, str(REPO))
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    import torch.nn.functional as F

    import zerojax
    from bench.architectures import GPT2
    from bench.checkpoint import gpt2_config
    from zerojax.ckpt import Checkpointer
    from zerojax.runtime.effective_time import LEDGER, _process_start_time, goodput

    after_import = time.time()
    log = directory / f"ett-{os.getpid()}.jsonl"
    config = gpt2_config(quick=False)
    torch.manual_seed(1)
    model = GPT2(config)
    model.eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    after_build = time.time()
    model, optimizer = zerojax.initialize(
        model,
        optimizer,
        config={
            "mesh": {"fsdp": 8},
            "zero": {"stage": 3},
            "runtime": {
                "compilation_cache_dir": str(directory / "cache"),
                "effective_time_log": str(log),
            },
        },
    )
    after_init = time.time()
    ckpt = Checkpointer(directory / "ckpt", model, optimizer, max_to_keep=None)
    if not cold:
        ckpt.restore()
    after_restore = time.time()
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (8, config.max_seq_len))
    targets = torch.roll(tokens, -1, dims=1)

    def step() -> float:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.item())

    step()
    after_first = time.time()
    step()
    after_second = time.time()
    if cold:
        ckpt.save(1, force=True)
    ckpt.close()
    started = _process_start_time() or start
    summary = LEDGER.summary()
    compile_by_source: dict[str, float] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "trace_compile":
            source = record.get("source", "?")
            compile_by_source[source] = compile_by_source.get(source, 0.0) + record["seconds"]
    print(
        "RESULT "
        + json.dumps(
            {
                "script_start": start - started,
                "import_torch": after_torch - start,
                "import_zerojax": after_import - after_torch,
                "build": after_build - after_import,
                "initialize": after_init - after_build,
                "restore": after_restore - after_init,
                "first_step": after_first - after_restore,
                "to_first_step": after_first - started,
                "second_step": after_second - after_first,
                "ledger": summary,
                "compile_by_source": compile_by_source,
                "goodput": goodput(summary),
            }
        ),
        flush=True,
    )


def run_child(directory: Path, cold: bool) -> dict:
    argv = [sys.executable, __file__, "--child", str(directory)] + (["--cold"] if cold else [])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"{shlex.join(argv)} failed:\n{out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--dir", help="checkpoint + caches (default: a temp dir, deleted)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        child(Path(options.child), options.cold)
        return
    python = (
        os.path.relpath(sys.executable)
        if sys.executable.startswith(os.getcwd())
        else (sys.executable)
    )
    print(f"Command: {shlex.join([python, *sys.argv])}")
    load_start = os.getloadavg()
    root = Path(options.dir or tempfile.mkdtemp(prefix="zerojax-bench-restart-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        print("  cold run (fills the caches, saves step 1) ...", file=sys.stderr, flush=True)
        cold = run_child(root, cold=True)
        warm = []
        for i in range(options.restarts):
            print(f"  restart {i + 1}/{options.restarts} ...", file=sys.stderr, flush=True)
            warm.append(run_child(root, cold=False))
    finally:
        if not options.dir:
            shutil.rmtree(root, ignore_errors=True)
    med = lambda key, runs=warm: statistics.median(r[key] for r in runs)
    print(f"\n## Restart to first step, warm caches (median of {options.restarts} restarts)\n")
    print("| part | warm restart (s) | cold first run (s) |\n|---|---|---|")
    for name, key in PARTS:
        print(f"| {name} | {med(key):.2f} | {cold[key]:.2f} |")
    # The first step's parts: the ledger's trace_compile by source, and the rest (the step's
    # own run, capture's work around torch.export, placing the inputs, the torch front end).
    for source, label in FIRST_STEP_PARTS:
        print(f"| - {label} | {med_part(warm, source):.2f} | {med_part([cold], source):.2f} |")
    rest = lambda runs: statistics.median(
        r["first_step"] - sum(r["compile_by_source"].get(s, 0.0) for s, _ in FIRST_STEP_PARTS)
        for r in runs
    )
    print(
        f"| - the rest: the step's run, capture around torch.export, inputs | {rest(warm):.2f} "
        f"| {rest([cold]):.2f} |"
    )
    print(
        f"| **process start -> first step done** | **{med('to_first_step'):.2f}** "
        f"| {cold['to_first_step']:.2f} |"
    )
    print(
        f"| (second step, for reference) | {med('second_step'):.2f} | {cold['second_step']:.2f} |"
    )
    ledger = lambda key: statistics.median(r["ledger"][key] for r in warm)
    terms = {k: statistics.median(r["goodput"][k] for r in warm) for k in ("scheduling", "runtime")}
    sources = sorted({s for r in warm for s in r["compile_by_source"]})
    by_source = ", ".join(
        f"{s} {statistics.median(r['compile_by_source'].get(s, 0.0) for r in warm):.2f} s"
        for s in sources
    )
    print(
        f"\nThe restarted processes' effective-time ledgers (medians): init {ledger('init'):.2f} s, "
        f"trace_compile {ledger('trace_compile'):.2f} s (capture + JAX tracing/lowering + "
        f"compile-or-load, on the loop's thread), checkpoint_restore "
        f"{ledger('checkpoint_restore'):.2f} s; trace_compile by source: {by_source}; in goodput terms these are runtime badput "
        f"(runtime goodput {100 * terms['runtime']:.1f} % of a two-step process; scheduling "
        f"{100 * terms['scheduling']:.1f} %: one process, no time between attempts). Load "
        f"average at start {' / '.join(f'{x:.2f}' for x in load_start)}, at end "
        f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs."
    )


if __name__ == "__main__":
    main()
