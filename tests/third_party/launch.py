"""Run a third-party training script as `python script.py ARGS` does, with its one zerojax line
or (`--plain`) without it, and record every loss its criterion computes.

    python tests/third_party/launch.py --losses OUT.json [--plain] [--fake-data N:M ...]
        [--fake-image-size S] SCRIPT [ARGS ...]

The scripts print their losses rounded (`loss 5.21`); the comparison with plain torch needs
them whole, so `torch.nn.NLLLoss` and `torch.nn.CrossEntropyLoss` record each value they
return (training and evaluation, in call order), written to OUT.json when the script ends.
The script runs as `__main__` from its own folder on `sys.path` (its `import data`, `from model
import ...`), its text unchanged but for dropping the line marked `# zerojax: the one added
line` under `--plain`. `--fake-data N:M` makes a `torchvision.datasets.FakeData` of N images
(imagenet's `--dummy`: 1281167 and 50000 of 3x224x224) one of M, and `--fake-image-size S` its
images SxS, so that a run on CPU takes seconds. Run by tests/third_party/test_*.py (not a test
module itself).
"""

from __future__ import annotations

import argparse
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


def smaller_fake_data(sizes: dict[int, int], image_size: int | None) -> None:
    from torchvision import datasets

    init = datasets.FakeData.__init__

    def smaller(self, size=1000, image_size_=(3, 224, 224), *args, **kwargs):
        if image_size is not None:
            image_size_ = (image_size_[0], image_size, image_size)
        init(self, sizes.get(size, size), image_size_, *args, **kwargs)

    datasets.FakeData.__init__ = smaller


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--losses", required=True)
    parser.add_argument("--plain", action="store_true", help="without the zerojax line")
    parser.add_argument("--fake-data", action="append", default=[], metavar="N:M")
    parser.add_argument("--fake-image-size", type=int)
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
    losses: list[float] = []
    for criterion in (torch.nn.NLLLoss, torch.nn.CrossEntropyLoss):
        recording(criterion, losses)
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
