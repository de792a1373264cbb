"""`zerojax ckpt inspect | export | import`: torch and safetensors in and out, bit for bit.

Run: .venv/bin/python -m pytest -q tests/ckpt/test_tools.py -p no:cacheprovider
(`-m slow` adds the peak-memory measurement of exporting a ~200 MB checkpoint).
Why: issue 5 promises that a checkpoint leaves zerojax as an ordinary torch or safetensors file
without the whole model in memory, and that such a file comes in as a checkpoint any mesh can
restore. Every round trip compares raw bytes, dtypes, key order and tied storage with the
original; the training-checkpoint case compares with the wrapped model's own state_dict().
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from zerojax.ckpt import layout
from zerojax.ckpt.errors import CheckpointCorruptedError, CheckpointNotFoundError
from zerojax.ckpt.export import export_checkpoint, progress_stream
from zerojax.ckpt.import_weights import import_weights
from zerojax.ckpt.inspect import describe_checkpoint, open_step
from zerojax.ckpt.torch_io import tensor_to_numpy
from zerojax.cli import main

REPO = Path(__file__).resolve().parents[2]


def bits(tensor: torch.Tensor) -> bytes:
    return tensor_to_numpy(tensor.contiguous()).tobytes()


def assert_same_state_dict(got, want, *, ordered: bool = True) -> None:
    """Same keys (in order), dtypes, shapes and bytes -- NaN payloads and -0.0 included."""
    if ordered:
        assert list(got) == list(want)
    else:
        assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert bits(got[name]) == bits(tensor), name


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=50,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config), config


def mixed_state_dict() -> OrderedDict:
    """A tiny GPT-2 (tied wte/lm_head) plus the dtype and layout cases a state_dict can hold."""
    model, _ = tiny_gpt2()
    sd = OrderedDict(model.state_dict())
    special = torch.randn(5)
    special[0], special[1], special[2] = float("nan"), -0.0, float("inf")
    sd["extra.special_fp32"] = special
    sd["extra.int64"] = torch.randint(-(2**62), 2**62, (7,), dtype=torch.int64)
    sd["extra.bf16"] = torch.randn(4, 3).to(torch.bfloat16)
    sd["extra.fp16"] = torch.randn(6).half()
    sd["extra.fp64"] = torch.randn(2, 2, dtype=torch.float64)
    sd["extra.int8"] = torch.randint(-128, 127, (9,), dtype=torch.int8)
    sd["extra.uint8"] = torch.randint(0, 255, (3, 3), dtype=torch.uint8)
    sd["extra.bool"] = torch.rand(10) > 0.5
    sd["extra.scalar"] = torch.tensor(3.25)
    sd["extra.steps"] = torch.tensor(2**40 + 3)  # int64 scalar beyond int32
    sd["extra.empty"] = torch.zeros(0, 4)
    sd["extra.transposed"] = torch.randn(4, 6).t()  # a non-contiguous view
    # Equal values, separate storage: not a tie.
    sd["extra.wte_copy"] = sd["transformer.wte.weight"].clone()
    return sd


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory):
    torch.manual_seed(1)
    sd = mixed_state_dict()
    path = tmp_path_factory.mktemp("in") / "gpt2.pt"
    torch.save(sd, path)
    return path, sd


# --------------------------------------------------------------------------- round trips


def test_torch_state_dict_round_trip(gpt2_file, tmp_path):
    path, sd = gpt2_file
    ckpt = tmp_path / "ckpt"
    assert main(["ckpt", "import", str(path), str(ckpt)]) == 0
    meta = open_step(ckpt).meta
    assert meta["format"] == layout.FORMAT and meta["step"] == 0
    assert meta["config"] is None and meta["optimizer"] is None and meta["extra"] == {}
    params = meta["parameters"]
    assert list(params) == list(sd)
    assert params["lm_head.weight"]["tied_to"] == "transformer.wte.weight"
    assert params["extra.wte_copy"]["tied_to"] is None
    assert params["extra.int64"] == {
        "shape": [7],
        "dtype": "int64",
        "stored_dtype": "int64",
        "kind": "buffer",
        "tied_to": None,
    }
    items = {n for n in os.listdir(ckpt / "0") if (ckpt / "0" / n).is_dir()}
    assert items == {layout.MODEL, layout.META}  # no optimizer, no train_state
    assert (ckpt / "0" / layout.MANIFEST).is_file()

    out = tmp_path / "out.pt"
    assert main(["ckpt", "export", str(ckpt), "--format", "torch", str(out), "--quiet"]) == 0
    for mmap in (False, True):
        loaded = torch.load(out, weights_only=True, mmap=mmap)
        assert isinstance(loaded, OrderedDict)
        assert_same_state_dict(loaded, sd)
    # The tie survives as torch.save writes it: one storage, two names.
    assert (
        loaded["lm_head.weight"].untyped_storage().data_ptr()
        == loaded["transformer.wte.weight"].untyped_storage().data_ptr()
    )
    assert (
        loaded["extra.wte_copy"].untyped_storage().data_ptr()
        != loaded["transformer.wte.weight"].untyped_storage().data_ptr()
    )
    assert not [n for n in os.listdir(tmp_path) if "zerojax-tmp" in n]

    st_out = tmp_path / "out.safetensors"
    assert main(["ckpt", "export", str(ckpt), str(st_out), "--quiet"]) == 0
    assert_same_state_dict(safetensors.torch.load_file(st_out), sd, ordered=False)


def test_safetensors_round_trip_and_dtype_cast(tmp_path):
    sd = {
        "encoder.weight": torch.randn(16, 8),
        "encoder.bias": torch.randn(16).to(torch.bfloat16),
        "decoder.weight": torch.randn(8, 16).half(),
        "positions": torch.arange(-5, 11, dtype=torch.int64) * 2**35,
        "mask": torch.rand(4, 4) > 0.3,
        "scale": torch.tensor(0.5, dtype=torch.float64),
    }
    src = tmp_path / "in.safetensors"
    safetensors.torch.save_file(sd, src)
    ckpt = tmp_path / "ckpt"
    assert main(["ckpt", "import", str(src), str(ckpt), "--step", "3"]) == 0
    assert describe_checkpoint(ckpt)["steps"] == [3]

    out = tmp_path / "out.safetensors"
    progress = io.StringIO()
    export_checkpoint(ckpt, out, format="safetensors", progress=progress)
    assert_same_state_dict(safetensors.torch.load_file(out), sd, ordered=False)
    assert "6/6 tensors" in progress.getvalue()
    assert progress_stream(quiet=True) is None

    torch_out = tmp_path / "out.pt"
    export_checkpoint(ckpt, torch_out, format="torch")
    assert_same_state_dict(torch.load(torch_out, weights_only=True), sd, ordered=False)

    cast = tmp_path / "bf16.safetensors"
    assert main(["ckpt", "export", str(ckpt), str(cast), "--dtype", "bfloat16", "--quiet"]) == 0
    loaded = safetensors.torch.load_file(cast)
    for name, tensor in sd.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert loaded[name].dtype == want.dtype and bits(loaded[name]) == bits(want), name


def test_exported_safetensors_loads_in_transformers(tmp_path):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(2)
    model, config = tiny_gpt2()
    model.eval()
    src = tmp_path / "gpt2.pt"
    torch.save(model.state_dict(), src)
    import_weights(src, tmp_path / "ckpt")
    hf_dir = tmp_path / "hf"
    config.save_pretrained(hf_dir)
    export_checkpoint(tmp_path / "ckpt", hf_dir / "model.safetensors")
    loaded = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    assert_same_state_dict(loaded.state_dict(), model.state_dict())
    ids = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


# --------------------------------------------------------------------------- training checkpoints


class TiedNet(nn.Module):
    """Embedding tied to the output layer, and a BatchNorm whose int64 counter JAX keeps as
    int32."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(F.relu(self.norm(self.fc(self.emb(ids)))))


ZERO3 = {"mesh": {"fsdp": 8}, "zero": {"stage": 3}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A ZeRO-3 run on 8 devices after one AdamW step, saved by the core at step 1."""
    import zerojax
    from zerojax.ckpt.checkpointer import save_checkpoint

    torch.manual_seed(3)
    net = TiedNet()
    model, optimizer = zerojax.initialize(
        net, torch.optim.AdamW(net.parameters(), lr=1e-2), config=ZERO3
    )
    ids = torch.randint(0, 16, (16,))
    F.cross_entropy(model(ids), ids).backward()
    optimizer.step()
    optimizer.zero_grad()
    directory = tmp_path_factory.mktemp("trained") / "ckpt"
    save_checkpoint(directory, model, optimizer, step=1, extra={"epoch": 2, "note": "hi"})
    return directory, model.state_dict()


@pytest.mark.multidevice
def test_export_of_training_checkpoint_equals_model_state_dict(trained, tmp_path):
    directory, state_dict = trained
    assert state_dict["norm.num_batches_tracked"].dtype == torch.int64
    params = open_step(directory).meta["parameters"]
    assert params["norm.num_batches_tracked"]["stored_dtype"] == "int32"  # JAX has no int64

    out = tmp_path / "model.pt"
    export_checkpoint(directory, out, format="torch")
    loaded = torch.load(out, weights_only=True)
    assert_same_state_dict(loaded, state_dict)
    assert int(loaded["norm.num_batches_tracked"]) == 1
    assert (
        loaded["head.weight"].untyped_storage().data_ptr()
        == loaded["emb.weight"].untyped_storage().data_ptr()
    )
    st_out = tmp_path / "model.safetensors"
    export_checkpoint(directory, st_out)
    assert_same_state_dict(safetensors.torch.load_file(st_out), state_dict, ordered=False)


@pytest.mark.multidevice
def test_inspect_training_checkpoint(trained, capsys):
    directory, _ = trained
    assert main(["ckpt", "inspect", str(directory), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {directory}: steps 1 (latest 1)" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert lines["emb.weight"] == [
        "emb.weight",
        "[16,",
        "8]",
        "float32",
        "float32",
        "parameter",
        "512",
    ]
    assert lines["norm.num_batches_tracked"][1:] == ["[]", "int64", "int32", "buffer", "4"]
    assert "tied to emb.weight" in out
    # emb 128 + fc 72 + norm 4*8 floats + counter: 232 floats and one int32.
    assert "9 entries (1 tied alias), 233 elements, 932 bytes" in out
    assert "optimizer: AdamW, 1 param group, first group lr=0.01" in out
    assert 'extra: {"epoch": 2, "note": "hi"}' in out
    assert "engine: num_calls=1, micro_step=1, step=1, skipped_steps=0" in out
    assert "verified: every file has its saved size and checksum" in out
    assert '"stage": 3' in out  # the saving run's config, pretty-printed

    assert main(["ckpt", "inspect", str(directory), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 1 and info["optimizer"]["type"] == "AdamW"
    assert info["optimizer_state"]["present"] and info["optimizer_state"]["arrays"] > 0
    assert info["config"]["zero"]["stage"] == 3
    assert info["total_bytes"] == 932


@pytest.mark.multidevice
def test_imported_weights_restore_onto_another_mesh(tmp_path):
    import zerojax
    from zerojax.ckpt.checkpointer import Checkpointer

    torch.manual_seed(4)
    source = TiedNet()
    source.norm.num_batches_tracked.fill_(5)
    source.norm.running_mean.normal_()
    src = tmp_path / "tied.pt"
    torch.save(source.state_dict(), src)
    import_weights(src, tmp_path / "ckpt")

    torch.manual_seed(5)  # different initial weights, which the restore must replace
    net = TiedNet()
    model, optimizer = zerojax.initialize(
        net,
        torch.optim.AdamW(net.parameters(), lr=1e-2),
        config={"mesh": {"data": 4, "fsdp": 2}, "zero": {"stage": 1}},
    )
    state = Checkpointer(tmp_path / "ckpt", model, optimizer).restore()
    assert state.step == 0 and state.config_at_save is None
    assert_same_state_dict(model.state_dict(), source.state_dict())


# --------------------------------------------------------------------------- inspect / errors


@pytest.fixture
def small_ckpt(tmp_path):
    sd = OrderedDict(w=torch.randn(3, 5), b=torch.zeros(5, dtype=torch.int64))
    sd["w_alias"] = sd["w"]
    torch.save(sd, tmp_path / "small.pt")
    import_weights(tmp_path / "small.pt", tmp_path / "ckpt", step=2)
    import_weights(tmp_path / "small.pt", tmp_path / "ckpt", step=7)
    (tmp_path / "ckpt" / "9.orbax-checkpoint-tmp-1732000000").mkdir()
    return tmp_path / "ckpt", sd


def test_inspect_lists_steps_partial_saves_and_entries(small_ckpt, capsys):
    directory, _ = small_ckpt
    assert main(["ckpt", "inspect", str(directory), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {directory}: steps 2, 7 (latest 7)" in out
    assert "ignored: 9.orbax-checkpoint-tmp-1732000000 (partial save" in out
    assert "step 2 (zerojax-checkpoint/1)" in out
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line[:3] == "  w" or line[:3] == "  b"
    }
    assert rows["w"] == ["[3,", "5]", "float32", "float32", "parameter", "60"]
    assert rows["b"] == ["[5]", "int64", "int64", "buffer", "40"]
    assert rows["w_alias"][-3:] == ["tied", "to", "w"]
    assert "3 entries (1 tied alias), 20 elements, 100 bytes" in out
    assert "optimizer: none (weights only)" in out
    assert "config: none (imported weights)" in out
    assert main(["ckpt", "inspect", str(directory), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 7 and info["partial"] == ["9.orbax-checkpoint-tmp-1732000000"]
    assert [p["bytes"] for p in info["parameters"]] == [60, 40, 0]


def test_bad_arguments_and_missing_checkpoints(small_ckpt, tmp_path, capsys):
    directory, _ = small_ckpt
    assert main(["ckpt", "inspect", str(tmp_path / "nope")]) == 2
    assert "nope' does not exist" in capsys.readouterr().err
    assert main(["ckpt", "export", str(directory), str(tmp_path / "x.pt"), "--step", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax ckpt export: error: step 5 not found")
    assert "available steps: 2, 7" in err
    assert main(["ckpt", "export", str(directory), str(tmp_path / "x.npz")]) == 2
    assert "cannot tell the format" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["ckpt", "export", str(directory), str(tmp_path / "x.pt"), "--format", "onnx"])
    assert info.value.code == 2
    assert "invalid choice: 'onnx'" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint step"):
        open_step(empty)
    assert not (tmp_path / "x.pt").exists()


def test_corrupted_checkpoint_is_named_and_output_untouched(small_ckpt, tmp_path, capsys):
    directory, _ = small_ckpt
    step_dir = directory / "7"
    manifest = json.loads((step_dir / layout.MANIFEST).read_text())["files"]
    data_file = max(
        (rel for rel in manifest if rel.startswith(f"{layout.MODEL}/")),
        key=lambda rel: manifest[rel]["size"],
    )
    with open(step_dir / data_file, "r+b") as f:
        f.truncate(manifest[data_file]["size"] - 3)
    out = tmp_path / "keep.pt"
    out.write_bytes(b"the user's previous export")
    assert main(["ckpt", "export", str(directory), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(step_dir / data_file) in err and "truncated" in err
    assert out.read_bytes() == b"the user's previous export"
    with pytest.raises(CheckpointCorruptedError):
        export_checkpoint(directory, tmp_path / "new.pt")
    assert not (tmp_path / "new.pt").exists()
    # Step 2 is intact and still exports.
    assert main(["ckpt", "export", str(directory), str(out), "--step", "2", "--quiet"]) == 0
    assert torch.load(out, weights_only=True).keys() == {"w", "b", "w_alias"}


def test_failed_export_leaves_no_file(small_ckpt, tmp_path, monkeypatch):
    directory, _ = small_ckpt
    import zerojax.ckpt.export as export_module

    calls = []

    def failing_read(opened, key, leaf):
        calls.append(key)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed mid-export
        return original(opened, key, leaf)

    original = export_module._read_leaf
    monkeypatch.setattr(export_module, "_read_leaf", failing_read)
    out = tmp_path / "half.safetensors"
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(directory, out)
    assert calls == ["w", "b"]
    assert not out.exists()
    assert not [n for n in os.listdir(tmp_path) if "zerojax-tmp" in n]


def test_import_refusals(small_ckpt, tmp_path, capsys):
    directory, _ = small_ckpt
    src = tmp_path / "small.pt"
    before = sorted(os.listdir(directory))
    assert main(["ckpt", "import", str(src), str(directory), "--step", "7"]) == 2
    assert "step 7 already exists" in capsys.readouterr().err
    assert main(["ckpt", "import", str(src), str(directory), "--step", "3"]) == 2
    assert "already holds step(s) [7] after step 3" in capsys.readouterr().err
    assert sorted(os.listdir(directory)) == before

    cases = {
        "missing.pt": (None, "no such file"),
        "list.pt": ([torch.zeros(2)], "holds a list, not a state_dict"),
        "training.pt": (
            {"model": {"w": torch.zeros(2)}, "step": 3},
            (
                "entries that are not tensors: 'model' (dict), 'step' (int); it looks like a "
                "training checkpoint -- save its 'model' entry alone"
            ),
        ),
        "complex.pt": ({"z": torch.zeros(2, dtype=torch.complex64)}, "'z' has dtype complex64"),
        "garbage.pt": (b"not a pickle", "cannot be read by torch.load(weights_only=True)"),
        "garbage.safetensors": (
            b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ",
            "not a safetensors file: bad JSON header",
        ),
        "empty.pt": ({}, "holds no tensors"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            torch.save(content, path)
        target = tmp_path / f"out_{name}"
        assert main(["ckpt", "import", str(path), str(target)]) == 2, name
        err = capsys.readouterr().err
        assert str(path) in err and message in err, (name, err)
        assert not (target / "0").exists(), name


# --------------------------------------------------------------------------- memory

MEMORY_SCRIPT = """
import sys, time
import jax, orbax.checkpoint  # the export imports them: part of the baseline
from zerojax.cli import main

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
baseline = status("VmRSS")
start = time.time()
code = main(["ckpt", "export", *sys.argv[1:], "--quiet"])
print(code, baseline, status("VmHWM"), time.time() - start)
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_peak_memory_stays_near_the_largest_tensor(tmp_path, fmt):
    """`zerojax ckpt export` of 16 tensors of 12.5 MiB (200 MiB) in a fresh process: peak RSS
    over the baseline of a process that imported zerojax, JAX and Orbax must stay under 2.5x
    the largest tensor + 100 MiB (131 MiB); holding the model would take 200 MiB more.
    Measured here: ~35 MiB growth for both formats."""
    numel = 3_276_800  # 12.5 MiB of float32
    sd = OrderedDict((f"layer{i}.weight", torch.randn(numel)) for i in range(16))
    largest = numel * 4
    torch.save(sd, tmp_path / "big.pt")
    del sd
    import_weights(tmp_path / "big.pt", tmp_path / "ckpt")
    (tmp_path / "big.pt").unlink()
    out = tmp_path / f"big.{'pt' if fmt == 'torch' else 'safetensors'}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEMORY_SCRIPT), str(tmp_path / "ckpt"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    code, baseline, peak, seconds = result.stdout.split()
    assert code == "0", result.stderr
    growth = int(peak) - int(baseline)
    total = 16 * largest
    print(
        f"\nexport {fmt}: checkpoint {total / 2**20:.0f} MiB, largest tensor "
        f"{largest / 2**20:.1f} MiB, baseline RSS {int(baseline) / 2**20:.0f} MiB, peak "
        f"{int(peak) / 2**20:.0f} MiB, growth {growth / 2**20:.0f} MiB, {float(seconds):.1f} s"
    )
    assert out.stat().st_size >= total
    assert growth < 2.5 * largest + 100 * 2**20
