"""pytorch/examples' word_language_model, its `main.py` unchanged but for the `initialize` line.

Run: .venv/bin/python -m pytest -q tests/third_party/test_word_language_model.py -p no:cacheprovider
Why: issue 43's done-when. The script trains an LSTM language model with its own SGD
(`p.data.add_(p.grad, alpha=-lr)`) or AdamW (`--use-optimizer`), clips with
`clip_grad_norm_`, anneals the learning rate, saves the whole model with `torch.save(model, f)`
and loads it back (`weights_only`, its classes allowed) for the test loss. That save raised
PicklingError under zerojax. Each run is launched as a user launches it (tests/third_party/
launch.py, which records every loss), on a tiny corpus written here (no downloads), and
compared with the same script without its zerojax line: training, validation and test losses
within 1e-5 relative (two float32 runs of one loop differ by reordered sums, ~1e-7 per step,
amplified over ~40 steps of lr 20 to a few 1e-6 at most).

`--model Transformer` (torch's `nn.Transformer` subclassed, its encoder given the square causal
mask the model builds and caches in its forward) failed to capture; it now trains like torch
at ZeRO-0 and ZeRO-3 and its whole-module save loads in a plain torch process. Its encoder
layers use dropout 0.1 whatever `--dropout` says (`TransformerModel` passes no dropout to
`nn.Transformer.__init__`), and zerojax's dropout masks are JAX's random numbers, not torch's,
so the comparison runs both scripts under launch.py's `--no-dropout`; a run with the script's
dropout on is checked to train, save and load.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from tests.fresh_python import run_fresh_python

pytestmark = pytest.mark.multidevice

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "word_language_model" / "main.py"
LAUNCH = HERE / "launch.py"

CONFIGS = {
    "zero0-1-device": {"mesh": {"data": -1}, "zero_stage": 0},
    "zero3-8-devices": {
        "devices": {"platform": "cpu", "num_cpu_devices": 8},
        "mesh": {"data": -1},
        "zero_stage": 3,
    },
}


def write_corpus(directory: Path) -> None:
    """train/valid/test.txt of random 9-word sentences over 40 words (wikitext-2's layout).

    Sized so every bptt chunk is whole (rows - 1 a multiple of --bptt 8: 52 lines of 10 tokens
    with <eos> are 65 rows of --batch_size 8; 17 lines are 17 rows of the script's evaluation
    batch of 10): one training and one evaluation shape, one compilation each."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(40)]
    directory.mkdir(parents=True)
    for name, lines in (("train", 52), ("valid", 17), ("test", 17)):
        sentences = (" ".join(rng.choices(words, k=9)) for _ in range(lines))
        (directory / f"{name}.txt").write_text("\n".join(sentences) + "\n")


def write_counting_corpus(directory: Path) -> None:
    """write_corpus's layout (52/17/17 lines of 9 words over 40), each sentence counting up from
    a random word (w7 w8 ... w15, modulo 40): a pattern a 2-layer transformer learns in a few
    dozen steps, so its losses fall well below the uniform log(41) and a run that does not
    learn shows."""
    rng = random.Random(0)
    directory.mkdir(parents=True)
    for name, lines in (("train", 52), ("valid", 17), ("test", 17)):
        starts = (rng.randrange(40) for _ in range(lines))
        sentences = (" ".join(f"w{(s + k) % 40}" for k in range(9)) for s in starts)
        (directory / f"{name}.txt").write_text("\n".join(sentences) + "\n")


CORPORA = {"LSTM": ("corpus", write_corpus), "Transformer": ("counting", write_counting_corpus)}


def run(
    tmp_path: Path,
    name: str,
    config: dict | None,
    *script_args: str,
    model: str = "LSTM",
    launch_options: tuple[str, ...] = (),
) -> list[float]:
    """The script, with zerojax (`config`) or without (None); every loss it computed."""
    out = tmp_path / name
    out.mkdir()
    corpus_name, write = CORPORA[model]
    corpus = tmp_path / corpus_name
    if not corpus.exists():
        write(corpus)
    launch = [str(LAUNCH), "--losses", str(out / "losses.json"), *launch_options]
    if config is None:
        launch.append("--plain")
    else:
        (out / "zerojax.json").write_text(json.dumps(config))
    args = [
        "--data", str(corpus), "--model", model, "--emsize", "16", "--nhid", "16",
        "--nlayers", "2", "--dropout", "0", "--epochs", "3", "--batch_size", "8",
        "--bptt", "8", "--log-interval", "5", "--save", str(out / "model.pt"), *script_args,
    ]  # fmt: skip
    with mock.patch.dict(os.environ, {"ZEROJAX_CONFIG": str(out / "zerojax.json")}):
        done = run_fresh_python([*launch, str(SCRIPT), *args], timeout=900, cwd=out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "End of training" in done.stdout
    return json.loads((out / "losses.json").read_text())


OPTIMIZERS = {"sgd": (), "adamw": ("--use-optimizer", "--lr", "0.003")}


@pytest.fixture(scope="module")
def torch_losses(tmp_path_factory):
    """Plain torch's losses for an optimizer choice (run once, when first asked for)."""
    base = tmp_path_factory.mktemp("torch")
    runs: dict[str, list[float]] = {}

    def losses(optimizer: str) -> list[float]:
        if optimizer not in runs:
            runs[optimizer] = run(base, optimizer, None, *OPTIMIZERS[optimizer])
        return runs[optimizer]

    return losses


_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


# On torch 2.11 capturing nn.LSTM with an (h, c) hidden state passed in is not supported yet:
# torch raises "For batched 3-D input, hx and cx should also be 3-D but got (4-D, 4-D)
# tensors" inside the capture (torch 2.13 and 2.14 capture it). strict: the day it captures,
# this mark must go.
@pytest.mark.xfail(
    _TORCH < (2, 13),
    reason=(
        "on torch 2.11, torch.export cannot capture this script's nn.LSTM called with its "
        "carried (h, c) state (torch raises 'hx and cx should also be 3-D'); torch 2.13 and "
        "2.14 capture it: train LSTMs that carry their state with torch >= 2.13"
    ),
    strict=True,
)
@pytest.mark.parametrize(
    "config",
    ["zero0-1-device", pytest.param("zero3-8-devices", marks=pytest.mark.slow)],
)
@pytest.mark.long
def test_lstm_with_its_own_sgd_and_torch_save_of_the_model(torch_losses, tmp_path, config):
    ours = run(tmp_path, "zerojax", CONFIGS[config])
    # Every training step's loss (3 epochs of 8), each epoch's validation losses and the test
    # losses of the model the script saved whole and loaded back (plain torch from then on).
    theirs = torch_losses("sgd")
    assert len(ours) == len(theirs) == 3 * 8 + 3 * 2 + 2
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    # What `torch.save(model, f)` wrote: the user's RNNModel, nothing of zerojax's.
    assert b"zerojax" not in (tmp_path / "zerojax" / "model.pt").read_bytes().lower()


@pytest.mark.slow
def test_lstm_with_adamw(torch_losses, tmp_path):
    ours = run(tmp_path, "zerojax", CONFIGS["zero0-1-device"], *OPTIMIZERS["adamw"])
    theirs = torch_losses("adamw")
    assert len(ours) == len(theirs) == 3 * 8 + 3 * 2 + 2
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


# --model Transformer at the pytorch/examples README's Transformer settings but --lr 2 (its
# command uses 5): with clipping at 0.25 each SGD step moves the weights by lr * 0.25, and at
# lr 5 on this corpus a 1-ulp difference in the weights grows to ~2e-5 in the last losses (plain
# torch against itself with every initial weight scaled by 1 + 1.2e-7 * N(0, 1)); at lr 2 that
# same perturbation moves plain torch's own losses by at most 1.7e-6 over the run, and zerojax,
# whose float32 sums are ordered differently (~1e-7 relative per forward), measured 5.4e-7
# (ZeRO-0) and 3.6e-7 (ZeRO-3). So the 1e-5 relative holds with a margin of ~6x over
# the problem's own conditioning.
TRANSFORMER = ("--lr", "2")
NO_DROPOUT = ("--no-dropout",)


@pytest.fixture(scope="module")
def torch_transformer(tmp_path_factory):
    """Plain torch's Transformer run without dropout: (losses, run folder)."""
    base = tmp_path_factory.mktemp("torch-transformer")
    losses = run(base, "plain", None, *TRANSFORMER, model="Transformer", launch_options=NO_DROPOUT)
    return losses, base / "plain"


def load_in_plain_torch(checkpoint: Path) -> dict[str, torch.Tensor]:
    """`checkpoint` (a `torch.save(model, f)` of the Transformer) loaded as the script loads it
    (`weights_only`, its list of allowed classes) in a fresh Python that never imports zerojax;
    its state_dict."""
    weights = checkpoint.with_suffix(".state_dict.pt")
    program = f"""
import sys, torch
sys.path.insert(0, {str(SCRIPT.parent)!r})
from model import PositionalEncoding, TransformerModel
allowed = [
    PositionalEncoding, TransformerModel, torch.nn.functional.relu,
    torch.nn.modules.activation.MultiheadAttention, torch.nn.modules.container.ModuleList,
    torch.nn.modules.dropout.Dropout, torch.nn.modules.linear.Linear,
    torch.nn.modules.linear.NonDynamicallyQuantizableLinear,
    torch.nn.modules.normalization.LayerNorm, torch.nn.modules.sparse.Embedding,
    torch.nn.modules.transformer.TransformerEncoder,
    torch.nn.modules.transformer.TransformerEncoderLayer,
]
with torch.serialization.safe_globals(allowed):
    model = torch.load({str(checkpoint)!r}, weights_only=True)
assert type(model) is TransformerModel, type(model)
assert {{type(p) for p in model.parameters()}} == {{torch.nn.Parameter}}
assert not any(name.startswith("zerojax") for name in sys.modules)
torch.save(model.state_dict(), {str(weights)!r})
"""
    done = run_fresh_python(["-c", program], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(weights)


@pytest.mark.parametrize(
    "config",
    ["zero0-1-device", pytest.param("zero3-8-devices", marks=pytest.mark.slow)],
)
@pytest.mark.long
def test_transformer_without_dropout_trains_like_torch_and_saves_a_plain_model(
    torch_transformer, tmp_path, config
):
    ours = run(
        tmp_path, "zerojax", CONFIGS[config], *TRANSFORMER,
        model="Transformer", launch_options=NO_DROPOUT,
    )  # fmt: skip
    theirs, plain = torch_transformer
    # 3 epochs of 8 training steps, 2 validation chunks per epoch, 2 test chunks (the test
    # losses are those of the model the script saved whole and loaded back).
    assert len(ours) == len(theirs) == 3 * 8 + 3 * 2 + 2
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert np.mean(theirs[16:24]) < np.mean(theirs[:8]) - 0.5  # a run that learned
    checkpoint = tmp_path / "zerojax" / "model.pt"
    assert b"zerojax" not in checkpoint.read_bytes().lower()
    loaded, reference = load_in_plain_torch(checkpoint), load_in_plain_torch(plain / "model.pt")
    assert loaded.keys() == reference.keys()
    # The saved weights (entries <= 1.4) after all 24 steps (the validation loss falls every
    # epoch, so both runs save epoch 3's): measured within 4.8e-7 of torch's; 10x that.
    for name, value in reference.items():
        np.testing.assert_allclose(loaded[name], value, rtol=0, atol=5e-6, err_msg=name)


@pytest.mark.slow
def test_transformer_with_the_scripts_dropout_trains_saves_and_loads(tmp_path):
    """The script as a user runs it: `--dropout 0.2` (its default) in the positional encoding,
    torch's 0.1 in every encoder layer. zerojax draws the masks, so only the run's health is
    checked: finite losses, a falling training loss, a checkpoint plain torch loads."""
    ours = run(
        tmp_path, "zerojax", CONFIGS["zero0-1-device"], *TRANSFORMER, "--dropout", "0.2",
        model="Transformer",
    )  # fmt: skip
    assert len(ours) == 3 * 8 + 3 * 2 + 2
    assert np.isfinite(ours).all(), ours
    assert np.mean(ours[16:24]) < np.mean(ours[:8]) - 0.3, ours
    checkpoint = tmp_path / "zerojax" / "model.pt"
    assert b"zerojax" not in checkpoint.read_bytes().lower()
    weights = load_in_plain_torch(checkpoint)
    assert all(torch.isfinite(value).all() for value in weights.values())
