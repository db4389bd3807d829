"""A checkpoint's puts and deletions of keyed tables (``CheckpointWriter.put_keys`` / ``delete_keys``).

Each call splits its keys by partition (keyed_runs.partition_of) and buffers a run per partition, merged in
memory with the runs earlier calls of the version buffered there (a put then an eviction of other keys of one
partition costs one record, not two). ``flush`` appends one key-run record per buffered partition
(keyed_records.build), a gathered write per table: at commit, or once ``knobs.KEYED_BUFFER_BYTES`` are
buffered. A version holds one record per (table, partition): a partition buffered again after a flush wrote
it merges into a new record (the earlier one is unreferenced bytes). A key changes at most once per version.

Which records are baselines (a read stops there):
- a partition's first record: nothing is below it;
- a partition whose runs above its baseline, with this save's own, weigh ``knobs.KEYED_MERGE_RATIO`` times
  the baseline or more, or whose read chain at the parent holds ``knobs.KEYED_CHAIN_BOUND`` records or more:
  the save merges the chain with its own run into a baseline (the live keys only). A merge rewrites about the
  baseline's bytes once per KEYED_MERGE_RATIO baselines' worth of changes, so merges add about
  1 / KEYED_MERGE_RATIO to the bytes saves write, whatever share of the table each save changes, and a read
  of any version fetches at most about 1 + KEYED_MERGE_RATIO times a partition's bytes in at most
  KEYED_CHAIN_BOUND records. A partition that never merged merges its first chain earlier, by a fixed share
  per partition (``_merges``: a hash spreads the first merges over the whole first period), so that partitions
  written at every save do not all merge at the same save, and keep those phases.
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
        """Append a record per buffered (table, partition): on top of its chain, merged into a baseline when
        the save merges it (``_merges``), or merged with the record this version wrote there before (the
        buffer was full)."""
        if not self._buffer:
            return
        w = self._writer
        by_table: dict[str, list] = {}
        with w.engine.read() as view:
            items = sorted(self._buffer.items())
            infos = {table: w.engine.table_record(table) for table in {t for (t, _p), _b in items}}
            chains = {}
            for (table, p), _b in items:
                if w.rows_of(table).get(p) is None:
                    parent = w.parent
                    info = infos[table]
                    chains[(table, p)] = [] if parent is None else list(view.row_chain(info.id, p, parent))
            merging = _merges(view, infos, chains, self._buffer)
            for (table, p), (codec, run) in items:
                info = infos[table]
                loc = w.rows_of(table).get(p)
                if loc is not None:  # written at an earlier flush: one record holds both
                    old = keyed_reader.load_run(w.engine.storage, info, loc, p, w.version)
                    codec, (old_run, run) = keyed_records.common_codec(info, [old, (codec, run)])
                    run, baseline = keyed_runs.merge([old_run, run]), bool(loc.flags & record.FLAG_BASELINE)
                elif (table, p) in merging:
                    codec, run, baseline = self._merged(info, p, chains[(table, p)], codec, run)
                else:
                    baseline = False
                if baseline:
                    run = keyed_runs.live_run(run)  # a baseline holds the live keys only
                by_table.setdefault(table, []).append(keyed_records.build(info, codec, p, w.version, run,
                                                                          baseline=baseline))
        for table, records in by_table.items():
            w.append_records(table, records)
        self._buffer.clear()
        self._buffered_bytes = 0

    def _merged(self, info: TableRecord, partition: int, chain: list, codec, run: keyed_runs.KeyRun) -> tuple:
        """(codec, run, True): a partition's ``chain`` at the parent merged with this version's ``run`` (a
        partition's first record is its run alone, a baseline)."""
        if not chain:
            return codec, run, True
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


#: the first merge of a partition comes at a share (k + 1) / _PHASES of its bounds, k a hash of the partition
_PHASES = 64


def _merges(view, infos: dict, chains: dict, buffer: dict) -> set:
    """The (table, partition) of ``chains`` (each partition's read chain at the parent, newest first, its
    baseline last; [] for a partition with nothing below) that this flush merges into baselines (module doc):

    - a partition's first record (nothing below it) is a baseline anyway;
    - *forced*: a chain of ``knobs.KEYED_CHAIN_BOUND`` records, or whose runs above the baseline (with this
      version's) weigh twice ``knobs.KEYED_MERGE_RATIO`` times the baseline (not scaled by the share below: a
      first merge that waits for the budget is not forced early);
    - *due* (weighing ``KEYED_MERGE_RATIO`` times the baseline): merged, the heaviest first, while the
      baselines they rewrite stay within ``knobs.KEYED_MERGE_BUDGET`` of this flush's own records' bytes
      (with the forced ones), and the heaviest one anyway if nothing else merges; the others wait for a later
      save. Merges then add at most about that share to a save's bytes, unless one partition weighs more than
      it (a table of few partitions: one partition a save) or merges are forced.

    While a chain still starts at its partition's first record (it never merged) its bounds are scaled by a
    fixed share per partition in (0, 1] (a hash): partitions written at every save then make their first
    merges over the whole first period instead of at one save, and keep those phases."""
    out, due = set(), []
    own = sum(_alone_bytes(run) for _codec, run in buffer.values())
    spent = 0
    for (table, p), chain in chains.items():
        if not chain:
            out.add((table, p))
            continue
        info = infos[table]
        share = 1.0
        first = next(view.row_blocks(info.id, p), None)
        if first is not None and first[0] == p and first[1] == chain[-1][0]:
            share = (int(keyed_runs.partition_of(np.array([p], np.int64), _PHASES)[0]) + 1) / _PHASES
        base = chain[-1][1].length
        above = sum(loc.length for _v, loc in chain[:-1]) + _alone_bytes(buffer[(table, p)][1])
        pressure = above / (knobs.KEYED_MERGE_RATIO * share * base)
        bound = knobs.KEYED_CHAIN_BOUND
        if len(chain) >= (bound if bound < 4 else max(2, bound * share)) or above >= 2 * knobs.KEYED_MERGE_RATIO * base:
            out.add((table, p))
            spent += base
        elif pressure >= 1:
            due.append((-pressure, table, p, base))
    for _neg, table, p, base in sorted(due):
        if spent + base > knobs.KEYED_MERGE_BUDGET * own and spent:
            continue  # (the first due one merges even past the budget: a partition per save at the least)
        out.add((table, p))
        spent += base
    return out


def _alone_bytes(run: keyed_runs.KeyRun) -> int:
    """Bytes a record of ``run`` alone takes."""
    n = run.count
    return (record.HEADER_BYTES + record.TRAILER_BYTES + 8 + 8 * n + (n + 7) // 8
            + int((~run.deleted).sum()) * run.values.shape[1])


def keys_arg(keys, table: str) -> np.ndarray:
    """The keys of a call on ``table`` (keyed_runs.as_keys)."""
    return keyed_runs.as_keys(keys, f"keys of table {table!r}")
