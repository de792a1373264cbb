"""Faults of the machine rather than the files: a full disk, write permission taken away, and
a writer killed mid-save.

Each scenario runs in processes of its own, as a training job would meet it:

- full disk: a 2 MB tmpfs mounted in a private mount namespace (`unshare -rm`), step 1 saved,
  the rest of the disk filled, then step 2 saved synchronously, asynchronously with
  `close()`, and asynchronously by a script that ends without `close()` (its exit code is
  the verdict); `ckpt import` and `ckpt export` onto the full disk.
- read-only: the checkpoint directory, one step, or the oldest step (which `max_to_keep`
  deletes) made read-only with chmod, and one array file made unreadable; as root, who
  writes and reads anywhere, the child runs as `nobody` (setpriv). Restoring and verifying
  read-only steps must still work; saving, importing and exporting into them must fail
  with a named error.
- a process that does not exit within 25 s of its script's end is hung: its threads' stacks
  are dumped (faulthandler) and summarized in the row.
- SIGKILL: a child saves step 3 asynchronously and is killed at random points; a fresh
  process then resumes (restore latest, save step 4), which must give back exactly what a
  committed step held and leave no temporary directory.

The `child_*` functions run in the worker process (`worker.py`); the others run in the
driver, start those processes and judge what they report.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from tools.fault_injection.outcomes import (
    CAUGHT,
    FLAWED,
    RECOVERED,
    SILENT,
    SKIPPED,
    Row,
    judge_error,
    names,
    one_line,
)

REPO = Path(__file__).resolve().parents[2]
TMPFS_SIZE = "2m"
NOBODY = 65534


def _tmp_dirs(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if "tmp" in n) if directory.is_dir() else []


def _fill(mount: Path) -> Path:
    """Fill the file system of `mount` to the last byte; returns the filler file."""
    filler = mount / "filler"
    with open(filler, "ab", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12, 1 << 9, 1):
            with contextlib.suppress(OSError):
                while f.write(b"\0" * chunk) == chunk:
                    pass
    return filler


def _restored(directory: Path, step: int | None, base_root: Path, seed: int) -> tuple[int, list]:
    """(step restored, differences from its saved values) of a restore into a fresh engine."""
    from tools.fault_injection.base import differences, load_values, make_model, state_values
    from zerojax.ckpt.checkpointer import Checkpointer

    model, optimizer = make_model(seed)
    ckpt = Checkpointer(directory, model, optimizer, max_to_keep=None)
    try:
        state = ckpt.restore(step)
    finally:
        with contextlib.suppress(Exception):
            ckpt.close()
    saved_as = {3: 1}.get(state.step, state.step)  # step 3 holds step 1's state: child_kill_save
    return state.step, differences(state_values(model), load_values(base_root, saved_as))


def _after_failed_save(row_fault: str, group: str, error, directory: Path, step: int,
                       base_root: Path, expected: str, seed: int) -> Row:  # fmt: skip
    """Judge a save that should have failed: the error, leftovers, and that the previous
    step still restores bit for bit."""
    if error is None:
        try:
            got, diffs = _restored(directory, None, base_root, seed)
        except Exception as exc:  # noqa: BLE001 - judged
            return Row(fault=row_fault, group=group, expected=expected, verdict=SILENT,
                       observed=one_line(f"save reported success; restore then raised {exc!r}"))  # fmt: skip
        verdict = SILENT if got != step or diffs else RECOVERED
        return Row(fault=row_fault, group=group, expected=expected, verdict=verdict,
                   observed=f"save reported success; latest step {got}, {len(diffs)} values differ")  # fmt: skip
    verdict, observed = judge_error(error, step, [str(directory)])
    leftovers = _tmp_dirs(directory)
    if leftovers:
        verdict, observed = FLAWED, f"{observed}; left {leftovers} behind"
    try:
        got, diffs = _restored(directory, None, base_root, seed)
        if diffs:
            verdict, observed = SILENT, f"{observed}; then step {got} restored with wrong values"
        else:
            observed += f"; step {got} still restores bit for bit"
    except Exception as exc:  # noqa: BLE001 - judged
        verdict = FLAWED
        observed += one_line(f"; the previous step no longer restores: {type(exc).__name__}: {exc}")
    return Row(fault=row_fault, group=group, expected=expected, verdict=verdict,
               observed=one_line(observed))  # fmt: skip


def _save_step(ckpt, step: int, *, close: bool = True) -> Exception | None:
    """`ckpt.save(step)`, then `close()` (or `wait()`); what either raised, after closing
    the Checkpointer anyway (its threads must not outlive the fault)."""
    try:
        ckpt.save(step)
        if close:
            ckpt.close()
        else:
            ckpt.wait()
    except Exception as error:  # noqa: BLE001 - judged by the caller
        with contextlib.suppress(Exception):
            ckpt.close()
        return error
    return None


def _failing_save(base_root: Path, directory: Path, *, async_save: bool, close: bool,
                  before_second=None) -> BaseException | None:  # fmt: skip
    """Save pristine step 1 into `directory`, call `before_second()`, save step 2 (and
    close); returns what the save or close raised."""
    from tools.fault_injection.base import make_model, restore_values_from
    from zerojax.ckpt.checkpointer import Checkpointer

    model, optimizer = make_model(3)
    restore_values_from(model, optimizer, base_root / "ckpt", 1)
    ckpt = Checkpointer(directory, model, optimizer, max_to_keep=None, async_save=async_save)
    ckpt.save(1)
    ckpt.wait()
    if before_second is not None:
        before_second()
    restore_values_from(model, optimizer, base_root / "ckpt", 2)
    return _save_step(ckpt, 2, close=close)


# --------------------------------------------------------------------------- children


def child_disk_full(base_root: Path, mount: Path) -> list[Row]:
    """In the private namespace, `mount` a fresh 2 MB tmpfs: saves, import and export onto
    a full disk."""

    rows = []
    expected = "CheckpointError naming step 2 or the path; no temporary directory left; step 1 still restores"
    for async_save, close in ((False, False), (True, True), (True, False)):
        mode = (
            "async save + close()"
            if async_save and close
            else "async save + wait()"
            if async_save
            else "sync save"
        )
        directory = mount / f"ckpt_{int(async_save)}{int(close)}"
        filler: list[Path] = []
        error = _failing_save(base_root, directory, async_save=async_save, close=close,
                              before_second=lambda made=filler: made.append(_fill(mount)))  # fmt: skip
        rows.append(_after_failed_save(f"disk full: {mode}", "disk-full", error, directory, 2,
                                       base_root, expected, seed=10))  # fmt: skip
        for f in filler:
            f.unlink()

    # ckpt import and export onto the full disk.
    filler = _fill(mount)
    cases = {
        "ckpt import onto a full disk": (
            ["ckpt", "import", str(base_root / "model.safetensors"), str(mount / "imported")],
            mount / "imported",
        ),
        "ckpt export onto a full disk": (
            ["ckpt", "export", str(base_root / "ckpt"), str(mount / "out" / "model.safetensors"), "--quiet"],
            mount / "out",
        ),
    }  # fmt: skip
    (mount / "out").mkdir(exist_ok=True)
    for fault, (argv, target) in cases.items():
        rows.append(_cli_must_fail(fault, "disk-full", argv, target, step=None))
    filler.unlink()
    return rows


def _cli_must_fail(fault: str, group: str, argv: list[str], target: Path, step) -> Row:
    from tools.fault_injection.file_faults import run_cli
    from tools.fault_injection.outcomes import judge_cli

    before = sorted(p.name for p in target.rglob("*")) if target.exists() else []
    code, _, err, escaped = run_cli(argv)
    expected = "exit non-zero naming the path; nothing half-written left behind"
    after = sorted(p.name for p in target.rglob("*")) if target.exists() else []
    if escaped is not None:
        verdict, observed = FLAWED, f"traceback: {type(escaped).__name__}: {escaped}"
    elif code == 0:
        verdict, observed = SILENT, "exit 0"
    else:
        verdict, observed = judge_cli(
            code, err, step, [str(target), str(target.parent)], in_process=True
        )
        if after != before:
            verdict, observed = FLAWED, f"{observed}; left {sorted(set(after) - set(before))[:4]}"
    return Row(fault=fault, group=group, expected=expected, verdict=verdict,
               observed=one_line(observed))  # fmt: skip


def child_save_without_close(base_root: Path, directory: Path, mount: str, end: Path) -> None:
    """Save step 1, make step 2's save fail (fill `mount`, or `directory` is read-only),
    and end the script without close(): the process must exit non-zero."""
    from tools.fault_injection.base import make_model, restore_values_from
    from zerojax.ckpt.checkpointer import Checkpointer

    model, optimizer = make_model(3)
    restore_values_from(model, optimizer, base_root / "ckpt", 1)
    ckpt = Checkpointer(directory, model, optimizer, max_to_keep=None, async_save=True)
    if mount:
        ckpt.save(1)
        ckpt.wait()
        _fill(Path(mount))
    restore_values_from(model, optimizer, base_root / "ckpt", 2)
    ckpt.save(2 if mount else 3)
    print("SCRIPT_END", flush=True)
    end.write_text("")  # the driver's clock for "hung at exit" starts here


def child_read_only(base_root: Path, scratch: Path) -> list[Row]:
    """Run as a user who cannot write where chmod says so (see `read_only_faults`)."""
    from tools.fault_injection.base import make_model, restore_values_from
    from tools.fault_injection.file_faults import run_cli
    from zerojax.ckpt.checkpointer import Checkpointer

    rows = []
    ro_dir, ro_step, ro_oldest = scratch / "ro_dir", scratch / "ro_step", scratch / "ro_oldest"

    def must_restore(fault: str, directory: Path) -> Row:
        expected = "restore works (a read needs no write permission): step 2 bit for bit"
        try:
            got, diffs = _restored(directory, None, base_root, seed=20)
        except Exception as error:  # noqa: BLE001 - judged
            return Row(fault=fault, group="read-only", expected=expected, verdict=FLAWED,
                       observed=one_line(f"raised {type(error).__name__}: {error}"))  # fmt: skip
        verdict = SILENT if diffs or got != 2 else RECOVERED
        return Row(fault=fault, group="read-only", expected=expected, verdict=verdict,
                   observed=f"restored step {got}, {len(diffs)} values differ")  # fmt: skip

    rows.append(must_restore("read-only checkpoint directory: restore latest", ro_dir / "ckpt"))

    # A file this user cannot read (a permission slip on a shared file system).
    from tools.fault_injection.base import load_values
    from tools.fault_injection.file_faults import restore_row, step_file_kinds

    unreadable = scratch / "ro_unreadable" / "ckpt"
    kinds = step_file_kinds(unreadable / "2")
    data = [files[0] for kind, files in kinds.items() if kind.startswith("model: array data")]
    target = unreadable / "2" / data[-1]  # the merged store's, when there is one (sorted last)
    target.chmod(0)
    values = {s: load_values(base_root, s) for s in (1, 2)}
    verdict, observed = restore_row(unreadable, None, values, 24, [str(target)])
    rows.append(Row(fault="unreadable model array file (chmod 000) in step 2: restore latest",
                    group="read-only", expected="CheckpointError naming step 2 or the file, or "
                    "step 1 bit for bit with a warning naming step 2", verdict=verdict,
                    observed=observed))  # fmt: skip
    rows.append(must_restore("read-only step 2: restore latest", ro_step / "ckpt"))
    code, _, err, escaped = run_cli(["ckpt", "inspect", str(ro_step / "ckpt"), "--verify"])
    rows.append(Row(fault="read-only step 2: inspect --verify", group="read-only",
                    expected="exit 0 (verifying is a read)",
                    verdict=RECOVERED if code == 0 else FLAWED,
                    observed=one_line(f"exit {code} {err} {escaped or ''}")))  # fmt: skip

    for async_save in (False, True):
        model, optimizer = make_model(21)
        restore_values_from(model, optimizer, base_root / "ckpt", 2)
        ckpt = Checkpointer(ro_dir / "ckpt", model, optimizer, max_to_keep=None,
                            async_save=async_save)  # fmt: skip
        error = _save_step(ckpt, 3)
        mode = "async save + close()" if async_save else "sync save"
        expected = "CheckpointError naming step 3 or the directory"
        if error is None:
            verdict, observed = SILENT, "save and close returned without an error"
        else:
            verdict, observed = judge_error(error, 3, [str(ro_dir / "ckpt")])
        rows.append(Row(fault=f"read-only checkpoint directory: {mode}", group="read-only",
                        expected=expected, verdict=verdict, observed=observed))  # fmt: skip

    # max_to_keep=2 deletes step 1 when step 3 commits; step 1 is read-only.
    model, optimizer = make_model(22)
    restore_values_from(model, optimizer, base_root / "ckpt", 1)
    expected = "step 3 committed and restorable; the failed deletion of step 1 reported"
    error = _save_step(Checkpointer(ro_oldest / "ckpt", model, optimizer, max_to_keep=2), 3)
    try:
        _, diffs = _restored(ro_oldest / "ckpt", 3, base_root, seed=23)
        state = f"step 3 restores, {len(diffs)} values differ"
        verdict = RECOVERED if error is None else judge_error(error, 1, [str(ro_oldest)])[0]
        if error is not None and re.search(r"step 3 (was )?not saved", str(error)):
            # Step 3 did commit: the error must be about step 1, which could not be deleted.
            verdict, state = FLAWED, f"{state}: the error says step 3 was not saved, but it was"
        verdict = SILENT if diffs else verdict
    except Exception as exc:  # noqa: BLE001 - judged
        state = one_line(f"step 3 does not restore: {type(exc).__name__}: {exc}")
        verdict = FLAWED if error is not None else SILENT
    steps = sorted(int(n) for n in os.listdir(ro_oldest / "ckpt") if n.isdigit())
    state += f"; step directories now {steps}"
    said = one_line(f"{type(error).__name__}: {error}") if error is not None else "no error"
    rows.append(Row(fault="read-only oldest step, max_to_keep=2: async save + close()",
                    group="read-only", expected=expected, verdict=verdict,
                    observed=one_line(f"{said}; {state}")))  # fmt: skip

    rows.append(_cli_must_fail(
        "read-only checkpoint directory: ckpt import --step 3", "read-only",
        ["ckpt", "import", str(base_root / "model.safetensors"), str(ro_dir / "ckpt"), "--step", "3"],
        ro_dir / "ckpt", step=3))  # fmt: skip
    rows.append(_cli_must_fail(
        "read-only output directory: ckpt export", "read-only",
        ["ckpt", "export", str(ro_dir / "ckpt"), str(ro_dir / "out" / "model.safetensors"), "--quiet"],
        ro_dir / "out", step=None))  # fmt: skip
    return rows


def child_kill_save(base_root: Path, directory: Path) -> None:
    """Save pristine step 1's state as step 3, asynchronously, into a copy of the base
    checkpoint, and wait to be killed (the driver sends SIGKILL)."""
    from tools.fault_injection.base import make_model, restore_values_from
    from zerojax.ckpt.checkpointer import Checkpointer

    model, optimizer = make_model(4)
    restore_values_from(model, optimizer, directory, 1)
    ckpt = Checkpointer(directory, model, optimizer, max_to_keep=None)
    print("SAVING", flush=True)
    ckpt.save(3)
    ckpt.wait()
    print("COMMITTED", flush=True)
    time.sleep(120)


def run_resume(spec: dict, base_root: Path, scratch: Path, seed: int) -> list[Row]:
    """A fresh process resumes after the SIGKILL: restore latest, then save step 4."""
    from tools.fault_injection.base import make_model
    from zerojax.ckpt.checkpointer import Checkpointer
    from zerojax.ckpt.layout import MANIFEST

    directory = Path(spec["dir"])
    expected = (
        "the newest committed, verified step bit for bit; saving step 4 then works and leaves "
        "no temporary directory; every listed step verifies"
    )
    start = time.perf_counter()
    try:
        got, diffs = _restored(directory, None, base_root, seed)
    except Exception as error:  # noqa: BLE001 - judged
        verdict, observed = FLAWED, one_line(f"resume blocked: {type(error).__name__}: {error}")
    else:
        if diffs:
            verdict, observed = SILENT, f"restored step {got} with {len(diffs)} wrong values"
        elif not (directory / str(got) / MANIFEST).is_file():
            verdict, observed = FLAWED, f"restored step {got}, which has no manifest (unverified)"
        else:
            verdict, observed = RECOVERED, f"resumed from step {got} bit for bit"
            model, optimizer = make_model(seed)
            ckpt = Checkpointer(directory, model, optimizer, max_to_keep=None, async_save=False)
            try:
                ckpt.restore()
                ckpt.save(4)
            except Exception as error:  # noqa: BLE001 - judged
                verdict, observed = FLAWED, one_line(f"{observed}; then save(4) raised {error!r}")
            finally:
                with contextlib.suppress(Exception):
                    ckpt.close()
            if _tmp_dirs(directory):
                verdict = FLAWED
                observed += f"; {_tmp_dirs(directory)} left after save(4)"
        # Every step the directory lists as committed must verify: a listed step that does
        # not is a step that restore() could be handed.
        from tools.fault_injection.file_faults import run_cli

        listed = Checkpointer(directory).all_steps()
        unverified = [
            step
            for step in listed
            if run_cli(["ckpt", "inspect", str(directory), "--step", str(step), "--verify"])[0]
        ]
        if unverified:
            verdict = SILENT
            observed += f"; listed step(s) {unverified} do not verify"
        else:
            observed += f"; steps {listed} all verify"
    return [Row(fault=spec["label"], group="sigkill", expected=expected, verdict=verdict,
                observed=one_line(f"[{spec['note']}] {observed}"),
                seconds=round(time.perf_counter() - start, 3))]  # fmt: skip


# --------------------------------------------------------------------------- driver side


def worker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tools.fault_injection.worker", *map(str, args)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _namespace_ok() -> str | None:
    """None when `unshare -rm` can mount a tmpfs here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>&1 || mount -t tmpfs -o size=64k tmpfs /tmp"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return None if probe.returncode == 0 else one_line(probe.stderr or probe.stdout)


def run_child(
    command: list[str], timeout: float, *, end_file: Path | None = None, exit_grace: float = 25.0,
    **kwargs,
) -> subprocess.CompletedProcess:  # fmt: skip
    """subprocess.run that survives a hang. A child that has not exited `exit_grace` seconds
    after `end_file` appeared (its script's end), or after `timeout` in all, is hung: its
    thread stacks are dumped (SIGUSR1, see worker.py), it is killed, and the result's `hung`
    is set."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True, **kwargs)
        start, ended, hung = time.monotonic(), None, False
        while child.poll() is None:
            now = time.monotonic()
            if ended is None and end_file is not None and end_file.exists():
                ended = now
            if now - start > timeout or (ended is not None and now - ended > exit_grace):
                hung = True
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGUSR1)
                time.sleep(2)
                child.kill()
                child.wait()
                break
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(command, child.returncode, out.read(), err.read())
    result.hung = hung
    return result


def _stack_summary(err: str) -> str:
    """Where a hung process waits, from its faulthandler dump: the main thread's innermost
    frame and what the other threads wait in (counted by their innermost library frame)."""
    blocks = re.split(r"\n(?=Thread 0x|Current thread 0x)", err)
    main, others = "", Counter()
    for block in blocks:
        frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File")]
        if not frames:
            continue
        if block.lstrip().startswith("Current thread"):
            main = frames[0]
        else:
            library = [f for f in frames if "site-packages" in f or "zerojax" in f]
            where = library[0] if library else frames[0]
            others[re.sub(r'^File ".*?(site-packages/|/zerojax/)', r"\1", where)] += 1
    waiting = "; ".join(f"{n} thread(s) in {w}" for w, n in others.most_common(2))
    return f"main thread in {main}; {waiting or 'no other thread'}"


def _hang_row(fault: str, group: str, process) -> list[Row]:
    if not getattr(process, "hung", False):
        return []
    return [Row(fault=fault, group=group, expected="the process exits", verdict=FLAWED,
                observed=one_line(f"hung at exit, killed after the timeout: {_stack_summary(process.stderr)}"))]  # fmt: skip


def _in_tmpfs(mount: Path, *worker_args: str) -> list[str]:
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return ["unshare", "-rm", "sh", "-c", script, "sh", TMPFS_SIZE, str(mount), *worker_command(*worker_args)]  # fmt: skip


def _rows_from(
    path: Path, process: subprocess.CompletedProcess, fault: str, group: str
) -> list[Row]:
    if path.is_file() and path.stat().st_size:
        return [Row(**r) for r in json.loads(path.read_text())]
    tail = one_line((process.stderr or "")[-400:])
    return [Row(fault=fault, group=group, expected="the scenario runs to its end", verdict=FLAWED,
                observed=f"worker exited {process.returncode} without a report: {tail}")]  # fmt: skip


def _no_close_row(fault: str, group: str, process: subprocess.CompletedProcess, step: int) -> Row:
    expected = f"the script exits non-zero, naming step {step}, though it never called close()"
    err = process.stderr or ""
    if getattr(process, "hung", False):
        observed = f"reached its end: {'SCRIPT_END' in (process.stdout or '')}; then hung at exit: {_stack_summary(err)}"
        return Row(
            fault=fault, group=group, expected=expected, verdict=FLAWED, observed=one_line(observed)
        )
    if "SCRIPT_END" not in (process.stdout or ""):
        observed = one_line(
            f"the script did not reach its end (exit {process.returncode}): {err[-300:]}"
        )
        return Row(fault=fault, group=group, expected=expected, verdict=FLAWED, observed=observed)
    if process.returncode == 0:
        said = [line for line in err.splitlines() if str(step) in line][:1]
        observed = f"exit 0; stderr: {one_line(said[0]) if said else 'nothing about it'}"
        return Row(fault=fault, group=group, expected=expected, verdict=SILENT, observed=observed)
    lines = err.strip().splitlines()
    verdict = CAUGHT if names(err, step, []) else FLAWED
    observed = f"exit {process.returncode}, {len(lines)} stderr lines: {one_line(lines[-1] if lines else '')}"
    if err.count("Traceback") > 0:
        verdict, observed = FLAWED, observed + f" ({err.count('Traceback')} tracebacks on stderr)"
    return Row(
        fault=fault, group=group, expected=expected, verdict=verdict, observed=one_line(observed)
    )


def disk_full_faults(base_root: Path, scratch: Path, timeout: float) -> list[Row]:
    why = _namespace_ok()
    if why is not None:
        return [Row(fault="disk full (tmpfs in a private mount namespace)", group="disk-full",
                    expected="-", verdict=SKIPPED, observed=f"cannot mount a tmpfs: {why}")]  # fmt: skip
    rows = []
    mount = scratch / "tmpfs_a"
    mount.mkdir(parents=True, exist_ok=True)
    out = scratch / "disk_full.json"
    process = run_child(
        _in_tmpfs(mount, "disk-full", base_root, mount, out),
        timeout, end_file=out, env=_env(), cwd=REPO,
    )  # fmt: skip
    (scratch / "disk_full.stderr").write_text(process.stderr or "")
    rows += _rows_from(out, process, "disk full: saves, import, export", "disk-full")
    rows += _hang_row("disk full: the process after the failed saves", "disk-full", process)
    mount = scratch / "tmpfs_b"
    mount.mkdir(parents=True, exist_ok=True)
    end = scratch / "disk_full_no_close.end"
    process = run_child(
        _in_tmpfs(mount, "save-without-close", base_root, mount / "ckpt", mount, end),
        timeout, end_file=end, env=_env(), cwd=REPO,
    )  # fmt: skip
    (scratch / "disk_full_no_close.stderr").write_text(process.stderr or "")
    rows.append(
        _no_close_row("disk full: async save, script ends without close()", "disk-full", process, 2)
    )
    return rows


def read_only_faults(base_root: Path, scratch: Path, timeout: float) -> list[Row]:
    """Copies of the base checkpoint with write permission taken away by chmod. As root, who
    writes anywhere, the child runs as `nobody` (setpriv), in a directory of its own under
    the system's temporary directory (`scratch` may sit below a directory only root can
    enter, as pytest's tmp_path does)."""
    as_user: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            return [Row(fault="read-only directories", group="read-only", expected="-",
                        verdict=SKIPPED, observed="running as root without setpriv")]  # fmt: skip
        as_user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    ro = Path(tempfile.mkdtemp(prefix="zerojax-faults-read-only-"))
    try:
        return _read_only_faults(base_root, ro, as_user, timeout, scratch)
    finally:
        for path in [ro, *ro.rglob("*")]:
            with contextlib.suppress(OSError):
                path.chmod(0o755 if path.is_dir() else 0o644)
        shutil.rmtree(ro, ignore_errors=True)


def _read_only_faults(
    base_root: Path, ro: Path, as_user: list[str], timeout: float, keep: Path
) -> list[Row]:
    """The read-only scenarios in `ro`; the children's stderr is kept in `keep`."""
    base = ro / "base"
    shutil.copytree(
        base_root, base, ignore=lambda d, names: [n for n in names if n.endswith(".pt")]
    )
    for name in ("ro_dir", "ro_step", "ro_oldest", "ro_no_close", "ro_unreadable"):
        shutil.copytree(base_root / "ckpt", ro / name / "ckpt")
    (ro / "ro_dir" / "out").mkdir()
    (ro / "home").mkdir()
    out = ro / "read_only.json"  # written by the child: its end
    if as_user:
        for path in [ro, *ro.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
    for directory in (ro / "ro_dir" / "ckpt", ro / "ro_dir" / "out", ro / "ro_no_close" / "ckpt"):
        directory.chmod(0o555)
    for step_dir in (ro / "ro_step" / "ckpt" / "2", ro / "ro_oldest" / "ckpt" / "1"):
        for path in [*step_dir.rglob("*"), step_dir]:
            path.chmod(0o555 if path.is_dir() else 0o444)
    env = {**_env(), "HOME": str(ro / "home")}
    process = run_child(
        [*as_user, *worker_command("read-only", base, ro, out)],
        timeout, end_file=out, env=env, cwd=REPO,
    )  # fmt: skip
    (keep / "read_only.stderr").write_text(process.stderr or "")
    rows = _rows_from(out, process, "read-only directories", "read-only")
    rows += _hang_row("read-only: the process after the failed saves", "read-only", process)
    end = ro / "no_close.end"
    process = run_child(
        [*as_user, *worker_command("save-without-close", base, ro / "ro_no_close" / "ckpt", "", end)],
        timeout, end_file=end, env=env, cwd=REPO,
    )  # fmt: skip
    (keep / "read_only_no_close.stderr").write_text(process.stderr or "")
    rows.append(
        _no_close_row(
            "read-only checkpoint directory: async save, script ends without close()",
            "read-only",
            process,
            3,
        )
    )
    return rows


def kill_faults(
    base_root: Path, scratch: Path, count: int, seed: int, timeout: float
) -> list[dict]:
    """SIGKILL `count` asynchronous saves at random points; returns the resume specs for
    the worker (the resume runs in a fresh process there)."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        directory = scratch / f"kill{i}" / "ckpt"
        shutil.rmtree(directory.parent, ignore_errors=True)
        shutil.copytree(base_root / "ckpt", directory)
        # The save commits ~0.3-1 s after it is called here: half the kills fall early (inside
        # the write), half late (around and after the commit).
        delay = rng.uniform(0.0, 0.5) if i % 2 == 0 else rng.uniform(0.5, 1.5)
        child = subprocess.Popen(
            worker_command("kill-save", base_root, directory),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(), cwd=REPO,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        started = False
        for line in child.stdout:
            if line.startswith("SAVING"):
                started = True
                break
            if time.monotonic() > deadline:
                break
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        rest = child.stdout.read()
        child.wait()
        committed = "COMMITTED" in rest
        note = (
            f"killed {delay * 1000:.0f} ms after save(3) was called, "
            f"{'after wait() returned' if committed else 'before wait() returned'}"
            if started
            else "the child never reached save(3)"
        )
        specs.append({"type": "resume", "dir": str(directory), "note": note,
                      "label": f"SIGKILL during async save #{i + 1}: resume"})  # fmt: skip
    return specs
