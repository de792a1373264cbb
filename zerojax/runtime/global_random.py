"""Importing zerojax leaves the global random generators a script seeds as they were.

Training scripts seed Python's `random`, numpy's global `np.random` and torch's default
generator first (timm's `utils.random_seed`, `transformers.set_seed`, Lightning's
`seed_everything`) and import zerojax later, at the one added line. `import jax` draws five
numbers from numpy's global state: `jax._src.clusters.k8s_cluster` computes a retry backoff,
`np.logspace(-1, 1, 5) * np.random.rand(5)`, as a default argument at import time. So every
later `np.random` draw of such a script (timm's mixup and cutmix, numpy augmentations, a
sampler seeded from numpy) came out different from the same script without zerojax: other
batches, other losses. `unchanged_global_random_state()` wraps zerojax's imports and puts the
three states back afterwards; it imports neither jax nor anything of zerojax's.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def unchanged_global_random_state() -> Iterator[None]:
    """Python's, numpy's and torch's global random states after the block are those before it
    (torch's default CPU generator only: importing never touches an accelerator's)."""
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(torch_state)
