"""Out-of-range indices raise torch's error, as torch raises it (zerojax/bridge/index_bounds.py).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/bridge/test_index_bounds.py

Why: JAX clamps gathers and drops scatters where torch raises, so an `nn.Embedding(128, 4)` read
at 200 returned row 127 and `cross_entropy` with target 99 of 8 classes a finite loss: a
vocabulary mismatch trained on garbage without a word. Each op torch checks is run here through
the bridge under `jax.jit` with an index just past each end of its range: the error type and
the first line of its message must be torch 2.13's own (read from torch on the same inputs),
and the rest of the message must name the op and the module path. Indices torch accepts
(negative ones where the op wraps them, `ignore_index` targets) must compute torch's values.
The last tests train through `zerojax.initialize` under ZeRO-3 on 8 devices: fused and general
paths, the error at the first read of the step's results, and the config switch that turns the
check off.
"""

import copy

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerojax
from zerojax.bridge.dtypes import from_torch, to_torch
from zerojax.bridge.index_bounds import IndexBounds, raise_if_out_of_range

# fp32 values of the same gathers/scatters: equal bits; losses through log-softmax within
# a few ulps of torch's (different summation order).
RTOL, ATOL = 1e-6, 1e-6


class Op(nn.Module):
    """`fn(x, i)` as a module, so the error's module path is known ('' is the root)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, i):
        return self.fn(x, i)


class Holder(nn.Module):
    """`Op` one level down: the error must name 'inner'."""

    def __init__(self, fn):
        super().__init__()
        self.inner = Op(fn)

    def forward(self, x, i):
        return self.inner(x, i)


def run_checked(fn, x, i, *, check=True):
    """`fn(x, i)` converted and run under jax.jit with the index check (or without)."""
    module = Holder(fn)
    converted = zerojax.convert(module, (x, i))

    def apply(params, buffers, x, i):
        bounds = IndexBounds() if check else None
        outputs, _ = converted.apply(params, buffers, x, i, index_bounds=bounds)
        return outputs, None if bounds is None else bounds.packed()

    outputs, flags = jax.jit(apply)(
        converted.params, converted.buffers, from_torch(x), from_torch(i)
    )
    raise_if_out_of_range(flags)
    return to_torch(outputs)


W = torch.randn(5, 3)


def _embedding(x, i):
    return F.embedding(i, W)


def _expand(i):
    return i[None].expand(4, i.shape[0])


# name -> (fn, lowest valid index, highest valid index + 1); x is (4, 5), i a 1-d index.
CASES = {
    "embedding": (_embedding, 0, 5),
    "index_select": (lambda x, i: x.index_select(1, i), 0, 5),
    "index_select_rows": (lambda x, i: x.index_select(0, i), 0, 4),
    "gather": (lambda x, i: x.gather(1, _expand(i)), 0, 5),
    "take": (lambda x, i: torch.take(x, i), -20, 20),
    "index": (lambda x, i: x[:, i], -5, 5),
    "index_rows": (lambda x, i: x[i], -4, 4),
    "index_put": (lambda x, i: x.index_put((i,), torch.ones(5)), -4, 4),
    "index_put_accumulate": (
        lambda x, i: x.index_put((i,), torch.ones(5), accumulate=True),
        -4,
        4,
    ),
    "setitem": (lambda x, i: _setitem(x, i), -4, 4),
    "index_add": (lambda x, i: x.index_add(1, i, torch.ones(4, i.shape[0])), 0, 5),
    "index_copy": (lambda x, i: x.index_copy(1, i, torch.ones(4, i.shape[0])), 0, 5),
    "index_fill": (lambda x, i: x.index_fill(1, i, 2.0), -5, 5),
    "scatter_value": (lambda x, i: x.scatter(1, _expand(i), 1.0), 0, 5),
    "scatter_src": (lambda x, i: x.scatter(1, _expand(i), torch.ones(4, i.shape[0])), 0, 5),
    "scatter_add": (lambda x, i: x.scatter_add(1, _expand(i), torch.ones(4, i.shape[0])), 0, 5),
    "scatter_reduce": (
        lambda x, i: x.scatter_reduce(1, _expand(i), torch.ones(4, i.shape[0]), "amax"),
        0,
        5,
    ),
    "put": (lambda x, i: x.put(i, torch.ones(i.shape[0])), -20, 20),
    "cross_entropy": (lambda x, i: F.cross_entropy(x[: i.shape[0]], i), 0, 5),
    "cross_entropy_smoothing": (
        lambda x, i: F.cross_entropy(x[: i.shape[0]], i, label_smoothing=0.1),
        0,
        5,
    ),
    "nll_loss": (lambda x, i: F.nll_loss(F.log_softmax(x[: i.shape[0]], 1), i), 0, 5),
    "cross_entropy_module": (lambda x, i: nn.CrossEntropyLoss()(x[: i.shape[0]], i), 0, 5),
    "one_hot": (lambda x, i: F.one_hot(i, 5).float() + x[0, 0], 0, 5),
}


def _setitem(x, i):
    y = x.clone()
    y[i] = 3.0
    return y


def _torch_error(fn, x, i) -> BaseException:
    with pytest.raises(Exception) as caught:
        fn(x, i)
    return caught.value


def _index(*values):
    return torch.tensor([0, *values])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("end", ["high", "low"])
def test_out_of_range_raises_torchs_error(name, end):
    fn, low, high = CASES[name]
    x = torch.randn(4, 5)
    bad = _index(high if end == "high" else low - 1)
    expected = _torch_error(fn, x, bad)
    with pytest.raises(type(expected)) as caught:
        run_checked(fn, x, bad)
    message = str(caught.value)
    assert message.splitlines()[0] == str(expected).splitlines()[0]
    assert "module 'inner'" in message, message
    assert f"index {int(bad[1])}" in message, message


@pytest.mark.parametrize("name", [n for n, (_, low, _) in CASES.items() if low < 0])
def test_negative_indices_torch_allows_compute_its_values(name):
    fn, low, high = CASES[name]
    x = torch.randn(4, 5)
    i = _index(low, -1, high - 1)
    torch.testing.assert_close(run_checked(fn, x, i), fn(x, i), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["cross_entropy", "cross_entropy_smoothing", "nll_loss"])
def test_ignored_targets_are_not_out_of_range(name):
    fn = CASES[name][0]
    x = torch.randn(4, 5)
    for i, kwargs_fn in (
        (torch.tensor([1, -100, 4]), fn),
        (
            torch.tensor([7, 2, 7]),
            lambda x, i: F.cross_entropy(x[: i.shape[0]], i, ignore_index=7),
        ),
    ):
        torch.testing.assert_close(
            run_checked(kwargs_fn, x, i), kwargs_fn(x, i), rtol=RTOL, atol=ATOL
        )


def test_without_the_check_the_program_runs_clamped():
    """The lowerings themselves still clamp: the check is what raises."""
    x = torch.randn(4, 5)
    out = run_checked(_embedding, x, torch.tensor([0, 200]), check=False)
    torch.testing.assert_close(out[1], W[4])  # clamped to the last row


def test_position_ids_from_an_arange_are_not_checked():
    """GPT-2's `wpe(arange(T))`: provably in range, so no reduction is added for it."""

    def positions(x, i):
        return F.embedding(torch.arange(x.shape[1]), W) + F.embedding(i, W).sum()

    module = Op(positions)
    converted = zerojax.convert(module, (torch.randn(4, 5), torch.tensor([0, 1])))
    bounds = IndexBounds()

    def apply(params, buffers, x, i):
        converted.apply(params, buffers, x, i, index_bounds=bounds)
        return bounds.packed()

    jax.jit(apply)(
        converted.params, converted.buffers, from_torch(torch.randn(4, 5)), jax.numpy.zeros(2, int)
    )
    assert len(bounds.sites) == 1  # the index input's lookup only


# --- through zerojax.initialize: ZeRO-3 on 8 devices -----------------------------------------


class TinyLM(nn.Module):
    def __init__(self, vocab=128, classes=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, tokens, targets=None):
        logits = self.head(self.wte(tokens))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _initialize(module, check=True):
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    config = {
        "mesh": {"fsdp": 8},
        "zero": {"stage": 3},
        "train": {"check_index_bounds": check},
    }
    return zerojax.initialize(module, optimizer, config=config)


def _batch(vocab=128, classes=8):
    return torch.randint(0, vocab, (8, 6)), torch.randint(0, classes, (8, 6))


@pytest.mark.multidevice
def test_zero3_fused_step_raises_on_a_bad_token_and_a_bad_target():
    torch.manual_seed(0)
    module = TinyLM()
    reference = copy.deepcopy(module)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model, optimizer = _initialize(module)
    tokens, targets = _batch()
    # A good step first: the loss is torch's.
    loss = model(tokens, targets)
    ref_loss = reference(tokens, targets)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    ref_loss.backward()
    ref_optimizer.step()
    ref_optimizer.zero_grad()
    weights_before = {n: p.detach().clone() for n, p in model.named_parameters()}

    bad_tokens = tokens.clone()
    bad_tokens[3, 2] = 200
    with pytest.raises(IndexError, match="index out of range in self") as caught:
        reference(bad_tokens, targets)
    with pytest.raises(IndexError, match="index out of range in self") as caught:
        model(bad_tokens, targets)  # raised when the loss is handed to torch
    assert "module 'wte' (Embedding)" in str(caught.value)
    assert "read index 200" in str(caught.value)

    bad_targets = targets.clone()
    bad_targets[0, 0] = 99
    with pytest.raises(IndexError, match="Target 99 is out of bounds."):
        reference(tokens, bad_targets)
    with pytest.raises(IndexError, match="Target 99 is out of bounds.") as caught:
        model(tokens, bad_targets)
    assert "cross_entropy in module '<root>'" in str(caught.value)
    # Nothing was applied from the bad steps; training goes on from where it was.
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), weights_before[name], rtol=0, atol=0)
    loss = model(tokens, targets)
    ref_loss = reference(tokens, targets)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())


@pytest.mark.multidevice
def test_zero3_general_path_raises_and_the_switch_turns_it_off():
    """Logits to a torch loss (forward_vjp, then backward); `check_index_bounds: false` gives
    the old clamped result and no error."""
    torch.manual_seed(0)
    tokens, targets = _batch()
    tokens[1, 1] = -1
    module = TinyLM()
    model, _ = _initialize(copy.deepcopy(module))
    with pytest.raises(IndexError, match="index out of range in self") as caught:
        model(tokens)
    assert "read index -1" in str(caught.value)

    unchecked, _ = _initialize(copy.deepcopy(module), check=False)
    logits = unchecked(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    clamped = tokens.clamp(0, 127)
    torch.testing.assert_close(logits, module(clamped), rtol=1e-5, atol=1e-6)


@pytest.mark.multidevice
def test_error_waits_no_longer_than_the_next_engine_call():
    """The flag is read when the step's results are: `model(x)`'s outputs (which waited for the
    program), so the failing call itself raises; the step after a failure runs normally."""
    torch.manual_seed(0)
    model, optimizer = _initialize(TinyLM())
    tokens, targets = _batch()
    tokens[0, 0] = 128
    with pytest.raises(IndexError):
        model(tokens, targets)
    tokens[0, 0] = 127
    model(tokens, targets).backward()
    optimizer.step()
    assert np.isfinite(model(tokens, targets).item())


@pytest.mark.multidevice
def test_ops_on_live_tensors_raise_at_the_call():
    """`zerojax.bridge.eager`: torch ops on a wrapped model's parameters run the same lowerings;
    an index out of range raises there and then, and a good one computes torch's rows."""
    module = TinyLM()
    reference = copy.deepcopy(module)
    model, _ = _initialize(module)
    weight = model.wte.weight.detach()
    rows = torch.tensor([3, 127])
    torch.testing.assert_close(
        weight.index_select(0, rows).numpy(), reference.wte.weight.detach()[rows].numpy()
    )
    expected = _torch_error(lambda w, i: w.index_select(0, i), reference.wte.weight, _index(128))
    with pytest.raises(type(expected), match="index out of range in self"):
        weight.index_select(0, _index(128))
