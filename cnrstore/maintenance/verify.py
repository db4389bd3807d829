"""fsck for a store: every checksum of live data, and the index against the log."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from ..engine import blocks as blocks_math
from .. import codecs
from ..engine import keyed_records, reader, record, segments
from ..errors import CnrError, CorruptionError, RemoteStorageError
from ..engine.schema import DAMAGED, TableRecord
from ..types import VerifyReport
from ..engine.storage import Expect, fetch, mismatch

#: What to do next, per kind of problem (appended to each problem verify reports).
DO_RECORD = ("reads that need it raise CorruptionError, never other data: restore a version that does not need "
             "it; `cnrstore repair` keeps every version and records which blocks are damaged")
DO_INDEX = "the index is damaged: `cnrstore repair` rebuilds it from the log (keeping what this index proves)"
DO_SEGMENT = ("restore the file from a copy if there is one; else `cnrstore repair` keeps every version and records "
              "which blocks are lost")
DO_DAMAGED = ("restore an undamaged version (`cnrstore ls` marks the damaged ones), then write a full checkpoint; "
              "`cnrstore retain` can drop the damaged versions, after which `cnrstore gc` works again")
DO_UNREAD = "harmless (space only): `cnrstore repair` rebuilds the index without it"
DO_LOG = ("reads are unaffected; keep index/ intact (back it up): a repair without it rebuilds from the other "
          "records, and may lose what only this record held (a version's step and meta)")
#: repair.LOST_SEGMENT (no segment has id 0): the entry of a record repair knows is lost
LOST_SEGMENT = 0


def damaged_blocks(view) -> dict[int, list[dict]]:
    """The damaged (version, block) pairs repair recorded (index meta ``damaged``, docs/FORMAT.md), for
    the versions the index still holds: version -> [{"table": id, "block": b, "why": str} or
    {"dense": id, "why": str}]."""
    raw = DAMAGED.get(view)
    versions = set(view.version_numbers()) if raw else set()
    return {int(v): list(items) for v, items in raw.items() if int(v) in versions}



if TYPE_CHECKING:
    from ..engine.core import Engine


def verify_store(engine: "Engine", progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check the store; damage is reported in ``problems``, never raised.

    ``progress(done, total)`` is called as index entries are checked (for progress bars). A problem
    names its table by name (and id), its dense array by name, its block and its version.
    """
    report = VerifyReport()
    seg_reader = engine.storage

    def add(problem: str, advice: str) -> None:
        report.problems.append(f"{problem} -- what to do: {advice}")

    pinned = engine.pinned()  # entries an open checkpoint's deltas will read (writer.pins) are not leftovers
    with engine.read() as view:
        committed = view.segments()
        for seg, length in sorted(committed.items()):
            path = seg_reader.path(seg)
            size = seg_reader.size(seg)  # through the storage seam (storage.py), like every read here
            if size is None:
                add(f"segment {path} is missing", DO_SEGMENT)
                continue
            try:
                header = seg_reader.read(seg, 0, segments.SEGMENT_HEADER_BYTES)
            except CnrError as exc:  # (e.g. not a regular file: its size would say nothing more)
                add(str(exc), DO_SEGMENT)
                continue
            if size < length:
                add(f"segment {path} holds {size} bytes, fewer than its committed {length}", DO_SEGMENT)
            try:
                segments.check_segment_header(header, seg, path)
            except CnrError as exc:
                _raise_unless_damage(exc)
                add(str(exc), DO_SEGMENT)
        tables = {info.id: info for info in view.tables().values()}
        versions = dict(view.versions())
        damaged = damaged_blocks(view)
        unread = _unread_entries(view, sorted(versions)) - pinned
        total = view.stat()["rows"]["entries"] + view.stat()["dense"]["entries"]
        done = 0
        block_key, block_versions = None, set()  # the entries of the block looked at (entries ascend)
        for tid, block, version, loc in view.row_entries():
            done += 1
            info = tables.get(tid)
            if info is None:
                add(f"index entry table id {tid} block {block} version {version} names an unknown table", DO_INDEX)
                continue
            where = f"table {info.name!r} (id {tid}) block {block} version {version}"
            if (tid, block) != block_key:
                block_key, block_versions = (tid, block), set()
            if loc.base and loc.base not in block_versions:
                add(f"index entry {where} is a delta on version {loc.base}, which has no entry: reads of it fail",
                    DO_INDEX)
            block_versions.add(version)
            if (tid, block, version) in unread:
                add(f"index entry {where} is read by no retained version (its version is gone and a baseline "
                    "shadows it)", DO_UNREAD)
            if loc.segment == LOST_SEGMENT:  # repair's mark of a lost record: listed with its versions below
                if not damaged:
                    add(f"index entry {where}: its record is lost", DO_RECORD)
                continue
            problem = _check_location(committed, loc.segment, loc.offset, loc.length)
            if problem:
                add(f"{where}: {problem}", DO_INDEX)
                continue
            try:
                rec = _parse_counted(seg_reader, loc, report)
                problem = _check_rows_record(rec, info, block, version, loc)
            except CnrError as exc:
                _raise_unless_damage(exc)
                problem = str(exc)
            if problem:
                add(f"{where}: {problem}", DO_RECORD)
            if progress is not None and done % 256 == 0:
                progress(done, total)
        dense_names = {i: n for n, i in view.dense_names().items()}
        for dense_id, version, loc in view.dense_entries():
            done += 1
            where = f"dense {dense_names.get(dense_id, dense_id)!r} version {version}"
            if loc.segment == LOST_SEGMENT:
                if not damaged:
                    add(f"{where}: its record is lost", DO_RECORD)
                continue
            problem = _check_location(committed, loc.segment, loc.offset, loc.length)
            if not problem:
                try:
                    rec = _parse_counted(seg_reader, loc, report)
                    desc = rec.dense_descriptor()
                    expect = np.dtype(desc["dtype"]).itemsize * int(np.prod(desc["shape"], dtype=np.int64))
                    problem = mismatch(rec, loc, Expect(record.KIND_DENSE, dense_id, version))
                    if not problem and rec.body.size != expect:
                        problem = "record body length disagrees with its dense descriptor"
                except CnrError as exc:
                    _raise_unless_damage(exc)
                    problem = str(exc)
                except (ValueError, TypeError, KeyError) as exc:
                    problem = f"bad dense descriptor: {exc}"
            if problem:
                add(f"{where}: {problem}", DO_RECORD)
        _check_log_records(view, committed, seg_reader, versions, report)
        for version, info in versions.items():
            if info.get("parent") is not None and info["parent"] >= version:
                add(f"version {version} has parent {info['parent']} that is not older", DO_INDEX)
        for version, items in sorted(damaged.items()):
            for item in items:
                what = (f"table {tables[item['table']].name!r} block {item['block']}"
                        if "table" in item and item["table"] in tables else
                        f"dense array {dense_names.get(item.get('dense'), item.get('dense'))!r}")
                add(f"version {version}: {what} is damaged ({item.get('why')}); repair recorded it, and reads "
                    "of it raise CorruptionError", DO_DAMAGED)
        if progress is not None:
            progress(total, total)
    return report


def _raise_unless_damage(exc: CnrError) -> None:
    """Re-raise what says nothing of the store's bytes: an object store that cannot be reached (or a read
    cache whose bucket moved on) is not damage, and verify cannot tell until it can read."""
    if isinstance(exc, RemoteStorageError) and not isinstance(exc, CorruptionError):
        raise exc


def _parse_counted(seg_reader, loc, report: VerifyReport) -> record.Record:
    """The checksum-verified record at ``loc``, counted in the report (CorruptionError if damaged)."""
    rec = fetch(seg_reader, loc)  # (what the record must be is checked by the caller, naming the problem)
    report.records_checked += 1
    report.bytes_checked += loc.length
    return rec


def _check_log_records(view, committed, seg_reader, versions: dict, report: VerifyReport) -> None:
    """The COMMIT and ANCHOR records repair rebuilds the index from: checksums and what they claim.
    (A format-1 store has none; versions committed before format 2 have no COMMIT record.)"""
    for kind, version, loc in view.log_entries():
        what = {record.KIND_COMMIT: "commit", record.KIND_ANCHOR: "anchor"}.get(kind, "drop")
        where = f"{what} record of version {version}" if what != "drop" else f"drop record {version}"
        problem = _check_location(committed, loc.segment, loc.offset, loc.length)
        if not problem:
            try:
                rec = _parse_counted(seg_reader, loc, report)
                body = record.log_body(rec)
                if rec.kind != kind or (kind != record.KIND_DROP and (rec.version != version or
                                                                       body.get("version") != version)):
                    problem = "record does not match its index entry"
                elif kind == record.KIND_COMMIT and version in versions and \
                        body.get("parent") != versions[version].get("parent"):
                    problem = "record disagrees with the version's parent in the index"
            except CnrError as exc:
                _raise_unless_damage(exc)
                problem = str(exc)
            except (ValueError, TypeError, AttributeError) as exc:
                problem = f"bad record body: {exc}"
        if problem:
            report.problems.append(f"{where}: {problem} -- what to do: {DO_LOG}")


def _unread_entries(view, kept: list[int]) -> set[tuple[int, int, int]]:
    """Row-index entries that no retained version reads (retention must have deleted them). Entries of
    dropped versions that a retained version still reads (e.g. a block's baseline) are fine.

    One pass over the row index, one block's entries held at a time: O(entries log versions)."""
    unread: set[tuple[int, int, int]] = set()
    key = None
    entries: list[tuple[int, bool, int]] = []
    for tid, block, version, loc in view.row_entries():
        if (tid, block) != key:
            if key is not None:
                unread.update((*key, v) for v in reader.unread_versions(entries, kept))
            key, entries = (tid, block), []
        entries.append((version, bool(loc.flags & record.FLAG_BASELINE), loc.base))
    if key is not None:
        unread.update((*key, v) for v in reader.unread_versions(entries, kept))
    return unread


def _check_location(committed: dict[int, int], seg: int, offset: int, length: int) -> str | None:
    if seg not in committed:
        return f"points into segment {seg}, which the catalog does not hold"
    if offset < segments.SEGMENT_HEADER_BYTES or offset + length > committed[seg]:
        return f"points past the committed length of segment {seg}"
    return None


def _check_rows_record(rec: record.Record, info: TableRecord, block: int, version: int, loc) -> str | None:
    problem = mismatch(rec, loc, Expect(record.KIND_ROWS, info.id, version, block))
    if problem:
        return problem
    if info.keyed or rec.flags & record.FLAG_KEYS:
        if not info.keyed or not rec.flags & record.FLAG_KEYS:
            return "a key run in a positional table, or rows in a keyed table: the catalog and the record disagree"
        try:
            keyed_records.parse_run(rec, info, "record")
        except CnrError as exc:
            return str(exc)
        return None
    try:
        codec = codecs.by_id(rec.codec_id)
    except CnrError:
        return f"record has unknown codec id {rec.codec_id}"
    if rec.body.size != rec.count * codec.row_bytes(info.dim):
        return "record body length disagrees with its row count and codec"
    block_len = blocks_math.length(block, info.block_rows, info.num_rows)
    offsets = rec.offsets()
    if offsets.size and (offsets[-1] >= block_len or (np.diff(offsets) <= 0).any()):
        return "record row offsets are out of range or not strictly increasing"
    return None
