"""XLA options the training programs compile with, so a CPU step uses memory as an accelerator's
would (and `zerojax plan`, which compiles on CPU, predicts it).

On XLA:CPU, each of these is measured on the 6.65B GPT-2 of `bench/memory.py` (ZeRO-3 on 4
devices, every block checkpointed, all model states bf16):

- `cse_barrier_expander` off: that pass removes `jax.checkpoint`'s optimization barriers, after
  which CSE merges every recomputation with its forward value and checkpointing saves nothing
  (bridge/remat.py).
- `cpu-all-reduce-combiner` off: the combiner merges every layer's gradient all-reduce into one,
  after the backward pass, so every layer's full-size gradient is live at once (+0.7 GB per
  layer there). Separate, each is reduced and sliced to its shard as the layer's backward ends,
  as a GPU's reduce-scatters are.
- `xla_cpu_copy_insertion_use_region_analysis`: without it, copy insertion copies the donated
  optimizer state before the update writes into it (+5 bytes per parameter of temporaries in
  the update program: 2.27 GB vs 0.45 GB for 8 layers); with it the update runs in place.
  The recorded live-tensor programs (`zerojax.train.deferred`: an optimizer's captured step,
  your own tensor code) compile with it too (`in_place_options`): Rprop's captured step
  copied its 52 previous gradients, each read by two of its outputs, before writing them.
"""

from __future__ import annotations


def compiler_options(platform: str) -> dict[str, str | bool]:
    """Options for `Lowered.compile(compiler_options=...)` on `platform` (none off CPU)."""
    if platform != "cpu":
        return {}
    return {
        "xla_disable_hlo_passes": "cse_barrier_expander,cpu-all-reduce-combiner",
        **in_place_options(platform),
    }


def in_place_options(platform: str) -> dict[str, bool]:
    """Options for a program that writes its donated inputs' new values in place, on
    `platform` (none off CPU)."""
    return {"xla_cpu_copy_insertion_use_region_analysis": True} if platform == "cpu" else {}
