"""timm's `train.py`, unchanged but for the `initialize` line: a ResNet and a ViT with its EMA,
mixup/cutmix and gradient clipping.

Run: .venv/bin/python -m pytest -q tests/third_party/test_timm_train.py -p no:cacheprovider
(ZeRO-0 on 1 device; add `-m slow` for ZeRO-3 on 8 devices, more options and `--resume`)
Why: issue 43's done-when. The script builds the model with `create_model`, wraps it in a
`ClassificationTask` (the task module calls the model, then the loss), builds the optimizer
with `create_optimizer_v2` (two parameter groups: no weight decay on biases and norms),
mixes batches up with `FastCollateMixup` (numpy's global random state) for a
`SoftTargetCrossEntropy`, clips with `dispatch_clip_grad`, keeps a `ModelEmaV3` (a deepcopy of
the model, `_foreach_lerp_` towards its weights after each step), steps a cosine schedule per
update (`step_update`), validates the model and the EMA under `torch.inference_mode()`, and
saves `{'state_dict': get_state_dict(model, unwrap_model), 'state_dict_ema': ...,
'optimizer': optimizer.state_dict(), 'args': ...}` through its `CheckpointSaver`
(checkpoint-0, last and model_best). Launched as a user launches it (tests/third_party/
launch.py, which records every loss), on a small image folder written here (no downloads),
and compared with the same script without its zerojax line. The mixup draws the plain run's
numbers only because `import zerojax` leaves the global random states as it found them
(zerojax/runtime/global_random.py): the script seeds before it reaches that line.

Tolerances (measured on these runs; float64 = the same script with the model, its inputs and
the loss in float64). Clipping to a norm of 0.5 (the gradient norms are 5 to 8) keeps both
steps small, so unlike pytorch/examples' imagenet run (test_imagenet.py) the second step does
not reach weights where float32 gradients are ill-conditioned: plain torch float32 is within
1.1e-6 of float64 in every loss (ViT: 7e-7 after one AdamW step, 1.1e-6 for the EMA's
validation loss), zerojax within 1.4e-6 (8 devices), 2.5e-6 of plain torch. Hence every loss, the
two training losses and the model's and the EMA's validation losses after them, within 1e-5
relative. The weights and the EMA's: plain torch 1.3e-6 from float64 (ViT), zerojax 1.6e-6 from
plain torch: 1e-5. The optimizer's moments hold the gradients themselves, each float32 run
7.8e-6 from float64 (AdamW's exp_avg; SGD's momentum 1.7e-6): zerojax 1.2e-5 from plain
torch (8 devices): 5e-5.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from tests.fresh_python import run_fresh_python

pytest.importorskip("torchvision")
timm = pytest.importorskip("timm")
from timm.optim import create_optimizer_v2

pytestmark = pytest.mark.multidevice

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "timm" / "train.py"
LAUNCH = HERE / "launch.py"

CONFIGS = {
    "zero0-1-device": {"mesh": {"data": -1}, "zero_stage": 0},
    "zero3-8-devices": {
        "devices": {"platform": "cpu", "num_cpu_devices": 8},
        "mesh": {"data": -1},
        "zero_stage": 3,
    },
}

CLASSES = 4
# Per model: its create_model keywords, the script's optimizer and learning rate. The ViT is
# timm's vit_tiny_patch16_224 (12 blocks) built for 32x32 images: 4 patches and a class token.
MODELS = {
    "resnet10t": ({}, "sgd", 0.05),
    "vit_tiny_patch16_224": ({"img_size": 32}, "adamw", 1e-3),
}


def write_images(directory: Path) -> None:
    """An ImageFolder tree of random 40x40 RGB PNGs: `train/` 4 classes of 4 (two batches of 8:
    timm's training loader drops a short last batch) and `validation/` 4 of 2 (one batch), the
    split names train.py reads by default."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, per_class in (("train", 4), ("validation", 2)):
        for label in range(CLASSES):
            folder = directory / split / f"class{label}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def run(
    tmp_path: Path, model: str, config: dict | None, options: tuple[str, ...] = ()
) -> tuple[list[float], Path]:
    """The script, with zerojax (`config`) or without (None), and more of its `options`: every
    loss it computed and its checkpoint folder."""
    out = tmp_path / "run"
    out.mkdir()
    images = tmp_path / "images"
    write_images(images)
    launch = [str(LAUNCH), "--losses", str(out / "losses.json")]
    launch += ["--record-loss", "timm.loss:SoftTargetCrossEntropy"]
    if config is None:
        launch.append("--plain")
    else:
        (out / "zerojax.json").write_text(json.dumps(config))
    model_kwargs, optimizer, lr = MODELS[model]
    args = [
        "--data-dir", str(images), "--device", "cpu", "-j", "0", "--seed", "0",
        "--model", model, "--num-classes", str(CLASSES), "--img-size", "32",
        "-b", "8", "--epochs", "1", "--opt", optimizer, "--lr", str(lr),
        "--warmup-epochs", "0", "--sched-on-updates",
        "--model-ema", "--model-ema-decay", "0.9",
        "--mixup", "0.8", "--cutmix", "1.0",
        "--clip-grad", "0.5",
        "--output", str(out), "--experiment", "train",
    ]  # fmt: skip
    if model_kwargs:
        args += ["--model-kwargs", *(f"{k}={v}" for k, v in model_kwargs.items())]
    args += options
    with mock.patch.dict(os.environ, {"ZEROJAX_CONFIG": str(out / "zerojax.json")}):
        done = run_fresh_python([*launch, str(SCRIPT), *args], timeout=900, cwd=out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((out / "losses.json").read_text()), out / "train"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`runs(model, name, options)`: the losses and checkpoint folder of the plain run
    ("torch") or a zerojax config's run of `model` with more script `options`, each launched
    once for the module."""
    done: dict[tuple, tuple[list[float], Path]] = {}

    def launched(model: str, name: str, options: tuple[str, ...] = ()) -> tuple[list[float], Path]:
        if (model, name, options) not in done:
            tmp = tmp_path_factory.mktemp(f"{model}-{name}")
            done[model, name, options] = run(tmp, model, CONFIGS.get(name), options)
        return done[model, name, options]

    return launched


def relative_distance(ours: dict, theirs: dict) -> float:
    assert sorted(ours) == sorted(theirs)
    names = sorted(theirs)
    a = torch.cat([ours[n].double().flatten() for n in names])
    b = torch.cat([theirs[n].double().flatten() for n in names])
    return float((a - b).norm() / b.norm())


PARAMS = ["zero0-1-device", pytest.param("zero3-8-devices", marks=pytest.mark.slow)]


@pytest.mark.parametrize("config", PARAMS)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.long
def test_timm_train_and_its_checkpoints_load_in_torch(runs, model, config):
    """The script runs through with plain torch's losses, and the checkpoints its saver wrote,
    with nothing of zerojax's in them, load into plain timm's model (weights and EMA) and
    optimizer with plain torch's values."""
    assert_like_torch(model, runs(model, config), runs(model, "torch"))


# More of the script's options, on the ResNet at ZeRO-0, each against plain torch with the
# same options: DataLoader worker processes (the script's default is 4), channels-last
# memory format with adaptive gradient clipping (AGC: per-parameter unit-wise norms, all but
# the head) and the EMA's warmup; and `--torchcompile inductor`, which wraps the model in
# torch.compile (and compiles the plain EMA copy for its validation), against the plain
# *eager* run: on a zerojax model torch.compile changes nothing.
VARIANTS = {
    "two-workers": (("-j", "2"), ("-j", "2")),
    "channels-last-agc": (("--channels-last", "--clip-mode", "agc", "--model-ema-warmup"),) * 2,
    "torch-compile": (("--torchcompile", "inductor"), ()),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_timm_train_options(runs, variant):
    ours, theirs = VARIANTS[variant]
    model = "resnet10t"
    assert_like_torch(model, runs(model, "zero0-1-device", ours), runs(model, "torch", theirs))


@pytest.mark.slow
def test_timm_train_resumes_from_plain_torch_checkpoint(runs):
    """`--resume` of the checkpoint plain torch wrote (weights, AdamW's moments and step, the
    EMA, the epoch) for a second epoch, on the ViT at ZeRO-3 over 8 devices: zerojax's load
    path, the way round the other tests do not take, against plain torch resuming the same."""
    model = "vit_tiny_patch16_224"
    _, their_dir = runs(model, "torch")
    resume = ("--epochs", "2", "--resume", str(their_dir / "last.pth.tar"))
    assert_like_torch(model, runs(model, "zero3-8-devices", resume), runs(model, "torch", resume))


def assert_like_torch(
    model: str, zerojax_run: tuple[list[float], Path], torch_run: tuple[list[float], Path]
) -> None:
    """The checks of the module docstring, zerojax's run against plain torch's."""
    ours, our_dir = zerojax_run
    theirs, their_dir = torch_run
    # Two training steps' SoftTargetCrossEntropy on mixed-up batches, then the validation
    # CrossEntropyLoss of the model and of its EMA.
    assert len(ours) == len(theirs) == 2 + 2
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)

    # checkpoint-<epoch>, last and model_best.
    files = sorted(path.name for path in our_dir.glob("*.pth.tar"))
    assert files == sorted(path.name for path in their_dir.glob("*.pth.tar")) and len(files) == 3
    for name in files:
        assert b"zerojax" not in (our_dir / name).read_bytes().lower(), name
    # weights_only=False: timm saves its argparse Namespace under "args" (its own resume reads
    # the file the same way).
    mine = torch.load(our_dir / "last.pth.tar", weights_only=False)
    reference = torch.load(their_dir / "last.pth.tar", weights_only=False)
    assert sorted(mine) == sorted(reference)
    for key in ("epoch", "arch", "version", "metric"):
        assert mine[key] == reference[key], key

    model_kwargs, optimizer_name, lr = MODELS[model]
    plain = timm.create_model(model, num_classes=CLASSES, **model_kwargs)
    plain.load_state_dict(mine["state_dict"])
    timm.create_model(model, num_classes=CLASSES, **model_kwargs).load_state_dict(
        mine["state_dict_ema"]
    )
    optimizer = create_optimizer_v2(plain, opt=optimizer_name, lr=lr, weight_decay=2e-5)
    optimizer.load_state_dict(mine["optimizer"])
    # The learning rate the schedule left, and the groups create_optimizer_v2 made.
    assert mine["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]

    assert relative_distance(mine["state_dict"], reference["state_dict"]) <= 1e-5
    assert relative_distance(mine["state_dict_ema"], reference["state_dict_ema"]) <= 1e-5
    ours_state, their_state = mine["optimizer"]["state"], reference["optimizer"]["state"]
    assert sorted(ours_state) == sorted(their_state)
    for key, value in their_state[0].items():
        distance = relative_distance(
            {i: s[key] for i, s in ours_state.items()}, {i: s[key] for i, s in their_state.items()}
        )
        # AdamW's step counts exactly; the moments see the module docstring.
        assert distance <= (0 if value.ndim == 0 else 5e-5), (key, distance)
