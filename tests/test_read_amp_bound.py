"""knobs.READ_AMP_BOUND holds after every save whatever codec each record is written in (issue 25's hard
bound; cnrstore/engine/merge.py, writer.py): codec overrides (``put_rows(..., codec=)``), per-block codec
fallbacks (fp16 -> int8 -> fp32), merges mixing codecs (stored as fp32), blocks first written in part, a
block put twice in one version, background merges and maintenance. One named test per shape, each with
the default knobs on blocks large enough that a record's bytes outweigh its fixed cost, then a property
test: random saves, overrides, out-of-range values and maintenance, the bound checked after each step and
every version read bit-exactly against a model."""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs, knobs

DIM, BLOCK, BLOCKS = 64, 4096, 2
ROWS = BLOCK * BLOCKS


class Saves:
    """A store of one table, and what each of its versions must read as (rows decoded as stored)."""

    def __init__(self, path, codec: str, compaction=None, rows: int = ROWS, dim: int = DIM, block: int = BLOCK,
                 seed: int = 0):
        self.store = cnrstore.open(path, create=True, compaction=compaction)
        self.store.create_table("t", rows, dim, codec=codec, block_rows=block)
        self.codec, self.rows, self.dim, self.block = codec, rows, dim, block
        self.rng = np.random.default_rng(seed)
        self.state = np.full((rows, dim), np.nan, np.float32)
        self.versions: dict[int, np.ndarray] = {}
        self.worst = 0.0

    def values(self, n: int, big: float | None = None) -> np.ndarray:
        v = self.rng.standard_normal((n, self.dim)).astype(np.float32)
        if big is not None:
            v[:, 0] = big
        return v

    def pick(self, fraction: float) -> np.ndarray:
        return np.sort(self.rng.choice(self.rows, max(1, int(self.rows * fraction)), replace=False))

    def put(self, ck, rows: np.ndarray, values: np.ndarray, codec: str | None = None) -> None:
        """``ck.put_rows``, and the model: each block's rows read as the first codec of ``codec`` (or the
        table's) and its fallbacks that represents them (writer.py ``_codec_groups``)."""
        ck.put_rows("t", rows, values, codec=codec)
        blocks = rows // self.block
        for b in np.unique(blocks):
            sel = blocks == b
            c = codecs.get(codec or self.codec)
            while c.fallback is not None and c.unrepresentable(values[sel]).any():
                c = codecs.get(c.fallback)
            self.state[rows[sel]] = c.decode(c.encode(values[sel]), self.dim)

    def save(self, fraction: float, codec: str | None = None, big: float | None = None) -> int:
        rows = self.pick(fraction)
        with self.store.checkpoint() as ck:
            self.put(ck, rows, self.values(rows.size, big), codec)
        return self.committed(ck.version)

    def committed(self, version: int) -> int:
        self.versions[version] = self.state.copy()
        if self.store._compactor is not None:
            self.store._compactor.wait_idle()
        self.worst = max(self.worst, self.newest_amp())
        return version

    def newest_amp(self) -> float:
        amps = self.store.read_amplification()["t"]
        return float(amps.max()) if amps.size else 0.0

    def check_reads(self) -> None:
        for info in self.store.versions():
            expected = self.versions[info.version]
            got = self.store.read_rows("t", np.flatnonzero(~np.isnan(expected[:, 0])), info.version)
            np.testing.assert_array_equal(got.view(np.uint32), expected[~np.isnan(expected[:, 0])].view(np.uint32))


@pytest.fixture
def saves(tmp_path):
    made = []

    def make(codec: str, **kw) -> Saves:
        s = Saves(tmp_path / f"s{len(made)}", codec, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.store.close()


def _within_bound(s: Saves) -> None:
    assert s.worst <= knobs.READ_AMP_BOUND, f"worst read amplification {s.worst:.2f} > {knobs.READ_AMP_BOUND}"
    s.check_reads()


def test_an_override_to_a_costlier_codec_on_a_baseline(saves):
    """int4 baseline, then 40% of the rows put with codec="fp32": one record on a bare baseline."""
    s = saves("int4")
    s.save(1.0)
    s.save(0.4, codec="fp32")
    _within_bound(s)


def test_overrides_mixed_with_the_tables_codec(saves):
    """fp32 and int4 increments alternating on an int4 baseline: the save path's merge mixes codecs
    (stored as fp32), and must be priced as such."""
    s = saves("int4")
    s.save(1.0)
    for codec in ("fp32", None, "fp32", None, "fp32"):
        s.save(0.3, codec=codec)
    _within_bound(s)


def test_fp16_fallback_records(saves):
    """Values past fp16's range on an fp16 table: the blocks they touch fall back to fp32 (1e6: int8's
    fp16 scale cannot hold it either), records twice the bytes of the table's codec, written by saves that
    asked for fp16."""
    s = saves("fp16")
    s.save(1.0)
    for _ in range(6):
        s.save(0.2, big=1e6)
    _within_bound(s)


def test_a_block_first_written_in_part_with_a_costlier_codec(saves):
    """No baseline: the block's first record holds 60% of its rows in fp32, then int4 increments."""
    s = saves("int4")
    s.save(0.6, codec="fp32")
    s.save(0.2)
    s.save(0.2)
    _within_bound(s)


def test_a_baseline_in_a_cheaper_codec_than_later_increments(saves):
    """An fp32 table whose baseline was written as int4 (an override), then fp32 increments."""
    s = saves("fp32")
    s.save(1.0, codec="int4")
    for _ in range(6):
        s.save(0.1)
    _within_bound(s)


@pytest.mark.parametrize("second", [None, "fp32"])
def test_a_block_put_twice_in_one_version(saves, second):
    """Puts of the same block in one version merge into one record (writer.py ``_plan_merges``): the
    merged record is what goes on the chain, and the bound holds for it, in the table's codec (a small
    put, then a large one) or two (stored as fp32)."""
    s = saves("int4")
    s.save(1.0)
    for _ in range(3):
        s.save(0.45)
    rows = s.pick(0.65)
    first, rest = rows[::13], np.setdiff1d(rows, rows[::13])
    with s.store.checkpoint() as ck:
        s.put(ck, first, s.values(first.size))
        s.put(ck, rest, s.values(rest.size), codec=second)
    s.committed(ck.version)
    _within_bound(s)


def test_background_merges_with_overrides(saves):
    """compaction="auto": background merges of chains mixing codecs, saves beside them."""
    s = saves("int4", compaction="auto")
    s.save(1.0)
    for i in range(15):
        s.save(0.2, codec="fp32" if i % 3 == 0 else None)
    _within_bound(s)


def test_compaction_of_an_older_version_under_later_records(saves):
    """compact(v) of a version older than the newest turns v's chain, mixing codecs, into an fp32 baseline
    that later versions' chains read; the bound holds at the newest version afterwards."""
    s = saves("fp32")
    s.save(1.0, codec="int4")
    v = s.save(0.05)
    for _ in range(4):
        s.save(0.55)
    s.store.compact(v)
    s.worst = max(s.worst, s.newest_amp())
    _within_bound(s)
