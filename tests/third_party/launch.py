"""Run a third-party training script as `python script.py ARGS` does, with its one zerojax line
or (`--plain`) without it, and record every loss its criterion computes.

    python tests/third_party/launch.py --losses OUT.json [--plain] [--fake-data N:M ...]
        [--fake-image-size S] [--no-dropout] [--record-loss MODULE:CLASS ...]
        [--record-backward] [--path DIR ...] SCRIPT [ARGS ...]

The scripts print their losses rounded (`loss 5.21`); the comparison with plain torch needs
them whole, so `torch.nn.NLLLoss` and `torch.nn.CrossEntropyLoss` record each value they return
(training and evaluation, in call order), written to OUT.json when the script ends;
`--record-loss timm.loss:SoftTargetCrossEntropy` records a script's own loss module as well;
`--record-backward` records instead every tensor whose `backward()` the script calls, its
training loss wherever it is computed (minGPT's model computes it in its forward, which zerojax
runs as its program).
The script runs as `__main__` from its own folder on `sys.path` (its `import data`, `from model
import ...`) and each `--path DIR` too (the project a script imports as if `pip install -e`
made it importable: minGPT's `mingpt`), its text unchanged but for dropping the line marked
`# zerojax: the one added line` under `--plain`. `--fake-data N:M` makes a
`torchvision.datasets.FakeData` of N images (imagenet's `--dummy`: 1281167 and 50000 of
3x224x224) one of M, and `--fake-image-size S` its images SxS, so that a run on CPU takes
seconds.

`--no-dropout` builds every dropout of torch's modules with probability 0, for a run compared
with plain torch loss for loss: zerojax draws dropout masks from JAX's random numbers, never
torch's, so a seeded run with dropout on cannot give torch's losses. A script's own flag is
not always enough: word_language_model's `TransformerModel` calls `nn.Transformer.__init__`
without a dropout, so its encoder layers keep torch's default 0.1 whatever `--dropout` says.
The probability is set right after each module's own `__init__` (`nn.Dropout`, `Dropout1d/2d/
3d`, `AlphaDropout`, ...: `_DropoutNd`; `nn.MultiheadAttention`'s attention-weight dropout),
the least a run can change: the script's calls and module classes stay as they are, so its
pickles name torch's classes, and the patch applies to the plain and the zerojax run alike. A
functional `F.dropout(x, p)` with a literal `p` in a script's own forward is not reached. Run by tests/third_party/test_*.py (not a test
module itself).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

MARK = "# zerojax: the one added line"


def recording(criterion: type[torch.nn.Module], losses: list[float]) -> None:
    forward = criterion.forward

    def recorded(self, *args, **kwargs):
        loss = forward(self, *args, **kwargs)
        losses.append(loss.item())
        return loss

    criterion.forward = recorded


def recording_backward(losses: list[float]) -> None:
    """Record the value of each tensor whose `backward()` the script calls; not zerojax's own
    calls (it probes torch's gradient conventions on plain tensors when it is imported)."""
    backward = torch.Tensor.backward
    zerojax_code = str(Path(__file__).resolve().parents[2] / "zerojax")

    def recorded(self, *args, **kwargs):
        if not sys._getframe(1).f_code.co_filename.startswith(zerojax_code):
            losses.append(self.item())
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = recorded


def smaller_fake_data(sizes: dict[int, int], image_size: int | None) -> None:
    from torchvision import datasets

    init = datasets.FakeData.__init__

    def smaller(self, size=1000, image_size_=(3, 224, 224), *args, **kwargs):
        if image_size is not None:
            image_size_ = (image_size_[0], image_size, image_size)
        init(self, sizes.get(size, size), image_size_, *args, **kwargs)

    datasets.FakeData.__init__ = smaller


def without_dropout() -> None:
    """Every dropout module built from here on drops nothing (module docstring)."""
    from torch.nn.modules.dropout import _DropoutNd

    def built_with_zero(cls: type, attribute: str) -> None:
        init = cls.__init__

        def zero(self, *args, **kwargs):
            init(self, *args, **kwargs)
            setattr(self, attribute, 0.0)

        cls.__init__ = zero

    built_with_zero(_DropoutNd, "p")
    built_with_zero(torch.nn.MultiheadAttention, "dropout")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--losses", required=True)
    parser.add_argument("--plain", action="store_true", help="without the zerojax line")
    parser.add_argument("--fake-data", action="append", default=[], metavar="N:M")
    parser.add_argument("--fake-image-size", type=int)
    parser.add_argument("--no-dropout", action="store_true", help="every dropout p=0")
    parser.add_argument("--record-loss", action="append", default=[], metavar="MODULE:CLASS")
    parser.add_argument("--record-backward", action="store_true", help="losses backward()ed")
    parser.add_argument("--path", action="append", default=[], metavar="DIR")
    parser.add_argument("script")
    args, script_args = parser.parse_known_args()
    script = Path(args.script).resolve()
    source = script.read_text()
    if MARK not in source:
        raise SystemExit(f"{script} has no line marked {MARK!r}")
    if args.plain:
        source = "\n".join("" if MARK in line else line for line in source.splitlines())
    if args.fake_data or args.fake_image_size:
        sizes = dict(tuple(int(n) for n in pair.split(":")) for pair in args.fake_data)
        smaller_fake_data(sizes, args.fake_image_size)
    if args.no_dropout:
        without_dropout()
    sys.path[:0] = args.path  # before importing what --record-loss names
    losses: list[float] = []
    if args.record_backward:
        recording_backward(losses)
    else:
        for criterion in (torch.nn.NLLLoss, torch.nn.CrossEntropyLoss):
            recording(criterion, losses)
    for name in args.record_loss:
        module, _, cls = name.partition(":")
        recording(getattr(importlib.import_module(module), cls), losses)
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.parent))
    try:
        exec(
            compile(source, str(script), "exec"), {"__name__": "__main__", "__file__": str(script)}
        )
    finally:
        Path(args.losses).write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
