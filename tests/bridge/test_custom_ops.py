"""Custom `torch.library` ops: user lowerings, decomposition fallback, and the error for neither.

Run: `.venv/bin/python -m pytest -q tests/bridge/test_custom_ops.py`

A library's own op (transformers' grouped GEMM, a fused kernel) used to stop conversion. Now it
converts when (1) someone registers a JAX lowering with `zerojax.register_lowering`, or (2) the
op has a Python implementation torch can trace into ATen; otherwise the error names the op, the
module path and the source line, and says how to lower it. torch.library ops are process-global,
so each is defined once here under the test-only `zjtest` namespace; lowerings registered by a
test live in a private copy of the table (`isolated_table`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zerojax
from tests.bridge.test_models import relative_error
from zerojax.bridge import registry
from zerojax.bridge.dtypes import from_torch
from zerojax.bridge.errors import MissingLoweringError

# fp32 elementwise chains of a few ops on O(1) values: torch and XLA each round every op once
# (0.5 ulp = 6e-8), transcendental kernels add a few ulp; 1e-6 is ~10 ulp of headroom.
RTOL = 1e-6


# --- test ops (defined once per process) ------------------------------------------------------


@torch.library.custom_op("zjtest::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _gelu_like(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


@torch.library.custom_op("zjtest::gelu_like", mutates_args=())
def gelu_like(x: torch.Tensor) -> torch.Tensor:
    return _gelu_like(x)


@gelu_like.register_fake
def _(x):
    return torch.empty_like(x)


# Autograd for eager torch: the reference gradient of the decomposed op.
def _gelu_like_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    s = torch.sigmoid(1.702 * x)
    return grad * (s + 1.702 * x * s * (1 - s))


gelu_like.register_autograd(
    _gelu_like_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs)
)

_LIB = torch.library.Library("zjtest", "FRAGMENT")  # kept alive: it owns the definitions
# A CPU kernel written in Python, registered the pre-custom_op way.
_LIB.define("cpu_only(Tensor x) -> Tensor")
_LIB.impl("cpu_only", lambda x: torch.cos(x) * 2 + x, "CPU")
_LIB.impl("cpu_only", lambda x: torch.empty_like(x), "Meta")
# A CompositeImplicitAutograd op: torch itself decomposes it unless a lowering keeps it whole.
_LIB.define("implicit(Tensor x) -> Tensor")
_LIB.impl("implicit", lambda x: torch.sin(x) + 1, "CompositeImplicitAutograd")
# Only a shape function: nothing to run, so nothing to decompose into.
_LIB.define("opaque(Tensor x) -> Tensor")
torch.library.register_fake("zjtest::opaque", lambda x: torch.empty_like(x), lib=_LIB)


# An implementation that reads tensor values: it cannot be traced to one static program.
@torch.library.custom_op("zjtest::value_driven", mutates_args=())
def value_driven(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    start = 0
    for end in counts.cumsum(0).tolist():
        out[start:end] = x[start:end] * (end - start)
        start = end
    return out


@value_driven.register_fake
def _(x, counts):
    return torch.empty_like(x)


@pytest.fixture
def isolated_table(monkeypatch):
    """Lowerings registered by the test vanish after it (the real table stays untouched)."""
    registry.supported_ops()  # load the built-ins into the table being copied
    monkeypatch.setattr(registry, "_LOWERINGS", dict(registry._LOWERINGS))
    monkeypatch.setattr(registry, "_LOWERINGS_BY_NAME", dict(registry._LOWERINGS_BY_NAME))
    monkeypatch.setattr(registry, "_KEPT_WHOLE_NAMES", set(registry._KEPT_WHOLE_NAMES))


class Block(torch.nn.Module):
    """linear -> `op` -> linear, so the op sits inside a named submodule with parameters."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.inp = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.op(self.inp(x)))


class Net(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.block = Block(op)

    def forward(self, x):
        return self.block(x).sum(-1)


def _targets(converted) -> set[str]:
    (program, _, _), *_ = converted._programs.values()
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def _forward_and_grad_match(model: torch.nn.Module, reference: torch.nn.Module, converted):
    """Converted forward and parameter gradients of sum(output) vs torch on `reference`."""
    x = torch.randn(3, 8)
    expected = reference(x)
    expected.sum().backward()
    got, _ = jax.jit(converted.apply)(converted.params, converted.buffers, from_torch(x))
    assert relative_error(got, expected.detach().numpy()) <= RTOL

    def loss(params):
        out, _ = converted.apply(params, converted.buffers, from_torch(x))
        return out.sum()

    grads = jax.jit(jax.grad(loss))(converted.params)
    for name, p in reference.named_parameters():
        err = relative_error(grads[name], p.grad.numpy())
        assert err <= RTOL, f"gradient of {name}: relative error {err:.2e}"


# --- 1. a user's lowering -----------------------------------------------------------------------


def test_registered_lowering_is_used_and_matches_torch(isolated_table):
    calls = []

    @zerojax.register_lowering(torch.ops.zjtest.scaled_tanh)
    def lower_scaled_tanh(ctx, x, scale):
        calls.append(ctx.node.name)
        return jnp.tanh(x) * scale

    model = Net(lambda h: scaled_tanh(h, 2.5))
    converted = zerojax.convert(model, (torch.randn(3, 8),))
    # Kept whole although it has a Python implementation: the user's lowering wins.
    assert "zjtest.scaled_tanh.default" in _targets(converted)
    reference = Net(lambda h: torch.tanh(h) * 2.5)
    reference.load_state_dict(model.state_dict())
    _forward_and_grad_match(model, reference, converted)
    assert calls, "the registered lowering was never called"


def test_lowering_registered_by_name_before_the_op_exists(isolated_table):
    """transformers defines its ops on import; a name registered earlier must still be found."""

    @zerojax.register_lowering("zjtest::defined_later")
    def lower_defined_later(ctx, x):
        return x * 3.0

    lib = torch.library.Library("zjtest", "FRAGMENT")
    lib.define("defined_later(Tensor x) -> Tensor")
    lib.impl("defined_later", lambda x: torch.empty_like(x), "Meta")
    op = torch.ops.zjtest.defined_later.default
    assert registry.get_lowering(op) is lower_defined_later
    assert op in zerojax.bridge.supported_ops()
    model = Net(torch.ops.zjtest.defined_later)
    converted = zerojax.convert(model, (torch.randn(3, 8),))
    reference = Net(lambda h: h * 3.0)
    reference.load_state_dict(model.state_dict())
    _forward_and_grad_match(model, reference, converted)


def test_a_composite_implicit_op_with_a_lowering_is_kept_whole(isolated_table):
    """torch would decompose it during capture; a registered lowering must still be reached."""

    @zerojax.register_lowering("zjtest::implicit.default")
    def lower_implicit(ctx, x):
        return jnp.sin(x) + 1

    model = Net(torch.ops.zjtest.implicit)
    converted = zerojax.convert(model, (torch.randn(3, 8),))
    assert "zjtest.implicit.default" in _targets(converted)
    reference = Net(lambda h: torch.sin(h) + 1)
    reference.load_state_dict(model.state_dict())
    _forward_and_grad_match(model, reference, converted)


def test_registering_twice_raises_unless_override(isolated_table):
    def first(ctx, x, scale):
        return x

    def second(ctx, x, scale):
        return x * scale

    zerojax.register_lowering(torch.ops.zjtest.scaled_tanh.default)(first)
    with pytest.raises(registry.DuplicateLoweringError, match="zjtest.scaled_tanh.default"):
        zerojax.register_lowering("zjtest::scaled_tanh")(second)
    assert registry.get_lowering(torch.ops.zjtest.scaled_tanh.default) is first
    zerojax.register_lowering("zjtest::scaled_tanh", override=True)(second)
    assert registry.get_lowering(torch.ops.zjtest.scaled_tanh.default) is second
    # Built-in lowerings are protected the same way.
    with pytest.raises(registry.DuplicateLoweringError, match=r"aten\.add\.Tensor"):
        zerojax.register_lowering(torch.ops.aten.add.Tensor)(second)


def test_register_lowering_rejects_what_is_not_an_op():
    with pytest.raises(TypeError, match="qualified name"):
        zerojax.register_lowering(torch.tanh)
    with pytest.raises(ValueError, match="'ns::op'"):
        zerojax.register_lowering("scaled_tanh")


# --- 2. decomposition through the op's own Python implementation --------------------------------


def test_custom_op_without_lowering_decomposes_through_its_python_implementation():
    model = Net(gelu_like)
    converted = zerojax.convert(model, (torch.randn(3, 8),))
    targets = _targets(converted)
    assert "zjtest.gelu_like.default" not in targets
    assert "aten.sigmoid.default" in targets
    reference = Net(gelu_like)  # eager: the op with its registered autograd formula
    reference.load_state_dict(model.state_dict())
    _forward_and_grad_match(model, reference, converted)


@pytest.mark.parametrize(
    ("op", "math"),
    [
        (torch.ops.zjtest.cpu_only, lambda h: torch.cos(h) * 2 + h),  # Python CPU kernel
        (torch.ops.zjtest.implicit, lambda h: torch.sin(h) + 1),  # CompositeImplicitAutograd
    ],
    ids=["cpu-kernel", "composite-implicit"],
)
def test_library_kernels_decompose_too(op, math):
    model = Net(op)
    converted = zerojax.convert(model, (torch.randn(3, 8),))
    assert not any(t.startswith("zjtest.") for t in _targets(converted))
    reference = Net(math)
    reference.load_state_dict(model.state_dict())
    _forward_and_grad_match(model, reference, converted)


# --- 3. neither: the error says which op, where, and what to do --------------------------------


def test_op_with_neither_lowering_nor_implementation_names_op_module_and_line():
    model = Net(torch.ops.zjtest.opaque)
    with pytest.raises(MissingLoweringError) as caught:
        zerojax.convert(model, (torch.randn(3, 8),))
    message = str(caught.value)
    assert "zjtest.opaque.default" in message
    assert "module 'block' (Block)" in message
    assert "test_custom_ops.py" in message and "self.op(self.inp(x))" in message
    assert "no Python implementation" in message
    assert 'zerojax.register_lowering("zjtest::opaque")' in message
    assert caught.value.ops == ("zjtest.opaque.default",)


def test_value_driven_implementation_cannot_decompose_and_says_why():
    class Grouped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x, counts):
            return value_driven(self.proj(x), counts)

    x, counts = torch.randn(6, 4), torch.tensor([2, 1, 3])
    with pytest.raises(MissingLoweringError) as caught:
        zerojax.convert(Grouped(), (x, counts))
    message = str(caught.value)
    assert "zjtest.value_driven.default" in message
    assert "tracing its Python implementation failed" in message
    assert ".tolist()" in message

    # The same op converts once it has a lowering: groups of data-dependent size, static shape.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_LOWERINGS", dict(registry._LOWERINGS))
        patch.setattr(registry, "_KEPT_WHOLE_NAMES", set(registry._KEPT_WHOLE_NAMES))

        @zerojax.register_lowering(torch.ops.zjtest.value_driven.default)
        def lower_value_driven(ctx, x, counts):
            group = jnp.repeat(jnp.arange(counts.shape[0]), counts, total_repeat_length=x.shape[0])
            return x * counts[group][:, None]

        model = Grouped()
        converted = zerojax.convert(model, (x, counts))
        got, _ = converted.apply(
            converted.params, converted.buffers, from_torch(x), from_torch(counts)
        )
        expected = model(x, counts).detach().numpy()
        assert relative_error(got, expected) <= RTOL
        assert np.all(np.isfinite(np.asarray(got)))
