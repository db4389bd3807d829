"""A checkpoint's puts and deletions of keyed tables (``CheckpointWriter.put_keys`` / ``delete_keys``).

Each call splits its keys by partition (keyed_runs.partition_of) and appends one key-run record per
partition it touches (keyed_records.build), in one gathered write. A version holds one record per
(table, partition): a second call touching a partition this version wrote merges into a new record (the
earlier one is unreferenced bytes). A key changes at most once per version.

Which records are baselines (a read stops there):
- a partition's first record: nothing is below it;
- a partition whose read chain at the parent holds ``knobs.KEYED_CHAIN_BOUND`` records or more: the save
  merges the chain with its own run into a baseline (the live keys only), so a read of any version walks at
  most that many records without a background merge.
"""

from __future__ import annotations

import numpy as np

from .. import codecs, knobs
from . import arguments, keyed_reader, keyed_records, keyed_runs, record
from ..errors import InvalidArgument
from .schema import TableRecord


class KeyedPuts:
    """The keyed part of one CheckpointWriter: which keys it changed per (table, partition)."""

    def __init__(self, writer):
        """``writer``: the CheckpointWriter (writer.py) it appends through (``rows_of``, ``append_records``,
        ``parent``, ``engine``, ``version``)."""
        self._writer = writer
        #: (table, partition) -> (keys this version changed there (sorted), bytes of a record of them alone)
        self.own: dict[tuple[str, int], tuple[np.ndarray, int]] = {}

    def put(self, info: TableRecord, keys, values, columns, codec: str | None, delete=None) -> None:
        """Put ``keys``; and delete ``delete`` (if given) in the same records: one record per partition the
        two touch, where a put_keys then a delete_keys call writes each partition both touch twice."""
        keys = keys_arg(keys, info.name)
        vals, _range = arguments.row_values(values, keys, info.dim, info.name)
        cols = keyed_records.check_columns(info, columns, keys.size)
        chosen = codecs.get(codec if codec is not None else info.codec)
        while chosen.fallback is not None and vals.size and chosen.unrepresentable(vals).any():
            chosen = codecs.get(chosen.fallback)  # the whole put in one codec that holds it faithfully
        width = keyed_records.row_width(info, chosen)
        rows = keyed_records.encode_rows(info, chosen, vals, cols) if keys.size else np.zeros((0, width), np.uint8)
        deleted = np.zeros(keys.size, bool)
        if delete is not None:
            gone = keys_arg(delete, info.name)
            keys = np.concatenate([keys, gone])
            rows = np.concatenate([rows, np.zeros((gone.size, width), np.uint8)])
            deleted = np.concatenate([deleted, np.ones(gone.size, bool)])
        self._write(info, chosen, keys, rows, deleted)

    def delete(self, info: TableRecord, keys) -> None:
        keys = keys_arg(keys, info.name)
        chosen = codecs.get(info.codec)
        width = keyed_records.row_width(info, chosen)
        self._write(info, chosen, keys, np.zeros((keys.size, width), np.uint8), np.ones(keys.size, bool))

    def _write(self, info: TableRecord, codec, keys: np.ndarray, rows, deleted: np.ndarray) -> None:
        if not keys.size:
            return
        w = self._writer
        parts = keyed_runs.partition_of(keys, info.partitions)
        order = np.lexsort((keys, parts))
        keys, parts, rows, deleted = keys[order], parts[order], rows[order], deleted[order]
        dup = np.flatnonzero((keys[1:] == keys[:-1]))
        if dup.size:
            raise InvalidArgument(f"key {int(keys[dup[0]])} of table {info.name!r} is given twice in one call; a key "
                                  "changes at most once per version")
        cuts = np.flatnonzero(np.diff(parts)) + 1
        starts = np.concatenate([[0], cuts]).tolist()
        stops = np.concatenate([cuts, [keys.size]]).tolist()
        pending = w.rows_of(info.name)
        for start, stop in zip(starts, stops):  # each partition's own keys vs what this version wrote there
            own = self.own.get((info.name, int(parts[start])))
            if own is not None:
                again = np.intersect1d(own[0], keys[start:stop], assume_unique=True)
                if again.size:
                    raise InvalidArgument(f"key {int(again[0])} of table {info.name!r} changes twice in version "
                                          f"{w.version}; a key changes at most once per version")
        records, owns = [], []
        with w.engine.read() as view:
            for start, stop in zip(starts, stops):
                p = int(parts[start])
                run = keyed_runs.KeyRun(keys[start:stop], deleted[start:stop], rows[start:stop])
                own_keys = run.keys
                own_bytes = _alone_bytes(run)
                loc = pending.get(p)
                if loc is not None:  # this version wrote the partition already: one record holds both
                    old_codec, old = keyed_reader.load_run(w.engine.storage, info, loc, p, w.version)
                    prior = self.own[(info.name, p)]
                    own_keys = np.union1d(prior[0], run.keys)
                    own_bytes += prior[1]
                    baseline = bool(loc.flags & record.FLAG_BASELINE)
                    codec_p, (old, run) = keyed_records.common_codec(info, [(old_codec, old), (codec, run)])
                    run = keyed_runs.merge([old, run])
                else:
                    codec_p, run, baseline = self._on_chain(view, info, p, codec, run)
                if baseline:
                    run = keyed_runs.live_run(run)  # a baseline holds the live keys only
                records.append(keyed_records.build(info, codec_p, p, w.version, run, baseline=baseline))
                owns.append(((info.name, p), (own_keys, own_bytes)))
        w.append_records(info.name, records)
        self.own.update(owns)

    def _on_chain(self, view, info: TableRecord, partition: int, codec, run: keyed_runs.KeyRun) -> tuple:
        """(codec, run, baseline) of a partition's first record this version: the run alone on top of the
        chain at the parent, or the chain merged with it into a baseline (see the module docstring)."""
        parent = self._writer.parent
        chain = [] if parent is None else list(view.row_chain(info.id, partition, parent))
        if not chain:
            return codec, run, True
        if len(chain) < knobs.KEYED_CHAIN_BOUND:
            return codec, run, False
        storage = self._writer.engine.storage
        runs = [keyed_reader.load_run(storage, info, loc, partition, v) for v, loc in reversed(chain)]
        codec_p, same = keyed_records.common_codec(info, runs + [(codec, run)])
        return codec_p, keyed_runs.merge(same), True

    def carried_bytes(self, table: str, partition: int, length: int) -> int:
        """Bytes of the record at (table, partition) of ``length`` that hold entries this version did not
        change (a merged baseline's): what writer._increment_bytes takes off."""
        own = self.own.get((table, partition))
        return 0 if own is None else max(0, length - own[1])


def _alone_bytes(run: keyed_runs.KeyRun) -> int:
    """Bytes a record of ``run`` alone takes."""
    n = run.count
    return 48 + 8 + 8 * n + (n + 7) // 8 + int((~run.deleted).sum()) * run.values.shape[1]


def keys_arg(keys, table: str) -> np.ndarray:
    arr = arguments.to_numpy(keys, f"keys of table {table!r}")
    if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu")):
        raise InvalidArgument(f"keys of table {table!r} must be a 1-D array of int64 keys, got {arr.dtype} of shape "
                              f"{arr.shape}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidArgument(f"keys of table {table!r} must fit int64; the largest is {int(arr.max())}")
    return np.ascontiguousarray(arr, dtype=np.int64)
