"""cnrstore/export.py's exporter registry: the wings register what the core export asks of them, and the
core imports neither wing (tests/test_engine.py checks the import graph; the exports themselves are
tested in test_export_state_dict.py, test_export_merged.py and test_cli.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import cnrstore
from cnrstore import export as export_mod
from cnrstore.export import exporter, register


def test_each_wing_registers_its_exporter_when_first_asked():
    import cnrstore.distributed.export
    import cnrstore.torch.export

    assert exporter("torch") is cnrstore.torch.export
    assert exporter("distributed") is cnrstore.distributed.export
    assert set(export_mod.WINGS) == {"torch", "distributed"}


def test_a_registered_exporter_is_the_one_the_export_uses(tmp_path, monkeypatch):
    monkeypatch.setattr(export_mod, "_exporters", dict(export_mod._exporters))
    written = []

    class Writer:
        @staticmethod
        def write(data, fmt, layout, path, metadata):
            written.append((sorted(data), fmt, layout, metadata["version"]))
            open(path, "wb").write(b"x")

    register("torch", Writer)
    monkeypatch.setitem(export_mod.WINGS, "torch", "cnrstore.errors")  # an import that registers nothing
    assert exporter("torch") is Writer
    snap = cnrstore.Snapshot(version=3, step=7, meta={}, tables={"t": np.zeros((2, 4), np.float32)}, dense={})
    report = export_mod.export(snap, "torch", tmp_path / "out.pt")
    assert written == [(["dense", "meta", "step", "tables", "version"], "torch", "nested", "3")]
    assert report.layout == "nested" and (tmp_path / "out.pt").read_bytes() == b"x"


def test_an_unregistered_name_is_a_key_error():
    with pytest.raises(KeyError, match="no exporter is registered as 'parquet'"):
        exporter("parquet")


def test_importing_the_core_export_imports_no_wing_and_no_torch():
    code = ("import sys, cnrstore.export; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('cnrstore.torch', "
            "'cnrstore.distributed'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
