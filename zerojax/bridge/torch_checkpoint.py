"""The model's own `torch.utils.checkpoint.checkpoint` calls, kept through capture.

torch.export (non-strict) runs a checkpointed function like any other code: its ops land in the
graph with nothing saying they were checkpointed, and torch has no public hook into a
`checkpoint` call. While capturing, `tagging_checkpoint_calls` swaps the module globals that
every `checkpoint` call goes through for versions that run the function inside
`torch.fx.traceback.annotate`, so each node it makes carries `meta["custom"][CHECKPOINT_TAG] =
<call number>` (also through `run_decompositions`); remat.py turns each call into a
`jax.checkpoint` region. Which globals depends on the torch release, found by what the module
has rather than by its version:

- torch >= 2.14: `_checkpoint_impl(function, args, kwargs, **options)`, the one path of both
  `use_reentrant` settings and of the decorator form `checkpoint(use_reentrant=False)(fn)`;
- torch 2.13: `CheckpointFunction` (`use_reentrant=True`) and
  `_checkpoint_without_reentrant_generator` (False).

Module globals are looked up at call time, so this also reaches the
`functools.partial(checkpoint, ...)` that Hugging Face's `gradient_checkpointing_enable()`
stores. The originals are restored on exit.
"""

from __future__ import annotations

import contextlib
import itertools

import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint

from zerojax.bridge.remat import CHECKPOINT_TAG

__all__ = ["tagging_checkpoint_calls"]


@contextlib.contextmanager
def tagging_checkpoint_calls():
    """Within: each torch checkpoint call's ops are tagged with its call number."""
    calls = itertools.count()

    def tagged_impl(function, args, kwargs, **options):
        del options  # preserve_rng_state: the region is replayed from the same key (remat.py)
        with fx_traceback.annotate({CHECKPOINT_TAG: next(calls)}):
            return function(*args, **kwargs)

    class TaggedCheckpointFunction:
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            del preserve_rng_state  # as above
            with fx_traceback.annotate({CHECKPOINT_TAG: next(calls)}):
                return function(*args)

    def tagged_generator(function, preserve_rng_state, context_fn, *rest, **kwargs):
        # checkpoint() runs the function between the generator's first and second step.
        with fx_traceback.annotate({CHECKPOINT_TAG: next(calls)}):
            yield

    if hasattr(torch_checkpoint, "_checkpoint_impl"):
        replacements = {"_checkpoint_impl": tagged_impl}
    else:
        replacements = {
            "CheckpointFunction": TaggedCheckpointFunction,
            "_checkpoint_without_reentrant_generator": tagged_generator,
        }
    saved = {name: getattr(torch_checkpoint, name) for name in replacements}
    for name, replacement in replacements.items():
        setattr(torch_checkpoint, name, replacement)
    try:
        # Annotations reach the nodes only while node meta is preserved (off in non-strict
        # export); run_decompositions then copies them onto each op's decomposition.
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        for name, original in saved.items():
            setattr(torch_checkpoint, name, original)
