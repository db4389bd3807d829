"""Store files that are not regular files (docs/DESIGN.md "Security", "Failure modes"): one named test per
shape, leveldb-style -- each file a store (or a distributed root, or an import) reads, replaced by a FIFO, a
symbolic link to /dev/zero, a symbolic link to a regular file outside the store (a copy of the right file:
a link is never followed out of the store, whatever it points at), or a directory; each directory of a
store or root replaced by a FIFO, a link to /dev/zero or a link to a copy outside.

Before, a FIFO made `ls`, `info`, `verify` and `export` block for ever in ``open()``, and a link to
/dev/zero made them read without end (MemoryError under a 2 GiB limit); a writable open truncated (and
wrote its pid into) whatever file a LOCK link named. Now every operation finishes: the command exits 2
with one line on stderr naming the file (`verify`: exit 1, the problem naming it), the Python API raises a
CnrError naming it, operations that never read the file still work, and `repair` rebuilds a damaged index
or sets such a segment aside. `cnrstore import` of a FIFO, a link to /dev/zero, or a DCP directory holding
one (or whose .metadata names a data file outside it) is InvalidArgument naming the file.

Every operation runs in a subprocess (tests/support/special_files_worker.py) under a 2 GiB address-space limit and
a wall-clock limit, so a regression hangs or fails one worker, not the test run. One worker per shape runs
every operation on every target (each in its own copy of one store built per module) and reports JSON;
the parametrized tests below only read its report. The helpers themselves (fs.py) are tested last.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import filenames

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "support", "special_files_worker.py")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
ADDRESS_SPACE = 2 << 30
WORKER_TIMEOUT_S = 120  # a batch of ~70 operations (~1 s in all); each is also stopped after 10 s (worker)

FILE_SHAPES = ["fifo", "dev_zero", "outside_link", "directory"]
DIR_SHAPES = ["fifo", "dev_zero", "outside_link"]

# -- a store: its files, and which operations read each ----------------------------------------------------
STORE_OPS = ["ls", "info", "verify", "export", "api_read", "api_verify", "gc", "api_open_writable", "repair"]
EVERY_OP = set(STORE_OPS)
#: What `cnrstore repair` (run last) does: refuses a store whose marker, REMOTE, LOCK or segments/ is not
#: what it must be, exit 2; rebuilds the index when the index is the damage (exit 0), and sets a segment
#: that is not a regular file aside (exit 1: the versions that read it are damaged), naming it.
REPAIRED = {"data.mdb", "lock.mdb", "index_dir", "segment"}
#: target -> (path in the store, whether it is a directory, the operations that read it: they must fail;
#: the others must succeed)
STORE_TARGETS = {
    "marker": (filenames.MARKER, False, EVERY_OP),
    "remote": (filenames.REMOTE, False, EVERY_OP),  # read at every open (is the store kept remotely?)
    "data.mdb": ("index/data.mdb", False, EVERY_OP),
    "lock.mdb": ("index/lock.mdb", False, EVERY_OP),
    "LOCK": (filenames.LOCK, False, {"gc", "api_open_writable", "repair"}),  # a writer's only
    "segment": ("segments/SEG", False, EVERY_OP - {"ls", "info"}),  # ls and info read only the index
    "index_dir": (filenames.INDEX_DIR, True, EVERY_OP),
    "segments_dir": (filenames.SEGMENTS_DIR, True, EVERY_OP),
}

# -- a distributed root ------------------------------------------------------------------------------------
ROOT_OPS = ["ls", "verify", "api_read", "api_verify"]
ROOT_TARGETS = {
    "dist_marker": ("CNRSTORE-DIST", False, {"verify", "api_read", "api_verify"}),
    "plan": ("gen-000001/PLAN", False, {"api_read"}),
    "manifest": ("global/g-000000000001.cnrg", False, set(ROOT_OPS)),
    "global_dir": ("global", True, set(ROOT_OPS)),
    "gen_dir": ("gen-000001", True, {"verify", "api_read", "api_verify"}),
    "rank_dir": ("gen-000001/rank-00000", True, {"verify", "api_read", "api_verify"}),
}


def _run_worker(jobs: list[dict], tmp) -> dict:
    """Run ``jobs`` in one worker process: ``{key: {op: outcome}}``. An operation the worker never reported
    (it was killed at the time limit, or died) is ``{"hung": true, "why": ...}``."""
    jobs_path, out_path = tmp / "jobs.json", tmp / "results.jsonl"
    jobs_path.write_text(json.dumps(jobs))
    try:
        proc = subprocess.run([sys.executable, WORKER, str(jobs_path), str(out_path), str(ADDRESS_SPACE)],
                              capture_output=True, text=True, env=ENV, timeout=WORKER_TIMEOUT_S)
        why = f"the worker exited {proc.returncode}: {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        why = f"the worker ran past {WORKER_TIMEOUT_S} s"
    report: dict = {job["key"]: {op: {"hung": True, "why": why} for op in job["ops"]} for job in jobs}
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            if line.strip():
                got = json.loads(line)
                report[got["key"]][got["op"]] = got["outcome"]
    return report


def _make_store(path: str) -> str:
    """A store with one table written at one version; returns its segment's file name."""
    with cnrstore.open(path, create=True) as s:
        s.create_table("t", num_rows=100, dim=4, codec="fp32")
        with s.checkpoint(step=1) as w:
            w.put_rows("t", np.arange(100), np.ones((100, 4), np.float32))
    return sorted(os.listdir(filenames.segments_dir(path)))[0]


def _make_root(path: str) -> None:
    """A distributed root with one generation (a one-rank plan), its rank store and one global version."""
    from cnrstore.distributed import GlobalVersion, Root, ShardingPlan

    plan = ShardingPlan.row_wise({"t": (100, 4)}, 1)
    root = Root(path)
    root.create()
    gen = root.generation_for(plan)
    rel = root.store_rel(gen, 0)
    _make_store(root.store_path(rel))
    root.commit(GlobalVersion(version=1, step=1, meta=None, created=1.0, generation=gen, plan=plan,
                              local_versions=(1,), stores=(rel,)))


def _replace(path: str, shape: str, outside: str) -> None:
    """Put ``shape`` where ``path`` is (or would be): a FIFO, a link to /dev/zero, a directory, or a link to
    a copy of the original in the directory ``outside`` (for a file with no bytes to copy -- LOCK -- a file
    of someone else's, which nothing may change; for REMOTE, which this store lacks, a valid identity)."""
    is_dir = os.path.isdir(path) and not os.path.islink(path)
    copy = os.path.join(outside, os.path.basename(path))
    if shape == "outside_link":
        if is_dir:
            shutil.copytree(path, copy, symlinks=True)
        elif not os.path.exists(path):
            with open(copy, "w") as f:
                json.dump({"url": "s3://bucket/prefix", "store_id": "0" * 16, "after": None}, f)
        elif os.path.getsize(path):
            shutil.copyfile(path, copy)
        else:
            with open(copy, "w") as f:
                f.write("someone else's file\n")
    if is_dir:
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    if shape == "fifo":
        os.mkfifo(path)
    elif shape == "dev_zero":
        os.symlink("/dev/zero", path)
    elif shape == "outside_link":
        os.symlink(copy, path)
    else:
        os.mkdir(path)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    base = tmp_path_factory.mktemp("templates")
    store, root = str(base / "store"), str(base / "root")
    seg = _make_store(store)
    _make_root(root)
    return store, seg, root


@pytest.fixture(scope="module")
def reports(templates, tmp_path_factory):
    """``get(shape)``: (the worker's report of every store and root target in that shape, target -> the path
    replaced); each shape's worker runs once, on first use."""
    store, seg, root = templates
    cache: dict = {}

    def get(shape: str) -> tuple[dict, dict]:
        if shape not in cache:
            tmp = tmp_path_factory.mktemp(f"shape-{shape}")
            jobs, replaced = [], {}
            for kind, targets, template, ops in (("store", STORE_TARGETS, store, STORE_OPS),
                                                 ("root", ROOT_TARGETS, root, ROOT_OPS)):
                for name, (rel, is_dir, _reads) in targets.items():
                    if shape not in (DIR_SHAPES if is_dir else FILE_SHAPES):
                        continue
                    work = tmp / name
                    outside = work / "outside"
                    os.makedirs(outside)
                    path = str(work / kind)
                    shutil.copytree(template, path, symlinks=True)
                    replaced[name] = os.path.join(path, rel.replace("SEG", seg))
                    _replace(replaced[name], shape, str(outside))
                    jobs.append({"key": name, "kind": kind, "path": path, "ops": ops, "out": str(work)})
            cache[shape] = (_run_worker(jobs, tmp), replaced)
        return cache[shape]

    return get


def _check(reports, shape: str, target: str) -> None:
    """Every operation on ``target`` in ``shape`` finished; those that read it failed, typed, naming it (a
    command: exit 2 and one line on stderr; verify: exit 1 and the problem; the API: a CnrError, or a
    verify report listing it); the others worked."""
    report, replaced = reports(shape)
    _rel, _is_dir, reads = {**STORE_TARGETS, **ROOT_TARGETS}[target]
    named = replaced[target]
    for op, got in report[target].items():
        where = f"{target} as {shape}: {op}: {got}"
        assert not got.get("hung"), f"{where}: did not finish within the worker's limit"
        assert got.get("raised") not in ("MemoryError", "RecursionError"), where
        if op not in reads:
            assert got.get("rc", 0) == 0 and got.get("raised") is None, where
            continue
        if op == "repair" and target in REPAIRED:
            assert got["rc"] == (1 if target == "segment" else 0), where
            if target == "segment":
                assert f"segment {named} is " in got["stdout"] and "renamed to" in got["stdout"], where
            continue
        if "rc" in got:  # a command
            if op == "verify" and got["rc"] == 1:  # verify reports damage (exit 1), naming the file
                assert named in got["stdout"], where
                continue
            assert got["rc"] == 2, where
            lines = got["stderr"].strip().splitlines()
            assert len(lines) == 1 and named in lines[0], where
        elif got["raised"] is None:  # an API verify reports, not raises
            assert op == "api_verify" and not got["value"]["ok"], where
            assert any(named in p for p in got["value"]["problems"]), where
        else:
            assert got["cnr"] and named in got["message"], where


STORE_FILES = [t for t, (_r, is_dir, _o) in STORE_TARGETS.items() if not is_dir]
STORE_DIRS = [t for t, (_r, is_dir, _o) in STORE_TARGETS.items() if is_dir]
ROOT_FILES = [t for t, (_r, is_dir, _o) in ROOT_TARGETS.items() if not is_dir]
ROOT_DIRS = [t for t, (_r, is_dir, _o) in ROOT_TARGETS.items() if is_dir]


@pytest.mark.parametrize("target", STORE_FILES)
def test_store_file_replaced_by_a_fifo_is_refused_without_blocking(reports, target):
    _check(reports, "fifo", target)


@pytest.mark.parametrize("target", STORE_FILES)
def test_store_file_replaced_by_a_link_to_dev_zero_is_refused_without_reading(reports, target):
    _check(reports, "dev_zero", target)


@pytest.mark.parametrize("target", STORE_FILES)
def test_store_file_replaced_by_a_link_to_a_copy_outside_is_not_followed(reports, target):
    _check(reports, "outside_link", target)


@pytest.mark.parametrize("target", STORE_FILES)
def test_store_file_replaced_by_a_directory_is_refused(reports, target):
    _check(reports, "directory", target)


@pytest.mark.parametrize("shape", DIR_SHAPES)
@pytest.mark.parametrize("target", STORE_DIRS)
def test_store_directory_replaced_by_a_fifo_or_a_link_is_refused(reports, target, shape):
    _check(reports, shape, target)


@pytest.mark.parametrize("shape", FILE_SHAPES)
@pytest.mark.parametrize("target", ROOT_FILES)
def test_root_file_that_is_not_a_regular_file_is_refused(reports, target, shape):
    _check(reports, shape, target)


@pytest.mark.parametrize("shape", DIR_SHAPES)
@pytest.mark.parametrize("target", ROOT_DIRS)
def test_root_directory_replaced_by_a_fifo_or_a_link_is_refused(reports, target, shape):
    _check(reports, shape, target)


def test_a_lock_file_or_segment_linked_outside_is_never_truncated_or_written(reports, templates):
    """A writable open used to truncate LOCK and write its pid there, through a link: into any file the
    store's author chose. The copy outside keeps its bytes."""
    report, replaced = reports("outside_link")
    assert report["LOCK"]["gc"]["rc"] == 2
    def outside(target):  # where _replace put the copy the link points at
        return os.path.join(replaced[target].split(f"/{target}/")[0], target, "outside",
                            os.path.basename(replaced[target]))

    assert open(outside("LOCK")).read() == "someone else's file\n"  # never truncated, no pid written
    # recovery (a writable open) truncates nothing through a link either, and repair renames the link aside
    assert open(outside("segment"), "rb").read() == open(os.path.join(templates[0], "segments", templates[1]),
                                                         "rb").read()


# -- import sources ----------------------------------------------------------------------------------------
IMPORT_OPS = ["import", "api_import"]
#: source -> the file the refusal must name (relative to the source), or None: the import succeeds
IMPORT_SOURCES = {
    "fifo": ("model.pt", "model.pt"),
    "dev_zero_link": ("model.pt", "model.pt"),
    "dcp_metadata_fifo": ("dcp", "dcp/.metadata"),
    "dcp_metadata_dev_zero_link": ("dcp", "dcp/.metadata"),
    "dcp_data_file_fifo": ("dcp", "dcp/__0_0.distcp"),
    "dcp_data_file_dev_zero_link": ("dcp", "dcp/__0_0.distcp"),
    "dcp_data_file_outside_it": ("dcp", "dcp/../outside.distcp"),  # a crafted .metadata names ../outside.distcp
    "link_to_a_checkpoint_file": ("model.pt", None),  # a source the user names may be a link to a file
}


def _point_metadata_outside(dcp_dir) -> None:
    """Rewrite a DCP directory's .metadata so that its data file is ``../outside.distcp`` (a real copy of it:
    DCP's own reader would import it), as a crafted checkpoint could name any file of the reader's."""
    import pickle

    meta_path = os.path.join(dcp_dir, ".metadata")
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = os.path.join("..", "outside.distcp")
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    shutil.move(os.path.join(dcp_dir, "__0_0.distcp"), os.path.join(os.path.dirname(dcp_dir), "outside.distcp"))


@pytest.fixture(scope="module")
def import_report(tmp_path_factory):
    import torch
    import torch.distributed.checkpoint as dcp

    tmp = tmp_path_factory.mktemp("imports")
    state = {"emb.weight": torch.ones(10, 4), "lin.weight": torch.ones(2, 4)}
    good = tmp / "good.pt"
    torch.save(state, good)
    jobs, where = [], {}
    for name, (source, refused) in IMPORT_SOURCES.items():
        work = tmp / name
        os.makedirs(work)
        src = work / source
        if source == "dcp":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(state, checkpoint_id=str(src), no_dist=True)
        if name == "link_to_a_checkpoint_file":
            os.symlink(good, src)
        elif name == "dcp_data_file_outside_it":
            _point_metadata_outside(str(src))
        elif refused is not None:
            _replace(str(work / refused), "fifo" if name.endswith("fifo") else "dev_zero", str(work))
        where[name] = (str(src), None if refused is None else str(work / refused), str(work / "store"))
        jobs.append({"key": name, "kind": "import", "path": str(work / "store"), "source": str(src),
                     "ops": IMPORT_OPS})
    return _run_worker(jobs, tmp), where


@pytest.mark.parametrize("source", IMPORT_SOURCES)
def test_import_of_a_source_that_is_not_a_regular_file_is_an_invalid_argument(import_report, source):
    """`cnrstore import` of a FIFO blocked for ever; of a link to /dev/zero, read without end; of a DCP
    directory holding either, likewise. Now: InvalidArgument naming the file, nothing created; a link to a
    regular checkpoint file is still read (the user named it)."""
    report, where = import_report
    _src, refused, store = where[source]
    for op, got in report[source].items():
        desc = f"{source}: {op}: {got}"
        assert not got.get("hung") and got.get("raised") != "MemoryError", desc
        if refused is None:
            assert got.get("rc", 0) == 0 and got.get("raised") is None, desc
            continue
        if "rc" in got:
            lines = got["stderr"].strip().splitlines()
            assert got["rc"] == 2 and len(lines) == 1 and refused in lines[0] and "InvalidArgument" in lines[0], desc
            assert not os.path.exists(store), desc  # the store the import would have created is not left
        else:
            assert got["raised"] == "InvalidArgument" and refused in got["message"], desc


# -- the helpers (cnrstore/engine/fs.py), and the writes of a store's scratch files ------------------------
@pytest.fixture
def alarm():
    """Fail, rather than hang the run, if the test blocks (an open() of a FIFO is interrupted by SIGALRM)."""
    import signal

    def hung(signum, frame):
        raise AssertionError("blocked: a FIFO was waited on")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


def test_read_regular_refuses_a_file_larger_than_its_bound_never_cutting_it_short(tmp_path):
    from cnrstore.engine import fs

    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert fs.read_regular(str(path), 100, "test file") == b"x" * 100
    with pytest.raises(cnrstore.CorruptionError, match=r"test file .*/f holds 100 bytes, more than any test file can \(99\)"):
        fs.read_regular(str(path), 99, "test file")
    with pytest.raises(FileNotFoundError):  # missing stays missing: callers' StoreNotFound
        fs.read_regular(str(tmp_path / "missing"), 1, "test file")


def test_open_regular_refuses_a_socket_and_follows_a_link_only_when_asked(tmp_path, alarm):
    import socket

    from cnrstore.engine import fs

    sock_path = str(tmp_path / "sock")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(sock_path)
        with pytest.raises(cnrstore.InvalidArgument, match="is a socket, not a regular file; fix it"):
            fs.open_regular(sock_path, "source", "fix it", error=cnrstore.InvalidArgument)
    target = tmp_path / "target"
    target.write_bytes(b"data")
    link = str(tmp_path / "link")
    os.symlink(target, link)
    with pytest.raises(cnrstore.CorruptionError, match=r"is a symbolic link \(to '.*target'\), not a regular file"):
        fs.open_regular(link, "store file")
    fd = fs.open_regular(link, "source", follow_symlinks=True, error=cnrstore.InvalidArgument)
    try:
        assert os.read(fd, 10) == b"data" and os.get_blocking(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("leftover", ["link_outside", "fifo"])
def test_an_atomic_write_never_writes_through_or_waits_on_what_lies_at_its_temporary_path(tmp_path, alarm,
                                                                                          leftover):
    """The marker's, REMOTE's, a plan's or manifest's temporary file (CNRSTORE.tmp, ...) was opened with
    O_TRUNC: a link there made the write truncate and fill its target, a FIFO there blocked it."""
    from cnrstore.engine import fs

    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    path, tmp = str(tmp_path / "CNRSTORE"), str(tmp_path / "CNRSTORE.tmp")
    if leftover == "fifo":
        os.mkfifo(tmp)
    else:
        os.symlink(victim, tmp)
    fs.DEFAULT.write_file_atomic(path, tmp, b"marker")
    assert open(path, "rb").read() == b"marker" and not os.path.lexists(tmp)
    assert victim.read_text() == "someone else's file\n"


def test_a_scratch_directory_that_is_a_link_is_removed_not_its_target(tmp_path):
    """repair rebuilds in index.repair-tmp/ after removing it: a link there made its removal fail silently
    and its rebuild fail (or write into the link's target)."""
    from cnrstore.engine import fs

    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    os.symlink(target, tmp_path / "index.repair-tmp")
    fs.DEFAULT.remove_tree(str(tmp_path / "index.repair-tmp"))
    assert not os.path.lexists(tmp_path / "index.repair-tmp") and (target / "keep").exists()
