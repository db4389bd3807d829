"""The crash-state explorer: crash states enumerated, not sampled (leveldb's fault_injection_test; ALICE,
OSDI'14; CrashMonkey, OSDI'18).

1. **Record.** A workload runs against a real store through ``RecordingFileSystem``, the engine's
   file-system seam (cnrstore/engine/fs.py): every create, append, fsync, directory fsync, truncate, remove,
   rename, mkdir, directory removal and atomic replace is logged in order with its bytes, and each LMDB
   commit (the ``index_committed`` pause point, with the environment's path: the store's index/, or the
   one repair builds in index.repair-tmp/) as one atomic step with a copy of its ``data.mdb`` as committed
   (LMDB writes its meta page last: a commit is all or nothing, and durable when it returns). The
   workload also logs where each operation starts and ends, with the versions that must be listed
   before and after it and the content every version must read.
2. **Rebuild.** For every prefix of that log, ``FileModel`` gives the files a crash right there leaves:
   - ``kill``: the process died (SIGKILL): everything written reached the page cache and survives;
   - ``power``: the machine lost power: a file holds only what its last fsync made durable, a
     created, removed or renamed directory entry counts only once its directory was fsynced;
   - ``torn``: power lost in the middle of the last unsynced append: the first half of it survives.
   Identical states are checked once.
3. **Check** (``check_state``). The state is opened for writing (recovery runs), then: the versions
   listed are those before the operation in flight or those after it; every listed version reads back
   bit for bit; ``verify()`` is clean; and a new checkpoint commits and reads back.

tests/test_crash_states.py runs named workloads in ``make test``, and an opt-in deep sweep (``--runslow``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from cnrstore.engine import filenames, fs, remote
from cnrstore.engine.remote import ObjectStore
from cnrstore.errors import RemoteObjectMissing, StoreNotFound
from cnrstore.maintenance.repair import repair
from cnrstore.store import Store


# -- 1. record ---------------------------------------------------------------------------------------------

@dataclass
class Effect:
    # create | write | fsync | fsync_dir | truncate | remove | replace | rename | mkdir | rmtree | index
    # | op_start | op_end
    kind: str
    path: str = ""
    offset: int = 0
    data: bytes = b""
    versions: frozenset = frozenset()  # op_start / op_end: the versions listed then
    name: str = ""  # op_start: the operation; rename: the new path


class RecordingFileSystem(fs.FileSystem):
    """The real file system, logging every effect (with its bytes) in order. Paths are kept relative to
    the store's root, so that a crash state can be rebuilt anywhere."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.effects: list[Effect] = []
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()

    def _rel(self, path: str) -> str:
        return os.path.relpath(os.path.abspath(path), self.root)

    def _log(self, effect: Effect) -> None:
        with self._lock:
            self.effects.append(effect)

    def open_append(self, path: str, *, create: bool) -> int:
        fd = super().open_append(path, create=create)
        self._paths[fd] = self._rel(path)
        if create:
            self._log(Effect("create", self._paths[fd]))
        return fd

    def pwritev(self, fd: int, buffers: list, offset: int) -> int:
        n = super().pwritev(fd, buffers, offset)
        if fd in self._paths:  # (not the temporary file of write_file_atomic: logged as one replace)
            data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
            self._log(Effect("write", self._paths[fd], offset, data))
        return n

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        if fd in self._paths:
            self._log(Effect("fsync", self._paths[fd]))

    def fsync_dir(self, path: str) -> None:
        super().fsync_dir(path)
        self._log(Effect("fsync_dir", self._rel(path)))

    def truncate(self, path: str, length: int) -> None:
        super().truncate(path, length)
        self._log(Effect("truncate", self._rel(path), length))

    def close(self, fd: int) -> None:
        super().close(fd)
        self._paths.pop(fd, None)

    def write_file_atomic(self, path: str, tmp_path: str, data: bytes) -> None:
        super().write_file_atomic(path, tmp_path, data)  # fsyncs the file, renames, fsyncs the directory
        self._log(Effect("replace", self._rel(path), 0, bytes(data)))

    def remove(self, path: str) -> None:
        super().remove(path)
        self._log(Effect("remove", self._rel(path)))

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self._log(Effect("rename", self._rel(src), name=self._rel(dst)))

    def mkdir(self, path: str) -> None:
        super().mkdir(path)
        self._log(Effect("mkdir", self._rel(path)))

    def remove_tree(self, path: str) -> None:
        super().remove_tree(path)
        self._log(Effect("rmtree", self._rel(path)))

    def index_committed(self, _name: str, env_path: str) -> None:
        """An LMDB commit of the environment at ``env_path`` (the store's index/, or the one repair
        builds in index.repair-tmp/): its data.mdb as committed, one atomic and durable step."""
        if os.path.relpath(os.path.abspath(env_path), self.root).startswith(".."):
            return  # an environment outside this store
        with open(os.path.join(env_path, "data.mdb"), "rb") as f:
            self._log(Effect("index", os.path.join(self._rel(env_path), "data.mdb"), data=f.read()))

    def record(self, effect: Effect) -> None:
        """Log an effect made outside the file system (an object-store put or delete: ``RecordingObjectStore``)."""
        self._log(effect)

    def op_start(self, name: str, versions) -> None:
        self._log(Effect("op_start", name=name, versions=frozenset(versions)))

    def op_end(self, versions) -> None:
        self._log(Effect("op_end", versions=frozenset(versions)))

    def __enter__(self) -> "RecordingFileSystem":
        fs.pause_at("index_committed", self.index_committed)
        return self

    def __exit__(self, *exc) -> None:
        fs.pause_at("index_committed", None)


# -- 2. rebuild --------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _File:
    current: bytearray
    durable: bytearray


@dataclass(eq=False)
class _Dir:
    """A directory: its entries as the running process sees them, and as they survive a power loss
    (as of its last fsync). An entry maps a name to a ``_File`` or ``_Dir`` (an inode: a renamed
    directory takes its contents along)."""

    current: dict = field(default_factory=dict)
    durable: dict = field(default_factory=dict)


class FileModel:
    """The store's files after a prefix of the effect log: what the process saw and what is durable.

    A tree of inodes: a file holds its current and its durable bytes; a directory its current and its
    durable entries. A created, removed or renamed entry survives a power loss only once its directory
    was fsynced; an LMDB commit (``index``) is durable when it returns."""

    def __init__(self):
        self.root = _Dir()
        self.last_write: _File | None = None  # the file of the newest write, while that write is unsynced

    @classmethod
    def of_directory(cls, root: str) -> "FileModel":
        """The model of a store at rest (everything durable): the state before the recorded workload."""
        model = cls()
        for dirpath, dirs, names in os.walk(root):
            rel = os.path.relpath(dirpath, root)
            for name in dirs:
                model._add(os.path.normpath(os.path.join(rel, name)), _Dir(), durable=True)
            for name in names:
                if name == "lock.mdb":
                    continue  # LMDB makes its lock file anew
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                model._add(os.path.normpath(os.path.join(rel, name)), _File(bytearray(data), bytearray(data)),
                           durable=True)
        return model

    def _parent(self, path: str) -> tuple[_Dir, str]:
        d = self.root
        head, name = os.path.split(path)
        for part in head.split(os.sep) if head else ():
            d = d.current[part]
        return d, name

    def _get(self, path: str):
        d, name = self._parent(path)
        return d.current[name]

    def _add(self, path: str, node, *, durable: bool = False) -> None:
        d, name = self._parent(path)
        d.current[name] = node
        if durable:
            d.durable[name] = node

    def apply(self, e: Effect) -> None:
        if e.kind == "create":
            self._add(e.path, _File(bytearray(), bytearray()))
        elif e.kind == "write":
            f = self._get(e.path)
            end = e.offset + len(e.data)
            if len(f.current) < end:
                f.current.extend(b"\0" * (end - len(f.current)))
            f.current[e.offset:end] = e.data
            self.last_write = f
        elif e.kind == "fsync":
            f = self._get(e.path)
            f.durable = bytearray(f.current)
            if self.last_write is f:
                self.last_write = None
        elif e.kind == "fsync_dir":
            d = self.root if e.path == "." else self._get(e.path)
            d.durable = dict(d.current)
        elif e.kind == "truncate":
            del self._get(e.path).current[e.offset:]
        elif e.kind in ("remove", "rmtree"):
            d, name = self._parent(e.path)
            d.current.pop(name, None)
        elif e.kind == "rename":
            d, name = self._parent(e.path)
            self._add(e.name, d.current.pop(name))
        elif e.kind == "mkdir":
            self._add(e.path, _Dir())
        elif e.kind == "replace":  # written, fsynced, renamed, its directory fsynced (all of its entries)
            self._add(e.path, _File(bytearray(e.data), bytearray(e.data)))
            d, _name = self._parent(e.path)
            d.durable = dict(d.current)
        elif e.kind == "index":  # committed and synced (the file made at the environment's creation if new)
            d, name = self._parent(e.path)
            f = d.current.get(name)
            if f is None:
                f = d.current[name] = _File(bytearray(), bytearray())
            f.current, f.durable = bytearray(e.data), bytearray(e.data)

    def state(self, variant: str) -> dict[str, bytes | None] | None:
        """{relative path: bytes, or None for a directory} of the crash state ``variant`` (kill, power,
        torn); None when ``torn`` does not apply (no unsynced append that would survive in part)."""
        out: dict[str, bytes | None] = {}
        torn: list = []

        def walk(d: _Dir, prefix: str) -> None:
            for name, node in (d.current if variant == "kill" else d.durable).items():
                path = os.path.join(prefix, name) if prefix else name
                if isinstance(node, _Dir):
                    out[path] = None
                    walk(node, path)
                elif variant == "kill":
                    out[path] = bytes(node.current)
                else:
                    out[path] = bytes(node.durable)
                    if variant == "torn" and node is self.last_write and len(node.current) > len(node.durable):
                        half = len(node.durable) + (len(node.current) - len(node.durable)) // 2
                        out[path] = bytes(node.current[:half])
                        torn.append(path)

        walk(self.root, "")
        if variant == "torn" and not torn:
            return None
        return out


def write_state(files: dict[str, bytes | None], root: str) -> None:
    os.makedirs(root, exist_ok=True)
    for rel in sorted(files):  # a directory before what it holds
        path = os.path.join(root, rel)
        if files[rel] is None:
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(files[rel])


def state_key(files: dict[str, bytes | None]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for rel in sorted(files):
        data = files[rel]
        h.update(rel.encode() + b"\0" + (b"dir" if data is None else hashlib.blake2b(data, digest_size=16).digest()))
    return h.digest()


# -- 3. check ----------------------------------------------------------------------------------------------

@dataclass
class Expectation:
    """What a crash state must show: one of ``allowed`` version sets, each version reading as ``content``."""

    allowed: tuple[frozenset, ...]
    content: dict[int, dict[str, np.ndarray]]
    #: With background retention the listed set changes between operations: then instead of ``allowed``,
    #: the newest ``keep_last`` versions of ``before`` must be listed (less those a version committed since pushed out
    #: of the newest ``keep_last``), and nothing unknown.
    keep_last: int | None = None
    before: frozenset = frozenset()  # the versions acknowledged before the operation in flight


def expectations(effects: list[Effect], content, initial=frozenset()) -> list[Expectation]:
    """The expectation after each prefix (0..len(effects)) of the log: the versions listed before the
    operation in flight, or those after it; once an operation has returned, only those after it."""
    ends: dict[int, frozenset] = {}  # index of an op_start -> the versions its op_end lists
    start = None
    for i, e in enumerate(effects):
        if e.kind == "op_start":
            start = i
        elif e.kind == "op_end":
            ends[start] = e.versions
    before = frozenset(initial)
    allowed = (before,)
    out = [Expectation(allowed, content, before=before)]
    for k, e in enumerate(effects, 1):
        if e.kind == "op_start":
            before = e.versions
            allowed = tuple({e.versions, ends.get(k - 1, e.versions)})
        elif e.kind == "op_end":
            before = e.versions
            allowed = (e.versions,)
        out.append(Expectation(allowed, content, before=before))
    return out


CheckNewWrite = Callable[[Store], None]


def _open_local(root: str) -> Store:
    return Store(root, create=False, readonly=False, filesystem=fs.DEFAULT)


def check_state(root: str, expect: Expectation, write_more: CheckNewWrite, opener=_open_local) -> None:
    """Open the crash state at ``root`` for writing (``opener(root)``) and check it (module docstring,
    step 3); raises AssertionError (or the store's error) naming what is wrong."""
    store = opener(root)
    try:
        listed = frozenset(v.version for v in store.versions())
        if expect.keep_last is None:
            assert listed in expect.allowed, (f"versions {sorted(listed)} listed; expected one of "
                                              f"{[sorted(a) for a in expect.allowed]} "
                                              f"(notes: {store.recovery_notes})")
        else:
            # the newest keep_last of what was acknowledged must be listed, except those that versions
            # committed since (by the operation in flight: listed, so durable) pushed out of the newest
            # keep_last: background retention may drop those as soon as the newer one commits
            newest = set(sorted(expect.before | (listed & set(expect.content)))[-expect.keep_last:])
            must = newest & set(expect.before)
            assert must <= listed <= set(expect.content), (
                f"versions {sorted(listed)} listed; the newest {sorted(must)} must be, and none unknown")
        _check_versions(store, listed, expect, "after recovery")
        write_more(store)  # a checkpoint and maintenance work on the recovered store ...
        _check_versions(store, listed, expect, "after a checkpoint, gc and compact on the recovered store")
    finally:
        store.close()
    with opener(root) as store:  # ... and survive a reopen
        _check_versions(store, listed, expect, "after reopening")


def check_repair_from_log(root: str, expect: Expectation) -> None:
    """The crash state at ``root`` with its index lost: ``repair`` rebuilds it from the segment log
    alone, and the store then lists the versions before the operation in flight or after it, each
    reading bit for bit as acknowledged, and verifies clean (repair's index never reads differently
    from the committed history)."""
    shutil.rmtree(filenames.index_dir(root), ignore_errors=True)
    report = repair(root)
    acknowledged = frozenset.intersection(*expect.allowed)  # (a version in flight may be reported lost)
    lost = acknowledged & set(report.versions_lost)
    assert not lost, f"repair lost versions {sorted(lost)}: {report.versions_lost} (notes: {report.notes[:3]})"
    with Store(root, create=False, readonly=True, filesystem=fs.DEFAULT) as store:
        listed = frozenset(v.version for v in store.versions())
        assert listed in expect.allowed, (f"repair from the log lists versions {sorted(listed)}; expected one of "
                                          f"{[sorted(a) for a in expect.allowed]}")
        _check_versions(store, listed, expect, "after repair from the log")


#: content keys with this prefix name a dense array (read_dense) rather than a table (read_table)
DENSE = "dense:"
#: content keys with this prefix name a keyed table; the content is a ``KeyedContent``
KEYED = "keyed:"


@dataclass
class KeyedContent:
    """What a keyed table reads at a version: every live key (ascending) with its value and columns, and
    keys that must be absent there (deleted ones, never-put ones)."""

    keys: np.ndarray
    values: np.ndarray
    columns: dict
    absent: np.ndarray


def _check_keyed(store: Store, name: str, v: int, want: KeyedContent, what: str) -> None:
    """read_keyed, keys, read_keys (live and absent keys) and a one-partition read_keyed at ``v``, exactly."""
    got = store.read_keyed(name, version=v)
    np.testing.assert_array_equal(got.keys, want.keys, err_msg=f"{what}: keys")
    np.testing.assert_array_equal(got.values, want.values, err_msg=f"{what}: values")
    assert sorted(got.columns) == sorted(want.columns), f"{what}: columns {sorted(got.columns)}"
    for col, arr in want.columns.items():
        np.testing.assert_array_equal(got.columns[col], arr, err_msg=f"{what}: column {col!r}")
    np.testing.assert_array_equal(store.keys(name, version=v), want.keys, err_msg=f"{what}: keys()")
    probe = np.concatenate([want.keys, want.absent])
    look = store.read_keys(name, probe, version=v)
    n = want.keys.size
    assert look.found[:n].all() and not look.found[n:].any(), (
        f"{what}: read_keys found {probe[~look.found[:n].nonzero()[0]][:5].tolist() if n else []} missing, "
        f"{probe[n:][look.found[n:]][:5].tolist()} present that must be absent")
    np.testing.assert_array_equal(look.values[:n], want.values, err_msg=f"{what}: read_keys values")
    assert not look.values[n:].any(), f"{what}: read_keys values of absent keys"
    for col, arr in want.columns.items():
        np.testing.assert_array_equal(look.columns[col][:n], arr, err_msg=f"{what}: read_keys column {col!r}")
    if n:  # the partition of the first key alone (what a rank owning it reads)
        part = store.partition_of(name, want.keys)
        own = part == part[0]
        mine = store.read_keyed(name, version=v, partitions=[int(part[0])])
        np.testing.assert_array_equal(mine.keys, want.keys[own], err_msg=f"{what}: one partition's keys")
        np.testing.assert_array_equal(mine.values, want.values[own], err_msg=f"{what}: one partition's values")


def _check_versions(store: Store, listed, expect: Expectation, when: str) -> None:
    for v in sorted(listed):
        for key, values in expect.content[v].items():
            if key.startswith(KEYED):
                _check_keyed(store, key[len(KEYED):], v, values, f"version {v} {key!r} {when}")
                continue
            got = (store.read_dense(key[len(DENSE):], version=v) if key.startswith(DENSE)
                   else store.read_table(key, version=v))
            np.testing.assert_array_equal(got, values, err_msg=f"version {v} {key!r} {when}")
    report = store.verify()
    assert report.ok, f"verify {when}: {report.problems[:3]}"


@dataclass
class Sweep:
    """What one exploration checked."""

    effects: int = 0
    states: int = 0  # distinct crash states opened and checked
    by_variant: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)


def explore(base: str, effects: list[Effect], content, workdir: str, write_more: CheckNewWrite, *,
            initial=frozenset(), variants=("kill", "power", "torn"), stride: int = 1,
            max_failures: int = 5, keep_last: int | None = None, repair_from_log: bool = False) -> Sweep:
    """Rebuild and check the crash state after every ``stride``-th prefix of ``effects`` (every prefix
    with 1), in each variant. ``base`` is a copy of the store before the workload. With
    ``repair_from_log`` each state is also checked with its index lost and repaired (a second copy)."""
    model = FileModel.of_directory(base)
    expect = expectations(effects, content, initial)
    for e in expect:
        e.keep_last = keep_last
    sweep = Sweep(effects=len(effects))
    seen: set = set()
    for k in range(len(effects) + 1):
        if k:
            model.apply(effects[k - 1])
        if k % stride and k != len(effects):
            continue

        def check(root: str, files, k=k) -> None:
            if repair_from_log:
                write_state(files, root + "-repaired")
                try:
                    check_repair_from_log(root + "-repaired", expect[k])
                finally:
                    shutil.rmtree(root + "-repaired", ignore_errors=True)
            check_state(root, expect[k], write_more)

        if not _check_prefix(sweep, seen, workdir, model, variants, effects, k, expect[k].allowed, check,
                             max_failures):
            break
    return sweep


def _check_prefix(sweep: Sweep, seen: set, workdir: str, model: FileModel, variants, effects, k: int, key,
                  check: Callable[[str, dict], None], max_failures: int) -> bool:
    """Write each distinct crash state ``model`` gives after prefix ``k`` (distinct by its files and ``key``)
    to a new directory and run ``check(root, files)`` on it, recording failures with the state's place in
    ``sweep``; False once ``max_failures`` are recorded."""
    for variant in variants:
        files = model.state(variant)
        if files is None:
            continue
        state = (state_key(files), key)
        if state in seen:
            continue
        seen.add(state)
        root = os.path.join(workdir, f"state-{len(seen)}")
        write_state(files, root)
        try:
            check(root, files)
        except Exception as exc:  # noqa: BLE001 - collected and reported with the state's place
            sweep.failures.append(f"after effect {k} ({effects[k - 1].kind if k else 'start'} "
                                  f"{effects[k - 1].path if k else ''}), {variant}: {type(exc).__name__}: {exc}")
            if len(sweep.failures) >= max_failures:
                return False
        finally:
            shutil.rmtree(root, ignore_errors=True)
        sweep.states += 1
        sweep.by_variant[variant] = sweep.by_variant.get(variant, 0) + 1
    return True


# -- 4. the remote tier ------------------------------------------------------------------------------------
# The object store's effects go into the same log: every put (an object replaced whole, durable when it
# returns: an S3 PUT is atomic) and delete, through the ObjectStore seam (engine/remote.py). A crash state
# is then a pair: the local files (kill / power / torn, as above) and the objects as of that prefix. Each is
# checked twice: local recovery with that remote (``check_state``, as for a local store), and recovery from
# the remote alone into an empty directory, which must list exactly the versions of the last pointer put.

class DictObjectStore(ObjectStore):
    """Objects in a dict (a crash state's remote, or the recording's)."""

    def __init__(self, objects: dict[str, bytes] | None = None):  # (no fsspec file system)
        super().__init__()
        self.url = "mem://remote"
        self.root = ""
        self.objects = dict(objects or {})
        self._lock = threading.RLock()

    def put_if(self, key: str, data, tag) -> None:
        with self._lock:  # (atomic, as S3's conditional PUT is)
            super().put_if(key, data, tag)

    def put(self, key: str, data) -> None:
        with self._lock:
            self.objects[key] = bytes(data)

    def get(self, key: str, start=None, end=None) -> bytes:
        with self._lock:
            if key not in self.objects:
                raise RemoteObjectMissing(f"reading {self.where(key)}: the object is missing", self.where(key))
            return self.objects[key][start:end]

    def size(self, key: str):
        with self._lock:
            return len(self.objects[key]) if key in self.objects else None

    def list(self, folder: str) -> dict[str, int]:
        if not folder:  # (the prefix itself: the objects directly in it)
            with self._lock:
                return {k: len(v) for k, v in self.objects.items() if "/" not in k}
        with self._lock:
            return {k[len(folder) + 1:]: len(v) for k, v in self.objects.items() if k.startswith(folder + "/")}

    def list_tree(self, folder: str) -> dict[str, int]:
        if not folder:
            with self._lock:
                return {k: len(v) for k, v in self.objects.items()}
        return self.list(folder)

    def delete(self, key: str) -> None:
        with self._lock:
            self.objects.pop(key, None)


class RecordingObjectStore(DictObjectStore):
    """Logs every put and delete into ``rec``'s effect log; a put of the pointer carries the versions the
    live store lists at that instant (``listed()``): what a recovery from the remote must find."""

    def __init__(self, rec: RecordingFileSystem, listed: Callable[[], frozenset]):
        super().__init__()
        self.rec = rec
        self.listed = listed

    def put(self, key: str, data) -> None:
        super().put(key, data)
        versions = self.listed() if key == filenames.REMOTE_POINTER else frozenset()
        self.rec.record(Effect("put", key, data=bytes(data), versions=versions))

    def delete(self, key: str) -> None:
        super().delete(key)
        self.rec.record(Effect("delete", key))


def segment_ids(objects: dict) -> set[int]:
    """The segment ids of the segment objects among ``objects`` (keys), in any writer's folder."""
    return {filenames.parse_segment_name(k.rsplit("/", 1)[-1]) for k in objects
            if k.split("/")[-2:-1] == [filenames.REMOTE_SEGMENTS_DIR]}


def remote_store(root: str, objects: ObjectStore, filesystem=fs.DEFAULT, *, readonly=False, create=False,
                 cache_bytes=0, every=1) -> Store:
    """A Store at ``root`` whose segments go to ``objects`` (what cnrstore.open(remote=...) builds)."""
    storage = remote.storage_for(os.path.abspath(root), objects, filesystem, readonly=readonly, create=create,
                                 cache_bytes=cache_bytes, every=every)
    return Store(root, create=create, readonly=readonly, filesystem=filesystem, storage=storage)


def check_remote_alone(objects: dict[str, bytes], pointer_versions: frozenset | None, content, workdir: str) -> None:
    """Recovery from the remote alone (an empty directory): exactly the last pointer's versions, bit for bit."""
    try:
        store = remote_store(workdir, DictObjectStore(objects), readonly=True)
    except StoreNotFound:
        assert pointer_versions is None, f"no store recovered from the remote; its pointer listed {pointer_versions}"
        return
    with store:
        listed = frozenset(v.version for v in store.versions())
        assert listed == pointer_versions, (f"recovery from the remote lists {sorted(listed)}; the last pointer "
                                            f"put listed {sorted(pointer_versions or ())}")
        _check_versions(store, listed, Expectation((listed,), content), "recovered from the remote alone")


def explore_remote(base: str, base_objects: dict[str, bytes], effects: list[Effect], content, workdir: str,
                   write_more: CheckNewWrite, *, initial=frozenset(), initial_pointer=None,
                   variants=("kill", "power", "torn"), stride: int = 1, max_failures: int = 5) -> Sweep:
    """``explore`` for a store with a remote tier: every ``stride``-th prefix, each variant of the local
    files with the remote as of that prefix, checked by local recovery and by recovery from the remote alone."""
    model = FileModel.of_directory(base)
    expect = expectations(effects, content, initial)
    sweep = Sweep(effects=len(effects))
    objects = dict(base_objects)
    pointer = initial_pointer
    seen: set = set()
    for k in range(len(effects) + 1):
        if k:
            e = effects[k - 1]
            model.apply(e)
            if e.kind == "put":
                objects[e.path] = e.data
                if e.path == filenames.REMOTE_POINTER:
                    pointer = e.versions
            elif e.kind == "delete":
                objects.pop(e.path, None)
        if k % stride and k != len(effects):
            continue

        def check(root: str, _files, k=k, remote_now=dict(objects), pointer=pointer) -> None:
            state_remote = DictObjectStore(remote_now)  # (the recovered store writes on; its reopen reads that)
            try:
                check_remote_alone(remote_now, pointer, content, root + "-fresh")
            finally:
                shutil.rmtree(root + "-fresh", ignore_errors=True)
            check_state(root, expect[k], write_more, opener=lambda r: remote_store(r, state_remote))

        if not _check_prefix(sweep, seen, workdir, model, variants, effects, k,
                             (state_key(dict(objects)), expect[k].allowed), check, max_failures):
            break
    return sweep
