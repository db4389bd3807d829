"""A checkpoint's puts and deletions of keyed tables (``CheckpointWriter.put_keys`` / ``delete_keys``).

Each call splits its keys by partition (keyed_runs.partition_of) and buffers a run per partition, merged in
memory with the runs earlier calls of the version buffered there (a put then an eviction of other keys of one
partition costs one record, not two). ``flush`` appends one key-run record per buffered partition
(keyed_records.build), a gathered write per table: at commit, or once ``knobs.KEYED_BUFFER_BYTES`` are
buffered. A version holds one record per (table, partition): a partition buffered again after a flush wrote
it merges into a new record (the earlier one is unreferenced bytes). A key changes at most once per version.

Which records are baselines (a read stops there):
- a partition's first record: nothing is below it;
- a partition whose read chain at the parent holds ``knobs.KEYED_CHAIN_BOUND`` records or more: the save
  merges the chain with its own run into a baseline (the live keys only), so a read of any version walks at
  most that many records without a background merge. A partition that never merged merges its first chain a
  little earlier, by a fixed share per partition (``_bound``), so that partitions written at every save do
  not all merge at the same save.
"""

from __future__ import annotations

import numpy as np

from .. import codecs, knobs
from . import arguments, fs, keyed_reader, keyed_records, keyed_runs, record
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
        #: (table, partition) -> (codec, run) changed by this version and not appended yet (``flush``)
        self._buffer: dict[tuple[str, int], tuple] = {}
        self._buffered_bytes = 0

    def put(self, info: TableRecord, keys, values, columns, codec: str | None) -> None:
        keys = keys_arg(keys, info.name)
        if values is None and not info.dim:  # a table of dim 0: a key's row is its columns
            values = np.zeros((keys.size, 0), np.float32)
        vals, _range = arguments.row_values(values, keys, info.dim, info.name)
        cols = keyed_records.check_columns(info, columns, keys.size)
        chosen = codecs.get(codec if codec is not None else info.codec)
        while chosen.fallback is not None and vals.size and info.dim and chosen.unrepresentable(vals).any():
            chosen = codecs.get(chosen.fallback)  # the whole put in one codec that holds it faithfully
        self._write(info, chosen, keys, False,
                    lambda idx: keyed_records.encode_rows(info, chosen, vals[idx], {c: a[idx] for c, a in cols.items()}))

    def delete(self, info: TableRecord, keys) -> None:
        keys = keys_arg(keys, info.name)
        chosen = codecs.get(info.codec)
        width = keyed_records.row_width(info, chosen)
        self._write(info, chosen, keys, True, lambda idx: np.zeros((idx.size, width), np.uint8))

    def _write(self, info: TableRecord, codec, keys: np.ndarray, deleting: bool, rows_of) -> None:
        """Checks the call's keys (each once, none this version changed before), then buffers its runs, merged
        per partition in memory with what the version buffered there (written by ``flush``). ``rows_of(idx)``
        encodes the rows of the call's entries ``idx``: one partition at a time, so each is gathered and laid
        out while it is small (no sorted copy of the whole call)."""
        if not keys.size:
            return
        w = self._writer
        parts = keyed_runs.partition_of(keys, info.partitions)
        order = np.lexsort((keys, parts))
        keys, parts = keys[order], parts[order]
        dup = np.flatnonzero((keys[1:] == keys[:-1]))
        if dup.size:
            raise InvalidArgument(f"key {int(keys[dup[0]])} of table {info.name!r} is given twice in one call; a key "
                                  "changes at most once per version")
        cuts = np.flatnonzero(np.diff(parts)) + 1
        spans = list(zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [keys.size]]).tolist()))
        for start, stop in spans:  # each partition's keys against what this version changed there
            own = self.own.get((info.name, int(parts[start])))
            if own is not None:
                again = np.intersect1d(own[0], keys[start:stop], assume_unique=True)
                if again.size:
                    raise InvalidArgument(f"key {int(again[0])} of table {info.name!r} changes twice in version "
                                          f"{w.version}; a key changes at most once per version")
        for start, stop in spans:
            key = (info.name, int(parts[start]))
            run = keyed_runs.KeyRun(keys[start:stop], np.full(stop - start, deleting), rows_of(order[start:stop]))
            prior = self.own.get(key)
            self.own[key] = ((run.keys, _alone_bytes(run)) if prior is None
                             else (np.union1d(prior[0], run.keys), prior[1] + _alone_bytes(run)))
            held = self._buffer.get(key)
            if held is not None:
                codec_b, (old, run) = keyed_records.common_codec(info, [held, (codec, run)])
                self._buffered_bytes -= old.values.nbytes
                self._buffer[key] = (codec_b, keyed_runs.merge([old, run]))
            else:
                self._buffer[key] = (codec, run)
            self._buffered_bytes += self._buffer[key][1].values.nbytes
        if self._buffered_bytes >= knobs.KEYED_BUFFER_BYTES:
            self.flush()

    def snapshot(self) -> tuple:
        """What ``restore`` puts back: the state before a call that raised InvalidArgument."""
        return dict(self.own), dict(self._buffer), self._buffered_bytes

    def restore(self, state: tuple) -> None:
        self.own, self._buffer, self._buffered_bytes = dict(state[0]), dict(state[1]), state[2]

    def flush(self) -> None:
        """Append a record per buffered (table, partition): on top of its chain, merged into a baseline at the
        chain bound, or merged with the record this version wrote there before (the buffer was full)."""
        if not self._buffer:
            return
        w = self._writer
        by_table: dict[str, list] = {}
        with w.engine.read() as view:
            for (table, p), (codec, run) in sorted(self._buffer.items()):
                info = w.engine.table_record(table)
                loc = w.rows_of(table).get(p)
                if loc is not None:  # written at an earlier flush: one record holds both
                    old = keyed_reader.load_run(w.engine.storage, info, loc, p, w.version)
                    codec, (old_run, run) = keyed_records.common_codec(info, [old, (codec, run)])
                    run, baseline = keyed_runs.merge([old_run, run]), bool(loc.flags & record.FLAG_BASELINE)
                else:
                    codec, run, baseline = self._on_chain(view, info, p, codec, run)
                if baseline:
                    run = keyed_runs.live_run(run)  # a baseline holds the live keys only
                by_table.setdefault(table, []).append(keyed_records.build(info, codec, p, w.version, run,
                                                                          baseline=baseline))
        for table, records in by_table.items():
            w.append_records(table, records)
        self._buffer.clear()
        self._buffered_bytes = 0

    def _on_chain(self, view, info: TableRecord, partition: int, codec, run: keyed_runs.KeyRun) -> tuple:
        """(codec, run, baseline) of a partition's first record this version: the run alone on top of the
        chain at the parent, or the chain merged with it into a baseline (see the module docstring)."""
        parent = self._writer.parent
        chain = [] if parent is None else list(view.row_chain(info.id, partition, parent))
        if not chain:
            return codec, run, True
        if len(chain) < _bound(view, info, partition, chain[-1][0]):
            return codec, run, False
        storage = self._writer.engine.storage
        fs.pause_point("keyed_chain_merge")  # the chain listed on this snapshot, its runs not read yet (tests/test_races.py)
        runs = [keyed_reader.load_run(storage, info, loc, partition, v) for v, loc in reversed(chain)]
        codec_p, same = keyed_records.common_codec(info, runs + [(codec, run)])
        return codec_p, keyed_runs.merge(same), True

    def carried_bytes(self, table: str, partition: int, length: int) -> int:
        """Bytes of the record at (table, partition) of ``length`` that hold entries this version did not
        change (a merged baseline's): what writer._increment_bytes takes off."""
        own = self.own.get((table, partition))
        return 0 if own is None else max(0, length - own[1])


def _bound(view, info: TableRecord, partition: int, bottom: int) -> int:
    """The chain length at which a save merges ``partition``'s chain (whose oldest record is at ``bottom``):
    ``knobs.KEYED_CHAIN_BOUND``, or, while the chain still starts at the partition's first record (it never
    merged), the bound less a fixed share of it per partition (a hash, up to half the bound). Partitions
    written at every save then first merge over half a bound's saves rather than all at one, and keep those
    phases: each save rewrites a small share of the table, never the whole of it at once."""
    bound = knobs.KEYED_CHAIN_BOUND
    first = next(view.row_blocks(info.id, partition), None)
    if bound < 4 or first is None or first[0] != partition or first[1] != bottom:
        return bound
    phase = int(keyed_runs.partition_of(np.array([partition], np.int64), bound // 2)[0])
    return bound - phase


def _alone_bytes(run: keyed_runs.KeyRun) -> int:
    """Bytes a record of ``run`` alone takes."""
    n = run.count
    return (record.HEADER_BYTES + record.TRAILER_BYTES + 8 + 8 * n + (n + 7) // 8
            + int((~run.deleted).sum()) * run.values.shape[1])


def keys_arg(keys, table: str) -> np.ndarray:
    """The keys of a call on ``table`` (keyed_runs.as_keys)."""
    return keyed_runs.as_keys(keys, f"keys of table {table!r}")
