"""Where a train step's time goes: each zerojax program alone vs the matching PyTorch phase.

On the GPT-2 bench model, interleaved in one process (one round runs every phase once):
- zerojax `loss_and_grads` (the fused forward+backward program) and `forward_vjp` + `backward`
  (the general path's two programs), called directly on the engine's state, no torch front end;
- PyTorch eager forward + loss + backward;
- zerojax `update` (AdamW on the accumulated gradients; params, master weights and optimizer
  state donated) vs torch's `AdamW.step()` (foreach).
Each phase ends when its results are ready. Wall time and process CPU time are reported: on a
shared machine the wall time of each side swings with the load, the CPU time much less (torch's
includes its OpenMP threads' spin-waiting).

Run: .venv/bin/python bench/train_step_phases.py [--steps N] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp
import torch

import zerojax
from bench.train_step import LR, PRECISIONS, build, lm_loss
from zerojax.bridge.dtypes import from_torch
from zerojax.train import optimizers


def wrapped(precision: str, fused: bool):
    model, tokens, targets = build(quick=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = {
        "mesh": {"data": 1},
        "precision": PRECISIONS[precision],
        "runtime": {"compilation_cache_dir": None, "report_effective_time": False},
    }
    model, optimizer = zerojax.initialize(
        model, optimizer, config=config, loss_fn=lm_loss if fused else None
    )
    for _ in range(2):  # compile every program
        loss = model(tokens, targets) if fused else lm_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, tokens, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    options = parser.parse_args()
    precision = options.precision
    jax.numpy.zeros(())
    print(f"load average at start: {os.getloadavg()}")
    fused_model, fused_optimizer, tokens, targets = wrapped(precision, fused=True)
    general_model, _, _, _ = wrapped(precision, fused=False)
    fused_engine, general_engine = fused_model.engine, general_model.engine
    x = fused_engine.shard_input(from_torch(tokens))
    y = fused_engine.shard_input(from_torch(targets))
    fused_program = fused_engine.programs.loss_and_grads(fused_engine._converted[False], ())
    vjp_program = general_engine.programs.forward_vjp(general_engine._converted[False], (False,))
    backward_program = general_engine.programs.backward(general_engine._converted[False])
    update_program = fused_engine.programs.update(fused_engine.optimizer_spec)
    one = jnp.float32(1.0)

    # The update donates params, master weights and optimizer state: the rounds thread the new
    # arrays through here (the engine's own state is left behind, unused).
    s = fused_engine.state
    # (base key, call number), as the engine passes it: the programs fold the number in.
    fused_rng, general_rng = fused_engine.next_rng(), general_engine.next_rng()
    current = {"params": s.params, "master": s.master, "opt_state": s.opt_state}

    def fused_forward_backward():
        return jax.block_until_ready(
            fused_program(current["params"], s.buffers, (x, y), {}, fused_rng, one)
        )

    g = general_engine.state

    def general_forward_backward():
        logits, _, pullback, _ = vjp_program(g.params, g.buffers, (x,), {}, general_rng)
        cotangent = jnp.full(logits.shape, 1.0 / (logits.shape[0] * logits.shape[1]), logits.dtype)
        return jax.block_until_ready(backward_program(pullback, g.params, cotangent, one))

    grads = fused_forward_backward()[2]
    hyper = optimizers.hyper_from_torch(
        fused_optimizer.torch_optimizer, fused_engine.optimizer_spec
    )

    def zerojax_update():
        params, master, opt_state, _, _ = update_program(
            current["params"], current["master"], current["opt_state"], grads, hyper, None
        )
        current.update(params=params, master=master, opt_state=opt_state)
        jax.block_until_ready(params)

    model, _, _ = build(quick=False)
    torch_optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def torch_forward_backward():
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            loss = lm_loss(model(tokens), targets)
        loss.backward()

    def torch_update():
        torch_optimizer.step()

    torch_forward_backward()
    torch_update()
    phases = {
        "zerojax loss_and_grads (fused f+b)": fused_forward_backward,
        "zerojax forward_vjp + backward (general f+b)": general_forward_backward,
        "PyTorch eager forward + loss + backward": torch_forward_backward,
        "zerojax update (AdamW)": zerojax_update,
        "PyTorch AdamW.step()": torch_update,
    }
    wall = {name: [] for name in phases}
    cpu = {name: [] for name in phases}
    for _ in range(options.steps):
        for name, phase in phases.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            phase()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
        model.zero_grad()
    print(f"load average at end: {os.getloadavg()}")
    print(f"\n{precision}, median of {options.steps} interleaved rounds\n")
    print("| phase | wall (ms) | wall min (ms) | process CPU time (ms) |\n|---|---|---|---|")
    for name in phases:
        print(
            f"| {name} | {statistics.median(wall[name]) * 1e3:.1f} | "
            f"{min(wall[name]) * 1e3:.1f} | {statistics.median(cpu[name]) * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
