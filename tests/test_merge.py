"""cnrstore/engine/merge.py: what one block's merged record holds, decided from the block's read chain alone
(records built in memory and read through a stand-in for the reader's BlockResolver). Merging inside real
checkpoints, and the read-chain bound it keeps, are test_delta.py's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs, knobs
from cnrstore.engine import merge, record
from cnrstore.engine.index import RowLoc

DIM = 2
BLOCK_LEN = 16
FP32 = codecs.get("fp32")
INT8 = codecs.get("int8")


class Chain:
    """One block's records, newest last as written, read back like BlockResolver.load_rows."""

    dim = DIM
    table = SimpleNamespace(codec="fp32")  # (what merge_block prices a record by: the table's codec)

    def __init__(self):
        self.records: dict[RowLoc, record.Record] = {}
        self.entries: list[tuple[int, RowLoc]] = []

    def write(self, version: int, offsets, codec=FP32, *, flags: int = 0, base: int = 0, copied: int = 0):
        offsets = np.asarray(offsets, dtype=np.int64)
        values = self.values(version, offsets)
        if base:
            flags |= record.FLAG_DELTA
        stored = None if flags & record.FLAG_FULL else offsets
        buffers, length = record.rows_record(codec.codec_id, flags, 1, 0, version, stored,
                                             codec.encode(values), base, copied)
        rec = record.parse(np.frombuffer(b"".join(bytes(b) for b in buffers), dtype=np.uint8), "seg", 0)
        loc = RowLoc(len(self.entries), 0, length, rec.count, rec.flags, base)
        self.records[loc] = rec
        self.entries.append((version, loc))
        return version, loc

    @staticmethod
    def values(version: int, offsets) -> np.ndarray:
        """Row ``o`` of version ``v`` holds (v, o): a read shows which version each row came from."""
        offsets = np.asarray(offsets)
        return np.stack([np.full(offsets.size, version), offsets], axis=1).astype(np.float32)

    def load_rows(self, loc, block, version):
        rec = self.records[loc]
        return rec, rec.body.reshape(rec.count, codecs.by_id(rec.codec_id).row_bytes(DIM))

    def merge(self, version: int, offsets, codec=FP32) -> merge.Merged:
        """Merge version ``version``'s rows ``offsets`` with the chain (newest first, down to a baseline)."""
        records, baseline = [], None
        for v, loc in reversed(self.entries):
            if loc.flags & record.FLAG_BASELINE:
                baseline = (v, loc)
                break
            records.append((v, loc))
        offsets = np.asarray(offsets, dtype=np.int64)
        return merge.merge_block(self, 0, BLOCK_LEN, merge.ChainMerge(records, baseline), codec, offsets,
                                 codec.encode(self.values(version, offsets)), cnrstore.Options())


def _read(m: merge.Merged) -> dict[int, int]:
    """{block offset: the version its row came from} of a merged record."""
    decoded = m.codec.decode(m.encoded, DIM)
    assert np.array_equal(decoded[:, 1], m.offsets), "each row sits at its own offset"
    return dict(zip(m.offsets.tolist(), decoded[:, 0].astype(int).tolist()))


def _baseline(chain: Chain, version: int = 1):
    return chain.write(version, np.arange(BLOCK_LEN), flags=record.FLAG_BASELINE | record.FLAG_FULL)


@pytest.fixture(autouse=True)
def _knobs(monkeypatch):
    """The defaults these tests reason with, whatever a run overrides."""
    monkeypatch.setattr(knobs, "READ_CHAIN_BOUND", 3)
    monkeypatch.setattr(knobs, "READ_AMP_BOUND", None)  # the count bound alone (test_merge_chains: by cost)
    monkeypatch.setattr(knobs, "MERGE_TRIGGER", None)
    monkeypatch.setattr(knobs, "DELTA_RESET_FRACTION", 1.0)
    monkeypatch.setattr(knobs, "DELTA_FULL_FRACTION", 0.7)
    monkeypatch.setattr(knobs, "DELTA_TIER_RATIO", 1.0)


def test_increments_merge_into_a_cumulative_delta_on_the_baseline_newest_value_first():
    chain = Chain()
    _baseline(chain)
    chain.write(2, [1, 2])
    chain.write(3, [2, 3])
    m = chain.merge(4, [3, 5])
    assert m.base == 1
    assert _read(m) == {1: 2, 2: 3, 3: 4, 5: 4}      # each row once, from the newest record holding it
    assert m.carried.tolist() == [1, 2]              # what came from older records
    assert m.copied == 2


def test_merged_rows_are_the_stored_bytes_never_re_encoded():
    chain = Chain()
    _baseline(chain)
    _v, loc = chain.write(2, [4, 7], INT8)
    m = chain.merge(3, [1], INT8)
    assert m.codec is INT8
    stored = chain.records[loc].body.reshape(2, -1)
    assert np.array_equal(m.encoded[m.offsets.tolist().index(4)], stored[0])
    assert np.array_equal(m.encoded[m.offsets.tolist().index(7)], stored[1])


def test_parts_of_several_codecs_are_stored_as_fp32_of_their_decoded_values():
    chain = Chain()
    _baseline(chain)
    _v, loc = chain.write(2, [4], INT8)
    m = chain.merge(3, [1], FP32)
    assert m.codec is FP32
    int8_row = INT8.decode(chain.records[loc].body.reshape(1, -1), DIM)[0]
    assert np.array_equal(FP32.decode(m.encoded, DIM)[m.offsets.tolist().index(4)], int8_row)


def test_copies_past_the_reset_fraction_make_a_new_baseline_of_every_row():
    chain = Chain()
    _baseline(chain)
    chain.write(2, [1], base=1, copied=BLOCK_LEN - 1)   # this block's deltas copied nearly a block already
    m = chain.merge(3, [2])
    assert m.base == 0 and m.copied == 0
    assert m.offsets.tolist() == list(range(BLOCK_LEN))
    rows = _read(m)
    assert rows[2] == 3 and rows[1] == 2 and rows[0] == 1   # untouched rows copied from the old baseline


def test_a_merge_holding_most_of_the_block_anyway_becomes_a_baseline():
    chain = Chain()
    _baseline(chain)
    chain.write(2, range(0, 6))
    m = chain.merge(3, range(6, 12))                    # 12 of 16 rows >= DELTA_FULL_FRACTION 0.7
    assert m.base == 0 and m.offsets.tolist() == list(range(BLOCK_LEN))


def test_few_rows_above_a_large_delta_merge_into_a_delta_on_it():
    chain = Chain()
    _baseline(chain)
    chain.write(2, range(0, 8), base=1, copied=0)       # D: a cumulative delta of 8 rows on the baseline
    chain.write(3, [9])
    m = chain.merge(4, [10])                            # 2 rows above D < DELTA_TIER_RATIO x 8
    assert m.base == 2                                  # read as it, D, the baseline
    assert _read(m) == {9: 3, 10: 4}                    # D's rows are not copied again
    assert m.carried.tolist() == [9]


def test_many_rows_above_a_delta_merge_everything_since_the_baseline():
    chain = Chain()
    _baseline(chain)
    chain.write(2, [0, 1], base=1, copied=0)
    chain.write(3, [5, 6])
    m = chain.merge(4, [7])                             # 3 rows above D >= 1.0 x 2
    assert m.base == 1 and _read(m) == {0: 2, 1: 2, 5: 3, 6: 3, 7: 4}


def test_a_chain_within_the_bound_needs_no_merge(tmp_path):
    assert merge.chain_merge(None, None, 0, 5, 0, cnrstore.Options(read_chain_bound=None)) is None  # merging is off
    with cnrstore.open(tmp_path / "s", create=True) as store:
        store.create_table("t", 16, DIM, codec="fp32", block_rows=16)
        for v in range(3):
            with store.checkpoint() as ck:
                ck.put_rows("t", [v], np.ones((1, DIM), np.float32))
        with store.engine.read() as view:
            info = view.table("t")
            options = store.options  # (READ_CHAIN_BOUND 3: the fixture's)
            assert merge.chain_merge(view, info, 0, None, 0, options) is None  # a first version has no chain
            assert merge.chain_merge(view, info, 0, 2, 0, options) is None     # 2 records + this one = 3
            plan = merge.chain_merge(view, info, 0, 3, 0, options)             # 3 records + this one > 3
    assert plan is not None and plan.baseline is None and [v for v, _loc in plan.records] == [3, 2, 1]
