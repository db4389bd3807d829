"""Rebuild a store prefix's pointer ``CURRENT`` from its objects (``cnrstore --remote URL repair DIR``,
``repair_pointer``), as leveldb's ``RepairDB`` rebuilds a database from its files; the multi-rank root's
counterpart is ``cnrstore.distributed.repair_root``.

A pointer is never deleted, but an operator's ``rm``, a lifecycle rule or a partial copy can lose it (or a
crafted write damage it) while the writers' folders are all there. Readers then get ``RemoteObjectMissing``
(``remote.pointer_missing``) or ``CorruptionError``, ``create=True`` refuses the prefix, and a writer that took
the prefix over cannot write it (its claim names a pointer that is gone). The repair reads what is there:

- every index snapshot ``w/<writer>/index/<generation>.mdb`` is a candidate, newest generation first (ties:
  by writer id); the first that **verifies** is chosen, the others tried before it are reported (``problems``);
- a snapshot verifies when it opens as an LMDB index (installed into a scratch directory, as a read cache's
  is), every segment it references is in the bucket, in the folder the rebuilt writers' history names, at
  least as long as its committed length (sizes from one listing of the prefix), and (``check_records``,
  the default) ``verify`` of the store it describes, read through the bucket, finds every record it
  references intact (checksum, header, kind, table, block, version);
- the new pointer names that snapshot, its writer (the folder's store id), the rebuilt history, and a
  generation past every snapshot found (so the next copy point's snapshot, one generation on, never
  replaces an existing object: snapshots stay immutable).

**The writers' history** (remote_layout.Writers) is recorded only in pointers and in writers' local
``REMOTE`` files, never in the bucket's other objects, so it is rebuilt from the folders: walking the
snapshot's segment ids downwards, an id in the current writer's folder is that writer's (a writer's folder
holds no id below its first: it allocates from there, and uploads nothing of another's), and an id it
lacks belongs to an earlier writer, the one among the folders holding it (at the committed length) whose
objects start latest (earlier writers' stale objects lie above their own ranges). Each writer's entry
starts at the lowest id of its run (the first entry at 0; the snapshot's writer, if it holds none, past
every id). This may differ from the lost history in the ids no index reads (gaps between runs), which is
safe: the repaired pointer resolves every segment its snapshot names to the object that verified, a writer
that takes the prefix over from it starts past all of them, and a copy point deletes, in these folders,
only what its snapshot and local index do not read. A wrong guess among stale objects fails ``verify`` and
rejects the snapshot; it never names a wrong record.

The pointer is written by one conditional put (only if there is still none, or it is still the damaged
one that was read): the repair's only write, so a repair killed at any point leaves the prefix as it found
it or repaired, and running it again gives the same pointer (a sound pointer is left as it is: ``rebuilt``
False). Nothing is ever deleted: the next copy point collects what the new pointer does not name.

Limit: LMDB keeps no checksum of its pages, so a snapshot damaged inside a page may still open; the record
check then rejects it when its entries do not match the records they name. Damage LMDB itself detects is a
rejection; the scratch directory is removed whatever happens.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field

import xxhash

from ..engine import filenames, fs
from ..engine.core import Engine
from ..engine.marker import marker_bytes
from ..engine.objects import FsspecObjectStore, ObjectStore
from ..engine.remote import Prepared, RemoteSegmentStorage, open_snapshot, pointer_missing
from ..engine.remote_layout import CACHE, Identity, Pointer, Writers, decode_pointer
from ..engine.storage import LocalSegmentStorage
from ..errors import (CnrError, CorruptionError, InvalidArgument, RemoteConflict, RemoteObjectMissing,
                      RemoteStorageError, StoreNotFound)
from .verify import verify_store

__all__ = ["StorePointerRepairReport", "repair_pointer", "pointer_needs_repair"]

_SNAPSHOT = re.compile(rf"^{filenames.REMOTE_WRITERS_DIR}/([0-9a-f]{{32}})/{filenames.REMOTE_INDEX_DIR}/([0-9a-f]{{16}})\.mdb$")
_SEGMENT = re.compile(rf"^(?:{filenames.REMOTE_WRITERS_DIR}/([0-9a-f]{{32}})/)?{filenames.REMOTE_SEGMENTS_DIR}/([^/]+)$")
_FIX = "run `cnrstore --remote URL repair DIR` again once the bucket is restored"


@dataclass
class StorePointerRepairReport:
    """What ``repair_pointer`` did: ``rebuilt`` (a new pointer was put; False: it was there and sound, nothing
    done), the pointer found before (``previous``: "missing", "damaged: ..." or "sound"), the snapshot chosen
    (``snapshot``, its ``writer``, the pointer's ``generation`` and ``writers`` history), the ``versions`` it
    lists, and the snapshots tried before it that did not verify (``problems``, one line each, newest
    first)."""

    url: str = ""
    rebuilt: bool = False
    previous: str = "missing"
    snapshot: str | None = None
    writer: str | None = None
    generation: int | None = None
    writers: list = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"url": self.url, "rebuilt": self.rebuilt, "previous": self.previous, "snapshot": self.snapshot,
                "writer": self.writer, "generation": self.generation, "writers": self.writers,
                "versions": self.versions, "problems": self.problems, "ok": self.ok}


def _objects(remote, remote_options: dict | None) -> ObjectStore:
    if isinstance(remote, ObjectStore):
        if remote_options is not None:
            raise InvalidArgument("remote_options belong to a remote URL; an ObjectStore is connected already")
        return remote
    if not isinstance(remote, str):
        raise InvalidArgument(f"remote={remote!r}: pass the store's object-store URL (s3://bucket/prefix)")
    return FsspecObjectStore(remote, remote_options)


def _read_current(objects: ObjectStore) -> tuple[str, str | None]:
    """(what the pointer is: "missing", "damaged: ..." or "sound"; its tag, None if missing)."""
    try:
        data, tag = objects.get_tagged(filenames.REMOTE_POINTER)
    except RemoteObjectMissing:
        return "missing", None
    try:
        decode_pointer(data, objects.where(filenames.REMOTE_POINTER), _FIX, tag)
    except CorruptionError as exc:
        return f"damaged: {exc}", tag
    return "sound", tag


def pointer_needs_repair(remote, remote_options: dict | None = None) -> bool:
    """Whether the store prefix ``remote`` has a pointer to rebuild: it is there and does not decode, or it is
    missing while the prefix holds the store's objects (``remote.pointer_missing``). False for a sound pointer
    and for a prefix holding no store (nothing to rebuild from)."""
    objects = _objects(remote, remote_options)
    state, _tag = _read_current(objects)
    if state == "missing":
        return pointer_missing(objects, filenames.REMOTE_POINTER) is not None
    return state != "sound"


def repair_pointer(remote, remote_options: dict | None = None, *, check_records: bool = True,
                   progress=None) -> StorePointerRepairReport:
    """Rebuild the pointer ``CURRENT`` of the store prefix ``remote`` (a URL, or a connected ``ObjectStore``)
    from its newest snapshot that verifies, when it is missing or damaged (module doc); a sound pointer is
    left as it is. ``check_records``: also read back every record the snapshot references (its versions'
    checksums: reads the bucket's bytes once); False checks the snapshot and its segments' lengths only.
    ``progress(done, total)`` follows the snapshots tried.

    Raises StoreNotFound if the prefix is empty, RemoteStorageError if the bucket does not exist,
    RemoteObjectMissing (a CorruptionError) if no snapshot verifies (each one's reason in the message),
    RemoteConflict if someone else wrote the pointer while the repair ran (run it again). Deletes nothing."""
    objects = _objects(remote, remote_options)
    report = StorePointerRepairReport(url=objects.url)
    report.previous, tag = _read_current(objects)
    if report.previous == "sound":
        return report
    listing = objects.list_tree("")
    snapshots = sorted(((int(m.group(2), 16), m.group(1), key) for key in listing if (m := _SNAPSHOT.match(key))),
                       key=lambda s: (-s[0], s[1]))
    if not snapshots:
        if tag is None and objects.bucket_exists() is False:
            raise RemoteStorageError(f"{objects.url}: the bucket does not exist; create it, or check the URL")
        if tag is None and pointer_missing(objects, filenames.REMOTE_POINTER) is None:
            raise StoreNotFound(f"{objects.url} holds no cnrstore store (no {filenames.REMOTE_POINTER}, no "
                                "writers' folders): nothing to repair")
        raise RemoteObjectMissing(f"{objects.where(filenames.REMOTE_POINTER)} is {report.previous.split(':')[0]} and "
                                  f"{objects.url} holds no index snapshot ({filenames.REMOTE_WRITERS_DIR}/<writer>/"
                                  f"{filenames.REMOTE_INDEX_DIR}/<generation>.mdb) to rebuild it from: restore it "
                                  "from a copy (a bucket with versioning keeps the previous one)",
                                  objects.where(filenames.REMOTE_POINTER))
    folders = _segment_folders(listing)
    generation = snapshots[0][0]
    for i, (gen, writer, key) in enumerate(snapshots):
        try:
            pointer, versions = _verified(objects, key, writer, listing[key], folders, generation, check_records)
        except CnrError as exc:
            report.problems.append(f"snapshot {key} (generation {gen}): not used: {type(exc).__name__}: {exc}")
        else:
            _put(objects, pointer, tag)
            report.rebuilt = True
            report.snapshot, report.writer, report.generation = key, writer, pointer.generation
            report.writers, report.versions = pointer.writers.to_json(), versions
            if progress is not None:
                progress(len(snapshots), len(snapshots))
            return report
        if progress is not None:
            progress(i + 1, len(snapshots))
    raise RemoteObjectMissing(f"{objects.where(filenames.REMOTE_POINTER)} is {report.previous.split(':')[0]} and none "
                              f"of the {len(snapshots)} index snapshot(s) of {objects.url} verifies; nothing was "
                              f"changed: {'; '.join(report.problems)}", objects.where(filenames.REMOTE_POINTER))


def _put(objects: ObjectStore, pointer: Pointer, tag: str | None) -> None:
    try:
        objects.put_if(filenames.REMOTE_POINTER, pointer.encode(), tag)
    except RemoteConflict as exc:
        raise RemoteConflict(f"{objects.where(filenames.REMOTE_POINTER)} was written by someone else while the repair "
                             f"ran ({exc}); run the repair again (it leaves a sound pointer as it is)") from exc


def _segment_folders(listing: dict[str, int]) -> dict[str, dict[int, int]]:
    """{writer ("" for a format-1 prefix's root): {segment id: object size}} from a listing of the prefix."""
    folders: dict[str, dict[int, int]] = {}
    for key, size in listing.items():
        m = _SEGMENT.match(key)
        if m is None:
            continue
        seg = filenames.parse_segment_name(m.group(2))
        if seg is not None:
            folders.setdefault(m.group(1) or "", {})[seg] = size
    return folders


def rebuild_history(writer: str, segments: dict[int, int], folders: dict[str, dict[int, int]]) -> Writers:
    """A writers' history ending with ``writer`` that places every segment of ``segments`` ({id: committed
    length}) in a folder of ``folders`` holding it at that length or longer (module doc).
    CorruptionError naming the first segment no folder holds so."""
    order, lowest, cur = [writer], {}, writer
    for seg in sorted(segments, reverse=True):
        need = segments[seg]
        held = folders.get(cur, {}).get(seg)
        if held is None:
            candidates = [w for w, segs in folders.items() if w not in order and segs.get(seg, -1) >= need]
            if not candidates:
                where = ", ".join(sorted(filenames.remote_folder(w) or "the prefix's root"
                                         for w, segs in folders.items() if seg in segs)) or "no folder"
                raise CorruptionError(f"segment {seg:016x}, which it needs at {need} bytes, is in {where} "
                                      "at that length", filenames.remote_segment_key(seg), None)
            cur = max(candidates, key=lambda w: (min(folders[w]), w))
            order.append(cur)
        elif held < need:
            key = filenames.remote_segment_key(seg, filenames.remote_folder(cur))
            raise CorruptionError(f"segment {key} holds {held} bytes, fewer than the {need} it needs", key, held)
        lowest[cur] = seg
    if writer not in lowest:
        lowest[writer] = max(segments, default=-1) + 1
    entries = [(w, lowest[w]) for w in reversed(order)]
    entries[0] = (entries[0][0], 0)
    return Writers(entries)


def _verified(objects: ObjectStore, key: str, writer: str, size: int, folders: dict, generation: int,
              check_records: bool) -> tuple[Pointer, list[int]]:
    """(the pointer naming snapshot ``key``, the versions it lists) if the snapshot verifies (module doc);
    CnrError saying why not."""
    data = objects.get(key)
    if len(data) != size:
        raise CorruptionError(f"it was listed at {size} bytes and read at {len(data)}", objects.where(key), None)
    scratch = tempfile.mkdtemp(prefix="cnrstore-pointer-repair-")
    try:
        root = os.path.join(scratch, "store")
        index_dir = filenames.index_dir(root)
        os.makedirs(index_dir)
        try:
            index = open_snapshot(data, index_dir)
        except Exception as exc:  # noqa: BLE001 - LMDB's own errors on bytes that are not an environment
            reason = str(exc).replace(f"{index_dir}: ", "").replace(index_dir, "the snapshot")
            raise CorruptionError(f"it does not open as an LMDB index ({reason})", objects.where(key), None) from None
        try:
            with index.read() as view:
                segments = view.segments()
                versions = view.version_numbers()
        except CnrError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged page, an entry that does not decode
            raise CorruptionError(f"its index does not read ({type(exc).__name__}: {exc})", objects.where(key),
                                  None) from None
        finally:
            index.close()
        history = rebuild_history(writer, segments, folders)
        pointer = Pointer(generation, key, len(data), f"{xxhash.xxh3_64_intdigest(data):016x}", writer, history,
                          len(versions), max(versions, default=None))
        if check_records:
            _check_records(root, objects, pointer)
        return pointer, versions
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_records(root: str, objects: ObjectStore, pointer: Pointer) -> None:
    """``verify`` of the store ``pointer`` describes (its index installed at ``root``), every record read from
    the bucket by range (nothing cached); CorruptionError with its first problems."""
    LocalSegmentStorage.create(root)
    with open(filenames.marker_path(root), "wb") as f:
        f.write(marker_bytes())
    storage = RemoteSegmentStorage(root, fs.DEFAULT, objects,
                                   Prepared(Identity(objects.url, uuid.uuid4().hex, CACHE), pointer, None),
                                   readonly=True, cache_bytes=0)
    engine = Engine.open(root, fs.DEFAULT, storage, readonly=True)
    try:
        found = verify_store(engine)
    finally:
        engine.close()
    if not found.ok:
        more = f" (and {len(found.problems) - 2} more)" if len(found.problems) > 2 else ""
        raise CorruptionError(f"verify of its versions through the bucket found {len(found.problems)} problem(s): "
                              f"{'; '.join(found.problems[:2])}{more}", pointer.snapshot, None)
