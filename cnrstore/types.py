"""Public value types returned by the Store API (API.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


@dataclass(frozen=True)
class TableInfo:
    """A table's shape and defaults. ``codec`` is the codec used when ``put_rows`` names none.

    A keyed table (``keyed`` True: rows addressed by int64 keys) has ``num_rows`` 0, ``block_rows`` 1, its
    ``partitions`` and its per-key ``columns`` (``((name, numpy dtype string, width), ...)``)."""

    name: str
    num_rows: int
    dim: int
    codec: str
    block_rows: int
    keyed: bool = False
    partitions: int = 0
    columns: tuple = ()


class KeyedRows(NamedTuple):
    """Rows of a keyed table (``Store.read_keyed``): ``keys`` int64 ascending, ``values`` float32 (n, dim),
    ``columns`` {name: array (n,) for a column of width 1, else (n, width), of the column's dtype}."""

    keys: np.ndarray
    values: np.ndarray
    columns: dict


class KeyLookup(NamedTuple):
    """``Store.read_keys``: ``found`` bool per key asked, ``values`` float32 (n, dim) and ``columns`` as in
    KeyedRows, zeros where not found."""

    found: np.ndarray
    values: np.ndarray
    columns: dict


@dataclass(frozen=True)
class VersionInfo:
    """One committed checkpoint version.

    ``tables`` are the tables put in this version; ``dense`` the dense arrays put in it; ``bytes`` the
    bytes this version appended to the log; ``created`` unix seconds; ``parent`` the previous version.
    """

    version: int
    step: int | None
    meta: dict | None
    created: float
    parent: int | None
    tables: tuple[str, ...]
    bytes: int
    dense: tuple[str, ...] = ()


@dataclass
class Snapshot:
    """Everything a version reads as: every table (float32) and dense array, with the version's info;
    ``keyed``: every keyed table as KeyedRows, ``partitions`` the partition count of each (what an export
    records, so that an import keeps it)."""

    version: int
    step: int | None
    meta: dict | None
    tables: dict[str, np.ndarray] = field(default_factory=dict)
    dense: dict[str, Any] = field(default_factory=dict)
    keyed: dict[str, Any] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)


@dataclass
class VerifyReport:
    """Result of ``Store.verify()``: ``ok`` is True exactly when ``problems`` is empty."""

    problems: list[str] = field(default_factory=list)
    records_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class CompactReport:
    """What ``Store.compact`` did: baselines written at ``version`` and the bytes they took."""

    version: int
    blocks_materialized: int = 0
    bytes_written: int = 0


@dataclass
class MergeReport:
    """What a background merge step did (compaction.merge_chains): blocks whose read chain at ``version``
    it merged (``baselines`` of them into new baselines), the bytes written, and the seconds it waited on
    the rate limit (the store's ``Options.merge_rate_bytes``)."""

    version: int
    blocks_merged: int = 0
    baselines: int = 0
    bytes_written: int = 0
    waited_s: float = 0.0


@dataclass
class GCReport:
    """What ``Store.gc`` did. ``bytes_reclaimed`` were freed on disk now; ``bytes_pending`` belong to
    segments that readers may still use, deleted by a later ``gc`` (or open) once they are done.

    ``incomplete`` is None when the pass did everything; otherwise it says what was left undone and
    why (the disk filled while copying live records out of under-full segments): what the report counts
    was reclaimed all the same, and a later ``gc`` with free space finishes the job.
    """

    bytes_reclaimed: int = 0
    bytes_copied: int = 0
    segments_deleted: int = 0
    segments_rewritten: int = 0
    bytes_pending: int = 0
    incomplete: str | None = None
