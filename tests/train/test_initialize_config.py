"""What `zerojax.initialize` takes from the config itself: `devices:` and `optimizer:`.

Run: .venv/bin/python -m pytest -q tests/train/test_initialize_config.py -p no:cacheprovider
Why: issue 15 (a script whose only zerojax call is `initialize(model, opt, config="c.yaml")`
with `devices: {num_cpu_devices: 4}` must run on 4 devices; checked in a fresh process, since
this one already runs JAX with 8) and issue 14 (every config key has an effect: `optimizer:`
builds the optimizer or is checked against the user's).
"""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path

import jax
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import MLP
from tests import tolerances
from tests.fresh_python import run_fresh_python
from zerojax.config import ConfigError

pytestmark = pytest.mark.multidevice

REPO = Path(__file__).resolve().parents[2]
ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3}
ADAMW = {"type": "AdamW", "params": {"lr": 2e-2, "betas": [0.8, 0.95], "weight_decay": 0.1}}

SCRIPT = textwrap.dedent(
    """
    import gc, json, sys
    import torch, zerojax
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model, opt = zerojax.initialize(net, None, config=sys.argv[1])
    import jax
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    torch_clip = torch.nn.utils.clip_grad_norm_
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
    opt.step()
    result = {
        "devices": jax.device_count(),
        "mesh": dict(model.engine.mesh.shape),
        "optimizer": type(opt._optimizer).__name__,
        "lr": opt.param_groups[0]["lr"],
        "unpatched": torch_clip is torch.nn.utils.clip_grad.clip_grad_norm_
        and torch_clip.__module__ == "torch.nn.utils.clip_grad",
        "norm": norm,
    }
    print(json.dumps(result))
    """
)


@pytest.mark.slow  # ~25 s: a fresh Python with torch, JAX and a compile
def test_initialize_applies_devices_section_in_a_fresh_process(tmp_path):
    """Issue 15's done-when, plus `optimizer:` built from the config and torch's own
    clip_grad_norm_ (unpatched) clipping on the shards. (Fast representative of the same `apply_devices` path:
    test_devices_after_jax_started_says_what_to_do.)"""
    config = tmp_path / "c.yaml"
    config.write_text(
        "devices: {num_cpu_devices: 4}\n"
        "zero_stage: 3\n"
        "optimizer: {type: AdamW, params: {lr: 1.0e-3}}\n"
        "runtime: {compilation_cache_dir: null}\n"
    )
    done = run_fresh_python(["-c", SCRIPT, str(config)], timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4 and result["mesh"] == {"data": 4}
    assert result["optimizer"] == "AdamW" and result["lr"] == 1e-3
    assert result["unpatched"] and result["norm"] > 1e-3


def test_devices_after_jax_started_says_what_to_do():
    assert jax.device_count() == 8  # JAX has started (conftest's 8 devices) before initialize
    net = MLP()
    with pytest.raises(ConfigError) as info:
        zerojax.initialize(net, None, {"devices": {"num_cpu_devices": 4}})
    message = str(info.value)
    assert message.startswith(
        "devices.num_cpu_devices=4: JAX already started with 8 CPU devices"
    ), message
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in message
    assert "before anything else uses JAX" in message


def test_optimizer_section_builds_the_optimizer_and_trains_like_torch():
    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    model, optimizer = zerojax.initialize(module, None, {**ZERO3, "optimizer": ADAMW})
    built = optimizer._optimizer
    assert type(built) is torch.optim.AdamW
    assert built.defaults["lr"] == 2e-2 and built.defaults["betas"] == (0.8, 0.95)
    assert built.defaults["weight_decay"] == 0.1
    exact = copy.deepcopy(reference).double()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=2e-2, betas=(0.8, 0.95))
    ref_optimizer.param_groups[0]["weight_decay"] = 0.1
    exact_optimizer = torch.optim.AdamW(exact.parameters(), lr=2e-2, betas=(0.8, 0.95))
    exact_optimizer.param_groups[0]["weight_decay"] = 0.1
    for _ in range(2):
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        for m, opt, inputs in (
            (model, optimizer, x),
            (reference, ref_optimizer, x),
            (exact, exact_optimizer, x.double()),
        ):
            F.cross_entropy(m(inputs), y).backward()
            opt.step()
            opt.zero_grad()
    # AdamW turns gradient rounding differences into up to lr-sized steps: held to torch's own
    # float32 error against the float64 run, all parameters at once.
    tolerances.assert_params_within_torch_error(
        model.state_dict(), reference.state_dict(), exact.state_dict(), "parameters"
    )


def test_deepspeed_optimizer_section_builds_adamw():
    module = MLP()
    ds = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    _, optimizer = zerojax.initialize(module, None, ds)
    assert type(optimizer._optimizer) is torch.optim.AdamW  # DeepSpeed's Adam is AdamW


MISMATCHES = [
    (
        lambda params: torch.optim.SGD(params, lr=2e-2),
        ADAMW,
        (
            "optimizer.type='adamw' in the config, but the torch optimizer passed to "
            "zerojax.initialize is SGD; pass optimizer=None to have zerojax build it from the "
            "config, or remove the config's optimizer section"
        ),
    ),
    (
        lambda params: torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1),
        ADAMW,
        (
            "optimizer.params.lr=0.02 in the config, but the torch AdamW has lr=0.001 in its "
            "param group; make them agree, or pass optimizer=None to have zerojax build it from "
            "the config"
        ),
    ),
    (
        lambda params: torch.optim.AdamW(params, lr=2e-2, betas=(0.9, 0.999), weight_decay=0.1),
        ADAMW,
        (
            "optimizer.params.betas=[0.8, 0.95] in the config, but the torch AdamW has "
            "betas=(0.9, 0.999) in its param group; make them agree, or pass optimizer=None to "
            "have zerojax build it from the config"
        ),
    ),
    (
        lambda params: torch.optim.Adam(params, lr=1e-3),
        {"type": "AdamW", "params": {"lr": 1e-3}},
        (
            "optimizer.type='adamw' in the config, but the torch optimizer passed to "
            "zerojax.initialize is Adam (a DeepSpeed 'Adam' is AdamW unless "
            "optimizer.params.adam_w_mode is false); pass optimizer=None to have zerojax build "
            "it from the config, or remove the config's optimizer section"
        ),
    ),
]


@pytest.mark.parametrize(
    "make, section, message", MISMATCHES, ids=["type", "lr", "betas", "deepspeed-adam"]
)
def test_optimizer_contradicting_the_config_is_an_error(make, section, message):
    module = MLP()
    with pytest.raises(ValueError) as info:
        zerojax.initialize(module, make(module.parameters()), {**ZERO3, "optimizer": section})
    assert str(info.value) == message


def test_optimizer_agreeing_with_the_config_is_accepted():
    """Per-group overrides (no decay on biases) and a scheduler that already moved lr are
    torch's own ways of using the configured values, not contradictions."""
    module = MLP()
    groups = [
        {"params": [p for p in module.parameters() if p.ndim >= 2]},
        {"params": [p for p in module.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=2e-2, betas=(0.8, 0.95), weight_decay=0.1)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1)  # lr is now 2e-3
    _, wrapped = zerojax.initialize(module, optimizer, {**ZERO3, "optimizer": ADAMW})
    assert wrapped.param_groups is optimizer.param_groups
