"""Compaction policies: when to materialize a baseline, which versions to keep, whether to collect.

Policies only decide; ``cnrstore.background`` (for ``open(compaction=...)``) carries the decisions out.
They see a ``History``: the committed versions and the newest baseline, so they can be tested alone.

When to materialize (a ``MaterializeRule``):
- ``IntermittentRule()`` — Check-N-Run's reset rule applied to the log. With ``B`` the bytes of the last
  baseline and ``S_i`` the bytes the log has grown by over the first ``i`` versions since it (a chain of
  increments is what a one-shot differential would hold, written piecewise), as a fraction of ``B``,
  materialize when ``1 + S_1 + … + S_i <= (i + 1) · S_i``: a new baseline now costs no more, over the
  period, than letting readers walk the growing chain.
- ``MaxChain(n)`` — when the newest version's read chain would exceed ``n`` records.
- ``EveryN(n)`` — every ``n`` versions.

What to keep (``Retention`` of one or more rules, like Orbax's preservation policies): ``KeepLast(n)``,
``KeepEveryNSteps(n)`` (versions whose step is a multiple of n), ``KeepVersions(vs)`` (named versions).
The newest version is always kept, and so is every record a kept version reads.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from ..errors import InvalidArgument
from ..types import VersionInfo


@dataclass(frozen=True)
class History:
    """Committed versions (oldest first) and the newest materialized baseline (version, bytes)."""

    versions: tuple[VersionInfo, ...]
    baseline_version: int | None
    baseline_bytes: int

    def since_baseline(self) -> list[VersionInfo]:
        """Versions committed after the newest baseline, oldest first. ``versions`` ascend (as the store
        lists them), so this costs a binary search plus the versions returned, not the whole history."""
        if self.baseline_version is None:
            return list(self.versions[1:])
        start = bisect.bisect_right(self.versions, self.baseline_version, key=_version_number)
        return list(self.versions[start:])


def _version_number(info: VersionInfo) -> int:
    return info.version


class MaterializeRule(Protocol):
    def due(self, history: History) -> bool: ...


def _positive(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class IntermittentRule:
    """Check-N-Run's intermittent-differential reset rule (see the module docstring)."""

    def due(self, history: History) -> bool:
        chain = history.since_baseline()
        if not chain or history.baseline_bytes <= 0:
            return False
        grown, s = 0, []
        for info in chain:
            grown += info.bytes
            s.append(grown / history.baseline_bytes)
        i = len(s)
        return 1 + sum(s) <= (i + 1) * s[-1]


@dataclass(frozen=True)
class MaxChain:
    """Materialize when the newest version's read chain would be longer than ``n`` records."""

    n: int

    def __post_init__(self):
        _positive(self.n, "MaxChain(n)")

    def due(self, history: History) -> bool:
        return len(history.since_baseline()) + 1 > self.n


@dataclass(frozen=True)
class EveryN:
    """Materialize every ``n`` versions."""

    n: int

    def __post_init__(self):
        _positive(self.n, "EveryN(n)")

    def due(self, history: History) -> bool:
        return len(history.since_baseline()) >= self.n


@dataclass(frozen=True)
class KeepLast:
    n: int

    def __post_init__(self):
        _positive(self.n, "KeepLast(n)")

    def keep(self, versions: tuple[VersionInfo, ...]) -> set[int]:
        return {v.version for v in versions[-self.n:]}


@dataclass(frozen=True)
class KeepEveryNSteps:
    """Keep versions whose step is a multiple of ``n`` (versions without a step are not kept by it)."""

    n: int

    def __post_init__(self):
        _positive(self.n, "KeepEveryNSteps(n)")

    def keep(self, versions: tuple[VersionInfo, ...]) -> set[int]:
        return {v.version for v in versions if v.step is not None and v.step % self.n == 0}


@dataclass(frozen=True)
class KeepVersions:
    versions: frozenset[int]

    def __init__(self, versions: Iterable[int]):
        object.__setattr__(self, "versions", frozenset(int(v) for v in versions))

    def keep(self, versions: tuple[VersionInfo, ...]) -> set[int]:
        return {v.version for v in versions if v.version in self.versions}


@dataclass(frozen=True)
class Retention:
    """Keep what any of the rules keeps, and always the newest version."""

    rules: tuple

    def __init__(self, *rules):
        if not rules:
            raise InvalidArgument("Retention needs at least one rule (KeepLast, KeepEveryNSteps, KeepVersions)")
        object.__setattr__(self, "rules", tuple(rules))

    def to_drop(self, versions: tuple[VersionInfo, ...]) -> set[int]:
        if not versions:
            return set()
        kept = {versions[-1].version}
        for rule in self.rules:
            kept |= rule.keep(versions)
        return {v.version for v in versions} - kept


@dataclass(frozen=True)
class Plan:
    """What a policy decided for the current history."""

    materialize: bool = False
    drop: frozenset[int] = field(default_factory=frozenset)
    collect: bool = False


def default_materialize(options=None) -> MaterializeRule | None:
    """The materialize rule of ``CompactionPolicy()`` and ``compaction="auto"``: none while the writer bounds
    read chains (``options.read_chain_bound``, a store's Options; without ``options``, ``Options()``'s, which
    follows ``knobs.READ_CHAIN_BOUND``): the writer then applies Check-N-Run's reset rule itself, per block,
    on the real union of changed rows (cnrstore/engine/merge.py), so background baselines would only add
    writes. ``IntermittentRule()`` on the log's growth when the bound is off (None)."""
    if options is None:
        from ..options import Options

        options = Options()
    return None if options.read_chain_bound is not None else IntermittentRule()


@dataclass(frozen=True)
class CompactionPolicy:
    """What ``open(compaction=...)`` takes: a materialize rule, an optional retention, and whether to
    garbage-collect after dropping or materializing. ``"auto"`` is ``CompactionPolicy()``: the paper's
    intermittent rule (per block in the writer, or in the background with the chain bound off; see
    ``default_materialize``), every version kept, GC on."""

    materialize: MaterializeRule | None = field(default_factory=default_materialize)
    retention: Retention | None = None
    gc: bool = True

    def plan(self, history: History) -> Plan:
        materialize = self.materialize is not None and self.materialize.due(history)
        drop = frozenset(self.retention.to_drop(history.versions)) if self.retention is not None else frozenset()
        return Plan(materialize, drop, self.gc and (materialize or bool(drop)))


def resolve(policy, options=None) -> CompactionPolicy | None:
    """The policy ``open(compaction=...)`` names: None (off), "auto" (``CompactionPolicy()``, its materialize
    rule chosen by the store's ``options``: ``default_materialize``), or a CompactionPolicy."""
    if policy is None:
        return None
    if policy == "auto":
        return CompactionPolicy(materialize=default_materialize(options))
    if isinstance(policy, CompactionPolicy):
        return policy
    raise InvalidArgument(f"compaction= takes None, 'auto' or a cnrstore.policy.CompactionPolicy, got {policy!r}")
