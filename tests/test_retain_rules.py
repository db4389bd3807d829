"""``Store.retain`` and ``cnrstore retain`` take a Checkpointer's retention rules: keep the newest N, keep every
N-th step, pin versions, drop versions -- never the newest; what every kept version reads is unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest

import cnrstore
from cnrstore.cli import main
from cnrstore.errors import InvalidArgument, VersionNotFound


def make(path, steps=(10, 20, 30, 40, 50, 60)):
    with cnrstore.open(path, create=True) as s:
        s.create_table("t", 64, 4)
        for i, step in enumerate(steps):
            with s.checkpoint(step=step) as ck:
                rows = np.arange(64) if i == 0 else np.array([i])
                ck.put_rows("t", rows, np.full((rows.size, 4), step, np.float32))
        return {v.version: s.read_table("t", v.version) for v in s.versions()}


def kept(path):
    with cnrstore.open(path, readonly=True) as s:
        return [v.version for v in s.versions()]


@pytest.mark.parametrize("kwargs, left", [
    ({"keep_last": 2}, [5, 6]),
    ({"keep_every_n_steps": 20}, [2, 4, 6]),
    ({"keep_last": 1, "keep_every_n_steps": 30}, [3, 6]),
    ({"keep_last": 1, "keep": [1]}, [1, 6]),
    ({"drop": [2, 3]}, [1, 4, 5, 6]),
    ({"keep_every_n_steps": 20, "drop": [1]}, [2, 4, 6]),
])
def test_retain_rules(tmp_path, kwargs, left):
    content = make(tmp_path / "s")
    with cnrstore.open(tmp_path / "s") as s:
        s.retain(**kwargs)
        assert [v.version for v in s.versions()] == left
        for v in left:
            np.testing.assert_array_equal(s.read_table("t", v), content[v])
        s.gc()


def test_retain_refuses_what_it_cannot_do_and_changes_nothing(tmp_path):
    make(tmp_path / "s")
    with cnrstore.open(tmp_path / "s") as s:
        for kwargs, error, words in [({}, InvalidArgument, "needs a rule"),
                                     ({"drop": [6]}, InvalidArgument, "newest"),
                                     ({"drop": [99]}, VersionNotFound, "99"),
                                     ({"keep_last": 2, "drop": [6]}, InvalidArgument, "newest"),
                                     ({"keep_last": 3, "drop": [5]}, InvalidArgument, "kept by a rule"),
                                     ({"keep": ["x"]}, InvalidArgument, "version numbers")]:
            with pytest.raises(error, match=words):
                s.retain(**kwargs)
        assert [v.version for v in s.versions()] == [1, 2, 3, 4, 5, 6]


def test_cnrstore_retain_takes_the_same_rules(tmp_path, capsys):
    make(tmp_path / "s")
    assert main(["retain", str(tmp_path / "s"), "--keep-every-n-steps", "20", "--keep", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kept"] == [1, 2, 4, 6]
    assert main(["retain", str(tmp_path / "s"), "--drop", "2", "--drop", "4"]) == 0
    assert kept(tmp_path / "s") == [1, 6]
    capsys.readouterr()
    assert main(["retain", str(tmp_path / "s")]) == 2
    assert "retain needs" in capsys.readouterr().err
