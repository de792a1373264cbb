"""Inputs of a dtype torch refuses are refused with torch's message (zerojax/bridge/dtype_checks.py).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/train/test_input_dtypes.py

Why: an int64, float64, float16 or bool input to a float32 `nn.Linear` was computed as float32
(the lowerings promote; torch.export's meta kernels do not check), where torch raises
`RuntimeError: mat1 and mat2 must have the same dtype, but got Double and Float`. Each case reads
torch 2.13's own error on the same module and inputs and expects the same type and first line.
What torch accepts must keep working: a model that casts its input itself, integer token ids
into an embedding (int64 or int32), and, under a bf16 compute policy (zerojax's autocast), a
float16 input as torch.autocast accepts it -- but not float64, which autocast leaves alone.
"""

import copy

import jax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from zerojax.bridge.dtypes import from_torch

# fp32 forward of a 2-layer MLP, zerojax vs torch: a few ulps of reordered sums.
RTOL, ATOL = 1e-5, 1e-6


class MLP(nn.Module):
    def __init__(self, cast_input=False):
        super().__init__()
        self.cast_input = cast_input
        self.net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x.float() if self.cast_input else x)


def _torch_error(module, x) -> BaseException:
    with pytest.raises(Exception) as caught:
        module(x)
    return caught.value


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0]


def _input(dtype):
    x = torch.randn(8, 6)
    return x.bool() if dtype is torch.bool else (x * 3).to(dtype)


@pytest.fixture(scope="module")
def wrapped():
    """A float32 MLP after initialize (ZeRO-3 over 8 devices) and its torch twin."""
    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    model, _ = zerojax.initialize(
        module, optimizer, config={"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
    )
    return model, reference


@pytest.mark.multidevice
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]
)
def test_refused_input_dtypes_raise_torchs_error(wrapped, dtype):
    model, reference = wrapped
    x = _input(dtype)
    expected = _torch_error(reference, x)
    assert isinstance(expected, RuntimeError)
    with pytest.raises(RuntimeError) as caught:
        model(x)
    message = str(caught.value)
    if dtype is torch.int32:
        # JAX holds int32 and int64 alike (no x64): the program is captured with int64 ids,
        # so torch's "Int" reads "Long" here; the refusal is the same.
        assert _first_line(caught.value) == _first_line(expected).replace("Int", "Long")
    else:
        assert _first_line(caught.value) == _first_line(expected)
    assert "module 'net.0' (Linear)" in message, message
    # A good input after a refused one runs, and computes torch's values.
    good = torch.randn(8, 6)
    torch.testing.assert_close(model(good), reference(good), rtol=RTOL, atol=ATOL)


@pytest.mark.multidevice
def test_a_model_that_casts_its_input_takes_float64():
    torch.manual_seed(0)
    module = MLP(cast_input=True)
    reference = copy.deepcopy(module)
    model, _ = zerojax.initialize(module, None, config={"mesh": {"fsdp": 8}})
    x = torch.randn(8, 6, dtype=torch.float64)
    torch.testing.assert_close(model(x), reference(x), rtol=RTOL, atol=ATOL)


@pytest.mark.multidevice
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_token_ids_into_an_embedding_train(dtype):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model, optimizer = zerojax.initialize(
        module, optimizer, config={"mesh": {"fsdp": 8}, "zero": {"stage": 3}}
    )
    tokens = torch.randint(0, 32, (8, 5), dtype=dtype)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.long().flatten())
    ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), tokens.long().flatten())
    loss.backward()
    optimizer.step()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())


@pytest.mark.multidevice
def test_bf16_policy_takes_float16_as_autocast_does_and_refuses_float64():
    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    model, _ = zerojax.initialize(
        module,
        None,
        config={"mesh": {"fsdp": 8}, "precision": "params=bfloat16,compute=bfloat16"},
    )
    half = torch.randn(8, 6, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(half)
    # bf16 arithmetic on both sides, rounded differently: bf16's 2^-8 relative step, a few.
    torch.testing.assert_close(model(half).float(), expected.float(), rtol=3e-2, atol=3e-2)
    wide = torch.randn(8, 6, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        refused = _torch_error(reference, wide)
    assert "Double and BFloat16" in str(refused)
    with pytest.raises(RuntimeError) as caught:
        model(wide)
    assert _first_line(caught.value) == _first_line(refused)


def test_convert_refuses_a_float64_input_to_apply():
    """The bare bridge: `zerojax.convert(...).apply` with torch tensors, jitted or not."""
    torch.manual_seed(0)
    module = MLP()
    x = torch.randn(8, 6)
    converted = zerojax.convert(module, (x,))
    torch.testing.assert_close(
        torch.from_dlpack(
            jax.jit(converted.apply)(converted.params, converted.buffers, from_torch(x))[0]
        ),
        module(x),
        rtol=RTOL,
        atol=ATOL,
    )
    wide = x.double()
    expected = _torch_error(module, wide)
    with pytest.raises(RuntimeError) as caught:
        converted.apply(converted.params, converted.buffers, wide)
    assert _first_line(caught.value) == _first_line(expected)
    half = x.half()
    expected = _torch_error(module, half)
    with pytest.raises(RuntimeError) as caught:
        converted.apply(converted.params, converted.buffers, from_torch(half))
    assert _first_line(caught.value) == _first_line(expected)
