"""The `zerojax plan` command.

Run: .venv/bin/python -m pytest -q tests/test_cli.py
Exists because `zerojax plan` is how a user checks a mesh config before paying for a machine: it
must set up the config's simulated devices itself (the subprocess gets no XLA_FLAGS), print the
memory table and write the stage 0-3 plot.
"""

import json
import textwrap
from pathlib import Path

import pytest

from tests.fresh_python import run_fresh_python
from zerojax.cli import CLIError, load_factory, main

REPO = Path(__file__).resolve().parents[1]

FACTORY = """
import torch

def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return model, (torch.randn(8, 16),)

not_a_pair = lambda: torch.nn.Linear(2, 2)
"""

CONFIG = """
devices: {platform: cpu, num_cpu_devices: 8}
mesh: {data: -1}
zero_stage: 3
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "factory.py").write_text(textwrap.dedent(FACTORY))
    (tmp_path / "mesh.yaml").write_text(CONFIG)
    return tmp_path


@pytest.mark.long
def test_plan_prints_table_and_writes_plot(files):
    plot = files / "plan.png"
    # The config must set the device count: no XLA_FLAGS in a fresh process.
    result = run_fresh_python(
        ["-m", "zerojax.cli", "plan", "--config", str(files / "mesh.yaml"),
         f"{files / 'factory.py'}:build", "--plot", str(plot)],
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # Psi = 16*32 + 32 + 32*8 + 8 = 808; stage 3 on 8 devices: 4Psi/8 = 404 bytes of params.
    assert "ZeRO stage 3 on mesh data=8 (N_d=8), Ψ=808 parameters" in out
    lines = {line.split("  ")[0]: line.split() for line in out.splitlines()}
    assert lines["params"][1:] == ["404", "404", "4Ψ/N_d", "1.000"]
    assert lines["gradients"][1:] == ["404", "404", "4Ψ/N_d", "1.000"]
    assert "compiled programs, memory_analysis() per device:" in out
    assert "  update: arguments" in out
    assert f"plot written to {plot}" in out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_factory_spec_errors(files, capsys):
    with pytest.raises(CLIError, match=r"expected MODULE:NAME .* or FILE\.py:NAME"):
        load_factory("no_colon_here")
    with pytest.raises(CLIError, match=r"no such file"):
        load_factory("missing/file.py:build")
    with pytest.raises(CLIError, match=r"has no callable named 'nope'"):
        load_factory(f"{files / 'factory.py'}:nope")
    assert load_factory("bench.architectures:mlp").__name__ == "mlp"
    code = main(
        ["plan", "--config", str(files / "mesh.yaml"), f"{files / 'factory.py'}:not_a_pair"]
    )
    assert code == 2
    assert "must return (module, example_args)" in capsys.readouterr().err


@pytest.mark.long
def test_plan_json_is_one_object_with_the_step_peak(files):
    command = ["-m", "zerojax.cli", "plan", "--config", str(files / "mesh.yaml")]
    command += [f"{files / 'factory.py'}:build", "--json", "--describe"]
    result = run_fresh_python(command, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # --describe went to stderr
    assert "0.weight" in result.stderr
    assert report["num_params"] == 808 and report["mesh"] == {"data": 8}
    assert report["components"]["params"]["measured"] == 404
    states = sum(c["measured"] for c in report["components"].values())
    assert report["states"] == states
    assert report["step_peak"] == states + report["activations"]
    assert set(report["programs"]) == {"forward_vjp", "backward", "update"}
    assert report["step_peak"] >= max(p["peak_estimate"] for p in report["programs"].values())


@pytest.mark.long
def test_plan_for_devices_you_do_not_have_matches_the_real_plan(files):
    """`--devices 8` builds the model on the meta device and compiles the step for 8
    simulated devices, never running it: the JSON report is the real run's, byte for byte."""
    command = ["-m", "zerojax.cli", "plan", "--config", str(files / "mesh.yaml")]
    command += [f"{files / 'factory.py'}:build", "--json"]
    reports = []
    for extra in ([], ["--devices", "8"]):
        result = run_fresh_python(command + extra, timeout=120)
        assert result.returncode == 0, result.stderr
        reports.append(json.loads(result.stdout))
    real, planned = reports
    assert planned == real


@pytest.mark.long
def test_plan_says_whether_the_step_fits_a_device_with_offload(files):
    """`--device-gb`/`--host-gb` answer "does it fit?" from the planned peaks: offloading the
    optimizer state, masters and gradients (DeepSpeed's offload_optimizer: cpu) takes them out
    of the device peak and into the host's, and the exit status says whether it fits."""
    deepspeed = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": True},
    }
    (files / "ds_offload.json").write_text(json.dumps(deepspeed))
    del deepspeed["zero_optimization"]["offload_optimizer"]
    (files / "ds_device.json").write_text(json.dumps(deepspeed))
    peaks = {}
    for name in ("device", "offload"):
        command = ["-m", "zerojax.cli", "plan", "--config", str(files / f"ds_{name}.json")]
        command += [f"{files / 'factory.py'}:build", "--devices", "8", "--json"]
        result = run_fresh_python(command + ["--device-gb", "1"], timeout=120)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["fits"] is True
        peaks[name] = report["step_peak"], report["host_step_peak"]
    (device, device_host), (offloaded, offloaded_host) = peaks["device"], peaks["offload"]
    assert offloaded < device and device_host == 0 and offloaded_host > 0
    # A budget between the two peaks: the offloaded step fits, the other does not.
    budget = f"{(device + offloaded) / 2 / 1e9:.9f}"
    for name, fits in (("device", False), ("offload", True)):
        command = ["-m", "zerojax.cli", "plan", "--config", str(files / f"ds_{name}.json")]
        command += [f"{files / 'factory.py'}:build", "--devices", "8", "--device-gb", budget]
        result = run_fresh_python(command, timeout=120)
        assert result.returncode == (0 if fits else 1), result.stderr
        verdict = result.stdout.strip().splitlines()[-1]
        assert verdict.startswith("fits: device peak" if fits else "does not fit: device peak")
