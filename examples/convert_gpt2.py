"""Convert a Hugging Face GPT-2 (built from a config, no download) and check it against torch.

Prints forward/gradient parity with PyTorch eager and the step time of the jitted JAX program.
Run: make demo   (or .venv/bin/python examples/convert_gpt2.py)
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import zerojax
from zerojax.bridge.dtypes import from_torch


def median_seconds(fn, steps=10):
    fn()  # warm-up (compiles for JAX)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=256)
    model = GPT2LMHeadModel(config).eval()
    tokens = torch.randint(0, config.vocab_size, (8, 128))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 from config: {num_params / 1e6:.1f}M parameters, batch {tuple(tokens.shape)}")

    start = time.perf_counter()
    converted = zerojax.convert(model, (tokens,), {"labels": tokens})
    print(
        f"converted in {time.perf_counter() - start:.1f} s: {len(converted.params)} parameter "
        f"arrays (tied: {converted.tied})"
    )

    def loss_fn(params, tokens):
        output, _ = converted.apply(params, converted.buffers, tokens, labels=tokens)
        return output.loss, output.logits

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    jax_tokens = from_torch(tokens)
    (loss, logits), grads = step(converted.params, jax_tokens)

    output = model(tokens, labels=tokens)
    output.loss.backward()
    logits_err = np.abs(np.asarray(logits) - output.logits.detach().numpy()).max()
    print(f"loss: zerojax {float(loss):.6f}  torch {output.loss.item():.6f}")
    print(f"logits max abs error: {logits_err:.2e}")
    worst = max(
        (
            float(
                jnp.linalg.norm(grads[name] - from_torch(p.grad))
                / jnp.linalg.norm(from_torch(p.grad))
            ),
            name,
        )
        for name, p in model.named_parameters()
        if name in grads
    )
    print(f"gradients: worst relative error {worst[0]:.2e} ({worst[1]})")

    def jax_step():
        (_loss, _), grads = step(converted.params, jax_tokens)
        jax.block_until_ready(grads)

    def torch_step():
        model.zero_grad()
        model(tokens, labels=tokens).loss.backward()

    jax_time, torch_time = median_seconds(jax_step), median_seconds(torch_step)
    print(
        f"forward+backward step: zerojax (jit) {jax_time * 1e3:.1f} ms, "
        f"PyTorch eager {torch_time * 1e3:.1f} ms  -> {torch_time / jax_time:.2f}x"
    )


if __name__ == "__main__":
    main()
