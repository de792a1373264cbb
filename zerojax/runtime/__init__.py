"""Process-wide runtime services below `train` and `ckpt`: the effective-training-time ledger
and JAX's persistent compilation cache (the config's `runtime` section)."""
