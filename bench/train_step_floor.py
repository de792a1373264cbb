"""The least time this CPU needs for the bench step's matrix products, against the step targets.

Issue 14 asks for the GPT-2 bench step at <= 0.9x PyTorch eager's time in fp32 and <= 1.0x eager
autocast's time in bf16. A step cannot be faster than its matrix products. This script:

1. collects every `dot_general` of the fused forward+backward program, from the jaxpr the
   engine jits (`loss_and_grads`): the forward, autodiff's backward, and the causal attention
   blocks' recompute;
2. runs each distinct product alone, with fresh random operands of the program's shapes and
   dtypes: once jitted by XLA:CPU (the kernels a zerojax program can reach; a weight gradient
   also with its activation transposed beforehand, counting the better of the two), and once as
   the same contraction in `torch.einsum` (MKL/oneDNN, AMX for bf16 where the CPU has it);
3. sums the medians, times the number of times each product occurs: the step's matmul floor for
   each library, each product running alone with the whole machine to itself;
4. times the PyTorch eager step (forward, loss, backward, AdamW) in the same process.

The floor leaves out everything else in a step (attention softmax, layer norms, GELU, the loss,
AdamW, the front end), so a step at the target must sit below it: if the XLA floor is above the
target, no schedule of these products by XLA:CPU meets it.

Run: .venv/bin/python bench/train_step_floor.py [--precision fp32|bf16] [--repeats N]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import string
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

from bench.train_step import PRECISIONS, time_steps, torch_step
from bench.train_step_phases import wrapped
from zerojax.bridge.dtypes import from_torch

TARGET_TIME_RATIO = {"fp32": 0.9, "bf16": 1.0}
"""Issue 14's targets: zerojax step time / PyTorch eager step time (bf16: eager autocast)."""

Product = collections.namedtuple("Product", "lhs rhs dimension_numbers preferred")


def _sub_jaxprs(value):
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(item, ClosedJaxpr):
            yield item.jaxpr
        elif isinstance(item, Jaxpr):
            yield item


def products(jaxpr: Jaxpr, repeat: int = 1) -> collections.Counter:
    """Each distinct dot_general in `jaxpr` and its sub-jaxprs, with how often it runs."""
    found = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (var.aval for var in eqn.invars)
            found[
                Product(
                    (lhs.shape, lhs.dtype),
                    (rhs.shape, rhs.dtype),
                    eqn.params["dimension_numbers"],
                    eqn.params["preferred_element_type"],
                )
            ] += repeat
        if eqn.primitive.name == "while":
            raise NotImplementedError("a while loop's trip count is not in its jaxpr")
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                found.update(products(sub, repeat * times))
    return found


def einsum_spec(product: Product) -> str:
    """The torch.einsum equation of a dot_general: batch dims, lhs free dims, rhs free dims."""
    (lhs_shape, _), (rhs_shape, _) = product.lhs, product.rhs
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = product.dimension_numbers
    letters = iter(string.ascii_letters)
    lhs = [None] * len(lhs_shape)
    rhs = [None] * len(rhs_shape)
    for pairs in ((lhs_batch, rhs_batch), (lhs_contract, rhs_contract)):
        for i, j in zip(*pairs):
            lhs[i] = rhs[j] = next(letters)
    lhs_free = [i for i, letter in enumerate(lhs) if letter is None]
    rhs_free = [i for i, letter in enumerate(rhs) if letter is None]
    for dims, free in ((lhs, lhs_free), (rhs, rhs_free)):
        for i in free:
            dims[i] = next(letters)
    batch = [lhs[i] for i in lhs_batch]
    lhs_free = [lhs[i] for i in lhs_free]
    rhs_free = [rhs[i] for i in rhs_free]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(batch + lhs_free + rhs_free)}"


def flops(product: Product) -> float:
    (lhs_shape, _), (rhs_shape, _) = product.lhs, product.rhs
    (lhs_contract, _), (lhs_batch, _) = product.dimension_numbers
    shared = np.prod([lhs_shape[i] for i in (*lhs_contract, *lhs_batch)])
    return 2.0 * np.prod(lhs_shape) * np.prod(rhs_shape) / shared


def median_seconds(run, repeats: int) -> float:
    run()
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_alone(product: Product, repeats: int) -> tuple[float, float]:
    """(XLA:CPU seconds, torch seconds) of one product alone, on fresh random operands."""
    rng = np.random.default_rng(0)
    operands = [
        rng.standard_normal(shape, dtype=np.float32) for shape, _ in (product.lhs, product.rhs)
    ]
    jax_operands = [
        jnp.asarray(x, dtype) for x, (_, dtype) in zip(operands, (product.lhs, product.rhs))
    ]
    dot = jax.jit(
        lambda a, b: lax.dot_general(
            a, b, product.dimension_numbers, preferred_element_type=product.preferred
        )
    )
    xla_seconds = median_seconds(lambda: dot(*jax_operands).block_until_ready(), repeats)
    (lhs_contract, rhs_contract), (lhs_batch, _) = product.dimension_numbers
    if len(product.lhs[0]) == 2 and lhs_contract == (0,) and not lhs_batch:
        # XLA:CPU hands a dot whose lhs contracts its rows to Eigen (in fp32); the other
        # orientation, behind a transpose made beforehand (XLA folds one made in the same
        # program back into the dot), runs in XLA's matmul library: count the better of the two.
        transpose = jax.jit(lambda a: a.T)
        lhs_t = transpose(jax_operands[0])
        dot_t = jax.jit(
            lambda a, b: lax.dot_general(
                a, b, (((1,), rhs_contract), ((), ())), preferred_element_type=product.preferred
            )
        )
        reoriented = median_seconds(
            lambda: transpose(jax_operands[0]).block_until_ready(), repeats
        ) + median_seconds(lambda: dot_t(lhs_t, jax_operands[1]).block_until_ready(), repeats)
        xla_seconds = min(xla_seconds, reoriented)
    torch_operands = [
        torch.from_numpy(np.array(x.astype(jnp.float32))).to(getattr(torch, str(dtype)))
        for x, (_, dtype) in zip(jax_operands, (product.lhs, product.rhs))
    ]
    spec = einsum_spec(product)
    torch_seconds = median_seconds(lambda: torch.einsum(spec, *torch_operands), repeats)
    return xla_seconds, torch_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument("--repeats", type=int, default=15)
    options = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")

    model, _, tokens, targets = wrapped(options.precision, fused=True)
    engine = model.engine
    state = engine.state
    batch = (engine.shard_input(from_torch(tokens)), engine.shard_input(from_torch(targets)))
    program = engine.programs.loss_and_grads(engine._converted[False], ())
    args = (state.params, state.buffers, batch, {}, engine.next_rng(), jnp.float32(1.0))
    found = products(jax.make_jaxpr(program._jitted)(*args).jaxpr)

    eager = torch_step(quick=False, precision=options.precision, compiled=False)
    _, eager_seconds = time_steps(eager, options.repeats)  # as bench/train_step.py times it

    rows, total_flops = [], 0.0
    floor = collections.defaultdict(float)  # (library, "linear" or "attention") -> seconds
    for product, count in sorted(found.items(), key=lambda item: -flops(item[0]) * item[1]):
        xla_seconds, torch_seconds = time_alone(product, options.repeats)
        kind = "attention" if product.dimension_numbers[1][0] else "linear"
        floor["XLA:CPU", kind] += count * xla_seconds
        floor["torch", kind] += count * torch_seconds
        total_flops += count * flops(product)
        rows.append(
            f"| {einsum_spec(product)} | {product.lhs[0]} x {product.rhs[0]} "
            f"{product.lhs[1]}->{product.preferred} | {count} | "
            f"{flops(product) / xla_seconds / 1e9:.0f} | {flops(product) / torch_seconds / 1e9:.0f} |"
        )

    print(
        f"\nprecision {options.precision}; distinct products: {len(found)}, "
        f"run {sum(found.values())} times per step, {total_flops / 1e9:.1f} GFLOP\n"
    )
    print(
        "| product | shapes | per step | XLA:CPU alone, best orientation GFLOP/s | torch alone GFLOP/s |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    target = TARGET_TIME_RATIO[options.precision] * eager_seconds
    print("\n| | ms |\n|---|---|")
    print(f"| PyTorch eager step (measured here) | {eager_seconds * 1e3:.1f} |")
    print(f"| target: {TARGET_TIME_RATIO[options.precision]}x eager | {target * 1e3:.1f} |")
    for library in ("XLA:CPU", "torch"):
        linear, attention = floor[library, "linear"], floor[library, "attention"]
        print(
            f"| matmul floor, {library} (each product alone): linear layers + attention "
            f"| {linear * 1e3:.1f} + {attention * 1e3:.1f} = {(linear + attention) * 1e3:.1f} |"
        )
    xla_floor = floor["XLA:CPU", "linear"] + floor["XLA:CPU", "attention"]
    print(f"\nXLA:CPU floor / target: {xla_floor / target:.2f}")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
