"""Changes between two versions: what a serving replica at version ``since`` needs to reach ``until``.

The rule (docs/DESIGN.md, "Changes between versions"). A row reads at ``until`` as its value in the newest
record of its block's read chain there that holds it (reader.py); call that record's index version the
row's *source*. Every record holds values as of its own version, never later ones: a checkpoint's record
its own puts, a merge's (a cumulative delta or a new baseline) or a compaction's baseline the rows as of
the version it is keyed at, a GC rewrite a subset of the rows it had under the same key. So a row whose
value was put by a version in ``(since, until]`` has its source in ``(since, until]`` too, and a row whose
source is at or before ``since`` reads at ``until`` as it read at ``since``. The changes are therefore the
rows whose source lies in ``(since, until]``, found from:

1. the index keys alone: the blocks with an entry in ``(since, until]`` (``IndexView.blocks_written_in``);
   no other block is read;
2. in each, the chain at ``until`` walked newest first while its records are newer than ``since`` (chains
   go down in version); each record's rows not held by a newer one are taken, encoded, as the rows read.

Records that may repeat rows their version did not change are a baseline (every row of its block: a save
that put the whole block, a compaction, a save's or a merge's new baseline) and a cumulative delta whose
base is older than ``since`` (every row changed since that base). Their rows are *suspect*: each is
compared with its value at ``since`` (one read of those rows there) and dropped where the decoded float32
bits are equal, so that a merge or a compaction does not make a replica re-load rows it has. What is left
over-reports only rows a checkpoint in ``(since, until]`` put (as a plain increment, or folded into a delta
on a base at or after ``since``) with the value they already had at ``since``: under-reporting, never.
``since`` must be a retained version for that comparison (the caller checks it); the rule of steps 1-2
alone would hold for a dropped one too.

Vectorized per block: numpy over the rows of a block, a Python loop over blocks and records only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .. import codecs
from . import blocks as blocks_math
from . import record
from .index import IndexView
from .range_fetch import ByteRange
from .reader import BlockResolver
from .schema import TableRecord
from .storage import SegmentStorage

__all__ = ["EncodedRows", "TableChanges", "table_changes", "dense_changed", "dense_changes"]


@dataclass(frozen=True)
class EncodedRows:
    """Rows of a table as stored: ``data`` (uint8 ``(len(rows), codecs.get(codec).row_bytes(dim))``) holds
    row ``rows[i]`` (int64, sorted) encoded by ``codec`` (its name), e.g. int8's row-wise codes with their
    fp16 scale and bias; ``codecs.get(codec).decode(data, dim)`` gives the float32 rows."""

    codec: str
    rows: np.ndarray
    data: np.ndarray

    def decode(self, dim: int) -> np.ndarray:
        """float32 ``(len(rows), dim)``: the rows' values, as the store reads them."""
        return codecs.get(self.codec).decode(self.data, dim)


@dataclass(frozen=True)
class TableChanges:
    """One table's changes between versions ``since`` and ``until`` (``Store.changes``).

    ``rows`` (int64, sorted, unique): the rows whose value at ``until`` came from a version newer than
    ``since`` (a superset of the rows put in ``(since, until]`` whose value changed; engine/changes.py
    says when it holds more). Their values at ``until``: ``values`` (float32 ``(len(rows), dim)``) or, with
    ``encoded=True``, ``parts`` (``EncodedRows``, one per codec the rows are stored in: the table's
    ``codec`` almost always; a fallback (``fp16`` -> ``int8`` -> ``fp32``), a ``put_rows(codec=)`` override or a
    merge mixing codecs (``fp32``) adds others) and ``values`` None. ``decoded()`` gives the float32 rows
    either way. A keyed table's (``keyed`` True) adds ``columns`` and ``deleted`` (below)."""

    table: str
    since: int
    until: int
    dim: int
    codec: str
    rows: np.ndarray
    values: np.ndarray | None = None
    parts: tuple[EncodedRows, ...] | None = None
    #: A keyed table's changes: ``rows`` are the keys live at ``until`` whose row (value or a column) differs
    #: from ``since`` or that were absent there, ``values`` their values (decoded, even with encoded=True),
    #: ``columns`` {name: array} their columns, ``deleted`` the keys live at ``since`` and absent at ``until``.
    keyed: bool = False
    columns: dict | None = None
    deleted: np.ndarray | None = None

    @property
    def encoded(self) -> bool:
        """Whether the values are given encoded (``parts``) rather than decoded (``values``)."""
        return self.parts is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the values as given: the encoded rows' (``parts``), else the float32 ``values``'."""
        if self.parts is not None:
            return sum(int(p.data.nbytes) for p in self.parts)
        return 0 if self.values is None else int(self.values.nbytes)

    def decoded(self) -> np.ndarray:
        """float32 ``(len(rows), dim)``: the rows' values at ``until`` (``values``, or ``parts`` decoded)."""
        if self.parts is None:
            return self.values
        out = np.empty((self.rows.size, self.dim), dtype=np.float32)
        for p in self.parts:
            out[np.searchsorted(self.rows, p.rows)] = p.decode(self.dim)
        return out


def _suspect(rec: record.Record, since: int) -> bool:
    """Whether record ``rec`` (newer than ``since``) may hold rows it did not change since ``since``: a
    baseline (every row of its block as of its version), or a cumulative delta on a base older than
    ``since`` (every row changed since that base). A plain increment (a GC rewrite of one included: same
    key, fewer rows) holds only its own version's puts; a delta on a base at or after ``since`` only puts of
    ``(base, version]``."""
    if rec.flags & record.FLAG_BASELINE:
        return True
    return bool(rec.flags & record.FLAG_DELTA) and rec.base() < since


def _block_changes(resolver: BlockResolver, block: int, since: int, until: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(codec id, encoded rows (copies), block offsets) of each record of the block whose rows are changes:
    the chain at ``until`` newest first down to ``since``, each row from the newest record holding it, the
    suspect rows equal at ``since`` dropped (``_unchanged``). Offsets of different entries are disjoint."""
    table = resolver.table
    block_len = blocks_math.length(block, table.block_rows, table.num_rows)
    taken: np.ndarray | None = None
    got: list[tuple[int, np.ndarray, np.ndarray, bool]] = []
    for v, loc in resolver.view.row_chain(table.id, block, until):
        if v <= since:
            break  # the chain goes down in version: every row left has its source at or before since
        rec, rows = resolver.load_rows(loc, block, v)
        if not rec.count:  # a record GC emptied: every row of it is shadowed
            continue
        offsets = rec.offsets()
        if taken is None:
            taken = np.zeros(block_len, dtype=bool)
        else:
            keep = ~taken[offsets]
            if not keep.all():
                offsets, rows = offsets[keep], rows[keep]
        if offsets.size:
            taken[offsets] = True
            got.append((rec.codec_id, np.array(rows), offsets, since > 0 and _suspect(rec, since)))
    if any(s for *_x, s in got):
        got = _unchanged(resolver, block, since, got)
    return [(cid, rows, offsets) for cid, rows, offsets, _s in got if offsets.size]


def _unchanged(resolver: BlockResolver, block: int, since: int, got: list) -> list:
    """``got`` with each suspect row whose value at ``since`` has the same float32 bits dropped (a row never
    written at ``since`` is kept): one read of the suspect rows at ``since``."""
    dim = resolver.dim
    suspect = [i for i, g in enumerate(got) if g[3]]
    offsets = np.concatenate([got[i][2] for i in suspect])
    order = np.argsort(offsets, kind="stable")
    want = offsets[order]
    new = np.concatenate([codecs.by_id(got[i][0]).decode(got[i][1], dim) for i in suspect])[order]
    old = np.empty_like(new)
    held = np.zeros(want.size, dtype=bool)
    pieces, _absent = resolver.resolve(block, want, since)
    for p in pieces:
        at = np.searchsorted(want, p.dest)
        old[at] = codecs.by_id(p.codec_id).decode(p.encoded, dim)
        held[at] = True
    same_sorted = held & (old.view(np.uint32) == new.view(np.uint32)).all(axis=1)
    same = np.empty_like(same_sorted)
    same[order] = same_sorted  # back in the order of ``offsets``
    out, at = list(got), 0
    for i in suspect:
        cid, rows, offs, _s = got[i]
        drop = same[at:at + offs.size]
        at += offs.size
        out[i] = (cid, rows[~drop], offs[~drop], False) if drop.any() else got[i]
    return out


def table_changes(view: IndexView, segments: SegmentStorage, table: TableRecord, since: int, until: int, *,
                  encoded: bool = False) -> TableChanges:
    """The changes of one table from ``since`` (0: every row written) to ``until`` (both retained versions,
    ``since <= until``, checked by the caller), read within ``view``. Records are checksum-verified as they
    are read (a storage that fetches ahead, a remote tier, fetches them first: ``SegmentStorage.prefetch``);
    rows come out sorted, their values as ``TableChanges`` says."""
    resolver = BlockResolver(view, segments, table)
    shift = blocks_math.shift(table.block_rows)
    found: list[np.ndarray] = []  # rows, in order (blocks ascending, offsets sorted within each)
    by_codec: dict[int, tuple[list, list]] = {}  # codec id -> (encoded rows, their positions in the result)
    count = 0
    blocks = list(view.blocks_written_in(table.id, since, until))
    # the records the walks below load, in their order, from the index alone: a remote tier fetches them
    # ahead, coalesced into ranged requests (a read at since of suspect rows is a plain read)
    ahead = [ByteRange(loc.segment, loc.offset, loc.length) for block in blocks
             for _v, loc in itertools.takewhile(lambda e: e[0] > since, view.row_chain(table.id, block, until))]
    with segments.prefetch(ahead, bounded=True):
        for block in blocks:
            entries = _block_changes(resolver, block, since, until)
            if not entries:
                continue
            offsets = np.concatenate([e[2] for e in entries])
            order = np.argsort(offsets, kind="stable")
            position = np.empty(offsets.size, dtype=np.int64)
            position[order] = np.arange(count, count + offsets.size)
            found.append(offsets[order] + (block << shift))
            at = 0
            for cid, rows, offs in entries:
                encs, dests = by_codec.setdefault(cid, ([], []))
                encs.append(rows)
                dests.append(position[at:at + offs.size])
                at += offs.size
            count += offsets.size
    rows = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    info = table.info()
    if encoded:
        parts = []
        for cid, (encs, dests) in sorted(by_codec.items()):
            dest = np.concatenate(dests)
            order = np.argsort(dest, kind="stable")
            parts.append(EncodedRows(codecs.by_id(cid).name, rows[dest[order]], np.concatenate(encs)[order]))
        return TableChanges(table.name, since, until, table.dim, info.codec, rows, None, tuple(parts))
    values = np.empty((rows.size, table.dim), dtype=np.float32)
    if len(by_codec) == 1:  # the usual case: put the encoded rows (a few bytes each) in order, decode in place
        ((cid, (encs, dests)),) = by_codec.items()
        ordered = np.empty((rows.size, encs[0].shape[1]), dtype=np.uint8)
        ordered[np.concatenate(dests)] = np.concatenate(encs)
        codecs.by_id(cid).decode_into(ordered, table.dim, values)
        return TableChanges(table.name, since, until, table.dim, info.codec, rows, values, None)
    for cid, (encs, dests) in by_codec.items():
        values[np.concatenate(dests)] = codecs.by_id(cid).decode(np.concatenate(encs), table.dim)
    return TableChanges(table.name, since, until, table.dim, info.codec, rows, values, None)


def dense_changed(view: IndexView, since: int, until: int, names: list[str] | None = None) -> list[str]:
    """The names (sorted, or in ``names``' order; each must exist, checked by the caller) of the dense arrays
    whose newest record at or before ``until`` is newer than ``since`` (0: every one ``until`` holds), from
    the index alone. A dense record is always a whole array put at its version (a payload migration
    rewrites it under the same version), so this is exact: an array put again with the same bytes included."""
    ids = view.dense_names()
    out = []
    for name in sorted(ids) if names is None else names:
        found = view.dense_at(ids[name], until)
        if found is not None and found[0] > since:
            out.append(name)
    return out


def dense_changes(view: IndexView, segments: SegmentStorage, since: int, until: int,
                  names: list[str] | None = None) -> dict[str, np.ndarray]:
    """{name: array at ``until``} of the arrays ``dense_changed`` names."""
    from .reader import read_dense

    ids = view.dense_names()
    return {name: read_dense(view, segments, ids[name], name, until)
            for name in dense_changed(view, since, until, names)}
