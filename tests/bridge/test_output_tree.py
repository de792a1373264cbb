"""Output containers through `Converted.apply` and `jax.jit`: namedtuples, torch structseqs.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_output_tree.py -p no:cacheprovider`
Why: torchvision's GoogLeNet and Inception-v3 return namedtuples in train mode; torch's pytree
spec names every namedtuple class by the pseudo-type `collections.namedtuple`, which once made
`convert` fail with "issubclass() arg 1 must be a class". The container must come back as the
module's own type, with jax.Array leaves, through `jax.jit`.
Tolerance: one fp32 Linear (8-long dot products): 1e-6 relative, a few ulp.
"""

import collections

import jax
import numpy as np
import torch
from torch import nn

import zerojax
from tests import tolerances
from zerojax.bridge.dtypes import from_torch

AuxOutputs = collections.namedtuple("AuxOutputs", ["logits", "aux_logits"])


class ReturnsNamedTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        logits = self.head(x)
        return {"main": AuxOutputs(logits, logits.sum(-1)), "max": logits.max(dim=-1)}


def test_namedtuple_and_structseq_outputs_keep_their_types_through_jit():
    model, x = ReturnsNamedTuple(), torch.randn(3, 8)
    expected = model(x)
    converted = zerojax.convert(model, (x,))
    out, _ = jax.jit(converted.apply)(converted.params, converted.buffers, from_torch(x))
    assert type(out["main"]) is AuxOutputs
    assert type(out["max"]) is torch.return_types.max
    # Running-error bounds on the float32 roundings (tolerances.absolute: the model on |x| and
    # |params|): logits an 8-term dot and the bias (9), aux their 4-term sum (4 more), per side.
    magnitude = tolerances.absolute(model)(x.abs().double())
    for ours, theirs, roundings, s in [
        (out["main"].logits, expected["main"].logits, 9, magnitude["main"].logits),
        (out["main"].aux_logits, expected["main"].aux_logits, 13, magnitude["main"].aux_logits),
        (out["max"].values, expected["max"].values, 9, magnitude["max"].values),
    ]:
        assert isinstance(ours, jax.Array)
        bound = tolerances.rounded_intermediates(torch.float32, 2 * roundings, s)
        tolerances.assert_within(torch.tensor(np.asarray(ours)), theirs.detach(), bound)
    np.testing.assert_array_equal(out["max"].indices, expected["max"].indices)


def test_namedtuple_output_is_differentiable():
    model, x = ReturnsNamedTuple(), torch.randn(3, 8)
    converted = zerojax.convert(model, (x,))

    def loss(params):
        out, _ = converted.apply(params, converted.buffers, from_torch(x))
        return out["main"].aux_logits.sum()

    grads = jax.grad(loss)(converted.params)
    model(x)["main"].aux_logits.sum().backward()
    # d/dW of sum(x W^T): column sums of x over the 3 rows, 3-term sums of |x| per side.
    bound = tolerances.reordered_sum(torch.float32, 3, 1.0) * x.abs().sum(0).double()
    expected = model.head.weight.grad
    tolerances.assert_within(
        torch.tensor(np.asarray(grads["head.weight"])), expected, bound.expand_as(expected)
    )
