"""Training scripts written as users write them, unchanged but for the `initialize` line.

Run: .venv/bin/python -m pytest -q tests/train/test_scripts.py -p no:cacheprovider
Why: issue 24's done-when: a nanoGPT-style script (tests/train/scripts/nanogpt_style.py: its
own LR schedule, `torch.nn.utils.clip_grad_norm_`, `raw_model = model.module`, a checkpoint
dict saved with torch.save) runs under zerojax on 1 device at ZeRO-0 and on 8 devices at
ZeRO-3 with plain torch's losses (1e-5 relative: the two sides differ by reordered float32
sums, ~1e-7 per step, amplified over 8 AdamW steps to well under 1e-5), and the checkpoint it
writes loads into plain torch and resumes with the losses plain torch's own run goes on with.
(The torchrun script calling clip_grad_norm_ is tests/distributed/ddp_script.py; the EMA
recipe is in test_torch_surface.py.) The 8-device run calls the script's `main` in this
process; the 1-device run launches it with `python`, as a user does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.fresh_python import run_fresh_python
from tests.train.scripts import nanogpt_style

pytestmark = pytest.mark.multidevice

ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3}
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "train" / "scripts" / "nanogpt_style.py"


def losses_in(out) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


def run(out, *extra) -> dict[int, float]:
    """The script in this process (8 simulated devices)."""
    nanogpt_style.main(["--out", str(out), *extra])
    return losses_in(out)


def run_as_python(out, *extra) -> dict[int, float]:
    """`python nanogpt_style.py ...` as a user launches it: one CPU device (no XLA_FLAGS)."""
    done = run_fresh_python([str(SCRIPT), "--out", str(out), *extra], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses_in(out)


@pytest.fixture(scope="module")
def torch_losses(tmp_path_factory):
    return run(tmp_path_factory.mktemp("torch"))


def assert_matches_and_resumes(ours, torch_losses, out):
    iterations = sorted(torch_losses)
    np.testing.assert_allclose(
        [ours[i] for i in iterations], [torch_losses[i] for i in iterations], rtol=1e-5
    )
    # The checkpoint zerojax's run wrote, resumed by plain torch.
    resumed = run(out / "resumed", "--resume", str(out / "zerojax" / "ckpt.pt"))
    later = sorted(resumed)
    assert later[0] == nanogpt_style.CHECKPOINT_AT and later[-1] == iterations[-1]
    np.testing.assert_allclose(
        [resumed[i] for i in later], [torch_losses[i] for i in later], rtol=1e-5
    )


def test_nanogpt_style_script_at_zero3_on_8_devices(torch_losses, tmp_path):
    ours = run(tmp_path / "zerojax", "--zerojax", json.dumps(ZERO3))
    assert_matches_and_resumes(ours, torch_losses, tmp_path)


@pytest.mark.long
def test_nanogpt_style_script_launched_with_python_on_one_device(torch_losses, tmp_path):
    config = json.dumps({"mesh": {"data": -1}, "zero_stage": 0})
    ours = run_as_python(tmp_path / "zerojax", "--zerojax", config)
    assert_matches_and_resumes(ours, torch_losses, tmp_path)
