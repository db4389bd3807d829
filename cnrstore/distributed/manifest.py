"""The root of a distributed store: its layout, generations and global-version manifests.

Layout (docs/FORMAT.md, "Distributed root")::

    <root>/CNRSTORE-DIST                 marker: format version, checksummed (written once, first)
    <root>/gen-000001/PLAN               the sharding plan of generation 1 (checksummed, written before
                                         any rank store of the generation)
    <root>/gen-000001/rank-00000/        rank 0's store (an ordinary cnrstore store)
    <root>/global/g-000000000007.cnrg    manifest of global version 7

A *generation* is one sharding plan: every rank of a job writes its shards into its own store of the
current generation. A job that starts with another plan or world size starts a new generation; the old
one stays readable for restores (resharding) until no manifest refers to it.

A global version exists exactly when its manifest file exists and verifies. Each rank commits its local
version first; the manifest, which names every rank's local version, is written last, atomically (tmp,
fsync, rename, fsync of the directory), as ``torch.distributed.checkpoint`` writes ``.metadata`` last.
Every file here is msgpack followed by the XXH3-64 of the bytes before it.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import time
from dataclasses import dataclass, field

import msgpack
import xxhash

from .. import store as _store
from ..engine import fs
from ..engine.msgpack_safe import unpack_bounded
from ..errors import CorruptionError, FormatVersionError, InvalidArgument, StoreNotFound, VersionNotFound
from .plan import ShardingPlan

__all__ = ["GlobalVersion", "Root", "DIST_FORMAT_VERSION", "seal", "unseal_bytes"]

DIST_FORMAT_VERSION = 1
MARKER = "CNRSTORE-DIST"
GLOBAL_DIR = "global"
PLAN_FILE = "PLAN"
ROOT_POINTER = "ROOT"  # a bucket root's pointer (remote_root.py)
_MAGIC = {MARKER: b"CNRDIST\0", PLAN_FILE: b"CNRPLAN\0", "manifest": b"CNRGLOB\0", ROOT_POINTER: b"CNRROOT\0"}
_MANIFEST_RE = re.compile(r"^g-(\d{12})\.cnrg$")
_GEN_RE = re.compile(r"^gen-(\d{6})$")
_STORE_RE = re.compile(r"^gen-(\d{6})/rank-(\d{5})$")  # a manifest's store paths: inside the root, nothing else
_MAX_FILE_BYTES = 1 << 30  # a marker, plan or manifest larger than this is not one (read whole into memory)


@dataclass(frozen=True)
class GlobalVersion:
    """One committed global version: every rank's local version, under one sharding plan."""

    version: int
    step: int | None
    meta: dict | None
    created: float
    generation: int
    plan: ShardingPlan
    local_versions: tuple[int, ...]  # by rank
    stores: tuple[str, ...] = field(default=())  # by rank, relative to the root
    priority: bool = False  # a CPR priority save on some rank: only its most-updated rows are fresh

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def to_dict(self) -> dict:
        return {"format": DIST_FORMAT_VERSION, "version": self.version, "step": self.step, "meta": self.meta,
                "created": self.created, "generation": self.generation, "plan": self.plan.to_dict(),
                "local_versions": list(self.local_versions), "stores": list(self.stores),
                "priority": self.priority}

    @classmethod
    def parse(cls, d, path: str, version: int | None = None) -> "GlobalVersion":
        """The global version a manifest's body ``d`` describes, checked as untrusted data: every field of
        its type, one local version and one store per rank, each store path ``gen-GGGGGG/rank-RRRRR`` of its
        generation (never a path outside the root), the version the file's name says. CorruptionError
        otherwise."""
        def bad(what: str) -> CorruptionError:
            return CorruptionError(f"{path} is not a global-version manifest ({what}); remove it or restore the "
                                   "root's global/ directory from a copy", path, 0)

        def is_int(x, lo=0, hi=2 ** 64 - 1) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi

        if not isinstance(d, dict):
            raise bad("its body is not a map")
        try:
            plan = ShardingPlan.from_dict(d["plan"]) if isinstance(d.get("plan"), dict) else None
        except Exception as exc:  # noqa: BLE001 - the plan's own checks: InvalidArgument (and what a map holds)
            raise bad(f"its plan: {exc}") from exc
        if plan is None:
            raise bad("no plan")
        gv_version, gen, lvs, stores = d.get("version"), d.get("generation"), d.get("local_versions"), d.get("stores")
        if not is_int(gv_version, 1) or (version is not None and gv_version != version):
            raise bad(f"version {gv_version!r} in a file named for version {version}")
        if not is_int(gen, 1, 999_999):
            raise bad(f"generation {gen!r}")
        if not isinstance(lvs, list) or len(lvs) != plan.world_size or not all(is_int(v, 1) for v in lvs):
            raise bad("local_versions is not one version number per rank")
        if not isinstance(stores, list) or (stores and len(stores) != plan.world_size):
            raise bad("stores is not one store path per rank")
        for rank, rel in enumerate(stores):
            m = _STORE_RE.match(rel) if isinstance(rel, str) else None
            if m is None or int(m.group(2)) != rank:
                raise bad(f"rank {rank}'s store path {rel!r} is not gen-GGGGGG/rank-{rank:05d} inside the root")
        step, meta, created = d.get("step"), d.get("meta"), d.get("created")
        if not all(k in d for k in ("step", "meta", "created")) or not (step is None or is_int(step, -2 ** 63)) or not (meta is None or isinstance(meta, dict)) \
                or not isinstance(created, (int, float)) or isinstance(created, bool) \
                or not isinstance(d.get("priority", False), bool):
            raise bad("step, meta, created or priority of the wrong type")
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict) -> "GlobalVersion":
        return cls(version=int(d["version"]), step=d["step"], meta=d["meta"], created=float(d["created"]),
                   generation=int(d["generation"]), plan=ShardingPlan.from_dict(d["plan"]),
                   local_versions=tuple(int(v) for v in d["local_versions"]), stores=tuple(d["stores"]),
                   priority=bool(d.get("priority", False)))


def seal(kind: str, payload: dict) -> bytes:
    """The bytes of a root file of ``kind`` (``CNRSTORE-DIST``, ``PLAN``, ``manifest``, ``ROOT``): magic, msgpack
    body, XXH3-64 of what precedes it (docs/FORMAT.md, "Distributed root")."""
    body = _MAGIC[kind] + msgpack.packb(payload, use_bin_type=True)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def _unseal(kind: str, path: str) -> dict:
    try:  # a regular file, read up to its size (never a FIFO, a device or a link out of the root)
        data = fs.read_regular(path, _MAX_FILE_BYTES, f"{kind} file", "a distributed root's files are regular files: "
                               "restore it from a copy")
    except PermissionError as exc:
        raise fs.permission_denied(exc, f"cannot read {kind} file {path}", path, needs="read", writing=False) \
            from None
    return unseal_bytes(kind, data, path)


def unseal_bytes(kind: str, data: bytes, path: str) -> dict:
    """The body of the root file ``data`` of ``kind`` (read from ``path``): CorruptionError unless its magic
    and checksum verify and its body is a map (bounded msgpack: never trusted)."""
    if len(data) > _MAX_FILE_BYTES:
        raise CorruptionError(f"{path} is corrupt: {len(data)} bytes is no {kind} file", path, 0)
    magic = _MAGIC[kind]
    if len(data) < len(magic) + 8 or not data.startswith(magic) or \
            struct.unpack_from("<Q", data, len(data) - 8)[0] != xxhash.xxh3_64_intdigest(data[:-8]):
        raise CorruptionError(f"{path} is corrupt (bad magic or checksum)", path, 0)
    body = unpack_bounded(data[len(magic):-8], path, len(magic))
    if not isinstance(body, dict):
        raise CorruptionError(f"{path} is corrupt: its body is not a map", path, len(magic))
    return body


class Root:
    """The files of a distributed root. Every rank may read; writes are rank 0's (the marker, plans,
    manifests, removal of unreferenced generations), except each rank's own store."""

    #: the bucket prefix of a root kept in an object store (remote_root.RemoteRoot); None: a directory
    remote: str | None = None

    def __init__(self, path: str, filesystem: fs.FileSystem = fs.DEFAULT):
        self.path = os.fspath(path)
        self.fs = filesystem
        # manifests parsed by versions(), by file name -> (inode, GlobalVersion); see versions()
        self._parsed: dict[str, tuple[int, GlobalVersion]] = {}

    # -- paths ----------------------------------------------------------------------------------------
    def _subdir(self, *names: str) -> str:
        """``<root>/<names...>``, a directory inside the root: CorruptionError if any of them is there but is
        a symbolic link (a read, or a rank's writes, would go to another directory) or not a directory. The
        root itself may be a link: its path is the caller's."""
        path = self.path
        for name in names:
            path = os.path.join(path, name)
            fs.check_kind(path, "directory", "a distributed root's generations, rank stores and global/ are "
                          "directories inside it: restore it from a copy", directory=True)
        return path

    def gen_dir(self, generation: int) -> str:
        return self._subdir(f"gen-{generation:06d}")

    def store_rel(self, generation: int, rank: int) -> str:
        return f"gen-{generation:06d}/rank-{rank:05d}"

    def store_path(self, rel: str) -> str:
        """The rank store ``rel`` (``gen-GGGGGG/rank-RRRRR``, as ``store_rel`` and manifests name it): a
        directory of the root, never followed through a link (``_subdir``)."""
        return self._subdir(*rel.split("/"))

    def remove_local_leftovers(self) -> list[int]:
        """A bucket root's rank directories of unlisted generations on this node (remote_root.RemoteRoot); a
        shared directory's are removed with their generation (``remove_unreferenced_generations``)."""
        return []

    def open_store(self, rel: str, *, readonly: bool = False, create: bool = False, compaction=None):
        """The rank store ``rel`` (``store_path``), opened: ``cnrstore.open``'s arguments."""
        return _store.open(self.store_path(rel), readonly=readonly, create=create, compaction=compaction)

    def rank_stores(self, gv: "GlobalVersion") -> list[str]:
        """The store of each rank that global version ``gv`` reads, by rank, relative to the root: the
        manifest's ``stores``, or for a manifest naming none, ``store_rel(gv.generation, rank)``."""
        return list(gv.stores) if gv.stores else [self.store_rel(gv.generation, r) for r in range(gv.world_size)]

    def named_local_versions(self, gvs=None) -> dict[str, set[int]]:
        """{rank store (``rank_stores``' names): the local versions that the global versions ``gvs`` (default:
        every one, ``versions()``) name in it}: what a rank store's reclaim must keep, and verify must find."""
        named: dict[str, set[int]] = {}
        for gv in self.versions() if gvs is None else gvs:
            for rel, v in zip(self.rank_stores(gv), gv.local_versions):
                named.setdefault(rel, set()).add(v)
        return named

    def _manifest_path(self, version: int) -> str:
        return os.path.join(self._subdir(GLOBAL_DIR), f"g-{version:012d}.cnrg")

    # -- the marker -----------------------------------------------------------------------------------
    def exists(self) -> bool:
        return os.path.exists(os.path.join(self.path, MARKER))

    def check(self) -> None:
        """Raise StoreNotFound / FormatVersionError / CorruptionError unless this is a readable root."""
        marker = os.path.join(self.path, MARKER)
        try:
            os.lstat(marker)  # (a marker that is a link, even a dangling one, is refused by _unseal)
            found = True
        except (FileNotFoundError, NotADirectoryError):
            found = False
        except PermissionError as exc:  # not "no root here": a directory on the way may not be searched
            raise fs.permission_denied(exc, f"cannot open the distributed root {self.path!r}", self.path,
                                       needs="read and search (r-x)", writing=False) from None
        if not found:
            raise StoreNotFound(f"{self.path} is not a distributed cnrstore root (no {MARKER}); create it "
                                "with DistributedCheckpointer, or check the path")
        fmt = _unseal(MARKER, marker).get("format")
        if fmt != DIST_FORMAT_VERSION:
            raise FormatVersionError(f"{self.path} has distributed format {fmt}; this cnrstore reads format "
                                     f"{DIST_FORMAT_VERSION}")

    def create(self) -> None:
        """Make the root (rank 0, at start-up); idempotent. Removes manifests a crash left half-written."""
        marker = os.path.join(self.path, MARKER)
        try:
            os.makedirs(os.path.join(self.path, GLOBAL_DIR), exist_ok=True)
            if not os.path.exists(marker):
                self.fs.write_file_atomic(marker, marker + ".tmp",
                                          seal(MARKER, {"format": DIST_FORMAT_VERSION, "created": time.time()}))
        except OSError as exc:
            if exc.errno in fs.NO_PERMISSION:
                raise fs.permission_denied(exc, f"cannot create the distributed root {self.path!r}",
                                           needs="write", writing=False) from None
            raise
        self.check()
        gdir = os.path.join(self.path, GLOBAL_DIR)
        for name in os.listdir(gdir):
            if name.endswith(".tmp"):
                self.fs.remove(os.path.join(gdir, name))

    # -- generations ----------------------------------------------------------------------------------
    def generations(self) -> list[int]:
        """Generations whose plan file is written, oldest first."""
        out = []
        for name in os.listdir(self.path) if os.path.isdir(self.path) else []:
            m = _GEN_RE.match(name)
            if m and os.path.exists(os.path.join(self.path, name, PLAN_FILE)):
                out.append(int(m.group(1)))
        return sorted(out)

    def plan_of(self, generation: int) -> ShardingPlan:
        path = os.path.join(self.gen_dir(generation), PLAN_FILE)
        body = _unseal(PLAN_FILE, path)
        try:
            return ShardingPlan.from_dict(body["plan"])
        except Exception as exc:  # noqa: BLE001 - a checksummed file that is no plan: untrusted bytes
            raise CorruptionError(f"{path} is not a sharding plan ({type(exc).__name__}: {exc})", path, 0) from exc

    def generation_for(self, plan: ShardingPlan) -> int:
        """The newest generation if its plan is ``plan``; else a new generation with that plan (rank 0)."""
        gens = self.generations()
        if gens and self.plan_of(gens[-1]) == plan:
            return gens[-1]
        # a directory without its PLAN is a generation a crash cut short: its number is not reused
        gen = max((int(m.group(1)) for m in map(_GEN_RE.match, os.listdir(self.path)) if m), default=0) + 1
        os.makedirs(self.gen_dir(gen), exist_ok=True)
        path = os.path.join(self.gen_dir(gen), PLAN_FILE)
        self.fs.write_file_atomic(path, path + ".tmp", seal(PLAN_FILE, {"plan": plan.to_dict()}))
        self.fs.fsync_dir(self.path)
        return gen

    def remove_unreferenced_generations(self, keep: int) -> list[int]:
        """Delete every generation older than ``keep`` that no manifest refers to; returns them."""
        used = {g.generation for g in self.versions()} | {keep}
        removed = []
        for name in os.listdir(self.path):
            m = _GEN_RE.match(name)
            if m and int(m.group(1)) < keep and int(m.group(1)) not in used:
                shutil.rmtree(os.path.join(self.path, name))
                removed.append(int(m.group(1)))
        return sorted(removed)

    # -- manifests ------------------------------------------------------------------------------------
    def version_numbers(self) -> list[int]:
        gdir = self._subdir(GLOBAL_DIR)
        if not os.path.isdir(gdir):
            return []
        return sorted(int(m.group(1)) for m in map(_MANIFEST_RE.match, os.listdir(gdir)) if m)

    def read(self, version: int) -> GlobalVersion:
        path = self._manifest_path(version)
        if not os.path.lexists(path):  # (a dangling link is there: _unseal refuses it)
            raise VersionNotFound(f"global version {version} is not in {self.path} (never committed, or dropped)")
        d = _unseal("manifest", path)
        if d.get("format") != DIST_FORMAT_VERSION:
            raise FormatVersionError(f"{path} has format {d.get('format')}, expected {DIST_FORMAT_VERSION}")
        return GlobalVersion.parse(d, path, version)

    def versions(self) -> list[GlobalVersion]:
        """Every committed global version, oldest first (manifests removed meanwhile are skipped).

        A manifest is immutable once written (``commit`` renames a new file into place and never
        overwrites one), so each is read and verified once per ``Root`` and remembered by file name and
        inode: a save, which lists the versions, parses only manifests it has not seen. ``read`` always
        reads the file afresh."""
        gdir = self._subdir(GLOBAL_DIR)
        if not os.path.isdir(gdir):
            self._parsed.clear()
            return []
        found = {}
        with os.scandir(gdir) as entries:
            for entry in entries:
                m = _MANIFEST_RE.match(entry.name)
                if m:
                    found[int(m.group(1))] = (entry.name, entry.inode())
        parsed = {}
        out = []
        for v in sorted(found):
            name, inode = found[v]
            known = self._parsed.get(name)
            if known is not None and known[0] == inode:
                gv = known[1]
            else:
                try:
                    gv = self.read(v)
                except VersionNotFound:
                    continue
            parsed[name] = (inode, gv)
            out.append(gv)
        self._parsed = parsed
        return out

    def latest(self) -> GlobalVersion | None:
        for v in reversed(self.version_numbers()):
            try:
                return self.read(v)
            except VersionNotFound:
                continue
        return None

    def commit(self, gv: GlobalVersion) -> None:
        """Write ``gv``'s manifest durably: from this moment the global version exists."""
        if os.path.exists(self._manifest_path(gv.version)):
            raise InvalidArgument(f"global version {gv.version} exists already")
        path = self._manifest_path(gv.version)
        fs.crash_point("dist_before_manifest")
        self.fs.write_file_atomic(path, path + ".tmp", seal("manifest", gv.to_dict()))
        fs.crash_point("dist_after_manifest")

    def commit_many(self, gvs) -> None:
        """``commit`` each of ``gvs`` in turn (a root in a bucket lists them with one pointer swap)."""
        for gv in gvs:
            self.commit(gv)

    def drop(self, versions) -> None:
        """Remove the manifests of ``versions`` (retention); the newest is never removed."""
        numbers = self.version_numbers()
        for v in versions:
            if numbers and v == numbers[-1]:
                raise InvalidArgument("the newest global version cannot be dropped")
            path = self._manifest_path(v)
            if os.path.exists(path):
                self.fs.remove(path)
        self.fs.fsync_dir(os.path.join(self.path, GLOBAL_DIR))
