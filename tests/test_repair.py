"""Index loss and damage: an open never destroys data it cannot account for, damage to the index is a
typed error naming ``cnrstore repair``, and repair rebuilds the index from the segment log."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import cnrstore
from cnrstore import filenames
from cnrstore.errors import CorruptionError, IndexDamaged

PY = sys.executable


def _make_store(path, versions: int = 4) -> None:
    rng = np.random.default_rng(0)
    with cnrstore.open(path, create=True) as s:
        s.create_table("emb", num_rows=300, dim=8, codec="int8", block_rows=64)
        s.create_table("f", num_rows=100, dim=4, codec="fp32", block_rows=32)
        for v in range(versions):
            with s.checkpoint(step=v, meta={"i": v}) as ck:
                rows = rng.choice(300, size=40, replace=False)
                ck.put_rows("emb", rows, rng.standard_normal((40, 8)).astype(np.float32))
                ck.put_rows("f", np.arange(v, 100, 3), rng.standard_normal((len(range(v, 100, 3)), 4)))
                ck.put_dense("dense", np.full(3, v, dtype=np.int64))


def _segment_digests(path) -> dict[str, str]:
    seg_dir = filenames.segments_dir(str(path))
    return {n: hashlib.sha256(open(os.path.join(seg_dir, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(seg_dir))}


def _data_mdb(path) -> str:
    return os.path.join(filenames.index_dir(str(path)), "data.mdb")


def _lose_deleted(path):
    os.remove(_data_mdb(path))


def _lose_truncated(path):
    os.truncate(_data_mdb(path), 0)


def _lose_dir(path):
    shutil.rmtree(filenames.index_dir(str(path)))


@pytest.mark.parametrize("damage", [_lose_deleted, _lose_truncated, _lose_dir], ids=["deleted", "empty", "no-dir"])
@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
def test_open_with_deleted_index_raises_corruption_and_keeps_segments(tmp_path, damage, readonly):
    path = tmp_path / "s"
    _make_store(path)
    before = _segment_digests(path)
    assert before
    damage(path)
    with pytest.raises(IndexDamaged, match="cnrstore repair") as info:
        cnrstore.open(path, readonly=readonly)
    assert isinstance(info.value, CorruptionError)
    assert _segment_digests(path) == before  # nothing deleted, nothing truncated


def test_unknown_segment_that_is_not_a_leftover_refuses_open_and_deletes_nothing(tmp_path):
    path = tmp_path / "s"
    _make_store(path, versions=2)
    seg_dir = filenames.segments_dir(str(path))
    # a committed segment the index no longer lists (e.g. an index restored from an older copy)
    with cnrstore.open(path) as s:
        with s._index.read() as view:
            committed = view.segments()
        first = min(committed)

        def forget(w):
            w.delete_segment(first)
        s._index.write(forget)
    before = _segment_digests(path)
    with pytest.raises(IndexDamaged, match="cnrstore repair"):
        cnrstore.open(path)
    assert _segment_digests(path) == before
    assert os.path.exists(os.path.join(seg_dir, f"{first:016x}.seg"))


def test_leftover_segment_of_an_uncommitted_checkpoint_is_still_removed(tmp_path):
    path = tmp_path / "s"
    _make_store(path, versions=1)
    with cnrstore.open(path) as s:
        with s._index.read() as view:
            high = max(view.segments())
    leftover = filenames.segment_path(str(path), high + 5)
    with open(leftover, "wb") as f:
        f.write(b"x" * 10)
    with cnrstore.open(path) as s:
        assert any("removed uncommitted segment" in n for n in s.recovery_notes)
    assert not os.path.exists(leftover)


_TRUNCATE = r"""
import os, sys
import cnrstore
path, what = sys.argv[1], sys.argv[2]
try:
    if what == "open":
        s = cnrstore.open(path, readonly=True)
        s.versions(); s.read_table("emb")
    else:
        s = cnrstore.open(path)
        s.versions()
except cnrstore.CorruptionError as exc:
    print("CORRUPTION", exc)
    sys.exit(3)
sys.exit(0)
"""


@pytest.mark.parametrize("what", ["open", "open-writable"])
def test_truncated_data_mdb_is_corruption_not_sigbus(tmp_path, what):
    path = tmp_path / "s"
    _make_store(path)
    data = _data_mdb(path)
    size = os.path.getsize(data)
    os.truncate(data, size - 8192)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([PY, "-c", _TRUNCATE, str(path), what], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)  # a signal gives a negative code
    assert "truncated" in res.stdout and "cnrstore repair" in res.stdout


def test_truncated_data_mdb_cli_verify_exits_2_with_message(tmp_path):
    path = tmp_path / "s"
    _make_store(path)
    data = _data_mdb(path)
    os.truncate(data, os.path.getsize(data) - 4096)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([PY, "-m", "cnrstore.cli", "verify", str(path)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "cnrstore repair" in res.stderr
