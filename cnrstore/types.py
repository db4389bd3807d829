"""Public value types returned by the Store API (API.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TableInfo:
    """A table's shape and defaults. ``codec`` is the codec used when ``put_rows`` names none."""

    name: str
    num_rows: int
    dim: int
    codec: str
    block_rows: int


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
    """Everything a version reads as: every table (float32) and dense array, with the version's info."""

    version: int
    step: int | None
    meta: dict | None
    tables: dict[str, np.ndarray] = field(default_factory=dict)
    dense: dict[str, Any] = field(default_factory=dict)


@dataclass
class VerifyReport:
    """Result of ``Store.verify()``: ``ok`` is True exactly when ``problems`` is empty."""

    problems: list[str] = field(default_factory=list)
    records_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems
