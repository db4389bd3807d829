"""CheckpointWriter: stream one version's records into the log, then commit it atomically.

Durability protocol (DESIGN.md): (1) append the version's records, then commit its ``VersionEdit``
(version_edit.py) through the one commit path, Engine._commit: (2) its COMMIT record (what repair rebuilds
the index from) is appended and everything fsynced, (3) one synced LMDB transaction applies the edit: the
index entries, the version record and the segments' committed lengths. The version exists exactly when
(3) has committed. Abort (or any failure) truncates what was appended.

A version holds at most one record per (table, block). A second ``put_rows`` that touches a block this
version already wrote merges into a new record for that block: encoded bytes are copied when the codecs
agree, and otherwise both parts are stored as fp32 of their decoded values (exact), never re-quantized.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from . import blocks as blocks_math
from .. import codecs
from . import fs, keyed_reader, merge, reader, record, arguments
from .keyed_writer import KeyedPuts
from ..errors import CnrError, InvalidArgument, StoreClosed, TableNotFound
from .index import DenseLoc, RowLoc
from .block_records import block_records
from .chain_costs import Head
from .schema import TableRecord
from .parts import EngineParts
from .version_edit import VersionEdit

if TYPE_CHECKING:
    from .core import Engine


class CheckpointWriter:
    """Writes one version. Use as a context manager: normal exit commits, an exception aborts."""

    def __init__(self, engine: "Engine", parts: EngineParts, version: int, parent: int | None, step: int | None,
                 meta: dict | None):
        self._engine = engine
        self._parts = parts  # what it appends and commits through (parts.py)
        self.version = version
        self._parent = parent
        self._step = step
        self._meta = meta
        self._rows: dict[str, dict[int, RowLoc]] = {}  # table name -> block -> record location
        self._dense: dict[str, tuple[int, DenseLoc]] = {}  # name -> (dense id, location)
        self._bytes = 0
        self._state = "open"  # open | committed | aborted | failed
        self._failure: BaseException | None = None
        #: (table, block) -> rows (global ids) a merged record of this version carries from older records
        self._carried: dict[tuple[str, int], np.ndarray] = {}
        #: (table id, block, version) of the baselines this version's cumulative deltas read: retention
        #: keeps their entries while the version is being written (compaction.drop_versions)
        self.pins: set[tuple[int, int, int]] = set()
        #: (table, block) -> the newest record of the block's chain at the parent, where this version's record
        #: goes on top of it unmerged: once committed, the engine's chain costs extend by it (chain_costs.py)
        self._below: dict[tuple[str, int], Head] = {}
        self._keyed = KeyedPuts(self)  # puts and deletions of keyed tables (keyed_writer.py)

    @property
    def committed(self) -> bool:
        return self._state == "committed"

    @property
    def parent(self) -> int | None:
        """The version this one goes on top of (the newest committed when it began), or None."""
        return self._parent

    @property
    def engine(self) -> "Engine":
        return self._engine

    def blocks_written(self) -> set[tuple[int, int]]:
        """(table id, block) of every record this version holds (so far)."""
        engine = self._engine
        return {(engine.table_record(name).id, block) for name, blocks in self._rows.items() for block in blocks}

    # context manager --------------------------------------------------------------------------------
    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            if self._state == "open" or self._state == "failed":
                self.commit()
        elif self._state in ("open", "failed"):
            self.abort()
        return False

    # puts -------------------------------------------------------------------------------------------
    def put_rows(self, table: str, rows, values, *, codec: str | None = None) -> None:
        """Write ``values[i]`` as row ``rows[i]`` of ``table`` in this version (see API.md).

        Bad input raises InvalidArgument (naming the table and the first offending row) and leaves the
        version as it was; TableNotFound for an unknown table.
        """
        self._check_open()
        info = self._table(table)
        keyed_reader.check_positional(info, "put_rows")
        rows = arguments.row_ids(rows, info.num_rows, table)
        values, value_range = arguments.row_values(values, rows, info.dim, table)
        order = arguments.sorted_unique_rows(rows, table)
        if order is not None:
            rows, values = rows[order], values[order]
        chosen = codecs.get(codec if codec is not None else info.codec)
        if not rows.size:
            return  # nothing to write: the table is not listed in this version
        shift = blocks_math.shift(info.block_rows)
        blocks = rows >> shift
        pending = self._rows.get(table, {})
        merging = np.isin(blocks, np.fromiter(pending, dtype=np.int64, count=len(pending))) if pending else None
        merge_plans = []
        if merging is not None and merging.any():
            merge_plans = self._plan_merges(table, info, rows, values, blocks, merging, chosen)
        fresh = ~merging if merging is not None else slice(None)
        before = dict(pending) if table in self._rows else None
        with contextlib.ExitStack() as stack:
            try:
                # each block's record in the codec it is written in (the table's, the put's, or a fallback)
                groups = list(_codec_groups(chosen, rows[fresh], values[fresh], shift,
                                            value_range if merging is None else None))
                # blocks whose record would pass the hard read bounds: a merged delta (merge.py)
                chain_merges, resolver = self._chain_merges(stack, info, groups, merge_plans)
                for group_codec, g_rows, g_values in groups:
                    for start, stop in _chunks(g_rows >> shift, self._parts.options.encode_chunk_rows):
                        encoded = group_codec.encode(g_values[start:stop], check=False)
                        self._append_fresh(table, info, group_codec, g_rows[start:stop], encoded, chain_merges,
                                           resolver)
                for p in merge_plans:
                    if p.block in chain_merges:  # the block's record, grown by this put, merged with its chain
                        self._append_chain_merge(table, info, p.block, p.codec, p.rows, p.encoded,
                                                 chain_merges[p.block], resolver)
                    else:
                        self._append(table, block_records(info, p.codec, p.rows, p.encoded, self.version,
                                                          base=p.base, copied=p.copied, baseline=p.complete), p.base)
            except InvalidArgument:
                # what this call appended is unreferenced: the version is as it was before the call
                if before is None:
                    self._rows.pop(table, None)
                else:
                    self._rows[table] = before
                raise
            except BaseException as exc:
                self._fail(exc)
                raise

    def put_keys(self, table: str, keys, values, *, columns=None, codec: str | None = None, delete=None) -> None:
        """Write ``values[i]`` (and each column's entry i) as the row of key ``keys[i]`` of keyed table
        ``table`` in this version (see API.md, "Keyed tables"). A key changes at most once per version.
        ``delete``: keys deleted in this version too, written in the same records as the puts (``delete_keys``
        after ``put_keys`` rewrites each partition both touch, doubling the version's bytes there).

        Bad input raises InvalidArgument and leaves the version as it was; TableNotFound for an unknown table.
        """
        self._check_open()
        info = self._table(table)
        keyed_reader.check_keyed(info, "put_keys")
        self._keyed_call(lambda: self._keyed.put(info, keys, values, columns, codec, delete))

    def delete_keys(self, table: str, keys) -> None:
        """Delete ``keys`` of keyed table ``table`` in this version: a read of this version or a later one
        does not find them (until put again); older versions still do. Deleting an absent key is allowed."""
        self._check_open()
        info = self._table(table)
        keyed_reader.check_keyed(info, "delete_keys")
        self._keyed_call(lambda: self._keyed.delete(info, keys))

    def _keyed_call(self, call) -> None:
        before = {t: dict(b) for t, b in self._rows.items()}
        own = dict(self._keyed.own)
        try:
            call()
        except InvalidArgument:
            self._rows, self._keyed.own = before, own  # what it appended is unreferenced
            raise
        except BaseException as exc:
            self._fail(exc)
            raise

    def rows_of(self, table: str) -> dict:
        """{block or partition: RowLoc} of the records this version wrote of ``table`` so far."""
        return self._rows.get(table, {})

    def append_records(self, table: str, records: list) -> None:
        """Append ((block, count, flags), buffers, length) records of ``table`` (keyed_writer.py)."""
        self._append(table, records)

    def _table(self, table: str) -> TableRecord:
        info = self._engine.table_record(table)
        if info is None:
            raise TableNotFound(f"no table {table!r} in this store; create it with store.create_table()")
        return info

    def put_dense(self, name: str, array) -> None:
        """Store ``array`` (numpy array or torch tensor) exactly, as dense array ``name`` of this version."""
        self._check_open()
        arguments.name(name, "dense array name")
        if name in self._dense:
            raise InvalidArgument(f"dense array {name!r} is put twice in version {self.version}")
        arguments.dense_size(name, array)  # from shape and dtype, before any copy (a tensor on a GPU, a view)
        arr = arguments.to_numpy(array, f"dense array {name!r}")
        arguments.dense_size(name, arr)
        if arr.dtype.hasobject or arr.dtype.fields is not None or arr.dtype.kind in "OVSUMm":
            raise InvalidArgument(f"dense array {name!r} has dtype {arr.dtype}; only numeric and bool arrays "
                                  "are stored (convert others, or pass them in meta=)")
        dense_id = self._engine.dense_id_for(name)
        buffers, length = record.dense_record(dense_id, self.version, arr)
        try:
            seg, off = self._parts.writer_appender.append(buffers, length)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._bytes += length
        self._dense[name] = (dense_id, DenseLoc(seg, off, length))

    # commit / abort ---------------------------------------------------------------------------------
    def commit(self) -> int:
        """Make this version durable and visible; returns its number. Idempotent once committed."""
        if self._state == "committed":
            return self.version
        if self._state == "failed":
            raise CnrError(f"checkpoint {self.version} failed earlier ({self._failure!r}) and cannot commit; "
                           "it has been aborted") from self._failure
        self._check_open()
        engine = self._engine
        try:
            edit = self._edit()
        except BaseException as exc:
            self._fail(exc)
            raise
        # append the COMMIT, fsync, StoreMoved check, one index transaction; on failure self._fail rolls
        # the version back
        self._parts.commit(self._parts.writer_appender, edit, appended=True, on_failure=self._fail)
        self._state = "committed"
        self._extend_chain_costs()
        engine.writer_done(self)
        return self.version

    def abort(self) -> None:
        """Discard this version: nothing of it becomes visible. Idempotent."""
        if self._state in ("committed", "aborted"):
            return
        failed = self._state == "failed"
        self._state = "aborted"
        if not failed:  # a failed writer rolled back already; a newer writer may be appending now
            self._parts.writer_appender.rollback()
        self._engine.writer_done(self)

    # internals --------------------------------------------------------------------------------------
    def _edit(self) -> VersionEdit:
        """What committing this version does (version_edit.py): its row and dense entries, its dense
        names, its ``versions`` entry and counters; encoded as its COMMIT record, with the catalog entries
        of the tables it wrote, so that repair can rebuild the index from the log."""
        engine = self._engine
        info = {
            "step": self._step,
            "meta": self._meta,
            "created": time.time(),
            "parent": self._parent,
            "tables": sorted(self._rows),
            "dense": sorted(self._dense),
            "bytes": self._bytes,
        }
        catalog, rows = [], []
        for name, blocks in self._rows.items():
            tinfo = engine.table_record(name)
            catalog.append(tinfo)
            rows += [(tinfo.id, block, self.version, blocks[block]) for block in sorted(blocks)]
        return VersionEdit(version=self.version, versions={self.version: info}, catalog=catalog, rows=rows,
                           dense=[(dense_id, self.version, loc) for dense_id, loc in self._dense.values()],
                           dense_names={name: dense_id for name, (dense_id, _loc) in self._dense.items()},
                           bytes_written=self._bytes, increment_bytes=self._increment_bytes())

    def _extend_chain_costs(self) -> None:
        """Tell the engine's chain costs about each plain record this committed version put on a chain."""
        engine = self._engine
        for (table, block), below in self._below.items():
            loc = self._rows.get(table, {}).get(block)
            if loc is None or loc.flags & (record.FLAG_DELTA | record.FLAG_BASELINE | record.FLAG_KEYS):
                continue  # merged, or a new baseline: the next save walks the chain afresh
            info = engine.table_record(table)
            self._parts.chain_costs.extend((info.id, block), below, Head(self.version, loc.segment, loc.offset),
                                           merge.read_cost([loc], merge.record_fixed_cost(info, self._parts.options)))

    def _check_open(self) -> None:
        if self._state == "failed":
            raise CnrError(f"checkpoint {self.version} failed earlier ({self._failure!r}); abort it") from self._failure
        if self._state != "open":
            raise StoreClosed(f"checkpoint {self.version} is already {self._state}")
        self._engine.check_open()

    def _fail(self, exc: BaseException) -> None:
        """An I/O failure mid-version: throw the version's bytes away; the writer can only abort now."""
        if isinstance(exc, InvalidArgument):
            return  # raised before anything was appended: the version is unchanged and stays usable
        self._failure = exc
        if self._state == "open":
            self._state = "failed"
            self._parts.writer_appender.rollback()
            self._engine.writer_done(self)  # the store may start a new checkpoint at once

    def _append(self, table: str, records: list, base: int = 0) -> None:
        """Append records (one gathered write per batch) and note where each lies (``base``: of the
        cumulative deltas among them)."""
        locations = self._parts.writer_appender.append_many([(buffers, length) for _key, buffers, length in records])
        blocks = self._rows.setdefault(table, {})
        for ((block, count, flags), _buffers, length), (seg, off) in zip(records, locations):
            blocks[block] = RowLoc(seg, off, length, count, flags, base if flags & record.FLAG_DELTA else 0)
            self._bytes += length

    def _increment_bytes(self) -> int:
        """Bytes this version's records would take holding only the rows put in it (what the trainer's
        increment costs; the denominator of stats()["write_amplification"]). A merged record counts as a
        record of its own rows, with offsets."""
        total = self._bytes
        for table, blocks in self._rows.items():
            for block, loc in blocks.items():
                if loc.flags & record.FLAG_KEYS:
                    total -= self._keyed.carried_bytes(table, block, loc.length)
        for (table, block), carried in self._carried.items():
            loc = self._rows[table][block]
            if not carried.size:
                continue
            aux = (0 if loc.flags & record.FLAG_FULL else 2 * loc.count) + (record.BASE.size if loc.base else 0)
            row_bytes = (loc.length - record.HEADER_BYTES - record.TRAILER_BYTES - aux) // max(1, loc.count)
            own = loc.count - carried.size
            total -= loc.length - (record.HEADER_BYTES + record.TRAILER_BYTES + own * (row_bytes + 2))
        return total

    def _chain_merges(self, stack: contextlib.ExitStack, info: TableRecord, groups: list, again: list):
        """({block: merge.ChainMerge} of the blocks whose record would pass the hard read bounds
        (merge.chain_merge), and a resolver reading within an index read transaction held by ``stack``
        while the merges load records. The blocks are the fresh ones of ``groups`` ((codec, rows, values)
        as ``_codec_groups`` splits them: each record priced in the codec it is written in) and those of
        ``again`` (``_plan_merges``: a block put again in this version, whose record grows into one
        replacing the earlier; priced on the chain below that record, at its delta base or the parent).

        The delta bases are pinned (``pins``) in the same critical section as the chain is read, so that
        a concurrent retention cannot drop the entries this version's deltas will read."""
        if self._parts.options.read_chain_bound is None or self._parent is None or not (groups or again):
            return {}, None
        shift = blocks_math.shift(info.block_rows)
        below: dict[int, tuple[int, int]] = {}  # block -> (its record's bytes, the version of the chain below)
        for group_codec, g_rows, _values in groups:
            unique, counts = np.unique(g_rows >> shift, return_counts=True)
            sizes = _record_bytes(counts, group_codec.row_bytes(info.dim))
            below.update(zip(unique.tolist(), ((size, self._parent) for size in sizes.tolist())))
        for p in again:
            if not p.complete:  # (a baseline: its chain is itself)
                size = int(_record_bytes(p.rows.size, p.codec.row_bytes(info.dim))) + (record.BASE.size if p.base else 0)
                below[p.block] = (size, p.base or self._parent)
        found = {}
        parts = self._parts
        with parts.pin_lock:
            view = stack.enter_context(parts.read())
            for block, (size, at) in below.items():
                head = merge.chain_head(view, info.id, block, at)
                costs = parts.chain_costs if at == self._parent else None  # (kept for the parent's heads)
                plan = merge.chain_merge(view, info, block, at, size, self._parts.options, costs, head)
                if plan is None and head is not None and at == self._parent:
                    self._below[(info.name, block)] = head
                if plan is not None:  # (every entry the merged record might read; narrowed after the merge)
                    found[block] = plan
                    for v, _loc in plan.records + ([plan.baseline] if plan.baseline is not None else []):
                        self.pins.add((info.id, block, v))
        return found, reader.BlockResolver(view, parts.storage, info)

    def _append_fresh(self, table: str, info: TableRecord, codec, rows: np.ndarray, encoded: np.ndarray,
                      chain_merges: dict, resolver) -> None:
        """Append records of rows of blocks this version had not written: plain increments, and for the
        blocks in ``chain_merges`` a delta (or new baseline) merged with the older chain (merge.py)."""
        if not chain_merges:
            self._append(table, block_records(info, codec, rows, encoded, self.version))
            return
        shift = blocks_math.shift(info.block_rows)
        blocks = rows >> shift
        keys = np.fromiter(chain_merges, dtype=np.int64, count=len(chain_merges))
        merged = np.isin(blocks, keys)
        if (~merged).any():
            self._append(table, block_records(info, codec, rows[~merged], encoded[~merged], self.version))
        m_rows, m_encoded, m_blocks = rows[merged], encoded[merged], blocks[merged]
        starts, bounds = blocks_math.runs(m_blocks)
        for i, start in enumerate(starts.tolist()):
            stop = int(bounds[i + 1])
            block = int(m_blocks[start])
            self._append_chain_merge(table, info, block, codec, m_rows[start:stop], m_encoded[start:stop],
                                     chain_merges[block], resolver)

    def _append_chain_merge(self, table: str, info: TableRecord, block: int, codec, rows: np.ndarray,
                            encoded: np.ndarray, plan: merge.ChainMerge, resolver) -> None:
        """Append this version's record of ``block``: its ``rows`` (global, sorted; ``encoded`` by ``codec``)
        merged with the chain ``plan`` (merge.merge_block, within the read budget of
        the store's ``Options.read_amp_bound``), and keep pinned exactly the entries the merged record reads."""
        options = self._parts.options
        first = blocks_math.base(block, info.block_rows)
        block_len = blocks_math.length(block, info.block_rows, info.num_rows)
        bound = options.read_amp_bound
        budget = None if bound is None else merge.merge_budget(bound, info, block, plan, options)
        m = merge.merge_block(resolver, block, block_len, plan, codec, rows - first, encoded, options, budget)
        self._append(table, block_records(info, m.codec, m.offsets + first, m.encoded, self.version,
                                          base=m.base, copied=m.copied, baseline=not m.base), m.base)
        fs.crash_point("after_delta_merge")  # a merged record appended, the version not committed
        if m.carried.size:  # (with rows an earlier put of this version carried, if any)
            carried = self._carried.get((table, block))
            self._carried[(table, block)] = (m.carried + first if carried is None
                                             else np.union1d(carried, m.carried + first))
        reads = {m.base} | ({plan.baseline[0]} if m.base and plan.baseline is not None else set())
        for v, _loc in plan.records + ([plan.baseline] if plan.baseline is not None else []):
            if v not in reads:
                self.pins.discard((info.id, block, v))

    def _plan_merges(self, table, info, rows, values, blocks, merging, codec) -> list:
        """For blocks this version already wrote: a ``_Regrown`` per block, the record replacing the earlier
        one: it keeps its kind (delta, baseline).

        Raises InvalidArgument (before anything is written) if a row was already put in this version.
        """
        engine = self._engine
        dim = info.dim
        plans = []
        m_rows, m_values, m_blocks = rows[merging], values[merging], blocks[merging]
        starts, bounds = blocks_math.runs(m_blocks)
        for i, start in enumerate(starts):
            stop = bounds[i + 1]
            block = int(m_blocks[start])
            base = blocks_math.base(block, info.block_rows)
            old = engine.load_pending(self._rows[table][block], info)
            old_rows = old.offsets() + base
            new_rows, new_values = m_rows[start:stop], m_values[start:stop]
            keep = None
            carried = self._carried.get((table, block))
            if carried is not None:  # rows the record carries from older versions: this put may override them
                keep = ~np.isin(old_rows, np.intersect1d(carried, new_rows, assume_unique=True))
                dup = np.intersect1d(np.setdiff1d(old_rows, carried, assume_unique=True), new_rows)
            else:
                dup = np.intersect1d(old_rows, new_rows)
            if dup.size:
                raise InvalidArgument(f"row {int(dup[0])} of table {table!r} is put twice in version "
                                      f"{self.version}; rows must be unique within a version")
            old_codec = codecs.by_id(old.codec_id)
            old_encoded = old.body.reshape(old.count, old_codec.row_bytes(dim))
            if keep is not None and not keep.all():
                old_rows, old_encoded = old_rows[keep], old_encoded[keep]
            new_codec = _codec_for(codec, new_values)
            if new_codec is old_codec:
                merged_codec = old_codec
                encoded = np.concatenate([old_encoded, new_codec.encode(new_values, check=False)])
            else:  # exact in fp32: each part reads as its own codec decoded it
                merged_codec = codecs.get("fp32")
                parts = [old_codec.decode(old_encoded, dim), new_codec.decode(new_codec.encode(new_values, check=False), dim)]
                encoded = merged_codec.encode(np.concatenate(parts), check=False)
            all_rows = np.concatenate([old_rows, new_rows])
            order = np.argsort(all_rows, kind="stable")
            plans.append(_Regrown(block, merged_codec, all_rows[order], np.ascontiguousarray(encoded[order]),
                                  old.base(), old.copied(), bool(old.flags & record.FLAG_BASELINE)))
            if carried is not None:
                self._carried[(table, block)] = np.setdiff1d(carried, new_rows, assume_unique=True)
        return plans


class _Regrown(NamedTuple):
    """A block put again in one version: its record's rows merged with the put's (``_plan_merges``)."""

    block: int
    codec: object
    rows: np.ndarray  # global row ids, sorted
    encoded: np.ndarray  # aligned with rows, by codec
    base: int  # of a cumulative delta, else 0
    copied: int
    complete: bool  # a baseline


def _record_bytes(counts, row_bytes: int):
    """Bytes of a record of ``counts`` rows of ``row_bytes`` each, with their offsets (at most)."""
    return counts * (row_bytes + 2) + record.HEADER_BYTES + record.TRAILER_BYTES


def _codec_for(codec, values: np.ndarray):
    """The codec that stores ``values`` faithfully: ``codec``, or the first of its fallbacks that can."""
    while codec.fallback is not None and values.size and codec.unrepresentable(values).any():
        codec = codecs.get(codec.fallback)
    return codec


def _codec_groups(codec, rows: np.ndarray, values: np.ndarray, shift: int, value_range=None):
    """Split rows into (codec, rows, values) groups: a block with a row ``codec`` cannot represent goes
    to the codec's fallback (recursively), so each block's record has one codec. ``value_range`` is the
    (min, max) of ``values`` if known."""
    if codec.fallback is None or not rows.size:
        if rows.size:
            yield codec, rows, values
        return
    bad = codec.unrepresentable(values, value_range=value_range)
    if not bad.any():
        yield codec, rows, values
        return
    blocks = rows >> shift
    demote = np.isin(blocks, np.unique(blocks[bad]))
    if (~demote).any():
        yield codec, rows[~demote], values[~demote]
    yield from _codec_groups(codecs.get(codec.fallback), rows[demote], values[demote], shift)


def _chunks(blocks: np.ndarray, target: int):
    """(start, stop) ranges of about ``target`` rows that never split a block."""
    n = blocks.size
    start = 0
    while start < n:
        stop = min(start + target, n)
        if stop < n:
            # extend to the end of the block that straddles the cut
            stop = int(np.searchsorted(blocks, blocks[stop - 1], side="right"))
        yield start, stop
        start = stop
