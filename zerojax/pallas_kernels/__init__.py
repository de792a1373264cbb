"""Pallas GPU kernels for the hot paths (attention, norms, fused AdamW, fused linear
cross-entropy): one folder per op with reference.py, kernel.py and api.py. Filled by the
kernels issue; empty until then."""
