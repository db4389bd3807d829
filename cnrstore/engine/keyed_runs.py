"""Key runs: the rows of a keyed table's partition as one version changed them (issue 50, the first piece).

A keyed table addresses rows by int64 keys from a sparse id space (up to 2^63), not by position. Its plan
(docs/DESIGN.md, "Keyed tables"): keys are hash-partitioned (``partition_of``) into a fixed number of
partitions, each the analogue of a positional table's block; a version writes, per partition it touched, one
*run*: the keys it put or deleted, sorted, with a deletion flag each, and the encoded values of the keys put.
A read of version v walks the partition's chain back to its baseline, as a block's does, and merges the runs:
the newest entry of a key wins, and a deleted key is absent at v (``merge``). This module is those runs as
arrays, and their bytes; it knows nothing of records, the index or codecs (``values`` are encoded rows, one
row of ``width`` bytes per key, as a positional block's are).

Everything is vectorized (numpy): no Python loop over keys.
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import CorruptionError, InvalidArgument
from .arguments import to_numpy

__all__ = ["KeyRun", "partition_of", "make_run", "merge", "live", "lookup", "encode_keys", "decode_keys",
           "values_bytes", "live_run", "as_keys", "MAX_PARTITIONS"]

#: The most partitions a keyed table may have (partition ids must fit the index's u32 block field).
MAX_PARTITIONS = 1 << 31
#: count u64, then the keys (i64 LE, strictly increasing), then the deletion flags (a bitmap, LSB first)
_COUNT = struct.Struct("<Q")

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class KeyRun(NamedTuple):
    """Entries sorted by ``keys`` (int64, strictly increasing); ``deleted[i]``: key i is deleted at this run;
    ``values[i]``: its encoded row (all zeros where deleted)."""

    keys: np.ndarray
    deleted: np.ndarray
    values: np.ndarray

    @property
    def count(self) -> int:
        """Entries in the run (not ``len``: a NamedTuple's length is its field count)."""
        return int(self.keys.size)


def partition_of(keys: np.ndarray, partitions: int) -> np.ndarray:
    """The partition of each key (int64 in [0, partitions)): splitmix64's finalizer of the key, reduced by
    multiply-high, so that neighbouring ids spread over every partition. Fixed forever: stored keys are found
    by it (the golden values are a test)."""
    if isinstance(partitions, bool) or not isinstance(partitions, (int, np.integer)) or not 0 < partitions <= MAX_PARTITIONS:
        raise InvalidArgument(f"partitions must be an int in [1, {MAX_PARTITIONS}], got {partitions!r}")
    k = as_keys(keys, "keys").view(np.uint64)
    with np.errstate(over="ignore"):
        z = k + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    # multiply-high of the top 32 bits by the partition count: < partitions, without a division
    return ((z >> np.uint64(32)) * np.uint64(partitions) >> np.uint64(32)).astype(np.int64)


def as_keys(keys, what: str) -> np.ndarray:
    """``keys`` (an array-like or a tensor) as a C-contiguous 1-D int64 array; InvalidArgument naming ``what``
    unless they are integers that fit int64 (an empty array of any dtype is no key)."""
    a = to_numpy(keys, what)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise InvalidArgument(f"{what} must be a 1-D array of integer keys (int64), got {a.dtype} of shape {a.shape}")
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        raise InvalidArgument(f"{what} must fit int64; the largest is {int(a.max())}")
    return np.ascontiguousarray(a, dtype=np.int64)


def make_run(keys, values: np.ndarray | None = None, deleted=None, *, width: int | None = None) -> KeyRun:
    """The run of one version's changes to a partition: ``keys`` put (with ``values``, one encoded row of
    ``width`` bytes each) or deleted (``deleted`` True; their values are ignored), in any order. A key given
    twice is InvalidArgument (one change per key per version)."""
    k = as_keys(keys, "keys")
    n = k.size
    d = np.zeros(n, bool) if deleted is None else np.asarray(deleted)
    if d.shape != (n,) or d.dtype != np.bool_:
        raise InvalidArgument(f"deleted must be a bool array of the keys' length {n}, got {d.dtype} {d.shape}")
    if values is None:
        if not d.all():
            raise InvalidArgument("values are needed for the keys put (deleted=False)")
        if width is None:
            raise InvalidArgument("width (bytes per encoded row) is needed when no values are given")
        v = np.zeros((n, width), np.uint8)
    else:
        v = np.asarray(values)
        if v.ndim != 2 or v.shape[0] != n or v.dtype != np.uint8 or (width is not None and v.shape[1] != width):
            raise InvalidArgument(f"values must be uint8 rows, one per key ({n} x {width if width is not None else 'width'}),"
                                  f" got {v.dtype} {v.shape}")
    order = np.argsort(k, kind="stable")
    k, d, v = k[order], d[order], v[order]
    if n > 1 and not (k[1:] > k[:-1]).all():  # (not np.diff: it wraps across the int64 range)
        dup = k[1:][k[1:] == k[:-1]][:5]
        raise InvalidArgument(f"a key may change once per version; given more than once: {dup.tolist()}")
    v = v.copy()
    v[d] = 0
    return KeyRun(k, d, v)


def merge(runs: Sequence[KeyRun]) -> KeyRun:
    """One run equal to applying ``runs`` oldest first: each key's newest entry (a put, or a deletion)."""
    if not runs:
        raise InvalidArgument("merge needs at least one run")
    widths = {r.values.shape[1] for r in runs}
    if len(widths) != 1:
        raise InvalidArgument(f"runs of one partition have one row width, got {sorted(widths)}")
    if len(runs) == 1:
        return runs[0]
    keys = np.concatenate([r.keys for r in runs])
    counts = [r.count for r in runs]
    age = np.repeat(np.arange(len(runs)), counts)
    order = np.lexsort((age, keys))  # by key, then oldest to newest
    keys = keys[order]
    last = np.ones(keys.size, bool)
    last[:-1] = keys[1:] != keys[:-1]  # the newest entry of each key
    pick = order[last]
    # the rows of the entries that win, gathered from each run (never a copy of the superseded ones)
    starts = np.concatenate([[0], np.cumsum(counts)])
    run_of = age[pick]
    local = pick - starts[run_of]
    values = np.empty((pick.size, runs[0].values.shape[1]), np.uint8)
    for i, r in enumerate(runs):
        mine = run_of == i
        if mine.any():
            values[mine] = r.values[local[mine]]
    return KeyRun(keys[last], np.concatenate([r.deleted for r in runs])[pick], values)


def live(run: KeyRun) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values) of the keys present: what a read of a chain merged from its baseline returns (the run's
    own arrays when it holds no deletion)."""
    if not run.deleted.any():
        return run.keys, run.values
    keep = ~run.deleted
    return run.keys[keep], run.values[keep]


def live_run(run: KeyRun) -> KeyRun:
    """The run of the keys present (no deletion): what a baseline holds."""
    if not run.deleted.any():
        return run
    keep = ~run.deleted
    return KeyRun(run.keys[keep], np.zeros(int(keep.sum()), bool), run.values[keep])


def lookup(run: KeyRun, keys) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``keys`` (any order, repeats allowed): (found: bool array, values: rows, zeros where not
    found); a deleted key is not found."""
    q = as_keys(keys, "keys")
    at = np.searchsorted(run.keys, q)
    inside = at < run.keys.size
    found = np.zeros(q.size, bool)
    found[inside] = run.keys[at[inside]] == q[inside]
    found[found] = ~run.deleted[at[found]]
    values = np.zeros((q.size, run.values.shape[1]), np.uint8)
    values[found] = run.values[at[found]]
    return found, values


def encode_keys(run: KeyRun) -> bytes:
    """The run's key part, as a record's aux will hold it: count u64 LE, the keys (i64 LE, strictly
    increasing), the deletion flags (``ceil(count / 8)`` bytes, LSB first)."""
    return (_COUNT.pack(run.count) + run.keys.astype("<i8").tobytes()
            + np.packbits(run.deleted, bitorder="little").tobytes())


def values_bytes(run: KeyRun) -> bytes:
    """The run's value part, as a record's body will hold it: the rows of the keys put, in key order."""
    return run.values[~run.deleted].tobytes()


def decode_keys(aux: bytes, body: bytes, width: int, where: str) -> KeyRun:
    """The run back from ``encode_keys`` and ``values_bytes``' bytes; CorruptionError naming ``where`` if
    they do not hold one (lengths, key order)."""
    if len(aux) < _COUNT.size:
        raise CorruptionError(f"{where}: a key run's header is cut short ({len(aux)} bytes)", where, None)
    (n,) = _COUNT.unpack_from(aux)
    flags = (n + 7) // 8
    if len(aux) != _COUNT.size + 8 * n + flags:
        raise CorruptionError(f"{where}: a key run of {n} keys needs {_COUNT.size + 8 * n + flags} bytes of keys "
                              f"and flags, the record holds {len(aux)}", where, None)
    keys = np.frombuffer(aux, "<i8", n, _COUNT.size).astype(np.int64)
    if n > 1 and not (keys[1:] > keys[:-1]).all():
        raise CorruptionError(f"{where}: a key run's keys are not strictly increasing", where, None)
    bits = np.frombuffer(aux, np.uint8, flags, _COUNT.size + 8 * n)
    deleted = np.unpackbits(bits, count=n, bitorder="little").astype(bool)
    if n and flags * 8 > n and np.unpackbits(bits, bitorder="little")[n:].any():
        raise CorruptionError(f"{where}: a key run's deletion flags have bits set past its {n} keys", where, None)
    put = int(n - deleted.sum())
    if len(body) != put * width:
        raise CorruptionError(f"{where}: {put} keys put need {put * width} bytes of rows, the record holds "
                              f"{len(body)}", where, None)
    if put == n:  # no deletion: the rows as they lie (a view of the body, no copy: readers copy what they return)
        return KeyRun(keys, deleted, np.frombuffer(body, np.uint8).reshape(n, width))
    values = np.zeros((n, width), np.uint8)
    values[~deleted] = np.frombuffer(body, np.uint8).reshape(put, width)
    return KeyRun(keys, deleted, values)
