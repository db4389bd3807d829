"""A multi-rank root kept in an object store: ``DistributedCheckpointer(local_dir, ..., remote="s3://b/p")``.

The root's marker, its generations' plans, its pointer and its global-version manifests live under the
prefix; each rank's store keeps its index and active segment on its node's local disk
(``<local_dir>/gen-GGGGGG/rank-RRRRR``) and its sealed segments and copy points under
``<prefix>/gen-GGGGGG/rank-RRRRR`` (the remote tier, cnrstore/engine/remote.py). Layout (docs/FORMAT.md,
"Distributed root in a bucket")::

    <prefix>/CNRSTORE-DIST                     marker (the bytes of a local root's), created once
    <prefix>/ROOT                              the root pointer: owner job, generations, global versions
    <prefix>/gen-000001/PLAN                   generation 1's sharding plan (as a local root's)
    <prefix>/gen-000001/rank-00000/...         rank 0's store's remote prefix (its CURRENT, writers' folders)
    <prefix>/global/g-000000000007-<job>.cnrg  the manifest of global version 7, put by job <job>

**One writer per root.** The root pointer is replaced only by a compare-and-swap (the remote tier's
conditional PUT on the tag last read). Rank 0 of a job claims the root when the job starts: from then on
the pointer names that job. Every later change (a new generation, a global version, retention) reads the
pointer, checks that it still names this job (else ``RemoteTakenOver``) and swaps it on the tag it read.
Of two jobs on one prefix, the one that started last owns the root; the other fails at its next save,
before any object of its own becomes part of a global version, and its rank stores' copy points fail as
the remote tier's stale writers do.

**A global version exists exactly when the root pointer lists it and its manifest verifies.** Its
manifest is put first, under a key of its own job's (never overwritten), then the pointer swapped; before
rank 0 puts it, every rank has made the copy point that uploads the local version it names. A manifest the
pointer does not list (a crash between the two, or a stale job's) is deleted by the next claim.
Generations are numbered from the pointer's counter (a number is never reused); retention moves a
generation to the pointer's ``doomed`` list before deleting its objects, and a claim finishes what a crash
left of such a deletion.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import uuid
from typing import NamedTuple

from .. import store as _store
from ..engine import fs
from ..engine.objects import FsspecObjectStore, ObjectStore, delete_with_proof
from ..engine.remote import EXPLICIT_COPY_POINTS, pointer_missing
from ..errors import (CorruptionError, FormatVersionError, InvalidArgument, RemoteConflict,
                      RemoteObjectMissing, RemoteTakenOver, StoreNotFound, VersionNotFound)
from .manifest import (DIST_FORMAT_VERSION, GLOBAL_DIR, MARKER, PLAN_FILE, ROOT_POINTER, GlobalVersion, Root, seal,
                       unseal_bytes)
from .plan import ShardingPlan

__all__ = ["RemoteRoot", "RootPointer", "open_root"]

log = logging.getLogger("cnrstore.distributed")

_JOB_CHARS = set("0123456789abcdef")
_GEN_DIR = re.compile(r"^gen-(\d{6})$")
_MAX_POINTER_BYTES = 64 << 20
#: A claim that loses its compare-and-swap to the owner's own swap (a save of the job it takes over) tries again
CLAIM_TRIES = 5


class RootPointer(NamedTuple):
    """The root pointer's body: the job that owns the root, its generations (oldest first), the generations
    being deleted, the next generation number, and the global versions as (number, job whose manifest it
    is). ``tag``: the object's tag when read (None: there was no pointer)."""

    owner: str
    generations: tuple[int, ...] = ()
    doomed: tuple[int, ...] = ()
    next_generation: int = 1
    versions: tuple[tuple[int, str], ...] = ()
    tag: str | None = None

    def encode(self) -> bytes:
        return seal(ROOT_POINTER, {"format": DIST_FORMAT_VERSION, "owner": self.owner, "changed": time.time(),
                                   "generations": list(self.generations), "doomed": list(self.doomed),
                                   "next_generation": self.next_generation,
                                   "versions": [[v, job] for v, job in self.versions]})

    def numbers(self) -> list[int]:
        return [v for v, _job in self.versions]

    def manifest_key(self, version: int) -> str:
        job = dict(self.versions).get(version)
        if job is None:
            raise VersionNotFound(f"global version {version} is not in this root (never committed, or dropped)")
        return manifest_key(version, job)


def manifest_key(version: int, job: str) -> str:
    return f"{GLOBAL_DIR}/g-{version:012d}-{job}.cnrg"


def decode_pointer(data: bytes, where: str, tag: str | None) -> RootPointer:
    """The root pointer ``data`` (read from ``where``), checked as untrusted bytes: CorruptionError naming the
    field that is wrong."""
    body = unseal_bytes(ROOT_POINTER, data, where)

    def bad(what: str) -> CorruptionError:
        return CorruptionError(f"{where} is not a root pointer ({what}); restore it from a copy (a bucket with "
                               "versioning keeps the previous one)", where, 0)

    def ints(name: str, lo: int = 1) -> tuple[int, ...]:
        value = body.get(name)
        if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) and
                                                  lo <= x <= 999_999 for x in value):
            raise bad(f"{name} is not a list of generation numbers")
        return tuple(value)

    if body.get("format") != DIST_FORMAT_VERSION:
        raise FormatVersionError(f"{where} has format {body.get('format')!r}; this cnrstore reads "
                                 f"{DIST_FORMAT_VERSION}")
    owner = body.get("owner")
    if not isinstance(owner, str) or not 1 <= len(owner) <= 64 or not set(owner) <= _JOB_CHARS:
        raise bad("its owner is not a job id")
    generations, doomed = ints("generations"), ints("doomed")
    nxt = body.get("next_generation")
    if not isinstance(nxt, int) or isinstance(nxt, bool) or not 1 <= nxt <= 1_000_000 or \
            any(g >= nxt for g in generations + doomed):
        raise bad("next_generation is not above every generation")
    versions = body.get("versions")
    if not isinstance(versions, list) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and not isinstance(e[0], bool)
            and 1 <= e[0] < 2 ** 63 and isinstance(e[1], str) and 1 <= len(e[1]) <= 64 and set(e[1]) <= _JOB_CHARS
            for e in versions):
        raise bad("versions is not a list of [number, job]")
    numbers = [e[0] for e in versions]
    if numbers != sorted(set(numbers)):
        raise bad("its versions are not in increasing order")
    return RootPointer(owner, generations, doomed, nxt, tuple((e[0], e[1]) for e in versions), tag)


class RemoteRoot(Root):
    """A distributed root in an object store (module doc); the methods of ``Root``, read from and written to
    the bucket. Rank stores open through ``open_store``: local directory under ``local_dir``, remote under
    the prefix. Reads may come from any process; every write is rank 0's of the job that owns the root."""

    def __init__(self, local_dir, url: str | None = None, options: dict | None = None, *,
                 timeout_s: float | None = None, cache_bytes: int | None = None, objects: ObjectStore | None = None):
        """``url`` and ``options`` (fsspec's, as ``cnrstore.open``'s ``remote_options``), or ``objects``
        connected already (tests); ``cache_bytes`` bounds each rank store's local copies of sealed segments."""
        super().__init__(local_dir)
        self.local = os.path.abspath(os.fspath(local_dir))
        if objects is None:
            if url is None:
                raise InvalidArgument("a bucket root needs remote= (e.g. 's3://bucket/prefix')")
            objects = (FsspecObjectStore(url, options) if timeout_s is None else
                       FsspecObjectStore(url, options, timeout_s=timeout_s))
        self.objects = objects
        self.remote = objects.url
        self.path = objects.url  # (the root's name in messages)
        self.cache_bytes = cache_bytes
        self.job = uuid.uuid4().hex
        self._manifests: dict[str, GlobalVersion] = {}  # by object key: a manifest is never rewritten

    # -- the pointer ----------------------------------------------------------------------------------
    def pointer(self) -> RootPointer | None:
        """The root pointer as it is now (None: the root has none yet). A root whose objects are there without
        its pointer is damage, never an empty root (``RemoteObjectMissing``): no pointer, no claim -- nothing
        reads it as holding no version, and no job claims it (a claim deletes what the pointer does not list)."""
        try:
            data, tag = self.objects.get_tagged(ROOT_POINTER)
        except RemoteObjectMissing:
            damage = pointer_missing(self.objects, ROOT_POINTER, ("gen-", f"{GLOBAL_DIR}/"))
            if damage is not None:
                raise RemoteObjectMissing(
                    f"{damage}. It lists the root's global versions: put it back (a bucket with versioning keeps "
                    f"the previous one), or rebuild it from the manifests and rank stores with `cnrstore --remote "
                    f"{self.remote} repair DIR` (cnrstore.distributed.repair_root). No job may start on this root "
                    "until then", damage.path) from None
            return None
        if len(data) > _MAX_POINTER_BYTES:
            raise CorruptionError(f"{self.objects.where(ROOT_POINTER)} is no root pointer ({len(data)} bytes)",
                                  self.objects.where(ROOT_POINTER), 0)
        return decode_pointer(data, self.objects.where(ROOT_POINTER), tag)

    def _owned(self) -> RootPointer:
        """The pointer, which must name this job: else RemoteTakenOver (another job started on the root)."""
        p = self.pointer()
        if p is None or p.owner != self.job:
            raise RemoteTakenOver(
                f"the multi-rank root {self.remote} is owned by another job now (its pointer names job "
                f"{None if p is None else p.owner}, this job is {self.job}): one job writes a root. A job started "
                "on the same prefix later took it over; stop this one (its saves are not global versions)",
                None if p is None else p.owner)
        return p

    def _swap(self, old: RootPointer | None, new: RootPointer) -> None:
        """Replace the pointer ``old`` (as read) by ``new`` by a compare-and-swap; RemoteTakenOver if another
        job moved it meanwhile."""
        try:
            self.objects.put_if(ROOT_POINTER, new.encode(), None if old is None else old.tag)
        except RemoteConflict:
            if old is not None and old.owner == self.job:
                self._owned()  # (raises, naming the new owner)
            raise

    # -- the marker -----------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.objects.size(MARKER) is not None

    def check(self) -> None:
        try:
            data = self.objects.get(MARKER)
        except RemoteObjectMissing:
            raise StoreNotFound(f"{self.remote} is not a multi-rank cnrstore root (no {MARKER}); create it with "
                                "DistributedCheckpointer(..., remote=URL), or check the URL") from None
        fmt = unseal_bytes(MARKER, data, self.objects.where(MARKER)).get("format")
        if fmt != DIST_FORMAT_VERSION:
            raise FormatVersionError(f"{self.remote} has distributed format {fmt}; this cnrstore reads format "
                                     f"{DIST_FORMAT_VERSION}")

    def create(self) -> None:
        """Make the root if it is not there, and claim it for this job (rank 0, at start-up): the pointer
        names this job from now on; manifests it does not list are deleted, and generations a crash left
        half-deleted are deleted -- only while the pointer still names this job (docs/DESIGN.md, "Deletion only
        with proof"): a claim a later job's superseded raises RemoteTakenOver and deletes nothing."""
        try:
            self.check()
        except StoreNotFound:
            try:
                self.objects.put_if(MARKER, seal(MARKER, {"format": DIST_FORMAT_VERSION, "created": time.time()}),
                                    None)
            except RemoteConflict:
                pass  # (created meanwhile: checked below)
            self.check()
        for attempt in range(CLAIM_TRIES):
            old = self.pointer()
            new = (old or RootPointer(self.job))._replace(owner=self.job, tag=None)
            try:
                self._swap(old, new)
                break
            except RemoteConflict as exc:
                now = self.pointer()
                if old is not None and now is not None and now.owner == old.owner and attempt + 1 < CLAIM_TRIES:
                    continue  # (the owner's own swap landed first -- a save of a job still running: claim again)
                if old is not None and now is not None and now.owner == old.owner:
                    raise RemoteConflict(
                        f"the job {old.owner} is still saving to the multi-rank root {self.remote} (its pointer moved "
                        f"{CLAIM_TRIES} times while this job claimed it); stop that job first") from exc
                raise RemoteConflict(f"another job ({None if now is None else now.owner}) claimed the multi-rank root "
                                     f"{self.remote} at the same moment as this one ({exc}); start one job per "
                                     "root") from exc
        fs.pause_point("root_claimed", self.job)
        listed = {manifest_key(v, job) for v, job in new.versions}
        delete_with_proof(self.objects, [f"{GLOBAL_DIR}/{name}" for name in self.objects.list(GLOBAL_DIR)
                                         if "/" not in name and f"{GLOBAL_DIR}/{name}" not in listed], self._proof)
        if new.doomed:
            self._delete_doomed()

    def _proof(self, keys: list[str]) -> RootPointer:
        """``delete_with_proof``'s proof for the root's objects: the pointer read now still names this job
        (else RemoteTakenOver: a later claim, whose job may have put any of ``keys`` since) and names none of
        ``keys`` (a manifest it lists, an object of a generation it lists: else RemoteConflict, nothing
        deleted)."""
        p = self._owned()
        named = {manifest_key(v, job) for v, job in p.versions}
        folders = tuple(f"gen-{g:06d}/" for g in p.generations)
        bad = [key for key in keys if key in named or key.startswith(folders)]
        if bad:
            raise RemoteConflict(f"the pointer of {self.remote} names {bad[:3]}, which this job was about to delete "
                                 "as garbage: nothing deleted")
        return p

    # -- generations ----------------------------------------------------------------------------------
    def generations(self) -> list[int]:
        p = self.pointer()
        return [] if p is None else list(p.generations)

    def plan_of(self, generation: int) -> ShardingPlan:
        key = f"gen-{generation:06d}/{PLAN_FILE}"
        body = unseal_bytes(PLAN_FILE, self.objects.get(key), self.objects.where(key))
        try:
            return ShardingPlan.from_dict(body["plan"])
        except Exception as exc:  # noqa: BLE001 - a checksummed object that is no plan: untrusted bytes
            raise CorruptionError(f"{self.objects.where(key)} is not a sharding plan ({type(exc).__name__}: {exc})",
                                  self.objects.where(key), 0) from exc

    def generation_for(self, plan: ShardingPlan) -> int:
        p = self._owned()
        if p.generations and self.plan_of(p.generations[-1]) == plan:
            return p.generations[-1]
        gen, skipped = p.next_generation, ()
        while True:  # a PLAN is put only where there is none: a stale job's never replaces the owner's
            try:
                self.objects.put_if(f"gen-{gen:06d}/{PLAN_FILE}", seal(PLAN_FILE, {"plan": plan.to_dict()}), None)
                break
            except RemoteConflict:  # left by a job that crashed or lost the root before listing it
                if self.plan_of(gen) == plan:
                    break
                skipped, gen = skipped + (gen,), gen + 1  # (doomed: its objects go with the next deletion)
        self._swap(p, p._replace(generations=p.generations + (gen,), doomed=p.doomed + skipped,
                                 next_generation=gen + 1))
        return gen

    def remove_unreferenced_generations(self, keep: int) -> list[int]:
        p = self._owned()
        used = {g.generation for g in self._load_all(p)} | {keep}
        drop = tuple(g for g in p.generations if g < keep and g not in used)
        if drop:
            self._swap(p, p._replace(generations=tuple(g for g in p.generations if g not in drop),
                                     doomed=p.doomed + drop))
            self._delete_doomed()
        return sorted(drop)

    def _delete_doomed(self) -> None:
        """Delete every object of the pointer's doomed generations, then take them off the pointer (each
        generation's listing, then the proof that the pointer is still this job's: ``delete_with_proof``)."""
        p = self._owned()
        if not p.doomed:
            return
        for g in p.doomed:
            folder = f"gen-{g:06d}"
            delete_with_proof(self.objects, [f"{folder}/{rel}" for rel in self.objects.list_tree(folder)], self._proof)
            fs.pause_point("root_generation_deleted", g)
        self._swap(p, p._replace(doomed=()))

    # -- manifests ------------------------------------------------------------------------------------
    def version_numbers(self) -> list[int]:
        p = self.pointer()
        return [] if p is None else p.numbers()

    def _load(self, p: RootPointer, version: int) -> GlobalVersion:
        key = p.manifest_key(version)
        known = self._manifests.get(key)
        if known is not None:
            return known
        where = self.objects.where(key)
        try:
            data = self.objects.get(key)
        except RemoteObjectMissing:
            now = self.pointer()  # dropped since ``p`` was read: gone, not damaged (still listed: damage)
            if now is None or key not in {manifest_key(v, job) for v, job in now.versions}:
                raise VersionNotFound(f"global version {version} was dropped from {self.remote} while it was "
                                      "being read (retention)") from None
            raise
        d = unseal_bytes("manifest", data, where)
        if d.get("format") != DIST_FORMAT_VERSION:
            raise FormatVersionError(f"{where} has format {d.get('format')}, expected {DIST_FORMAT_VERSION}")
        gv = GlobalVersion.parse(d, where, version)
        self._manifests[key] = gv
        return gv

    def manifest(self, version: int, job: str) -> GlobalVersion:
        """The manifest of global version ``version`` put by job ``job``, read and checked, whether or not the
        pointer lists it (``repair``)."""
        return self._load(RootPointer(job, versions=((version, job),)), version)

    def _load_all(self, p: RootPointer | None) -> list[GlobalVersion]:
        out = []
        for v in ([] if p is None else p.numbers()):
            try:
                out.append(self._load(p, v))
            except VersionNotFound:
                pass  # dropped since the pointer was read: skipped, as a local root skips it
        return out

    def read(self, version: int) -> GlobalVersion:
        p = self.pointer()
        if p is None:
            raise VersionNotFound(f"global version {version} is not in {self.remote} (it holds none)")
        return self._load(p, version)

    def versions(self) -> list[GlobalVersion]:
        return self._load_all(self.pointer())

    def latest(self) -> GlobalVersion | None:
        while True:
            p = self.pointer()
            if p is None or not p.versions:
                return None
            try:
                return self._load(p, p.versions[-1][0])
            except VersionNotFound:
                continue  # dropped since the pointer was read (a newer one was listed first): read it again

    def commit(self, gv: GlobalVersion) -> None:
        """Make ``gv`` a global version: its manifest put, then the pointer swapped to list it (only if this
        job still owns the root: else RemoteTakenOver and nothing of it is listed)."""
        self.commit_many([gv])

    def commit_many(self, gvs) -> None:
        """Make every one of ``gvs`` (numbers ascending, past every listed one) a global version at once: their
        manifests put, then one pointer swap listing them all (only if this job still owns the root: else
        RemoteTakenOver and none of them is listed). A publication that caught up with several saves."""
        gvs = list(gvs)
        p = self._owned()
        numbers = [gv.version for gv in gvs]
        if not gvs or numbers != sorted(set(numbers)) or numbers[0] <= max(p.numbers(), default=0):
            raise InvalidArgument(f"global versions {numbers} are not new and ascending (listed: {list(p.numbers())})")
        fs.crash_point("dist_before_manifest")
        for gv in gvs:
            self.objects.put(manifest_key(gv.version, self.job), seal("manifest", gv.to_dict()))
        fs.crash_point("dist_manifest_put")
        self._swap(p, p._replace(versions=p.versions + tuple((gv.version, self.job) for gv in gvs)))
        fs.crash_point("dist_after_manifest")

    def drop(self, versions) -> None:
        p = self._owned()
        numbers = p.numbers()
        drop = set(versions) & set(numbers)
        if numbers and numbers[-1] in drop:
            raise InvalidArgument("the newest global version cannot be dropped")
        if not drop:
            return
        self._swap(p, p._replace(versions=tuple(e for e in p.versions if e[0] not in drop)))
        delete_with_proof(self.objects, [p.manifest_key(v) for v in sorted(drop)], self._proof)

    # -- rank stores ----------------------------------------------------------------------------------
    def gen_dir(self, generation: int) -> str:
        return os.path.join(self.local, f"gen-{generation:06d}")

    def store_path(self, rel: str) -> str:
        """The local directory of rank store ``rel`` on this node (made on its first open)."""
        parts = rel.split("/")
        if len(parts) != 2 or not all(p.startswith(("gen-", "rank-")) for p in parts):
            raise InvalidArgument(f"{rel!r} is not a rank store's name (gen-GGGGGG/rank-RRRRR)")
        return os.path.join(self.local, *parts)

    def remove_local_leftovers(self) -> list[int]:
        """Delete this node's directories of generations the root no longer lists (their objects were
        deleted by retention, or they were never listed); returns their numbers. Every rank of a job calls it
        at start-up, after rank 0's claim: nothing of this job reads an unlisted generation."""
        listed = set(self.generations())
        removed = []
        for name in os.listdir(self.local) if os.path.isdir(self.local) else []:
            m = _GEN_DIR.match(name)
            if m and int(m.group(1)) not in listed:
                # (ranks sharing this node's directory may remove it at the same time)
                shutil.rmtree(os.path.join(self.local, name), ignore_errors=True)
                removed.append(int(m.group(1)))
        return sorted(removed)

    def open_store(self, rel: str, *, readonly: bool = False, create: bool = False, compaction=None):
        """Rank store ``rel``: its local directory on this node, its remote under the prefix. A writable open
        whose local directory was written by a writer the bucket has moved past (another node took the rank
        store over since), or whose takeover found the stale writer gone on past what it recovered and deleting
        what that read (``RemoteTakenOver`` from the claim), discards that directory and recovers the store
        from the bucket again (``CLAIM_TRIES`` opens at most)."""
        path = self.store_path(rel)

        def attempt():
            return _store.open(path, readonly=readonly, create=create, compaction=compaction,
                               remote=self.objects.sub(rel), cache_bytes=self.cache_bytes,
                               remote_every=None if readonly else EXPLICIT_COPY_POINTS)

        for tries in range(1, CLAIM_TRIES + 1):
            try:
                return attempt()
            except RemoteTakenOver as exc:
                if readonly or tries == CLAIM_TRIES:
                    raise
                # a directory another node's takeover left behind, or a recovery whose claim found the stale
                # writer's copy point no longer keeping what it read (remote._check_owner): recovered again
                log.warning("cnrstore: %s was written by a writer of %s that another node has taken over since, or "
                            "recovered from a copy point its stale writer has moved past (%s); discarding it and "
                            "recovering the rank store from the bucket", path, rel, exc)
                shutil.rmtree(path, ignore_errors=True)
        raise AssertionError("unreachable")


def open_root(path, *, remote: str | None = None, remote_options: dict | None = None,
              remote_timeout_s: float | None = None, cache_bytes: int | None = None) -> Root:
    """The multi-rank root at ``path`` (a shared directory), or with ``remote`` the root in that bucket
    prefix whose rank stores keep their local files under ``path`` (this node's disk)."""
    if remote is None:
        if any(x is not None for x in (remote_options, remote_timeout_s, cache_bytes)):
            raise InvalidArgument("remote_options, remote_timeout_s and cache_bytes need remote= (the bucket "
                                  "prefix of the root)")
        return Root(path)
    if isinstance(remote, ObjectStore):
        return RemoteRoot(path, objects=remote, cache_bytes=cache_bytes)
    if not isinstance(remote, str):
        raise InvalidArgument(f"remote={remote!r}: pass a URL such as 's3://bucket/prefix'")
    return RemoteRoot(path, remote, remote_options, timeout_s=remote_timeout_s, cache_bytes=cache_bytes)
