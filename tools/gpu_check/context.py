"""What every section of the GPU check is handed: where it runs, how big, how long it may take,
and the timing and peak measurements all sections share.

Set up before jax is imported (`prepare_environment`): JAX must not pre-allocate 75% of the
GPU (torch runs beside it in the same process), and under `--cpu` it must see only the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable

MiB = 2**20

# Dense bf16 tensor-core FLOP/s and HBM bandwidth from NVIDIA's data sheets, by the start of
# `device_kind`. MFU is reported against these; the fraction of a *measured* peak (a large
# jnp.dot, a large copy) is reported beside it, since a kernel is judged against what the
# device reaches, and data-sheet figures are unreachable (H100 SXM: ~70-80% of 989 TFLOP/s).
DATA_SHEET_PEAKS = {
    # device_kind prefix: (bf16 dense TFLOP/s, HBM GB/s)
    "NVIDIA H200": (989.4, 4800.0),
    "NVIDIA H100 PCIe": (756.0, 2000.0),
    "NVIDIA H100 NVL": (835.0, 3900.0),
    "NVIDIA H100": (989.4, 3350.0),  # SXM5 80 GB
    "NVIDIA A100": (312.0, 2039.0),
}


def prepare_environment(cpu: bool) -> None:
    """Environment the section's process needs, before jax is imported."""
    # torch allocates from the same GPU in the same process: JAX takes memory as it needs it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # torch too, should the CPU machine have a GPU


@dataclasses.dataclass(eq=False)  # hashed by identity: measured_peaks is cached per Context
class Context:
    """cpu: tiny shapes on the CPU, Pallas interpreted (the code paths, not the numbers).
    deadline: `time.monotonic()` by which the section should have finished; a section that
    runs contenders in a loop checks `time_left()` and reports what it had to leave out."""

    cpu: bool
    deadline: float
    scratch_dir: str  # a directory of the section's own, on the machine's disk (checkpoints)

    @functools.cached_property
    def device(self):
        import jax

        return jax.devices("cpu" if self.cpu else "gpu")[0]

    @property
    def interpret(self) -> bool:
        return self.cpu

    @property
    def torch_device(self) -> str:
        return "cpu" if self.cpu else "cuda"

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def data_sheet_peaks(self) -> tuple[float, float] | None:
        """(bf16 TFLOP/s, GB/s) of this device's data sheet, or None when unknown (CPU)."""
        kind = getattr(self.device, "device_kind", "")
        for prefix, peaks in DATA_SHEET_PEAKS.items():
            if kind.startswith(prefix):
                return peaks
        return None

    @functools.cache  # noqa: B019 (one Context per process: the cache dies with the process)
    def measured_peaks(self) -> tuple[float, float]:
        """(bf16 matmul TFLOP/s, memory GB/s) measured on this device: an [n, n] @ [n, n] bf16
        jnp.dot (2 n^3 FLOPs), and `x + 1` on a large float32 array (read + write)."""
        import jax
        import jax.numpy as jnp

        matmul_n, copy_bytes = (256, MiB) if self.cpu else (8192, 2**30)
        keys = jax.random.split(jax.random.key(1), 2)
        a, b = (
            jax.device_put(jax.random.normal(key, (matmul_n, matmul_n), jnp.bfloat16), self.device)
            for key in keys
        )
        seconds = seconds_per_call(jax.jit(jnp.dot), a, b)
        tflops = 2 * matmul_n**3 / seconds / 1e12
        x = jax.device_put(jnp.ones(copy_bytes // 4, jnp.float32), self.device)
        seconds = seconds_per_call(jax.jit(lambda x: x + 1), x)
        return tflops, 2 * copy_bytes / seconds / 1e9

    def peak_bytes_in_use(self) -> int | None:
        """JAX's device-memory high-water mark of this process, or None where the backend
        keeps no statistics (the CPU)."""
        stats = self.device.memory_stats()
        return None if not stats else stats.get("peak_bytes_in_use")


def seconds_per_call(fn: Callable, *args, repeats: int = 5, calls: int = 10) -> float:
    """Median over `repeats` runs of the mean time per call of `calls` back-to-back calls,
    after one untimed call (compilation).

    Calls are dispatched asynchronously and synchronized once per run, so the device queue
    stays full and a kernel of tens of microseconds is not measured as dispatch latency.
    """
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)
