"""Test setup: 8 simulated CPU devices, set before anything imports jax."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import logging

import jax
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Fresh but reproducible random inputs per test."""
    torch.manual_seed(0)
    yield


# torch.export logs every traced op at DEBUG on this logger; pytest would print it all on failure.
logging.getLogger("torch.__trace").setLevel(logging.INFO)


def pytest_report_header(config):
    return f"jax {jax.__version__} devices={jax.device_count()} torch {torch.__version__}"
