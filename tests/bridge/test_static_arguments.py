"""Non-tensor arguments (`return_loss=True`, `output_hidden_states=True`, `return_dict=False`,
strings) are static: part of the program's cache key, never traced.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_static_arguments.py -p no:cacheprovider`
Why: CLIP/SigLIP are trained with `model(..., return_loss=True)`; torch.export specializes on
such a value and keeps it as a graph input, and `apply` once fed only the tensors ("traced with
4 tensor input(s), got 3"); through `zerojax.initialize` a Python bool would also have become a
traced array under jax.jit. Each value must give torch's result, and a new value a new program.
Tolerance: `bounds` derives each output's float32 rounding bound per element (a Linear, a Gram
matrix, a cross-entropy over 8 rows); gradients are held to torch's own float32 error against a
float64 twin (tolerances.assert_params_within_torch_error).
"""

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from tests import tolerances
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


def bounds(model: ContrastiveHead, x: torch.Tensor, reduction: str = "mean") -> dict:
    """Two-sided elementwise bounds per output, first order, u = float32 unit roundoff:
    hidden = x W^T + b, 8 products and the bias: 9 u S_h (S_h = |x| |W|^T + |b|); logits =
    hidden hidden^T: both factors' errors and a 4-term dot, (2 x 9 + 4) u S_h S_h^T; the
    cross-entropy row i moves by <= 2 max_j d logits_ij (softmax - onehot has l1 norm <= 2) and
    rounds its 8-term logsumexp, exp and log ((8 + 2 + 2 LIBM_ULPS) u of |logits| and log 8);
    the mean or sum over 8 rows adds 8 u of the rows' magnitudes."""
    u = tolerances.unit_roundoff(torch.float32)
    w, b = model.proj.weight.detach().double(), model.proj.bias.detach().double()
    s_h = x.abs().double() @ w.abs().T + b.abs()
    s_logits = s_h @ s_h.T
    d_logits = (2 * 9 + 4) * u * s_logits
    rows = 2 * d_logits.amax(1) + (10 + 2 * tolerances.LIBM_ULPS) * u * (
        2 * s_logits.amax(1) + np.log(len(x))
    )
    magnitude = 2 * s_logits.amax(1) + np.log(len(x))  # >= |loss_i|
    if reduction == "mean":
        loss = rows.mean() + len(x) * u * magnitude.mean()
    else:
        loss = rows.sum() + len(x) * u * magnitude.sum()
    return {"logits": 2 * d_logits, "hidden_states": 2 * 9 * u * s_h, "loss": 2 * loss}


def _close(ours, theirs, limits: dict, flags: dict):
    """Leaf by leaf within `limits` (by output name; a tuple output is named by `flags`)."""
    if isinstance(theirs, tuple):  # return_dict=False: the dict's values in order
        names = ["logits"] + ["loss"] * bool(flags.get("return_loss"))
        names += ["hidden_states"] * bool(flags.get("output_hidden_states"))
        ours, theirs = dict(zip(names, ours, strict=True)), dict(zip(names, theirs, strict=True))
    assert set(ours) == set(theirs)
    for name, expected in theirs.items():
        got = torch.tensor(np.array(_numpy(ours[name])))
        tolerances.assert_within(got, expected.detach(), limits[name], name)


def test_each_static_value_gives_torchs_result_and_its_own_program():
    model, x = ContrastiveHead(), torch.randn(BATCH, 8)
    converted = zerojax.convert(model, (x,), {"return_loss": True})
    for flags in FLAGS:
        out, _ = converted.apply(converted.params, converted.buffers, from_torch(x), **flags)
        _close(out, model(x, **flags), bounds(model, x, flags.get("reduction", "mean")), flags)
    assert len(converted._programs) == len(FLAGS)


def test_static_arguments_under_jit_as_static_argnames_or_wrapped():
    model, x = ContrastiveHead(), torch.randn(BATCH, 8)
    converted = zerojax.convert(model, (x,))
    expected = model(x, return_loss=True, reduction="sum")
    limits, flags = bounds(model, x, "sum"), {"return_loss": True}
    apply = jax.jit(converted.apply, static_argnames=("return_loss", "reduction"))
    out, _ = apply(
        converted.params, converted.buffers, from_torch(x), return_loss=True, reduction="sum"
    )
    _close(out, expected, limits, flags)
    # Static(...) carries the value in the tree structure: no static_argnames needed.
    out, _ = jax.jit(converted.apply)(
        converted.params,
        converted.buffers,
        from_torch(x),
        return_loss=Static(True),
        reduction=Static("sum"),
    )
    _close(out, expected, limits, flags)


@pytest.mark.multidevice
def test_initialize_trains_with_non_tensor_keyword_arguments():
    torch.manual_seed(0)
    module, reference = ContrastiveHead(), ContrastiveHead()
    reference.load_state_dict(module.state_dict())
    exact = ContrastiveHead().double()
    exact.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    model, _ = zerojax.initialize(module, None, config={"mesh": {"data": -1}})
    x = torch.randn(BATCH, 8)
    out = model(x, return_loss=True, reduction="sum")
    expected = reference(x, return_loss=True, reduction="sum")
    out["loss"].backward()
    expected["loss"].backward()
    exact(x.double(), return_loss=True, reduction="sum")["loss"].backward()
    _close(out, expected, bounds(reference, x, "sum"), {"return_loss": True})
    tolerances.assert_params_within_torch_error(
        {n: p.grad for n, p in module.named_parameters()},
        {n: p.grad for n, p in reference.named_parameters()},
        {n: p.grad for n, p in exact.named_parameters()},
        "gradients",
    )
    # return_dict=False: a tuple; output_hidden_states: one more output.
    flags = {"output_hidden_states": True, "return_dict": False}
    hidden = model(x, **flags)
    assert isinstance(hidden, tuple) and len(hidden) == 2
    _close(hidden, reference(x, **flags), bounds(reference, x), flags)
