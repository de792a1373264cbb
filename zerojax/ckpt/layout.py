"""On-disk layout of a zerojax checkpoint: the one contract between saving, restoring and the
`zerojax ckpt` tools.

A checkpoint directory holds one Orbax step directory per saved step; Orbax writes each into a
temporary directory and renames it when every item is committed, with the manifest written
just before (`zerojax.ckpt.commit`), so a step directory that exists is complete and
verifiable. A numbered directory without the manifest is not a step. Inside a step directory
each item is its own Orbax item:

    DIR/
      <step>/
        model/        PyTreeSave  {state_dict name: array} -- parameters (in the master dtype
                                  when the precision policy keeps fp32 master weights) and
                                  buffers, flat, keyed by torch's names (tied aliases appear once,
                                  under the canonical name; `meta.parameters[...]["tied_to"]`
                                  lists the others); zero-size arrays are not stored
                                  (Orbax refuses them): `meta.parameters` gives their shape
                                  and restoring recreates them
        optimizer/    PyTreeSave  the engine's optimizer state tree (absent after `ckpt import`)
        train_state/  PyTreeSave  {"rng": uint32 key data, "loss_scale": {...}} (absent after
                                  `ckpt import`)
        meta/         JsonSave    see `Meta` below
        zerojax_manifest.json     size and xxh3_64 of every file, written before Orbax's
                                  commit renames the directory

Orbax keys may contain dots: a flat dict {"h.0.attn.weight": ...} is stored leaf by leaf and
can be restored one leaf at a time with `PyTreeRestore(..., partial_restore=True)`.
"""

from __future__ import annotations

FORMAT = "zerojax-checkpoint/1"
"""`meta["format"]`; readers refuse any other value."""

MODEL = "model"
OPTIMIZER = "optimizer"
TRAIN_STATE = "train_state"
META = "meta"
ITEMS = (MODEL, OPTIMIZER, TRAIN_STATE, META)

MANIFEST = "zerojax_manifest.json"
"""{"files": {relative path: {"size": int, "xxh3_64": int}}} for every file under the step
directory except itself (manifests from before 2026-11-28: "crc32" instead of "xxh3_64")."""

# `meta` keys (JSON):
#   format      FORMAT
#   step        int, the step number the directory is named after
#   config      dataclasses.asdict(zerojax.Config) of the saving run, or None after import
#   parameters  {state_dict name: {"shape": [int], "dtype": torch dtype name without "torch."
#                ("float32", "bfloat16", "int64", ...), "stored_dtype": dtype on disk (numpy
#                name), "kind": "parameter" | "buffer", "tied_to": canonical name or None}}
#                in the module's state_dict order; tied aliases have "tied_to" set and no array
#                in `model/`
#   optimizer   {"type": torch optimizer class name, "param_groups": [...torch's
#                param_groups minus "params"...]} or None
#   scheduler   the LR scheduler's state_dict() or None
#   engine      {"num_calls": int, "skipped_steps": int}
#   torch_rng   torch.get_rng_state() as a list of ints (so user-side torch randomness resumes)
#   extra       the user's JSON-serialisable dict
#   items       the items the step holds, sorted (["meta", "model", "optimizer",
#               "train_state"]); restore refuses a step missing one. Absent in steps written
#               before it was recorded: Orbax's `_CHECKPOINT_METADATA` lists them too
