"""Key runs (cnrstore/engine/keyed_runs.py), the first piece of keyed tables (issue 50): a version's puts and
deletions of a partition, merged newest-first along a chain, against a dict model of every version; their bytes
round-trip and damaged bytes are CorruptionError; the partition function is fixed (golden values) and spreads
neighbouring ids."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cnrstore.engine import keyed_runs as kr
from cnrstore.errors import CorruptionError, InvalidArgument

WIDTH = 3
KEYS = st.one_of(st.integers(-5, 40), st.sampled_from([-(2 ** 63), 2 ** 63 - 1, 2 ** 50 + 7, -(2 ** 40)]))
#: one version's changes: key -> a row's fill byte (a put), or None (a deletion)
CHANGES = st.dictionaries(KEYS, st.one_of(st.none(), st.integers(0, 255)), max_size=12)


def _run(changes: dict) -> kr.KeyRun:
    keys = np.array(list(changes), np.int64)
    deleted = np.array([v is None for v in changes.values()], bool)
    values = np.array([[0 if v is None else v] * WIDTH for v in changes.values()], np.uint8).reshape(-1, WIDTH)
    # (given in reverse order: make_run sorts)
    return kr.make_run(keys[::-1], values[::-1], deleted[::-1])


def _as_dict(keys, values) -> dict:
    return {int(k): bytes(v) for k, v in zip(keys, values)}


@settings(max_examples=200, deadline=None)
@given(st.lists(CHANGES, min_size=1, max_size=6))
def test_merged_runs_read_every_version_as_the_model(history):
    runs, model = [], {}
    for changes in history:
        runs.append(_run(changes))
        for k, v in changes.items():
            if v is None:
                model.pop(k, None)
            else:
                model[k] = bytes([v] * WIDTH)
        merged = kr.merge(runs)
        assert _as_dict(*kr.live(merged)) == model
        assert (merged.keys[1:] > merged.keys[:-1]).all()
        probe = np.array(sorted(set(model) | {-5, 41, 2 ** 62}), np.int64)
        found, values = kr.lookup(merged, probe)
        for k, f, v in zip(probe.tolist(), found, values):
            assert f == (k in model) and (bytes(v) == model[k] if f else not v.any())
        # a chain read from a baseline: the merge of the newest runs on top of the merge of the older ones
        if len(runs) > 2:
            baseline = kr.merge(runs[:2])
            assert _as_dict(*kr.live(kr.merge([baseline, *runs[2:]]))) == model
        back = kr.decode_keys(kr.encode_keys(runs[-1]), kr.values_bytes(runs[-1]), WIDTH, "r")
        for a, b in zip(back, runs[-1]):
            np.testing.assert_array_equal(a, b)


def test_damaged_bytes_are_corruption_errors():
    run = _run({3: 1, -2: None, 9: 7})
    aux, body = kr.encode_keys(run), kr.values_bytes(run)
    assert len(aux) == 8 + 3 * 8 + 1 and len(body) == 2 * WIDTH
    with pytest.raises(CorruptionError, match="cut short"):
        kr.decode_keys(aux[:5], body, WIDTH, "seg 1 @ 40")
    with pytest.raises(CorruptionError, match="needs"):
        kr.decode_keys(aux[:-1], body, WIDTH, "x")
    with pytest.raises(CorruptionError, match="rows"):
        kr.decode_keys(aux, body[:-1], WIDTH, "x")
    swapped = aux[:8] + aux[16:24] + aux[8:16] + aux[24:]
    with pytest.raises(CorruptionError, match="strictly increasing"):
        kr.decode_keys(swapped, body, WIDTH, "x")
    stray = aux[:-1] + bytes([aux[-1] | 0x80])
    with pytest.raises(CorruptionError, match="past its 3 keys"):
        kr.decode_keys(stray, body, WIDTH, "x")


def test_bad_arguments_are_invalid_arguments():
    with pytest.raises(InvalidArgument, match="more than once"):
        kr.make_run([1, 2, 1], np.zeros((3, 2), np.uint8))
    with pytest.raises(InvalidArgument, match="uint8 rows"):
        kr.make_run([1, 2], np.zeros((3, 2), np.uint8))
    with pytest.raises(InvalidArgument, match="integer keys"):
        kr.make_run([1.5, 2.0], np.zeros((2, 2), np.uint8))
    with pytest.raises(InvalidArgument, match="values are needed"):
        kr.make_run([1, 2], None, np.array([True, False]), width=2)
    with pytest.raises(InvalidArgument, match="fit int64"):
        kr.make_run(np.array([2 ** 63], np.uint64), np.zeros((1, 2), np.uint8))
    with pytest.raises(InvalidArgument, match="one row width"):
        kr.merge([kr.make_run([1], np.zeros((1, 2), np.uint8)), kr.make_run([1], np.zeros((1, 3), np.uint8))])
    for bad in (0, -1, True, 2 ** 31 + 1, 2.0):
        with pytest.raises(InvalidArgument, match="partitions"):
            kr.partition_of(np.arange(3), bad)


def test_the_partition_of_a_key_is_fixed_and_spreads_neighbouring_ids():
    keys = np.array([0, 1, 2, -1, 2 ** 62, -(2 ** 63), 2 ** 63 - 1], np.int64)
    # golden values: changing them changes where every stored key is found
    assert kr.partition_of(keys, 1000).tolist() == GOLDEN_1000
    ids = np.arange(1 << 20, dtype=np.int64) + (1 << 40)  # a dense range of raw ids
    counts = np.bincount(kr.partition_of(ids, 64), minlength=64)
    assert counts.min() > 0.9 * ids.size / 64 and counts.max() < 1.1 * ids.size / 64
    assert kr.partition_of(ids, 1).max() == 0


GOLDEN_1000 = [883, 566, 591, 893, 2, 281, 165]
