"""Rebuild a store's index from its segment log (leveldb's RepairDB is the model).

The log is self-describing: every record is checksummed and names its kind, object, block and version;
each commit appends a COMMIT record (the version's info, the catalog entries of the tables it wrote, the
dense ids it wrote, and the count and flags of every block record it wrote); each compaction appends an
ANCHOR record (every block's read chain at its version, the dense heads and the catalog).

Repair scans every segment record by record (a bad record is noted and skipped: the scan resumes at
the next record magic whose checksum holds), then decides which versions are *provably whole*: version
v is recovered when its COMMIT record is present and, following parent pointers back to the version's
newest ANCHOR (or to a version without parent), every record its reads need is present — per block the
records of its ancestors that wrote the block, newest first, until a baseline (a compacted baseline at
an ancestor's version, or an anchor's head, holds the whole block). Every other version is reported
with the reason. Versions dropped before (the newest DROP record lists the versions kept then; an
ANCHOR's ``dropped_below`` says retain dropped every older one) stay dropped.

The new index is built in ``index.repair-tmp/`` beside ``index/``, synced, and swapped in: the old
``index/`` is renamed ``index.damaged-<time>/`` (never deleted). Segment files are not changed, except
that one whose header is damaged (so that no record in it can be read) is renamed ``<name>.damaged``.
Counters are set past every version, table id, dense id and segment id found, so none is reused.
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import compaction, filenames, fs, record, segments
from .errors import CorruptionError, StoreNotFound
from .index import DenseLoc, Index, IndexWriter, RowLoc
from .lock import ProcessLock
from .marker import FORMAT_VERSION, read_marker

Progress = Callable[[int, int], None]


@dataclass
class RepairReport:
    """What ``repair`` did. ``ok`` is True when every committed version found was recovered."""

    path: str
    versions_recovered: list[int] = field(default_factory=list)
    #: version -> why it could not be proven whole (its data is left in the log, unindexed)
    versions_lost: dict[int, str] = field(default_factory=dict)
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

    @property
    def ok(self) -> bool:
        return not self.versions_lost

    def to_json(self) -> dict:
        return {"ok": self.ok, "path": self.path, "versions_recovered": self.versions_recovered,
                "versions_lost": {str(v): why for v, why in sorted(self.versions_lost.items())},
                "versions_dropped": self.versions_dropped, "tables_recovered": self.tables_recovered,
                "segments_scanned": self.segments_scanned, "records_scanned": self.records_scanned,
                "bytes_scanned": self.bytes_scanned, "bad_records": self.bad_records, "notes": self.notes,
                "old_index": self.old_index}


class _Found:
    """What the scan found: record locations by key, and the parsed COMMIT / ANCHOR bodies."""

    def __init__(self):
        self.rows: dict[tuple[int, int, int], list] = {}  # (tid, block, version) -> [(RowLoc, compacted)]
        self.compacted_at: dict[int, list] = {}  # version -> [(tid, block)] with a compacted record there
        self.dense: dict[tuple[int, int], DenseLoc] = {}
        self.commits: dict[int, tuple[dict, DenseLoc]] = {}
        self.anchors: dict[int, list[tuple[dict, DenseLoc]]] = {}
        self.drop: tuple[dict, DenseLoc] | None = None  # the newest DROP record
        self.max_version = 0
        self.max_table = 0
        self.max_dense = 0
        self.seen_versions: set[int] = set()

    def row(self, tid: int, block: int, version: int, count: int | None = None, flags: int | None = None,
            compacted: bool = False):
        """A present record of (tid, block, version): compacted, or the checkpoint's with that count and
        flags (a merge within a version leaves the earlier record behind: the count tells them apart)."""
        best = None
        for loc, is_compacted in self.rows.get((tid, block, version), ()):
            if compacted:
                if is_compacted:
                    return loc
            elif not is_compacted and (count is None or (loc.count == count and loc.flags == flags)):
                best = loc  # the later one in log order
        return best


def _block_record_at(found: _Found, tid: int, block: int, version: int) -> RowLoc | None:
    """The record of (tid, block) at ``version`` a delta names as its base: a compacted record there
    (a materialized baseline, or one GC rewrote), else the checkpoint's (as its COMMIT record lists it)."""
    loc = found.row(tid, block, version, compacted=True)
    if loc is not None:
        return loc
    commit = found.commits.get(version)
    if commit is None:
        return None
    for block_id, count, flags in _unpack_blocks(commit[0].get("blocks", {}).get(tid, [b"", b"", b""])):
        if block_id == block:
            return found.row(tid, block, version, count, flags)
    return None


def _delta_chain(found: _Found, tid: int, block: int, version: int, loc: RowLoc, prev) -> tuple | None:
    """The read chain of a delta record ``loc`` at ``version``: it, then the chain from its base (taken
    from ``prev``, the chain it was written over, where it is there; else found in the log: the base is a
    baseline, or a delta on one). None if a record of it is missing."""
    chain = [(version, loc)]
    while loc.base:
        suffix = [i for i, e in enumerate(prev or ()) if e[0] == loc.base] if not isinstance(prev, str) else []
        if suffix:
            return tuple(chain) + tuple(prev[suffix[0]:])
        base_version = loc.base
        loc = _block_record_at(found, tid, block, base_version)
        if loc is None or (not loc.base and not loc.flags & record.FLAG_BASELINE) or len(chain) > 64:
            return None
        chain.append((base_version, loc))
    return tuple(chain)


def repair(path, progress: Progress | None = None) -> RepairReport:
    """Rebuild the index of the store at ``path`` from its segment log; see the module docstring.

    Takes the store's lock (raises StoreLocked while a writer holds it). Close every handle of the store
    in this process first. ``progress(done, total)`` is called as segment bytes are scanned.
    """
    root = os.path.abspath(os.fspath(path))
    if not os.path.exists(filenames.marker_path(root)) or not os.path.isdir(filenames.segments_dir(root)):
        raise StoreNotFound(f"no cnrstore store at {root!r} (no marker or no segments/ directory); repair "
                            "needs the store's CNRSTORE marker and segments/")
    read_marker(root)
    lock = ProcessLock(root)
    lock.acquire()
    try:
        report = RepairReport(root)
        found, lengths = _scan(root, report, progress)
        plan = _prove(found, report)
        _install(root, found, lengths, plan, report, FORMAT_VERSION)
        return report
    finally:
        lock.release()


# scan -------------------------------------------------------------------------------------------------
def _scan(root: str, report: RepairReport, progress: Progress | None) -> tuple[_Found, dict[int, int]]:
    seg_dir = filenames.segments_dir(root)
    names = [(filenames.parse_segment_name(n), n) for n in sorted(os.listdir(seg_dir))]
    names = [(s, n) for s, n in names if s is not None]
    total = sum(os.path.getsize(os.path.join(seg_dir, n)) for _s, n in names)
    found, lengths, done = _Found(), {}, 0
    for seg, name in names:
        seg_path = os.path.join(seg_dir, name)
        size = os.path.getsize(seg_path)
        report.segments_scanned += 1
        if _scan_segment(seg, seg_path, found, report):
            lengths[seg] = size
        else:
            os.rename(seg_path, seg_path + ".damaged")  # unreadable by the store, kept as evidence
            report.notes.append(f"segment {seg_path} has a damaged header: none of its records can be read; "
                                f"renamed to {name}.damaged")
        done += size
        if progress is not None:
            progress(done, total)
    if progress is not None:
        progress(total, total)
    return found, lengths


def _scan_segment(seg: int, seg_path: str, found: _Found, report: RepairReport) -> bool:
    """Scan one segment into ``found``; False if its header is damaged (its records are unusable)."""
    with open(seg_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return False
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        buf = np.frombuffer(mm, dtype=np.uint8)
        try:
            segments.check_segment_header(buf, seg, seg_path)
        except CorruptionError:
            return False
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
                report.bad_records.append(f"{seg_path}: {pos - bad_from} bytes at offset {bad_from} are no "
                                          "valid record (damaged, skipped)")
                bad_from = None
            _note(found, rec, seg, pos, length, report)
            pos += length
        if bad_from is not None:
            report.bad_records.append(f"{seg_path}: {size - bad_from} bytes at offset {bad_from} (the end) are "
                                      "no valid record (damage, or the torn tail of a crash; skipped)")
        del buf
        return True
    finally:
        try:
            mm.close()
        except BufferError:
            pass


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
    found.max_version = max(found.max_version, v)
    if rec.kind == record.KIND_ROWS:
        found.seen_versions.add(v)
        found.max_table = max(found.max_table, rec.object_id)
        compacted = bool(rec.flags & record.FLAG_COMPACTED)
        found.rows.setdefault((rec.object_id, rec.block, v), []).append(
            (RowLoc(seg, pos, length, rec.count, rec.flags, rec.base()), compacted))
        if compacted:
            found.compacted_at.setdefault(v, []).append((rec.object_id, rec.block))
    elif rec.kind == record.KIND_DENSE:
        found.seen_versions.add(v)
        found.max_dense = max(found.max_dense, rec.object_id)
        found.dense[(rec.object_id, v)] = DenseLoc(seg, pos, length)
    else:
        try:
            body = record.log_body(rec)
        except (ValueError, TypeError) as exc:
            report.bad_records.append(f"segment {seg} offset {pos}: undecodable log record ({exc})")
            return
        for info in body.get("catalog", ()):
            found.max_table = max(found.max_table, info["id"])
        if rec.kind == record.KIND_DROP:
            # the newest DROP: by seq, then by the newest version it saw (a store repaired by a cnrstore
            # that did not restore meta drop_seq numbered its later drops from 1 again)
            if found.drop is None or (body.get("seq", 0), body.get("latest", 0)) > \
                    (found.drop[0].get("seq", 0), found.drop[0].get("latest", 0)):
                found.drop = (body, DenseLoc(seg, pos, length))
        elif rec.kind == record.KIND_COMMIT:
            found.seen_versions.add(v)
            if body.get("parent") is not None:
                found.max_version = max(found.max_version, body["parent"])
            for did in body.get("dense_ids", {}).values():
                found.max_dense = max(found.max_dense, did)
            found.commits.setdefault(v, (body, DenseLoc(seg, pos, length)))
        else:
            for did in body.get("dense_names", {}).values():
                found.max_dense = max(found.max_dense, did)
            found.anchors.setdefault(v, []).append((body, DenseLoc(seg, pos, length)))


# proof ------------------------------------------------------------------------------------------------
class _State:
    """What reading at one version needs: per block its read chain (RowLocs with versions, newest first)
    or why it is unreadable; per dense id its record or why not; ``unknown``: why blocks this state does
    not list may be unreadable (None: they were never written)."""

    __slots__ = ("unknown", "blocks", "dense")

    def __init__(self, unknown, blocks, dense):
        self.unknown = unknown
        self.blocks = blocks
        self.dense = dense


@dataclass
class _Plan:
    versions: dict[int, dict] = field(default_factory=dict)  # recovered version -> version info
    rows: dict[tuple[int, int, int], RowLoc] = field(default_factory=dict)
    dense: dict[tuple[int, int], DenseLoc] = field(default_factory=dict)
    tables: dict[int, dict] = field(default_factory=dict)  # table id -> catalog entry
    dense_names: dict[str, int] = field(default_factory=dict)
    log: dict[tuple[int, int], DenseLoc] = field(default_factory=dict)
    floor: int = 0
    drop: dict | None = None
    last_baseline: dict | None = None

    def dropped(self, v: int) -> bool:
        """Whether version v was dropped (by retain or a retention policy) before the repair."""
        if v < self.floor:
            return True
        return self.drop is not None and v <= self.drop["latest"] and v not in self.drop["kept_set"]


def _unpack_blocks(packed) -> list[tuple[int, int, int]]:
    blocks = np.frombuffer(packed[0], dtype="<u8")
    counts = np.frombuffer(packed[1], dtype="<u4")
    flags = np.frombuffer(packed[2], dtype="<u1")
    return list(zip(blocks.tolist(), counts.tolist(), flags.tolist()))


def _unpack_heads(packed) -> list[tuple[int, int, int, int]]:
    blocks = np.frombuffer(packed[0], dtype="<u8")
    versions = np.frombuffer(packed[1], dtype="<u8")
    counts = np.frombuffer(packed[2], dtype="<u4")
    flags = np.frombuffer(packed[3], dtype="<u1")
    return list(zip(blocks.tolist(), versions.tolist(), counts.tolist(), flags.tolist()))


def _prove(found: _Found, report: RepairReport) -> _Plan:
    plan = _Plan()
    for body, _loc in list(found.commits.values()) + [a for lst in found.anchors.values() for a in lst]:
        for info in body.get("catalog", ()):
            plan.tables[info["id"]] = dict(info)
        names = body.get("dense_names") or body.get("dense_ids") or {}
        for name, did in names.items():
            plan.dense_names.setdefault(name, did)
        plan.floor = max(plan.floor, body.get("dropped_below", 0) or 0)
    if found.drop is not None:
        plan.drop = dict(found.drop[0], kept_set=set(found.drop[0]["kept"]))
        plan.log[(record.KIND_DROP, plan.drop["seq"])] = found.drop[1]
    table_name = {tid: info["name"] for tid, info in plan.tables.items()}
    dense_name = {did: name for name, did in plan.dense_names.items()}

    def tname(tid):
        return repr(table_name.get(tid, f"id {tid}"))

    nodes = sorted(set(found.commits) | set(found.anchors))
    states: dict[int, _State] = {}  # only of versions some unprocessed version names as parent
    waiting: dict[int, int] = {}
    for body, _loc in found.commits.values():
        if body.get("parent") is not None:
            waiting[body["parent"]] = waiting.get(body["parent"], 0) + 1
    empty = _State(None, {}, {})
    for v in nodes:
        commit = found.commits.get(v)
        if commit is None:
            base = _State(f"the commit record of version {v} is missing", {}, {})
        else:
            parent = commit[0].get("parent")
            if parent is None:
                base = empty
            elif parent in states:
                base = states[parent]
                waiting[parent] -= 1
                if not waiting[parent]:
                    del states[parent]  # memory: only the states still needed are kept
            else:
                base = _State(f"the commit record of version {parent} (an ancestor) is missing", {}, {})
        st = _State(base.unknown, dict(base.blocks), dict(base.dense))
        if commit is not None:
            body = commit[0]
            for tid, packed in body.get("blocks", {}).items():
                for block, count, flags in _unpack_blocks(packed):
                    loc = found.row(tid, block, v, count, flags)
                    key = (tid, block)
                    if loc is None:
                        st.blocks[key] = f"the record of table {tname(tid)} block {block} at version {v} is missing"
                    elif flags & record.FLAG_BASELINE:
                        st.blocks[key] = ((v, loc),)
                    elif loc.base:  # a delta: read with the chain from its base only
                        chain = _delta_chain(found, tid, block, v, loc, st.blocks.get(key, st.unknown))
                        st.blocks[key] = chain if chain is not None else (
                            f"the records of table {tname(tid)} block {block} that version {v}'s delta on "
                            f"version {loc.base} reads are missing")
                    else:
                        prev = st.blocks.get(key, st.unknown)
                        st.blocks[key] = prev if isinstance(prev, str) else ((v, loc),) + (prev or ())
            for _name, did in body.get("dense_ids", {}).items():
                loc = found.dense.get((did, v))
                st.dense[did] = (v, loc) if loc is not None else \
                    f"the record of dense array {dense_name.get(did, did)!r} at version {v} is missing"
        for tid, block in found.compacted_at.get(v, ()):  # a compacted baseline holds the whole block
            loc = found.row(tid, block, v, compacted=True)
            if not loc.base:
                st.blocks[(tid, block)] = ((v, loc),)
            else:  # a delta GC rewrote with its live rows: read with the chain from its base
                chain = _delta_chain(found, tid, block, v, loc, st.blocks.get((tid, block)))
                st.blocks[(tid, block)] = chain if chain is not None else (
                    f"the records of table {tname(tid)} block {block} that version {v}'s delta on "
                    f"version {loc.base} reads are missing")
        if v in found.anchors:
            heads: dict[tuple[int, int], tuple] = {}
            dense_heads: dict[int, tuple] = {}
            for body, _loc in found.anchors[v]:
                listed: dict[tuple[int, int], list] = {}  # a block's read chain at v, newest first
                for tid, packed in body.get("heads", {}).items():
                    for block, hv, count, flags in _unpack_heads(packed):
                        listed.setdefault((tid, block), []).append((hv, count, flags))
                for (tid, block), entries in listed.items():
                    if heads.get((tid, block)) is not None:
                        continue
                    chain: list | None = []
                    for hv, count, flags in entries:
                        loc = None if flags & record.FLAG_COMPACTED else found.row(tid, block, hv, count, flags)
                        if loc is None:  # compacted, or rewritten by GC with its live rows (compacted too)
                            loc = found.row(tid, block, hv, compacted=True)
                        if loc is None:
                            chain = None
                            break
                        chain.append((hv, loc))
                        if loc.flags & record.FLAG_BASELINE:
                            break
                    heads[(tid, block)] = tuple(chain) if chain else None
                for did, hv in body.get("dense", {}).items():
                    loc = found.dense.get((did, hv))
                    if loc is not None and dense_heads.get(did) is None:
                        dense_heads[did] = (hv, loc)
                    dense_heads.setdefault(did, None)
            blocks = {}
            for key, chain in heads.items():  # blocks the anchor does not list had no record yet
                if chain is not None:
                    blocks[key] = chain
                else:
                    derived = st.blocks.get(key, st.unknown)
                    blocks[key] = derived if derived is not None else \
                        f"the anchor record of table {tname(key[0])} block {key[1]} at version {v} is missing"
            dense = {}
            for did, head in dense_heads.items():
                dense[did] = head if head is not None else st.dense.get(did, st.unknown) or \
                    f"the record of dense array {dense_name.get(did, did)!r} (anchor at {v}) is missing"
            st = _State(None, blocks, dense)
        if waiting.get(v):
            states[v] = st
        # decide v
        if commit is None:
            continue
        if plan.dropped(v):
            report.versions_dropped.append(v)
            continue
        why = _why_unreadable(st, plan, tname)
        if why is not None:
            report.versions_lost[v] = why
            continue
        body = commit[0]
        plan.versions[v] = {k: body.get(k) for k in ("step", "meta", "created", "parent", "tables", "dense", "bytes")}
        plan.log[(record.KIND_COMMIT, v)] = commit[1]
        for (tid, block), chain in st.blocks.items():
            for hv, loc in chain:
                have = plan.rows.get((tid, block, hv))
                if have is None or (loc.flags & record.FLAG_COMPACTED and not have.flags & record.FLAG_COMPACTED):
                    plan.rows[(tid, block, hv)] = loc
        for did, (hv, loc) in st.dense.items():
            plan.dense[(did, hv)] = loc
        if v in found.anchors:  # versions ascend: the newest recovered anchor wins
            plan.last_baseline = {"version": v, "bytes": sum(c[0][1].length for c in st.blocks.values())}
    for a, lst in found.anchors.items():
        plan.log[(record.KIND_ANCHOR, a)] = lst[-1][1]
    # versions seen in records without a commit record: uncommitted checkpoints, or lost commit records
    parents = {b.get("parent") for b, _l in found.commits.values()}
    for v in sorted(found.seen_versions - set(found.commits)):
        if plan.dropped(v):
            continue
        if v in parents:
            report.versions_lost[v] = f"version {v}: its commit record is missing (a later version names it as parent)"
        else:
            report.versions_lost[v] = (f"version {v}: records without a commit record (a checkpoint that never "
                                       "committed, a version written before format 2, or a lost commit record)")
    for v in sorted(parents - set(found.commits) - found.seen_versions - {None}):
        if not plan.dropped(v) and v not in found.anchors:
            report.versions_lost[v] = f"version {v}: its commit record is missing (a later version names it as parent)"
    report.versions_recovered = sorted(plan.versions)
    written = {tid for tid, _b, _v in found.rows}
    for tid in sorted(written - set(plan.tables)):
        report.notes.append(f"table id {tid}: rows were found but its definition is in no commit or anchor "
                            "record: they cannot be read")
    report.tables_recovered = sorted(info["name"] for info in plan.tables.values())
    report.notes.append("tables created but never written by a committed version are not in the log and "
                        "cannot be recovered")
    return plan


def _why_unreadable(st: _State, plan: _Plan, tname) -> str | None:
    for (tid, block), chain in sorted(st.blocks.items()):
        if isinstance(chain, str):
            return chain
        if tid not in plan.tables:
            return f"the definition of table {tname(tid)} is missing"
    for did, entry in sorted(st.dense.items()):
        if isinstance(entry, str):
            return entry
    if st.unknown is not None:
        return st.unknown
    return None


# install ----------------------------------------------------------------------------------------------
def _install(root: str, found: _Found, lengths: dict[int, int], plan: _Plan, report: RepairReport,
             format_version: int) -> None:
    tmp = filenames.index_repair_tmp(root)
    shutil.rmtree(tmp, ignore_errors=True)  # a previous repair's unfinished build: ours, never installed
    filesystem = fs.DEFAULT
    index = Index(tmp, readonly=False, create=True)
    try:
        max_seg = max(lengths, default=0)
        seg_dir = filenames.segments_dir(root)
        for name in os.listdir(seg_dir):  # renamed-aside damaged segments too: never reuse an id
            if name.endswith(".damaged"):
                s = filenames.parse_segment_name(name[: -len(".damaged")])
                max_seg = max(max_seg, s or 0)

        def body(w: IndexWriter) -> None:
            w.put_meta("format", format_version)
            w.put_meta("next_version", found.max_version + 1)
            w.put_meta("next_table_id", max([found.max_table, *plan.tables]) + 1)
            w.put_meta("next_dense_id", max([found.max_dense, *plan.dense_names.values()]) + 1)
            w.put_meta("bytes_written", report.bytes_scanned)
            w.put_meta("max_deleted_segment", max_seg)
            w.put_meta("segment_ids", {"high": max_seg, "pending": []})
            w.put_meta("dropped_below", plan.floor)
            if plan.drop is not None:  # later drops are numbered after it (the newest DROP wins)
                w.put_meta("drop_seq", plan.drop["seq"])
            if plan.last_baseline is not None:
                w.put_meta("last_baseline", plan.last_baseline)
            for info in plan.tables.values():
                w.put_table(info["name"], info)
            for name, did in plan.dense_names.items():
                w.put_dense_name(name, did)
            for seg, length in lengths.items():
                w.put_segment(seg, length)
            for v, info in plan.versions.items():
                w.put_version(v, info)
            for (tid, block, v), loc in plan.rows.items():
                w.put_row(tid, block, v, loc)
            for (did, v), loc in plan.dense.items():
                w.put_dense(did, v, loc)
            for (kind, v), loc in plan.log.items():
                w.put_log(kind, v, loc)
            compaction.prune_log(w)

        index.write(body)
    finally:
        index.close()
    filesystem.fsync_dir(tmp)
    current = filenames.index_dir(root)
    if os.path.exists(current):
        aside = filenames.index_damaged(root, time.strftime("%Y%m%dT%H%M%S"))
        n = 1
        while os.path.exists(aside):
            aside = filenames.index_damaged(root, time.strftime("%Y%m%dT%H%M%S") + f"-{n}")
            n += 1
        os.rename(current, aside)
        report.old_index = aside
    os.rename(tmp, current)
    filesystem.fsync_dir(root)


__all__ = ["repair", "RepairReport"]
