"""Test setup: 8 simulated CPU devices, set before anything imports jax."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import logging
from pathlib import Path

import jax
import jax.experimental.pallas.fuser  # jax 0.11.2 registers a tracing flag on its first use
import pytest
import torch

try:  # jax >= 0.11: Pallas Triton lowers only for a GPU it knows; lower for an H100 from CPU
    from jax._src.pallas.triton import gpu_info as _gpu_info

    _gpu_info.registry.setdefault(
        "cpu", lambda: _gpu_info.get_gpu_info_from_version(_gpu_info.GpuVersion.H100)
    )
except ImportError:  # jax 0.10 assumes compute capability 9.0 when no GPU is present
    pass

from tools.cpu_torchvision import define_missing_schemas
from zerojax.runtime.compilation_cache import enable_compilation_cache

# transformers imports torchvision whenever it is installed (the dev extra has it for the model
# zoo), and the registry's CUDA-built torchvision only imports after this (see the module).
define_missing_schemas()

# Compiled XLA programs persist in <repo>/.cache/jax (gitignored), through zerojax's own switch
# (every program, however fast to compile), so a rerun loads instead of compiling: a third of a
# bridge test file's time. Tests that call zerojax.initialize() move the cache to their config's
# runtime.compilation_cache_dir (default ~/.cache/zerojax/jax), as it does for a user. JAX keys
# entries by XLA_FLAGS too, so `make test-other-cpu` never loads this CPU's programs.
enable_compilation_cache(str(Path(__file__).resolve().parents[1] / ".cache" / "jax"))


@pytest.fixture(autouse=True)
def _seed():
    """Fresh but reproducible random inputs per test."""
    torch.manual_seed(0)
    yield


# torch.export logs every traced op at DEBUG on this logger; pytest would print it all on failure.
logging.getLogger("torch.__trace").setLevel(logging.INFO)


def pytest_addoption(parser):
    parser.addoption(
        "--torch-without-onednn",
        action="store_true",
        help="run torch eager without oneDNN (torch.backends.mkldnn), as on a CPU without "
        "AVX512-BF16: bf16 convolutions and matmuls then take ATen's own kernels, which round "
        "differently (see `make test-other-cpu`)",
    )


def pytest_configure(config):
    if config.getoption("--torch-without-onednn"):
        torch.backends.mkldnn.enabled = False


def pytest_report_header(config):
    return (
        f"jax {jax.__version__} devices={jax.device_count()} torch {torch.__version__} "
        f"torch-cpu={torch.backends.cpu.get_cpu_capability()} "
        f"onednn={torch.backends.mkldnn.enabled} XLA_FLAGS={os.environ['XLA_FLAGS']!r}"
    )


def pytest_sessionfinish(session, exitstatus):
    """A run that selected no test is a failure (exit 1), never pytest's exit code 5: a `-m`/`-k`
    or collection mistake in `make test` or .ci/run must not read as anything but red."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "no tests were selected: check the -m / -k expression and the paths", red=True
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
