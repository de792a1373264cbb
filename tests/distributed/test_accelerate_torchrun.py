"""accelerate under torchrun with 2 processes: plain accelerate (DDP on gloo) against zerojax
initialized before (order A) and after (order B) `accelerator.prepare` (issue 26).

    .venv/bin/python -m pytest -q -m slow tests/distributed/test_accelerate_torchrun.py

Why: with several processes `Accelerator.prepare_model` wraps the model in
`DistributedDataParallel`; zerojax already is the data parallelism, so a zerojax model must
come out of `prepare` unwrapped (order A: zerojax's hook on prepare_model) or be unwrapped by
`initialize` (order B: the wrap already happened), with the accelerator then saving the model
itself. `accelerate_script.py` runs one loop with everything accelerate users touch: its
sharded DataLoader, `accumulate` (2 micro-batches), `backward`, `clip_grad_norm_`, `gather`, an
LR scheduler, and a `save_state`/`load_state` round trip (the state after the first optimizer
step loaded back at the end and the rest trained again).

Tolerances: each rank's losses and gathered losses within 1e-5 relative of plain accelerate's
and the clip norms too (two float32 runs of one loop differ by reordered sums: XLA's sharded
contractions and all-reduce over 8 devices vs torch's per-rank matmuls and gloo's all-reduce of
2; ~1e-7 per step, measured <= 1e-7); final weights within 1e-4 normwise over all parameters
(AdamW turns ~1e-7 gradient differences into up to lr-sized steps on near-zero second
moments; measured 2e-8). The resumed pass is the same program on the same restored values:
equal to 1e-6 (measured: bit-equal).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.torchrun import REPO, check_ok, torchrun

pytest.importorskip("accelerate", reason="accelerate is a dev dependency")

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "distributed" / "accelerate_script.py"
WORLD_SIZE = 2


def _run(out, *args: str) -> list[dict]:
    check_ok(torchrun(SCRIPT, *args, "--out", str(out), timeout=300))
    name = "torch" if args[1] == "torch" else f"zerojax{args[3]}"
    return [dict(np.load(out / f"{name}_rank{r}.npz")) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def plain_accelerate(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("plain"), "--engine", "torch")


def _assert_close(name, actual, expected, rtol):
    scale = max(float(np.abs(expected).max()), 1e-30)
    error = float(np.abs(actual - expected).max())
    assert error <= rtol * scale, f"{name}: max |diff| {error:.3g} > {rtol} x {scale:.3g}"


@pytest.mark.parametrize("order", ["A", "B"])
def test_zerojax_under_accelerate_matches_plain_accelerate(tmp_path, plain_accelerate, order):
    ours = _run(tmp_path, "--engine", "zerojax", "--order", order)
    for rank, (got, want) in enumerate(zip(ours, plain_accelerate, strict=True)):
        assert int(got["num_processes"]) == WORLD_SIZE
        # Plain accelerate wraps in DDP; a model zerojax owns comes out of prepare unwrapped
        # (order B: prepare wrapped it before zerojax existed; initialize took it off).
        assert bool(want["ddp_wrapped"])
        assert bool(got["ddp_wrapped"]) == (order == "B")
        _assert_close(f"rank {rank} losses", got["losses"], want["losses"], 1e-5)
        _assert_close(f"rank {rank} gathered losses", got["gathered"], want["gathered"], 1e-5)
        _assert_close(f"rank {rank} clip norms", got["norms"], want["norms"], 1e-5)
        error = float(np.linalg.norm(got["final"] - want["final"]) / np.linalg.norm(want["final"]))
        assert error <= 1e-4, f"rank {rank}: final weights differ normwise by {error:.3g}"
        # save_state after the first optimizer step, load_state, train on: the same again.
        resumed_from = 2  # micro-batches before the save (one optimizer step of 2)
        _assert_close(
            f"rank {rank} resumed losses", got["resumed_losses"], got["losses"][resumed_from:], 1e-6
        )
        _assert_close(f"rank {rank} resumed weights", got["resumed_final"], got["final"], 1e-6)
    # Each rank its own rows (a test comparing equal numbers would prove nothing).
    assert not np.allclose(ours[0]["losses"], ours[1]["losses"])
