"""The engine keeps its parts to itself: code outside ``cnrstore/engine/`` (the rest of the package, the
tools and the benchmarks) uses an ``Engine`` through its public methods and the maintenance handle only,
and the handle is dead once its ``with`` block ends."""

from __future__ import annotations

import ast
import os

import numpy as np
import pytest

import cnrstore
from cnrstore.errors import CnrError

PACKAGE = os.path.dirname(cnrstore.__file__)
ROOT = os.path.dirname(PACKAGE)
#: the engine's public surface may hold these data attributes (set in __init__); all else is a method
PUBLIC_DATA = {"path", "readonly", "recovery_notes"}


def _engine_surface() -> tuple[set[str], set[str]]:
    """(public names of class Engine, public data attributes its __init__ sets), from engine/core.py."""
    tree = ast.parse(open(os.path.join(PACKAGE, "engine", "core.py"), encoding="utf-8").read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    methods = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    data = {t.attr for node in ast.walk(init) for t in getattr(node, "targets", [getattr(node, "target", None)])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    public_data = {name for name in data if not name.startswith("_")}
    return {m for m in methods if not m.startswith("_")} | public_data, public_data


def _names_an_engine(node: ast.AST) -> bool:
    """``engine``, ``x.engine`` or ``x._engine`` (an Engine by this code base's naming), not the module
    ``cnrstore.engine``."""
    if isinstance(node, ast.Name):
        return node.id == "engine"
    return (isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine")
            and not (isinstance(node.value, ast.Name) and node.value.id == "cnrstore"))


def engine_internal_uses(paths: list[str], public: set[str]) -> list[str]:
    """Each ``<engine>.<name>`` outside the engine's public surface, in the files at ``paths``."""
    found = []
    for path in paths:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   for a in n.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _names_an_engine(node.value) and node.attr not in public
                    and not (isinstance(node.value, ast.Name) and "engine" in modules)):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: .{node.attr}")
    return found


def _outside_files() -> list[str]:
    out = []
    for top in ("cnrstore", "tools", "benchmarks"):
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, top)):
            if os.path.join("cnrstore", "engine") in dirpath:
                continue
            out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return out


def test_nothing_outside_the_engine_uses_its_internals():
    public, _data = _engine_surface()
    files = _outside_files()
    assert len(files) > 40, "the scan found the package, the tools and the benchmarks"
    found = engine_internal_uses(files, public)
    assert not found, f"{len(found)} use(s) of engine internals outside cnrstore/engine/:\n" + "\n".join(found)


def test_the_engine_has_no_public_data_but_what_it_states():
    _public, data = _engine_surface()
    assert data == PUBLIC_DATA, f"Engine.__init__ makes public data attributes {sorted(data - PUBLIC_DATA)}"


def test_the_count_catches_a_use_of_an_internal(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(store, engine):\n    store.engine.appender.seal()\n    engine.index.read()\n"
                   "    with store.engine.read() as view:\n        return view\n")
    public, _data = _engine_surface()
    assert [line.split(": ")[1] for line in engine_internal_uses([str(bad)], public)] == [".appender", ".index"]


def test_the_maintenance_handle_holds_the_lock_and_dies_with_its_block(store):
    store.create_table("t", 64, 2)
    with store.checkpoint() as w:
        w.put_rows("t", np.arange(4), np.ones((4, 2), np.float32))
    engine = store.engine
    with engine.maintenance() as m:
        assert not engine._maintenance_lock.acquire(blocking=False), "the handle holds the maintenance lock"
        with m.read() as view:
            assert view.version_numbers() == [1]
        assert m.history().versions[-1].version == 1
    assert engine._maintenance_lock.acquire(blocking=False)
    engine._maintenance_lock.release()
    with pytest.raises(CnrError, match="after its `with engine.maintenance"):
        m.read()
    with pytest.raises(CnrError, match="after its"):
        m.commit(None)
