"""torch's own `clip_grad_norm_` on live gradients vs the wrapped model's one-program clip.

After one backward of the GPT-2 bench model (bench/architectures.gpt2_bench_model), times
interleaved, --repeats times each, median reported:

- `model.clip_grad_norm_(1.0)`: zerojax's clip, one jitted program over all gradients;
- `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`: torch's function, unpatched, on
  the live `p.grad` tensors (zerojax.train.live_tensor): its ops (a norm per gradient, the
  total, the in-place scales) recorded and run as one program (zerojax.train.deferred);
- the same torch function on the plain-torch twin (its gradients in host memory), for scale.

Each zerojax timing ends when the clipped gradients are ready (`jax.block_until_ready`), so
asynchronous dispatch does not flatter it; the clip factor is 1 after the first clip, but both
contenders still compute and multiply. Target: torch's function on zerojax costs at most 1.1x
`model.clip_grad_norm_`. One CPU device (mesh {data: 1}) and --devices 8 (ZeRO-3 on 8
simulated devices) are separate runs.

Run: .venv/bin/python bench/clip_grad_norm.py [--repeats N] [--devices 8]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    import jax
    import torch
    import torch.nn.functional as F

    import zerojax
    from bench.architectures import gpt2_bench_model
    from bench.timing import interleaved_medians_ms

    torch.manual_seed(0)
    module, (tokens,) = gpt2_bench_model()
    module.eval()
    reference = copy.deepcopy(module)
    targets = torch.roll(tokens, -1, dims=1)
    stage = 3 if args.devices > 1 else 0
    model, _ = zerojax.initialize(
        module, None, {"mesh": {"data": args.devices}, "zero_stage": stage}
    )
    for m in (model, reference):
        F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten()).backward()
    engine = model.engine
    num_grads = len(engine.grads)
    num_elements = sum(g.size for g in engine.grads.values())

    def wrapped_clip():
        model.clip_grad_norm_(1.0)
        jax.block_until_ready(engine.grads)

    def torch_clip_on_live():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        jax.block_until_ready(engine.grads)

    def torch_clip_on_torch():
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)

    contenders = {
        "model.clip_grad_norm_": wrapped_clip,
        "torch clip_grad_norm_ on zerojax": torch_clip_on_live,
        "torch clip_grad_norm_ on torch": torch_clip_on_torch,
    }
    # The untimed calls compile, and make the first clip's real scaling.
    medians = interleaved_medians_ms(contenders, args.repeats)
    print(
        f"GPT-2 bench model: {num_grads} gradients, {num_elements / 1e6:.2f}M elements; "
        f"{args.devices} device(s), ZeRO-{stage}; median of {args.repeats}"
    )
    for name, ms in medians.items():
        print(f"  {name:36s} {ms:8.2f} ms")
    ratio = medians["torch clip_grad_norm_ on zerojax"] / medians["model.clip_grad_norm_"]
    print(f"  torch's function on zerojax / model.clip_grad_norm_: {ratio:.2f}x (target <= 1.1)")


if __name__ == "__main__":
    main()
