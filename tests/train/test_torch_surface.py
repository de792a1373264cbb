"""What a training script touches around the loop, after `zerojax.initialize`: the original
module's tensors, EMAs, deep copies, `nn.init`, freezing, torch's RNG, the wrapper's attributes.

Run: .venv/bin/python -m pytest -q tests/train/test_torch_surface.py -p no:cacheprovider
Why: issue 24. Real scripts reach past the loop -- `raw_model = model.module` and its
`state_dict()`, `AveragedModel` / `p.data.lerp_` EMAs, `copy.deepcopy(model)`, `nn.init` after
wrapping, `model.config`, `inspect.signature(model.forward)` -- and each of these read
unallocated memory, lost a write, or failed before the tensors became live views of the
engine's state (zerojax.train.parameters, zerojax.train.live_tensor). Each test fails without
the piece it names. Values are compared with a plain-torch twin on the same inputs.
"""

from __future__ import annotations

import copy
import inspect
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zerojax
from bench.architectures import CNN, MLP

pytestmark = pytest.mark.multidevice

BATCH = 8
ZERO3 = {"mesh": {"data": -1}, "zero_stage": 3}


def twins(module_type=MLP, config=ZERO3, lr=0.1):
    """(wrapped, its optimizer, plain torch twin, the twin's optimizer), same initial values."""
    torch.manual_seed(0)
    module = module_type()
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    model, optimizer = zerojax.initialize(module, optimizer, config)
    return model, optimizer, reference, ref_optimizer


def step_both(model, optimizer, reference, ref_optimizer, inputs, target):
    for m, opt in ((model, optimizer), (reference, ref_optimizer)):
        F.cross_entropy(m(inputs), target).backward()
        opt.step()
        opt.zero_grad()


def mlp_batch():
    return torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))


def assert_state_close(got: dict, expected: dict, what: str):
    """Two fp32 runs of one SGD loop differ by the forward's reordered sums (the MLP's widths
    32/64 and the batch of 8: ~100 roundings of unit-scale terms, ~1e-5 relative per step),
    so 1e-5 relative with a 1e-6 floor for near-zero entries over these few steps."""
    assert set(got) == set(expected), what
    for name, value in expected.items():
        mine = torch.as_tensor(np.asarray(got[name])).to(value.dtype)
        torch.testing.assert_close(mine, value, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def test_initialize_leaves_torch_rng_alone():
    torch.manual_seed(1)
    MLP()
    expected = torch.rand(4)
    torch.manual_seed(1)
    zerojax.initialize(MLP(), None, ZERO3)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


def test_raw_module_state_dict_after_training_saves_and_loads_in_torch():
    """`raw_model = model.module; torch.save(raw_model.state_dict(), f)` after training:
    the trained values, BatchNorm's running statistics included, loadable by plain torch."""
    model, optimizer, reference, ref_optimizer = twins(CNN)
    model.train(), reference.train()
    reference.dropout.p = model.module.dropout.p = 0.0  # deterministic on both sides
    for _ in range(2):
        step_both(
            model, optimizer, reference, ref_optimizer,
            torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,)),
        )  # fmt: skip
    raw_model = model.module
    buffer = io.BytesIO()
    torch.save(raw_model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert all(type(v) is torch.Tensor for v in loaded.values())
    assert_state_close(loaded, reference.state_dict(), "saved state_dict")
    fresh = CNN()
    fresh.load_state_dict(loaded)
    assert_state_close(fresh.state_dict(), reference.state_dict(), "loaded into plain torch")


def test_ema_with_lerp_on_live_params_matches_torch():
    """timm/nanoGPT-style EMA kept as a zerojax-free twin module and updated with
    `ema_p.lerp_(p.detach(), 1 - decay)` from the wrapped model's live parameters, and the
    reverse: the wrapped model's own parameters moved with `p.data.lerp_`."""
    model, optimizer, reference, ref_optimizer = twins()
    ema, ref_ema = copy.deepcopy(model), copy.deepcopy(reference)
    assert type(ema) is MLP and all(type(p) is torch.nn.Parameter for p in ema.parameters())
    for _ in range(3):
        step_both(model, optimizer, reference, ref_optimizer, *mlp_batch())
        with torch.no_grad():
            for mine, theirs, p, q in zip(
                ema.parameters(), ref_ema.parameters(), model.parameters(), reference.parameters()
            ):
                mine.lerp_(p.detach(), 0.1)
                theirs.lerp_(q.detach(), 0.1)
    assert_state_close(ema.state_dict(), ref_ema.state_dict(), "EMA twin")
    with torch.no_grad():
        for p, q, e, f in zip(
            model.parameters(), reference.parameters(), ema.parameters(), ref_ema.parameters()
        ):
            p.data.lerp_(e, 0.5)
            q.data.lerp_(f, 0.5)
    assert_state_close(model.state_dict(), reference.state_dict(), "lerp_ into the engine")
    # The update the optimizer makes next starts from the written values.
    step_both(model, optimizer, reference, ref_optimizer, *mlp_batch())
    assert_state_close(model.state_dict(), reference.state_dict(), "after the next step")


def test_averaged_model_of_the_raw_module():
    model, optimizer, reference, ref_optimizer = twins()
    swa = torch.optim.swa_utils.AveragedModel(model.module)
    ref_swa = torch.optim.swa_utils.AveragedModel(reference)
    for _ in range(3):
        step_both(model, optimizer, reference, ref_optimizer, *mlp_batch())
        swa.update_parameters(model.module)
        ref_swa.update_parameters(reference)
    assert_state_close(swa.state_dict(), ref_swa.state_dict(), "AveragedModel")
    x, _ = mlp_batch()
    torch.testing.assert_close(swa(x), ref_swa(x), rtol=1e-5, atol=1e-6)


def test_nn_init_after_initialize_writes_the_engine():
    model, _, _, _ = twins()
    layer = model.module.fc1
    torch.nn.init.zeros_(layer.bias)
    torch.nn.init.normal_(layer.weight, std=0.02)
    engine = model.engine
    assert not np.asarray(engine.params[layer.bias._zerojax_name]).any()
    weight = np.asarray(engine.params[layer.weight._zerojax_name])
    # 64 x 32 = 2048 draws: their standard deviation is 0.02 within a few percent.
    assert abs(weight.std() - 0.02) < 0.003 and abs(weight.mean()) < 0.003
    assert (
        engine.params[layer.weight._zerojax_name].sharding
        == engine.plan.params[layer.weight._zerojax_name]
    )


def test_master_weights_take_in_place_writes():
    """With bf16 params and fp32 masters, `p.data.copy_(t)` sets the master and the param is
    its bf16 rounding (what the optimizer update does)."""
    config = {**ZERO3, "precision": "params=bfloat16,compute=bfloat16,master=float32"}
    model, _, _, _ = twins(config=config)
    p = model.module.fc1.weight
    value = torch.randn(p.shape)
    p.data.copy_(value)
    engine, name = model.engine, p._zerojax_name
    np.testing.assert_array_equal(np.asarray(engine.master[name]), value.numpy())
    np.testing.assert_array_equal(
        np.asarray(engine.params[name]).astype(np.float32),
        value.to(torch.bfloat16).float().numpy(),
    )


def test_assigning_data_sets_the_parameter_and_refuses_another_shape():
    """`p.data = t` (weight loading and tying by hand) sets the value, as torch's does, and
    the training that follows matches torch's; another shape is refused by name (a zerojax
    parameter's shape is fixed), leaving the value as it was."""
    model, optimizer, reference, ref_optimizer = twins()
    value = torch.randn(model.module.fc1.weight.shape)
    model.module.fc1.weight.data = value.clone()
    reference.fc1.weight.data = value.clone()
    np.testing.assert_array_equal(model.module.fc1.weight.detach().numpy(), value.numpy())
    step_both(model, optimizer, reference, ref_optimizer, *mlp_batch())
    assert_state_close(model.module.state_dict(), reference.state_dict(), "after .data =")
    before = model.module.fc1.weight.detach().numpy().copy()
    with pytest.raises(RuntimeError, match="'fc1.weight' of shape"):
        model.module.fc1.weight.data = torch.zeros(3, 3)
    np.testing.assert_array_equal(model.module.fc1.weight.detach().numpy(), before)
    assert tuple(model.module.fc1.weight.data.shape) == before.shape


def test_freezing_mid_run_stops_gradients_and_updates():
    model, optimizer, reference, ref_optimizer = twins()
    step_both(model, optimizer, reference, ref_optimizer, *mlp_batch())
    for m in (model.module, reference):
        m.fc1.weight.requires_grad_(False)
    frozen = model.module.fc1.weight
    before = frozen.detach().numpy().copy()
    x, y = mlp_batch()
    F.cross_entropy(model(x), y).backward()
    assert frozen.grad is None
    optimizer.step()
    np.testing.assert_array_equal(frozen.detach().numpy(), before)


def test_the_model_stays_itself():
    """`initialize` gives back the user's own module object, as FSDP2's fully_shard does: the
    HF Trainer reads `model.loss_type`/`config` and keeps only the columns
    `inspect.signature(model.forward)` names; nanoGPT calls `model.estimate_mfu`; DDP-style
    scripts take `model.module`."""

    class WithExtras(MLP):
        loss_type = "ForCausalLM"

        def forward(self, x, labels=None, num_items_in_batch=None):
            return super().forward(x)

        def estimate_mfu(self) -> float:
            return 0.5

    torch.manual_seed(0)
    module = WithExtras()
    model, _ = zerojax.initialize(module, None, ZERO3)
    assert model is module and isinstance(model, WithExtras)
    assert isinstance(model.module, WithExtras) and model.module.fc1 is model.fc1
    assert model.loss_type == "ForCausalLM" and model.estimate_mfu() == 0.5
    assert list(inspect.signature(model.forward).parameters) == [
        "x",
        "labels",
        "num_items_in_batch",
    ]
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _ = model.no_such_attribute
    x, _ = mlp_batch()
    assert model(x).shape == (BATCH, 10)


def test_optimizer_hooks_fire_and_step_takes_a_closure():
    """Lightning calls `optimizer.step(closure)`; torch's step hooks (used by schedulers,
    loggers and profilers) fire around every step."""
    model, optimizer, reference, ref_optimizer = twins()
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    x, y = mlp_batch()

    def closure(m, opt):
        def run():
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            return loss

        return run

    loss = optimizer.step(closure(model, optimizer))
    ref_loss = ref_optimizer.step(closure(reference, ref_optimizer))
    assert calls == ["pre", "post"]
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0)
    assert_state_close(model.state_dict(), reference.state_dict(), "after step(closure)")


def test_initializing_twice_is_a_clear_error():
    model, _, _, _ = twins()
    with pytest.raises(ValueError, match="MLP was already initialized"):
        zerojax.initialize(model, None, ZERO3)
    # An ordinary copy can be initialized (a second engine over the same values).
    again, _ = zerojax.initialize(copy.deepcopy(model), None, ZERO3)
    x, _ = mlp_batch()
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)
