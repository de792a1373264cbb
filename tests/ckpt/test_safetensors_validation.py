"""`zerojax ckpt import` of a malformed safetensors file: one named error, nothing written.

Run: `.venv/bin/python -m pytest -q tests/ckpt/test_safetensors_validation.py -p no:cacheprovider`
Why: issue 41 item 6 -- float offsets, a null shape or a list as dtype gave raw TypeErrors, and
two tensors over the same bytes were accepted. Each case here starts from a valid file written
by the `safetensors` package itself, changes its header (or its length prefix) byte by byte,
and asserts a CheckpointFormatError naming the file and the tensor at fault, raised before any
output exists; the CLI turns it into one line and exit code 2.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from zerojax.ckpt.errors import CheckpointError, CheckpointFormatError
from zerojax.ckpt.import_weights import import_weights
from zerojax.ckpt.safetensors_io import read_safetensors
from zerojax.cli import main

REPO = Path(__file__).resolve().parents[2]


def valid_file(path: Path) -> tuple[dict, bytes, dict[str, torch.Tensor]]:
    """Write three tensors of different sizes with `safetensors`; return (header, data, sd)."""
    state_dict = {
        "encoder.weight": torch.randn(4, 6),
        "encoder.bias": torch.randn(6),
        "head.weight": torch.randn(3, 4).to(torch.bfloat16),
    }
    safetensors.torch.save_file(state_dict, path, metadata={"format": "pt"})
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :], state_dict


def encode(header: dict | str | bytes, data: bytes, *, length: int | None = None) -> bytes:
    """The file's bytes: `header` as JSON (or raw text/bytes), its length prefix (or
    `length`), then `data`."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def range_of(header: dict, name: str) -> tuple[int, int]:
    return tuple(header[name]["data_offsets"])


def first_and_last(header: dict) -> tuple[str, str]:
    """The tensors stored first and last in the data section."""
    names = sorted((n for n in header if n != "__metadata__"), key=lambda n: range_of(header, n))
    return names[0], names[-1]


def set_field(name: str, field: str, value) -> Callable:
    def mutate(header, data):
        header[name][field] = value
        return encode(header, data)

    return mutate


def overlap(header, data):
    """The last tensor moved 4 bytes back into the one before it (same size: counts match)."""
    names = sorted((n for n in header if n != "__metadata__"), key=lambda n: range_of(header, n))
    begin, end = range_of(header, names[-1])
    header[names[-1]]["data_offsets"] = [begin - 4, end - 4]
    return encode(header, data[:-4])


def alias(header, data):
    """Two names for the same bytes: the last tensor (BF16[3, 4]) given the range of the
    first (F32[6], as many bytes), its own bytes cut off."""
    first, last = first_and_last(header)
    header[last]["data_offsets"] = list(range_of(header, first))
    return encode(header, data[:-24])


def gap(header, data):
    """8 bytes inserted before the last tensor, its offsets shifted past them."""
    _, last = first_and_last(header)
    begin, end = range_of(header, last)
    header[last]["data_offsets"] = [begin + 8, end + 8]
    return encode(header, data[:begin] + b"\x00" * 8 + data[begin:])


def trailing_bytes(header, data):
    return encode(header, data + b"\x00" * 8)


def offsets_past_data(header, data):
    _, last = first_and_last(header)
    begin, end = range_of(header, last)
    header[last]["data_offsets"] = [begin + 8, end + 8]
    return encode(header, data)


def reversed_offsets(header, data):
    name = "encoder.bias"
    begin, end = range_of(header, name)
    header[name]["data_offsets"] = [end, begin]
    return encode(header, data)


def float_offsets(header, data):
    header["encoder.bias"]["data_offsets"] = [float(o) for o in range_of(header, "encoder.bias")]
    return encode(header, data)


def nan_offsets(header, data):
    text = json.dumps(header)
    begin, end = range_of(header, "encoder.bias")
    text = text.replace(f"[{begin}, {end}]", f"[NaN, {end}]")
    return encode(text, data)


def duplicate_name(header, data):
    """The JSON object lists encoder.bias twice (json.loads would keep the second silently)."""
    text = json.dumps(header)
    entry = json.dumps(header["encoder.bias"])
    return encode(text[:-1] + f', "encoder.bias": {entry}' + "}", data)


def duplicate_field(header, data):
    text = json.dumps(header).replace('"dtype": "F32"', '"dtype": "F32", "dtype": "F32"', 1)
    name = next(n for n in header if n != "__metadata__" and header[n]["dtype"] == "F32")
    assert text.index(json.dumps(name)) < text.index('"dtype": "F32", "dtype"')
    return encode(text, data)


def metadata(value) -> Callable:
    def mutate(header, data):
        header["__metadata__"] = value
        return encode(header, data)

    return mutate


def prefix(length: int) -> Callable:
    def mutate(header, data):
        return encode(header, data, length=length)

    return mutate


def raw(text: bytes) -> Callable:
    return lambda header, data: encode(text, data)


# (mutation, tensor the error names (None: the file as a whole), words of the message)
CASES: dict[str, tuple[Callable, str | None, str]] = {
    "bad_json": (raw(b'{"encoder.weight": {"dtype": '), None, "bad JSON header"),
    "not_utf8": (raw(b'{"\xff\xfe": 1}'), None, "bad JSON header"),
    "deeply_nested_json": (raw(b"[" * 100_000 + b"]" * 100_000), None, "bad JSON header"),
    "header_a_list": (raw(b"[]"), None, "header is a JSON list, not an object"),
    "header_past_the_file": (prefix(10_000), None, "does not fit in its"),
    "huge_header_length": (prefix(2**63 + 5), None, "exceeds the format's limit"),
    "float_offsets": (float_offsets, "encoder.bias", "is not a pair of ints"),
    "nan_offsets": (nan_offsets, "encoder.bias", "is not a pair of ints"),
    "string_offsets": (set_field("encoder.bias", "data_offsets", ["0", "24"]), "encoder.bias", "is not a pair of ints"),
    "three_offsets": (set_field("encoder.bias", "data_offsets", [0, 12, 24]), "encoder.bias", "is not a pair of ints"),
    "offsets_null": (set_field("encoder.bias", "data_offsets", None), "encoder.bias", "is not a pair of ints"),
    "negative_offsets": (set_field("encoder.bias", "data_offsets", [-24, 0]), "encoder.bias", "not 0 <= begin <= end"),
    "reversed_offsets": (reversed_offsets, "encoder.bias", "not 0 <= begin <= end"),
    "offsets_past_the_data": (offsets_past_data, "head.weight", "not 0 <= begin <= end"),
    "shape_null": (set_field("encoder.bias", "shape", None), "encoder.bias", "not a list of non-negative ints"),
    "shape_a_string": (set_field("encoder.bias", "shape", "6"), "encoder.bias", "not a list of non-negative ints"),
    "shape_negative": (set_field("encoder.bias", "shape", [-6]), "encoder.bias", "not a list of non-negative ints"),
    "shape_float": (set_field("encoder.bias", "shape", [6.0]), "encoder.bias", "not a list of non-negative ints"),
    "shape_bool": (set_field("encoder.bias", "shape", [True]), "encoder.bias", "not a list of non-negative ints"),
    "shape_nested": (set_field("encoder.bias", "shape", [[6]]), "encoder.bias", "not a list of non-negative ints"),
    "dtype_a_list": (set_field("encoder.bias", "dtype", ["F32"]), "encoder.bias", "dtype ['F32']"),
    "dtype_an_int": (set_field("encoder.bias", "dtype", 7), "encoder.bias", "dtype 7"),
    "dtype_unknown": (set_field("encoder.bias", "dtype", "F7"), "encoder.bias", "dtype 'F7'"),
    "dtype_unsupported": (set_field("encoder.bias", "dtype", "F8_E4M3"), "encoder.bias", "dtype 'F8_E4M3'"),
    "bytes_not_shape_times_dtype": (set_field("encoder.bias", "shape", [5]), "encoder.bias", "needs 20 bytes"),
    "dtype_size_changed": (set_field("encoder.bias", "dtype", "F64"), "encoder.bias", "needs 48 bytes"),
    "overlapping_tensors": (overlap, "head.weight", "overlap tensor 'encoder.weight'"),
    "aliased_tensors": (alias, "head.weight", "overlap tensor 'encoder.bias'"),
    "gap_between_tensors": (gap, "head.weight", "of the data section to no tensor"),
    "bytes_after_the_last_tensor": (trailing_bytes, "head.weight", "bytes after the last tensor"),
    "duplicate_name": (duplicate_name, "encoder.bias", "lists it more than once"),
    "duplicate_field": (duplicate_field, "encoder.bias", "repeats dtype"),
    "entry_not_an_object": (lambda h, d: encode({**h, "encoder.bias": 5}, d), "encoder.bias", "lacks dtype, shape and data_offsets"),
    "entry_without_dtype": (lambda h, d: encode({**h, "encoder.bias": {"shape": [6], "data_offsets": [0, 24]}}, d), "encoder.bias", "lacks dtype"),
    "metadata_a_list": (metadata(["format", "pt"]), None, "__metadata__ must map strings to strings"),
    "metadata_int_value": (metadata({"format": 1}), None, "__metadata__ must map strings to strings"),
    "metadata_nested": (metadata({"format": {"pt": "yes"}}), None, "__metadata__ must map strings to strings"),
    "metadata_a_string": (metadata("pt"), None, "__metadata__ must map strings to strings"),
}  # fmt: skip


def test_the_cases_start_from_the_layout_they_assume(tmp_path):
    """The mutations above name tensors by where `safetensors` puts them: check it does."""
    header, data, _ = valid_file(tmp_path / "valid.safetensors")
    assert first_and_last(header) == ("encoder.bias", "head.weight")
    assert range_of(header, "encoder.bias") == (0, 24) and header["head.weight"]["dtype"] == "BF16"
    assert len(data) == range_of(header, "head.weight")[1] == 144


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_header_raises_a_named_error(tmp_path, case):
    mutate, tensor, words = CASES[case]
    header, data, _ = valid_file(tmp_path / "valid.safetensors")
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(mutate(header, data))
    with pytest.raises(CheckpointFormatError) as info:
        read_safetensors(path)
    error = info.value
    message = str(error)
    assert isinstance(error, CheckpointError) and isinstance(error, ValueError)
    assert error.path == str(path) and repr(str(path)) in message, message
    assert error.tensor == tensor, message
    if tensor is not None:
        assert f"tensor {tensor!r}" in message, message
    assert words in message, message
    assert "\n" not in message  # the CLI prints it as one line


@pytest.mark.parametrize(
    "case", ["float_offsets", "shape_null", "dtype_a_list", "overlapping_tensors"]
)
def test_import_refuses_before_writing_anything(tmp_path, case, capsys):
    """Through `zerojax ckpt import` (in process): exit code 2, one line naming file and
    tensor, and no directory, step or temporary directory left behind. The cases are the ones
    the issue found (three raw TypeErrors and one silent acceptance)."""
    mutate, tensor, words = CASES[case]
    header, data, _ = valid_file(tmp_path / "valid.safetensors")
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(mutate(header, data))
    target = tmp_path / "ckpt"
    with pytest.raises(CheckpointFormatError):
        import_weights(path, target)
    assert not target.exists()

    assert main(["ckpt", "import", str(path), str(target)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert str(path) in lines[0] and f"tensor {tensor!r}" in lines[0] and words in lines[0]
    assert not target.exists()

    # A directory that already holds a step keeps exactly what it held.
    valid = tmp_path / "valid.safetensors"
    import_weights(valid, target, step=0)
    before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    assert main(["ckpt", "import", str(path), str(target), "--step", "1"]) == 2
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before


@pytest.mark.long
def test_cli_exits_nonzero_with_one_line_and_no_traceback(tmp_path):
    """The installed command in its own process: what a user sees in a terminal."""
    header, data, _ = valid_file(tmp_path / "valid.safetensors")
    path = tmp_path / "bad.safetensors"
    path.write_bytes(set_field("encoder.bias", "shape", None)(header, data))
    result = subprocess.run(
        [str(Path(sys.executable).parent / "zerojax"), "ckpt", "import", str(path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "tensor 'encoder.bias'" in lines[0] and "shape None" in lines[0]
    assert not (tmp_path / "out").exists()


def test_valid_files_still_read_bit_for_bit(tmp_path):
    """The rules refuse no file the reference writer makes: data stored in another order
    than the header's, null metadata and a zero-size tensor all read back exactly."""
    header, data, state_dict = valid_file(tmp_path / "valid.safetensors")
    arrays, meta = read_safetensors(tmp_path / "valid.safetensors")
    assert meta == {"format": "pt"}
    for name, tensor in state_dict.items():
        expected = (
            tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
        )
        got = arrays[name].view(np.int16) if tensor.dtype == torch.bfloat16 else arrays[name]
        np.testing.assert_array_equal(got, expected)  # fmt: skip

    # The same tensors, the header listing them in reverse; null metadata; an empty tensor.
    reordered = {n: header[n] for n in reversed(list(header)) if n != "__metadata__"}
    reordered["__metadata__"] = None
    reordered["empty"] = {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}
    path = tmp_path / "reordered.safetensors"
    path.write_bytes(encode(reordered, data))
    arrays2, meta2 = read_safetensors(path)
    assert meta2 == {} and arrays2["empty"].shape == (0, 3)
    for name in state_dict:
        np.testing.assert_array_equal(arrays2[name], arrays[name])


# --------------------------------------------------------------------------- beyond the header


def test_torch_file_with_a_flipped_bit_is_refused(tmp_path):
    """torch.load does not check the zip's crc32s: a bit flipped in a tensor's bytes imported
    as a wrong weight (found by tools/fault_injection). The import checks them first."""
    path = tmp_path / "model.pt"
    torch.save({"encoder.weight": torch.randn(64, 64)}, path)
    data = bytearray(path.read_bytes())
    at = data.index(b"model/data/0") + 200  # inside the tensor's bytes (after its header)
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    target = tmp_path / "ckpt"
    with pytest.raises(CheckpointFormatError, match="fails its crc32 check") as info:
        import_weights(path, target)
    assert str(path) in str(info.value)
    assert not target.exists()


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    """A write that fails -- Orbax's (here: the directory's parent is a file) or the
    manifest's, written inside the temporary step directory before its commit -- raises
    CheckpointError and keeps no step, no temporary directory and no directory the import
    created."""
    valid_file(tmp_path / "valid.safetensors")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="writing step 0 of .* failed, nothing was kept"):
        import_weights(tmp_path / "valid.safetensors", tmp_path / "file" / "ckpt")

    import zerojax.ckpt.commit as module

    def full_disk(step_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "write_manifest", full_disk)
    existing = tmp_path / "existing"
    existing.mkdir()
    for target in (tmp_path / "fresh", existing):
        with pytest.raises(CheckpointError, match="No space left on device"):
            import_weights(tmp_path / "valid.safetensors", target, step=3)
        assert not (tmp_path / "fresh").exists()
        assert list(existing.iterdir()) == []
