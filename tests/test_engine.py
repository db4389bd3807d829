"""The engine layer (issue 12, part 1): no import circle in cnrstore/ (nor among the scripts in tools/), and
the segment storage seam is the only way the engine reads, measures and removes segments."""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
import traceback

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import fs, storage
from cnrstore.store import Store

PACKAGE = os.path.dirname(cnrstore.__file__)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _import_graph() -> dict[str, set[str]]:
    """Module -> the cnrstore modules it imports: every import statement, including those under ``if
    TYPE_CHECKING:`` and inside functions. ``from . import x`` names module ``x`` when it is one."""
    modules = {}
    for dirpath, _dirs, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                modules[_module_name(os.path.join(dirpath, f))] = os.path.join(dirpath, f)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_pkg = path.endswith("__init__.py")
        package = name if is_pkg else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                for alias in node.names:
                    full = f"{stem}.{alias.name}"
                    targets.append(full if full in modules else stem)
            for t in targets:
                while t and t not in modules:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != name and not (t == "cnrstore" and name.startswith("cnrstore")):
                    graph[name].add(t)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_circle_in_the_package():
    """No module of cnrstore/ imports (even for type checking only, or inside a function) a module that
    imports it back, directly or not; nothing beneath store.py imports it."""
    graph = _import_graph()
    assert "cnrstore.engine" in graph and graph["cnrstore.engine.writer"], "the graph was built"
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
    for low in ("cnrstore.engine.writer", "cnrstore.maintenance.compaction", "cnrstore.maintenance.background",
                "cnrstore.maintenance.verify", "cnrstore.engine", "cnrstore.engine.merge",
                "cnrstore.maintenance.liveness"):
        assert "cnrstore.store" not in graph[low], f"{low} imports store.py"
    # only what sits above the Store (the package's API, the CLI, the distributed checkpointer that
    # opens one store per rank, a root's manifest and bucket modules, which open its rank stores, export,
    # import and migrate-payload, which open a store by path or a root's rank stores, and the torch
    # Checkpointer, which opens the store it is given as a path) imports it; repair reads the marker from
    # marker.py
    above = {"cnrstore", "cnrstore.cli", "cnrstore.distributed.checkpointer", "cnrstore.distributed.verify",
             "cnrstore.distributed.manifest", "cnrstore.distributed.remote_root", "cnrstore.distributed.maintenance",
             "cnrstore.export", "cnrstore.distributed.export", "cnrstore.torch.imports",
             "cnrstore.torch.migrate", "cnrstore.torch.checkpointer", "cnrstore.serving"}
    importers = {m for m, deps in graph.items() if "cnrstore.store" in deps}
    assert importers <= above, f"modules beneath the Store import store.py: {sorted(importers - above)}"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


#: The layers, lowest first: a module of a layer imports only from its own layer and those before it.
#: The shared leaves (errors, checks, types, knobs, options, lazy, codecs, policy) sit beneath every layer.
LAYERS = ("cnrstore.engine", "cnrstore.maintenance", "cnrstore.store")
LEAVES = ("cnrstore.errors", "cnrstore.checks", "cnrstore.types", "cnrstore.knobs", "cnrstore.options",
          "cnrstore.lazy", "cnrstore.codecs", "cnrstore.policy")


def test_the_layers_import_only_downward():
    """cnrstore/engine/ imports nothing of maintenance/, the Store or above; maintenance/ nothing of the
    Store or above; the leaves nothing of any layer (docs/ARCHITECTURE.md draws this)."""
    graph = _import_graph()
    assert graph["cnrstore.maintenance.compaction"] & {"cnrstore.engine.core"}, "the graph was built"
    upward = []
    for module, deps in graph.items():
        if any(_in(module, leaf) for leaf in LEAVES):
            upward += [f"{module} -> {d}" for d in deps if any(_in(d, layer) for layer in LAYERS)]
            continue
        level = next((i for i, layer in enumerate(LAYERS) if _in(module, layer)), None)
        if level is None:
            continue
        above = LAYERS[level + 1:]
        upward += [f"{module} -> {d}" for d in deps if any(_in(d, layer) for layer in above)
                   or d == "cnrstore" or any(_in(d, w) for w in WINGS)]
    assert not upward, "imports against the layering: " + ", ".join(sorted(upward))


WINGS = ("cnrstore.torch", "cnrstore.distributed", "cnrstore.serving")


def test_the_core_imports_no_wing():
    """Beneath the command line, no module outside cnrstore/torch/ and cnrstore/distributed/ imports
    either (not even inside a function): the wings register what the core asks of them (export's
    exporters)."""
    graph = _import_graph()
    assert "cnrstore.export" in graph["cnrstore.torch.export"], "the graph was built"
    wing = lambda m: any(m == w or m.startswith(w + ".") for w in WINGS)  # noqa: E731
    reaches = sorted(f"{m} -> {d}" for m, deps in graph.items() if not wing(m) and m != "cnrstore.cli"
                     for d in deps if wing(d))
    assert not reaches, "core modules import a wing: " + ", ".join(reaches)


TOOLS = os.path.join(os.path.dirname(PACKAGE), "tools")


def _tools_graph() -> dict[str, set[str]]:
    """Script of tools/ -> the scripts of tools/ it imports (they import each other by bare name, with
    tools/ on ``sys.path``): every import statement, inside functions too."""
    names = {f[:-3] for f in os.listdir(TOOLS) if f.endswith(".py")}
    graph: dict[str, set[str]] = {}
    for name in names:
        path = os.path.join(TOOLS, name + ".py")
        deps = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                deps.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                deps.add(node.module.split(".")[0])
        graph[name] = (deps & names) - {name}
    return graph


def test_no_import_circle_in_tools():
    """The trainer and its multi-rank mode share the model module; neither imports the other back."""
    graph = _tools_graph()
    assert {"dlrm_dist", "dlrm_model"} <= graph["train_dlrm"], "the graph was built"
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"], "the check finds a circle"
    cycle = _cycle(graph)
    assert cycle is None, "import circle in tools/: " + " -> ".join(cycle)


class RecordingStorage(storage.LocalSegmentStorage):
    """The local storage, recording what the engine asks of it."""

    def __init__(self, root):
        super().__init__(root)
        self.calls: list[tuple] = []

    def read(self, seg, offset, length):
        self.calls.append(("read", seg))
        return super().read(seg, offset, length)

    def remove(self, seg):
        self.calls.append(("remove", seg))
        super().remove(seg)

    def sealed(self, seg):
        self.calls.append(("sealed", seg))


def test_the_engine_reads_removes_and_seals_segments_through_the_storage_seam(tmp_path, monkeypatch):
    """Reads of committed data, the deletion of segments GC freed and the sealing of segments the
    appenders leave behind all go through the store's SegmentStorage."""
    monkeypatch.setattr(cnrstore.knobs, "SEGMENT_BYTES", 2048)  # several segments: appenders roll over
    path = str(tmp_path / "s")
    cnrstore.open(path, create=True).close()
    recorder = RecordingStorage(path)
    store = Store(path, create=False, readonly=False, filesystem=fs.DEFAULT, storage=recorder)
    store.create_table("t", 256, 4, codec="fp32", block_rows=64)
    for v in range(4):
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(256) if v == 0 else np.arange(v, 256, 7), np.full((256 if v == 0 else len(range(v, 256, 7)), 4), v, np.float32))
    assert any(c[0] == "sealed" for c in recorder.calls), "rolled-over segments were announced as sealed"
    sealed = {c[1] for c in recorder.calls if c[0] == "sealed"}
    with store.engine.read() as view:
        assert sealed <= set(view.segments()), "only committed segments are sealed"
    recorder.calls.clear()
    assert store.read_table("t")[3, 0] == 3.0
    assert any(c[0] == "read" for c in recorder.calls)
    store.retain(keep_last=1)
    report = store.gc()
    removed = [c[1] for c in recorder.calls if c[0] == "remove"]
    assert report.segments_deleted == len(removed) > 0
    assert not any(os.path.exists(cnrstore.engine.filenames.segment_path(path, s)) for s in removed)
    assert store.verify().ok
    store.close()


class TieredStorage(storage.SegmentStorage):
    """What an object store for sealed segments would do: ``sealed`` uploads the segment (here: into a
    dict) and deletes the local file; reads, sizes and removals of sealed segments are served from the
    upload, those of the active segments from the local files."""

    supports_appends = True  # (appends go to local files, as the seam's docstring says)

    def __init__(self, root):
        self.local = storage.LocalSegmentStorage(root)
        self.remote: dict[int, np.ndarray] = {}

    def appender(self, committed, format_version, ids, **kwargs):
        return self.local.appender(committed, format_version, ids, **kwargs)

    def recover(self, committed, doomed=(), **kwargs):
        return self.local.recover(committed, doomed, **kwargs)

    def read(self, seg, offset, length):
        if seg in self.remote:
            data = self.remote[seg]
            if offset + length > len(data):
                raise cnrstore.CorruptionError(f"segment {seg} is shorter", self.path(seg), offset)
            return data[offset:offset + length]
        return self.local.read(seg, offset, length)

    def path(self, seg):
        return f"object://segments/{seg}" if seg in self.remote else self.local.path(seg)

    def size(self, seg):
        return len(self.remote[seg]) if seg in self.remote else self.local.size(seg)

    def list(self):
        return sorted(set(self.remote) | set(self.local.list()))

    def remove(self, seg):
        if self.remote.pop(seg, None) is None:
            self.local.remove(seg)

    def sealed(self, seg):
        with open(self.local.path(seg), "rb") as f:
            data = np.frombuffer(f.read(), np.uint8)
        data.flags.writeable = False
        self.remote[seg] = data
        self.local.forget(seg)
        os.remove(self.local.path(seg))  # the segment now lives only in the object store

    def forget(self, seg):
        self.local.forget(seg)

    def close(self):
        self.local.close()


def test_sealed_segments_moved_to_another_storage_are_read_verified_and_freed_there(tmp_path, monkeypatch):
    """A storage that moves every sealed segment off the local disk (an object store): reads of every
    version, merges of new deltas, verify, retain and gc all work, since the engine touches segments only
    through the seam (verify once sized segments by their local files and reported them missing)."""
    monkeypatch.setattr(cnrstore.knobs, "SEGMENT_BYTES", 2048)
    path = str(tmp_path / "s")
    cnrstore.open(path, create=True).close()
    tiered = TieredStorage(path)
    store = Store(path, create=False, readonly=False, filesystem=fs.DEFAULT, storage=tiered)
    store.create_table("t", 256, 4, codec="fp32", block_rows=64)
    expected = np.zeros((256, 4), np.float32)
    snapshots = {}
    for v in range(6):
        rows = np.arange(256) if v == 0 else np.arange(v, 256, 5)
        expected[rows] = v + 1
        with store.checkpoint() as ck:
            ck.put_rows("t", rows, np.full((len(rows), 4), v + 1, np.float32))
        snapshots[store.latest().version] = expected.copy()
    assert tiered.remote, "segments were sealed and moved"
    assert not any(os.path.exists(cnrstore.engine.filenames.segment_path(path, s)) for s in tiered.remote)
    for version, table in snapshots.items():
        np.testing.assert_array_equal(store.read_table("t", version), table)
    report = store.verify()
    assert report.ok, report.problems
    newest = max(snapshots)
    store.retain(keep_last=1)
    sealed_before = set(tiered.remote)
    report = store.gc()
    assert report.segments_deleted > 0 and sealed_before - set(tiered.remote), "gc freed uploaded segments"
    np.testing.assert_array_equal(store.read_table("t"), snapshots[newest])
    assert store.verify().ok
    store.close()


# -- every segment file access goes through the storage seam ----------------------------------------------
_AUDIT: dict = {"root": None, "events": [], "outside": []}
_SEAM_FILES = ("cnrstore/engine/storage.py", "cnrstore/engine/segments.py")  # the local storage and its files
_PATH_EVENTS = {"open": 0, "os.listdir": 0, "os.scandir": 0, "os.rename": 0, "os.remove": 0, "os.truncate": 0,
                "os.rmdir": 0, "os.mkdir": 0, "os.chmod": 0, "os.utime": 0, "shutil.rmtree": 0}


def _audit(event, args):
    seg_dir = _AUDIT["root"]
    if seg_dir is None or event not in _PATH_EVENTS or not args:
        return
    path = args[_PATH_EVENTS[event]]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    path = os.path.abspath(os.fsdecode(path))
    if path != seg_dir and not path.startswith(seg_dir + os.sep):
        return
    _AUDIT["events"].append(event)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.replace(os.sep, "/").endswith(_SEAM_FILES):
            return
        frame = frame.f_back
    stack = [f"{f.filename.rsplit('/', 2)[-2:]}:{f.lineno}" for f in traceback.extract_stack()[-8:-1]]
    _AUDIT["outside"].append((event, path, stack))



@contextlib.contextmanager
def _audited(path):
    if not _AUDIT.get("installed"):  # (an audit hook cannot be removed: installed once, by the test that needs it)
        sys.addaudithook(_audit)
        _AUDIT["installed"] = True
    _AUDIT["root"] = os.path.abspath(cnrstore.engine.filenames.segments_dir(path))
    try:
        yield
    finally:
        _AUDIT["root"] = None


def _segment_ids(path):
    return sorted(s for s in map(cnrstore.engine.filenames.parse_segment_name, os.listdir(
        cnrstore.engine.filenames.segments_dir(path))) if s is not None)


def test_every_segment_file_access_goes_through_the_storage_seam(tmp_path, monkeypatch):
    """An audit hook sees every open, listing, rename, removal and truncation of the interpreter: in a
    workload of checkpoints, reads, retain, gc (freeing and cleaning), compact, verify, stats, a reopen
    after a torn write, and repair of a segment with a damaged header, every one under segments/ comes
    from the storage seam (storage.py and the local segment files of segments.py) — none from the
    engine, GC, verify, the Store or repair (issue 22)."""
    monkeypatch.setattr(cnrstore.knobs, "SEGMENT_BYTES", 2048)
    path = str(tmp_path / "s")
    _AUDIT.update(events=[], outside=[])
    with _audited(path):
        cnrstore.open(path, create=True).close()
        with cnrstore.open(path) as store:
            store.create_table("t", 256, 4, codec="fp32", block_rows=64)
            for v in range(6):
                rows = np.arange(256) if v in (0, 3) else np.arange(v, 256, 5)
                with store.checkpoint() as ck:
                    ck.put_rows("t", rows, np.full((len(rows), 4), v, np.float32))
            store.read_table("t", version=2)
            store.retain(keep_last=2)
            store.gc()
            store.compact()
            store.gc()
            assert store.verify().ok
            store.stats()
    with open(cnrstore.engine.filenames.segment_path(path, _segment_ids(path)[-1]), "ab") as f:
        f.write(b"torn tail")
    with _audited(path):
        with cnrstore.open(path) as store:  # recovery truncates the torn tail
            assert store.recovery_notes
    with open(cnrstore.engine.filenames.segment_path(path, _segment_ids(path)[0]), "r+b") as f:
        f.write(b"X")  # a damaged header: repair sets the segment aside
    with _audited(path):
        report = cnrstore.repair(path)
    assert any("damaged header" in n for n in report.notes), report.notes
    assert {"os.rename", "os.listdir", "open", "os.remove", "os.truncate"} <= set(_AUDIT["events"]), _AUDIT["events"]
    assert not _AUDIT["outside"], _AUDIT["outside"][:5]


def test_old_module_paths_name_the_moved_modules():
    """Code written against the flat layout keeps working: each old path is the moved module itself (so a
    monkeypatch through either path patches the one the engine uses), imported on first use;
    ``cnrstore.repair`` is the function, whatever was imported."""
    import importlib

    assert len(cnrstore.MOVED_MODULES) == 22
    for old, new in cnrstore.MOVED_MODULES.items():
        moved = importlib.import_module(f"cnrstore.{new}")
        assert importlib.import_module(f"cnrstore.{old}") is moved, old
        assert getattr(cnrstore, old) is moved, old
        assert moved.__name__ == f"cnrstore.{new}" and moved.__spec__.name == f"cnrstore.{new}", old
        assert not os.path.exists(os.path.join(PACKAGE, old + ".py")), f"{old}.py is still in cnrstore/"
    import cnrstore.reader as old_path
    assert old_path is importlib.import_module("cnrstore.engine.reader")
    from cnrstore.maintenance.repair import repair
    assert cnrstore.repair is repair
    importlib.import_module("cnrstore.maintenance.repair")
    assert cnrstore.repair is repair
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("cnrstore.no_such_module")
    with pytest.raises(AttributeError, match="no_such_name"):
        cnrstore.no_such_name  # noqa: B018
    from cnrstore import verify
    assert verify.verify_store.__module__ == "cnrstore.maintenance.verify"


def test_importing_cnrstore_imports_no_moved_module_under_its_old_path():
    """The old paths cost nothing until used: a fresh ``import cnrstore`` registers none of them."""
    code = ("import sys, cnrstore; print(sorted(m for m in sys.modules if m.split('.')[-1] in "
            "cnrstore.MOVED_MODULES and m.count('.') == 1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
