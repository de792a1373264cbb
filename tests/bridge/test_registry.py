"""The lowering table: decorator registration, duplicates, supported_ops()."""

import pytest
import torch

import zerojax
from zerojax.bridge import registry

aten = torch.ops.aten


def test_registering_an_overload_twice_raises_and_names_both():
    existing = registry.get_lowering(aten.add.Tensor)
    with pytest.raises(
        registry.DuplicateLoweringError, match=r"aten\.add\.Tensor already lowered by"
    ):
        registry.lowering(aten.add.Tensor)(lambda ctx, a, b, alpha=1: a + b)
    assert registry.get_lowering(aten.add.Tensor) is existing


def test_lowering_rejects_a_packet_instead_of_an_overload():
    with pytest.raises(TypeError, match="ATen overloads"):
        registry.lowering(aten.add)


def test_supported_ops_holds_overloads_and_covers_the_common_core():
    ops = zerojax.bridge.supported_ops()
    assert all(isinstance(op, torch._ops.OpOverload) for op in ops)
    for op in (
        aten.addmm.default,
        aten.convolution.default,
        aten.native_layer_norm.default,
        aten.scaled_dot_product_attention.default,
        aten.native_dropout.default,
        aten.index_put.default,
        aten._softmax.default,
        aten.view.default,
    ):
        assert op in ops, op
