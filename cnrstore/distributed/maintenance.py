"""Offline maintenance of a multi-rank root, local or in a bucket (the CLI's ``info``, ``retain`` and ``gc`` on
a root): what the root holds, retention of its global versions, and the space of rank-store versions that no
global version names.

``describe`` only reads. ``retain`` and ``collect`` change what a job writes, so they need the root to
themselves:

- a local root (``Root``): every rank store there is opened writable first, so its lock is held (a job that
  holds one: StoreLocked, and nothing is changed);
- a bucket root (``RemoteRoot``): the root is claimed for this process (``RemoteRoot.create``) and ``collect``
  opens each rank store writable in the root's local directory, which takes it over from the job's node. A job
  still running on the root fails at its next save (RemoteTakenOver); a job started later claims the root back
  and goes on from the newest global version (its nodes recover their rank stores from the bucket).

Neither torch nor a process group is needed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from ..errors import InvalidArgument, StoreNotFound
from .manifest import Root
from .remote_root import RemoteRoot

__all__ = ["RootGCReport", "RootRetainReport", "StoreGC", "collect", "describe", "retain"]


def describe(root: Root) -> dict:
    """What ``root`` holds: its owner job (a bucket root's pointer; None for a local root), its generations
    with their plans (world size, row ids, tables ``{name: [rows, dim]}``, the global versions that read
    them), how many global versions it has and the newest (version, step, created, generation)."""
    root.check()
    pointer = root.pointer() if isinstance(root, RemoteRoot) else None
    gvs = root.versions()
    generations = []
    for g in root.generations():
        plan = root.plan_of(g)
        generations.append({"generation": g, "world_size": plan.world_size, "row_ids": plan.row_ids,
                            "tables": {name: [n, d] for name, (n, d) in sorted(plan.tables.items())},
                            "global_versions": [gv.version for gv in gvs if gv.generation == g]})
    newest = gvs[-1] if gvs else None
    return {"root": root.remote or root.path, "remote": root.remote,
            "local": root.local if isinstance(root, RemoteRoot) else root.path,
            "owner": None if pointer is None else pointer.owner, "generations": generations,
            "global_versions": len(gvs),
            "newest": None if newest is None else {"version": newest.version, "step": newest.step,
                                                   "created": newest.created, "generation": newest.generation}}


@dataclass
class RootRetainReport:
    """What ``retain`` did: global versions dropped and kept, generations removed (none left referring)."""

    dropped: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    generations_removed: list[int] = field(default_factory=list)


@dataclass
class StoreGC:
    """``collect`` on one rank store: its local versions dropped (no global version names them), what its
    ``gc`` reclaimed, and for a bucket root the bytes of its objects under the prefix before and after (its
    close's copy point deletes the objects no version needs)."""

    store: str
    versions_dropped: list[int] = field(default_factory=list)
    bytes_reclaimed: int = 0
    segments_deleted: int = 0
    bucket_bytes_before: int | None = None
    bucket_bytes_after: int | None = None
    incomplete: str | None = None

    @property
    def bucket_bytes_freed(self) -> int | None:
        if self.bucket_bytes_before is None or self.bucket_bytes_after is None:
            return None
        return self.bucket_bytes_before - self.bucket_bytes_after


@dataclass
class RootGCReport:
    stores: list[StoreGC] = field(default_factory=list)

    @property
    def bytes_reclaimed(self) -> int:
        return sum(s.bytes_reclaimed for s in self.stores)

    @property
    def bucket_bytes_freed(self) -> int | None:
        freed = [s.bucket_bytes_freed for s in self.stores]
        return None if not freed or None in freed else sum(freed)

    @property
    def incomplete(self) -> str | None:
        notes = [f"{s.store}: {s.incomplete}" for s in self.stores if s.incomplete]
        return "; ".join(notes) or None

    def to_json(self) -> dict:
        return {"stores": [{**s.__dict__, "bucket_bytes_freed": s.bucket_bytes_freed} for s in self.stores],
                "bytes_reclaimed": self.bytes_reclaimed, "bucket_bytes_freed": self.bucket_bytes_freed,
                "incomplete": self.incomplete}


def _rank_stores(root: Root) -> list[str]:
    """Every rank store of the root's generations (by their plans), and any other a manifest names."""
    rels = [root.store_rel(g, r) for g in root.generations() for r in range(root.plan_of(g).world_size)]
    for gv in root.versions():
        rels.extend(root.rank_stores(gv))
    return list(dict.fromkeys(rels))


def _open_all(root: Root, rels: list[str], stack: contextlib.ExitStack) -> dict:
    """{rel: the rank store, open writable} of those of ``rels`` that exist (kept open by ``stack``): a local
    root's rank stores locked, a bucket root's taken over into its local directory."""
    stores = {}
    for rel in rels:
        if not isinstance(root, RemoteRoot) and not os.path.isdir(root.store_path(rel)):
            continue  # (a rank that never opened its store)
        try:
            stores[rel] = stack.enter_context(root.open_store(rel))
        except StoreNotFound:
            continue  # (a bucket root's rank that never made a copy point)
    return stores


def retain(root: Root, keep_last: int, *, progress=None) -> RootRetainReport:
    """Keep the newest ``keep_last`` global versions of ``root`` (never fewer than the newest), drop the
    others' manifests (``Root.drop``), then remove the generations no global version reads any more (all
    but the newest generation may go). Needs the root to itself (module doc). The rank stores' space is
    reclaimed by ``collect``. ``progress(done, total, note)``: once before and once after."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise InvalidArgument(f"keep_last must be a positive integer, got {keep_last!r}")
    root.check()
    if progress is not None:
        progress(0, 1, f"keeping the newest {keep_last} global version(s)")
    with contextlib.ExitStack() as stack:
        if isinstance(root, RemoteRoot):
            root.create()  # the claim: from now on the job that wrote the root fails at its next save
        else:
            _open_all(root, _rank_stores(root), stack)  # their locks, until the manifests are dropped
        numbers = root.version_numbers()
        drop = numbers[:-keep_last]
        root.drop(drop)
    gens = root.generations()
    removed = root.remove_unreferenced_generations(gens[-1]) if gens else []
    if progress is not None:
        progress(1, 1, f"dropped {len(drop)} global version(s)")
    return RootRetainReport(dropped=list(drop), kept=root.version_numbers(), generations_removed=removed)


def _bucket_bytes(root: Root, rel: str) -> int | None:
    if not isinstance(root, RemoteRoot):
        return None
    return sum(root.objects.sub(rel).list_tree("").values())


def collect(root: Root, *, progress=None) -> RootGCReport:
    """Reclaim the space of every rank store's local versions that no global version names (a save that
    never became a global version, or one ``retain`` dropped): each rank store of each generation is opened
    writable, those versions dropped (``Store.drop_versions``, the newest too, as a job's start-up does),
    ``Store.gc`` run, and the store closed (a bucket root's: its copy point deletes the objects no version
    needs). Needs the root to itself (module doc). ``progress(done, total, note)``: per rank store."""
    root.check()
    if isinstance(root, RemoteRoot):
        root.create()  # the claim first: no job can add a global version that names what is dropped here
    referenced = root.named_local_versions()
    rels = _rank_stores(root)
    report = RootGCReport()
    before = {rel: _bucket_bytes(root, rel) for rel in rels}  # (before the takeovers, which write objects too)
    with contextlib.ExitStack() as stack:
        stores = _open_all(root, rels, stack)  # every lock (or takeover) before anything is dropped
        for i, rel in enumerate(rels):
            if progress is not None:
                progress(i, len(rels), rel)
            store = stores.get(rel)
            if store is None:
                continue
            entry = StoreGC(rel, bucket_bytes_before=before[rel])
            keep = referenced.get(rel, set())
            drop = {vi.version for vi in store.versions()} - keep
            if drop:
                entry.versions_dropped = store.drop_versions(drop, allow_newest=True)
            gc = store.gc()
            entry.bytes_reclaimed, entry.segments_deleted, entry.incomplete = (gc.bytes_reclaimed,
                                                                              gc.segments_deleted, gc.incomplete)
            stores.pop(rel)
            store.close()  # (a bucket root's rank store: the copy point that deletes what no version needs)
            entry.bucket_bytes_after = _bucket_bytes(root, rel)
            report.stores.append(entry)
    if progress is not None:
        progress(len(rels), len(rels), "done")
    return report
