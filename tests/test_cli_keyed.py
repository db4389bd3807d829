"""The `cnrstore` command on a store with a keyed table (issue 50): ls (--long, --json), info, verify, rows by
key, diff (keys put or changed and deleted; --rows, --json), and export --layout nested then import back."""

from __future__ import annotations

import json

import os
import subprocess
import sys

import numpy as np
import pytest

import cnrstore


def run(*args, check_rc=0):
    proc = subprocess.run([sys.executable, "-m", "cnrstore.cli", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert proc.returncode == check_rc, (proc.returncode, proc.stdout, proc.stderr)
    return proc


@pytest.fixture(scope="module")
def keyed_store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli_keyed") / "store")
    with cnrstore.open(path, create=True) as store:
        store.create_table("ids", dim=3, keyed=True, partitions=4, columns={"score": "float32"})
        store.create_table("emb", 16, 3)
        for v, (puts, evicts) in enumerate([(range(10), []), ([20, 21], [1, 2, 3]), ([1], [20])]):
            k = np.asarray(list(puts), np.int64)
            with store.checkpoint(step=v, meta={"v": v}) as ck:
                ck.put_keys("ids", k, np.full((k.size, 3), v, np.float32), columns={"score": np.full(k.size, v, np.float32)})
                if evicts:
                    ck.delete_keys("ids", evicts)
                n = 16 if v == 0 else 2
                ck.put_rows("emb", np.arange(n), np.full((n, 3), v, np.float32))
    return path


def test_ls_info_verify(keyed_store):
    out = run("ls", keyed_store).stdout
    assert "3 version(s)" in out and "emb, ids" in out
    assert 'meta: {"v": 2}' in run("ls", keyed_store, "--long").stdout
    listing = json.loads(run("ls", keyed_store, "--json").stdout)
    assert [r["tables"] for r in listing] == [["emb", "ids"]] * 3
    assert "4 partitions; columns score:f4" in run("info", keyed_store).stdout
    assert run("verify", keyed_store).stdout.startswith("ok:")


def test_rows_of_a_keyed_table_by_key(keyed_store):
    out = run("rows", keyed_store, "ids", 1, 2, 21).stdout.splitlines()
    assert out == ["1: [2. 2. 2.]  score=2.0", "2: not found", "21: [1. 1. 1.]  score=1.0"]
    got = json.loads(run("rows", keyed_store, "ids", 2, 5, "--version", 1, "--json").stdout)
    assert got["found"] == [True, True] and got["values"][1] == [0, 0, 0]


def test_diff_counts_and_lists_keys_put_and_deleted(keyed_store):
    out = run("diff", keyed_store, 1, 3).stdout
    # (20, admitted at 2 and evicted at 3, counts as deleted: the records since 1 are read alone, and deleting it
    # from a copy at 1 is a no-op)
    assert "ids" in out and "2 keys put or changed, 3 deleted" in out
    assert "2 keys put or changed and 3 deleted in 1 keyed table(s)" in out
    out = run("diff", keyed_store, 1, 2, "--rows").stdout
    assert "keys: 20 21" in out and "deleted: 1 2 3" in out
    got = json.loads(run("diff", keyed_store, 0, 2, "--rows", "--json").stdout)["tables"]["ids"]
    assert got["keyed"] and got["keys_changed"] == 9 and got["keys_deleted"] == 0
    assert got["keys"] == [0, 4, 5, 6, 7, 8, 9, 20, 21] and got["deleted"] == []
    assert json.loads(run("diff", keyed_store, 1, 2, "--json").stdout)["tables"]["emb"]["rows_changed"] == 2


def test_export_nested_then_import_back(keyed_store, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "o.dcp"
    assert "layout nested" in run("export", keyed_store, "--format", "dcp", out).stdout
    msg = run("import", tmp_path / "back", out).stdout
    assert "1 keyed table(s)" in msg and "keyed table ids: 9 keys x 3, fp32, columns score" in msg
    with cnrstore.open(keyed_store, readonly=True) as a, cnrstore.open(tmp_path / "back", readonly=True) as b:
        want, got = a.read_keyed("ids"), b.read_keyed("ids")
        assert np.array_equal(want.keys, got.keys) and np.array_equal(want.values, got.values)
        assert np.array_equal(want.columns["score"], got.columns["score"])
