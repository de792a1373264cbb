"""Two AdamW steps of a small GPT-2 under ZeRO-3 on 8 CPU devices, in a fresh process, for
tests/runtime/test_program_cache.py: a restarted job's first steps.

Run: python tests/runtime/program_cache_script.py CACHE_DIR|none OUT.npz
Writes the engine's weights after the steps to OUT.npz and prints one JSON line: the losses,
the programs served from the program cache, whether the update's donated params were consumed
and the update executable's output shardings.
"""

import json
import logging
import sys

import jax
import numpy as np
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import GPT2, GPT2Config

CONFIG = GPT2Config(vocab_size=64, max_seq_len=16, width=32, num_layers=2, num_heads=4, dropout=0)
LR, WEIGHT_DECAY = 1e-3, 0.1


def batches(num_steps: int):
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, CONFIG.vocab_size, (8, 16), generator=generator) for _ in range(2)]
    return [(t, torch.roll(t, -1, dims=1)) for t in tokens[:num_steps]]


def model_and_optimizer():
    torch.manual_seed(0)
    module = GPT2(CONFIG)
    return module, torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


class Loads(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.programs = []

    def emit(self, record):
        message = record.getMessage()
        if "loaded from the program cache" in message:
            self.programs.append(message.split()[2])


def main(cache: str, out: str) -> None:
    loads = Loads()
    logging.getLogger("zerojax").addHandler(loads)
    logging.getLogger("zerojax").setLevel(logging.INFO)
    module, optimizer = model_and_optimizer()
    model, optimizer = zerojax.initialize(
        module,
        optimizer,
        config={
            "mesh": {"fsdp": 8},
            "zero": {"stage": 3},
            "runtime": {"compilation_cache_dir": None if cache == "none" else cache},
        },
    )
    losses, consumed = [], []
    for tokens, targets in batches(2):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        before = list(model.engine.state.params.values())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        consumed.append(all(a.is_deleted() for a in before))
    engine = model.engine
    np.savez(out, **{n: np.asarray(v) for n, v in engine.state.weights.items()})
    update = engine.compiled_programs()["update"]
    result = {
        "losses": losses,
        "loaded": loads.programs,
        "donated_params_consumed": consumed,
        "output_shardings": [repr(s) for s in jax.tree.leaves(update.output_shardings)],
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    # A user's process: 8 CPU devices of its own (the test imports this module for its model).
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    main(*sys.argv[1:3])
