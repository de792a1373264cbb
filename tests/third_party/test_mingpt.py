"""karpathy/minGPT's adder project, `projects/adder/adder.py` unchanged but for the `initialize`
line.

Run: .venv/bin/python -m pytest -q tests/third_party/test_mingpt.py -p no:cacheprovider
Why: issue 42's minGPT case. minGPT's `Trainer.run` builds its AdamW from
`model.configure_optimizers()` (two param groups: weight decay on the matrices only) after the
model is placed, then loops `model.zero_grad(set_to_none=True); loss.backward();
clip_grad_norm_(model.parameters(), 1.0); optimizer.step()`. That AdamW, built after
`initialize`, is adopted as the compiled update (`zerojax.train.late_optimizers`). The script
also evaluates with `model.generate` (inputs growing one token a call) at its first iteration
and `torch.save`s `model.state_dict()`. Launched as a user launches it (tests/third_party/
launch.py, `mingpt` importable as `pip install -e .` makes it), on 1-digit sums so that a run
takes seconds, and compared with the same script without its zerojax line: every training loss
within 1e-5 relative (two float32 runs of one loop differ by reordered sums, ~1e-7 a step,
amplified over a dozen AdamW steps to a few 1e-6 at most). minGPT's dropout (0.1 everywhere)
draws torch's random numbers, zerojax's JAX's, so both runs build it with p=0 (`--no-dropout`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fresh_python import run_fresh_python

HERE = Path(__file__).resolve().parent
PROJECT = HERE / "minGPT"
SCRIPT = PROJECT / "projects" / "adder" / "adder.py"
LAUNCH = HERE / "launch.py"
ITERATIONS = 12


def run(tmp_path: Path, name: str, *, plain: bool) -> tuple[list[float], str]:
    """The adder script, with its zerojax line or without; (every loss it called backward() on,
    its output and log)."""
    out = tmp_path / name
    out.mkdir()
    launch = [
        str(LAUNCH), "--losses", str(out / "losses.json"), "--no-dropout",
        "--path", str(PROJECT), "--record-backward",
    ]  # fmt: skip
    if plain:
        launch.append("--plain")
    args = [f"--trainer.max_iters={ITERATIONS}", "--trainer.num_workers=0", "--data.ndigit=1"]
    done = run_fresh_python([*launch, str(SCRIPT), *args], timeout=600, cwd=out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((out / "losses.json").read_text()), done.stdout + done.stderr


@pytest.mark.long
def test_adder_trains_like_torch(tmp_path):
    theirs, their_output = run(tmp_path, "torch", plain=True)
    ours, our_output = run(tmp_path, "zerojax", plain=False)
    # One loss per training iteration.
    assert len(ours) == len(theirs) == ITERATIONS
    assert len(set(theirs)) > 1 and all(np.isfinite(theirs))
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    # Its evaluation at iteration 0 (greedy `generate` over both splits) ran and printed; in
    # the zerojax run through the engine (its log names each new input shape's program).
    for output in (their_output, our_output):
        assert "train final score" in output and "test final score" in output
    assert "zerojax: new input shapes" in our_output and "zerojax" not in their_output
