"""The Checkpointer API: what a step holds, which steps exist, and what restore refuses.

Run: `.venv/bin/python -m pytest -q tests/ckpt/test_checkpointer.py -p no:cacheprovider`
Why: issue 5 -- every piece of training state round-trips (weights, master weights, buffers,
optimizer moments and hyperparameters, LR scheduler, fp16 loss scale, RNGs, the user's `extra`),
keep-last-N / interval / latest-by-default behave, and a checkpoint that does not fit the
model is refused with every difference listed. The state is filled with random values instead
of trained (no compilation), so these tests are fast; tests/ckpt/test_resume.py trains.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from torch import nn

import zerojax
from zerojax.ckpt import layout
from zerojax.ckpt.checkpointer import Checkpointer, restore_checkpoint, save_checkpoint
from zerojax.ckpt.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from zerojax.ckpt.manifest import write_manifest

pytestmark = pytest.mark.multidevice

ZERO3 = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}}


class Tiny(nn.Module):
    def __init__(self, hidden: int = 16, extra_layer: bool = False, head_dtype=torch.float32):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.head = nn.Linear(hidden, 8, dtype=head_dtype)
        if extra_layer:
            self.extra = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(8))

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)))


def make(config=ZERO3, optimizer="adamw", seed=0, **module_kwargs):
    torch.manual_seed(seed)
    net = Tiny(**module_kwargs)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = None
    return zerojax.initialize(net, opt, config=config, seed=seed)


def scramble(model, seed: int = 1) -> None:
    """Fill every array of the engine with fresh random values (no training, no compile)."""
    engine, rs = model.engine, np.random.default_rng(seed)

    def rand(like, sharding):
        value = rs.standard_normal(like.shape).astype(np.float32)
        return jax.device_put(jnp.asarray(value).astype(like.dtype), sharding)

    state = engine.state
    master = state.master
    if master is not None:
        master = {n: rand(a, engine.plan.master_weights[n]) for n, a in master.items()}
        params = {n: master[n].astype(a.dtype) for n, a in state.params.items()}
    else:
        params = {n: rand(a, engine.plan.params[n]) for n, a in state.params.items()}
    opt_state = state.opt_state
    if opt_state is not None:
        opt_state = dict(opt_state)
        for key, value in opt_state.items():
            if key == "step":  # the update counts: any shape the engine keeps them in
                opt_state[key] = tuple(
                    jax.device_put(jnp.full(np.shape(v), 5 + i, v.dtype), v.sharding)
                    if hasattr(v, "sharding")
                    else jnp.full(np.shape(v), 5 + i, jnp.int32)
                    for i, v in enumerate(value)
                )
            else:
                opt_state[key] = {n: rand(a, a.sharding) for n, a in value.items()}
    engine.load(
        state.replace(
            params=params,
            master=master,
            buffers={n: rand(a, engine.replicated) for n, a in state.buffers.items()},
            opt_state=opt_state,
            rng=jax.random.key(int(rs.integers(1 << 30))),
            num_calls=17,
            micro_step=23,
            step=21,
            skipped_steps=2,
        )
    )


def host(model) -> dict:
    engine = model.engine
    return {
        "params": {n: np.asarray(a) for n, a in engine.params.items()},
        "master": {n: np.asarray(a) for n, a in (engine.master or {}).items()},
        "buffers": {n: np.asarray(a) for n, a in engine.buffers.items()},
        "opt": jax.tree.map(np.asarray, engine.opt_state),
        "rng": np.asarray(jax.random.key_data(engine.rng)),
        "calls": (
            engine.state.num_calls,
            engine.state.micro_step,
            engine.state.step,
            engine.state.skipped_steps,
        ),
    }


def assert_state_equal(a: dict, b: dict) -> None:
    for key in ("params", "master", "buffers"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            np.testing.assert_array_equal(a[key][name], b[key][name], err_msg=f"{key}.{name}")
    jax.tree.map(np.testing.assert_array_equal, a["opt"], b["opt"])
    np.testing.assert_array_equal(a["rng"], b["rng"])
    assert a["calls"] == b["calls"]


def test_round_trip_restores_every_piece_of_state(tmp_path):
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scramble(model)
    for _ in range(3):
        opt.step()  # no gradients: nothing to update, but torch's call order is kept
        sched.step()  # lr 1e-3 -> 5e-4, and the scheduler's counters move
    torch.manual_seed(42)
    torch_rng = torch.get_rng_state()
    saved = host(model)
    with Checkpointer(tmp_path, model, opt, scheduler=sched) as ckpt:
        assert ckpt.save(7)
    assert (tmp_path / "7" / layout.MANIFEST).is_file()

    other, other_opt = make(seed=3)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=2, gamma=0.5)
    assert not np.array_equal(host(other)["params"]["fc1.weight"], saved["params"]["fc1.weight"])
    torch.manual_seed(0)
    state = Checkpointer(tmp_path, other, other_opt, scheduler=other_sched).restore()
    assert state.step == 7 and state.extra == {}
    assert state.config_at_save["zero"]["stage"] == 3
    assert_state_equal(host(other), saved)
    assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-4
    assert other_sched.state_dict() == sched.state_dict()
    assert torch.equal(torch.get_rng_state(), torch_rng)
    # The torch views agree too.
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name


def test_latest_by_default_keep_last_n_and_listing(tmp_path):
    model, opt = make()
    with Checkpointer(tmp_path, model, opt, max_to_keep=2) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        weights = {}
        for step in (1, 2, 3):
            scramble(model, seed=step)
            weights[step] = host(model)
            assert ckpt.save(step)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    reader, reader_opt = make(seed=9)
    ckpt = Checkpointer(tmp_path, reader, reader_opt)
    assert ckpt.restore().step == 3
    assert_state_equal(host(reader), weights[3])
    assert ckpt.restore(2).step == 2
    assert_state_equal(host(reader), weights[2])
    with pytest.raises(CheckpointNotFoundError, match=r"step 1 not found.*\[2, 3\]"):
        ckpt.restore(1)
    ckpt.close()


def test_save_interval_and_force(tmp_path):
    model, opt = make()
    with Checkpointer(tmp_path, model, opt, save_interval_steps=2, async_save=False) as ckpt:
        assert ckpt.save(1) is False
        assert ckpt.save(2) is True
        assert ckpt.save(3) is False
        assert ckpt.save(3, force=True) is True
        assert ckpt.all_steps() == [2, 3]
        with pytest.raises(CheckpointError, match="step 3 already exists"):
            ckpt.save(3, force=True)


def test_config_supplies_defaults_and_directory_is_required(tmp_path):
    config = {
        **ZERO3,
        "checkpoint": {
            "directory": str(tmp_path / "c"),
            "max_to_keep": 1,
            "save_interval_steps": 5,
            "async_save": False,
        },
    }
    model, opt = make(config)
    ckpt = Checkpointer(model=model, optimizer=opt)
    assert (ckpt.directory, ckpt.max_to_keep, ckpt.save_interval_steps, ckpt.async_save) == (
        str(tmp_path / "c"),
        1,
        5,
        False,
    )
    assert ckpt.save(10) and ckpt.save(15)
    assert ckpt.all_steps() == [15]
    ckpt.close()
    bare, bare_opt = make()
    with pytest.raises(ValueError, match="checkpoint.directory"):
        Checkpointer(model=bare, optimizer=bare_opt)


def test_restore_from_an_empty_directory(tmp_path):
    model, opt = make()
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint") as info:
        Checkpointer(tmp_path / "nothing", model, opt).restore()
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "nothing").exists()  # a reader creates nothing


def test_extra_round_trip_and_unserialisable_extra(tmp_path):
    model, opt = make()
    extra = {
        "epoch": 3,
        "name": "run-a",
        "nested": {"xs": [1, 2.5, None]},
        "gen": torch.tensor([1, 2], dtype=torch.uint8),
        "ok": True,
    }
    with Checkpointer(tmp_path, model, opt) as ckpt:
        ckpt.save(1, extra=extra)
        with pytest.raises(CheckpointError, match=r"extra\['bad'\]\[0\].*not JSON"):
            ckpt.save(2, extra={"fine": 1, "bad": [object()]})
        ckpt.wait()
        assert ckpt.all_steps() == [1]
        state = ckpt.restore()
    assert state.extra == {**extra, "gen": [1, 2]}


def test_fp16_loss_scale_round_trip(tmp_path):
    config = {**ZERO3, "precision": "params=float16,compute=float16,master=float32"}
    model, opt = make(config)
    engine = model.engine
    scramble(model)
    loss_scale = {
        "scale": jnp.float32(512.0),
        "good_steps": jnp.int32(7),
        "hysteresis": jnp.int32(1),
    }
    engine.load(engine.state.replace(loss_scale=loss_scale, skipped_steps=3))
    save_checkpoint(tmp_path, model, opt, step=4)
    other, other_opt = make(config, seed=5)
    assert other_opt.loss_scale != 512.0
    assert restore_checkpoint(tmp_path, other, other_opt).step == 4
    assert other_opt.loss_scale == 512.0 and other_opt.skipped_steps == 3
    assert int(other.engine.loss_scale["good_steps"]) == 7
    assert int(other.engine.loss_scale["hysteresis"]) == 1
    # Replicated over the mesh, as the current policy keeps it (the direct read places it).
    for value in other.engine.loss_scale.values():
        assert value.sharding.is_fully_replicated and len(value.sharding.device_set) == 8
    assert_state_equal(host(other), host(model))


def test_bf16_with_fp32_master_round_trip_and_policy_change(tmp_path):
    bf16 = {**ZERO3, "precision": "params=bfloat16,compute=bfloat16,master=float32"}
    model, opt = make(bf16)
    scramble(model)
    saved = host(model)
    assert saved["params"]["fc1.weight"].dtype == jnp.bfloat16
    # Random fp32 masters are not bf16 values: the checkpoint must hold the masters.
    assert not np.array_equal(
        saved["master"]["fc1.weight"], saved["params"]["fc1.weight"].astype(np.float32)
    )
    save_checkpoint(tmp_path, model, opt, step=1, async_save=True)

    same, same_opt = make(bf16, seed=4)
    restore_checkpoint(tmp_path, same, same_opt)
    assert_state_equal(host(same), saved)

    fp32, fp32_opt = make(ZERO3, seed=4)  # no master: params are the saved masters
    restore_checkpoint(tmp_path, fp32, fp32_opt)
    for name, master in saved["master"].items():
        np.testing.assert_array_equal(np.asarray(fp32.engine.params[name]), master)
        assert fp32.engine.params[name].dtype == jnp.float32

    save_checkpoint(tmp_path / "fp32", fp32, fp32_opt, step=2)
    pure_bf16 = {**ZERO3, "precision": "params=bfloat16,compute=bfloat16"}
    low, low_opt = make(pure_bf16, seed=4)  # fp32 on disk, bf16 params now: cast
    restore_checkpoint(tmp_path / "fp32", low, low_opt)
    for name, master in saved["master"].items():
        assert low.engine.params[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.asarray(low.engine.params[name]), np.asarray(jnp.asarray(master, jnp.bfloat16))
        )


def test_mismatch_lists_every_difference(tmp_path):
    model, opt = make()
    save_checkpoint(tmp_path, model, opt, step=1)
    # fc1 wider (shape), a layer the checkpoint lacks (missing), head in bf16 (dtype). The
    # checkpoint's buffer `count` is dropped by deleting it (unexpected).
    torch.manual_seed(0)
    net = Tiny(hidden=32, extra_layer=True, head_dtype=torch.bfloat16)
    del net.count
    other, other_opt = zerojax.initialize(net, torch.optim.AdamW(net.parameters()), config=ZERO3)
    with pytest.raises(CheckpointMismatchError) as info:
        Checkpointer(tmp_path, other, other_opt).restore()
    lines = info.value.differences
    assert "fc1.weight: shape saved (16, 8) vs current (32, 8)" in lines
    assert "fc1.bias: shape saved (16,) vs current (32,)" in lines
    assert "head.weight: shape saved (8, 16) vs current (8, 32)" in lines
    assert "head.weight: dtype saved float32 vs current bfloat16" in lines
    assert "head.bias: dtype saved float32 vs current bfloat16" in lines
    assert any(line.startswith("extra.weight: missing from the checkpoint") for line in lines)
    assert any(line.startswith("extra.bias: missing from the checkpoint") for line in lines)
    assert any(line.startswith("count: unexpected") for line in lines)
    assert len(lines) == 8
    assert all(line in str(info.value) for line in lines)


def test_optimizer_mismatch_suggests_weights_only(tmp_path):
    model, opt = make(optimizer="sgd")
    scramble(model)
    save_checkpoint(tmp_path, model, opt, step=1)
    other, other_opt = make(optimizer="adamw", seed=2)
    fresh = jax.tree.map(np.asarray, other.engine.opt_state)
    with pytest.raises(CheckpointMismatchError, match="SGD.*AdamW.*load_optimizer=False"):
        Checkpointer(tmp_path, other, other_opt).restore()
    Checkpointer(tmp_path, other, other_opt).restore(load_optimizer=False)
    for name, value in host(model)["params"].items():
        np.testing.assert_array_equal(np.asarray(other.engine.params[name]), value)
    jax.tree.map(np.testing.assert_array_equal, host(other)["opt"], fresh)
    assert other_opt.param_groups[0]["lr"] == 1e-3  # SGD's lr=0.1 not taken either


def test_optimizer_state_tree_mismatch_is_listed(tmp_path):
    model, opt = make()
    save_checkpoint(tmp_path, model, opt, step=1)
    torch.manual_seed(0)
    net = Tiny()
    amsgrad = torch.optim.AdamW(net.parameters(), amsgrad=True)
    other, other_opt = zerojax.initialize(net, amsgrad, config=ZERO3)
    with pytest.raises(CheckpointMismatchError, match="load_optimizer=False") as info:
        Checkpointer(tmp_path, other, other_opt).restore()
    assert "state['max_exp_avg_sq']['fc1.weight']: missing from the checkpoint" in (
        info.value.differences
    )


def test_weights_only_checkpoint_keeps_fresh_optimizer_state(tmp_path):
    """The layout `zerojax ckpt import` writes: `model` + `meta`, no optimizer/train_state."""
    model, _ = make()
    scramble(model)
    weights = {n: np.asarray(a) for n, a in model.engine.params.items()}
    weights["count"] = np.asarray(model.engine.buffers["count"])
    table = {
        name: {
            "shape": list(t.shape),
            "dtype": "float32",
            "stored_dtype": "float32",
            "kind": "buffer" if name == "count" else "parameter",
            "tied_to": None,
        }
        for name, t in Tiny().state_dict().items()
    }
    meta = {
        "format": layout.FORMAT,
        "step": 0,
        "config": None,
        "parameters": table,
        "optimizer": None,
        "scheduler": None,
        "extra": {},
    }
    with ocp.CheckpointManager(tmp_path) as mgr:
        mgr.save(
            0,
            args=ocp.args.Composite(
                model=ocp.args.PyTreeSave(weights), meta=ocp.args.JsonSave(meta)
            ),
        )
    write_manifest(tmp_path / "0")  # as `ckpt import` does: a step has its manifest
    other, other_opt = make(seed=2)
    calls_before = other.engine.num_calls
    fresh = jax.tree.map(np.asarray, other.engine.opt_state)
    state = Checkpointer(tmp_path, other, other_opt).restore()
    assert state.step == 0 and state.config_at_save is None
    for name, value in weights.items():
        got = other.engine.params.get(name, other.engine.buffers.get(name))
        np.testing.assert_array_equal(np.asarray(got), value)
        assert got.sharding == (
            other.engine.plan.params[name]
            if name in other.engine.params
            else other.engine.replicated
        )
    jax.tree.map(np.testing.assert_array_equal, host(other)["opt"], fresh)
    assert other.engine.num_calls == calls_before


def test_not_a_zerojax_model():
    with pytest.raises(TypeError, match="zerojax.initialize"):
        Checkpointer("/tmp/x", nn.Linear(2, 2))


def test_partial_tmp_dirs_are_not_steps_and_a_writer_cleans_them(tmp_path):
    model, opt = make()
    save_checkpoint(tmp_path, model, opt, step=1)
    partial = tmp_path / "2.orbax-checkpoint-tmp-123"
    shutil.copytree(tmp_path / "1", partial)
    reader = Checkpointer(tmp_path, model, opt)
    assert reader.all_steps() == [1] and reader.restore().step == 1
    assert partial.exists()  # a reader never deletes
    with Checkpointer(tmp_path, model, opt) as writer:
        writer.save(2)
    assert not partial.exists() and (tmp_path / "2").is_dir()


class WithEmpty(nn.Module):
    """A zero-size parameter and buffer: Orbax cannot store them ("Cannot save arrays with
    zero size"), so checkpoints keep their shape in meta only."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.nothing = nn.Parameter(torch.zeros(0, 4))
        self.register_buffer("no_tokens", torch.zeros(0, dtype=torch.int64))

    def forward(self, x):
        return self.fc(x)


def make_with_empty(config=ZERO3, seed=0):
    torch.manual_seed(seed)
    net = WithEmpty()
    return zerojax.initialize(net, torch.optim.AdamW(net.parameters()), config=config, seed=seed)


@pytest.mark.parametrize("read", ["host", "host-in-batches", "orbax-sharded"])
def test_zero_size_parameter_and_buffer_round_trip_onto_another_mesh(tmp_path, monkeypatch, read):
    # The three ways `restore` reads arrays: whole to host then device_put (one process), the
    # same a few bytes at a time, and Orbax reading each shard (several processes).
    from zerojax.ckpt import checkpointer

    monkeypatch.setattr(checkpointer, "_HOST_READ", read != "orbax-sharded")
    if read == "host-in-batches":
        monkeypatch.setattr(checkpointer, "_HOST_BATCH_BYTES", 200)
    model, opt = make_with_empty()
    scramble(model)
    saved = host(model)
    assert saved["params"]["nothing"].shape == (0, 4)
    with Checkpointer(tmp_path, model, opt) as ckpt:
        ckpt.save(3)
    stored = ocp.PyTreeCheckpointHandler().metadata(tmp_path / "3" / layout.MODEL).tree
    assert set(stored) == {"fc.weight", "fc.bias"}  # the empty ones are in meta only

    other, other_opt = make_with_empty({"mesh": {"data": 4, "fsdp": 2}, "zero": {"stage": 1}}, 5)
    assert not np.array_equal(host(other)["params"]["fc.weight"], saved["params"]["fc.weight"])
    assert Checkpointer(tmp_path, other, other_opt).restore().step == 3
    assert_state_equal(host(other), saved)
    engine = other.engine
    assert engine.params["nothing"].sharding == engine.plan.params["nothing"]
    assert engine.opt_state["exp_avg"]["nothing"].shape == (0, 4)
    assert engine.params["fc.weight"].sharding == engine.plan.params["fc.weight"]
    assert engine.opt_state["exp_avg"]["fc.weight"].sharding == engine.plan.opt_state["fc.weight"]
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name


def test_imported_state_dict_with_a_zero_size_tensor_restores(tmp_path):
    from zerojax.ckpt.import_weights import import_weights

    torch.manual_seed(7)
    source = WithEmpty()
    source.fc.weight.data.normal_()
    torch.save(source.state_dict(), tmp_path / "w.pt")
    import_weights(tmp_path / "w.pt", tmp_path / "ckpt")
    model, opt = make_with_empty(seed=1)
    fresh = jax.tree.map(np.asarray, model.engine.opt_state)
    assert Checkpointer(tmp_path / "ckpt", model, opt).restore().step == 0
    for name, value in source.state_dict().items():
        got = model.state_dict()[name]
        assert got.shape == value.shape and got.dtype == value.dtype, name
        assert torch.equal(got, value), name
    jax.tree.map(np.testing.assert_array_equal, host(model)["opt"], fresh)


def test_a_checkpoint_with_one_step_count_per_group_restores(tmp_path, monkeypatch):
    """zerojax before per-parameter step counts (torch keeps `step` per parameter) saved one
    count per param group; such a checkpoint restores with that count for every parameter of
    its group instead of refusing the shapes (an upgrade must not strand a run)."""
    from zerojax.ckpt import training_state as ts

    model, opt = make()
    scramble(model)  # step counts 5, ...: one group here
    gather = ts.gather_items

    def one_count_per_group(engine, *, with_optimizer):
        items = gather(engine, with_optimizer=with_optimizer)
        state = dict(items[layout.OPTIMIZER])
        state["step"] = tuple(np.asarray(jax.device_get(v))[0] for v in state["step"])
        return {**items, layout.OPTIMIZER: state}

    with monkeypatch.context() as patch:
        patch.setattr(ts, "gather_items", one_count_per_group)
        with Checkpointer(tmp_path, model, opt) as ckpt:
            assert ckpt.save(1)
    other, other_opt = make(seed=3)
    Checkpointer(tmp_path, other, other_opt).restore()
    steps = {int(v["step"]) for v in other_opt.state_dict()["state"].values()}
    assert steps == {5}, steps
    assert_state_equal(host(other), host(model))
