"""Keyed tables at another world size: each rank reads only the partitions it will own (issue 50).

A job whose ranks own a keyed table's keys by partition range -- key k belongs to rank
``partition_of(k) * world_size // partitions`` (``owner``) -- can restore at any other world size without a
rank reading what it will not hold: rank r of M reads, from each of the N stores that wrote the table, the
records of partitions ``owned_partitions(P, r, M)`` only (found from the index: ``Store.read_keyed(partitions=)``),
so the bytes it reads are those of the keys it owns, whatever N and M (no multiple required). dynamicemb's
reload at another world size reads every rank's file on every rank (W-fold).

``read_owned`` does that over a list of (store, version) pairs, one per writer rank, and says how many record
bytes it read (``ReadReport``): the sum of the records the partitions' read chains visit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .engine import keyed_reader
from .engine.keyed_runs import as_keys, partition_of
from .errors import InvalidArgument
from .types import KeyedRows

__all__ = ["owner", "owner_of_keys", "owned_partitions", "read_owned", "ReadReport"]


def owner(partitions: np.ndarray, total: int, world_size: int) -> np.ndarray:
    """The rank (int64) owning each partition of ``partitions`` (of ``total``) at ``world_size``: contiguous
    ranges, ``partition * world_size // total``."""
    _check(total, world_size, 0)
    return np.asarray(partitions, np.int64) * world_size // total


def owner_of_keys(keys, partitions: int, world_size: int) -> np.ndarray:
    """The rank (int64) owning each of ``keys`` (int64) in a table of ``partitions`` at ``world_size``:
    ``owner(partition_of(keys), partitions, world_size)``. A job whose ranks each hold the keys this gives them
    (route each id to ``owner_of_keys``'s rank) can be restored at any other world size by partitions."""
    return owner(partition_of(as_keys(keys, "keys"), partitions), partitions, world_size)


def owned_partitions(total: int, rank: int, world_size: int) -> np.ndarray:
    """The partitions (int64, ascending) rank ``rank`` of ``world_size`` owns: those whose ``owner`` is it."""
    _check(total, world_size, rank)
    lo = -(-rank * total // world_size)  # ceil: the first p with p * world_size // total == rank
    hi = -(-(rank + 1) * total // world_size)
    return np.arange(lo, hi, dtype=np.int64)


def _check(total: int, world_size: int, rank: int) -> None:
    for name, value, least in (("partitions", total, 1), ("world_size", world_size, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise InvalidArgument(f"{name} must be an int >= {least}, got {value!r}")
    if rank >= world_size:
        raise InvalidArgument(f"rank {rank} is not below world_size {world_size}")


@dataclass
class ReadReport:
    """What ``read_owned`` read: ``bytes_read`` the record bytes of every chain it walked, ``stores`` how many
    stores, ``partitions`` the partitions it read of each."""

    bytes_read: int = 0
    stores: int = 0
    partitions: int = 0


def read_owned(sources, table: str, rank: int, world_size: int, *,
               writers_owned: bool = False) -> tuple[KeyedRows, ReadReport]:
    """(KeyedRows of every key rank ``rank`` of ``world_size`` owns, keys ascending; ReadReport) from
    ``sources``: (store, version) pairs, one per rank that wrote ``table`` (version None: the newest). A key
    found in two sources (the writers did not own keys by partition) is InvalidArgument, and so are sources
    whose tables differ in partitions. ``writers_owned``: the sources are the writer ranks in rank order, each
    of which held only the keys it owned (``owner`` at ``len(sources)`` ranks); a key read from a source that
    did not own it is InvalidArgument (the job routed its ids some other way)."""
    parts, rows, report = [], [], ReadReport()
    mine = total = None
    for index, (store, version) in enumerate(sources):
        info = store.engine.table_record(table)
        if info is None:
            continue
        keyed_reader.check_keyed(info, "read_owned")
        if mine is None:
            total = info.partitions
            mine = owned_partitions(info.partitions, rank, world_size)
        elif info.partitions != total:
            raise InvalidArgument(f"keyed table {table!r} has {total} partitions in one source and {info.partitions} "
                                  "in another: a key's partition differs between them, so no reader can own a "
                                  "range of them; read each source whole instead")
        got = store.read_keyed(table, version, partitions=mine)
        if writers_owned and got.keys.size:
            wrong = owner_of_keys(got.keys, total, len(sources)) != index
            if wrong.any():
                raise InvalidArgument(
                    f"key {int(got.keys[wrong][0])} of keyed table {table!r} was held by rank {index} of "
                    f"{len(sources)}, which does not own it (cnrstore.keyed_reshard.owner_of_keys gives rank "
                    f"{int(owner_of_keys(got.keys[wrong][:1], total, len(sources))[0])}): the job routed its ids "
                    "otherwise, so cnrstore cannot tell which rank each id belongs to at another world size; "
                    "restore at the world size it was saved with")
        report.bytes_read += chain_bytes(store, info, version, mine)
        report.stores += 1
        report.partitions = int(mine.size)
        parts.append(got.keys)
        rows.append(got)
    if not rows:
        raise InvalidArgument(f"no source holds keyed table {table!r}")
    keys = np.concatenate(parts)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    dup = keys[1:][keys[1:] == keys[:-1]]
    if dup.size:
        raise InvalidArgument(f"key {int(dup[0])} of table {table!r} is in two of the sources: their ranks did not own "
                              "keys by partition (keyed_reshard.owner); read each source whole instead")
    values = np.concatenate([r.values for r in rows])[order]
    columns = {n: np.concatenate([r.columns[n] for r in rows])[order] for n in rows[0].columns}
    return KeyedRows(keys, values, columns), report


def chain_bytes(store, info, version: int | None, partitions: np.ndarray) -> int:
    """Bytes of the records the read chains of ``partitions`` at ``version`` visit (what reading them costs)."""
    with store.engine.read() as view:
        v = version if version is not None else view.latest()[0]
        return sum(loc.length for p in partitions.tolist() for _v, loc in view.row_chain(info.id, p, v))
