"""Point-in-time reads of keyed tables: a partition's run at a version, keys looked up, whole tables.

A partition's read chain at version v is its block's (index.row_chain): the key-run records at or before v,
newest first, down to a baseline. Merged oldest first (keyed_runs.merge), each key's newest entry wins and a
key deleted at or before v is absent. Every record is checksum-verified and checked against its index entry
(storage.fetch) and its partition (keyed_records.parse_run) before a byte of it is used.
"""

from __future__ import annotations

import numpy as np

from . import keyed_records, keyed_runs, record
from ..errors import InvalidArgument
from .index import IndexView
from .schema import TableRecord
from .storage import Expect, SegmentStorage, fetch


def check_keyed(info: TableRecord, what: str) -> None:
    """InvalidArgument unless ``info`` is a keyed table (``what``: the call)."""
    if not info.keyed:
        raise InvalidArgument(f"{what}: table {info.name!r} is positional (rows by position); use put_rows, "
                              "read_rows and read_table for it, or create a table with keyed=True")


def check_positional(info: TableRecord, what: str) -> None:
    """InvalidArgument if ``info`` is a keyed table (``what``: the positional call refused)."""
    if info.keyed:
        raise InvalidArgument(f"{what}: table {info.name!r} is keyed (rows by int64 key); use put_keys, "
                              "delete_keys, read_keys, keys and read_keyed for it")


def load_run(storage: SegmentStorage, info: TableRecord, loc, partition: int, version: int | None) -> tuple:
    """(codec, KeyRun) of the key-run record at ``loc``, the one the index entry (partition, version) names."""
    rec = fetch(storage, loc, Expect(record.KIND_ROWS, info.id, version, partition))
    return keyed_records.parse_run(rec, info, f"{storage.path(loc.segment)}:{loc.offset}")


def partition_run(view: IndexView, storage: SegmentStorage, info: TableRecord, partition: int,
                  version: int) -> tuple | None:
    """(codec, the partition's run at ``version`` merged from its chain, with deletions) or None if the
    partition has no record at or before ``version``."""
    runs = [load_run(storage, info, loc, partition, v) for v, loc in view.row_chain(info.id, partition, version)]
    if not runs:
        return None
    runs.reverse()  # oldest first
    codec, same = keyed_records.common_codec(info, runs)
    return codec, keyed_runs.merge(same)


def read_keys(view: IndexView, storage: SegmentStorage, info: TableRecord, keys: np.ndarray,
              version: int) -> tuple[np.ndarray, keyed_records.KeyedRows]:
    """(found: bool per key, KeyedRows of ``keys`` in their order, zeros where not found) at ``version``."""
    n = keys.size
    found = np.zeros(n, bool)
    values = np.zeros((n, info.dim), np.float32)
    columns = keyed_records.new_columns(info.columns, n)
    if n:
        parts = keyed_runs.partition_of(keys, info.partitions)
        order = np.argsort(parts, kind="stable")
        sorted_parts = parts[order]
        cuts = np.flatnonzero(np.diff(sorted_parts)) + 1
        for idx in np.split(order, cuts):  # one group per partition asked: a loop over partitions, not keys
            got = partition_run(view, storage, info, int(parts[idx[0]]), version)
            if got is None:
                continue
            codec, run = got
            hit, rows = keyed_runs.lookup(run, keys[idx])
            found[idx] = hit
            keyed_records.decode_into(info, codec, rows[hit], idx[hit], values, columns)
    return found, keyed_records.KeyedRows(keys, values, columns)


def read_all(view: IndexView, storage: SegmentStorage, info: TableRecord, version: int,
             partitions: np.ndarray | None = None, *, keys_only: bool = False) -> keyed_records.KeyedRows:
    """Every key live at ``version`` (of ``partitions`` only, if given), ascending, with its row (``keys_only``:
    values and columns empty). Each partition's rows are decoded once, straight to their place in key order."""
    wanted = None if partitions is None else set(partitions.tolist())
    runs = []  # (codec, live keys, live rows) per partition read
    for partition, oldest in view.row_blocks(info.id):
        if oldest > version or (wanted is not None and partition not in wanted):
            continue
        got = partition_run(view, storage, info, partition, version)
        if got is not None:
            codec, run = got
            runs.append((codec, *keyed_runs.live(run)))
    keys = np.concatenate([k for _c, k, _r in runs]) if runs else np.zeros(0, np.int64)
    order = np.argsort(keys, kind="stable")
    if keys_only:
        return keyed_records.KeyedRows(keys[order], np.zeros((0, info.dim), np.float32), {})
    n = keys.size
    dest = np.empty(n, np.int64)
    dest[order] = np.arange(n)  # where each entry goes in key order
    values = np.empty((n, info.dim), np.float32)
    columns = keyed_records.new_columns(info.columns, n, np.empty)
    at = 0
    for codec, k, rows in runs:
        keyed_records.decode_into(info, codec, rows, dest[at:at + k.size], values, columns)
        at += k.size
    return keyed_records.KeyedRows(keys[order], values, columns)


def keyed_changes(view: IndexView, storage: SegmentStorage, info: TableRecord, since: int, until: int):
    """The TableChanges (keyed) of ``info`` from ``since`` to ``until``. Only partitions with an entry in (min,
    max] of the two are read. Going forward, a partition whose chain at ``until`` reaches ``since`` without a
    baseline in between is read from its records newer than ``since`` alone (what a follower's update costs is
    the changes' bytes, not the partition's): their puts, and their deletions (a key deleted in the interval
    that ``since`` did not hold included: deleting it is a no-op); a key put again with the row it had is then
    reported too. Any other partition (a baseline since ``since``: a save's merge, ``compact``) is read at both
    versions and compared: exact. ``until < since`` (a follower's rollback) gives what takes a copy at
    ``since`` back to ``until``: keys ``until`` does not hold are ``deleted``, a partition ``until`` never wrote
    included."""
    from .changes import TableChanges

    put_keys, put_rows, gone = [], [], []
    for p in view.blocks_written_in(info.id, min(since, until), max(since, until)):
        newer = _runs_since(view, storage, info, p, since, until)
        if newer is not None:  # the records written since `since`: what changed, as they say it
            codec, run = newer
            put_keys.append(run.keys[~run.deleted])
            put_rows.append(keyed_records.decode_rows(info, codec, run.values[~run.deleted], put_keys[-1]))
            gone.append(run.keys[run.deleted])
            continue
        now = partition_run(view, storage, info, p, until)
        before = partition_run(view, storage, info, p, since) if since else None
        if now is None:  # (a rollback to before the partition's first record: it holds no key there)
            if before is None:
                continue
            now = _empty_run(info, before[0])
        codec, run = now
        keys, rows = keyed_runs.live(run)
        if before is not None:
            codec_b, run_b = before
            codec, (run_b, run) = keyed_records.common_codec(info, [(codec_b, run_b), (codec, run)])
            keys, rows = keyed_runs.live(run)
            hit, old_rows = keyed_runs.lookup(run_b, keys)
            fresh = ~hit | (old_rows != rows).any(axis=1)
            keys, rows = keys[fresh], rows[fresh]
            old_keys, _ = keyed_runs.live(run_b)
            still, _ = keyed_runs.lookup(run, old_keys)
            gone.append(old_keys[~still])
        if keys.size:
            put_keys.append(keys)
            put_rows.append(keyed_records.decode_rows(info, codec, rows, keys))
    keys = np.concatenate(put_keys) if put_keys else np.zeros(0, np.int64)
    order = np.argsort(keys, kind="stable")
    if put_rows:
        values = np.concatenate([r.values for r in put_rows])[order]
        columns = {n: np.concatenate([r.columns[n] for r in put_rows])[order] for n, _d, _w in info.columns}
    else:
        values = np.zeros((0, info.dim), np.float32)
        columns = keyed_records.new_columns(info.columns, 0)
    deleted = np.sort(np.concatenate(gone)) if gone else np.zeros(0, np.int64)
    return TableChanges(info.name, since, until, info.dim, info.codec, keys[order], values, keyed=True,
                        columns=columns, deleted=deleted)


def _runs_since(view: IndexView, storage: SegmentStorage, info: TableRecord, partition: int, since: int,
                until: int) -> tuple | None:
    """(codec, the runs of ``partition`` newer than ``since`` on its chain at ``until``, merged), or None when
    they do not say what changed alone: a rollback, no ``since``, or a baseline among them."""
    if not since or until < since:
        return None
    newer = []
    for v, loc in view.row_chain(info.id, partition, until):
        if v <= since:
            break
        if loc.flags & record.FLAG_BASELINE:
            return None
        newer.append(load_run(storage, info, loc, partition, v))
    if not newer:
        return None
    newer.reverse()  # oldest first
    codec, same = keyed_records.common_codec(info, newer)
    return codec, keyed_runs.merge(same)


def _empty_run(info: TableRecord, codec) -> tuple:
    """(codec, a run of no key): a partition with no record at a version."""
    width = keyed_records.row_width(info, codec)
    return codec, keyed_runs.make_run(np.zeros(0, np.int64), np.zeros((0, width), np.uint8), width=width)
