"""Bridge benchmark: conversion coverage vs peers, and GPT-2 step time vs PyTorch.

1. Coverage: the 8 reference architectures (bench/architectures.py) converted by zerojax,
   torch2jax and torchax; a model counts as converted when its jitted forward matches torch
   eager (eval mode) within 1e-4 relative error and a gradient of a scalar loss is computable.
   A peer that is not installed or fails to import is reported as such.
2. Timing: forward+backward of a GPT-2 (4 layers, width 256, batch 8 x 256 tokens) with a
   cross-entropy loss: zerojax (jax.jit of value_and_grad) vs PyTorch eager vs torch.compile,
   medians of --steps steps, printed as ratios.

Run: make bench   (peers go into .venv-bench, never into zerojax's dependencies)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zerojax
from bench.architectures import ARCHITECTURES, gpt2_bench_model, scalar_loss
from zerojax.bridge.dtypes import from_torch


def relative_error(got, want) -> float:
    got = [np.asarray(x, dtype=np.float64) for x in jax.tree.leaves(got)]
    want = [x.detach().double().numpy() for x in torch_pytree.tree_leaves(want)]
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} outputs, torch has {len(want)}")
    return max(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-12) for g, w in zip(got, want))


def run_zerojax(module, args):
    converted = zerojax.convert(module, args)
    jax_args = [from_torch(a) for a in args]

    def forward(params):
        return converted.apply(params, converted.buffers, *jax_args)[0]

    out = jax.jit(forward)(converted.params)
    jax.jit(jax.grad(lambda p: scalar_loss(forward(p))))(converted.params)
    return out


def run_torch2jax(module, args):
    from torch2jax import t2j

    fn = t2j(module)
    state = {k: from_torch(v) for k, v in module.state_dict().items()}
    # Differentiate the float entries only (BatchNorm's int counter is state, not a weight).
    floats = {k: v for k, v in state.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    jax_args = [from_torch(a) for a in args]
    out = jax.jit(lambda s: fn(*jax_args, state_dict=s))(state)
    jax.jit(jax.grad(lambda f: scalar_loss(fn(*jax_args, state_dict={**state, **f}))))(floats)
    return out


def run_torchax(module, args):
    import torchax

    states, fn = torchax.extract_jax(module)
    jax_args = tuple(from_torch(a) for a in args)
    out = jax.jit(lambda s: fn(s, jax_args))(states)
    jax.jit(jax.grad(lambda s: scalar_loss(fn(s, jax_args))))(states)
    return out


PEERS = {"zerojax": run_zerojax, "torch2jax": run_torch2jax, "torchax": run_torchax}


def import_problem(peer: str) -> str | None:
    if peer == "zerojax":
        return None
    try:
        __import__(peer)
    except Exception as error:  # noqa: BLE001 - a peer may fail with anything on import (version skew)
        return f"import fails: {type(error).__name__}: {str(error).splitlines()[0][:70]}"
    return None


def coverage_table() -> str:
    problems = {peer: import_problem(peer) for peer in PEERS}
    rows, converted = [], dict.fromkeys(PEERS, 0)
    for name, factory in ARCHITECTURES.items():
        torch.manual_seed(0)
        module, args = factory()
        module.eval()
        with torch.no_grad():
            want = module(*args)
        cells = []
        for peer, run in PEERS.items():
            if problems[peer]:
                cells.append("not run")
                continue
            try:
                err = relative_error(run(module, args), want)
                ok = err <= 1e-4
                converted[peer] += ok
                cells.append(f"{'yes' if ok else 'WRONG'} (err {err:.1e})")
            except Exception as error:  # noqa: BLE001 - report any failure of any converter as a table cell
                line = str(error).strip().splitlines()[0] if str(error).strip() else ""
                cells.append(f"fails: {type(error).__name__}: {line[:60]}")
                if peer == "zerojax":
                    traceback.print_exc()
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    header = "| model | " + " | ".join(PEERS) + " |\n|---|" + "---|" * len(PEERS)
    total = (
        "| **converted** | "
        + " | ".join(f"**{converted[p]}/{len(ARCHITECTURES)}**" for p in PEERS)
        + " |"
    )
    notes = "\n".join(f"- {peer}: {problem}" for peer, problem in problems.items() if problem)
    return "\n".join([header, *rows, total]) + ("\n\n" + notes if notes else "")


class LanguageModelLoss(torch.nn.Module):
    """Next-token cross-entropy around a model returning logits: the unit that gets timed."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def median_ms(step, steps: int) -> float:
    step()
    step()  # warm-up: compile (JAX, torch.compile) and allocator growth
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def timing_table(steps: int) -> str:
    torch.manual_seed(0)
    model, (tokens,) = gpt2_bench_model()
    model.eval()  # dropout off: every contender does the same arithmetic
    targets = torch.roll(tokens, -1, dims=1)
    wrapped = LanguageModelLoss(model).eval()

    converted = zerojax.convert(wrapped, (tokens, targets))
    jax_tokens, jax_targets = from_torch(tokens), from_torch(targets)
    grad_step = jax.jit(
        jax.value_and_grad(
            lambda p: converted.apply(p, converted.buffers, jax_tokens, jax_targets)[0]
        )
    )

    def zerojax_step():
        _loss, grads = grad_step(converted.params)
        jax.block_until_ready(grads)

    def eager_step():
        model.zero_grad(set_to_none=True)
        wrapped(tokens, targets).backward()

    compiled = torch.compile(wrapped)

    def compiled_step():
        model.zero_grad(set_to_none=True)
        compiled(tokens, targets).backward()

    results = {
        "zerojax (jax.jit)": median_ms(zerojax_step, steps),
        "PyTorch eager": median_ms(eager_step, steps),
        "torch.compile": median_ms(compiled_step, steps),
    }
    zerojax_ms = results["zerojax (jax.jit)"]
    lines = ["| implementation | median step (ms) | time vs zerojax |", "|---|---|---|"]
    for name, ms in results.items():
        lines.append(f"| {name} | {ms:.1f} | {ms / zerojax_ms:.2f}x |")
    loss_jax = float(grad_step(converted.params)[0])
    loss_torch = wrapped(tokens, targets).item()
    lines.append(
        f"\nloss: zerojax {loss_jax:.6f}, torch {loss_torch:.6f}; {steps} timed steps each; "
        f"{torch.get_num_threads()} torch threads, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}"
    )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    parser.add_argument("--skip-timing", action="store_true")
    options = parser.parse_args()
    print("## Conversion coverage (8 reference architectures)\n")
    print(coverage_table())
    if not options.skip_timing:
        print("\n## GPT-2 forward+backward step on CPU (4 layers, width 256, batch 8 x 256)\n")
        print(timing_table(options.steps))


if __name__ == "__main__":
    jnp.zeros(())  # initialise the JAX backend before torch starts its threads
    main()
