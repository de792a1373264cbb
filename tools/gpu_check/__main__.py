"""`python3 -m tools.gpu_check --out DIR [--cpu] [--sections ...] [--budget-s S]`: the runner.

Runs each section in a subprocess (`python -m tools.gpu_check.section NAME`), gives it the
share of the remaining budget its entry in SECTIONS names, merges their reports into DIR and
prints a summary. Exit status 1 when a check failed or a section crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.gpu_check.report import SectionReport, markdown, write_json

REPO = Path(__file__).resolve().parents[2]

# name -> seconds it may take on a GPU (of the default 450 s) and under --cpu (of 170 s), in
# the order they run: what the issue most needs first, so a short budget loses the least.
SECTIONS = {
    "kernels": (110, 50),
    "train_step": (150, 50),
    "memory": (80, 30),
    "offload": (60, 25),
    "checkpoints": (40, 15),
}
GRACE_S = 15  # after SIGTERM, a section writes what it has measured; then SIGKILL


def versions() -> dict:
    """The stack the check ran on, read in a subprocess (the runner itself imports no jax)."""
    code = (
        "import json, platform, torch, jax, jaxlib\n"
        "devices = jax.devices()\n"
        "info = {'python': platform.python_version(), 'torch': torch.__version__,\n"
        "        'torch cuda': torch.version.cuda, 'jax': jax.__version__,\n"
        "        'jaxlib': jaxlib.__version__, 'backend': jax.default_backend(),\n"
        "        'devices': f'{len(devices)} x {devices[0].device_kind}'}\n"
        "print(json.dumps(info))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=section_env(False)
    )
    if result.returncode:
        return {"versions": f"could not be read: {result.stderr.strip()[-500:]}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def section_env(cpu: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_section(name: str, cpu: bool, seconds: float, log) -> SectionReport:
    """One section in its own process, stopped (SIGTERM, then SIGKILL) when its time is up."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as scratch:
        out_json = Path(scratch) / "report.json"
        command = [sys.executable, "-m", "tools.gpu_check.section", name, "--json", str(out_json)]
        command += ["--seconds", f"{seconds:.0f}", "--scratch", scratch] + (
            ["--cpu"] if cpu else []
        )
        log.write(f"\n===== {name} ({seconds:.0f} s): {' '.join(command)}\n")
        log.flush()
        start = time.monotonic()
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=section_env(cpu), cwd=REPO
        )
        try:
            process.wait(timeout=seconds + GRACE_S)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        elapsed = time.monotonic() - start
        if out_json.exists():
            report = SectionReport.from_json(json.loads(out_json.read_text()))
        else:
            report = SectionReport(name)
        if process.returncode and report.error is None and report.incomplete is None:
            report.error = (
                f"the section's process exited with status {process.returncode} after "
                f"{elapsed:.0f} s (its output is in gpu_check.log)"
            )
        report.seconds = elapsed
        return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__)
    parser.add_argument("--out", required=True, type=Path, help="directory for the report files")
    parser.add_argument(
        "--cpu", action="store_true", help="tiny shapes on the CPU, Pallas interpreted (CI)"
    )
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock seconds for all sections (default 450 on a GPU, 170 with --cpu); "
        "each section gets its share, and sections left without time are skipped",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or (170.0 if args.cpu else 450.0)
    shares = {name: SECTIONS[name][1 if args.cpu else 0] for name in args.sections}
    start = time.monotonic()
    header = {
        "mode": "CPU (tiny shapes, Pallas interpreted; numbers meaningless)" if args.cpu else "GPU",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "host": f"{platform.node()}, {os.cpu_count()} CPUs",
        **versions(),
    }
    reports = []
    with open(args.out / "gpu_check.log", "w") as log:
        for index, name in enumerate(args.sections):
            left = budget - (time.monotonic() - start)
            # What is left is split in proportion to the shares of the sections still to run.
            rest = sum(shares[n] for n in args.sections[index:])
            seconds = min(shares[name] * left / rest * 1.25, left)
            if seconds < shares[name] * 0.5:
                reports.append(SectionReport(name, skipped=f"{left:.0f} s of the budget left"))
                continue
            print(f"gpu_check: {name} (up to {seconds:.0f} s) ...", flush=True)
            reports.append(run_section(name, args.cpu, seconds, log))
    header["wall seconds"] = round(time.monotonic() - start, 1)
    write_json(args.out / "gpu_check.json", header, reports)
    (args.out / "gpu_check.md").write_text(markdown(header, reports))
    print_summary(header, reports, args.out)
    return 1 if any(report.failed for report in reports) else 0


def git_commit() -> str:
    result = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return result.stdout.strip() or "unknown (no git)"


def print_summary(header: dict, reports: list[SectionReport], out: Path) -> None:
    print(
        f"\nzerojax GPU check: {header.get('devices', '?')}, jax {header.get('jax', '?')}, "
        f"torch {header.get('torch', '?')}, {header['wall seconds']} s"
    )
    for report in reports:
        if report.skipped:
            status = f"skipped ({report.skipped})"
        elif report.error:
            status = "CRASHED: " + report.error.strip().splitlines()[-1][:200]
        else:
            failed = [c.name for c in report.checks if not c.passed]
            status = (
                f"FAILED: {', '.join(failed)}" if failed else f"{len(report.checks)} checks passed"
            )
            if report.incomplete:
                status += f" (incomplete: {report.incomplete})"
        missed = [t.name for t in report.targets if not t.met]
        print(
            f"  {report.section:12} {status}"
            + (f"; targets missed: {', '.join(missed)}" if missed else "")
        )
    print(f"report: {out / 'gpu_check.md'} (and gpu_check.json, gpu_check.log)")


if __name__ == "__main__":
    sys.exit(main())
