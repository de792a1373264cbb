"""The planner against reality (issue 11): the planned training-step peak vs the memory a real
step takes, on this machine.

    .venv/bin/python bench/plan_vs_rss.py

For three configurations, each in fresh processes on 4 simulated CPU devices:

- **planned**: `memory_report(abstract=True)` on the model built on the meta device (what
  `zerojax plan --devices 4` runs): the per-device step peak, and the training state (the
  engine keeps its gradient buffers between steps);
- **real**: the same model built for real and trained as users train it (`zerojax.initialize`,
  `loss.backward()`, `optimizer.step()`, `zero_grad()`), three steps. The state resident
  between steps is read off the live arrays' shards; the rest of the peak is the growth of the
  process's resident memory (RSS) during the third step over its value just before it: the
  kernel's own high-water mark (`VmHWM`, restarted through `/proc/self/clear_refs`), so no
  short-lived peak is missed. Earlier steps compile the programs and write every state array (pages
  of zeros are not resident until written), so that growth is execution alone: gradients,
  activations, gathered weights, scratch. glibc is told to return large blocks to the system at
  once (`MALLOC_MMAP_THRESHOLD_`), or freed scratch would stay resident and hide the growth.

On CPU the simulated devices share the process's memory, so the comparison is of totals over the
4 devices: planned 4 x per-device peak vs real resident state + RSS growth. Goal: within 10%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICES = 4

CONFIGS = {
    "mlp-fp32-zero3": {
        "what": "8-layer MLP 2048-wide, fp32, ZeRO-3",
        "config": {"mesh": {"fsdp": -1}, "zero_stage": 3},
    },
    "gpt2-bf16-zero3-ckpt": {
        "what": "GPT-2 1024x8, bf16 compute + fp32 master, ZeRO-3, every block checkpointed",
        "config": {
            "mesh": {"fsdp": -1},
            "zero_stage": 3,
            "precision": "params=bfloat16,compute=bfloat16,master=float32",
            "activation_checkpointing": {"modules": {r"model\.transformer\.h\.\d+": "full"}},
        },
    },
    "gpt2-fp32-zero1": {
        "what": "GPT-2 1024x8, fp32, ZeRO-1",
        "config": {"mesh": {"data": -1}, "zero_stage": 1},
    },
}


def build(name: str):
    """(model, example args) for a configuration; honours an enclosing torch.device("meta")."""
    import torch

    if name.startswith("mlp"):
        layers = [torch.nn.Linear(2048, 2048) for _ in range(8)]
        model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())])

        class WithLoss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = model

            def forward(self, x):
                return self.net(x).square().mean()

        return WithLoss(), (torch.randn(256, 2048),)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=1024, n_layer=8, n_head=16, n_positions=256, vocab_size=8192)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = GPT2LMHeadModel(config).train()

        def forward(self, tokens):
            return self.model(input_ids=tokens, labels=tokens).loss

    return LM(), (torch.randint(0, config.vocab_size, (8, 256)),)


def planned(name: str) -> dict:
    import torch

    import zerojax

    with torch.device("meta"):
        model, args = build(name)
    report = zerojax.memory_report(model, args, CONFIGS[name]["config"], abstract=True)
    return {"step_peak": report.step_peak, "resident": report.measured_total}


def real(name: str) -> dict:
    import jax
    import torch

    import zerojax

    def status(field: str) -> int:
        """A /proc/self/status figure in bytes (VmRSS: resident now; VmHWM: its peak)."""
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    torch.manual_seed(0)
    model, args = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = zerojax.initialize(model, optimizer, CONFIGS[name]["config"])
    for step in range(3):
        if step == 2:
            resident = sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards)
            before = status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the kernel restarts the peak (VmHWM) from the current RSS
        loss = model(*args)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        float(loss)
    return {"resident": resident, "rss_growth": status("VmHWM") - before}


def run_child(role: str, name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        PYTHONPATH=str(REPO),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
        MALLOC_MMAP_THRESHOLD_="65536",
    )
    result = subprocess.run(
        [sys.executable, __file__, "--child", role, name],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=900,
    )
    if result.returncode != 0:
        raise SystemExit(f"{role} {name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    mb = lambda b: b / 2**20
    print(
        f"{'configuration':<22} {'planned (resident + step)':>27} "
        f"{'real (resident + RSS growth)':>30} {'real/planned':>12}"
    )
    for name, case in CONFIGS.items():
        plan, measured = run_child("planned", name), run_child("real", name)
        planned_total = DEVICES * plan["step_peak"]
        real_total = measured["resident"] + measured["rss_growth"]
        step = planned_total - DEVICES * plan["resident"]
        print(
            f"{name:<22} {mb(planned_total):>8.0f} MiB ({mb(DEVICES * plan['resident']):.0f} + "
            f"{mb(step):.0f}) {mb(real_total):>10.0f} MiB ({mb(measured['resident']):.0f} + "
            f"{mb(measured['rss_growth']):.0f}) {real_total / planned_total:>12.3f}   "
            f"{case['what']}",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        role, name = sys.argv[2], sys.argv[3]
        print(json.dumps(planned(name) if role == "planned" else real(name)))
    else:
        main()
