"""Point-in-time reads: resolve which record holds each asked row of a block at a version, and decode.

A block's records at or before version v, newest first, form its *read chain*. A row reads as its
value in the newest record of the chain that holds it; a baseline record (every row of the block
written at or before its version) ends the chain: rows not found by then were never written. Every record is checksum-verified (record.parse) before any byte of it is used.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import blocks as blocks_math
from .. import codecs
from . import chain as chain_rule
from . import record
from ..errors import CorruptionError, InvalidArgument, MissingRows
from .index import IndexView, RowLoc
from .range_fetch import ByteRange
from .schema import TableRecord
from .storage import Expect, SegmentStorage, fetch


@dataclass
class Piece:
    """Encoded rows of one record to decode, and where they go inside their block."""

    codec_id: int
    source: np.ndarray  # uint8 (m, row_bytes): the record's rows (a view of the segment's map, or a copy)
    dest: np.ndarray | None  # int64 block offsets, or None for rows 0..n-1
    take: np.ndarray | None = None  # bool (m,): the rows of ``source`` this piece holds; None: all of them
    #: With ``dest`` None: the newer records of the chain above the baseline ``source``, newest first, as
    #: (encoded rows, u16 block offsets): the block reads as ``source`` with their rows written over it,
    #: the newest record's of each row winning (resolved when decoded, on the decoding thread).
    over: list | None = None

    @property
    def encoded(self) -> np.ndarray:
        """uint8 (n, row_bytes): the piece's rows, in ``dest`` order (a copy when ``take`` selects some:
        a plan keeps views, and its rows are gathered one block at a time as they are decoded)."""
        return self.source if self.take is None else self.source[self.take]

    @property
    def count(self) -> int:
        """Rows in the piece."""
        return self.source.shape[0] if self.dest is None else self.dest.shape[0]


class BlockPlan(NamedTuple):
    """A block of a whole-table (or row-range) read, planned: its pieces, every record they come from
    verified (``iter_plan``)."""

    offset: int  # where the block's first row goes, from the read's first row
    pieces: list[Piece]  # ``decode_block``'s
    ranges: list[ByteRange]  # every record read to plan it: what the read may let go of once decoded


class BlockResolver:
    """Reads records of one table through a segment reader, within one index transaction."""

    def __init__(self, view: IndexView, segments: SegmentStorage, table: TableRecord):
        self.view = view
        self.segments = segments
        self.table = table
        self.block_rows = table.block_rows
        self.dim = table.dim
        #: a list: each record ``load`` reads is noted in it (``iter_plan``: the ranges of a block's plan)
        self.loaded: list[ByteRange] | None = None

    def load(self, loc, block: int | None = None, version: int | None = None) -> record.Record:
        """The verified record at ``loc``; it must be the one its index entry (block, version) names."""
        rec = fetch(self.segments, loc, Expect(record.KIND_ROWS, self.table.id, version, block))
        if self.loaded is not None:
            self.loaded.append(ByteRange(loc.segment, loc.offset, loc.length))
        return rec

    def resolve(self, block: int, want: np.ndarray | None, version: int, *,
                overlay: bool = False) -> tuple[list[Piece], np.ndarray]:
        """Pieces holding the rows ``want`` (sorted unique block offsets; None = every row) at ``version``.

        Each wanted row appears in exactly one piece, except with ``overlay`` (and ``want`` None): a chain
        of records of one codec on a full baseline is then one Piece with ``over`` (``decode_block``
        resolves it), which costs a read a few array operations per block rather than per record.
        Returns (pieces, offsets never written).
        """
        block_len = blocks_math.length(block, self.block_rows, self.table.num_rows)
        if want is None:
            chain = self._chain(block, version)
            if overlay:
                found, seen = self._overlay(chain, block_len)
                if found is not None:
                    return [found], np.zeros(0, dtype=np.int64)
                chain = itertools.chain(seen, chain)  # (each record is loaded and verified once)
            return self._resolve_all(chain, block_len)
        remaining = want
        pieces: list[Piece] = []
        for v, loc in self.view.row_chain(self.table.id, block, version):
            rec, rows = self.load_rows(loc, block, v)
            if not rec.count:  # a record GC emptied (every row of it shadowed for every kept version)
                if rec.flags & record.FLAG_BASELINE:
                    break
                continue
            if rec.flags & record.FLAG_FULL:
                found = remaining < rec.count
                idx = remaining[found]
            else:
                offsets = rec.stored_offsets()  # u16, searched as is: no per-record copy
                idx = np.searchsorted(offsets, remaining.astype(record.OFFSET_DTYPE))
                np.minimum(idx, rec.count - 1, out=idx)
                found = offsets[idx] == remaining
                idx = idx[found]
            if idx.size:
                pieces.append(Piece(rec.codec_id, rows[idx], remaining[found]))
                remaining = remaining[~found]
            if not remaining.size or rec.flags & record.FLAG_BASELINE:
                break
        return pieces, remaining

    def _chain(self, block: int, version: int) -> Iterator[tuple[record.Record, np.ndarray]]:
        """The block's read chain at ``version``, newest first: each record verified as it is reached
        (``load_rows``), with its encoded rows."""
        for v, loc in self.view.row_chain(self.table.id, block, version):
            yield self.load_rows(loc, block, v)

    def _overlay(self, chain: Iterator, block_len: int) -> tuple[Piece | None, list]:
        """(the block as one Piece: its full baseline ``source`` with the newer records' rows ``over`` it,
        the records of ``chain`` taken so far). The Piece is None unless the chain ends in a baseline of
        every row and all its records share one codec; ``_resolve_all`` goes on from the records taken."""
        seen: list[tuple[record.Record, np.ndarray]] = []
        for rec, rows in chain:
            seen.append((rec, rows))
            if rec.codec_id != seen[0][0].codec_id:
                return None, seen
            if ends_read(rec, block_len):
                over = [(r, np.arange(c.count, dtype=record.OFFSET_DTYPE) if c.flags & record.FLAG_FULL
                         else c.stored_offsets()) for c, r in seen[:-1] if c.count]  # (GC empties records)
                return Piece(rec.codec_id, rows, None, over=over or None), seen
            if rec.flags & record.FLAG_BASELINE:
                return None, seen  # a baseline of part of the block: rows may be missing
        return None, seen

    def _resolve_all(self, chain: Iterator, block_len: int) -> tuple[list[Piece], np.ndarray]:
        """``resolve`` for every row of the block from its ``chain`` (``_chain``): newest record first,
        each row taken once."""
        pieces: list[Piece] = []
        filled = None
        left = block_len
        for rec, rows in chain:
            if filled is None and ends_read(rec, block_len):
                return [Piece(rec.codec_id, rows, None)], np.zeros(0, dtype=np.int64)  # the common case
            offsets = rec.offsets()
            if filled is None:
                filled = np.zeros(block_len, dtype=bool)
                take = None
            else:
                take = ~filled[offsets]
                if take.all():
                    take = None
                else:
                    offsets = offsets[take]  # (the rows stay a view: Piece.encoded selects them when used)
            if offsets.size:
                pieces.append(Piece(rec.codec_id, rows, offsets, take))
                filled[offsets] = True
                left -= offsets.size
            if not left or rec.flags & record.FLAG_BASELINE:
                break
        if filled is None:
            return pieces, np.arange(block_len, dtype=np.int64)
        return pieces, (np.flatnonzero(~filled) if left else np.zeros(0, dtype=np.int64))

    def load_rows(self, loc, block: int, version: int) -> tuple[record.Record, np.ndarray]:
        """The verified record and its encoded rows as a (count, row_bytes) array."""
        rec = self.load(loc, block, version)
        path = self.segments.path(loc.segment)
        try:
            row_bytes = codecs.by_id(rec.codec_id).row_bytes(self.dim)
        except InvalidArgument:
            raise CorruptionError(f"record at {path}:{loc.offset} names unknown codec id {rec.codec_id}",
                                  path, loc.offset) from None
        if rec.body.size != rec.count * row_bytes:
            raise CorruptionError(f"record at {path}:{loc.offset} holds {rec.body.size} body bytes, not "
                                  f"{rec.count} rows of {row_bytes}", path, loc.offset)
        check_offsets(rec, blocks_math.length(block, self.block_rows, self.table.num_rows), path, loc.offset)
        return rec, rec.body.reshape(rec.count, row_bytes)


def check_offsets(rec: record.Record, block_len: int, path: str, offset: int) -> None:
    """CorruptionError unless every row offset of ROWS record ``rec`` lies in its block of ``block_len`` rows
    (the table catalog and the record disagree otherwise): a FULL record's count, else its largest stored
    offset (one vectorized pass over at most 2**16 u16)."""
    last = (rec.count if rec.flags & record.FLAG_FULL else
            int(rec.stored_offsets().max()) + 1 if rec.count else 0)
    if last > block_len:
        raise CorruptionError(f"record at {path}:{offset} holds row offset {last - 1} of block {rec.block}, which "
                              f"has {block_len} rows in the table catalog: the store is damaged", path, offset)


def unread_versions(entries: list[tuple], kept: list[int]) -> list[int]:
    """Versions of one block's ``entries`` no version in ``kept`` (sorted) reads, oldest first.

    ``entries``: (version, is baseline) or (version, is baseline, delta base) per index entry, oldest
    first. A kept version k reads the entries of its read chain: from the newest entry at or before k,
    back to a baseline, jumping from a cumulative delta to the entry at its base version. The walk from
    an entry on does not depend on where it began, so each entry is walked once: linear in entries,
    plus one binary search per kept version (vectorized).
    """
    if not entries:
        return []
    versions = np.fromiter((e[0] for e in entries), dtype=np.int64, count=len(entries))
    starts = np.unique(np.searchsorted(versions, np.asarray(kept, dtype=np.int64), side="right") - 1)
    position = {int(v): i for i, v in enumerate(versions.tolist())}
    flags = [record.FLAG_BASELINE if e[1] else 0 for e in entries]
    bases = [e[2] if len(e) > 2 else 0 for e in entries]
    read = np.zeros(len(entries), dtype=bool)
    for start in starts[starts >= 0].tolist():
        for i in chain_rule.walk(flags, bases, position, start):
            if read[i]:
                break  # the walk from here on is done already
            read[i] = True
    return versions[~read].tolist()


#: How many missing row ids a MissingRows message names (the count is always exact).
MISSING_SHOWN = 8


class _Missing:
    """Rows found missing, block by block in ascending row order: the exact count and the first
    ``MISSING_SHOWN`` ids. Memory is constant however many rows are missing."""

    def __init__(self):
        self.count = 0
        self.first: list[int] = []

    def add(self, rows: np.ndarray) -> None:
        """Missing row ids (ascending, after every id added before)."""
        self.count += int(rows.size)
        if len(self.first) < MISSING_SHOWN:
            self.first.extend(int(r) for r in rows[: MISSING_SHOWN - len(self.first)])

    def add_range(self, start: int, stop: int) -> None:
        """Rows ``start`` .. ``stop - 1``, counted arithmetically (never materialized)."""
        if stop <= start:
            return
        self.count += stop - start
        if len(self.first) < MISSING_SHOWN:
            self.first.extend(range(start, min(stop, start + MISSING_SHOWN - len(self.first))))

    def error(self, table: str, version: int, *, whole_table: bool = False) -> MissingRows:
        first = ", ".join(map(str, self.first)) + (", ..." if self.count > len(self.first) else "")
        hint = ("restore a table only once every row is written (write the missing rows in a checkpoint, "
                "or read the written rows with read_rows)" if whole_table else
                "ask only for rows written at or before this version, or read a later version")
        return MissingRows(
            f"{self.count} row(s) of table {table!r} were never written at or before version {version} "
            f"(first: {first}); {hint}"
        )


def read_rows(view: IndexView, segments: SegmentStorage, table: TableRecord, rows: np.ndarray, version: int) -> np.ndarray:
    """float32 (len(rows), dim): ``rows`` (validated int64, may repeat) as of ``version``.

    Raises MissingRows (its exact count and the first ids) before allocating the output if any row
    was never written at or before ``version``.
    """
    dim = table.dim
    unique_rows, inverse = np.unique(rows, return_inverse=True)
    shift = blocks_math.shift(table.block_rows)
    blocks = unique_rows >> shift
    starts, bounds = blocks_math.runs(blocks)
    resolver = BlockResolver(view, segments, table)
    by_codec: dict[int, tuple[list, list]] = {}
    missing = _Missing()
    for i in range(starts.size):
        lo, hi = bounds[i], bounds[i + 1]
        block = int(blocks[lo])
        base = block << shift
        pieces, absent = resolver.resolve(block, unique_rows[lo:hi] - base, version)
        if absent.size:
            missing.add(absent + base)
        if missing.count:
            continue  # the read fails: keep counting, stop gathering
        for p in pieces:
            encs, dests = by_codec.setdefault(p.codec_id, ([], []))
            encs.append(p.encoded)
            # position in unique_rows of each decoded row
            dests.append(lo + np.searchsorted(unique_rows[lo:hi], p.dest + base))
    if missing.count:
        raise missing.error(table.name, version)
    out_unique = np.empty((unique_rows.size, dim), dtype=np.float32)
    for codec_id, (encs, dests) in by_codec.items():
        decoded = codecs.by_id(codec_id).decode(np.concatenate(encs), dim)
        out_unique[np.concatenate(dests)] = decoded
    return out_unique if unique_rows.size == rows.size and np.array_equal(unique_rows, rows) else out_unique[inverse]


def _written_blocks(view: IndexView, table: TableRecord, version: int, start: int,
                    stop: int) -> Iterator[tuple[int, int, int]]:
    """(block, first row, end row) of every block with an index entry at or before ``version`` that rows
    ``start .. stop - 1`` of the table reach, in block order, the rows clipped to the range: one seek to
    find each (``IndexView.row_blocks``), whatever was never written between them."""
    num_rows, block_rows = table.num_rows, table.block_rows
    first, last = start >> blocks_math.shift(block_rows), (stop - 1) >> blocks_math.shift(block_rows)
    for block, oldest in view.row_blocks(table.id, first):
        if block > last:
            return  # past the range (an entry past the table's end included: verify reports it)
        if oldest > version:
            continue  # written only later: counted with the gap before the next written block
        base = blocks_math.base(block, block_rows)
        yield block, max(start, base), min(stop, base + blocks_math.length(block, block_rows, num_rows))


def every_block_written(view: IndexView, table: TableRecord, version: int, start: int = 0,
                        stop: int | None = None) -> bool:
    """Whether every block that rows ``start .. stop - 1`` reach has an index entry at or before ``version``
    (one seek per written block): else the read of the range must raise MissingRows. True does not promise
    every row (a block's records may hold only some of its rows)."""
    stop = table.num_rows if stop is None else stop
    if stop <= start:
        return True
    shift = blocks_math.shift(table.block_rows)
    blocks = ((stop - 1) >> shift) - (start >> shift) + 1
    return sum(1 for _ in _written_blocks(view, table, version, start, stop)) == blocks


def ends_read(loc, block_len: int) -> bool:
    """Whether a read of a block goes no further down its chain than the entry (or record) ``loc``: it holds
    every row of the block (FULL with ``block_len`` rows). The chain itself ends after a baseline
    (``IndexView.row_chain``); a read may stop sooner still, once the records above have held every row
    it asks for, which only the records' offsets tell."""
    return bool(loc.flags & record.FLAG_FULL) and loc.count == block_len


def plan_reads(view: IndexView, table: TableRecord, version: int, start: int = 0,
               stop: int | None = None) -> Iterator[RowLoc]:
    """The index location of every record ``plan_table`` (same arguments) will fetch, in the order it
    fetches them, from the index alone: each block's read chain down to its end or to an entry that holds
    every row (``ends_read``). It may name a few records the read then does not need (rows found sooner),
    never fewer: what a storage fetches ahead of the read (``SegmentStorage.prefetch``)."""
    stop = table.num_rows if stop is None else stop
    if stop <= start:
        return
    for block, _lo, _hi in _written_blocks(view, table, version, start, stop):
        block_len = blocks_math.length(block, table.block_rows, table.num_rows)
        for _v, loc in view.row_chain(table.id, block, version):
            yield loc
            if ends_read(loc, block_len):
                break


def iter_plan(view: IndexView, segments: SegmentStorage, table: TableRecord, version: int,
              start: int = 0, stop: int | None = None) -> Iterator[BlockPlan]:
    """``plan_table`` block by block: each ``BlockPlan`` as soon as its records are verified, so that a
    caller may decode it while later blocks are fetched. Raises MissingRows after the last block if rows
    are missing (and yields nothing more once it finds one)."""
    num_rows = table.num_rows
    stop = num_rows if stop is None else stop
    if stop <= start:
        return
    resolver = BlockResolver(view, segments, table)
    resolver.loaded = []
    missing = _Missing()
    next_row = start  # rows of the range before it are accounted for
    for block, lo, hi in _written_blocks(view, table, version, start, stop):
        base = blocks_math.base(block, table.block_rows)
        missing.add_range(next_row, lo)
        next_row = hi
        if hi - lo == blocks_math.length(block, table.block_rows, num_rows):
            pieces, absent = resolver.resolve(block, None, version, overlay=True)
        else:  # the range's ends cut the block: only its rows there, renumbered from the cut
            pieces, absent = resolver.resolve(block, np.arange(lo - base, hi - base, dtype=np.int64), version)
            pieces = [Piece(p.codec_id, p.source, p.dest - (lo - base), p.take) for p in pieces]
        ranges, resolver.loaded = resolver.loaded, []
        if absent.size:
            missing.add(absent + base)
        if not missing.count:
            yield BlockPlan(lo - start, pieces, ranges)
    missing.add_range(next_row, stop)
    if missing.count:
        raise missing.error(table.name, version, whole_table=True)


def plan_table(view: IndexView, segments: SegmentStorage, table: TableRecord, version: int,
               start: int = 0, stop: int | None = None) -> list[BlockPlan]:
    """A ``BlockPlan`` (offset, pieces, ranges) of every block of rows ``start .. stop - 1`` of the table
    (default: the whole table; ``0 <= start <= stop <= num_rows``, checked by the caller) as of ``version``:
    the pieces hold the block's rows of the range, in order from row ``start + offset``, each row in exactly
    one piece (``decode_block(out, offset, pieces, dim)`` writes them), and ``ranges`` are the records read
    for them. Every record these pieces come from is verified (checksum, the index entry's table, block and version, its codec and row offsets) before
    this returns; nothing is decoded.

    Only blocks with index entries are visited (one seek to find each, ``IndexView.row_blocks``):
    rows of the others are counted as missing arithmetically, so a sparsely written table of billions
    of rows raises MissingRows (exact count, first ids) in time and memory proportional to what was
    written. The pieces of a block wholly in the range are views of the segments' maps (decode them
    within the same read transaction); a block cut by the range's ends holds a copy of its rows there.
    """
    return list(iter_plan(view, segments, table, version, start, stop))


def read_table(view: IndexView, segments: SegmentStorage, table: TableRecord, version: int,
               out: np.ndarray | None = None) -> np.ndarray:
    """float32 (num_rows, dim): the whole table as of ``version``, decoded on this thread into ``out``
    (float32 C-contiguous (num_rows, dim)) if given, else a new array. Every row must have been written.
    Every record is verified (``plan_table``) before ``out`` is written."""
    plans = plan_table(view, segments, table, version)
    if out is None:
        out = np.empty((table.num_rows, table.dim), dtype=np.float32)
    for block in plans:
        decode_block(out, block.offset, block.pieces, table.dim)
    return out


#: Largest encoded block (bytes) ``decode_block`` gathers in a buffer kept by its thread for the next
#: block (a fresh one each time costs a page fault per 4 KiB, twice the gather itself); larger ones
#: get a temporary.
SCRATCH_BYTES = 8 << 20
_scratch = threading.local()


def _encoded_rows(count: int, row_bytes: int) -> np.ndarray:
    """uint8 (count, row_bytes) to gather a block's encoded rows in: this thread's scratch buffer
    (grown as needed up to ``SCRATCH_BYTES``), or a new array for a larger block."""
    need = count * row_bytes
    if need > SCRATCH_BYTES:
        return np.empty((count, row_bytes), dtype=np.uint8)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < need:
        buf = _scratch.buf = np.empty(need, dtype=np.uint8)
    return buf[:need].reshape(count, row_bytes)


def _newest_rows(over: list, block_len: int):
    """(block offsets, encoded rows) of the records ``over`` (newest first: (rows, u16 offsets) each), each
    offset once with the newest record's row; in three array operations whatever the records' count."""
    offsets = np.concatenate([o for _r, o in over]) if len(over) > 1 else over[0][1]
    rows = np.concatenate([r for r, _o in over]) if len(over) > 1 else over[0][0]
    first = np.full(block_len, offsets.size, dtype=np.int64)
    np.minimum.at(first, offsets, np.arange(offsets.size))  # newest first: the smallest position wins
    held = np.flatnonzero(first < offsets.size)
    return held, rows[first[held]]


def decode_block(out: np.ndarray, base: int, pieces: list[Piece], dim: int) -> None:
    """Decode a block's pieces (``plan_table``'s: every row they stand for in exactly one) into
    ``out[base:...]``. A whole-block piece decodes straight from the segment into place; pieces of one
    codec are gathered as encoded rows (a few bytes a row, one block at most, in a buffer the thread
    keeps) and decoded with one call straight into place — a baseline with newer records over it
    (``Piece.over``) is copied whole and the newest row of each offset written over it; pieces of several
    codecs go through a block-sized temporary each."""
    if len(pieces) == 1 and pieces[0].dest is None:
        p = pieces[0]
        source = p.encoded
        if p.over:  # a baseline with newer records over it: one gathered block
            encoded = _encoded_rows(source.shape[0], source.shape[1])
            encoded[:] = source
            held, rows = _newest_rows(p.over, source.shape[0])
            encoded[held] = rows
            source = encoded
        codecs.by_id(p.codec_id).decode_into(source, dim, out[base : base + source.shape[0]])
        return
    codec_id = pieces[0].codec_id
    if all(p.codec_id == codec_id for p in pieces):
        count = sum(p.count for p in pieces)
        encoded = _encoded_rows(count, pieces[0].source.shape[1])
        for p in pieces:  # every row of the block is in exactly one piece
            encoded[p.dest] = p.encoded
        codecs.by_id(codec_id).decode_into(encoded, dim, out[base : base + count])
        return
    for p in pieces:
        out[base + p.dest] = codecs.by_id(p.codec_id).decode(p.encoded, dim)


def read_dense(view: IndexView, segments: SegmentStorage, dense_id: int, name: str, version: int):
    """The dense array ``name`` as of ``version`` (exact dtype, shape and bytes), or None if never put."""
    found = view.dense_at(dense_id, version)
    if found is None:
        return None
    found_version, loc = found
    path = segments.path(loc.segment)
    rec = fetch(segments, loc, Expect(record.KIND_DENSE, dense_id, found_version))
    try:
        desc = rec.dense_descriptor()
        dtype = np.dtype(desc["dtype"])
        return rec.body.view(dtype).reshape(desc["shape"]).copy()
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptionError(f"dense record at {path}:{loc.offset} has a bad descriptor: {exc}", path, loc.offset) from exc
