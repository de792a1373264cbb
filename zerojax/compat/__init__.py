"""What differs between the releases of jax and torch that zerojax admits, each in one module.

`jax_api` covers jax 0.10 and 0.11; `torch_export` covers torch 2.11 to 2.15. Code elsewhere
imports the names defined here instead of branching on versions itself, and each branch has a
test that runs in the venv holding that release (`make test-torch-2.11`, `make
test-gpu-stack`).
"""
