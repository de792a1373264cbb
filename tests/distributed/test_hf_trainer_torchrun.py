"""The Hugging Face Trainer under torchrun with 2 processes: plain Trainer (DDP on gloo) against
the same script with `zerojax.initialize(model)` added (issue 26).

    .venv/bin/python -m pytest -q -m slow tests/distributed/test_hf_trainer_torchrun.py

Why: under torchrun the Trainer wraps its model in DDP (through accelerate), normalises the
loss by the token count of all processes and multiplies it by their number (DDP then averages
the gradients), and saves from the main process only. A zerojax model must stay unwrapped
(zerojax is the data parallelism), its own loss (over the global batch) must come back as each
process's share so the logged loss and grad norm are plain Trainer's (before: both doubled),
and saving must not wait forever on the main process's reads of a state sharded over both
(`zerojax.integrations.hf_trainer`). `hf_trainer_script.py` trains 4 steps with the Trainer's
own AdamW, accumulation 2, clipping, a checkpoint at step 2, `evaluate()`, `save_model()` (then
`from_pretrained`), and resumes a new model and Trainer from the checkpoint.

Tolerances: logged losses and grad norms within 1e-5 relative of plain Trainer's, the eval loss
too (two float32 runs of one loop differ by reordered sums: XLA's sharded contractions and
all-reduce over 8 devices vs torch's per-rank matmuls and gloo's all-reduce of 2; ~1e-7 per
step); final weights within 1e-4 normwise over all parameters (AdamW turns ~1e-7 gradient
differences into up to lr-sized steps on near-zero second moments). The saved directory
reloads to the trained weights exactly (a host copy, written and read), and the resumed run is
the same program on the restored state: its last steps and weights within 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.torchrun import REPO, check_ok, torchrun

pytest.importorskip("transformers", reason="transformers is a dev dependency")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (a dev dependency)")

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "distributed" / "hf_trainer_script.py"
WORLD_SIZE = 2
SAVE_AT = 2


def _run(out, engine: str) -> list[dict]:
    check_ok(torchrun(SCRIPT, "--engine", engine, "--out", str(out), timeout=400))
    return [dict(np.load(out / f"{engine}_rank{r}.npz")) for r in range(WORLD_SIZE)]


def _assert_close(name, actual, expected, rtol):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shapes {actual.shape} vs {expected.shape}"
    error = float(np.max(np.abs(actual - expected) / np.maximum(np.abs(expected), 1e-30)))
    assert error <= rtol, f"{name}: max relative difference {error:.3g} > {rtol}"


def test_zerojax_model_under_trainer_matches_plain_trainer_with_ddp(tmp_path):
    theirs = _run(tmp_path, "torch")
    ours = _run(tmp_path, "zerojax")
    for rank, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert int(got["num_processes"]) == WORLD_SIZE
        assert bool(want["ddp_wrapped"]) and not bool(got["ddp_wrapped"])
        assert len(got["logs"]) == 4
        _assert_close(f"rank {rank} logged loss, grad norm", got["logs"], want["logs"], 1e-5)
        _assert_close(f"rank {rank} eval loss", got["eval_loss"], want["eval_loss"], 1e-5)
        error = float(np.linalg.norm(got["final"] - want["final"]) / np.linalg.norm(want["final"]))
        assert error <= 1e-4, f"rank {rank}: final weights differ normwise by {error:.3g}"
        np.testing.assert_array_equal(got["reloaded"], got["final"])
        _assert_close(f"rank {rank} resumed logs", got["resumed_logs"], got["logs"][SAVE_AT:], 1e-6)
        error = np.abs(got["resumed_final"] - got["final"]).max()
        assert error <= 1e-6 * np.abs(got["final"]).max(), f"rank {rank}: resumed {error:.3g}"
