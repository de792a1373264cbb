"""The `zerojax` command.

    zerojax plan --config mesh.yaml MODULE:FACTORY [--devices N] [--plot FILE.png] [--describe] [--json]
    zerojax ckpt inspect DIR [--step S] [--json]
    zerojax ckpt export DIR [--step S] --format safetensors|torch OUT [--dtype D] [--quiet]
    zerojax ckpt import FILE DIR [--step S]
    zerojax ett LOG [--json]

`plan` converts the model FACTORY builds, places its training state the way the config says,
and prints per-device bytes of params, gradients, optimizer state and master weights measured
from the sharded arrays beside the ZeRO formula, plus the compiled step's memory_analysis().

FACTORY is a zero-argument callable returning `(module, example_args)` -- a torch.nn.Module and
a tuple of example inputs, batch dim first -- or `(module, example_args, loss_fn)` with
`loss_fn(outputs, batch) -> scalar` on JAX arrays. Name it as `package.module:name` (imported,
the current directory on sys.path) or `path/to/file.py:name` (loaded from the file). Every
factory in bench/architectures.py fits: `zerojax plan --config examples/zero3.yaml
bench/architectures.py:gpt2_bench_model`.

`devices.num_cpu_devices` in the config is applied before JAX starts its backends, so an 8-way
mesh can be rehearsed on a laptop. With `--devices N` nothing is allocated: the factory runs
under `torch.device("meta")`, the mesh is resolved for N devices (simulated CPU devices), and
the training step is compiled for them from shapes and shardings alone, never run; the bytes
are those the real arrays would take (tests/sharding/test_memory.py compares the two), so a
7B model's plan for 64 devices runs on a laptop.

`ckpt` reads and converts checkpoints (`zerojax.ckpt`): `inspect` lists steps and, for one
step, every entry's shape, dtypes and bytes from metadata alone; `export` writes the model as
one safetensors or torch file, streaming one tensor at a time; `import` turns a torch or
safetensors state_dict into a checkpoint step any mesh can restore.

`ett` accounts for a job's effective training time from the log files of
`runtime.effective_time_log` (LOG is that path; the per-rank files beside it are found): every
rank and every restart, with what each restart cost (zerojax/runtime/job_time.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["load_factory", "main", "plot_stages"]


class CLIError(Exception):
    """A user mistake on the command line; printed without a traceback."""


def load_factory(spec: str) -> Callable[[], Any]:
    """`package.module:name` or `path/to/file.py:name` -> the callable it names."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise CLIError(
            f"FACTORY={spec!r}: expected MODULE:NAME (bench.architectures:gpt2) or "
            "FILE.py:NAME (bench/architectures.py:gpt2)"
        )
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise CLIError(f"FACTORY={spec!r}: no such file {str(path)!r}")
        module_spec = importlib.util.spec_from_file_location(f"_zerojax_factory_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # dataclasses need their module registered
        module_spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise CLIError(f"FACTORY={spec!r}: cannot import {target!r}: {exc}") from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise CLIError(f"FACTORY={spec!r}: {target!r} has no callable named {name!r}")
    return factory


def _build(factory: Callable[[], Any], spec: str):
    built = factory()
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise CLIError(
            f"FACTORY={spec!r} returned {type(built).__name__}; it must return "
            "(module, example_args) or (module, example_args, loss_fn)"
        )
    module, args, loss_fn = (*built, None) if len(built) == 2 else built
    import torch

    if not isinstance(module, torch.nn.Module):
        raise CLIError(f"FACTORY={spec!r}: first element is {type(module).__name__}, not a Module")
    return module, args if isinstance(args, tuple) else (args,), loss_fn


def _cmd_plan(opts: argparse.Namespace) -> int:
    from zerojax.config import DevicesConfig, load_config

    if opts.devices is None:
        config = load_config(opts.config)
    else:  # a cluster you do not have: N simulated CPU devices stand in for it
        config = load_config(opts.config, num_devices=opts.devices)
        config = replace(
            config, devices=DevicesConfig(platform="cpu", num_cpu_devices=opts.devices)
        )
    from zerojax.sharding.mesh import configure_devices

    # Before the first JAX operation: the CPU device count is read once, at backend start.
    configure_devices(config)

    import torch

    from zerojax.config import ConfigError
    from zerojax.parallel.placement import abstract_state
    from zerojax.sharding import make_sharding_plan
    from zerojax.train.memory_plan import memory_report

    abstract = opts.devices is not None
    factory = load_factory(opts.factory)
    if abstract:
        # No weights in memory: the model (and tensors the factory makes) live on `meta`.
        with torch.device("meta"):
            module, args, loss_fn = _build(factory, opts.factory)
    else:
        module, args, loss_fn = _build(factory, opts.factory)
    report = memory_report(module, args, config, loss_fn=loss_fn, abstract=abstract)
    if opts.describe:
        out = sys.stderr if opts.json else sys.stdout  # --json: stdout is the JSON object
        print(make_sharding_plan(abstract_state(module)[0], config).describe(), file=out)
        print(file=out)
    verdict = _fits(report, opts.device_gb, opts.host_gb)
    if opts.json:
        print(
            json.dumps({**report.as_dict(), **({"fits": verdict[0]} if verdict else {})}, indent=1)
        )
    else:
        print(f"{type(module).__name__} from {opts.factory}, config {opts.config}")
        print(report)
        if verdict:
            print(verdict[1])
    if opts.plot:
        reports = {}
        for stage in range(4):
            if stage == config.zero.stage:
                reports[stage] = report
                continue
            try:  # a config checks itself: offload needs stage >= 1, say
                staged = replace(config, zero=replace(config.zero, stage=stage))
                reports[stage] = memory_report(
                    module, args, staged, loss_fn=loss_fn, run_step=False, abstract=abstract
                )
            except ConfigError as exc:  # e.g. the replicated-bytes guard at a higher stage
                print(f"stage {stage} not plotted: {exc}", file=sys.stderr)
        title = f"{type(module).__name__} ({opts.factory}), mesh " + " x ".join(
            f"{a}={s}" for a, s in report.mesh_shape.items()
        )
        plot_stages(reports, opts.plot, title=title)
        print(f"plot written to {opts.plot}")
    return 1 if verdict and not verdict[0] else 0


def _fits(report, device_gb: float | None, host_gb: float | None) -> tuple[bool, str] | None:
    """(whether the step's peaks fit the budgets given, a line saying so); None without any.
    Budgets are decimal GB per device (and per device's share of the host)."""
    checks = [
        (what, budget, peak)
        for what, budget, peak in (
            ("device", device_gb, report.step_peak),
            ("host", host_gb, report.host_step_peak or 0),
        )
        if budget is not None
    ]
    if not checks:
        return None
    if report.step_peak is None:
        raise CLIError("--device-gb/--host-gb need the step's programs; the step did not run")
    parts = [
        f"{what} peak {peak / 1e9:.2f} GB {'<=' if peak <= budget * 1e9 else '>'} {budget:g} GB"
        for what, budget, peak in checks
    ]
    fits = all(peak <= budget * 1e9 for _, budget, peak in checks)
    return fits, f"{'fits' if fits else 'does not fit'}: {', '.join(parts)} per device"


def _cmd_ckpt_inspect(opts: argparse.Namespace) -> int:
    import json

    from zerojax.ckpt.inspect import describe_checkpoint, format_description, verify_checkpoint

    if opts.verify:
        info = verify_checkpoint(opts.directory, opts.step)
    else:
        info = describe_checkpoint(opts.directory, opts.step)
    problems = info.get("problems", [])
    if opts.json:
        print(json.dumps(info, indent=2))
    elif info.get("described", True):
        print(format_description(info))
        if opts.verify and not problems:
            print("verified: every file has its saved size and checksum, every item is there")
    if problems:
        # Anything not verified is a failure: a script that checks `inspect --verify` before
        # exporting or resuming must not go on (exit status 1).
        print(
            f"zerojax ckpt inspect: step {info['step']} of {info['directory']} is NOT verified "
            f"({len(problems)} problem{'s' * (len(problems) > 1)}):",
            file=sys.stderr,
        )
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    return 0


def _cmd_ckpt_export(opts: argparse.Namespace) -> int:
    from zerojax.ckpt.export import (
        export_checkpoint,
        progress_stream,
        return_large_frees_to_os,
    )

    return_large_frees_to_os()  # peak memory near the largest tensor, not a few of them
    out = export_checkpoint(
        opts.directory,
        opts.out,
        format=opts.format,
        step=opts.step,
        dtype=opts.dtype,
        progress=progress_stream(opts.quiet),
    )
    if not opts.quiet:
        print(f"wrote {out} ({os.path.getsize(out):,} bytes)")
    return 0


def _cmd_ckpt_import(opts: argparse.Namespace) -> int:
    from zerojax.ckpt.import_weights import import_weights

    step_dir = import_weights(opts.file, opts.directory, step=opts.step)
    print(f"imported {opts.file} as {step_dir}")
    return 0


def _add_ckpt_commands(commands) -> None:
    from zerojax.ckpt.export import EXPORT_DTYPES, FORMATS

    ckpt = commands.add_parser(
        "ckpt",
        help="inspect, export and import checkpoints",
        description="Inspect a checkpoint directory, export its model as one torch or "
        "safetensors file, or import such a file as a checkpoint step.",
    )
    tools = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = tools.add_parser(
        "inspect",
        help="steps, entries, dtypes and bytes of a checkpoint (metadata only)",
        description="List the committed steps (and ignored partial saves) of DIR, then one "
        "step's state_dict entries with shapes, torch and stored dtypes and bytes, the "
        "optimizer state, engine counters, extra and the saving run's config.",
    )
    inspect.add_argument("directory", metavar="DIR", help="checkpoint directory")
    inspect.add_argument("--step", type=int, help="step to describe (default: the latest)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="also check every file against the manifest and every item and array; exit "
        "status 1 if anything cannot be verified (no manifest, a damaged or missing file)",
    )
    inspect.set_defaults(run=_cmd_ckpt_inspect, name="ckpt inspect")

    export = tools.add_parser(
        "export",
        help="the model as one safetensors or torch file, one tensor in memory at a time",
        description="Write every state_dict entry of a step's model (tied aliases included, "
        "torch dtypes restored) to OUT, streaming one tensor at a time.",
    )
    export.add_argument("directory", metavar="DIR", help="checkpoint directory")
    export.add_argument("out", metavar="OUT", help="output file (written atomically)")
    export.add_argument("--step", type=int, help="step to export (default: the latest)")
    export.add_argument(
        "--format", choices=FORMATS, help="default: from OUT's suffix (.safetensors, .pt)"
    )
    export.add_argument(
        "--dtype", choices=EXPORT_DTYPES, help="cast floating-point entries to this dtype"
    )
    export.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    export.set_defaults(run=_cmd_ckpt_export, name="ckpt export")

    imp = tools.add_parser(
        "import",
        help="a torch/safetensors state_dict file as a checkpoint step",
        description="Write the state_dict in FILE (torch .pt/.pth/.bin or .safetensors) as "
        "step S of checkpoint DIR (model and meta only), restorable onto any mesh.",
    )
    imp.add_argument("file", metavar="FILE", help="torch state_dict or .safetensors file")
    imp.add_argument("directory", metavar="DIR", help="checkpoint directory (created)")
    imp.add_argument("--step", type=int, default=0, help="step number to write (default 0)")
    imp.set_defaults(run=_cmd_ckpt_import, name="ckpt import")


def _cmd_ett(opts: argparse.Namespace) -> int:
    import json

    from zerojax.runtime.job_time import format_summary, job_summary

    summary = job_summary(opts.log)
    print(json.dumps(summary, indent=1) if opts.json else format_summary(summary))
    return 0


def plot_stages(reports: dict, path: str | os.PathLike, *, title: str = "") -> None:
    """Stacked bars of measured per-device bytes by component, one bar per ZeRO stage, with the
    formula total marked on each bar."""
    try:
        import matplotlib
    except ImportError as exc:
        raise CLIError(
            "--plot needs matplotlib: pip install matplotlib (or the zerojax 'dev' extra)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zerojax.sharding.memory import COMPONENTS, LABELS

    stages = sorted(reports)
    peak = max(r.measured_total for r in reports.values()) or 1
    unit, scale = next(
        (u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if peak >= s
    )
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    colors = {"params": "#4c72b0", "grads": "#dd8452", "opt_state": "#55a868"}
    colors["master_weights"] = "#c44e52"
    bottoms = [0.0] * len(stages)
    for name in COMPONENTS:
        heights = [reports[s][name].measured / scale for s in stages]
        ax.bar(stages, heights, 0.6, bottom=bottoms, label=LABELS[name], color=colors[name])
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    formula = [reports[s].formula_total / scale for s in stages]
    ax.scatter(stages, formula, marker="_", s=900, color="black", zorder=3, label="ZeRO formula")
    for stage, top in zip(stages, bottoms):
        ax.annotate(f"{top:.3g}", (stage, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(stages, [f"stage {s}" for s in stages])
    ax.set_ylabel(f"measured bytes per device ({unit})")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, markerscale=0.4)
    ax.margins(y=0.12)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerojax", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan",
        help="per-device memory of the training state a config describes",
        description="Measure per-device bytes of params, gradients, optimizer state and "
        "master weights for the config's ZeRO stage, beside the ZeRO formula.",
    )
    plan.add_argument("--config", required=True, help="zerojax YAML/JSON or ds_config.json")
    plan.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="zero-argument callable returning (module, example_args[, loss_fn])",
    )
    plan.add_argument("--plot", metavar="FILE.png", help="stacked bars for ZeRO stages 0-3")
    plan.add_argument("--describe", action="store_true", help="also print every param's specs")
    plan.add_argument(
        "--json", action="store_true", help="print the report as one JSON object (bytes/device)"
    )
    plan.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="plan for N devices without their memory: the model is built on the meta device "
        "and the step compiled for N simulated CPU devices, never run",
    )
    plan.add_argument(
        "--device-gb",
        type=float,
        metavar="D",
        help="say whether the step's device peak fits D GB per device (exit status 1 if not)",
    )
    plan.add_argument(
        "--host-gb",
        type=float,
        metavar="H",
        help="likewise for the host memory each device's offloaded state takes",
    )
    plan.set_defaults(run=_cmd_plan)
    _add_ckpt_commands(commands)
    ett = commands.add_parser(
        "ett",
        help="effective training time of a job, across ranks and restarts",
        description="Split a job's wall clock (every rank, every torchrun restart) into "
        "productive steps, startup, init, compile, checkpoint time, steps redone after a "
        "restart and time between attempts, from runtime.effective_time_log's files.",
    )
    ett.add_argument("log", metavar="LOG", help="the runtime.effective_time_log path")
    ett.add_argument("--json", action="store_true", help="machine-readable output")
    ett.set_defaults(run=_cmd_ett)
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    if opts.command == "ckpt" and "JAX_PLATFORMS" not in os.environ:
        # The ckpt tools read and write host memory only: without this, Orbax would start JAX
        # on a GPU (claiming most of its memory) on a machine that may be training.
        import jax

        try:
            jax.config.update("jax_platforms", "cpu")
        except RuntimeError:  # backends already up (called in-process): nothing to avoid
            pass
    from zerojax.ckpt.errors import CheckpointError
    from zerojax.config import ConfigError
    from zerojax.runtime.job_time import LedgerLogError

    user_errors: tuple[type[Exception], ...] = (
        CLIError,
        ConfigError,
        CheckpointError,
        LedgerLogError,
    )
    if opts.command == "ckpt":
        # The ckpt tools raise ValueError for bad files and arguments, each message naming
        # the file and the fix; a traceback would add nothing.
        user_errors += (ValueError,)
    try:
        return opts.run(opts)
    except user_errors as exc:
        print(f"zerojax {getattr(opts, 'name', opts.command)}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
