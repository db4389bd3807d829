"""cnrstore.serving.Follower over keyed tables (issue 50): a KeyedReplica follows puts, evictions and
re-admissions poll by poll and in one poll of several versions, rolls back and forward, re-syncs in full when
retention dropped the version it held; no evicted key is ever found (nor its vector left in a slot) once the
update that evicted it is applied, and a lookup under serving() never mixes two versions."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cnrstore.errors import InvalidArgument
from cnrstore.serving import Follower, KeyedReplica

DIM = 4
COLUMNS = {"score": "float32", "seen": ("int64", 2)}
POOL = np.concatenate([np.arange(-20, 60), [1 << 40, -(1 << 62), (1 << 62) + 5]]).astype(np.int64)


def _row(keys: np.ndarray, salt: int) -> tuple[np.ndarray, dict]:
    values = ((keys[:, None] % 1000) + salt + np.arange(DIM)).astype(np.float32) / 4
    return values, {"score": (keys % 7 + salt).astype(np.float32), "seen": np.stack([keys, keys + salt], 1)}


def save(store, puts=(), evicts=(), salt=0) -> int:
    puts, evicts = np.asarray(puts, np.int64), np.asarray(evicts, np.int64)
    with store.checkpoint(step=salt) as ck:
        if puts.size:
            values, columns = _row(puts, salt)
            ck.put_keys("ids", puts, values, columns=columns)
        if evicts.size:
            ck.delete_keys("ids", evicts)
    return store.latest().version


def same_as_store(replica: KeyedReplica, store, version=None) -> None:
    want, got = store.read_keyed("ids", version), replica.rows()
    assert np.array_equal(want.keys, got.keys)
    assert np.array_equal(want.values.view(np.uint32), got.values.view(np.uint32))
    for name in want.columns:
        assert np.array_equal(want.columns[name], got.columns[name]), name


def no_stale(replica: KeyedReplica, store, version=None) -> None:
    """Every key absent at the version is not found, and no free slot holds anything but zeros."""
    live = store.keys("ids", version)
    absent = np.setdiff1d(POOL, live)
    found, values = replica.lookup(absent)
    assert not found.any() and not values.any()
    st = replica._state
    assert not st.values[st.free].any()
    assert all(not c[st.free].any() for c in st.columns.values())


@pytest.fixture
def keyed(store):
    store.create_table("ids", dim=DIM, keyed=True, partitions=8, columns=COLUMNS)
    save(store, POOL[:30], salt=1)
    return store


def test_puts_evictions_readmissions_poll_by_poll(keyed):
    store = keyed
    rng = np.random.default_rng(0)
    target = {}
    with Follower(store.path, target) as f:
        replica = target["ids"]
        assert isinstance(replica, KeyedReplica) and len(replica) == 30
        same_as_store(replica, store)
        for salt in range(2, 30):
            live = store.keys("ids")
            evicts = rng.choice(live, min(live.size, int(rng.integers(0, 8))), replace=False)
            puts = np.setdiff1d(rng.choice(POOL, int(rng.integers(0, 12)), replace=False), evicts)
            v = save(store, puts, evicts, salt)
            assert f.poll() == v
            same_as_store(replica, store)
            no_stale(replica, store)
            found, _ = replica.lookup(evicts)
            assert not found.any()  # evicted by this very update: gone at once
        assert f.stats["full_syncs"] == 1


def test_one_poll_over_several_versions_evict_then_readmit(keyed):
    store = keyed
    target = {"ids": KeyedReplica()}
    with Follower(store.path, target) as f:
        replica = target["ids"]
        k = POOL[:3]
        save(store, evicts=k, salt=2)            # evicted ...
        save(store, puts=k[:2], salt=3)          # ... two re-admitted with new vectors
        save(store, puts=POOL[40:45], salt=4)
        f.poll()
        same_as_store(replica, store)
        no_stale(replica, store)
        found, values = replica.lookup(k)
        assert found.tolist() == [True, True, False]
        assert np.array_equal(values[:2], _row(k[:2], 3)[0])  # the new vectors, never the old ones


def test_rollback_and_forward_exact_keys(keyed):
    store = keyed
    v1 = store.latest().version
    save(store, POOL[30:50], POOL[:10], salt=2)
    v3 = save(store, POOL[50:60], POOL[10:20], salt=3)
    target = {}
    with Follower(store.path, target, version=v1) as f:
        replica = target["ids"]
        assert f.rollback(v3) == v3
        same_as_store(replica, store, v3)
        assert f.rollback(v1) == v1  # keys admitted after v1 are gone, the evicted ones back
        same_as_store(replica, store, v1)
        no_stale(replica, store, v1)
        assert f.rollback(v3) == v3
        same_as_store(replica, store, v3)
        no_stale(replica, store, v3)


def test_rollback_to_before_a_partition_was_written(store):
    store.create_table("ids", dim=DIM, keyed=True, partitions=8, columns=COLUMNS)
    v1 = save(store, POOL[:1], salt=1)
    v2 = save(store, POOL[1:40], salt=2)
    target = {}
    with Follower(store.path, target) as f:
        assert f.version == v2
        f.rollback(v1)
        same_as_store(target["ids"], store, v1)
        no_stale(target["ids"], store, v1)


def test_retention_dropping_the_version_held_resyncs_without_the_evicted(keyed):
    store = keyed
    target = {}
    with Follower(store.path, target) as f:
        replica = target["ids"]
        evicted = POOL[:10]
        save(store, evicts=evicted, salt=2)
        save(store, POOL[60:70], salt=3)
        store.compact()
        store.retain(keep_last=1)  # drops the version the follower holds
        store.gc()
        f.poll()
        assert f.stats["full_syncs"] == 2
        same_as_store(replica, store)
        assert not replica.lookup(evicted)[0].any()
        no_stale(replica, store)
        save(store, POOL[:5], POOL[60:62], salt=4)  # re-admitted after the re-sync: changes only
        f.poll()
        assert f.stats["full_syncs"] == 2
        same_as_store(replica, store)
        no_stale(replica, store)


def test_a_replica_that_held_other_keys_is_replaced_by_the_full_sync(keyed):
    store = keyed
    replica = KeyedReplica()
    plan = replica.plan_replace(np.array([-999, 12345], np.int64), np.ones((2, DIM), np.float32),
                                {"score": np.zeros(2, np.float32), "seen": np.zeros((2, 2), np.int64)},
                                DIM, store.tables()["ids"].columns)
    replica.commit(plan)
    with Follower(store.path, {"ids": replica}):
        same_as_store(replica, store)
        assert not replica.lookup([-999, 12345])[0].any()


def test_a_lookup_under_serving_never_mixes_versions(store):
    """Each version holds keys [0, n) with every value n: a lookup sees one n, and exactly those keys."""
    store.create_table("ids", dim=DIM, keyed=True, partitions=8)
    sizes = [50, 20, 80, 5, 60, 40]

    def put(n, prev):
        with store.checkpoint() as ck:
            ck.put_keys("ids", np.arange(n), np.full((n, DIM), n, np.float32))
            if prev > n:
                ck.delete_keys("ids", np.arange(n, prev))

    put(sizes[0], 0)
    target = {}
    f = Follower(store.path, target)
    replica, stop, bad = target["ids"], threading.Event(), []

    def reader():
        q = np.arange(100)
        while not stop.is_set():
            with f.serving():
                found, values = replica.lookup(q)
            n = int(found.sum())
            if not (found[:n].all() and (values[:n] == n).all() and not values[n:].any()):
                bad.append(n)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(1, 40):
            n, prev = sizes[i % len(sizes)], sizes[(i - 1) % len(sizes)]
            put(n, prev)
            f.poll()
    finally:
        stop.set()
        for t in threads:
            t.join()
        f.close()
    assert not bad


def test_a_keyed_table_needs_a_keyed_replica(keyed):
    store = keyed
    with pytest.raises(InvalidArgument, match=r"target\['ids'\] is keyed table 'ids'.*KeyedReplica"):
        Follower(store.path, {"ids": np.zeros((30, DIM), np.float32)})
    store.create_table("t", 8, DIM)
    with store.checkpoint() as ck:
        ck.put_rows("t", np.arange(8), np.ones((8, DIM), np.float32))
    with pytest.raises(InvalidArgument, match=r"target\['t'\] must be a writable numpy array"):
        Follower(store.path, {"t": KeyedReplica()})
    target = {"t": np.zeros((8, DIM), np.float32)}
    with Follower(store.path, target, tables=["t"]):  # a keyed table left out is not followed
        assert list(target) == ["t"]
    with pytest.raises(InvalidArgument, match="keys must be a 1-D array"):
        KeyedReplica().lookup([[1]])


def test_a_serving_models_keyed_embedding_follows_slot_by_slot_and_never_keeps_an_evicted_vector(tmp_path):
    """A model's KeyedEmbedding as the target (cnrstore/torch/keyed_serving.py): after each poll it equals the
    training module at that save (ids in their slots, rows, metadata); an evicted id is not found and its old
    slot holds another id's row or zeros; rollback and a second follower's full sync agree."""
    import torch
    from torch import nn

    from cnrstore.torch import Checkpointer, KeyedEmbedding

    class Model(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.emb = KeyedEmbedding(24, DIM, eviction="lru", partitions=4, seed=seed, init_std=0.5)
            self.top = nn.Linear(DIM, 1)

    def state(m):
        e = m.emb
        return (e.weight.detach().clone(), e.slot_ids.clone(), e.last_step.clone(), e.count.clone(),
                m.top.weight.detach().clone())

    train, serve = Model(0), Model(1)
    opt = torch.optim.SGD(train.parameters(), lr=0.1)
    saved, evicted = {}, set()
    with Checkpointer(tmp_path / "k", train, opt) as ck:
        for step in range(8):
            before = set(train.emb.ids().tolist())
            ids = torch.arange(10) + 7 * step  # new ids every step: the pool of 24 slots evicts
            train.top(train.emb(ids)).sum().backward()
            opt.step()
            opt.zero_grad()
            evicted |= before - set(train.emb.ids().tolist())
            if step % 2 == 1:
                ck.save(step).wait()
                saved[ck.store.latest().version] = state(train)
        versions = sorted(saved)
        with Follower(ck.store, serve, version=versions[0]) as f:
            with pytest.raises(InvalidArgument, match="has capacity 8"):  # (a model of another capacity: refused)
                Follower(ck.store, nn.ModuleDict({"emb": KeyedEmbedding(8, DIM)}), tables=["emb"])
            for v in [versions[0], versions[-1]] + versions[-2::-1]:  # a poll to the newest, then rollbacks
                if v > f.version:
                    assert f.poll() == v
                elif v < f.version:
                    f.rollback(v)
                for a, b in zip(state(serve), saved[v]):
                    assert torch.equal(a, b), v
                gone = torch.tensor(sorted(evicted - set(saved[v][1].tolist())))
                assert gone.numel() and (serve.emb.lookup(gone) == -1).all()
            other = Model(2)
            with Follower(ck.store, other, version=f.version):  # a full sync lands on the same state
                for a, b in zip(state(other), state(serve)):
                    assert torch.equal(a, b)
