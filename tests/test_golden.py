"""Stores written by earlier cnrstore releases (tests/data/format<N>/, made by tools/make_golden.py)
must still read back exactly as they did when written."""

import os
import shutil

import numpy as np
import pytest

import cnrstore

DATA = os.path.join(os.path.dirname(__file__), "data")
FORMATS = sorted(d for d in os.listdir(DATA) if d.startswith("format"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_golden_store_reads_as_written(fmt, tmp_path):
    src = os.path.join(DATA, fmt)
    path = tmp_path / "store"
    shutil.copytree(os.path.join(src, "store"), path)  # LMDB needs a writable lock file beside it
    expected = np.load(os.path.join(src, "expected.npz"))
    with cnrstore.open(path, readonly=True) as store:
        versions = [v.version for v in store.versions()]
        assert versions == {"format1": [1, 2], "format2": [1, 2], "format3": [1, 2, 3, 4]}.get(fmt, list(range(1, 9)))
        assert store.versions()[1].meta == {"loader_pos": 9}
        for key in expected.files:
            v, name = key.split("/")
            version = int(v[1:])
            if name.startswith("keyed:"):  # format 4: a keyed table's keys, values and columns
                _, table, field, *col = name.split(":")
                rows = store.read_keyed(table, version)
                got = rows.keys if field == "keys" else rows.values if field == "values" else rows.columns[col[0]]
            else:
                got = store.read_dense(name, version) if name == "dense" else store.read_table(name, version)
            assert got.dtype == expected[key].dtype
            assert np.array_equal(got.view(np.uint8), expected[key].view(np.uint8)), key
        assert store.verify().ok
        if fmt not in ("format1", "format2"):  # format 3: version 4 is read through cumulative deltas
            with store.engine.read() as view:
                flags = [loc.flags for _t, _b, v, loc in view.row_entries() if v == 4]
            assert any(f & cnrstore.engine.record.FLAG_DELTA for f in flags)


def test_golden_store_opens_for_writing(tmp_path):
    src = os.path.join(DATA, FORMATS[-1], "store")
    shutil.copytree(src, tmp_path / "store")
    with cnrstore.open(tmp_path / "store") as store:
        with store.checkpoint() as ck:
            ck.put_rows("t_int4", [1], np.ones((1, 7), np.float32))
        assert store.read_rows("t_int4", [1])[0, 0] == 1.0
        assert store.verify().ok
