"""Work done on every commit or save must not grow with the number of versions (issue 11, hardening):
counted, not timed. Background compaction's history is kept incrementally; the distributed
checkpointer parses each manifest once."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import given, strategies as st

import cnrstore
from cnrstore.engine import core as engine_module
import cnrstore.store as store_module
from cnrstore.maintenance import compaction
from cnrstore.distributed import manifest as manifest_module
from cnrstore.distributed.manifest import GlobalVersion, Root
from cnrstore.distributed.plan import ShardingPlan
from cnrstore.policy import (CompactionPolicy, EveryN, History, IntermittentRule, KeepEveryNSteps, KeepLast,
                             MaxChain, Retention)
from cnrstore.types import VersionInfo


@pytest.fixture
def count_version_records(monkeypatch):
    """How many version records the store has turned into VersionInfo (each is one msgpack unpack)."""
    calls = [0]
    real = engine_module.version_info

    def counting(version, info):
        calls[0] += 1
        return real(version, info)

    monkeypatch.setattr(engine_module, "version_info", counting)
    return calls


def _commit(store, i, nbytes=4):
    with store.checkpoint(step=i) as ck:
        ck.put_dense("d", np.arange(nbytes, dtype=np.uint8))
    return ck.version


def _full_history(store) -> History:
    """What _history must equal: every version read from the index, as before the cache."""
    versions = tuple(store.versions())
    with store.engine.read() as view:
        baseline = view.meta("last_baseline")
    if baseline is not None:
        return History(versions, baseline["version"], baseline["bytes"])
    if versions:
        return History(versions, versions[0].version, versions[0].bytes)
    return History(versions, None, 0)


@pytest.mark.parametrize("existing", [40, 400])
def test_background_compaction_reads_only_the_new_version_per_commit(store_path, count_version_records, existing):
    with cnrstore.open(store_path, create=True) as store:
        for i in range(existing):
            _commit(store, i)
    # a policy that looks at every commit but never acts: what is left is the cost of looking
    with cnrstore.open(store_path, compaction=CompactionPolicy(materialize=EveryN(10**9))) as store:
        _commit(store, existing)
        assert store._compactor.wait_idle(30)
        count_version_records[0] = 0
        for i in range(10):
            _commit(store, existing + 1 + i)
            assert store._compactor.wait_idle(30)
        assert store._compactor.errors == []
        # one record per commit, however many versions the store holds (it was existing + 1 each)
        assert count_version_records[0] == 10
        assert store.engine.history() == _full_history(store)


def test_history_is_read_afresh_after_versions_are_dropped(store_path, count_version_records):
    with cnrstore.open(store_path, create=True) as store:
        for i in range(12):
            _commit(store, i)
        store.engine.history()
        store.retain(5)
        count_version_records[0] = 0
        history = store.engine.history()
        assert count_version_records[0] == 5  # the cache no longer matched the index: one full read
        assert [v.version for v in history.versions] == [8, 9, 10, 11, 12]
        assert history == _full_history(store)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_history_and_policy_decisions_equal_those_from_a_full_history(store_path, seed):
    rng = random.Random(seed)
    policies = [CompactionPolicy(), CompactionPolicy(materialize=MaxChain(3)),
                CompactionPolicy(materialize=EveryN(4), retention=Retention(KeepLast(3), KeepEveryNSteps(5))),
                CompactionPolicy(materialize=None, retention=Retention(KeepLast(2)))]
    with cnrstore.open(store_path, create=True) as store:
        step = 0
        for _ in range(60):
            op = rng.random()
            versions = [v.version for v in store.versions()]
            if op < 0.7 or len(versions) < 3:
                step += rng.randint(1, 3)
                _commit(store, step, nbytes=rng.choice([1, 16, 200, 5000]))
            elif op < 0.8:
                store.compact(rng.choice(versions))  # moves last_baseline (or not, if older)
            elif op < 0.9:
                with store.engine.maintenance() as m:
                    compaction.drop_versions(m, set(rng.sample(versions[:-1], rng.randint(1, len(versions) - 1))))
            else:
                store.retain(rng.randint(1, len(versions)))
            if rng.random() < 0.6:  # not after every change: the cache must catch up over several
                history = store.engine.history()
                full = _full_history(store)
                assert history == full
                for policy in policies:
                    assert policy.plan(history) == policy.plan(full)


def _version(n, step):
    return VersionInfo(version=n, step=step, meta=None, created=0.0, parent=None, tables=(), bytes=n * 7 % 13)


@given(st.lists(st.integers(1, 50), unique=True, min_size=1, max_size=40), st.integers(0, 55))
def test_since_baseline_by_binary_search_equals_the_filter(numbers, baseline):
    versions = tuple(_version(n, n) for n in sorted(numbers))
    history = History(versions, baseline, 10)
    assert history.since_baseline() == [v for v in versions if v.version > baseline]
    for rule in (IntermittentRule(), MaxChain(3), EveryN(2)):
        rule.due(history)  # no error on any shape


# distributed: manifests parsed per save ---------------------------------------------------------------
PLAN = ShardingPlan.row_wise({"emb.a": (8, 2)}, 1)


def _manifest(root, n):
    root.commit(GlobalVersion(version=n, step=n, meta=None, created=0.0, generation=1, plan=PLAN,
                              local_versions=(n,), stores=("gen-000001/rank-00000",)))


@pytest.fixture
def count_manifest_parses(monkeypatch):
    calls = [0]
    real = manifest_module._unseal

    def counting(kind, path):
        if kind == "manifest":
            calls[0] += 1
        return real(kind, path)

    monkeypatch.setattr(manifest_module, "_unseal", counting)
    return calls


@pytest.mark.parametrize("existing", [5, 200])
def test_listing_global_versions_again_parses_only_new_manifests(tmp_path, count_manifest_parses, existing):
    root = Root(tmp_path / "root")
    root.create()
    for n in range(1, existing + 1):
        _manifest(root, n)
    assert [gv.version for gv in root.versions()] == list(range(1, existing + 1))
    assert count_manifest_parses[0] == existing  # each once
    count_manifest_parses[0] = 0
    for n in range(existing + 1, existing + 6):  # five saves: a manifest each, then a listing
        _manifest(root, n)
        assert root.versions()[-1].version == n
    assert count_manifest_parses[0] == 5
    root.drop([1, 3])
    assert [gv.version for gv in root.versions()][:3] == [2, 4, 5]
    assert count_manifest_parses[0] == 5
    # a fresh Root reads (and verifies) every manifest again
    assert [gv.version for gv in Root(tmp_path / "root").versions()] == [gv.version for gv in root.versions()]


def test_a_replaced_manifest_is_parsed_again(tmp_path, count_manifest_parses):
    root = Root(tmp_path / "root")
    root.create()
    _manifest(root, 1)
    _manifest(root, 2)
    assert root.versions()[0].step == 1
    path = root._manifest_path(1)
    os.link(path, tmp_path / "keep")  # hold the old inode, so that the new file cannot reuse its number
    os.remove(path)
    root.commit(GlobalVersion(version=1, step=99, meta=None, created=0.0, generation=1, plan=PLAN,
                              local_versions=(1,), stores=("gen-000001/rank-00000",)))
    count_manifest_parses[0] = 0
    assert root.versions()[0].step == 99
    assert count_manifest_parses[0] == 1


def test_a_distributed_save_parses_only_its_own_manifest(tmp_path, group, count_manifest_parses):
    import torch
    from torch import nn

    from cnrstore.distributed import DistributedCheckpointer

    torch.manual_seed(0)
    model = nn.Module()
    model.emb = nn.ModuleDict({"a": nn.Embedding(8, 2)})
    plan = ShardingPlan.row_wise({"emb.a": (8, 2)}, 1)
    # keep_last: every save lists the global versions (local reclaim, generations in use)
    ck = DistributedCheckpointer(tmp_path / "root", model, plan=plan, codec="fp32", keep_last=1000)
    try:
        for i in range(3):
            ck.save(step=i).wait()
        count_manifest_parses[0] = 0
        for i in range(3, 9):
            with torch.no_grad():
                model.emb["a"].weight[i % 8] += 1
            ck.save(step=i).wait()
        assert count_manifest_parses[0] == 6  # one per save (its own), not one per global version
        assert [gv.step for gv in ck.versions()] == list(range(9))
    finally:
        ck.close()


def _msgpack_records_read(store_path, versions, monkeypatch):
    """msgpack records unpacked by one background-style materialize + drop at ``versions`` versions."""
    import cnrstore.engine.index as index_module

    with cnrstore.open(store_path, create=True) as store:
        store.create_table("e", 64, 2, codec="fp32", block_rows=16)
        rng = np.random.default_rng(0)
        for i in range(versions):
            ids = np.arange(64) if i == 0 else rng.choice(64, 3, replace=False)
            with store.checkpoint(step=i) as ck:
                ck.put_rows("e", np.sort(ids), rng.standard_normal((ids.size, 2)).astype(np.float32))
        calls = [0]
        real = index_module._unpack

        def counting(data):
            calls[0] += 1
            return real(data)

        monkeypatch.setattr(index_module, "_unpack", counting)
        with store.engine.maintenance() as m:
            compaction.materialize(m, versions)
            compaction.drop_versions(m, {2, 3})
        monkeypatch.setattr(index_module, "_unpack", real)
        return calls[0]


def test_materialize_and_drop_unpack_no_version_record_per_version(tmp_path, monkeypatch):
    # prune_log and drop_versions need version numbers only: reading every version's record made a
    # background step cost grow with the history
    assert _msgpack_records_read(tmp_path / "a", 10, monkeypatch) == \
        _msgpack_records_read(tmp_path / "b", 120, monkeypatch)


def _chain_entries_read(store_path, versions, monkeypatch):
    """Row-index entries block_chains reads at the newest of ``versions`` (a baseline every 5)."""
    from cnrstore.engine.index import IndexView

    monkeypatch.setattr(cnrstore.knobs, "READ_CHAIN_BOUND", None)  # plain increments: chains of 4
    with cnrstore.open(store_path, create=True) as store:
        store.create_table("e", 32, 2, codec="fp32", block_rows=16)
        for i in range(versions):
            ids = np.arange(32) if i == 0 else np.array([i % 16, 16 + i % 16])
            with store.checkpoint(step=i) as ck:
                ck.put_rows("e", ids, np.full((ids.size, 2), i, np.float32))
            if i % 5 == 4:
                store.compact()
        read = [0]
        chain, entries = IndexView.row_chain, IndexView.row_entries

        def counted(method):
            def wrapper(self, *args):
                for item in method(self, *args):
                    read[0] += 1
                    yield item
            return wrapper

        monkeypatch.setattr(IndexView, "row_chain", counted(chain))
        monkeypatch.setattr(IndexView, "row_entries", counted(entries))
        with store.engine.read() as view:
            chains = compaction.block_chains(view, versions)
        monkeypatch.setattr(IndexView, "row_chain", chain)
        monkeypatch.setattr(IndexView, "row_entries", entries)
        assert sorted(chains) == [(1, 0), (1, 1)] and all(len(c) == 4 for c in chains.values())
        return read[0]


def test_materialize_reads_the_chains_not_every_record_of_the_history(tmp_path, monkeypatch):
    # background materialization (block_chains) walked the whole row index: every step cost grew
    # with the number of versions
    assert _chain_entries_read(tmp_path / "a", 13, monkeypatch) == \
        _chain_entries_read(tmp_path / "b", 153, monkeypatch)
