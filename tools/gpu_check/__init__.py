"""The GPU check: one command that measures zerojax on a GPU against its peers, in minutes.

    PYTHONPATH=. python3 -m tools.gpu_check --out DIR          # on a GPU machine (make gpu-check)
    PYTHONPATH=. python3 -m tools.gpu_check --out DIR --cpu    # same code paths, tiny, on CPU

It runs from the source tree with whatever python, torch and jax the machine has (nothing is
installed, nothing is downloaded), so it measures the stack a GPU user already holds. Each
section (`SECTIONS` in `__main__`) runs in a subprocess of its own: JAX's device-memory peak
(`peak_bytes_in_use`) cannot be reset within a process, torch and JAX must not both reserve the
GPU's memory, and a crash in one section must not lose the others' numbers. Every contender of
a section runs in that same subprocess, so each number sits beside its peer from the same run.

Outputs (at most 8 files in DIR): `gpu_check.json` (every section's rows, checks and errors),
`gpu_check.md` (the same as tables), `gpu_check.log` (each section's own output). The exit
status is non-zero when a correctness check failed or a section crashed; a section skipped for
lack of time (the `--budget-s` wall-clock budget) is reported as skipped and does not fail it.

With `--cpu` every section runs on the CPU with tiny shapes and the Pallas kernels in interpret
mode: CI runs it (`make gpu-check CPU=1`), so an API that moved under us breaks CI rather than
the next run on a GPU machine. Its numbers mean nothing; its checks still must pass.
"""
