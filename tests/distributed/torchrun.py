"""Run a script under `python -m torch.distributed.run` on 127.0.0.1, bounded in time.

Every run gets free ports (MASTER_PORT and the JAX coordinator's MASTER_PORT + 1, drawn below
the ephemeral port range), a marker in its environment (on timeout every process carrying it
is killed: torchrun starts each rank in its own session, and a rank whose agent died is no
longer its descendant, so neither a process group nor the process tree reaches them all),
output to a file (an orphaned rank holding a pipe would block the reader forever) and a clean
environment: tests/conftest.py's XLA_FLAGS (8 devices in *this* process) is dropped,
each rank sets its own device count, and PYTHONPATH puts this checkout's zerojax first.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from zerojax.distributed import COORDINATOR_PORT_OFFSET

REPO = Path(__file__).resolve().parents[2]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_master_port() -> int:
    """A port that is free, and whose coordinator port (+ offset) is free too.

    Drawn at random from below the kernel's ephemeral range: a port found by binding port 0 lies
    inside it, where every outgoing connection (the ranks' gloo and TCPStore clients, a parallel
    test's) takes its local port, so one could take the pair between this check and torchrun's
    bind. The random draw (from the OS, not a seeded generator) keeps parallel test workers apart.
    """
    low_ephemeral, _ = _ephemeral_port_range()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(10_000, low_ephemeral - COORDINATOR_PORT_OFFSET)
        if _port_is_free(port) and _port_is_free(port + COORDINATOR_PORT_OFFSET):
            return port
    raise RuntimeError(f"no free pair of ports found on 127.0.0.1 in [10000, {low_ephemeral})")


def kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment carries ZEROJAX_TEST_RUN=marker (Linux /proc)."""
    needle = f"ZEROJAX_TEST_RUN={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle in environ.read().split(b"\0"):
                    os.kill(int(entry), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # gone, or not ours to read


def torchrun(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 240,
    extra_env: dict[str, str] | None = None,
    torchrun_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run `script args` on `nproc` local ranks; returns the finished process (output merged into
    stdout). On timeout every process of the run is killed and AssertionError raised with the
    output so far."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        OMP_NUM_THREADS="1",
        ZEROJAX_TEST_RUN=marker,
        **(extra_env or {}),
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_master_port()}",
        *torchrun_args,
        str(script),
        *args,
    ]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        try:
            process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        # Also after a normal exit: a rank orphaned by a dead agent must not outlive the test.
        kill_marked(marker)
        process.wait()
        log.seek(0)
        output = log.read()
    if timed_out:
        raise AssertionError(
            f"torchrun {script} did not finish within {timeout} s; killed. Output:\n{output[-6000:]}"
        )
    return subprocess.CompletedProcess(command, process.returncode, output, None)


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-6000:]}"
