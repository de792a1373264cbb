"""`import zerojax` loads none of the frameworks its integrations serve.

Run: .venv/bin/python -m pytest -q tests/runtime/test_import_cost.py -p no:cacheprovider
Why: a restarted job pays every import before its first step (bench/effective_time_restart.py),
and a tool such as `zerojax ckpt inspect` pays it for nothing. The integrations
(`zerojax.integrations.accelerate`, `hf_trainer`) find their framework through
`importlib.util` and hook it only when `zerojax.initialize` meets it; importing transformers
alone takes seconds. The check runs in a fresh Python: in this process pytest's plugins and
other tests have imported them already.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.fresh_python import run_fresh_python

# Frameworks zerojax integrates with, each installed by the dev extra (a package that is not
# installed cannot be imported by accident: the test checks they are there).
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "timm", "trl")

LOADED = """
import json, sys
import zerojax
print(json.dumps(sorted({{name.split(".")[0] for name in sys.modules}} & set({names!r}))))
"""


@pytest.mark.long
def test_import_zerojax_imports_no_integrated_framework():
    missing = [name for name in FRAMEWORKS if importlib.util.find_spec(name) is None]
    assert not missing, f"{missing} not installed: the dev extra (pyproject.toml) installs them"
    done = run_fresh_python(["-c", LOADED.format(names=list(FRAMEWORKS))], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == [], f"`import zerojax` imported {loaded}: import them where they are used"


FULL_COLLECTIONS = """
import gc, json
import torch, jax
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)
import zerojax
print(json.dumps([len(full), gc.isenabled()]))
"""


@pytest.mark.long
def test_import_zerojax_runs_no_full_collection_and_leaves_the_collector_on():
    """zerojax's imports build long-lived objects only: a full collection during them walks the
    process for nothing (two, ~0.7 s at load 10, before zerojax/runtime/gc_pause.py)."""
    done = run_fresh_python(["-c", FULL_COLLECTIONS], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    full, enabled = json.loads(done.stdout.strip().splitlines()[-1])
    assert (full, enabled) == (0, True)
