"""Coverage matrix: real model zoos through zerojax, one row per model.

    .venv/bin/python -m tools.model_coverage                     # every family (hours on 2 cores)
    .venv/bin/python -m tools.model_coverage --family timm --jobs 2
    .venv/bin/python -m tools.model_coverage --only torchvision/resnet18 --rerun
    .venv/bin/python -m tools.model_coverage --write-docs        # table from the cached results

For each model of tools/model_zoo.py's populations (torchvision, torchvision segmentation, timm,
Hugging Face, multimodal) two fresh subprocesses, one after the other (so one hang or crash
cannot stop the matrix, and the largest models have the host's memory to themselves in each;
`--timeout` seconds for both), run `check_parity` (converts? forward and gradient parity
against a float64 torch reference, judged against torch fp32's own error) and
`check_zero3_step` (one `loss.backward(); opt.step()` through `zerojax.initialize`, ZeRO-3 on 8
simulated devices).
Results are cached as JSON per model under `--cache-dir` (`.cache/model_coverage`, gitignored),
so the matrix can run in pieces: a model with a cached result is skipped unless `--rerun`.
Each result records the git commit it ran on. `--write-docs` rewrites the section of
docs/coverage.md between `<!-- coverage:begin -->` and `<!-- coverage:end -->` from the cache.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
COVERAGE_PAGE = ROOT / "docs" / "coverage.md"
POPULATIONS = {
    "torchvision": "torchvision classification (every model of `list_models`)",
    "torchvision-seg": "torchvision segmentation (every model)",
    "timm": "timm (sample of CNNs, ViTs, hierarchical, hybrid)",
    "hf": "Hugging Face transformers",
    "multimodal": "multimodal (LLaVA, Qwen2-VL, Qwen2.5-VL)",
}


def cache_path(cache_dir: pathlib.Path, name: str) -> pathlib.Path:
    return cache_dir / (name.replace("/", "__") + ".json")


def git_commit() -> str:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "zerojax"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return head + ("+dirty" if dirty else "")


# --------------------------------------------------------------------------- worker


def run_worker(name: str, stage: str, out: pathlib.Path) -> None:
    """Run one check (`stage`: "parity" or "step") for one model in this process and write its
    JSON result to `out`."""
    # 8 simulated CPU devices for the ZeRO-3 mesh; must be set before JAX starts.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    from tools import model_zoo

    case = model_zoo.cases([name.split("/", 1)[0]])[name]
    check = model_zoo.check_parity if stage == "parity" else model_zoo.check_zero3_step
    result = check(case)
    # This process's peak resident memory (Linux reports KiB): where a large model's memory
    # goes, check by check.
    result["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out.write_text(json.dumps(result, indent=1, default=str))


def _run_stage(name: str, stage: str, out: pathlib.Path, timeout: float) -> dict:
    """One check of one model in a fresh subprocess (the next one starts with the memory of
    this one returned: the largest models need all of it); a timeout or a crash becomes a
    failed result with its cause."""
    out.unlink(missing_ok=True)
    command = [
        *(sys.executable, "-m", "tools.model_coverage"),
        *("--worker", name, "--stage", stage, "--out", str(out)),
    ]
    try:
        proc = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        failure = f"timeout: no result within {timeout:.0f} s"
    else:
        if proc.returncode == 0 and out.exists():
            result = json.loads(out.read_text())
            out.unlink()
            return result
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        failure = f"worker exited with status {proc.returncode}: {' | '.join(tail)}"[:400]
        if proc.returncode in (-9, 137):
            failure = f"worker killed (SIGKILL, likely out of host memory): {failure}"
    return {"passed": False, "converts": False, "cause": f"{stage} check: {failure}"}


def run_one(
    name: str, parity_in_train_mode: bool, cache_dir: pathlib.Path, timeout: float, commit: str
) -> dict:
    """Both checks of one model, each in its own subprocess, `timeout` seconds for the two."""
    path = cache_path(cache_dir, name)
    tmp = path.with_suffix(".partial")
    start = time.perf_counter()
    parity = _run_stage(name, "parity", tmp, timeout)
    if parity.get("converts") or not parity_in_train_mode or parity.get("stage") == "run":
        left = max(timeout - (time.perf_counter() - start), 1.0)
        step = _run_stage(name, "step", tmp, left)
    else:
        # Parity converted this very model in train mode and failed: the step would too.
        step = {"passed": False, "stage": parity.get("stage"), "cause": parity["cause"]}
        step["seconds"] = 0
    result = {
        "name": name,
        "family": name.split("/", 1)[0],
        "parity": parity,
        "step": step,
        "seconds": time.perf_counter() - start,
        "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
    }
    path.write_text(json.dumps(result, indent=1, default=str))
    return result


# --------------------------------------------------------------------------- report


def _true(value) -> bool:
    """A verdict from a cached result (older results hold numpy bools written as strings)."""
    return value is True or value == "True"


def passed(result: dict) -> bool:
    return _true(result["parity"].get("passed")) and _true(result["step"].get("passed"))


def _err(value) -> str:
    return "-" if value is None else f"{value:.1e}"


# zerojax's CaptureError explains what torch.export can capture before torch's reason; the table
# keeps the reason (and the model line, when torch names one).
_CAPTURE_PREAMBLE = re.compile(
    r"; zerojax converts only what torch\.export can trace \(.*?\)\. torch's reason:"
)


def _short(cause: str) -> str:
    """A cause for the table: boilerplate dropped, cut to 400 characters."""
    cause = _CAPTURE_PREAMBLE.sub(":", cause)
    return cause if len(cause) <= 400 else cause[:399] + "…"


def _row(result: dict) -> str:
    parity, step = result["parity"], result["step"]
    name = result["name"].split("/", 1)[1]
    converts = "yes" if _true(parity.get("converts")) else "**no**"
    if "forward_error" in parity:
        forward = f"{_err(parity['forward_error'])} / {_err(parity['forward_error_torch_fp32'])}"
        forward = forward if _true(parity.get("forward_ok")) else f"**{forward}**"
        gradient = f"{_err(parity['gradient_error'])} / {_err(parity['gradient_error_torch_fp32'])}"
        if "ill_conditioned_at_batch_2" in parity:
            first = parity["ill_conditioned_at_batch_2"]
            forward += f" at batch {parity['batch']}"
            gradient += (
                f" at batch {parity['batch']} (batch 2: {_err(first['gradient_error'])} / "
                f"{_err(first['gradient_error_torch_fp32'])})"
            )
        gradient = gradient if _true(parity.get("gradient_ok")) else f"**{gradient}**"
    else:
        forward = gradient = "-"
    zero3 = "yes" if _true(step.get("passed")) else "**no**"
    causes = []
    if not _true(parity.get("passed")):
        causes.append(f"parity ({parity.get('stage', '?')}): {parity.get('cause', '?')}")
    if not _true(step.get("passed")) and step.get("cause") != parity.get("cause"):
        causes.append(f"step ({step.get('stage', '?')}): {step.get('cause', '?')}")
    cause = "; ".join(_short(c) for c in causes).replace("|", "\\|").replace("\n", " ")
    status = "pass" if passed(result) else "**fail**"
    return (
        f"| {name} | {status} | {converts} | {forward} | {gradient} | {zero3} | "
        f"{result['seconds']:.0f} | {cause} |"
    )


TABLE_HEADER = (
    "| model | result | converts | forward err (zerojax / torch fp32) "
    "| gradient err (zerojax / torch fp32) | ZeRO-3 step | s | cause of failure |"
)


def _ratio_summary(parities: list[dict]) -> str:
    """Median and worst of zerojax's gradient error over torch fp32's, across a population."""
    ratios = sorted(
        p["gradient_error"] / p["gradient_error_torch_fp32"]
        for p in parities
        if p.get("gradient_error") is not None and p.get("gradient_error_torch_fp32")
    )
    if not ratios:
        return "-"
    return f"{ratios[len(ratios) // 2]:.2f}x, {ratios[-1]:.2f}x"


def render(results: dict[str, dict], expected: dict[str, list[str]]) -> str:
    """Markdown: a summary per population, then one table per population."""
    lines = [
        BEGIN,
        "",
        "Regenerate with `make coverage` (`tools/model_coverage.py`; `--family`, `--only`, `--jobs`,",
        "`--write-docs`). Columns: *converts* (`zerojax.convert` captures and runs it); *forward*",
        "and *gradient*: relative error of zerojax / of torch fp32, each against float64 torch at",
        "that run's own ReLU/max-pool branches (`tools/float64_judge.py`: a pre-activation within",
        "fp32 rounding of a kink takes either branch by luck, which moves a gradient by ~1e-2)",
        "(forward: all floating outputs; gradient: worst parameter of a fixed random probe loss",
        "over the outputs); a model passes parity when zerojax is within 3x torch fp32's own",
        "error (tests/tolerances.py's TORCH_ERROR_FACTOR) or within the fp32 bounds of the model",
        "tests (1e-5 forward, 1e-4 gradient); a wrong lowering is off by O(1). For models that",
        "take images, torch fp32's error is the worst of its contiguous, `channels_last` and",
        "oneDNN-off evaluations (three valid accumulation orders). A model with BatchNorm in train",
        "mode whose torch fp32 gradient is off float64 by more than 1e-4 at batch 2 (amplified",
        "rounding) is judged at batch 8, the",
        "ZeRO-3 step's batch, by a rule that reads torch's error only; its batch-2 numbers are",
        "shown beside. *ZeRO-3 step*: one",
        "`loss.backward(); opt.step()` through `zerojax.initialize` on an 8-way `fsdp` mesh with",
        "dropout on: finite loss and parameters, parameters changed. *s*: seconds for both checks",
        "on a shared 2-core CPU. Bold marks a failure; its cause is in the last column. Models",
        "are built from tiny configs with random weights (`tools/model_zoo.py`); torchvision is",
        "imported through `tools.model_zoo.import_torchvision()`, which defines the two",
        "`torchvision::` op schemas its import needs when the wheel's C extension cannot load.",
        "",
        (
            "| population | models | pass (all checks) | converts | parity | ZeRO-3 step "
            "| not run yet | gradient err zerojax / torch fp32: median, worst |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for family, names in expected.items():
        ran = [results[n] for n in names if n in results]
        lines.append(
            f"| {POPULATIONS[family]} | {len(names)} | **{sum(map(passed, ran))}** | "
            f"{sum(_true(r['parity'].get('converts')) for r in ran)} | "
            f"{sum(_true(r['parity'].get('passed')) for r in ran)} | "
            f"{sum(_true(r['step'].get('passed')) for r in ran)} | {len(names) - len(ran)} | "
            f"{_ratio_summary([r['parity'] for r in ran])} |"
        )
    commits = sorted({r.get("commit", "?") for r in results.values()})
    lines += [
        "",
        f"Results from commit(s) {', '.join(commits)}. A model under *not run yet* has no",
        "cached result: one model takes 2-10 min on a shared 2-core CPU, so the matrix runs in",
        "pieces (`make coverage` resumes where it stopped).",
        "",
    ]
    for family, names in expected.items():
        ran = [results[n] for n in names if n in results]
        summary = f"{POPULATIONS[family]}: {sum(map(passed, ran))}/{len(names)} pass"
        # HTML, not Markdown, inside <summary>; markdown="1" lets the docs site (md_in_html)
        # render the table inside <details>, as GitHub does.
        summary = re.sub(r"`([^`]+)`", r"<code>\1</code>", summary)
        lines += [
            f'<details markdown="1"><summary>{summary}</summary>',
            "",
            TABLE_HEADER,
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [_row(r) for r in ran]
        missing = [n.split("/", 1)[1] for n in names if n not in results]
        if missing:
            lines += ["", f"Not run yet: {', '.join(missing)}."]
        lines += ["", "</details>", ""]
    lines.append(END)
    return "\n".join(lines)


def write_page(section: str, page: pathlib.Path = COVERAGE_PAGE) -> None:
    """Replace the text between BEGIN and END in `page` (the docs' coverage page) by `section`;
    a page without the markers gets a "Model coverage" section at its end."""
    text = page.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + f"\n\n## Model coverage\n\n{section}\n"
    page.write_text(text)


# The name the table's writer had while the table lived in README.md (tests/tools use it).
write_readme = write_page


def load_results(cache_dir: pathlib.Path, names: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        path = cache_path(cache_dir, name)
        if path.exists():
            out[name] = json.loads(path.read_text())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", help="population(s), comma-separated")
    parser.add_argument("--only", action="append", help="model name(s), e.g. hf/gpt2 or gpt2")
    parser.add_argument("--jobs", type=int, default=1, help="models run in parallel")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per model")
    parser.add_argument("--rerun", action="store_true", help="ignore cached results")
    parser.add_argument(
        "--write-docs", action="store_true", help="write the table into docs/coverage.md"
    )
    parser.add_argument("--no-run", action="store_true", help="only report cached results")
    parser.add_argument("--cache-dir", type=pathlib.Path, default=ROOT / ".cache/model_coverage")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--stage", choices=("parity", "step"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.stage, args.out)
        return

    from tools import model_zoo

    families = [f for spec in args.family or [] for f in spec.split(",")] or list(POPULATIONS)
    all_cases = model_zoo.cases(families)
    expected = {f: [n for n, c in all_cases.items() if c.family == f] for f in families}
    names = list(all_cases)
    if args.only:
        wanted = set(args.only)
        names = [n for n in names if n in wanted or n.split("/", 1)[1] in wanted]
        if not names:
            raise ValueError(f"--only {sorted(wanted)} matches no model of {families}")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    todo = [n for n in names if args.rerun or not cache_path(args.cache_dir, n).exists()]
    # Round-robin over the families, the heaviest models last, so a partial run covers all.
    position = {n: i for f in expected.values() for i, n in enumerate(f)}
    todo.sort(key=lambda n: (n.split("/", 1)[1] in model_zoo.HEAVY, position[n]))
    if not args.no_run and todo:
        commit = git_commit()
        print(f"running {len(todo)} model(s), {args.jobs} at a time, on {commit}", flush=True)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {
                pool.submit(
                    run_one,
                    *(n, all_cases[n].parity_in_train_mode, args.cache_dir, args.timeout, commit),
                ): n
                for n in todo
            }
            for future in concurrent.futures.as_completed(futures):
                r = future.result()
                cause = "" if passed(r) else "  " + _row(r).rsplit("|", 2)[-2].strip()[:200]
                print(
                    f"{'PASS' if passed(r) else 'FAIL'} {r['name']} ({r['seconds']:.0f} s){cause}",
                    flush=True,
                )
    results = load_results(args.cache_dir, list(all_cases))
    for family, members in expected.items():
        ran = [results[n] for n in members if n in results]
        print(f"{family}: {sum(map(passed, ran))}/{len(members)} pass ({len(ran)} run)")
    if args.write_docs:
        # The page's table always covers every population, from whatever is cached.
        every = model_zoo.cases(list(POPULATIONS))
        expected_all = {f: [n for n, c in every.items() if c.family == f] for f in POPULATIONS}
        write_page(render(load_results(args.cache_dir, list(every)), expected_all))
        print(f"{COVERAGE_PAGE.relative_to(ROOT)} coverage section written")


if __name__ == "__main__":
    main()
