"""`zerojax ckpt import` of a torch file runs nothing from it (zerojax/ckpt/torch_io.py).

Run: .venv/bin/python -m pytest -q tests/ckpt/test_torch_file_trust.py -p no:cacheprovider
Why: a torch checkpoint is a pickle, and a pickle runs whatever its writer chose when it is
loaded. Issue 41: nothing zerojax reads back from a checkpoint may execute code, and a file
that would needs a CheckpointError naming it (not torch's advice to retry with
weights_only=False). Each file here would run `touch <marker>` if unpickled by plain pickle.
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
import zipfile

import pytest
import torch

from zerojax.ckpt.errors import CheckpointError
from zerojax.ckpt.import_weights import import_weights, read_state_dict_file
from zerojax.cli import main


class _RunsAShellCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def zip_checkpoint(path, marker):
    """What torch.save writes (a zip whose data.pkl is the pickle), the pickle replaced."""
    buffer = io.BytesIO()
    torch.save({"w": torch.randn(3, 2)}, buffer)
    with zipfile.ZipFile(buffer) as original, zipfile.ZipFile(path, "w") as planted:
        for name in original.namelist():
            data = original.read(name)
            if name.endswith("/data.pkl"):
                data = pickle.dumps({"w": _RunsAShellCommand(marker)}, protocol=2)
            planted.writestr(name, data)


def legacy_checkpoint(path, marker):
    """The pre-1.6 format: a bare pickle (torch.load reads it, without mmap)."""
    path.write_bytes(pickle.dumps(_RunsAShellCommand(marker), protocol=2))


FILES = {"zip": zip_checkpoint, "legacy": legacy_checkpoint}


@pytest.mark.parametrize("kind", list(FILES))
def test_a_torch_file_that_needs_code_runs_nothing(kind, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "ran"
    path = tmp_path / "model.pt"
    FILES[kind](path, marker)
    # torch's switch for weights_only=False applies only where the caller does not pass it.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError) as refused:
        read_state_dict_file(path)
    message = str(refused.value)
    assert str(path) in message and "needs code to load" in message, message
    assert "system" in message, message  # the global it asked for
    with pytest.raises(CheckpointError):
        import_weights(path, tmp_path / "run")
    assert main(["ckpt", "import", str(path), str(tmp_path / "cli")]) == 2
    assert str(path) in capsys.readouterr().err
    assert not marker.exists(), "a checkpoint ran a shell command"
    assert not (tmp_path / "run" / "0").exists() and not (tmp_path / "cli" / "0").exists()


def test_a_plain_state_dict_still_imports(tmp_path):
    """The refusal is of code, not of torch files: torch.save(state_dict) imports as before."""
    state = {"w": torch.randn(3, 2), "b": torch.arange(4)}
    torch.save(state, tmp_path / "model.pt")
    entries = read_state_dict_file(tmp_path / "model.pt")
    assert [name for name, *_ in entries] == ["w", "b"]
    for (_, array, _, _), tensor in zip(entries, state.values(), strict=True):
        assert array.tobytes() == tensor.numpy().tobytes()
