"""TRL's SFTTrainer, unchanged, training a zerojax model: examples/trl_sft.py against itself
with `--plain`.

Run: .venv/bin/python -m pytest -q tests/integrations/test_trl.py -p no:cacheprovider
Why: issue 26 names TRL's SFTTrainer (composed on the Hugging Face Trainer) among the places
users launch from. It patches `model.forward` with a fused LM head that returns per-token
log-probs and computes its loss from them outside the model: the patch must be traced into the
engine (run eagerly around it, it failed in a layer norm backward on live tensors) and the
gradient must flow from an output that is not the model's own loss (the fused program raised).
Both runs are float32 (`bf16=False` in the example; see its comment).

Tolerances: per-step logged losses within 1e-5 relative (two float32 runs of one loop differ by
reordered sums, ~1e-7 per step); final weights within 1e-4 normwise over all parameters (AdamW
turns ~1e-7 gradient differences into up to lr-sized steps on near-zero second moments, so
per-tensor bounds on small tensors are not meaningful). The saved directory must load with
`from_pretrained` as the model's own class.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL is a dev dependency")
import transformers

# Two SFT runs (~9 s): make test-distributed (in CI) runs it, keeping make test under 8 minutes.
pytestmark = [pytest.mark.multidevice, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_sft.py"
STEPS = 4


def load_example():
    spec = importlib.util.spec_from_file_location("trl_sft_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sft_trainer_trains_a_zerojax_model_like_plain_sft(tmp_path):
    example = load_example()
    # Dropout off: zerojax draws its masks from JAX's generator, not torch's.
    run = ["--steps", str(STEPS), "--dropout", "0"]
    theirs = example.main([*run, "--plain", "--output-dir", str(tmp_path / "t")])
    ours = example.main([*run, "--output-dir", str(tmp_path / "z")])
    assert len(ours) == len(theirs) == STEPS
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    assert ours[-1] < ours[0]  # it trains (lr 3e-3: the loss falls within 4 steps)

    mine = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "z" / "final")
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "t" / "final")
    assert type(mine) is transformers.GPT2LMHeadModel
    names = sorted(reference.state_dict())
    assert sorted(mine.state_dict()) == names

    def flat(model):
        state = model.state_dict()
        return torch.cat([state[n].double().flatten() for n in names])

    error = float((flat(mine) - flat(reference)).norm() / flat(reference).norm())
    assert error <= 1e-4, error
