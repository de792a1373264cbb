"""Runtime assertions leave the captured graph with the values computed only for them.

    pytest -q tests/bridge/test_assertions.py

Why: Hugging Face LLaVA checks its image-token count with `torch._check_tensor_all`, which
torch.export records as `_is_all_true -> item() -> sym_ite -> _assert_scalar`; the host read
(`item()`) cannot run in a jitted program and `sym_ite` has no lowering, so LLaVA failed to
convert although nothing it computes depends on the check.
"""

import jax
import numpy as np
import pytest
import torch
from torch import nn

import zerojax
from zerojax.bridge.assertions import ASSERTIONS, drop_assertions
from zerojax.bridge.capture import capture
from zerojax.bridge.dtypes import from_torch


class ChecksTokenCount(nn.Module):
    """LLaVA's get_placeholder_mask in five lines: a count check beside the real mask."""

    def forward(self, ids, x):
        mask = ids == 3
        torch._check_tensor_all(mask.sum() * x.shape[-1] == x[:1].numel())
        return x * mask.unsqueeze(-1)


def _inputs():
    ids = torch.tensor([[3, 1, 3], [2, 3, 2]])  # three 3s: the check holds for x of shape (2,3,2)
    return ids, torch.randn(2, 3, 2)


def test_assert_only_chain_is_dropped_and_the_model_runs_under_jit():
    ids, x = _inputs()
    graph = capture(ChecksTokenCount(), (ids, x), {}, train=False).graph_module.graph
    targets = {node.target for node in graph.nodes}
    assert not targets & ASSERTIONS
    assert torch.sym_ite not in targets
    assert torch.ops.aten._is_all_true.default not in targets
    assert torch.ops.aten._local_scalar_dense.default not in targets

    converted = zerojax.convert(ChecksTokenCount(), (ids, x))
    out, _ = jax.jit(converted.apply)(converted.params, converted.buffers, ids.numpy(), x.numpy())
    # Elementwise product with a 0/1 mask: exact.
    np.testing.assert_array_equal(np.asarray(out), ChecksTokenCount()(ids, x).numpy())


def test_a_value_an_assertion_shares_with_real_computation_stays():
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    eq = graph.call_function(torch.ops.aten.eq.Scalar, (a, 3))
    total = graph.call_function(torch.ops.aten.sum.default, (eq,))  # feeds only the assertion
    graph.call_function(torch.ops.aten._assert_async.msg, (total, "no 3 in a"))
    out = graph.call_function(torch.ops.aten.mul.Tensor, (a, eq))  # eq also feeds the output
    graph.output((out,))

    assert drop_assertions(graph) == 2  # the assertion and the sum
    kept = [node.target for node in graph.nodes if node.op == "call_function"]
    assert kept == [torch.ops.aten.eq.Scalar, torch.ops.aten.mul.Tensor]


@pytest.mark.slow  # ~10 s; tests/tools/test_model_coverage.py runs LLaVA in the default suite
def test_tiny_llava_converts_and_matches_torch():
    """The model the chain came from, as small as its config allows."""
    import transformers

    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
    )
    text = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    image_token, num_image_tokens = 63, 4  # (8 / 4)^2 patches; "default" drops CLS
    config = transformers.LlavaConfig(
        vision_config=vision.to_dict() | {"model_type": "clip_vision_model"},
        text_config=text.to_dict() | {"model_type": "llama"},
        image_token_index=image_token,
        image_seq_length=num_image_tokens,
    )
    model = transformers.LlavaForConditionalGeneration(config).eval()
    ids = torch.randint(4, image_token, (2, 10))
    ids[:, 1 : 1 + num_image_tokens] = image_token
    pixels = torch.randn(2, 3, 8, 8)

    converted = zerojax.convert(model, (ids,), {"pixel_values": pixels})
    out, _ = jax.jit(converted.apply)(
        converted.params, converted.buffers, from_torch(ids), pixel_values=from_torch(pixels)
    )
    with torch.no_grad():
        expected = model(ids, pixel_values=pixels).logits
    # fp32 ulp 6e-8 x accumulation depth of a few hundred (3 blocks of width <= 32): 1e-5.
    np.testing.assert_allclose(np.asarray(out.logits), expected.numpy(), rtol=1e-5, atol=1e-5)
