"""The step manifest: sizes and checksums (xxh3_64; crc32 in older manifests) that name a
damaged checkpoint file.

Run: .venv/bin/python -m pytest -q tests/ckpt/test_manifest.py -p no:cacheprovider
Why: a checkpoint copied halfway, truncated by a full disk or edited by hand must fail with
the file's name and what differs, before any restore or export reads garbage; a step without
a manifest cannot be verified and is refused (issue 41).
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
import xxhash

from zerojax.ckpt import layout
from zerojax.ckpt.errors import CheckpointCorruptedError, CheckpointError
from zerojax.ckpt.manifest import (
    file_checksum,
    manifest_problems,
    verify_manifest,
    write_manifest,
)


@pytest.fixture
def step_dir(tmp_path):
    """A step-like tree of random files, one larger than the 1 MB read chunk."""
    rng = np.random.default_rng()
    root = tmp_path / "7"
    (root / "model" / "ocdbt.process_0" / "d").mkdir(parents=True)
    (root / "meta").mkdir()
    files = {
        "model/_METADATA": rng.bytes(300),
        "model/ocdbt.process_0/d/abc": rng.bytes(3 * 2**20 + 17),
        "meta/metadata": b'{"format": "zerojax-checkpoint/1"}',
        "empty_file": b"",
    }
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    return root, files


def test_manifest_records_every_file_size_and_xxh3(step_dir):
    root, files = step_dir
    write_manifest(root)
    manifest = json.loads((root / layout.MANIFEST).read_text())
    assert set(manifest["files"]) == set(files)  # not itself
    for rel, data in files.items():
        expected = {"size": len(data), "xxh3_64": xxhash.xxh3_64_intdigest(data)}
        assert manifest["files"][rel] == expected
    big = files["model/ocdbt.process_0/d/abc"]  # streamed in 1 MB pieces: same digest
    assert file_checksum(root / "model/ocdbt.process_0/d/abc") == xxhash.xxh3_64_intdigest(big)
    assert file_checksum(root / "model/ocdbt.process_0/d/abc", "crc32") == zlib.crc32(big)
    assert sorted(os.listdir(root)) == sorted(["model", "meta", "empty_file", layout.MANIFEST])
    verify_manifest(root)  # intact: no error
    write_manifest(root)  # rewriting is idempotent and does not list the manifest
    assert json.loads((root / layout.MANIFEST).read_text()) == manifest


def test_truncated_file_is_named_with_both_sizes(step_dir):
    root, files = step_dir
    write_manifest(root)
    big = root / "model/ocdbt.process_0/d/abc"
    size = len(files["model/ocdbt.process_0/d/abc"])
    with open(big, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointCorruptedError, match="truncated") as info:
        verify_manifest(root)
    assert str(big) in str(info.value)
    assert f"size {size - 1000} bytes vs {size}" in str(info.value)
    assert info.value.path == str(big)
    assert isinstance(info.value, CheckpointError)


def flip_bits(path, offset: int, mask: int) -> None:
    """Change the byte at `offset` of the file at `path` (XOR `mask`), keeping its size."""
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_changed_byte_same_size_is_a_crc_mismatch(step_dir):
    root, _ = step_dir
    write_manifest(root)
    target = root / "model/_METADATA"
    flip_bits(target, 150, 0x01)
    with pytest.raises(
        CheckpointCorruptedError, match=r"changed since it was saved: xxh3_64 0x[0-9a-f]{16} vs"
    ) as info:
        verify_manifest(root)
    assert info.value.path == str(target)


def old_manifest(root, files):
    """The manifest as zerojax wrote it before 2026-11-28: {size, crc32} per file."""
    entries = {rel: {"size": len(d), "crc32": zlib.crc32(d)} for rel, d in files.items()}
    (root / layout.MANIFEST).write_text(json.dumps({"files": entries}))


def test_a_manifest_of_crc32s_is_still_verified(step_dir):
    """Checkpoints saved before the manifest held xxh3_64 verify with their crc32s, and a
    changed byte, a truncation or a deletion is still named."""
    root, files = step_dir
    old_manifest(root, files)
    verify_manifest(root)
    target = root / "model/ocdbt.process_0/d/abc"
    flip_bits(target, 2**20 + 5, 0x10)  # in the second 1 MB piece of the streamed hash
    with pytest.raises(
        CheckpointCorruptedError, match=r"changed since it was saved: crc32 0x[0-9a-f]{8} vs"
    ) as info:
        verify_manifest(root)
    assert info.value.path == str(target)
    with open(target, "r+b") as f:
        f.truncate(10)
    (root / "empty_file").unlink()
    problems = manifest_problems(root)
    assert [p.path for p in problems] == [str(root / "empty_file"), str(target)]
    assert "is missing" in str(problems[0]) and "is truncated" in str(problems[1])


def test_missing_and_grown_files(step_dir):
    root, _ = step_dir
    write_manifest(root)
    with open(root / "meta/metadata", "ab") as f:
        f.write(b" ")
    with pytest.raises(CheckpointCorruptedError, match=r"meta/metadata' is grown"):
        verify_manifest(root)
    write_manifest(root)
    (root / "empty_file").unlink()
    with pytest.raises(CheckpointCorruptedError, match=r"empty_file' is missing"):
        verify_manifest(root)


def test_no_manifest_and_a_damaged_manifest_are_refused(step_dir):
    """Issue 41: a step without a manifest used to be accepted silently (no check at all)."""
    root, _ = step_dir
    with pytest.raises(CheckpointCorruptedError, match="has no zerojax_manifest.json") as info:
        verify_manifest(root)
    assert info.value.path == str(root / layout.MANIFEST)
    assert [p.path for p in manifest_problems(root)] == [str(root / layout.MANIFEST)]
    write_manifest(root)
    (root / layout.MANIFEST).write_text('{"files": ')  # cut short
    with pytest.raises(CheckpointCorruptedError, match="manifest .* is unreadable"):
        verify_manifest(root)
    # Entries of the wrong form, or outside the step, are a damaged manifest, never a
    # KeyError or a read of another file.
    for files in (
        {"meta/metadata": {"size": 3}},
        {"meta/metadata": {"size": 3, "xxh3_64": "0x12"}},
        {"meta/metadata": {"size": 3, "xxh3_64": 1, "crc32": None}},
        {"meta/metadata": [1, 2]},
        {"../../etc/passwd": {"size": 1, "crc32": 0}},
        {"/etc/passwd": {"size": 1, "crc32": 0}},
    ):
        (root / layout.MANIFEST).write_text(json.dumps({"files": files}))
        with pytest.raises(CheckpointCorruptedError, match="manifest .* is unreadable"):
            verify_manifest(root)
    # Files added after the manifest (not listed) are not corruption.
    write_manifest(root)
    (root / "later.txt").write_text("x")
    verify_manifest(root)


def test_every_problem_is_listed(step_dir):
    root, _ = step_dir
    write_manifest(root)
    (root / "empty_file").unlink()
    with open(root / "meta/metadata", "ab") as f:
        f.write(b" ")
    problems = manifest_problems(root)
    assert [p.path for p in problems] == [str(root / "empty_file"), str(root / "meta/metadata")]
    assert "is missing" in str(problems[0]) and "is grown" in str(problems[1])


def test_an_unreadable_file_is_a_problem_not_an_os_error(step_dir, monkeypatch):
    """chmod 000 stops no root: the read itself fails here, as it would for another user."""
    from zerojax.ckpt import manifest

    root, _ = step_dir
    write_manifest(root)

    def unreadable(path, *_):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(manifest, "file_checksum", unreadable)
    with pytest.raises(CheckpointCorruptedError, match="cannot be read: PermissionError") as info:
        verify_manifest(root)
    assert info.value.path == str(root / "empty_file")  # the first file, in sorted order


def test_write_manifest_needs_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        write_manifest(tmp_path / "nope")
