"""Compaction policies decide from a History alone: tested without a store."""

import pytest
from hypothesis import given, strategies as st

import cnrstore
from cnrstore.policy import (CompactionPolicy, EveryN, History, IntermittentRule, KeepEveryNSteps, KeepLast,
                             KeepVersions, MaxChain, Retention)
from cnrstore.policy.compaction import resolve
from cnrstore.types import VersionInfo


def history(byte_sizes, steps=None, baseline=1):
    steps = steps or list(range(len(byte_sizes)))
    versions = tuple(VersionInfo(version=i + 1, step=steps[i], meta=None, created=0.0, parent=i or None,
                                 tables=("t",), bytes=b) for i, b in enumerate(byte_sizes))
    return History(versions, baseline, byte_sizes[baseline - 1] if baseline else 0)


def paper_rule(s):
    """1 + S_1 + ... + S_i <= (i + 1) * S_i, with S the cumulative growth fractions."""
    i = len(s)
    return 1 + sum(s) <= (i + 1) * s[-1]


def test_intermittent_rule_follows_the_paper_formula():
    # baseline 100 bytes, increments of 25: S = 0.25, 0.5, 0.75 ...
    assert not IntermittentRule().due(history([100]))                      # nothing since the baseline
    assert not IntermittentRule().due(history([100, 25]))                  # 1.25 <= 0.5 ? no
    assert not IntermittentRule().due(history([100, 25, 25]))              # 1.75 <= 1.5 ? no
    assert IntermittentRule().due(history([100, 25, 25, 25]))              # 2.5 <= 3.0 ? yes
    assert IntermittentRule().due(history([100, 200]))                     # one huge increment: 3 <= 4


@given(st.integers(1, 10**6), st.lists(st.integers(0, 10**6), min_size=1, max_size=30))
def test_intermittent_rule_matches_the_formula_everywhere(base, increments):
    s, grown = [], 0
    for b in increments:
        grown += b
        s.append(grown / base)
    assert IntermittentRule().due(history([base, *increments])) == paper_rule(s)


def test_chain_and_every_n_rules():
    assert not MaxChain(3).due(history([100, 1]))          # chain of 2
    assert MaxChain(3).due(history([100, 1, 1, 1]))        # chain of 4 > 3
    assert not EveryN(3).due(history([100, 1, 1]))
    assert EveryN(3).due(history([100, 1, 1, 1]))
    assert not MaxChain(2).due(history([1, 1, 1, 1], baseline=4))  # counted from the newest baseline
    for bad in (0, -1, 1.5, True):
        with pytest.raises(cnrstore.InvalidArgument):
            MaxChain(bad)


def test_retention_keeps_the_union_and_the_newest():
    h = history([10] * 8, steps=[0, 100, 150, 200, 250, 300, 310, 320])
    assert Retention(KeepLast(2)).to_drop(h.versions) == {1, 2, 3, 4, 5, 6}
    assert Retention(KeepEveryNSteps(100)).to_drop(h.versions) == {3, 5, 7}  # 8 is the newest
    assert Retention(KeepLast(1), KeepVersions([2, 3])).to_drop(h.versions) == {1, 4, 5, 6, 7}
    with pytest.raises(cnrstore.InvalidArgument):
        Retention()


def test_plan_and_resolve():
    plan = CompactionPolicy(materialize=EveryN(1), retention=Retention(KeepLast(1))).plan(history([5, 5]))
    assert plan.materialize and plan.drop == {1} and plan.collect
    assert not CompactionPolicy(materialize=None).plan(history([5, 5])).collect
    assert resolve(None) is None and resolve("auto") == CompactionPolicy()
    with pytest.raises(cnrstore.InvalidArgument):
        resolve("sometimes")
