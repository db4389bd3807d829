"""VersionEdit: what one change to a store does, said once (leveldb ``db/version_edit.h``).

Every change to a store is one ``VersionEdit``: a checkpoint's commit, a compaction's baselines and
ANCHOR, a drop of versions, a GC batch, a payload rewrite, and the index ``cnrstore repair`` rebuilds.
An edit has two outputs, and the code that writes a store has no other:

* ``encode()`` -- the log records the change appends: the msgpack bodies of its COMMIT, DROP and ANCHOR
  records (docs/FORMAT.md), appended after the change's data records and fsynced with them;
* ``apply(w)`` -- its effect on the index, inside the one synced write transaction of
  ``Engine._commit`` (leveldb's ``VersionSet::LogAndApply``, which also fills in where the encoded
  records were appended and the segments' committed lengths).

``decode(kind, version, body)`` turns a log record back into the edit that wrote it, so that repair
reads the very fields a commit encoded. The log does not say where the records an edit names lie: a
decoded edit's row entries carry only their count and flags (segment 0, which no segment has), and
repair finds the records by scanning (cnrstore/maintenance/repair.py).

Maintenance plans on an older snapshot while a checkpoint may commit, so some parts of an edit are
*decided in the transaction*, against the state it sees: a move replaces an index entry only while it
still points at the record that was copied; a segment is freed only while no commit has grown it;
the versions dropped are those of ``drop_versions`` still present; an entry is pruned only when no
kept version reads it and no open checkpoint pins it. What the transaction decided is left in
``dropped`` and ``freed``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from . import record
from ..errors import CheckpointInProgress, CnrError, InvalidArgument
from .index import DenseLoc, IndexView, IndexWriter, RowLoc
from .reader import unread_versions
from .schema import (
    BYTES_WRITTEN, DOOMED_SEGMENTS, INCREMENT_BYTES, LAST_BASELINE, MERGE_BYTES, SAVE_BYTES, NEXT_DENSE_ID, MetaKey, TableRecord,
    table_from_log,
)

#: The fields of a ``versions`` entry, as a COMMIT record carries them (on disk: never rename).
VERSION_FIELDS = ("step", "meta", "created", "parent", "tables", "dense", "bytes")
#: The segment of a row entry decoded from the log: where its record lies is not known (no segment has id 0).
UNPLACED = 0


@dataclass
class AnchorLog:
    """An ANCHOR record: every block's read chain at ``version`` (``heads``: (table id, block) -> [(version,
    count, flags)], newest first, ending at a baseline), the dense heads (dense id -> version of its newest
    record at or before ``version``), the whole catalog and dense names, and ``dropped_below``."""

    version: int
    dropped_below: int
    catalog: list[TableRecord]
    dense_names: dict[str, int]
    heads: dict[tuple[int, int], list[tuple[int, int, int]]]
    dense: dict[int, int]


@dataclass
class DropLog:
    """A DROP record: the ``seq``-th drop of the store, when ``latest`` was the newest version, kept ``kept``."""

    seq: int
    latest: int
    kept: list[int]
    kept_set: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.kept_set = frozenset(self.kept)

    def dropped(self, version: int) -> bool:
        """Whether this drop (if it is the newest) says ``version`` was dropped."""
        return version <= self.latest and version not in self.kept_set


class Move(NamedTuple):
    """An index entry to point at a copy of its record (GC, migrate-payload): ``kind`` "row" (key (table id,
    block, version)), "dense" (key (dense id, version)) or "log" (key (kind, version)). Applied only while
    the entry still points at ``old``'s record; otherwise skipped, or with ``conflict`` InvalidArgument."""

    kind: str
    key: tuple
    old: object
    new: object
    conflict: str | None = None


class Encoded(NamedTuple):
    """One log record of an edit: its kind, the version in its header, its ``log`` key and its body."""

    kind: int
    version: int
    key: int
    body: dict


@dataclass
class VersionEdit:
    """What one change does to a store (see the module docstring). Build one, then ``Engine._commit`` it."""

    #: the version a checkpoint commits: its entry in ``versions`` is encoded as its COMMIT record
    version: int | None = None
    #: what makes the change ("checkpoint", or a maintenance step: "compact", "merge", "drop", "gc",
    #: "gc_free", "replace_dense"): it names the change's crash points (``crash_points``)
    operation: str = "checkpoint"
    #: catalog entries a COMMIT carries: the tables its version wrote (not put)
    catalog: list[TableRecord] = field(default_factory=list)
    anchor: AnchorLog | None = None
    drop: DropLog | None = None

    # -- put into the index -----------------------------------------------------------------------
    segments: dict[int, int] = field(default_factory=dict)  # segment id -> committed length
    tables: list[TableRecord] = field(default_factory=list)  # catalog entries
    #: dense names the change writes (a COMMIT's ``dense_ids``); a name new to the store is recorded and
    #: ``next_dense_id`` raised past its id
    dense_names: dict[str, int] = field(default_factory=dict)
    rows: list[tuple[int, int, int, RowLoc]] = field(default_factory=list)  # (table id, block, version, loc)
    dense: list[tuple[int, int, DenseLoc]] = field(default_factory=list)  # (dense id, version, loc)
    versions: dict[int, dict] = field(default_factory=dict)  # version -> entry (VERSION_FIELDS)
    log: dict[tuple[int, int], DenseLoc] = field(default_factory=dict)  # (kind, version or seq) -> record

    # -- decided in the transaction -------------------------------------------------------------------
    moves: list[Move] = field(default_factory=list)
    drop_versions: frozenset = frozenset()  # drop these (those still present), and what only they read
    allow_newest: bool = False  # ... the newest version too (cnrstore.distributed's orphans)
    shadowed: list[tuple[int, int]] = field(default_factory=list)  # blocks to prune of entries none reads
    pinned: frozenset = frozenset()  # (table id, block, version) never pruned: an open checkpoint reads them
    #: segment id -> committed length it was judged at: freed (doomed) if still that long; None: no freeing
    free_segments: dict[int, int] | None = None
    prune_log_records: bool = False  # forget the log records repair no longer needs (``prune_log``)

    # -- meta -----------------------------------------------------------------------------------------
    bytes_written: int | None = None  # added to meta bytes_written
    increment_bytes: int | None = None  # added to meta increment_bytes (and bytes_written to save_bytes)
    merge_bytes: int | None = None  # added to meta merge_bytes (bytes_written of a background merge)
    last_baseline: dict | None = None  # {"version", "bytes"}: set unless a newer baseline is recorded
    meta: dict[MetaKey, object] = field(default_factory=dict)  # set as given, after everything above

    # -- what the transaction decided (set by apply) --------------------------------------------------
    dropped: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)

    @property
    def rewrites_chains(self) -> bool:
        """Whether the edit may change what blocks' read chains cost below their newest records, so that
        costs remembered by newest record (chain_costs.py) no longer hold: a compaction's baselines (at a
        version older than the newest, a chain mixing codecs becomes fp32 of its rows) and GC's copies (a
        partly live baseline rewritten smaller weighs less against the records above it). A checkpoint
        writes new newest records; a background merge writes at the newest version and never leaves a
        chain costlier (compaction.merge_chains)."""
        return bool(self.moves) or (bool(self.rows) and self.version is None and self.merge_bytes is None)

    @property
    def info(self) -> dict:
        """The ``versions`` entry of the version this edit commits."""
        return self.versions[self.version]

    # encode / decode ------------------------------------------------------------------------------------
    def encode(self) -> list[Encoded]:
        """The log records this edit appends, in order: its COMMIT, DROP and ANCHOR (as present)."""
        out = []
        if self.version is not None:
            out.append(Encoded(record.KIND_COMMIT, self.version, self.version, self._commit_body()))
        if self.drop is not None:
            d = self.drop
            out.append(Encoded(record.KIND_DROP, d.latest, d.seq, {"seq": d.seq, "latest": d.latest, "kept": d.kept}))
        if self.anchor is not None:
            out.append(Encoded(record.KIND_ANCHOR, self.anchor.version, self.anchor.version, _anchor_body(self.anchor)))
        return out

    def _commit_body(self) -> dict:
        blocks: dict[int, list] = {}
        for tid, block, _v, loc in self.rows:
            blocks.setdefault(tid, []).append((block, loc.count, loc.flags))
        packed = {tid: [np.array([b for b, _c, _f in items], dtype="<u8").tobytes(),
                        np.array([c for _b, c, _f in items], dtype="<u4").tobytes(),
                        np.array([f for _b, _c, f in items], dtype="<u1").tobytes()]
                  for tid, items in blocks.items()}
        return {**self.info, "version": self.version, "catalog": [t.as_dict() for t in self.catalog],
                "dense_ids": self.dense_names, "blocks": packed}

    # apply ----------------------------------------------------------------------------------------------
    def apply(self, w: IndexWriter) -> None:
        """Make this edit's changes in the write transaction ``w``. May run more than once (Index.write
        retries after growing the map): everything it decides is decided afresh each time."""
        for seg, length in self.segments.items():
            w.put_segment(seg, length)
        for table in self.tables:
            w.put_table(table)
        for name, dense_id in self.dense_names.items():
            if w.dense_id(name) is None:
                w.put_dense_name(name, dense_id)
                NEXT_DENSE_ID.put(w, max(NEXT_DENSE_ID.get(w), dense_id + 1))
        self.dropped = _drop_versions(w, self.drop_versions, self.allow_newest, self.pinned) \
            if self.drop_versions else []
        for tid, block, version, loc in self.rows:
            w.put_row(tid, block, version, loc)
        for dense_id, version, loc in self.dense:
            w.put_dense(dense_id, version, loc)
        for version, info in self.versions.items():
            w.put_version(version, info)
        for move in self.moves:
            _move(w, move)
        if self.shadowed:
            _prune_shadowed(w, self.shadowed, self.pinned)
        self.freed = _doom(w, self.free_segments) if self.free_segments is not None else []
        if self.bytes_written is not None:
            written = BYTES_WRITTEN.get(w)
            BYTES_WRITTEN.put(w, written + self.bytes_written)
            if self.increment_bytes is not None:
                # (a store written before this counter existed counts its earlier bytes as increments)
                INCREMENT_BYTES.put(w, INCREMENT_BYTES.get(w, written) + self.increment_bytes)
                SAVE_BYTES.put(w, SAVE_BYTES.get(w, written) + self.bytes_written)
            if self.merge_bytes is not None:
                MERGE_BYTES.put(w, MERGE_BYTES.get(w) + self.merge_bytes)
        if self.last_baseline is not None and \
                self.last_baseline["version"] >= (LAST_BASELINE.get(w) or {}).get("version", 0):
            LAST_BASELINE.put(w, self.last_baseline)
        for key, value in self.meta.items():
            key.put(w, value)
        for (kind, version), loc in self.log.items():
            w.put_log(kind, version, loc)
        if self.prune_log_records:
            prune_log(w)


def decode(kind: int, version: int, body: dict) -> VersionEdit:
    """The edit a COMMIT, ANCHOR or DROP record with header version ``version`` and (checked,
    record.log_body) ``body`` encodes. Its row entries are UNPLACED (see the module docstring). A catalog
    entry is checked as a ``tables`` value is: CorruptionError if it is malformed."""
    if kind == record.KIND_COMMIT:
        rows = [(tid, block, version, RowLoc(UNPLACED, 0, 0, count, flags))
                for tid, packed in body.get("blocks", {}).items() for block, count, flags in _unpack(packed, 3)]
        return VersionEdit(version=version, versions={version: {k: body.get(k) for k in VERSION_FIELDS}},
                           catalog=[table_from_log(t) for t in body.get("catalog", ())], rows=rows,
                           dense_names=dict(body.get("dense_ids", {})))
    if kind == record.KIND_ANCHOR:
        heads: dict[tuple[int, int], list] = {}
        for tid, packed in body.get("heads", {}).items():
            for block, hv, count, flags in _unpack(packed, 4):
                heads.setdefault((tid, block), []).append((hv, count, flags))
        return VersionEdit(anchor=AnchorLog(version, body.get("dropped_below", 0) or 0,
                                            [table_from_log(t) for t in body.get("catalog", ())],
                                            dict(body.get("dense_names", {})), heads, dict(body.get("dense", {}))))
    if kind == record.KIND_DROP:
        return VersionEdit(drop=DropLog(body["seq"], body["latest"], list(body["kept"])))
    raise ValueError(f"record kind {kind} encodes no edit")


def anchor_at(view: IndexView, version: int, heads: dict, dropped_below: int) -> AnchorLog:
    """The ANCHOR at ``version`` of the state ``view`` reads: ``heads`` (table id, block) -> the block's
    read chain there, [(version, count, flags)] newest first; the catalog, dense names and dense heads
    from ``view``."""
    dense: dict[int, int] = {}
    for dense_id, v, _loc in view.dense_entries():
        if v <= version:
            dense[dense_id] = v  # entries come oldest first
    return AnchorLog(version, dropped_below, list(view.tables().values()), view.dense_names(), heads, dense)


def _anchor_body(anchor: AnchorLog) -> dict:
    by_table: dict[int, list] = {}
    for (tid, blk), chain in sorted(anchor.heads.items()):
        for entry in chain:
            by_table.setdefault(tid, []).append((blk, *entry))
    packed = {}
    for tid, items in by_table.items():
        arr = np.array(items, dtype=np.int64).reshape(-1, 4)
        packed[tid] = [arr[:, 0].astype("<u8").tobytes(), arr[:, 1].astype("<u8").tobytes(),
                       arr[:, 2].astype("<u4").tobytes(), arr[:, 3].astype("<u1").tobytes()]
    return {"version": anchor.version, "dropped_below": anchor.dropped_below,
            "catalog": [t.as_dict() for t in anchor.catalog],
            "dense_names": anchor.dense_names, "heads": packed, "dense": anchor.dense}


_PACKED_DTYPES = {3: ("<u8", "<u4", "<u1"), 4: ("<u8", "<u8", "<u4", "<u1")}


def _unpack(packed, n: int) -> list[tuple]:
    """The rows of a "blocks array" list (docs/FORMAT.md) of ``n`` little-endian arrays, as int tuples."""
    return list(zip(*(np.frombuffer(b, dtype=dt).tolist() for b, dt in zip(packed, _PACKED_DTYPES[n]))))


class ParentPin(NamedTuple):
    """In an edit's ``pinned``: the open checkpoint ``version`` is written on top of version ``parent``, which a
    drop must not take away (its new records would read older chains, and no kept version would hold the
    parent's entries)."""

    version: int
    parent: int


# the parts decided in the transaction ------------------------------------------------------------------
def _drop_versions(w: IndexWriter, drop: frozenset, allow_newest: bool, pinned: frozenset) -> list[int]:
    """Drop the versions of ``drop`` still present and every entry no kept version reads (an entry at v of
    a block is read by kept k >= v only if no baseline lies in (v, k]; a dense entry is a whole array).
    Returns the dropped versions, oldest first."""
    versions = w.version_numbers()
    dropped = sorted(set(versions) & set(drop))
    if dropped and dropped[-1] == versions[-1] and not allow_newest:
        raise CnrError("the newest version cannot be dropped")  # a policy bug, not a user input
    for pin in pinned:
        if isinstance(pin, ParentPin) and pin.parent in dropped:  # its records go on top of the parent's chains
            raise CheckpointInProgress(f"version {pin.parent} cannot be dropped while checkpoint {pin.version}, "
                                       "written on top of it, is open; drop it once that checkpoint has committed "
                                       "or aborted")
    kept = sorted(set(versions) - set(dropped))
    by_block: dict[tuple[int, int], list] = {}
    for t, b, v, loc in w.row_entries():
        by_block.setdefault((t, b), []).append((v, loc))
    for (t, b), entries in by_block.items():
        _delete_unread_rows(w, t, b, entries, kept, pinned)
    by_dense: dict[int, list] = {}
    for d, v, _loc in w.dense_entries():
        by_dense.setdefault(d, []).append((v, True))
    for d, entries in by_dense.items():
        for v in unread_versions(entries, kept):
            w.delete_dense(d, v)
    for v in dropped:
        w.delete_version(v)
    return dropped


def _prune_shadowed(w: IndexWriter, blocks: list[tuple[int, int]], pinned: frozenset) -> None:
    """Delete the entries of ``blocks`` no kept version reads (those of dropped versions a new baseline
    shadows), except pinned ones."""
    kept = w.version_numbers()
    for tid, blk in blocks:
        _delete_unread_rows(w, tid, blk, w.block_entries(tid, blk), kept, pinned)


def _delete_unread_rows(w: IndexWriter, tid: int, blk: int, entries: list, kept: list[int], pinned: frozenset) -> None:
    """Delete the entries of block ``blk`` of table ``tid`` (``entries``: (version, RowLoc), oldest first) that
    no version of ``kept`` reads, except pinned ones (the bases of deltas the open checkpoint writes)."""
    chain = [(v, bool(loc.flags & record.FLAG_BASELINE), loc.base) for v, loc in entries]
    for v in unread_versions(chain, kept):
        if (tid, blk, v) not in pinned:
            w.delete_row(tid, blk, v)


def _move(w: IndexWriter, move: Move) -> None:
    if move.kind == "row":
        current, put = w.row_at(*move.key), w.put_row
    elif move.kind == "dense":
        current, put = w.dense_loc(*move.key), w.put_dense
    else:
        current, put = w.log_loc(*move.key), w.put_log
    if _same_place(current, move.old):
        put(*move.key, move.new)
    elif move.conflict is not None:
        raise InvalidArgument(move.conflict)


def _same_place(current, old) -> bool:
    """Whether an index entry (RowLoc or DenseLoc, or None) still points at the record ``old`` does."""
    return current is not None and (current.segment, current.offset) == (old.segment, old.offset)


def _doom(w: IndexWriter, planned: dict[int, int]) -> list[int]:
    """Take out of the index the segments of ``planned`` whose committed length is still the planned one
    (GC plans on a snapshot: a segment a commit has grown since may hold entries the plan did not see;
    no commit takes a segment out of the catalog while an entry points into it). Their files wait in
    meta ``doomed_segments``, with this transaction's id, for readers to finish. Returns them."""
    freed = [seg for seg, length in planned.items() if w.segment_length(seg) == length]
    doomed = DOOMED_SEGMENTS.get(w)
    for seg in freed:
        w.delete_segment(seg)
        doomed[seg] = w.txn_id()
    DOOMED_SEGMENTS.put(w, doomed)
    return freed


def prune_log(w: IndexWriter) -> None:
    """Forget (so that GC may reclaim) the COMMIT and ANCHOR records repair no longer needs.

    With k(u) the smallest kept version >= u: the COMMIT of a dropped version u is dead once an anchor
    lies in (u, k(u)] (or no kept version is newer); an ANCHOR at a is dead once a newer anchor lies in
    (a, k(a)] (or no kept version is newer). COMMITs of kept versions and their anchors stay. Only the
    newest DROP record is needed: it lists every version kept at that drop.
    """
    kept = w.version_numbers()
    anchors = [v for _k, v, _loc in w.log_entries(record.KIND_ANCHOR)]
    drops = [seq for _k, seq, _loc in w.log_entries(record.KIND_DROP)]
    dead = [(record.KIND_DROP, seq) for seq in drops[:-1]]  # the newest DROP lists every kept version
    for kind, u, _loc in list(w.log_entries()):
        if kind == record.KIND_DROP:
            continue
        i = bisect.bisect_left(kept, u)  # not np.searchsorted: it would convert the list on each call
        if i < len(kept) and kept[i] == u and kind == record.KIND_COMMIT:
            continue
        k = kept[i] if i < len(kept) else None
        j = bisect.bisect_right(anchors, u)  # first anchor > u
        if k is None or (j < len(anchors) and anchors[j] <= k):
            dead.append((kind, u))
    for kind, u in dead:
        w.delete_log(kind, u)


def crash_points(operation: str) -> tuple[str, str | None, str]:
    """The crash points (``fs.crash_point``) ``Engine._commit`` passes for a change made by ``operation``:
    (after its records are appended, after their fsync or None, inside its index transaction). A
    checkpoint's are ``after_append``, ``after_fsync`` and ``inside_index_commit``; a maintenance step's
    ``<operation>_after_append`` and ``<operation>_inside_index_commit`` (``CNRSTORE_CRASH_AT`` names
    them)."""
    if operation == "checkpoint":
        return "after_append", "after_fsync", "inside_index_commit"
    return f"{operation}_after_append", None, f"{operation}_inside_index_commit"
