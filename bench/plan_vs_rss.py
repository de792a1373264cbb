"""The planner against reality (issue 11): the planned training-step peak vs the memory a real
step takes, on this machine.

    .venv/bin/python bench/plan_vs_rss.py

For three configurations, each in fresh processes on 4 simulated CPU devices:

- **planned**: `memory_report(abstract=True)` on the model built on the meta device (what
  `zerojax plan --devices 4` runs): the per-device training-step peak;
- **real**: the same model built for real and trained as users train it (`zerojax.initialize`,
  `loss.backward()`, `optimizer.step()`, `zero_grad()`), 4 steps, each in two phases (the
  forward call; backward + step). A phase's peak is the device buffers live when it starts
  (each buffer once, by address) plus the growth of the process's resident memory during it:
  the kernel's own high-water mark (`VmHWM`, restarted through `/proc/self/clear_refs`), so no
  short-lived peak is missed. glibc is told to return large blocks to the system at once
  (`MALLOC_MMAP_THRESHOLD_`), or freed scratch would stay resident and hide the growth. The
  real peak is the largest phase peak after the first step (which compiles).

On CPU the simulated devices share the process's memory, so the comparison is of totals over the
4 devices: planned 4 x per-device peak vs the real peak. Goal: within 10%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICES = 4
STEPS = 4

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
    return {"step_peak": report.step_peak}


def real(name: str) -> dict:
    import jax
    import torch

    import zerojax

    def status(field: str) -> int:
        """A /proc/self/status figure in bytes (VmRSS: resident now; VmHWM: its peak)."""
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    def held() -> int:
        """Bytes of the live device buffers: each once, by address (a sharded array's shards
        are also live arrays of their own once something has read them)."""
        buffers = {
            s.data.unsafe_buffer_pointer(): s.data.nbytes
            for a in jax.live_arrays()
            for s in a.addressable_shards
        }
        return sum(buffers.values())

    torch.manual_seed(0)
    model, args = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = zerojax.initialize(model, optimizer, CONFIGS[name]["config"])
    engine = model.engine
    peaks = []

    def phase(run, ready):
        """Run one phase of a step; its peak: the arrays held before it + the RSS growth."""
        resident, before = held(), status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the kernel restarts the peak (VmHWM) from the current RSS
        result = run()
        jax.block_until_ready(ready())
        peaks.append(resident + status("VmHWM") - before)
        return result

    for _step in range(STEPS):
        loss = phase(lambda: model(*args), lambda: engine.state.grads or engine.state.params)
        phase(lambda loss=loss: (loss.backward(), optimizer.step()), lambda: engine.state.params)
        optimizer.zero_grad()
        float(loss)
    return {"peak": max(peaks[2:])}  # the first step compiles


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
    print(f"{'configuration':<22} {'planned':>10} {'real':>10} {'real/planned':>12}")
    for name, case in CONFIGS.items():
        plan, measured = run_child("planned", name), run_child("real", name)
        planned_total = DEVICES * plan["step_peak"]
        print(
            f"{name:<22} {mb(planned_total):>6.0f} MiB {mb(measured['peak']):>6.0f} MiB "
            f"{measured['peak'] / planned_total:>12.3f}   {case['what']}",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        role, name = sys.argv[2], sys.argv[3]
        print(json.dumps(planned(name) if role == "planned" else real(name)))
    else:
        main()
