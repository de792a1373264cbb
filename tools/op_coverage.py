"""Op coverage: torch's core-ATen opset against zerojax's lowering table.

    .venv/bin/python tools/op_coverage.py              # report
    .venv/bin/python tools/op_coverage.py --markdown   # the gap table of docs/coverage.md

Prints (a) the gap list: every core-ATen overload of the installed torch (those tagged
`torch.Tag.core`) that zerojax.bridge.supported_ops() lacks, with the reason from
zerojax/bridge/aten_gaps.py where it gives one; (b) the extras: lowered overloads
outside the core opset (ops zerojax keeps whole, such as scaled_dot_product_attention, and
non-core ops that torch.export leaves in graphs); (c) lowered overloads per op-family module.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from zerojax.bridge.aten_gaps import ATEN_GAPS
from zerojax.bridge.registry import get_lowering, supported_ops

NOT_LOWERED = "not lowered"


def core_aten_ops() -> set[torch._ops.OpOverload]:
    """Every ATen overload registered with the dispatcher that carries torch.Tag.core."""
    core = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified.removeprefix("aten::").partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, name), overload or "default")
        except (AttributeError, RuntimeError):  # internal names without a Python binding
            continue
        if torch.Tag.core in op.tags:
            core.add(op)
    return core


def gap_reasons() -> dict[str, str]:
    """str(overload) -> why zerojax lacks it (the package's documented gaps)."""
    return dict(ATEN_GAPS)


def family(op) -> str:
    """The lowering module that registers `op` (pointwise, reduction, ...)."""
    return get_lowering(op).__module__.rsplit(".", 1)[-1]


def report(markdown: bool) -> None:
    core = core_aten_ops()
    lowered = supported_ops()
    reasons = gap_reasons()
    gaps = sorted(core - lowered, key=str)
    extras = sorted(lowered - core, key=str)
    # Non-core ops that OpInfo samples reach and the suite documents as gaps.
    lowered_names = {str(op) for op in lowered}
    core_names = {str(op) for op in core}
    other_gaps = sorted(op for op in reasons if op not in core_names and op not in lowered_names)

    if markdown:
        print("| ATen overload | core | why it is not lowered |")
        print("|---|---|---|")
        for op in gaps:
            print(f"| `{op}` | yes | {reasons.get(str(op), NOT_LOWERED)} |")
        for op in other_gaps:
            print(f"| `{op}` | no | {reasons[op]} |")
        return

    print(
        f"torch {torch.__version__}: {len(core)} core-ATen overloads; zerojax lowers "
        f"{len(lowered)} overloads, {len(core & lowered)} of them core."
    )
    print(f"\n(a) Gap list: {len(gaps)} core-ATen overloads without a lowering")
    for op in gaps:
        print(f"  {op!s:55s} {reasons.get(str(op), NOT_LOWERED)}")
    if other_gaps:
        print(f"\n    and {len(other_gaps)} non-core overloads OpInfo samples reach (ATEN_GAPS)")
        for op in other_gaps:
            print(f"  {op:55s} {reasons[op]}")
    print(f"\n(b) Extras: {len(extras)} lowered overloads outside the core opset")
    for op in extras:
        print(f"  {op!s:55s} {family(op)}")
    print("\n(c) Lowered overloads per op family")
    counts = collections.Counter(family(op) for op in lowered)
    core_counts = collections.Counter(family(op) for op in lowered & core)
    print(f"  {'family':14s} {'lowered':>8s} {'core':>6s} {'extra':>6s}")
    for name, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        print(f"  {name:14s} {count:8d} {core_counts[name]:6d} {count - core_counts[name]:6d}")
    print(f"  {'total':14s} {len(lowered):8d} {len(core & lowered):6d} {len(extras):6d}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--markdown", action="store_true", help="print the gap table of docs/coverage.md"
    )
    report(parser.parse_args(argv).markdown)


if __name__ == "__main__":
    main()
