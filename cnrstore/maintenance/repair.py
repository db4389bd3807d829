"""Rebuild a store's index from its segment log, salvaging (leveldb's RepairDB is the model).

The log is self-describing: every record is checksummed and names its kind, object, block and version;
each commit appends a COMMIT record (the version's info, the catalog entries of the tables it wrote, the
dense ids it wrote, and the count and flags of every block record it wrote); each compaction and each
drop appends an ANCHOR record (every block's read chain at its version, the dense heads and the
catalog); each drop a DROP record (the versions kept).

Two invariants govern repair (docs/DESIGN.md, "Repair"):

* **R1 — the repaired index never reads differently from the committed history.** A (version, block)
  pair is indexed only along a read chain that is *proven*: every record of it is present and is the
  record that history wrote there (the COMMIT's count and flags, an ANCHOR's listing, or the intact
  index's entry). A record that is damaged or gone is never skipped over: the pairs that need it are
  *damaged*, and their index entry points at the damaged bytes (or at segment 0, which no segment has),
  so that a read of them raises CorruptionError instead of returning older data.
* **R2 — repair never leaves a store less readable than it found it.** A damaged record costs only the
  (version, block) pairs whose chain visits it: the version stays listed, its damaged blocks are
  recorded in the index (meta ``damaged``) and named by ``verify`` and ``cnrstore ls``. When the index
  is intact, it is a source of truth: every entry it holds whose record the scan finds whole is kept,
  so nothing the old index could read is dropped.

Scan: every segment record by record; a bad stretch is skipped (the scan resumes at the next record
magic whose checksum holds) and, when the stretch is exactly one record whose header still names it,
*attributed* to that record (a "suspect": its key is known, its bytes are not trustworthy).

Proof (``_prove``, in named steps: the catalog, the states from the log, each version decided, the
report): per version, ascending (``_log_states``, ``_LogProof``), the state (per block its read chain, a
``Chain`` of ``Link``s newest first, or a chain not proven, with why) is derived from the parent's state
and the version's COMMIT; a materialized baseline (a COMPACTED record with BASELINE) resets a block; an
ANCHOR resets every block. The chain *from an index entry* does not depend on where a walk began, so
every entry's chain is remembered: a delta's base is looked up there (whether it came from a COMMIT, a
compacted baseline or an ANCHOR listing). Where a version's ancestry is not proven (an ancestor's COMMIT
or the ANCHOR that covered it is damaged), and the scan found no damage it could not attribute, the chain
is taken from the row records' own headers (the walk the index would do over every record present). A
damaged COMMIT's version is rebuilt from its records' headers and what its damaged body still decodes
to. Every walk over a block's entries (the headers', the old index's, the damage of each new entry)
asks the one read-chain rule, ``engine/chain.py``; a delta whose base has no entry ends its chain in a
lost link (``chain.missing_base``), never skipped.

The new index is built in ``index.repair-tmp/`` beside ``index/``, synced, and swapped in: the old
``index/`` is renamed ``index.damaged-<time>/`` (never deleted). Segment files are not changed, except
that one whose header is damaged (so that no record in it can be read) is renamed ``<name>.damaged``.
Counters are set past every version, table id, dense id and segment id found, so none is reused. Every
COMMIT, ANCHOR and newest DROP found is indexed in ``log`` and the liveness rule (``version_edit.prune_log``)
decides which stay, so that a GC after repair keeps every record a later repair needs.
"""

from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import msgpack
import numpy as np

from ..engine import chain as chain_rule
from ..engine import filenames, fs, record, schema, segments, version_edit
from ..engine import remote as remote_tier
from .remote_pointer import StorePointerRepairReport, pointer_needs_repair, repair_pointer
from .verify import LOST_SEGMENT, damaged_blocks, verify_store
from ..errors import CnrError, CorruptionError, InvalidArgument, StoreNotFound
from ..engine.core import Engine
from ..engine.index import DenseLoc, Index, RowLoc, finish_interrupted_install, install_built_index
from ..engine.msgpack_safe import unpack_bounded
from ..engine.lock import ProcessLock
from ..engine.storage import LocalSegmentStorage
from ..engine.marker import FORMAT_VERSION, read_marker
from ..engine.schema import TableRecord, table_from_log
from ..engine.version_edit import AnchorLog, DropLog, VersionEdit

Progress = Callable[[int, int], None]

# LOST_SEGMENT (verify.py): the segment id of an index entry whose record repair knows is lost (no segment
# has id 0): reads of it raise CorruptionError (the segment is missing), so a lost record is never skipped.
#: Index meta key of the damaged (version, block) pairs repair recorded (docs/FORMAT.md; schema.DAMAGED).
DAMAGED_META = schema.DAMAGED.name


@dataclass
class RepairReport:
    """What ``repair`` did. ``ok`` is True when every committed version found was recovered whole."""

    path: str
    versions_recovered: list[int] = field(default_factory=list)
    #: version -> why it could not be recovered at all (its data is left in the log, unindexed)
    versions_lost: dict[int, str] = field(default_factory=dict)
    #: recovered version -> what of it is damaged (reads of those blocks raise CorruptionError)
    damaged: dict[int, list[str]] = field(default_factory=dict)
    #: versions retain had dropped before the repair: left dropped, not damage
    versions_dropped: list[int] = field(default_factory=list)
    tables_recovered: list[str] = field(default_factory=list)
    segments_scanned: int = 0
    records_scanned: int = 0
    bytes_scanned: int = 0
    bad_records: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: where the previous index was moved (None if there was none)
    old_index: str | None = None
    #: whether the previous index opened and served as a source of truth
    used_index: bool = False
    #: with ``remote=``: the rebuild of the prefix's pointer ``CURRENT`` that ran first because it was missing
    #: or damaged (remote_pointer.StorePointerRepairReport; None: it was sound, or no store was there)
    pointer: "StorePointerRepairReport | None" = None

    @property
    def ok(self) -> bool:
        return not self.versions_lost and not self.damaged and (self.pointer is None or self.pointer.ok)

    def to_json(self) -> dict:
        return {"ok": self.ok, "path": self.path, "versions_recovered": self.versions_recovered,
                "versions_lost": {str(v): why for v, why in sorted(self.versions_lost.items())},
                "damaged": {str(v): whats for v, whats in sorted(self.damaged.items())},
                "versions_dropped": self.versions_dropped, "tables_recovered": self.tables_recovered,
                "segments_scanned": self.segments_scanned, "records_scanned": self.records_scanned,
                "bytes_scanned": self.bytes_scanned, "bad_records": self.bad_records, "notes": self.notes,
                "old_index": self.old_index, "used_index": self.used_index,
                "pointer": None if self.pointer is None else self.pointer.to_json()}


class _Found:
    """What the scan found: record locations by key, the parsed COMMIT / ANCHOR bodies, and the
    records whose bytes are damaged but whose header still names them (suspects)."""

    def __init__(self):
        self.rows: dict[tuple[int, int, int], list] = {}  # (tid, block, version) -> [(RowLoc, compacted)]
        self.dense: dict[tuple[int, int], DenseLoc] = {}
        self.commits: dict[int, tuple[VersionEdit, DenseLoc | None]] = {}  # the edit each COMMIT encodes
        self.anchors: dict[int, list[tuple[AnchorLog, DenseLoc]]] = {}
        self.drop: tuple[DropLog, DenseLoc] | None = None  # the newest DROP record
        self.valid: dict[tuple[int, int], tuple] = {}  # (segment, offset) -> (length, kind, object, block, version, count, flags, base)
        self.suspect_rows: dict[tuple[int, int, int], RowLoc] = {}
        self.suspect_dense: dict[tuple[int, int], DenseLoc] = {}
        self.suspect_log: dict[tuple[int, int], tuple[DenseLoc, dict | None]] = {}
        self.unattributed: list[str] = []  # damaged stretches no one record's header accounts for
        self.max_version = 0
        self.max_table = 0
        self.max_dense = 0
        self.seen_versions: set[int] = set()
        self.codec_of: dict[tuple[int, int], int] = {}  # (segment, offset) of a row record -> its codec id
        self.compacted_at: dict[int, set] = {}  # version -> {(tid, block)} with a COMPACTED record there
        self._by_block: dict[tuple[int, int], list[int]] | None = None

    def row(self, tid: int, block: int, version: int, count: int | None = None, flags: int | None = None,
            compacted: bool = False):
        """A present record of (tid, block, version): compacted, or the checkpoint's with that count and
        flags (a merge within a version leaves the earlier record behind: the count tells them apart)."""
        best = None
        for loc, is_compacted in self.rows.get((tid, block, version), ()):
            if compacted:
                if is_compacted:
                    best = loc  # the later one in log order (a GC copy of a copy)
            elif not is_compacted and (count is None or (loc.count == count and loc.flags == flags)):
                best = loc  # the later one in log order
        return best

    def by_block(self) -> dict[tuple[int, int], list[int]]:
        """(tid, block) -> sorted versions with a present or suspect record."""
        if self._by_block is None:
            out: dict[tuple[int, int], set] = {}
            for tid, block, v in list(self.rows) + list(self.suspect_rows):
                out.setdefault((tid, block), set()).add(v)
            self._by_block = {k: sorted(vs) for k, vs in out.items()}
        return self._by_block


def repair(path, progress: Progress | None = None, *, filesystem: fs.FileSystem | None = None,
           remote: str | None = None, remote_options: dict | None = None,
           check_records: bool = True) -> RepairReport:
    """Rebuild the index of the store at ``path`` from its segment log (and its old index, when that
    still opens); see the module docstring.

    With ``remote`` (the store's object-store URL, engine/remote.py) the log is the local segments and
    every segment object under the remote prefix (read from there). A ``path`` that holds no store is
    recovered from the remote alone instead: the index snapshot its pointer names is installed there
    (every version of the last copy point; the report lists them). Whatever ``path`` holds, a pointer that
    is damaged, or missing beside the store's objects, is first rebuilt from the newest snapshot that
    verifies (remote_pointer.repair_pointer; ``report.pointer`` says what it did; ``check_records=False``
    checks each snapshot's index and its segments' lengths, not every record's checksum).

    Takes the store's lock (raises StoreLocked while a writer holds it). Close every handle of the store
    in this process first. ``progress(done, total)`` is called as segment bytes are scanned. Every
    effect on the store's files (renames, the new index's directory and commit, removals) goes through
    ``filesystem`` (default: the real one; tests record it to enumerate repair's crash states).
    """
    if not isinstance(check_records, bool):
        raise InvalidArgument(f"check_records must be True or False, got {check_records!r}")
    filesystem = filesystem if filesystem is not None else fs.DEFAULT
    root = os.path.abspath(os.fspath(path))
    rebuilt = None
    if remote is not None and pointer_needs_repair(remote, remote_options):
        rebuilt = repair_pointer(remote, remote_options, check_records=check_records)
    report = _repair(root, progress, filesystem, remote, remote_options)
    if rebuilt is not None:
        report.pointer = rebuilt
        report.notes.insert(0, pointer_note(rebuilt))
    return report


def pointer_note(rebuilt: StorePointerRepairReport) -> str:
    """One line saying what ``repair_pointer`` did."""
    if not rebuilt.rebuilt:
        return f"the pointer {filenames.REMOTE_POINTER} of {rebuilt.url} is there and sound; nothing to rebuild"
    return (f"the pointer {filenames.REMOTE_POINTER} of {rebuilt.url} was {rebuilt.previous.split(':')[0]}; rebuilt "
            f"(generation {rebuilt.generation}) from the snapshot {rebuilt.snapshot}, listing "
            f"{len(rebuilt.versions)} version(s); {len(rebuilt.problems)} newer snapshot(s) did not verify "
            "(nothing deleted)")


def _repair(root: str, progress: Progress | None, filesystem: fs.FileSystem, remote, remote_options) -> RepairReport:
    if remote is not None and not os.path.exists(filenames.marker_path(root)):
        return _recover_from_remote(root, remote, remote_options, filesystem)
    if remote is not None and os.path.isdir(root):
        ident = remote_tier.read_identity(root)
        if ident is not None and ident.role == "cache":
            return _reinstall_cache(root, remote, remote_options, filesystem)
    if remote is None:
        remote_tier.check_local_only(root, "repair")
    LocalSegmentStorage.check_directory(root)
    if not os.path.exists(filenames.marker_path(root)) or not os.path.isdir(filenames.segments_dir(root)):
        raise StoreNotFound(f"no cnrstore store at {root!r} (no marker or no segments/ directory); repair "
                            "needs the store's CNRSTORE marker and segments/")
    read_marker(root)
    lock = ProcessLock(root)
    lock.acquire()
    try:
        report = RepairReport(root)
        _finish_interrupted_install(root, filesystem, report)

        def storage_():
            return LocalSegmentStorage(root, filesystem) if remote is None else \
                remote_tier.repair_storage(root, remote, remote_options, filesystem)

        if _store_is_healthy(root, storage_, report, progress):
            return report
        old = _read_old_index(root, report)
        storage = storage_()
        try:
            found, lengths = _scan(storage, report, progress)
            plan = _prove(found, report, old)
            _install(root, filesystem, storage, found, lengths, plan, report, FORMAT_VERSION, old)
        finally:
            storage.close()
        return report
    finally:
        lock.release()


def _store_is_healthy(root: str, make_storage, report: RepairReport, progress=None) -> bool:
    """Whether the store's index opens and ``verify`` finds nothing wrong with it or the log: then repair
    changes nothing (and leaves nothing behind), and the report says so. The caller holds the lock."""
    if not os.path.isdir(filenames.index_dir(root)):
        return False
    try:
        engine = Engine.open(root, fs.DEFAULT, make_storage(), readonly=True)
    except CnrError:
        return False
    try:
        verified = verify_store(engine, progress)
        if not verified.ok:
            return False
        with engine.read() as view:
            report.versions_recovered = view.version_numbers()
            report.tables_recovered = sorted(view.tables())
    except CnrError:
        return False
    finally:
        engine.close()
    report.used_index = True
    report.notes.append(f"the store is healthy: its index opens and verify found no problem in "
                        f"{verified.records_checked:,} records; nothing was changed")
    return True


# the old index ----------------------------------------------------------------------------------------
#: The meta of an old index that still opens which repair carries over (so that no counter goes back).
_CARRIED_META = (schema.NEXT_VERSION, schema.DROPPED_BELOW, schema.DROP_SEQ, schema.LAST_BASELINE,
                 schema.BYTES_WRITTEN, schema.INCREMENT_BYTES, schema.SAVE_BYTES, schema.MERGE_BYTES,
                 schema.MAX_DELETED_SEGMENT)


@dataclass
class _OldIndex:
    versions: dict[int, dict]
    tables: dict[int, TableRecord]
    dense_names: dict[str, int]
    rows: dict[tuple[int, int], list[tuple[int, RowLoc]]]  # (tid, block) -> [(version, loc)] ascending
    dense: dict[int, list[tuple[int, DenseLoc]]]
    meta: dict[schema.MetaKey, object]  # _CARRIED_META
    damaged: dict[int, list[dict]]


def _read_old_index(root: str, report: RepairReport) -> _OldIndex | None:
    """The old index's content, if it opens (it is a source of truth, cross-checked against the log)."""
    path = filenames.index_dir(root)
    if not os.path.isdir(path):
        return None
    try:
        index = Index(path, readonly=True)
    except CnrError as exc:
        report.notes.append(f"the old index cannot be used ({type(exc).__name__}: {exc}); rebuilt from the log alone")
        return None
    try:
        with index.read() as view:
            rows: dict = {}
            for tid, block, v, loc in view.row_entries():
                rows.setdefault((tid, block), []).append((v, loc))
            dense: dict = {}
            for did, v, loc in view.dense_entries():
                dense.setdefault(did, []).append((v, loc))
            meta = {key: key.get(view) for key in _CARRIED_META}
            old = _OldIndex(dict(view.versions()), {info.id: info for info in view.tables().values()},
                            view.dense_names(), rows, dense, meta, damaged_blocks(view))
    except (CnrError, KeyError, ValueError, TypeError) as exc:
        report.notes.append(f"the old index cannot be read ({type(exc).__name__}: {exc}); rebuilt from the log alone")
        return None
    finally:
        index.close()
    report.used_index = True
    return old


# scan -------------------------------------------------------------------------------------------------
def _recover_from_remote(root: str, url: str, options: dict | None, filesystem: fs.FileSystem) -> RepairReport:
    """``repair(path, remote=url)`` of a path with no store: the remote's last copy point installed there, a
    read cache."""
    storage = remote_tier.open_storage(root, url, options, filesystem, readonly=True, create=False)
    storage.close()
    return _cache_report(root, url, storage.generation, "recovered the index of the last copy point")


def _reinstall_cache(root: str, url: str, options: dict | None, filesystem: fs.FileSystem) -> RepairReport:
    """``repair(path, remote=url)`` of a read cache: the remote's newest snapshot installed as its index."""
    pointer = remote_tier.reinstall_cache(root, url, options, filesystem)
    return _cache_report(root, url, pointer.generation, "installed the newest copy point")


def _cache_report(root: str, url: str, generation: int, done: str) -> RepairReport:
    report = RepairReport(root)
    index = Index(filenames.index_dir(root), readonly=True)
    try:
        with index.read() as view:
            report.versions_recovered = view.version_numbers()
            report.tables_recovered = sorted(view.tables())
    finally:
        index.close()
    report.notes.append(f"{root} is a read cache of {url}: {done} (generation {generation}) as its index, every "
                        "version committed by then; segments are read from the remote")
    return report


def _scan(storage: LocalSegmentStorage, report: RepairReport,
          progress: Progress | None) -> tuple[_Found, dict[int, int]]:
    sizes = {seg: storage.size(seg) or 0 for seg in storage.list()}
    total = sum(sizes.values())
    found, lengths, done = _Found(), {}, 0
    for seg, size in sizes.items():
        seg_path = storage.path(seg)
        report.segments_scanned += 1
        unusable = _scan_segment(storage, seg, seg_path, found, report)
        if unusable is None:
            lengths[seg] = size
        else:
            aside = storage.quarantine(seg)  # unreadable by the store, kept as evidence
            report.notes.append(f"segment {seg_path} {unusable}: none of its records can be read; "
                                f"renamed to {os.path.basename(aside)}")
            found.unattributed.append(f"segment {seg_path} ({unusable})")
        done += size
        if progress is not None:
            progress(done, total)
    if progress is not None:
        progress(total, total)
    return found, lengths


def _scan_segment(storage: LocalSegmentStorage, seg: int, seg_path: str, found: _Found,
                  report: RepairReport) -> str | None:
    """Scan one segment into ``found``; None if it was scanned, else why its records are unusable: its
    header is damaged, or it is not a regular file (a link, a FIFO, a device: never read)."""
    unreadable = storage.unreadable(seg)
    if unreadable is not None:
        return unreadable
    with storage.scan(seg) as mm:
        size = len(mm)
        if size == 0:
            return "has a damaged header"
        buf = np.frombuffer(mm, dtype=np.uint8)
        try:
            segments.check_segment_header(buf, seg, seg_path)
        except CorruptionError:
            return "has a damaged header"
        pos, bad_from = segments.SEGMENT_HEADER_BYTES, None
        while pos < size:
            rec, length = _record_at(buf, mm, pos, size, seg_path)
            if rec is None:
                if bad_from is None:
                    bad_from = pos
                nxt = mm.find(record.MAGIC, pos + 1)
                if nxt < 0:
                    break
                pos = nxt
                continue
            if bad_from is not None:
                _bad_stretch(found, report, mm, seg, seg_path, bad_from, pos, at_end=False)
                bad_from = None
            _note(found, rec, seg, pos, length, report)
            pos += length
        if bad_from is not None:
            _bad_stretch(found, report, mm, seg, seg_path, bad_from, size, at_end=True)
        del buf
        return None


def _bad_stretch(found: _Found, report: RepairReport, mm, seg: int, seg_path: str, start: int, end: int,
                 at_end: bool) -> None:
    """Account for bytes [start, end) that hold no valid record: attribute them to the one record whose
    header (unverified) spans exactly that stretch, if there is one; a record cut short by the end of
    the segment is the torn tail of a crash."""
    what = f"{seg_path}: {end - start} bytes at offset {start}" + (" (the end)" if at_end else "")
    if start + record.HEADER_BYTES <= len(mm):
        _magic, kind, _codec, flags, obj, count, block, version, aux_len, body_len = \
            record.HEADER.unpack_from(mm, start)
        length = record.HEADER_BYTES + aux_len + body_len + record.TRAILER_BYTES
        if kind == record.KIND_ROWS:  # a header whose fields disagree is no evidence of anything
            plausible = not flags & ~_KNOWN_FLAGS and aux_len == record.rows_aux_bytes(flags, count)
        elif kind == record.KIND_DENSE:
            plausible = not flags and not count and not block
        else:
            plausible = kind in (record.KIND_COMMIT, record.KIND_ANCHOR, record.KIND_DROP) and not (
                flags or obj or count or block or aux_len)
        if plausible and start + length == end:
            name = {1: "rows", 2: "dense", 3: "commit", 4: "anchor", 5: "drop"}[kind]
            if kind == record.KIND_ROWS:
                base = record.BASE.unpack_from(mm, start + record.HEADER_BYTES)[0] \
                    if flags & record.FLAG_DELTA and aux_len >= record.BASE.size else 0
                found.suspect_rows[(obj, block, version)] = RowLoc(seg, start, length, count, flags, base)
                desc = f"the {name} record of table id {obj} block {block} at version {version}"
            elif kind == record.KIND_DENSE:
                found.suspect_dense[(obj, version)] = DenseLoc(seg, start, length)
                desc = f"the {name} record of dense id {obj} at version {version}"
            else:
                try:  # what the damaged body still decodes to: evidence of last resort, never trusted alone
                    body = unpack_bounded(mm[start + record.HEADER_BYTES + aux_len:start + length
                                             - record.TRAILER_BYTES])
                    body = body if isinstance(body, dict) else None
                except Exception:  # noqa: BLE001 - any decoding failure means "no usable body"
                    body = None
                found.suspect_log[(kind, version)] = (DenseLoc(seg, start, length), body)
                desc = f"the {name} record of version {version}"
            found.max_version = max(found.max_version, version) if kind != record.KIND_DROP else found.max_version
            report.bad_records.append(f"{what} are {desc}, damaged (checksum mismatch)")
            return
        if at_end and start + length > end:
            report.bad_records.append(f"{what} are a record cut short: the torn tail of a crash (skipped)")
            return
    found.unattributed.append(what)
    report.bad_records.append(f"{what} are no valid record (damaged, skipped)")


def _record_at(buf, mm, pos: int, size: int, seg_path: str):
    if pos + record.HEADER_BYTES + record.TRAILER_BYTES > size or mm[pos:pos + 4] != record.MAGIC:
        return None, 0
    *_, aux_len, body_len = record.HEADER.unpack_from(mm, pos)
    length = record.HEADER_BYTES + aux_len + body_len + record.TRAILER_BYTES
    if pos + length > size:
        return None, 0
    try:
        return record.parse(buf[pos:pos + length], seg_path, pos), length
    except CorruptionError:
        return None, 0


def _note(found: _Found, rec: record.Record, seg: int, pos: int, length: int, report: RepairReport) -> None:
    report.records_scanned += 1
    report.bytes_scanned += length
    v = rec.version
    if rec.kind != record.KIND_DROP:
        found.max_version = max(found.max_version, v)
    base = rec.base() if rec.kind == record.KIND_ROWS else 0
    found.valid[(seg, pos)] = (length, rec.kind, rec.object_id, rec.block, v, rec.count, rec.flags, base)
    if rec.kind == record.KIND_ROWS:
        found.seen_versions.add(v)
        found.max_table = max(found.max_table, rec.object_id)
        compacted = bool(rec.flags & record.FLAG_COMPACTED)
        found.rows.setdefault((rec.object_id, rec.block, v), []).append(
            (RowLoc(seg, pos, length, rec.count, rec.flags, base), compacted))
        found.codec_of[(seg, pos)] = rec.codec_id
        if compacted:
            found.compacted_at.setdefault(v, set()).add((rec.object_id, rec.block))
    elif rec.kind == record.KIND_DENSE:
        found.seen_versions.add(v)
        found.max_dense = max(found.max_dense, rec.object_id)
        found.dense[(rec.object_id, v)] = DenseLoc(seg, pos, length)
    else:
        try:  # the edit the record encodes, decoded where commits encode it (version_edit.py)
            edit = version_edit.decode(rec.kind, v, record.log_body(rec))
        except (ValueError, TypeError, msgpack.ExtraData, CorruptionError) as exc:
            report.bad_records.append(f"segment {seg} offset {pos}: undecodable log record ({exc})")
            return
        for info in edit.catalog + (edit.anchor.catalog if edit.anchor is not None else []):
            found.max_table = max(found.max_table, info.id)
        if edit.drop is not None:
            # the newest DROP: by seq, then by the newest version it saw (a store repaired by a cnrstore
            # that did not restore meta drop_seq numbered its later drops from 1 again)
            if found.drop is None or (edit.drop.seq, edit.drop.latest) > (found.drop[0].seq, found.drop[0].latest):
                found.drop = (edit.drop, DenseLoc(seg, pos, length))
        elif edit.anchor is None:
            found.seen_versions.add(v)
            if edit.info["parent"] is not None:
                found.max_version = max(found.max_version, edit.info["parent"])
            for did in edit.dense_names.values():
                found.max_dense = max(found.max_dense, did)
            found.commits[v] = (edit, DenseLoc(seg, pos, length))  # a GC copy is the same record
        else:
            for did in edit.anchor.dense_names.values():
                found.max_dense = max(found.max_dense, did)
            found.anchors.setdefault(v, []).append((edit.anchor, DenseLoc(seg, pos, length)))


# proof ------------------------------------------------------------------------------------------------
class Link(NamedTuple):
    """One record a read visits: its ``version`` and location ``loc`` (a ``RowLoc`` in a block's chain, a
    ``DenseLoc`` as a dense array's head), and ``why`` it is damaged or lost (None: present, the record
    history wrote there). A damaged or lost link ends its chain; its ``loc`` points at the damaged bytes,
    or at ``LOST_SEGMENT``, so that a read of it raises."""

    version: int
    loc: RowLoc | DenseLoc
    why: str | None = None


@dataclass(frozen=True, slots=True)
class Chain:
    """A block's read chain as repair proves it: its ``links``, newest first, the last one possibly
    damaged; or, when not even the key of a record the chain needs is known (the version's ancestry is
    not proven), no links and why (``unproven``). No links and no reason: the block was never written."""

    links: tuple[Link, ...] = ()
    unproven: str | None = None

    @property
    def proven(self) -> bool:
        return self.unproven is None

    @property
    def healthy(self) -> bool:
        """Proven, and every record of it present (a never-written block's empty chain is healthy)."""
        return self.unproven is None and (not self.links or self.links[-1].why is None)

    def after(self, link: Link) -> Chain:
        """The chain that reads ``link`` and then this one: an unproven chain stays unproven (and
        ``link`` is dropped with it)."""
        return self if self.unproven is not None else Chain((link,) + self.links)

    def suffixes(self) -> list[Chain]:
        """The chain from each of its links, newest first: the chain from an index entry does not depend
        on where a walk began."""
        return [Chain(self.links[i:]) for i in range(len(self.links))]

    def from_version(self, version: int) -> Chain | None:
        """The chain from this chain's link at ``version`` (a suffix), or None where it has none."""
        for i, link in enumerate(self.links):
            if link.version == version:
                return Chain(self.links[i:])
        return None


#: The chain of a block never written.
_EMPTY = Chain()


_KNOWN_FLAGS = record.FLAG_BASELINE | record.FLAG_FULL | record.FLAG_COMPACTED | record.FLAG_DELTA | record.FLAG_KEYS
_SHAPE = record.FLAG_BASELINE | record.FLAG_DELTA  # what a GC rewrite keeps of a record's flags


class _State:
    """The proof's state at one version: per block its chain, per dense id its head."""

    __slots__ = ("unknown", "blocks", "dense")

    def __init__(self, unknown: str | None, blocks: dict[tuple[int, int], Chain], dense: dict[int, Link]):
        self.unknown = unknown  # why blocks not listed may be unreadable (None: never written)
        self.blocks = blocks  # (tid, block) -> chain
        self.dense = dense  # dense id -> head

    def chain(self, key: tuple[int, int]) -> Chain:
        """The chain of block ``key``: listed, else empty (never written) or unproven (``unknown``)."""
        if key in self.blocks:
            return self.blocks[key]
        return _EMPTY if self.unknown is None else Chain(unproven=self.unknown)


@dataclass
class _Plan:
    versions: dict[int, dict] = field(default_factory=dict)  # recovered version -> version info
    #: per recovered version: (tid, block) -> chain, dense id -> link
    chains: dict[int, dict[tuple[int, int], Chain]] = field(default_factory=dict)
    dense: dict[int, dict[int, Link]] = field(default_factory=dict)
    tables: dict[int, dict] = field(default_factory=dict)  # table id -> catalog entry
    dense_names: dict[str, int] = field(default_factory=dict)
    log: dict[tuple[int, int], DenseLoc] = field(default_factory=dict)
    floor: int = 0
    drop: DropLog | None = None  # the newest DROP record
    last_baseline: dict | None = None
    partial: set = field(default_factory=set)  # versions whose chains use a record GC rewrote partly

    def dropped(self, v: int) -> bool:
        """Whether version v was dropped (by retain or a retention policy) before the repair."""
        if v < self.floor:
            return True
        return self.drop is not None and self.drop.dropped(v)

    def known_kept(self, v: int) -> bool:
        return self.drop is not None and not self.drop.dropped(v)


class _LogProof:
    """The per-version proof from the log alone (see the module docstring)."""

    def __init__(self, found: _Found, plan: _Plan, report: RepairReport, tname):
        self.found = found
        self.plan = plan
        self.report = report
        self.tname = tname
        self.entry: dict[tuple[int, int, int], Chain] = {}  # (tid, block, version) -> chain from that entry
        self._history_entries: dict[tuple[int, int], tuple] = {}  # (tid, block) -> history_entries()
        skipped = []  # versions a COMMIT's parent pointer jumps over: never part of the history
        for v, (edit, _loc) in found.commits.items():
            p = edit.info["parent"]
            if p is not None and v - p > 1:
                skipped.append((p, v))
        self.skipped = skipped

    def in_history(self, u: int) -> bool:
        return not any(p < u < v for p, v in self.skipped)

    # links --------------------------------------------------------------------------------------------
    def lost(self, tid, block, v, count, flags, base, what="record") -> Link:
        suspect = self.found.suspect_rows.get((tid, block, v))
        where = f"the {what} of table {self.tname(tid)} block {block} at version {v}"
        if suspect is not None:
            return Link(v, suspect, f"{where} is damaged (checksum mismatch at segment {suspect.segment} "
                                    f"offset {suspect.offset})")
        return Link(v, RowLoc(LOST_SEGMENT, 0, 0, count, flags, base), f"{where} is missing")

    def own(self, tid, block, v, count, flags, version_of=None) -> Link:
        """The link of the record (tid, block, v) that history wrote with ``count`` and ``flags``: the
        checkpoint's record, or its rewrite by GC (COMPACTED, its live rows only)."""
        loc = self.found.row(tid, block, v, count, flags)
        if loc is not None:
            return Link(v, loc)
        loc = self.found.row(tid, block, v, compacted=True)
        if loc is not None and (loc.flags & _SHAPE) == (flags & _SHAPE):
            if loc.count < count and version_of is not None:
                self.plan.partial.add(version_of)
            return Link(v, loc)
        base = 0
        if flags & record.FLAG_DELTA:
            cand = self.found.suspect_rows.get((tid, block, v))
            base = cand.base if cand is not None else 0
        return self.lost(tid, block, v, count, flags, base)

    def chain_from(self, tid, block, link: Link, below: Chain = _EMPTY) -> Chain:
        """The chain starting at ``link``: ``below`` is the chain of the block just under it (what a
        plain increment is read with). A proven one is remembered as the chain from that entry."""
        nxt = chain_rule.step(link.loc.flags, link.loc.base)
        if link.why is not None or nxt == chain_rule.END:
            out = Chain((link,))
        elif nxt != chain_rule.PREVIOUS:
            out = self.base_chain(tid, block, nxt, below).after(link)
        else:
            out = below.after(link)
        if out.proven:
            self.entry[(tid, block, link.version)] = out
        return out

    def base_chain(self, tid, block, base, below: Chain) -> Chain:
        """The chain from the entry at a delta's ``base``: remembered from wherever it was proven, else
        found in ``below`` (the chain the delta was written over), else the record at ``base``."""
        known = self.entry.get((tid, block, base))
        if known is not None:
            return known
        known = below.from_version(base)
        if known is not None:
            return known
        loc = self.found.row(tid, block, base, compacted=True)
        if loc is None:
            locs = [loc for loc, comp in self.found.rows.get((tid, block, base), ()) if not comp]
            loc = locs[-1] if locs else None
        if loc is None:
            return Chain((self.lost(tid, block, base, 0, record.FLAG_BASELINE, 0, "base record"),))
        if chain_rule.step(loc.flags, loc.base) != chain_rule.PREVIOUS:  # a baseline, or a delta on a base
            return self.chain_from(tid, block, Link(base, loc))
        return Chain(unproven=f"the records of table {self.tname(tid)} block {block} under the delta base at "
                              f"version {base} are not proven")

    def header_chain(self, tid, block, v) -> Chain:
        """The chain at ``v`` as the index would walk it over every record present (their headers)."""
        versions, kept, position = self.history_entries(tid, block)
        i = bisect.bisect_right(kept, v) - 1
        if i < 0:
            return _EMPTY
        links: list[Link] = []
        while i is not None:
            u = kept[i]
            known = self.entry.get((tid, block, u))
            if known is not None:
                links.extend(known.links)
                break
            loc = self.found.row(tid, block, u, compacted=True)
            if loc is None or not loc.flags & record.FLAG_BASELINE:
                plain = [loc for loc, comp in self.found.rows.get((tid, block, u), ()) if not comp]
                loc = plain[-1] if plain else loc
            if loc is None:
                suspect = self.found.suspect_rows[(tid, block, u)]
                links.append(self.lost(tid, block, u, suspect.count, suspect.flags, suspect.base))
                break
            links.append(Link(u, loc))
            i = chain_rule.next_position(i, loc.flags, loc.base, position)
        else:
            missing = chain_rule.missing_base(loc.flags, loc.base, versions)
            if missing is not None:
                links.append(self.lost(tid, block, missing, 0, record.FLAG_BASELINE, 0, "base record"))
        return Chain(tuple(links))

    def history_entries(self, tid, block) -> tuple[set[int], list[int], dict[int, int]]:
        """A block's entries for :meth:`header_chain`'s walk: the versions with a present or suspect
        record, those of them in the history (ascending: the entries walked), and each version's position
        among those: a version the history skips takes that of the history's entry before it (a delta on
        it goes on there), or none when there is none (a walk that reaches it ends, its base not missing)."""
        got = self._history_entries.get((tid, block))
        if got is None:
            versions = self.found.by_block().get((tid, block), [])
            kept: list[int] = []
            position: dict[int, int] = {}
            for u in versions:
                if self.in_history(u):
                    kept.append(u)
                if kept:
                    position[u] = len(kept) - 1
            got = self._history_entries[(tid, block)] = (set(versions), kept, position)
        return got

    # states -------------------------------------------------------------------------------------------
    def apply_commit(self, st: _State, v: int, edit: VersionEdit) -> None:
        """Replay the COMMIT of version v (its decoded edit) over the parent's state ``st``: each block
        it wrote reads the record it names (count and flags), then what that record is read with."""
        for tid, block, _v, loc in edit.rows:
            key = (tid, block)
            link = self.own(tid, block, v, loc.count, loc.flags, version_of=v)
            st.blocks[key] = self.chain_from(tid, block, link, st.chain(key))
        for _name, did in edit.dense_names.items():
            loc = self.found.dense.get((did, v))
            if loc is not None:
                st.dense[did] = Link(v, loc)
            else:
                suspect = self.found.suspect_dense.get((did, v))
                st.dense[did] = Link(v, suspect or DenseLoc(LOST_SEGMENT, 0, 0),
                                     f"the record of dense array {self._dname(did)} at version {v} is "
                                     + ("damaged" if suspect else "missing"))

    def _dname(self, did):
        return repr({i: n for n, i in self.plan.dense_names.items()}.get(did, f"id {did}"))

    def apply_compacted(self, st: _State, v: int) -> None:
        """Materialized baselines at v (COMPACTED with BASELINE) hold the whole block; a COMPACTED delta
        (a background merge, or GC's rewrite of a delta) heads the block's chain at v; any other COMPACTED
        record is GC's rewrite of the checkpoint's own record at v, never a baseline."""
        for tid, block in sorted(self.found.compacted_at.get(v, ())):
            loc = self.found.row(tid, block, v, compacted=True)
            nxt = chain_rule.PREVIOUS if loc is None else chain_rule.step(loc.flags, loc.base)
            if nxt == chain_rule.END:
                st.blocks[(tid, block)] = self.chain_from(tid, block, Link(v, loc))
            elif nxt != chain_rule.PREVIOUS:
                # a merged delta (background merge, or GC's rewrite of a delta): the block's state at v is
                # it and the chain at its base. Taken where that chain is proven whole; else what the
                # commits proved stands (a merge only repeats rows the records it merged hold)
                key = (tid, block)
                remembered = self.entry.get((tid, block, v))
                chain = self.chain_from(tid, block, Link(v, loc), st.chain(key))
                if chain.healthy:
                    st.blocks[key] = chain
                elif remembered is not None:
                    self.entry[(tid, block, v)] = remembered
                else:
                    self.entry.pop((tid, block, v), None)

    def apply_anchor(self, st: _State, v: int) -> _State:
        heads: dict[tuple[int, int], Chain] = {}
        dense_heads: dict[int, Link] = {}
        # the newest ANCHOR at v first (the last found: a later one, retain's then compact's at one version, is
        # appended after, and GC moves only the indexed one, which is the newest, to a newer segment): its chains
        # win, as _index_log_records indexes it, so that GC never frees a record the indexed ANCHOR names
        for anchor, _loc in reversed(self.found.anchors[v]):
            for (tid, block), entries in anchor.heads.items():  # a block's read chain at v, newest first
                if (tid, block) in heads and heads[(tid, block)].healthy:
                    continue
                links = []
                for hv, count, flags in entries:
                    if flags & record.FLAG_COMPACTED:
                        loc = self.found.row(tid, block, hv, compacted=True)
                        link = Link(hv, loc) if loc is not None else self.lost(tid, block, hv, count, flags, 0)
                    else:
                        link = self.own(tid, block, hv, count, flags)
                    links.append(link)
                    if link.why is not None or chain_rule.step(link.loc.flags, link.loc.base) == chain_rule.END:
                        break
                chain = Chain(tuple(links))
                for suffix in chain.suffixes():  # every suffix is the chain from that entry
                    if suffix.healthy:
                        self.entry.setdefault((tid, block, suffix.links[0].version), suffix)
                heads[(tid, block)] = chain
            for did, hv in anchor.dense.items():
                loc = self.found.dense.get((did, hv))
                if loc is not None:
                    dense_heads[did] = Link(hv, loc)
                elif did not in dense_heads:
                    suspect = self.found.suspect_dense.get((did, hv))
                    dense_heads[did] = Link(hv, suspect or DenseLoc(LOST_SEGMENT, 0, 0),
                                            f"the record of dense array {self._dname(did)} at version {hv} "
                                            f"(anchor at {v}) is " + ("damaged" if suspect else "missing"))
        return _State(None, heads, dense_heads)

    def header_state(self, v: int) -> _State:
        """The state at v from the records' own headers (every block with a record at or before v)."""
        blocks = {}
        for (tid, block), versions in self.found.by_block().items():
            if versions[0] <= v:
                chain = self.header_chain(tid, block, v)
                if chain.links:
                    blocks[(tid, block)] = chain
        dense = {}
        for (did, u), loc in sorted(self.found.dense.items()):
            if u <= v and self.in_history(u):
                dense[did] = Link(u, loc)
        return _State(None, blocks, dense)


def _prove(found: _Found, report: RepairReport, old: _OldIndex | None) -> _Plan:
    """The plan of the new index (its versions, their chains and dense heads, the catalog, the log
    records to index) from what the scan ``found`` and the ``old`` index, if it opened; what could not
    be recovered, and why, goes into ``report``. The steps, in order: the catalog; the damaged COMMITs
    rebuilt (index lost only); each version's state proven from the log; the log records indexed; each
    version decided; what the report says of the rest."""
    plan = _catalog(found, report, old)
    proof = _LogProof(found, plan, report, _table_namer(plan))
    commits = dict(found.commits)
    # with an intact index the index holds every committed version's info: nothing to rebuild
    rebuilt = _rebuild_damaged_commits(found, commits, proof, report) if old is None else []
    logged = _log_states(found, commits, proof, old)
    _index_log_records(plan, found)
    _decide_versions(plan, found, logged, old, proof)
    report.notes.extend(rebuilt)
    _report_uncommitted(plan, found, commits, report)
    _report_recovered(plan, found, report, old)
    return plan


# the catalog ------------------------------------------------------------------------------------------
def _catalog(found: _Found, report: RepairReport, old: _OldIndex | None) -> _Plan:
    """A plan holding the catalog (tables, dense names), the drop floor and the newest DROP record: from
    the COMMITs and ANCHORs, then the intact old index (the truth where it opened), else, as a last
    resort, what damaged COMMITs and ANCHORs still decode to."""
    plan = _Plan()
    _catalog_from_log(plan, found)
    if old is not None:
        _catalog_from_old_index(plan, old)
    else:
        _dense_names_from_damaged(plan, found)
        _tables_from_damaged(plan, found, report)
    if found.drop is not None:
        plan.drop = found.drop[0]
        plan.log[(record.KIND_DROP, plan.drop.seq)] = found.drop[1]
    return plan


def _catalog_from_log(plan: _Plan, found: _Found) -> None:
    """Every table a whole COMMIT or ANCHOR defines (a later definition of an id wins over an earlier),
    every dense name (the first id found for a name stays), and the highest ``dropped_below`` an ANCHOR
    says."""
    facts = [(e.catalog, e.dense_names, 0) for e, _loc in found.commits.values()]
    facts += [(a.catalog, a.dense_names, a.dropped_below) for lst in found.anchors.values() for a, _loc in lst]
    for catalog, names, dropped_below in facts:
        for info in catalog:
            plan.tables[info.id] = info
        for name, did in names.items():
            plan.dense_names.setdefault(name, did)
        plan.floor = max(plan.floor, dropped_below)


def _catalog_from_old_index(plan: _Plan, old: _OldIndex) -> None:
    """The intact index's catalog and drop floor are the truth: they override the log's."""
    for tid, info in old.tables.items():
        plan.tables[tid] = info
    for name, did in old.dense_names.items():
        plan.dense_names[name] = did
    plan.floor = max(plan.floor, old.meta[schema.DROPPED_BELOW])


def _dense_names_from_damaged(plan: _Plan, found: _Found) -> None:
    """Dense names a damaged log record's body still decodes to (name -> id, well typed), where neither
    the name nor the id is known yet."""
    for _key, (_loc, body) in found.suspect_log.items():
        names = (body or {}).get("dense_ids") or (body or {}).get("dense_names")
        if isinstance(names, dict):
            for name, did in names.items():
                if isinstance(name, str) and isinstance(did, int) and did not in plan.dense_names.values():
                    plan.dense_names.setdefault(name, did)


def _tables_from_damaged(plan: _Plan, found: _Found, report: RepairReport) -> None:
    """Tables a damaged log record's catalog still decodes to, where neither the id nor the name is
    known yet and the definition agrees with the table's row records (``_plausible_table``); each one
    taken is noted."""
    for _key, (_loc, body) in found.suspect_log.items():
        for info in (body or {}).get("catalog", ()) if isinstance((body or {}).get("catalog"), list) else ():
            known_names = {t.name for t in plan.tables.values()}
            if isinstance(info, dict) and isinstance(info.get("id"), int) and info["id"] not in plan.tables \
                    and info.get("name") not in known_names:
                table = _plausible_table(found, info)
                if table is not None:
                    plan.tables[table.id] = table
                    report.notes.append(f"table {info.get('name')!r}: its definition comes from a damaged "
                                        "record (checked against the table's row records)")


def _table_namer(plan: _Plan) -> Callable[[int], str]:
    """How the report names a table id: its name in the catalog as it stands now, else ``id N``."""
    table_name = {tid: info.name for tid, info in plan.tables.items()}

    def tname(tid):
        return repr(table_name.get(tid, f"id {tid}"))

    return tname


# the states from the log ------------------------------------------------------------------------------
#: Per version the log may decide: its COMMIT's edit, the COMMIT's location (None for a rebuilt one) and
#: its proven state.
_Logged = tuple[VersionEdit, DenseLoc | None, _State]


class _ParentStates:
    """The proven states a later version still derives its own from: a version's state is kept while a
    COMMIT not yet replayed names it as parent, and let go once the last such one has taken it."""

    def __init__(self, commits: dict[int, tuple[VersionEdit, DenseLoc | None]]):
        self.states: dict[int, _State] = {}
        self.waiting: dict[int, int] = {}  # version -> how many COMMITs not yet replayed name it as parent
        for edit, _loc in commits.values():
            if edit.info["parent"] is not None:
                self.waiting[edit.info["parent"]] = self.waiting.get(edit.info["parent"], 0) + 1

    def keep(self, v: int, st: _State) -> None:
        """Remember version v's state if a version still to come derives from it."""
        if self.waiting.get(v):
            self.states[v] = st

    def parent_of(self, v: int, edit: VersionEdit | None) -> _State:
        """The state version v's COMMIT (``edit``; None: missing) is replayed over: its parent's, empty
        for a version with no parent, or one whose every block is unknown (saying which COMMIT is
        missing) where the parent's state was never proven."""
        if edit is None:
            return _State(f"the commit record of version {v} is missing", {}, {})
        parent = edit.info["parent"]
        if parent is None:
            return _State(None, {}, {})
        if parent not in self.states:
            return _State(f"the commit record of version {parent} (an ancestor) is missing", {}, {})
        st = self.states[parent]
        self.waiting[parent] -= 1
        if not self.waiting[parent]:
            del self.states[parent]  # memory: only the states still needed are kept
        return st


def _log_states(found: _Found, commits: dict, proof: _LogProof, old: _OldIndex | None) -> dict[int, _Logged]:
    """Every version with a COMMIT or ANCHOR, ascending, proven from its parent's state (``_state_at``);
    those with a COMMIT that the log decides or cross-checks (``_logged_version``) are returned."""
    parents = _ParentStates(commits)
    logged: dict[int, _Logged] = {}
    for v in sorted(set(commits) | set(found.anchors)):
        commit = commits.get(v)
        base = parents.parent_of(v, commit[0] if commit is not None else None)
        if base.unknown is not None and v not in found.anchors and commit is not None and not found.unattributed:
            base = _header_base(proof, v, commit[0])
        st = _state_at(proof, base, v, commit[0] if commit is not None else None)
        parents.keep(v, st)
        if commit is not None and _logged_version(proof.plan, v, old, proof.report):
            logged[v] = (commit[0], commit[1], st)
    return logged


def _header_base(proof: _LogProof, v: int, edit: VersionEdit) -> _State:
    """Where version v's ancestry is not proven (a COMMIT or the ANCHOR that covered it is damaged or
    gone) and the scan accounted for every damaged byte: its parent's state from the records' own
    headers (``_LogProof.header_state``), noted in the report."""
    parent = edit.info["parent"]
    base = proof.header_state(parent) if parent is not None else _State(None, {}, {})
    proof.report.notes.append(
        f"version {v}: the commit record of version {parent} (an ancestor) and any anchor covering it are "
        "missing or damaged; its read chains below it were taken from the row records' own headers")
    return base


def _state_at(proof: _LogProof, base: _State, v: int, edit: VersionEdit | None) -> _State:
    """Version v's state: ``base`` (its parent's, left unchanged) with its COMMIT (``edit``, if any)
    replayed, its COMPACTED records applied, and its ANCHORs' listings taking over where whole."""
    st = _State(base.unknown, dict(base.blocks), dict(base.dense))
    if edit is not None:
        proof.apply_commit(st, v, edit)
    proof.apply_compacted(st, v)
    if v in proof.found.anchors:
        st = _anchored(proof.apply_anchor(st, v), st)
    return st


def _anchored(anchored: _State, st: _State) -> _State:
    """The state an ANCHOR lists (``anchored``), except where its listing is damaged and the state the
    commits proved (``st``) reads the block or dense array whole: that one is kept."""
    for key, chain in anchored.blocks.items():
        if not chain.healthy and key in st.blocks and st.blocks[key].healthy:
            anchored.blocks[key] = st.blocks[key]
    for did, link in anchored.dense.items():
        if link.why is not None and did in st.dense and st.dense[did].why is None:
            anchored.dense[did] = st.dense[did]
    return anchored


def _logged_version(plan: _Plan, v: int, old: _OldIndex | None, report: RepairReport) -> bool:
    """Whether committed version v's proven state is kept for deciding it: always where the intact old
    index holds v (the index decides, the log cross-checks); else not where v was dropped (retain, a
    retention policy, or absent from the old index below its newest version) or where GC rewrote records
    it reads and no DROP says it was kept (it was dropped): those are reported dropped."""
    if old is not None and v in old.versions:
        return True
    if plan.dropped(v) or (old is not None and v <= max(old.versions, default=0)):
        report.versions_dropped.append(v)
        return False
    if v in plan.partial and not plan.known_kept(v):
        report.versions_dropped.append(v)
        report.notes.append(f"version {v}: GC rewrote records it reads for the versions kept (it was "
                            "dropped; the DROP record that says so is damaged or gone): left dropped")
        return False
    return True


def _index_log_records(plan: _Plan, found: _Found) -> None:
    """Index every ANCHOR (the last copy found of each) and every COMMIT found: the liveness rule
    (``prune_log``) keeps what later repairs need."""
    for a, lst in found.anchors.items():
        plan.log[(record.KIND_ANCHOR, a)] = lst[-1][1]
    for v, (_body, loc) in found.commits.items():
        plan.log[(record.KIND_COMMIT, v)] = loc


# deciding each version --------------------------------------------------------------------------------
def _decide_versions(plan: _Plan, found: _Found, logged: dict[int, _Logged], old: _OldIndex | None,
                     proof: _LogProof) -> None:
    """Each version, ascending, into the plan or the report's lost versions: from the old index where it
    holds the version (``_old_index_version``), else from the log's proof where every chain is proven
    (``_unproven``)."""
    candidates = set(logged) | (set(old.versions) if old is not None else set())
    for v in sorted(candidates):
        if old is not None and v in old.versions:
            got = logged.get(v)
            info, chains, dense = _old_index_version(old, v, found, proof, got[2] if got is not None else None)
        else:
            edit, _loc, st = logged[v]
            why = _unproven(v, st)
            if why is not None:
                proof.report.versions_lost[v] = why
                continue
            info, chains, dense = dict(edit.info), st.blocks, st.dense
        _admit(plan, found, v, info, chains, dense, proof)


def _old_index_version(old: _OldIndex, v: int, found: _Found, proof: _LogProof,
                       st: _State | None) -> tuple[dict, dict[tuple[int, int], Chain], dict[int, Link]]:
    """Version v as the old index reads it (``_old_index_state``): its info, chains and dense heads;
    where the log proves a block whole (``st``: v's state from the log, if any) that the index cannot
    read, the log's chain."""
    chains, dense = _old_index_state(old, v, found, proof.tname, proof)
    if st is not None:
        for key, chain in st.blocks.items():
            if chain.healthy and not chains.get(key, _EMPTY).healthy:
                chains[key] = chain
    return dict(old.versions[v]), chains, dense


def _unproven(v: int, st: _State) -> str | None:
    """Why version v, whose state from the log is ``st``, cannot be recovered (as the report says it:
    naming the version): the first block whose chain is not proven, else the blocks not listed being
    unknown; None when every chain is proven."""
    reasons = [chain.unproven for chain in st.blocks.values() if not chain.proven]
    if st.unknown is not None:
        reasons.append(st.unknown)
    if not reasons:
        return None
    return reasons[0] if reasons[0].startswith("version") else f"version {v}: {reasons[0]}"


def _admit(plan: _Plan, found: _Found, v: int, info: dict, chains: dict[tuple[int, int], Chain],
           dense: dict[int, Link], proof: _LogProof) -> None:
    """Place version v in the plan (its info, chains and dense heads; an anchored version is the last
    baseline), unless a table its chains read has no definition: then it is lost."""
    missing_tables = sorted({tid for tid, _b in chains} - set(plan.tables))
    if missing_tables:
        proof.report.versions_lost[v] = (f"version {v}: the definition of table {proof.tname(missing_tables[0])} "
                                         "is missing")
        return
    plan.versions[v] = info
    plan.chains[v] = chains
    plan.dense[v] = dense
    if v in found.anchors:
        plan.last_baseline = {"version": v, "bytes": sum(c.links[0].loc.length for c in chains.values() if c.links)}


def _report_uncommitted(plan: _Plan, found: _Found, commits: dict, report: RepairReport) -> None:
    """Versions not recovered nor dropped that have no COMMIT: seen in records (a checkpoint that never
    committed, a pre-format-2 version, a lost COMMIT) or named as a parent (a lost COMMIT) are lost."""
    parents = {e.info["parent"] for e, _l in commits.values()}
    for v in sorted(found.seen_versions - set(commits)):
        if plan.dropped(v) or v in plan.versions:
            continue
        if v in parents:
            report.versions_lost[v] = f"version {v}: its commit record is missing (a later version names it as parent)"
        else:
            report.versions_lost[v] = (f"version {v}: records without a commit record (a checkpoint that never "
                                       "committed, a version written before format 2, or a lost commit record)")
    for v in sorted(parents - set(commits) - found.seen_versions - {None}):
        if not plan.dropped(v) and v not in found.anchors and v not in plan.versions:
            report.versions_lost[v] = f"version {v}: its commit record is missing (a later version names it as parent)"


def _report_recovered(plan: _Plan, found: _Found, report: RepairReport, old: _OldIndex | None) -> None:
    """The report's recovered versions and tables (a recovered version is never also lost), and notes of
    what the catalog cannot give back: tables with rows but no definition, and, with the index lost,
    tables never written."""
    for v in list(report.versions_lost):
        if v in plan.versions:
            del report.versions_lost[v]
    report.versions_recovered = sorted(plan.versions)
    written = {tid for tid, _b, _v in found.rows}
    for tid in sorted(written - set(plan.tables)):
        report.notes.append(f"table id {tid}: rows were found but its definition is in no commit or anchor "
                            "record: they cannot be read")
    report.tables_recovered = sorted(info.name for info in plan.tables.values())
    if old is None:
        report.notes.append("tables created but never written by a committed version are not in the log and "
                            "cannot be recovered")


def _plausible_table(found: _Found, info: dict) -> TableRecord | None:
    """The table of a catalog entry decoded from a damaged record, if the entry is well formed (checked as
    a ``tables`` value is) and agrees with every row record of its table (blocks within the table, the
    row size of each record's codec); else None."""
    from .. import codecs

    try:
        table = table_from_log(info)
        n_blocks = -(-table.num_rows // table.block_rows)
        for (t, block, _v), locs in found.rows.items():
            if t != table.id:
                continue
            if block >= n_blocks:
                return None
            for loc, _comp in locs:
                aux = (0 if loc.flags & record.FLAG_FULL else 2 * loc.count) + (
                    record.BASE.size if loc.flags & record.FLAG_DELTA else 0)
                body = loc.length - record.HEADER_BYTES - record.TRAILER_BYTES - aux
                rec_codec = found.valid.get((loc.segment, loc.offset))
                if rec_codec is None or loc.count == 0:
                    continue
                codec_id = found.codec_of.get((loc.segment, loc.offset))
                if codec_id is None or body != loc.count * codecs.by_id(codec_id).row_bytes(table.dim):
                    return None
        return table
    except CnrError:  # (a CorruptionError from the entry's check, or an unknown codec id)
        return None


def _rebuild_damaged_commits(found: _Found, commits: dict, proof: _LogProof, report: RepairReport) -> list[str]:
    """A version whose COMMIT record is damaged (the scan attributed a damaged stretch to it) is rebuilt:
    its blocks from the headers of its row records (the newest record of each key at that version), its
    parent from the versions around it, and step / meta / created from what the damaged body still
    decodes to (unverified: said in the notes)."""
    notes = []
    known = sorted(set(found.commits) | set(found.anchors))
    for (kind, v), (_loc, damaged_body) in sorted(found.suspect_log.items()):
        if kind != record.KIND_COMMIT or v in commits:
            continue
        body = damaged_body if isinstance(damaged_body, dict) else {}
        if body.get("version") != v and not any(u == v for _t, _b, u in found.rows) and \
                not any(u == v for _d, u in found.dense):
            continue  # nothing corroborates the version its header names (the flipped byte may be there)
        blocks: dict[int, list] = {}
        for (tid, block, u), locs in found.rows.items():
            if u != v:
                continue
            plain = [loc for loc, comp in locs if not comp]
            if plain:
                blocks.setdefault(tid, []).append((block, plain[-1].count, plain[-1].flags))
            else:  # only GC's rewrite is left: its shape (BASELINE, DELTA) is the record's
                loc = locs[-1][0]
                blocks.setdefault(tid, []).append((block, loc.count, loc.flags & ~record.FLAG_COMPACTED))
        for (tid, block, u), loc in found.suspect_rows.items():
            if u == v and not any(b == block for b, _c, _f in blocks.get(tid, ())):
                blocks.setdefault(tid, []).append((block, loc.count, loc.flags))
        body = damaged_body if isinstance(damaged_body, dict) else {}
        older = [u for u in known if u < v]
        parent = body.get("parent") if isinstance(body.get("parent"), int) and body.get("parent") in known \
            else (older[-1] if older else None)
        dense_ids = {}
        for (did, u) in list(found.dense) + list(found.suspect_dense):
            if u == v:
                dense_ids[next((n for n, i in proof.plan.dense_names.items() if i == did), f"dense{did}")] = did
        rows = [(tid, b, v, RowLoc(version_edit.UNPLACED, 0, 0, c, f)) for tid, items in blocks.items()
                for b, c, f in items]
        tables = sorted({proof.plan.tables[tid].name for tid in blocks if tid in proof.plan.tables})
        created = body.get("created") if isinstance(body.get("created"), (int, float)) else 0.0
        step = body.get("step") if isinstance(body.get("step"), int) or body.get("step") is None else None
        meta = body.get("meta") if isinstance(body.get("meta"), dict) or body.get("meta") is None else None
        nbytes = body.get("bytes") if isinstance(body.get("bytes"), int) else 0
        info = {"step": step, "meta": meta, "created": created, "parent": parent, "tables": tables,
                "dense": sorted(dense_ids), "bytes": nbytes}
        commits[v] = (VersionEdit(version=v, versions={v: info}, rows=rows, dense_names=dense_ids), None)
        notes.append(f"version {v}: its commit record is damaged; its blocks were rebuilt from its records' "
                     f"headers, its parent taken as version {parent}, and its step, meta and creation time "
                     + ("from what the damaged record still decodes to (unverified)" if body else "are lost"))
    return notes


def _old_index_state(old: _OldIndex, v: int, found: _Found, tname, proof: _LogProof) -> tuple[dict, dict]:
    """Version v's chains and dense heads as the old index reads them, each record checked against the
    scan: a present record is kept (found elsewhere by its key, count and flags if the entry points
    astray); a damaged one ends its chain as a damaged link (a read of it raises CorruptionError)."""
    why_damaged = {}
    for item in old.damaged.get(v, ()):
        if "table" in item:
            why_damaged[(item["table"], item["block"])] = item.get("why")
    chains = {}
    for (tid, block), entries in old.rows.items():
        versions = [u for u, _loc in entries]
        i = bisect.bisect_right(versions, v) - 1
        if i < 0:
            continue
        position = {u: j for j, u in enumerate(versions)}
        locs = [loc for _u, loc in entries]
        links = []
        for j in chain_rule.walk([loc.flags for loc in locs], [loc.base for loc in locs], position, i):
            link = _checked_row(found, tid, block, versions[j], locs[j], tname, why_damaged.get((tid, block)))
            links.append(link)
            if link.why is not None:
                break
        else:
            missing = chain_rule.missing_base(locs[j].flags, locs[j].base, position)
            if missing is not None:
                links.append(proof.lost(tid, block, missing, 0, record.FLAG_BASELINE, 0, "base record"))
        chains[(tid, block)] = Chain(tuple(links))
    dense = {}
    for did, entries in old.dense.items():
        versions = [u for u, _loc in entries]
        i = bisect.bisect_right(versions, v) - 1
        if i < 0:
            continue
        u, loc = entries[i]
        got = found.valid.get((loc.segment, loc.offset))
        if got is not None and got[0] == loc.length and got[1] == record.KIND_DENSE and got[2] == did and got[4] == u:
            dense[did] = Link(u, loc)
        elif (did, u) in found.dense:
            dense[did] = Link(u, found.dense[(did, u)])
        else:
            dense[did] = Link(u, loc, f"the record of dense array id {did} at version {u} is damaged or missing")
    return chains, dense


def _checked_row(found: _Found, tid, block, u, loc: RowLoc, tname, old_why) -> Link:
    """The link of the old index's entry (tid, block, u) at ``loc``: present where the scan found that
    record there or elsewhere (a GC copy: same count, flags and base), else damaged (``old_why``: why the
    old index said it is)."""
    got = found.valid.get((loc.segment, loc.offset))
    if got is not None and got[:8] == (loc.length, record.KIND_ROWS, tid, block, u, loc.count, loc.flags, loc.base):
        return Link(u, loc)
    for other, _comp in found.rows.get((tid, block, u), ()):  # the same record elsewhere (a GC copy)
        if other.count == loc.count and other.flags == loc.flags and other.base == loc.base:
            return Link(u, other)
    if loc.segment == LOST_SEGMENT:
        why = old_why or f"the record of table {tname(tid)} block {block} at version {u} is missing"
    else:
        why = (f"the record of table {tname(tid)} block {block} at version {u} (segment {loc.segment} offset "
               f"{loc.offset}) is " + ("damaged (checksum mismatch)" if got is None else "not the one the index names"))
    return Link(u, loc, why)


# install ----------------------------------------------------------------------------------------------
def _entries(plan: _Plan, report: RepairReport) -> tuple[dict, dict, dict]:
    """The row and dense entries every recovered version's chains need (a present record wins over a
    damaged one at the same key), and the damaged pairs, computed from those entries as a read walks
    them (so that what meta ``damaged`` says is exactly what reads find)."""
    rows: dict[tuple[int, int, int], tuple] = {}
    dense: dict[tuple[int, int], tuple] = {}
    for v in plan.versions:
        for (tid, block), chain in plan.chains[v].items():
            for u, loc, why in chain.links:
                have = rows.get((tid, block, u))
                if have is None or (have[1] is not None and why is None):
                    rows[(tid, block, u)] = (loc, why)
        for did, (u, loc, why) in plan.dense[v].items():
            have = dense.get((did, u))
            if have is None or (have[1] is not None and why is None):
                dense[(did, u)] = (loc, why)
    # walk each block's entries as a read does: damage of an entry's chain is that of its first bad link
    by_block: dict[tuple[int, int], list] = {}
    for (tid, block, u), (loc, why) in sorted(rows.items()):
        by_block.setdefault((tid, block), []).append(Link(u, loc, why))
    recovered = sorted(plan.versions)
    damaged: dict[int, list] = {}
    for (tid, block), entries in by_block.items():
        position = {u: i for i, (u, _l, _w) in enumerate(entries)}
        flags = [loc.flags for _u, loc, _w in entries]
        bases = [loc.base for _u, loc, _w in entries]
        memo: dict[int, str | None] = {}

        def bad(i):
            path = []
            result = None
            for j in chain_rule.walk(flags, bases, position, i):
                if j in memo:
                    result = memo[j]
                    break
                path.append(j)
                why = entries[j].why
                if why is not None:
                    result = why
                    break
            else:
                missing = chain_rule.missing_base(flags[j], bases[j], position)
                if missing is not None:
                    result = f"the base record of table id {tid} block {block} at version {missing} is missing"
            for j in path:
                memo[j] = result
            return result

        versions = [u for u, _l, _w in entries]
        for i in range(len(entries)):
            why = bad(i)
            if why is None:
                continue
            for v in _readers_of(recovered, versions, i):
                damaged.setdefault(v, []).append({"table": tid, "block": block, "why": why})
    by_dense: dict[int, list] = {}
    for (did, u), (loc, why) in sorted(dense.items()):
        by_dense.setdefault(did, []).append((u, why))
    for did, entries in by_dense.items():
        versions = [u for u, _w in entries]
        for i, (_u, why) in enumerate(entries):
            if why is None:
                continue
            for v in _readers_of(recovered, versions, i):
                damaged.setdefault(v, []).append({"dense": did, "why": why})
    names = {tid: info.name for tid, info in plan.tables.items()}
    dnames = {did: name for name, did in plan.dense_names.items()}
    for v, items in sorted(damaged.items()):
        report.damaged[v] = [(f"table {names.get(i['table'], i['table'])!r} block {i['block']}" if "table" in i
                              else f"dense array {dnames.get(i['dense'], i['dense'])!r}") + f": {i['why']}"
                             for i in items]
    return rows, dense, damaged


def _readers_of(recovered: list[int], versions: list[int], i: int) -> list[int]:
    """The recovered versions (ascending) that read the i-th of one key's index entries (``versions``:
    theirs, ascending): those from its version up to, not including, the next entry's."""
    hi = versions[i + 1] if i + 1 < len(versions) else None
    return recovered[bisect.bisect_left(recovered, versions[i]):
                     (bisect.bisect_left(recovered, hi) if hi is not None else None)]


def _install(root: str, filesystem: fs.FileSystem, storage: LocalSegmentStorage, found: _Found,
             lengths: dict[int, int], plan: _Plan, report: RepairReport, format_version: int,
             old: _OldIndex | None) -> None:
    rows, dense, damaged = _entries(plan, report)
    tmp = filenames.index_repair_tmp(root)
    filesystem.remove_tree(tmp)  # a previous repair's unfinished build: ours, never installed
    filesystem.mkdir(tmp)
    index = Index(tmp, readonly=False, create=True)
    meta = old.meta if old is not None else {key: key.default for key in _CARRIED_META}
    try:
        # set-aside damaged segments count too: never reuse an id
        max_seg = max([*lengths, *storage.quarantined(), meta[schema.MAX_DELETED_SEGMENT]], default=0)
        drop_seq = max(plan.drop.seq if plan.drop is not None else 0, meta[schema.DROP_SEQ])

        meta_set = {
            schema.FORMAT: format_version,
            schema.NEXT_VERSION: max(found.max_version + 1, meta[schema.NEXT_VERSION], max(plan.versions, default=0) + 1),
            schema.NEXT_TABLE_ID: max([found.max_table, *plan.tables]) + 1,
            schema.NEXT_DENSE_ID: max([found.max_dense, *plan.dense_names.values()]) + 1,
            schema.BYTES_WRITTEN: max(report.bytes_scanned, meta[schema.BYTES_WRITTEN]),
            schema.MAX_DELETED_SEGMENT: max_seg,
            schema.SEGMENT_IDS: {"high": max_seg, "pending": []},
            schema.DROPPED_BELOW: plan.floor,
        }
        for key in (schema.INCREMENT_BYTES, schema.SAVE_BYTES, schema.MERGE_BYTES):
            if meta[key]:
                meta_set[key] = meta[key]
        if drop_seq:  # later drops are numbered after it
            meta_set[schema.DROP_SEQ] = drop_seq
        last = plan.last_baseline or meta[schema.LAST_BASELINE]
        if last is not None:
            meta_set[schema.LAST_BASELINE] = last
        if damaged:
            meta_set[schema.DAMAGED] = damaged
        # the whole index as one edit; the liveness rule decides which log records stay (prune_log)
        edit = VersionEdit(segments=dict(lengths), tables=list(plan.tables.values()), dense_names=dict(plan.dense_names),
                           rows=[(tid, block, v, loc) for (tid, block, v), (loc, _why) in rows.items()],
                           dense=[(did, v, loc) for (did, v), (loc, _why) in dense.items()],
                           versions=dict(plan.versions), log=dict(plan.log), meta=meta_set, prune_log_records=True)
        index.write(edit.apply)
    finally:
        index.close()
    filesystem.fsync_dir(tmp)
    # From here on the new index is whole: a repair interrupted below installs it (see
    # _finish_interrupted_install) rather than rebuilding without the old index it has just moved aside.
    filesystem.write_file_atomic(filenames.index_repair_ready(root), filenames.index_repair_ready(root) + ".tmp",
                                 b"built\n")
    fs.crash_point("repair_before_install")
    current = filenames.index_dir(root)
    if os.path.exists(current):
        aside = filenames.index_damaged(root, time.strftime("%Y%m%dT%H%M%S"))
        n = 1
        while os.path.exists(aside):
            aside = filenames.index_damaged(root, time.strftime("%Y%m%dT%H%M%S") + f"-{n}")
            n += 1
        filesystem.rename(current, aside)
        report.old_index = aside
        fs.crash_point("repair_between_renames")  # no index/ now: the next open or repair installs the built one
    install_built_index(root, filesystem)


def _finish_interrupted_install(root: str, filesystem: fs.FileSystem, report: RepairReport) -> None:
    """A repair killed between moving the old index aside and renaming the new one in: install what it
    built (index.finish_interrupted_install), so that this repair starts from what that one proved (its
    view of the old index included) instead of from the log alone."""
    if finish_interrupted_install(root, filesystem):
        report.notes.append("installed the index an interrupted repair had built (index.repair-tmp/)")


__all__ = ["repair", "RepairReport", "damaged_blocks", "LOST_SEGMENT", "DAMAGED_META"]
