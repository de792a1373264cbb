"""Checkpoints on Orbax: sharded save/restore onto any mesh, torch/safetensors import-export.
Filled by the checkpoint issue; empty until then."""
