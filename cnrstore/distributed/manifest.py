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

import builtins
import os
import re
import shutil
import struct
import time
from dataclasses import dataclass, field

import msgpack
import xxhash

from .. import fs
from ..errors import CorruptionError, FormatVersionError, InvalidArgument, StoreNotFound, VersionNotFound
from .plan import ShardingPlan

__all__ = ["GlobalVersion", "Root", "DIST_FORMAT_VERSION"]

DIST_FORMAT_VERSION = 1
MARKER = "CNRSTORE-DIST"
GLOBAL_DIR = "global"
PLAN_FILE = "PLAN"
_MAGIC = {MARKER: b"CNRDIST\0", PLAN_FILE: b"CNRPLAN\0", "manifest": b"CNRGLOB\0"}
_MANIFEST_RE = re.compile(r"^g-(\d{12})\.cnrg$")
_GEN_RE = re.compile(r"^gen-(\d{6})$")


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
    def from_dict(cls, d: dict) -> "GlobalVersion":
        return cls(version=int(d["version"]), step=d["step"], meta=d["meta"], created=float(d["created"]),
                   generation=int(d["generation"]), plan=ShardingPlan.from_dict(d["plan"]),
                   local_versions=tuple(int(v) for v in d["local_versions"]), stores=tuple(d["stores"]),
                   priority=bool(d.get("priority", False)))


def _seal(kind: str, payload: dict) -> bytes:
    body = _MAGIC[kind] + msgpack.packb(payload, use_bin_type=True)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def _unseal(kind: str, path: str) -> dict:
    try:
        with builtins.open(path, "rb") as f:
            data = f.read()
    except PermissionError as exc:
        raise fs.permission_denied(exc, f"cannot read {kind} file {path}", path, needs="read", writing=False) \
            from None
    magic = _MAGIC[kind]
    if len(data) < len(magic) + 8 or not data.startswith(magic) or \
            struct.unpack_from("<Q", data, len(data) - 8)[0] != xxhash.xxh3_64_intdigest(data[:-8]):
        raise CorruptionError(f"{path} is corrupt (bad magic or checksum)", path, 0)
    try:
        return msgpack.unpackb(data[len(magic):-8], raw=False, strict_map_key=False)
    except Exception as exc:  # a checksummed body that does not parse: written by something else
        raise CorruptionError(f"{path} does not parse: {exc}", path, len(magic)) from exc


class Root:
    """The files of a distributed root. Every rank may read; writes are rank 0's (the marker, plans,
    manifests, removal of unreferenced generations), except each rank's own store."""

    def __init__(self, path: str, filesystem: fs.FileSystem = fs.DEFAULT):
        self.path = os.fspath(path)
        self.fs = filesystem
        # manifests parsed by versions(), by file name -> (inode, GlobalVersion); see versions()
        self._parsed: dict[str, tuple[int, GlobalVersion]] = {}

    # -- paths ----------------------------------------------------------------------------------------
    def gen_dir(self, generation: int) -> str:
        return os.path.join(self.path, f"gen-{generation:06d}")

    def store_rel(self, generation: int, rank: int) -> str:
        return f"gen-{generation:06d}/rank-{rank:05d}"

    def store_path(self, rel: str) -> str:
        return os.path.join(self.path, rel)

    def _manifest_path(self, version: int) -> str:
        return os.path.join(self.path, GLOBAL_DIR, f"g-{version:012d}.cnrg")

    # -- the marker -----------------------------------------------------------------------------------
    def exists(self) -> bool:
        return os.path.exists(os.path.join(self.path, MARKER))

    def check(self) -> None:
        """Raise StoreNotFound / FormatVersionError / CorruptionError unless this is a readable root."""
        marker = os.path.join(self.path, MARKER)
        try:
            os.stat(marker)
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
                                          _seal(MARKER, {"format": DIST_FORMAT_VERSION, "created": time.time()}))
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
        return ShardingPlan.from_dict(_unseal(PLAN_FILE, os.path.join(self.gen_dir(generation), PLAN_FILE))["plan"])

    def generation_for(self, plan: ShardingPlan) -> int:
        """The newest generation if its plan is ``plan``; else a new generation with that plan (rank 0)."""
        gens = self.generations()
        if gens and self.plan_of(gens[-1]) == plan:
            return gens[-1]
        # a directory without its PLAN is a generation a crash cut short: its number is not reused
        gen = max((int(m.group(1)) for m in map(_GEN_RE.match, os.listdir(self.path)) if m), default=0) + 1
        os.makedirs(self.gen_dir(gen), exist_ok=True)
        path = os.path.join(self.gen_dir(gen), PLAN_FILE)
        self.fs.write_file_atomic(path, path + ".tmp", _seal(PLAN_FILE, {"plan": plan.to_dict()}))
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
        gdir = os.path.join(self.path, GLOBAL_DIR)
        if not os.path.isdir(gdir):
            return []
        return sorted(int(m.group(1)) for m in map(_MANIFEST_RE.match, os.listdir(gdir)) if m)

    def read(self, version: int) -> GlobalVersion:
        path = self._manifest_path(version)
        if not os.path.exists(path):
            raise VersionNotFound(f"global version {version} is not in {self.path} (see versions())")
        d = _unseal("manifest", path)
        if d.get("format") != DIST_FORMAT_VERSION:
            raise FormatVersionError(f"{path} has format {d.get('format')}, expected {DIST_FORMAT_VERSION}")
        return GlobalVersion.from_dict(d)

    def versions(self) -> list[GlobalVersion]:
        """Every committed global version, oldest first (manifests removed meanwhile are skipped).

        A manifest is immutable once written (``commit`` renames a new file into place and never
        overwrites one), so each is read and verified once per ``Root`` and remembered by file name and
        inode: a save, which lists the versions, parses only manifests it has not seen. ``read`` always
        reads the file afresh."""
        gdir = os.path.join(self.path, GLOBAL_DIR)
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
        self.fs.write_file_atomic(path, path + ".tmp", _seal("manifest", gv.to_dict()))
        fs.crash_point("dist_after_manifest")

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
