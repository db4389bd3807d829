"""Layer 6 — compaction: baseline materialization, retention and garbage collection.

Each operation works through a maintenance handle (``with engine.maintenance() as m:``, engine/handle.py),
which holds the maintenance lock: compact, retain, gc, merges and dense rewrites run one at a time.

None of these changes what a retained version reads, bit for bit (invariant I2): a materialized
baseline holds the *encoded bytes* of the rows it gathers (a block whose chain mixes codecs is stored
as fp32 of each row's decoded value, which decodes identically), and GC copies records byte for byte.

Every operation commits in one synced index transaction after fsyncing what it appended, as a
checkpoint does, so a crash at any point leaves every committed version intact. A segment file that
GC freed is deleted only once no reader of any process can still see an index state that points into
it (LMDB's reader table tells which states are still being read); until then it is listed in the index
meta ``doomed_segments`` with the id of the transaction that freed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from ..engine import blocks as blocks_math
from .. import codecs
from ..engine import chain as chain_rule
from ..engine import fs, keyed_reader, keyed_records, keyed_runs, merge, reader, record, schema
from . import liveness
from ..errors import InvalidArgument, StorageFull
from ..engine.index import DenseLoc, IndexView, RowLoc
from ..engine.segments import SEGMENT_HEADER_BYTES
from ..engine.storage import Expect, fetch
from ..types import CompactReport, GCReport, MergeReport
from ..engine.block_records import block_records
from ..engine.version_edit import DropLog, Move, VersionEdit, anchor_at

if TYPE_CHECKING:
    from ..engine.core import Engine
    from ..engine.handle import MaintenanceHandle
    from ..options import Options

Progress = Callable[[int, int], None]


def block_chains(view: IndexView, version: int) -> dict[tuple[int, int], list[tuple[int, RowLoc]]]:
    """For every (table id, block) with records at or before ``version``: its read chain at ``version``,
    newest first, ending at a baseline or at the block's oldest record.

    One seek per block with records, then only the chain itself is read (walking back from
    ``version``): the cost does not grow with the records of other versions, so that a background
    materialization after many versions costs what the blocks' chains hold, not the whole history."""
    chains: dict[tuple[int, int], list] = {}
    for tid in sorted(info.id for info in view.tables().values()):
        for block, oldest in view.row_blocks(tid):
            if oldest > version:
                continue
            chains[(tid, block)] = list(view.row_chain(tid, block, version))  # (ends at a baseline)
    return chains


def versions_with_read_chains(engine: "Engine") -> list[tuple[int, dict, int]]:
    """(version, version info, longest read chain) for every version of the store, oldest first, from
    one read transaction and one pass over the row index (``read_chain_lengths``): linear in versions
    and index entries. What ``cnrstore ls`` lists."""
    with engine.read() as view:
        versions = view.versions()
        chain_lengths = read_chain_lengths(view.row_entries(), [v for v, _info in versions])
    return [(v, info, chain) for (v, info), chain in zip(versions, chain_lengths.tolist())]


def read_chain_lengths(entries: Iterable[tuple[int, int, int, RowLoc]], versions: Sequence[int]) -> np.ndarray:
    """int64 array: for each of ``versions`` (ascending), its longest read chain over every block, i.e.
    ``max(len(c) for c in block_chains(view, v).values())`` (0 if no block has a record at or before v),
    for all versions in ONE pass over ``entries`` (``view.row_entries()``: key order, so each block's
    entries come together, oldest first).

    A block's chain length is a step function of the version: from its i-th entry up to (not
    including) its next one it is the length of the chain that starts at the i-th (``chain.lengths``).
    Each entry thus raises the answer over one range of ``versions`` to its length; the ranges are
    folded with a sparse table (a range of length 2^k is written at level k
    as two overlapping halves, then levels are pushed down). O(entries log versions + versions log
    versions) time, vectorized after the pass; O(entries + versions) memory.
    """
    starts: list[int] = []  # version of each entry
    ends: list[int] = []  # version of the block's next entry (0 for the block's newest: see has_next)
    has_next: list[bool] = []
    lengths: list[int] = []  # chain length from the entry on
    prev = None
    block: list[tuple[int, int, int]] = []  # the block's entries seen so far: (version, flags, base)
    for t, b, v, loc in entries:
        if (t, b) == prev:
            ends[-1], has_next[-1] = v, True
        else:
            lengths += chain_rule.lengths(*zip(*block)) if block else []
            prev, block = (t, b), []
        block.append((v, loc.flags, loc.base))
        starts.append(v)
        ends.append(0)
        has_next.append(False)
    lengths += chain_rule.lengths(*zip(*block)) if block else []
    vers = np.asarray(versions, dtype=np.uint64)
    n = vers.size
    out = np.zeros(n, dtype=np.int64)
    if not n or not starts:
        return out
    lo = np.searchsorted(vers, np.asarray(starts, dtype=np.uint64), side="left").astype(np.int64)
    hi = np.searchsorted(vers, np.asarray(ends, dtype=np.uint64), side="left").astype(np.int64)
    hi[~np.asarray(has_next, dtype=bool)] = n  # the block's newest entry holds for every later version
    keep = lo < hi  # the versions in [lo, hi) read this entry's chain length for its block
    lo, hi, val = lo[keep], hi[keep], np.asarray(lengths, dtype=np.int64)[keep]
    if not lo.size:
        return out
    level = np.frexp((hi - lo).astype(np.float64))[1].astype(np.int64) - 1  # floor(log2(hi - lo))
    row = np.zeros(n, dtype=np.int64)  # row[i]: max over [i, i + 2**level) at the level being folded
    for k in range(int(level.max()), -1, -1):
        at = level == k
        if at.any():
            np.maximum.at(row, lo[at], val[at])
            np.maximum.at(row, hi[at] - (1 << k), val[at])
        if k:
            half = 1 << (k - 1)
            pushed = row.copy()
            np.maximum(pushed[half:], row[: n - half], out=pushed[half:])
            row = pushed
    return row


def materialize(m: "MaintenanceHandle", version: int, progress: Progress | None = None, *,
                drop_below: int | None = None) -> CompactReport:
    """Write a baseline at ``version`` for every block whose read chain there is longer than one record,
    then an ANCHOR record: the head of every block's (now one-record) read chain at ``version``, the dense
    heads and the whole catalog, so that repair can prove versions from there on without older COMMIT
    records. ``drop_below`` (retain) records in it that every version older than that is being dropped.

    ``m``: the engine's maintenance handle (engine/handle.py). A checkpoint may be in progress meanwhile (compaction
    appends to a segment of its own). Reads of every version are unchanged.
    """
    report = CompactReport(version)
    appender = m.appender
    new_entries: list[tuple[int, int, RowLoc]] = []
    with m.read() as view:
        tables = {info.id: info for info in view.tables().values()}
        all_chains = block_chains(view, version)
        chains = {key: chain for key, chain in all_chains.items() if len(chain) > 1}
        # bytes of the state at `version` once materialized: what a full baseline there weighs
        baseline_bytes = sum(chain[0][1].length for key, chain in all_chains.items() if key not in chains)
        done = 0
        try:
            for (tid, block), chain in sorted(chains.items()):
                info = tables[tid]
                if info.keyed:  # the partition's runs merged: its live keys
                    codec, run = keyed_reader.partition_run(view, m.storage, info, block, version)
                    records = [keyed_records.build(info, codec, block, version, keyed_runs.live_run(run),
                                                   baseline=True, compacted=True)]
                else:
                    resolver = reader.BlockResolver(view, m.storage, info)
                    pieces, _never_written = resolver.resolve(block, None, version)
                    codec, rows, encoded = _merge_pieces(pieces, blocks_math.base(block, info.block_rows), info.dim)
                    records = block_records(info, codec, rows, encoded, version, compacted=True)
                locations = appender.append_many([(buffers, length) for _key, buffers, length in records])
                for ((blk, count, flags), _buffers, length), (seg, off) in zip(records, locations):
                    new_entries.append((tid, blk, RowLoc(seg, off, length, count, flags)))
                    report.bytes_written += length
                    baseline_bytes += length
                report.blocks_materialized += 1
                done += 1
                if progress is not None:
                    progress(done, len(chains))
            heads = {key: [(chain[0][0], chain[0][1].count, chain[0][1].flags)]
                     for key, chain in all_chains.items() if key not in chains}
            for tid, blk, loc in new_entries:
                heads[(tid, blk)] = [(version, loc.count, loc.flags)]
            floor = max(schema.DROPPED_BELOW.get(view), drop_below or 0)
            anchor = anchor_at(view, version, heads, floor)
        except BaseException:
            appender.rollback()
            raise
    # the new baselines replace the entries this version may have had; entries of dropped versions they
    # shadow for every kept version are garbage now
    edit = VersionEdit(operation="compact", anchor=anchor,
                       rows=[(tid, blk, version, loc) for tid, blk, loc in new_entries],
                       shadowed=[(tid, blk) for tid, blk, _loc in new_entries], bytes_written=report.bytes_written,
                       last_baseline={"version": version, "bytes": baseline_bytes}, meta={schema.DROPPED_BELOW: floor},
                       prune_log_records=True)
    m.commit(edit, pin=True)  # as in drop_versions: never delete the base of an open checkpoint's delta
    _merge_past_the_bound(m, version, {(tid, blk) for tid, blk, _loc in new_entries})
    return report


def _merge_past_the_bound(m: "MaintenanceHandle", version: int, blocks: set[tuple[int, int]]) -> None:
    """After baselines were written at ``version`` for ``blocks``: if a newer version exists, merge there
    each of these blocks whose read amplification now passes ``Options.read_amp_bound``. (A baseline of a
    chain mixing codecs is fp32 of its rows, which may cost more than the chain it replaces; the newer
    versions' chains read it.)"""
    bound = m.options.read_amp_bound
    if bound is None or not blocks:
        return
    with m.read() as view:
        newest = max(view.version_numbers(), default=version)
    if newest > version:
        merge_chains(m, newest, blocks, bound=bound)


def merge_chains(m: "MaintenanceHandle", version: int, blocks: set[tuple[int, int]] | None = None, *,
                 limiter=None, halted: Callable[[], bool] = lambda: False, bound: float | None = None) -> MergeReport:
    """Merge every block (of ``blocks``, (table id, block) pairs; None: all) whose read amplification at
    ``version`` passes the store's ``Options.merge_trigger`` and whose chain holds two or more records above its
    baseline (``merge.merge_due``) — with ``bound``, instead every block whose read amplification there
    passes ``bound``, one record above its baseline sufficing: one delta (or new baseline:
    merge.merge_block) per block, flagged COMPACTED, written at ``version`` under the block's key there, so
    that reads at ``version`` and later walk it instead of the records it merged. A merge that would leave
    the block's read amplification higher than it was (a chain mixing codecs, stored as fp32) is not
    written. Reads of every version are unchanged bit for bit.

    Commits in batches of about ``Options.merge_batch_bytes`` (crash points ``merge_after_append`` and
    ``merge_inside_index_commit``), asks ``limiter`` (a RateLimiter) before each block, and stops early,
    between blocks, once ``halted()``; what it leaves is only not merged yet. A checkpoint may be
    written meanwhile.
    """
    report = MergeReport(version)
    options = m.options
    trigger = options.merge_trigger if bound is None else bound
    if trigger is None or options.read_chain_bound is None:
        return report
    with m.read() as view:
        tables = {info.id: info for info in view.tables().values()}
        if blocks is None:
            blocks = {(tid, block) for tid in tables for block, oldest in view.row_blocks(tid) if oldest <= version}
        due = []
        for tid, block in sorted(blocks):
            info = tables.get(tid)
            if info is None or info.keyed:  # (a keyed table's saves bound its chains: keyed_writer.py)
                continue
            chain = merge.walk_chain(view, tid, block, version)
            if (len(chain.records) >= 2 and merge.merge_due(info, block, chain, trigger, options) if bound is None
                    else chain.records and merge.read_amplification(info, block, chain, options) > bound):
                due.append((info, block, chain))
    batch: list[tuple[int, int, RowLoc]] = []
    batch_bytes = 0
    waited_before = limiter.waited if limiter is not None else 0.0  # (a limiter lives across steps)
    try:
        for info, block, chain in due:
            if halted():
                break
            size = _append_merge(m, version, info, block, chain, batch, limiter, halted, trigger)
            if size is None:
                continue
            batch_bytes += size
            report.blocks_merged += 1
            report.baselines += bool(batch[-1][2].flags & record.FLAG_BASELINE)
            if batch_bytes >= options.merge_batch_bytes:
                _commit_merges(m, version, batch, batch_bytes)  # (rolls back itself on failure)
                report.bytes_written += batch_bytes
                batch, batch_bytes = [], 0
    except BaseException:
        if batch:
            m.appender.rollback()  # merged records appended, not committed: thrown away
        raise
    if batch:
        _commit_merges(m, version, batch, batch_bytes)
        report.bytes_written += batch_bytes
    report.waited_s = limiter.waited - waited_before if limiter is not None else 0.0
    return report


def _append_merge(m: "MaintenanceHandle", version: int, info, block: int, chain, batch: list, limiter, halted,
                  trigger: float) -> int | None:
    """Append the merged record of ``block`` (its read ``chain`` at ``version``, merged within the budget of
    ``trigger``) to the compaction appender, noting its entry in ``batch``; returns its bytes. None (nothing
    appended) if the merge would leave the block's read amplification higher than the chain's: a save
    beside this merge checked its bound against the chain (chain_costs.py), and may rely on it."""
    with m.read() as view:
        resolver = reader.BlockResolver(view, m.storage, info)
        block_len = blocks_math.length(block, info.block_rows, info.num_rows)
        codec = codecs.get(info.codec)
        merged = merge.merge_block(resolver, block, block_len, chain, codec, np.empty(0, dtype=np.int64),
                                   np.empty((0, codec.row_bytes(info.dim)), dtype=np.uint8), m.options,
                                   merge.merge_budget(trigger, info, block, chain, m.options))
    first = blocks_math.base(block, info.block_rows)
    records = block_records(info, merged.codec, merged.offsets + first, merged.encoded, version, base=merged.base,
                            copied=merged.copied, baseline=not merged.base, merged=True)
    ((_blk, count, flags), _buffers, length), = records
    after = merge.merged_chain(chain, version, RowLoc(0, 0, length, count, flags, merged.base))
    options = m.options
    if merge.read_amplification(info, block, after, options) > merge.read_amplification(info, block, chain, options):
        return None
    size = sum(length for _key, _buffers, length in records)
    if limiter is not None:
        limiter.acquire(size, halted)
    locations = m.appender.append_many([(buffers, n) for _key, buffers, n in records])
    for ((blk, count, flags), _buffers, length), (seg, off) in zip(records, locations):
        base = merged.base if flags & record.FLAG_DELTA else 0
        batch.append((info.id, blk, RowLoc(seg, off, length, count, flags, base)))
    fs.crash_point("merge_appended")  # a merged record appended, not committed
    return size


def _commit_merges(m: "MaintenanceHandle", version: int, rows: list, size: int) -> None:
    """Commit merged records of ``version``: they replace its entries of their blocks; entries of dropped
    versions no kept version reads any more are pruned (never a pinned one)."""
    edit = VersionEdit(operation="merge", rows=[(tid, blk, version, loc) for tid, blk, loc in rows],
                       shadowed=[(tid, blk) for tid, blk, _loc in rows], bytes_written=size, merge_bytes=size)
    m.commit(edit, pin=True)  # as in drop_versions: never delete the base of an open checkpoint's delta


def _merge_pieces(pieces: list, base: int, dim: int):
    """(codec, global rows sorted, encoded rows aligned) holding every piece's rows exactly."""
    rows = np.concatenate([np.arange(p.encoded.shape[0]) if p.dest is None else p.dest for p in pieces]) + base
    order = np.argsort(rows, kind="stable")
    ids = {p.codec_id for p in pieces}
    if len(ids) == 1:
        codec = codecs.by_id(ids.pop())
        encoded = np.concatenate([p.encoded for p in pieces])
    else:  # several codecs: fp32 of each row's decoded value reads back bit-identically
        codec = codecs.get("fp32")
        decoded = np.concatenate([codecs.by_id(p.codec_id).decode(p.encoded, dim) for p in pieces])
        encoded = codec.encode(decoded, check=False)
    return codec, rows[order], np.ascontiguousarray(encoded[order])


def drop_versions(m: "MaintenanceHandle", drop: set[int], *, allow_newest: bool = False) -> list[int]:
    """Drop the versions in ``drop`` and every index entry no kept version reads.

    The newest version is dropped only with ``allow_newest`` (cnrstore.distributed reclaims local versions
    that no global version refers to); version numbers are never reused either way.

    An entry is kept while a kept version reads it: it lies on that version's read chain (back from the
    block's newest entry at or before the version to a baseline, jumping from a cumulative delta to the
    entry at its base: ``IndexView.row_chain``), decided inside the edit's transaction
    (``version_edit._drop_versions``, by ``reader.unread_versions``), as are the bases an open checkpoint
    pinned. Dense entries are each a whole array, so each is a baseline. Returns the dropped versions,
    oldest first.
    """
    with m.read() as view:
        present = view.version_numbers()
        seq = schema.DROP_SEQ.get(view) + 1
        if not set(present) & set(drop):
            return []
        kept_now = sorted(set(present) - set(drop))
        # an ANCHOR at the oldest kept version: every block's read chain there, so that repair can
        # prove the kept versions without the COMMIT records of the dropped ones (which prune_log forgets)
        oldest = kept_now[0] if kept_now else None
        anchor = None
        if oldest is not None:
            chains = {key: [(v, loc.count, loc.flags) for v, loc in chain]
                      for key, chain in block_chains(view, oldest).items()}
            anchor = anchor_at(view, oldest, chains, schema.DROPPED_BELOW.get(view))
    # the log records the drop, so that repair leaves these versions dropped (docs/FORMAT.md, DROP)
    edit = VersionEdit(operation="drop", drop=DropLog(seq, present[-1], kept_now), anchor=anchor,
                       drop_versions=frozenset(drop),
                       allow_newest=allow_newest, meta={schema.DROP_SEQ: seq}, prune_log_records=True)
    m.commit(edit, pin=True)  # pins the bases of deltas the open checkpoint writes: a checkpoint cannot pin
    # one while the drop decides (writer._chain_merges)
    return edit.dropped


def collect(m: "MaintenanceHandle", progress: Progress | None = None) -> GCReport:
    """Reclaim the space of dead records and dead rows, through the maintenance handle ``m``.

    Liveness is per row (cnrstore/maintenance/liveness.py): a row record some retained version reads only partly is
    live for those rows only. A segment with nothing live is freed; the others are *cleaned* (their live
    records copied to the compaction appender's segment, byte for byte and checksum-verified, a partly
    live record rewritten with its live rows only under the same index key) when their live fraction is
    under ``Options.gc_live_fraction``, and further, best first by the log-structured file system's
    cost-benefit score ``(1 - u) * age / (1 + u)`` (u the live fraction, age in versions since the
    segment's newest record), while the disk would hold more than ``Options.gc_space_bound`` times the live
    bytes. The checkpoint writer's active segment is sealed first, and cleaned like any other, when no
    checkpoint is open. Freed segments are deleted once no reader can need them.

    Works on a full disk as far as it can: the wholly dead segments are freed first, in one index
    transaction that needs no segment space, and deleted at once where no reader needs them; then the
    segments to clean are copied in batches of about ``_GC_BATCH_BYTES``, each committed on its own.
    A full disk during a copy rolls back that batch only and stops copying: the report's ``incomplete``
    says so, and a later ``gc`` (once there is space) finishes the job. A full disk during the first
    index transaction raises StorageFull with the store unchanged.
    """
    report = GCReport()
    appender = m.appender
    m.seal_idle_writer_segment()  # a small store's one segment can then be cleaned too
    survey = _survey(m)
    fs.pause_point("gc_planned")  # liveness judged on the snapshot above; commits may land meanwhile
    dead, candidates = _choose(survey, m.writer_segments(), m.options)  # (the writer's: possibly uncommitted bytes)
    if appender.active is not None and (appender.active in candidates or appender.active in dead):
        appender.seal()  # compaction's own segment is worth cleaning: copies go to a new one
    _free_dead(m, survey, dead)  # StorageFull here: nothing changed
    m.delete_doomed(report)  # the space the copies below may need
    done = 0
    for batch in _batches(survey, candidates):
        try:
            moves, copied = _copy_live_records(m, survey, batch)
        except StorageFull as exc:
            appender.rollback()
            report.incomplete = _incomplete(candidates, done, exc)
            break
        except BaseException:
            appender.rollback()
            raise
        # The copies were planned on an older snapshot: each replaces its entry only if the entry is still
        # the one copied, and a segment is freed only if no commit has grown it since (VersionEdit).
        edit = VersionEdit(operation="gc", moves=moves, free_segments={seg: survey.committed[seg] for seg in batch},
                           bytes_written=copied)
        try:
            m.commit(edit, appended=bool(moves))  # rolls back on failure
        except StorageFull as exc:
            report.incomplete = _incomplete(candidates, done, exc)
            break
        appender.forget(edit.freed)
        report.bytes_copied += copied
        report.segments_rewritten += len(edit.freed)
        done += len(batch)
        if progress is not None:
            progress(done, len(candidates))
        m.delete_doomed(report)  # each batch's sources, as soon as no reader needs them
    return m.delete_doomed(report)


@dataclass
class _Survey:
    """What GC judged on one index snapshot: each committed segment's length, live bytes, age (the newest
    version of a record in it) and the index entries that point into it, and which row records are
    only partly live (``partial``: (table id, block, version) -> the live block offsets)."""

    committed: dict[int, int]
    newest: int
    live: dict[int, int]
    age: dict[int, int] = field(default_factory=dict)
    row_users: dict[int, list] = field(default_factory=dict)
    dense_users: dict[int, list] = field(default_factory=dict)
    log_users: dict[int, list] = field(default_factory=dict)
    partial: dict = field(default_factory=dict)


def _survey(m: "MaintenanceHandle") -> _Survey:
    """Liveness (per row: liveness.row_liveness, the open checkpoint's pinned bases kept) and the users of
    every segment, on one read transaction."""
    pinned = m.pinned()
    with m.read() as view:
        kept = view.version_numbers()
        alive = liveness.row_liveness(view, lambda loc: fetch(m.storage, loc), kept, pinned)
        survey = _Survey(view.segments(), kept[-1] if kept else 0, dict(alive.live_bytes), partial=alive.partial)
        live, age = survey.live, survey.age
        for tid, block, v, loc in view.row_entries():
            survey.row_users.setdefault(loc.segment, []).append((tid, block, v, loc))
            age[loc.segment] = max(age.get(loc.segment, 0), v)
        for dense_id, v, loc in view.dense_entries():
            live[loc.segment] = live.get(loc.segment, 0) + loc.length
            survey.dense_users.setdefault(loc.segment, []).append((dense_id, v, loc))
            age[loc.segment] = max(age.get(loc.segment, 0), v)
        for kind, v, loc in view.log_entries():  # COMMIT / ANCHOR records repair needs
            live[loc.segment] = live.get(loc.segment, 0) + loc.length
            survey.log_users.setdefault(loc.segment, []).append((kind, v, loc))
    return survey


def _choose(survey: _Survey, busy: set, options: "Options") -> tuple[list[int], list[int]]:
    """(the wholly dead segments, the segments to clean, best first): those under ``gc_live_fraction`` live,
    then more by the cost-benefit score while the disk would hold more than ``gc_space_bound`` times the
    live bytes (never one over ``gc_clean_max_live`` live). Segments in ``busy`` are skipped."""
    committed, live, age = survey.committed, survey.live, survey.age
    dead: list[int] = []
    scored = []
    for seg, length in sorted(committed.items()):
        if seg in busy:
            continue  # being appended to (compaction's own active segment is judged like any other)
        payload = max(1, length - SEGMENT_HEADER_BYTES)
        if live.get(seg, 0) == 0:
            dead.append(seg)
        else:
            u = min(1.0, live[seg] / payload)
            scored.append(((1 - u) * (survey.newest - age.get(seg, 0) + 1) / (1 + u), seg, u, payload))
    scored.sort(reverse=True)
    candidates = [seg for _score, seg, u, _p in scored if u < options.gc_live_fraction]
    disk = sum(max(1, length - SEGMENT_HEADER_BYTES) for seg, length in committed.items() if seg not in dead)
    total_live = sum(live.get(seg, 0) for seg in committed)
    disk -= sum(p - live.get(seg, 0) for _s, seg, _u, p in scored if seg in candidates)
    for _score, seg, u, payload in scored:  # best first, while the disk is over the bound
        if disk <= options.gc_space_bound * total_live:
            break
        if seg not in candidates and u < options.gc_clean_max_live:
            candidates.append(seg)
            disk -= payload - live.get(seg, 0)
    return dead, candidates


def _free_dead(m: "MaintenanceHandle", survey: _Survey, dead: list[int]) -> None:
    """Free the wholly dead segments in one commit that writes no segment bytes (LMDB may need a page or
    two): StorageFull leaves the store unchanged."""
    if dead:
        free = VersionEdit(operation="gc_free", free_segments={seg: survey.committed[seg] for seg in dead})
        m.commit(free, appended=False)
        m.appender.forget(free.freed)


def _batches(survey: _Survey, candidates: list[int]) -> list[list[int]]:
    """``candidates`` in order, cut into batches of about ``_GC_BATCH_BYTES`` live bytes (one commit each)."""
    batches: list[list[int]] = []
    size = _GC_BATCH_BYTES
    for seg in candidates:
        if size >= _GC_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(seg)
        size += survey.live.get(seg, 0)
    return batches


def _copy_live_records(m: "MaintenanceHandle", survey: _Survey, batch: list[int]) -> tuple[list[Move], int]:
    """Append the live records of the segments in ``batch`` to compaction's appender (each checksum-verified
    and checked against its entry; a partly live row record rewritten with its live rows only); returns
    the index moves to commit and the bytes copied. The caller rolls back on failure."""
    moves: list[Move] = []
    copied = 0
    for seg in batch:
        # (kind, index key, the entry's record, the copy's location but for its place, buffers)
        copies: list[tuple[str, tuple, object, object, list]] = []
        for tid, block, v, loc in survey.row_users.get(seg, []):
            rows = survey.partial.get((tid, block, v))
            if rows is None:
                buffers = [_verified_bytes(m, loc, Expect(record.KIND_ROWS, tid, v, block))]
                copies.append(("row", (tid, block, v), loc, loc, buffers))
            else:  # partly live: rewritten with its live rows only
                new_loc, buffers, _length = _live_rows_record(m, loc, rows, tid, block)
                copies.append(("row", (tid, block, v), loc, new_loc, buffers))
        for dense_id, v, loc in survey.dense_users.get(seg, []):
            buffers = [_verified_bytes(m, loc, Expect(record.KIND_DENSE, dense_id, v))]
            copies.append(("dense", (dense_id, v), loc, loc, buffers))
        for kind, v, loc in survey.log_users.get(seg, []):
            copies.append(("log", (kind, v), loc, loc, [_verified_bytes(m, loc, Expect(kind))]))
        locations = m.appender.append_many([(buffers, new.length) for _k, _key, _old, new, buffers in copies])
        fs.crash_point("gc_cleaned_segment")
        for (kind, key, old, new, _buffers), (new_seg, off) in zip(copies, locations):
            moves.append(Move(kind, key, old, new._replace(segment=new_seg, offset=off)))
            copied += new.length
    return moves, copied


def _live_rows_record(m: "MaintenanceHandle", loc: RowLoc, rows: np.ndarray, tid: int, block: int):
    """(new RowLoc without its place, buffers, length) of the record at ``loc`` holding only the block
    offsets ``rows`` (sorted, a subset of its rows): encoded bytes copied, flags kept (FULL recomputed),
    marked COMPACTED (written by maintenance: repair reads it as the block's record at its version)."""
    rec = fetch(m.storage, loc, Expect(record.KIND_ROWS, tid, None, block))
    offsets = rec.offsets()
    take = np.searchsorted(offsets, rows)
    body = rec.body.reshape(rec.count, -1)[take]
    full = bool(rows.size) and int(rows[-1]) == rows.size - 1
    flags = (rec.flags & ~record.FLAG_FULL) | (record.FLAG_FULL if full else 0) | record.FLAG_COMPACTED
    buffers, length = record.rows_record(rec.codec_id, flags, rec.object_id, rec.block, rec.version,
                                         None if full else rows, np.ascontiguousarray(body), rec.base(), rec.copied())
    return RowLoc(0, 0, length, int(rows.size), flags, rec.base()), buffers, length


#: GC copies the live records of about this many bytes of under-full segments per index commit.
_GC_BATCH_BYTES = 64 << 20


def _incomplete(candidates: list[int], done: int, exc: BaseException) -> str:
    return (f"{len(candidates) - done} of {len(candidates)} under-full segments were not rewritten ({exc}); "
            "free disk space and run gc again to reclaim them")


def _verified_bytes(m: "MaintenanceHandle", loc, expect: Expect) -> np.ndarray:
    """A record's bytes, checksum-verified and checked against the index entry that names it: GC never
    copies damage, nor a record other than the one the entry names, into a new segment."""
    fetch(m.storage, loc, expect)
    return m.storage.read(loc.segment, loc.offset, loc.length)


def replace_dense(m: "MaintenanceHandle", name: str, version: int, array: np.ndarray) -> DenseLoc:
    """Rewrite dense array ``name`` of committed ``version`` as ``array``: a new DENSE record (same dense id
    and version) appended by compaction's appender, then one index transaction points the entry at it. The
    old record becomes dead bytes that ``gc`` reclaims. Used once per version by ``cnrstore migrate-payload``
    (docs/DESIGN.md "Security"); nothing else rewrites a committed version's data.

    InvalidArgument if the version holds no such array (now)."""
    with m.read() as view:
        dense_id = view.dense_id(name)
        old = None if dense_id is None else view.dense_loc(dense_id, version)
    if old is None:
        raise InvalidArgument(f"version {version} holds no dense array {name!r}")
    appender = m.appender
    buffers, length = record.dense_record(dense_id, version, array)
    try:
        loc = DenseLoc(*appender.append(buffers, length), length)
    except BaseException:
        appender.rollback()
        raise

    conflict = (f"dense array {name!r} of version {version} changed (dropped or moved) while it was rewritten; "
                "run the command again")
    edit = VersionEdit(operation="replace_dense", moves=[Move("dense", (dense_id, version), old, loc, conflict)],
                       bytes_written=length)
    m.commit(edit)
    return loc
