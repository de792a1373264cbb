"""Non-tensor arguments (`return_loss=True`, `output_hidden_states=True`, `return_dict=False`,
strings) are static: part of the program's cache key, never traced.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_static_arguments.py -p no:cacheprovider`
Why: CLIP/SigLIP are trained with `model(..., return_loss=True)`; torch.export specializes on
such a value and keeps it as a graph input, and `apply` once fed only the tensors ("traced with
4 tensor input(s), got 3"); through `zerojax.initialize` a Python bool would also have become a
traced array under jax.jit. Each value must give torch's result, and a new value a new program.
Tolerance: a Linear, a 4x4 Gram matrix and a cross-entropy over 4 rows in fp32: <= 8-long
reductions, 1e-6 relative (a few ulp); gradients 1e-5 (products of those).
"""

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from zerojax.bridge import Static
from zerojax.bridge.dtypes import from_torch

BATCH = 8


class ContrastiveHead(nn.Module):
    """CLIP's signature in miniature: flags choose what is computed and how it is returned."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(
        self, x, return_loss=False, output_hidden_states=False, return_dict=True, reduction="mean"
    ):
        hidden = self.proj(x)
        logits = hidden @ hidden.T
        out = {"logits": logits}
        if return_loss:
            out["loss"] = F.cross_entropy(logits, torch.arange(len(x)), reduction=reduction)
        if output_hidden_states:
            out["hidden_states"] = hidden
        return out if return_dict else tuple(out.values())


FLAGS = [
    {},
    {"return_loss": True},
    {"return_loss": True, "reduction": "sum"},
    {"output_hidden_states": True, "return_dict": False},
]


def _numpy(x):
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _close(ours, theirs):
    ours_leaves, ours_def = jax.tree.flatten(ours)
    theirs_leaves, theirs_def = jax.tree.flatten(theirs)
    assert ours_def == theirs_def
    for a, b in zip(ours_leaves, theirs_leaves, strict=True):
        np.testing.assert_allclose(_numpy(a), _numpy(b), rtol=1e-6, atol=1e-6)


def test_each_static_value_gives_torchs_result_and_its_own_program():
    model, x = ContrastiveHead(), torch.randn(BATCH, 8)
    converted = zerojax.convert(model, (x,), {"return_loss": True})
    for flags in FLAGS:
        out, _ = converted.apply(converted.params, converted.buffers, from_torch(x), **flags)
        _close(out, model(x, **flags))
    assert len(converted._programs) == len(FLAGS)


def test_static_arguments_under_jit_as_static_argnames_or_wrapped():
    model, x = ContrastiveHead(), torch.randn(BATCH, 8)
    converted = zerojax.convert(model, (x,))
    expected = model(x, return_loss=True, reduction="sum")
    apply = jax.jit(converted.apply, static_argnames=("return_loss", "reduction"))
    out, _ = apply(
        converted.params, converted.buffers, from_torch(x), return_loss=True, reduction="sum"
    )
    _close(out, expected)
    # Static(...) carries the value in the tree structure: no static_argnames needed.
    out, _ = jax.jit(converted.apply)(
        converted.params,
        converted.buffers,
        from_torch(x),
        return_loss=Static(True),
        reduction=Static("sum"),
    )
    _close(out, expected)


@pytest.mark.multidevice
def test_initialize_trains_with_non_tensor_keyword_arguments():
    torch.manual_seed(0)
    module, reference = ContrastiveHead(), ContrastiveHead()
    reference.load_state_dict(module.state_dict())
    model, _ = zerojax.initialize(module, None, config={"mesh": {"data": -1}})
    x = torch.randn(BATCH, 8)
    out = model(x, return_loss=True, reduction="sum")
    expected = reference(x, return_loss=True, reduction="sum")
    out["loss"].backward()
    expected["loss"].backward()
    _close(out, expected)
    for name, param in reference.named_parameters():
        ours = dict(module.named_parameters())[name].grad
        np.testing.assert_allclose(ours, param.grad, rtol=1e-5, atol=1e-6, err_msg=name)
    # return_dict=False: a tuple; output_hidden_states: one more output.
    hidden = model(x, output_hidden_states=True, return_dict=False)
    assert isinstance(hidden, tuple) and len(hidden) == 2
    _close(hidden, reference(x, output_hidden_states=True, return_dict=False))
