"""Checksums, completion markers and clean-up of shardopt's checkpoint files, in one process (issue 57; the
killed-rank cases are in tests_dist/test_fault_injection.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from test_checkpoint import fresh, state_snapshot, train

import shardopt.checkpoint as ckpt
from shardopt.checkpoint import commit, files


def _flip(path: str, tensor: str, at: float = 0.5, count: int = 16) -> None:
    """Flip ``count`` bytes in the middle of ``tensor``'s data in the safetensors file ``path``."""
    end, header = files._data_end(path)
    base = end - max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    a, b = header[tensor]["data_offsets"]
    pos = base + a + int((b - a - count) * at)
    with open(path, "r+b") as f:
        f.seek(pos)
        data = f.read(count)
        f.seek(pos)
        f.write(bytes(x ^ 0xFF for x in data))


def _biggest(path: str) -> str:
    _, header = files._data_end(path)
    return max(
        (k for k in header if k != "__metadata__"),
        key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0],
    )


def test_every_tensor_carries_its_crc32(tmp_path):
    model, opt = fresh("racs")
    train(model, opt, 2)
    path = ckpt.save(str(tmp_path), opt)
    _, header = files._data_end(path)
    sums = json.loads(header["__metadata__"][files.CRC_KEY])
    assert set(sums) == {k for k in header if k != "__metadata__"}
    with safe_open(path, framework="pt") as f:
        for k in f.keys():
            assert sums[k] == files._crc(f.get_tensor(k).contiguous()), k


def test_flipped_bytes_are_refused_naming_file_and_tensor(tmp_path):
    model, opt = fresh("racs")
    train(model, opt, 2)
    path = ckpt.save(str(tmp_path), opt)
    victim = _biggest(path)
    _flip(path, victim)
    model2, opt2 = fresh("racs")
    train(model2, opt2, 1)
    before = state_snapshot(opt2)
    with pytest.raises(ckpt.CheckpointError, match=rf"{files.STATE_FILE}: checksum mismatch in tensor '{victim}'"):
        ckpt.load(str(tmp_path), opt2)
    after = state_snapshot(opt2)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing loaded
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch"):
        files.read_state_file(path)  # the offline tools (inspect, convert) refuse it too


def test_the_verify_switch_skips_the_check(tmp_path, monkeypatch):
    model, opt = fresh("scale")
    train(model, opt, 2)
    path = ckpt.save(str(tmp_path), opt)
    _flip(path, _biggest(path))
    monkeypatch.setenv("SHARDOPT_CHECKPOINT_VERIFY", "0")
    ckpt.load(str(tmp_path), fresh("scale")[1])  # loads (damaged values): the user chose not to check


def test_files_without_checksums_still_load(tmp_path):
    """Checkpoints written before checksums existed: no ``shardopt_crc32`` metadata, nothing to verify."""
    model, opt = fresh("scale")
    train(model, opt, 2)
    path = ckpt.save(str(tmp_path), opt)
    from safetensors.torch import load_file, save_file

    _, header = files._data_end(path)
    save_file(load_file(path), path, metadata={"shardopt": header["__metadata__"]["shardopt"]})
    ckpt.load(str(tmp_path), fresh("scale")[1])


def test_interrupted_save_is_named_and_its_leftovers_cleaned(tmp_path):
    """Part and ``.tmp-*`` files without a main file: the error says the save was interrupted; ``clean`` (and the
    next save) removes them, never a complete checkpoint's files."""
    model, opt = fresh("scale")
    train(model, opt, 2)
    good = tmp_path / "A"
    ckpt.save(str(good), opt)
    bad = tmp_path / "B"
    bad.mkdir()
    (bad / "shardopt_state.0123abcd.r00001.0.safetensors").write_bytes(b"x" * 10)
    (bad / ".tmp-abc.safetensors").write_bytes(b"half")
    with pytest.raises(ckpt.CheckpointError, match="the save was interrupted before its main file"):
        ckpt.load(str(bad), fresh("scale")[1])
    (good / ".tmp-old.safetensors").write_bytes(b"half")
    (good / "shardopt_state.deadbeef.r00001.0.safetensors").write_bytes(b"orphan")
    found = commit.leftovers(str(tmp_path))
    assert sorted(os.path.basename(p) for p in found) == sorted(
        [
            ".tmp-old.safetensors",
            "shardopt_state.deadbeef.r00001.0.safetensors",
            ".tmp-abc.safetensors",
            "shardopt_state.0123abcd.r00001.0.safetensors",
        ]
    )
    ckpt.save(str(good), opt)  # the next save in A removes A's leftovers
    assert sorted(os.listdir(good)) == [files.STATE_FILE]
    from shardopt.cli import main

    assert main(["checkpoint", "clean", "--dry-run", str(tmp_path)]) == 0 and os.listdir(bad)
    assert main(["checkpoint", "clean", str(tmp_path)]) == 0
    assert sorted(os.listdir(bad)) == [] and sorted(os.listdir(good)) == [files.STATE_FILE]
    ckpt.load(str(good), fresh("scale")[1])


def test_marker_names_the_partial_file_and_the_last_complete_checkpoint(tmp_path):
    for tag, step in (("A", 2), ("B", 4)):
        d = tmp_path / tag
        d.mkdir()
        (d / "model.pt").write_bytes(b"m" * 100)
        commit.write_marker(str(d), {"global_steps": step})
    assert commit.incomplete(str(tmp_path), "B") is None
    assert commit.last_complete(str(tmp_path)) == str(tmp_path / "B")
    (tmp_path / "B" / "model.pt").write_bytes(b"m" * 50)
    err = commit.incomplete(str(tmp_path), "B")
    assert "model.pt is partial or changed (50 bytes, 100 when saved)" in err and f"{tmp_path / 'A'}" in err
    (tmp_path / "C").mkdir()
    (tmp_path / "C" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o")
    err = commit.incomplete(str(tmp_path), "C")
    assert "neither shardopt's" in err and "the last complete checkpoint is" in err and str(tmp_path / "A") in err
    assert commit.incomplete(str(tmp_path), "C", needs_shardopt=False) is None


def test_pointer_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "latest"
    commit.write_atomic(str(path), "A")

    def boom(*a, **k):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        commit.write_atomic(str(path), "B")
    monkeypatch.undo()
    assert path.read_text() == "A" and os.listdir(tmp_path) == ["latest"]
