"""Process-wide runtime services below `train` and `ckpt`: the effective-training-time ledger,
JAX's persistent compilation cache (the config's `runtime` section), and how DataLoader workers
start once JAX runs (`worker_processes`)."""
