"""Keyed tables restored at another world size (cnrstore/keyed_reshard.py): each reader rank reads only the
partitions it owns from every writer's store, gets exactly the keys it owns, and reads about their bytes."""

import numpy as np
import pytest

import cnrstore
from cnrstore import keyed_reshard
from cnrstore.engine import keyed_runs
from cnrstore.errors import InvalidArgument

P = 64


def _write(tmp_path, n_writers: int, seed: int = 0):
    """n_writers stores, writer r holding the keys it owns by partition; three saves with evictions."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(-(1 << 40), 1 << 40, 6000))
    owner = keyed_reshard.owner(keyed_runs.partition_of(keys, P), P, n_writers)
    stores, state = [], {}
    for r in range(n_writers):
        s = cnrstore.open(tmp_path / f"w{r}", create=True)
        s.create_table("ids", dim=4, keyed=True, partitions=P, columns={"score": "int64"})
        stores.append(s)
    for save in range(3):
        for r, s in enumerate(stores):
            mine = keys[owner == r]
            put = mine[rng.random(mine.size) < (1.0 if save == 0 else 0.2)]
            gone = mine[rng.random(mine.size) < (0.0 if save == 0 else 0.05)]
            put = np.setdiff1d(put, gone)
            vals = rng.standard_normal((put.size, 4)).astype(np.float32)
            with s.checkpoint(step=save) as ck:
                ck.put_keys("ids", put, vals, columns={"score": np.full(put.size, save)})
                ck.delete_keys("ids", gone)
            state.update({int(k): (tuple(v), save) for k, v in zip(put, vals)})
            for k in gone:
                state.pop(int(k), None)
    return stores, state


@pytest.mark.parametrize("n,m", [(2, 3), (3, 2), (4, 1)])
def test_every_reader_gets_exactly_what_it_owns(tmp_path, n, m):
    stores, state = _write(tmp_path, n)
    try:
        got_keys = []
        for r in range(m):
            rows, report = keyed_reshard.read_owned([(s, None) for s in stores], "ids", r, m)
            parts = keyed_runs.partition_of(rows.keys, P)
            assert (keyed_reshard.owner(parts, P, m) == r).all()
            for k, v, sc in zip(rows.keys.tolist(), rows.values.tolist(), rows.columns["score"].tolist()):
                assert state[k] == (tuple(np.float32(x) for x in v), sc)
            got_keys.append(rows.keys)
            assert report.stores == n and report.partitions == keyed_reshard.owned_partitions(P, r, m).size
        assert sorted(np.concatenate(got_keys).tolist()) == sorted(state)
    finally:
        for s in stores:
            s.close()


def test_a_reader_reads_about_the_bytes_it_owns(tmp_path):
    """After compaction each partition is one baseline: a reader of 3 reads at most 1.1x the bytes of its keys
    (8 bytes of key, 16 of value, 8 of score each), not every writer's whole table."""
    stores, state = _write(tmp_path, 2)
    try:
        for s in stores:
            s.compact()
        for r in range(3):
            rows, report = keyed_reshard.read_owned([(s, None) for s in stores], "ids", r, 3)
            owned = rows.keys.size * (8 + 16 + 8)
            assert owned <= report.bytes_read <= 1.1 * owned, (report.bytes_read, owned)
    finally:
        for s in stores:
            s.close()


def test_owned_partitions_cover_every_partition_once():
    for total, world in ((7, 3), (64, 5), (3, 7), (1, 1)):
        parts = np.concatenate([keyed_reshard.owned_partitions(total, r, world) for r in range(world)])
        assert parts.tolist() == list(range(total))
        assert (keyed_reshard.owner(parts, total, world) == np.repeat(
            np.arange(world), [keyed_reshard.owned_partitions(total, r, world).size for r in range(world)])).all()
    with pytest.raises(InvalidArgument):
        keyed_reshard.owned_partitions(8, 3, 3)


def test_sources_that_did_not_own_by_partition_are_refused(tmp_path):
    with cnrstore.open(tmp_path / "a", create=True) as a, cnrstore.open(tmp_path / "b", create=True) as b:
        for s in (a, b):
            s.create_table("ids", dim=1, keyed=True, partitions=4)
            with s.checkpoint() as ck:
                ck.put_keys("ids", [5], np.ones((1, 1)))
        with pytest.raises(InvalidArgument, match="two of the sources"):
            keyed_reshard.read_owned([(a, None), (b, None)], "ids", 0, 1)


def test_writers_that_held_ids_they_did_not_own_are_refused_when_asked(tmp_path):
    keys = np.arange(200, dtype=np.int64)
    owner = keyed_reshard.owner_of_keys(keys, 8, 2)
    with cnrstore.open(tmp_path / "a", create=True) as a, cnrstore.open(tmp_path / "b", create=True) as b:
        for r, s in enumerate((a, b)):
            s.create_table("ids", dim=1, keyed=True, partitions=8)
            mine = keys[owner == r]
            with s.checkpoint() as ck:
                ck.put_keys("ids", mine, np.ones((mine.size, 1)))
        got, _ = keyed_reshard.read_owned([(a, None), (b, None)], "ids", 0, 1, writers_owned=True)
        assert np.array_equal(got.keys, keys)
        # listed the other way round, each source holds the ids the other rank owns
        with pytest.raises(InvalidArgument, match="does not own it"):
            keyed_reshard.read_owned([(b, None), (a, None)], "ids", 0, 1, writers_owned=True)


def test_sources_with_different_partition_counts_are_refused(tmp_path):
    with cnrstore.open(tmp_path / "a", create=True) as a, cnrstore.open(tmp_path / "b", create=True) as b:
        for s, parts in ((a, 4), (b, 8)):
            s.create_table("ids", dim=1, keyed=True, partitions=parts)
            with s.checkpoint() as ck:
                ck.put_keys("ids", [parts], np.ones((1, 1)))
        with pytest.raises(InvalidArgument, match="4 partitions in one source and 8"):
            keyed_reshard.read_owned([(a, None), (b, None)], "ids", 0, 2)
