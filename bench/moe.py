"""Mixture-of-experts benchmark: expert parallelism vs replicated experts on 8 CPU devices.

The model is a hand-written 2-layer MoE language model, 16 experts, top-2, written the way
transformers writes its MoE experts (sort the token-expert pairs by expert, `histc`, `cumsum`,
grouped GEMM through `transformers::grouped_mm_fallback`), so the bridge sees the same ops it
sees in Mixtral or Qwen-MoE. One training step (forward, backward, AdamW) is timed on
- replicated experts: `mesh: {data: 8}`, every device holds all 16 experts;
- expert parallel: `mesh: {data: 2, expert: 4}` and `{expert: 8}`, experts split over `expert`
  by the `expert` rule preset, tokens dispatched and combined by all-to-all;
- expert parallel with a capacity factor (`moe: {capacity_factor: f}`): fixed dispatch buffers
  of f x the balanced share; the token-expert pairs it dropped are read from
  `engine.moe_stats()`.

Then, on a two-level mesh `node: 2 x local: 4` (the experts split over both axes), the bytes
the training step's all-to-alls send over each axis, read from the compiled HLO
(`zerojax.sharding.collective_traffic`), for flat dispatch (one all-to-all over both axes)
and hierarchical dispatch (over `node`, then over `local`), beside the analytic expectation.

The 8 devices are simulated on this machine's CPU cores (`jax_num_cpu_devices`): they share
the cores, so the times compare the programs' work and copies, not a network. Steps are the
median of --steps after WARMUP_STEPS untimed ones, ending when the updated params are ready.

Run: .venv/bin/python bench/moe.py [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax

if __name__ == "__main__":  # imported by tests, whose conftest has set up 8 devices
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp
import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations import moe as hf_moe  # defines transformers::grouped_mm_fallback

import zerojax
from zerojax.bridge.dtypes import from_torch
from zerojax.parallel import ExpertParallel, ParallelPlan
from zerojax.sharding.collective_traffic import all_to_all_bytes_per_axis

WARMUP_STEPS = 3
LR = 1e-3


class Experts(nn.Module):
    """`num_experts` SwiGLU-free 2-layer MLPs as stacked weights (what the `expert` preset
    splits on dim 0), applied to the token-expert pairs grouped by expert."""

    def __init__(self, num_experts: int, width: int, hidden: int):
        super().__init__()
        self.num_experts = num_experts
        self.up = nn.Parameter(torch.randn(num_experts, width, hidden) / width**0.5)
        self.down = nn.Parameter(torch.randn(num_experts, hidden, width) / hidden**0.5)

    def forward(self, x, expert_ids, weights):
        top_k = expert_ids.shape[-1]
        ids, order = expert_ids.reshape(-1).sort()
        rows = x[order // top_k]
        counts = torch.histc(ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        ends = counts.cumsum(0, dtype=torch.int32)
        grouped_mm = torch.ops.transformers.grouped_mm_fallback
        hidden = F.gelu(grouped_mm(rows, self.up, ends))
        out = grouped_mm(hidden, self.down, ends) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, order // top_k, out)


class MoeLayer(nn.Module):
    def __init__(self, num_experts: int, top_k: int, width: int, hidden: int):
        super().__init__()
        self.top_k = top_k
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = Experts(num_experts, width, hidden)

    def forward(self, x):
        h = self.norm(x)
        probs = self.router(h).softmax(-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + self.experts(h, expert_ids, weights)


class MoeLM(nn.Module):
    """Embedding, `num_layers` residual MoE layers, LM head."""

    def __init__(self, vocab=256, width=128, hidden=256, num_experts=16, top_k=2, num_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            MoeLayer(num_experts, top_k, width, hidden) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens).flatten(0, 1)  # (tokens, width): routing is per token
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)).unflatten(0, tokens.shape)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def moe_bench_model(quick: bool = False, **sizes):
    """(model, tokens, targets), seeded. Full: 16 x 64 tokens (2,048 token-expert pairs)."""
    torch.manual_seed(0)
    batch, seq = (8, 16) if quick else (16, 64)
    model = MoeLM(**sizes)
    tokens = torch.randint(0, model.embed.num_embeddings, (batch, seq))
    return model, tokens, torch.roll(tokens, -1, dims=1)


CASES = {
    "replicated experts, data 8": {"mesh": {"data": 8}},
    "expert parallel, data 2 x expert 4": {"mesh": {"data": 2, "expert": 4}, "rules": ["expert"]},
    "expert parallel, expert 8": {"mesh": {"expert": 8}, "rules": ["expert"]},
}
CAPACITY_FACTORS = (1.0, 1.25, 2.0)


def time_case(config: dict, quick: bool, steps: int):
    """(first loss, median step seconds, engine) of one configuration."""
    model, tokens, targets = moe_bench_model(quick)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    config = {**config, "runtime": {"compilation_cache_dir": None}}
    model, optimizer = zerojax.initialize(model, optimizer, config, loss_fn=lm_loss)
    engine = model.engine

    def step():
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        jax.block_until_ready(engine.params)
        return loss

    first_loss = step().item()
    stats = engine.moe_stats()  # the first step's routing, before training moves it
    for _ in range(WARMUP_STEPS - 1):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return first_loss, statistics.median(times), stats


def dropped_per_layer(stats: dict) -> tuple[list[int], int]:
    """(pairs dropped in each layer, pairs routed per layer), read from each layer's first
    grouped GEMM (the up projection; the down projection sees the same routing)."""
    first = {}
    for site, routed in sorted(stats.items()):
        first.setdefault(site.split(":")[0], routed)
    routed = int(next(iter(first.values()))["rows_per_expert"].sum()) if first else 0
    return [r["dropped"] for r in first.values()], routed


NODES, LOCAL = 2, 4


def dispatch_traffic(hierarchical: bool, quick: bool = False):
    """One training step's loss and gradients (forward + backward) of the bench MoE on the mesh
    node: 2 x local: 4, experts split over both axes: (loss, grads, bytes per axis, rows each
    device dispatches per grouped GEMM)."""
    model, tokens, targets = moe_bench_model(quick)
    converted = zerojax.convert(model, (tokens,), train=True)
    mesh = jax.make_mesh(
        (NODES, LOCAL), ("node", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    both = ("node", "local")
    placement = ExpertParallel(
        mesh=mesh, expert_axes=both, row_axes=both, hierarchical=hierarchical
    )
    parallel = ParallelPlan(mesh=mesh, experts=placement)
    sharding = jax.sharding.NamedSharding
    split = jax.sharding.PartitionSpec(both)
    params = {
        name: jax.device_put(
            value,
            sharding(mesh, split if ".experts." in name else jax.sharding.PartitionSpec()),
        )
        for name, value in converted.params.items()
    }
    tokens_, targets_ = (
        jax.device_put(from_torch(t), sharding(mesh, split)) for t in (tokens, targets)
    )

    def loss(params, tokens, targets):
        logits, _ = converted.apply(params, converted.buffers, tokens, parallel=parallel)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    step = jax.jit(jax.value_and_grad(loss)).lower(params, tokens_, targets_).compile()
    value, grads = step(params, tokens_, targets_)
    rows = tokens.numel() * model.layers[0].top_k // (NODES * LOCAL)
    return value, grads, all_to_all_bytes_per_axis(step.as_text(), mesh), rows


def traffic_table(quick: bool) -> str:
    """Flat vs hierarchical bytes per axis, measured from HLO, with the analytic expectation."""
    results = {h: dispatch_traffic(h, quick) for h in (False, True)}
    rows = results[False][3]
    flat_node, hier_node = results[False][2]["node"], results[True][2]["node"]
    lines = [
        (
            f"Dispatch/combine bytes per device, one training step (fwd + bwd), 2 layers x 2 "
            f"grouped GEMMs, mesh node {NODES} x local {LOCAL}, R = {rows} rows per device per "
            f"GEMM:"
        ),
        "| dispatch | node axis (inter-node) bytes | local axis (intra-node) bytes | loss |",
        "|---|---|---|---|",
    ]
    for hierarchical, (value, _, traffic, _) in results.items():
        name = "hierarchical (node, then local)" if hierarchical else "flat (node x local)"
        lines.append(
            f"| {name} | {traffic['node']:,.0f} | {traffic['local']:,.0f} | {float(value):.6f} |"
        )
    lines += [
        "",
        (
            f"inter-node bytes, hierarchical / flat: measured {hier_node / flat_node:.4f}; "
            f"analytic 1/local = {1 / LOCAL:.4f} (dropless buffers: flat sends R rows to each "
            f"of the {(NODES - 1) * LOCAL} devices on other nodes, hierarchical R rows to the "
            f"same-local peer on each of the {NODES - 1} other node(s))"
        ),
        (
            f"expected routed rows that must cross nodes per dispatch, uniformly random "
            f"routing: R x (nodes - 1) / nodes = {rows * (NODES - 1) / NODES:.0f}, inside the "
            f"{(NODES - 1) * LOCAL * rows} (flat) or {(NODES - 1) * rows} (hierarchical) "
            f"buffer rows sent"
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="8 x 16 tokens (a smoke run)")
    parser.add_argument("--traffic-only", action="store_true", help="only the HLO byte table")
    args = parser.parse_args()
    if args.traffic_only:
        print(traffic_table(args.quick))
        return
    print(f"# MoE train step, 8 simulated CPU devices ({jax.devices()[0].device_kind})")
    print(
        f"# jax {jax.__version__}, torch {torch.__version__}, transformers fallback op "
        f"{'present' if hf_moe is not None else 'missing'}"
    )
    print("| configuration | step (ms) | vs replicated | first-step loss | dropped pairs / layer |")
    print("|---|---|---|---|---|")
    baseline = None
    rows = [(name, config, None) for name, config in CASES.items()]
    ep = CASES["expert parallel, data 2 x expert 4"]
    rows += [
        (
            f"expert parallel, data 2 x expert 4, capacity {f}",
            {**ep, "moe": {"capacity_factor": f}},
            f,
        )
        for f in CAPACITY_FACTORS
    ]
    for name, config, _ in rows:
        print(f"  timing {name} ...", file=sys.stderr, flush=True)
        loss, seconds, stats = time_case(config, args.quick, args.steps)
        baseline = seconds if baseline is None else baseline
        dropped, routed = dropped_per_layer(stats)
        dropped_text = (
            f"{' / '.join(str(d) for d in dropped)} of {routed}" if stats else "- (no dispatch)"
        )
        print(
            f"| {name} | {seconds * 1e3:.1f} | {baseline / seconds:.2f}x | {loss:.6f} "
            f"| {dropped_text} |",
            flush=True,
        )
    print()
    print(traffic_table(args.quick))


if __name__ == "__main__":
    main()
