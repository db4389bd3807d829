"""The Store API (API.md): whole-table reads into the caller's memory (read_table(out=)) and read_tables
of several tables and row ranges, on one decode thread or several.
"""

from __future__ import annotations

import numpy as np
import pytest

import cnrstore
from cnrstore import codecs, knobs

from support.options import options_changed

# -- read_table(out=), read_tables ------------------------------------------------------------------------------

def _int4_chain(store, rng, also=lambda v, ck: None) -> None:
    """Table "w" (1000 x 6, int4, blocks of 64 rows): a baseline, then 3 increments of 150 rows, 3 rows of
    each past int4's range (written with its fallback codec); ``also(v, ck)`` writes more in checkpoint v."""
    store.create_table("w", 1000, 6, codec="int4", block_rows=64)
    for v in range(4):
        with store.checkpoint() as ck:
            rows = np.arange(1000) if v == 0 else np.sort(rng.choice(1000, 150, replace=False))
            vals = rng.standard_normal((rows.size, 6)).astype(np.float32)
            vals[:3, 0] = 1e6
            ck.put_rows("w", rows, vals)
            also(v, ck)


@pytest.mark.parametrize("threads", [1, 3])
def test_read_table_into_out_equals_read_table(tmp_path, monkeypatch, threads):
    """Several blocks, a chain of increments in two codecs (int4 with int8 fallback rows): out= gives
    read_table's bits, on one thread or several, and read_tables reads several tables at once."""
    from cnrstore import knobs

    monkeypatch.setattr(knobs, "DECODE_THREADS", threads)
    monkeypatch.setattr(knobs, "DECODE_INLINE_BYTES", 0)  # (small reads: through the pool all the same)
    rng = np.random.default_rng(5)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("f", 300, 3, codec="fp32", block_rows=128)
        _int4_chain(store, rng, lambda v, ck: v < 2 and ck.put_rows(
            "f", np.arange(300), rng.standard_normal((300, 3)).astype(np.float32)))
        for version in (1, 4):
            want = store.read_table("w", version)
            out = np.full((1000, 6), np.nan, dtype=np.float32)
            got = store.read_table("w", version, out=out)
            assert np.shares_memory(got, out) and np.array_equal(out.view(np.uint32), want.view(np.uint32))
        both = store.read_tables({"w": None, "f": np.zeros((300, 3), np.float32)})
        assert np.array_equal(both["w"], store.read_table("w")) and np.array_equal(both["f"], store.read_table("f"))
        snap = store.restore()
        assert np.array_equal(snap.tables["w"], both["w"]) and np.array_equal(snap.tables["f"], both["f"])


@pytest.mark.parametrize("threads", [1, 3])
def test_read_tables_row_ranges_equal_slices_of_read_table(tmp_path, monkeypatch, threads):
    """``(start, out)`` values read rows start .. start + len(out) - 1: ranges cut blocks at both ends, lie
    inside one block, cover whole blocks, end at the table's short last block or are empty; a chain of
    increments in two codecs (int4 and its int8 fallback). Bits equal read_table's slice."""
    from cnrstore import knobs

    monkeypatch.setattr(knobs, "DECODE_THREADS", threads)
    monkeypatch.setattr(knobs, "DECODE_INLINE_BYTES", 0)  # (small reads: through the pool all the same)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        _int4_chain(store, np.random.default_rng(6))
        for version in (1, 4):
            want = store.read_table("w", version)
            for start, stop in ((0, 1000), (37, 999), (64, 128), (70, 90), (500, 1000), (999, 1000), (5, 5)):
                out = np.full((stop - start, 6), np.nan, dtype=np.float32)
                got = store.read_tables({"w": (start, out)}, version)["w"]
                assert np.shares_memory(got, out) or out.size == 0
                assert np.array_equal(out.view(np.uint32), want[start:stop].view(np.uint32)), (start, stop)


def test_a_small_read_decodes_on_the_callers_thread_and_reads_the_same(tmp_path, monkeypatch):
    """Under ``Options.decode_inline_bytes`` of destinations no block goes to the decode pool (handing it
    over costs more than the decode); the bits are the pool's."""
    from cnrstore import knobs
    from cnrstore.engine import table_decode

    monkeypatch.setattr(knobs, "DECODE_THREADS", 3)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        _int4_chain(store, np.random.default_rng(7))
        with options_changed(store, decode_inline_bytes=0):
            pooled = store.read_table("w")
        monkeypatch.setattr(table_decode, "_executor", lambda workers: pytest.fail("a small read used the pool"))
        with options_changed(store, decode_inline_bytes=pooled.nbytes + 1):
            assert np.array_equal(store.read_table("w").view(np.uint32), pooled.view(np.uint32))
        with options_changed(store, decode_inline_bytes=pooled.nbytes):
            with pytest.raises(pytest.fail.Exception, match="used the pool"):
                store.read_table("w")


def test_read_tables_row_range_of_a_partly_written_table(tmp_path):
    """A range needs only its own rows written (a TorchRec shard's rows of a table stored under global ids);
    a range reaching an unwritten row raises MissingRows (exact count) and leaves every out untouched."""
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("w", 1000, 4, codec="fp32", block_rows=64)
        store.create_table("f", 10, 4, codec="fp32")
        vals = np.arange(400 * 4, dtype=np.float32).reshape(400, 4)
        with store.checkpoint() as ck:
            ck.put_rows("w", np.arange(300, 700), vals)
            ck.put_rows("f", np.arange(10), np.ones((10, 4), np.float32))
        out = np.zeros((400, 4), np.float32)
        store.read_tables({"w": (300, out)})
        assert np.array_equal(out, vals)
        with pytest.raises(cnrstore.MissingRows):
            store.read_table("w")
        outs = {"f": np.full((10, 4), 7, np.float32), "w": (290, np.full((420, 4), 7, np.float32))}
        with pytest.raises(cnrstore.MissingRows, match=r"^20 row\(s\)"):
            store.read_tables(outs)
        assert (outs["f"] == 7).all() and (outs["w"][1] == 7).all()


def test_read_tables_bad_row_range_raises(tmp_path):
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("w", 10, 4, codec="fp32")
        with store.checkpoint() as ck:
            ck.put_rows("w", np.arange(10), np.ones((10, 4), np.float32))
        for bad in ((8, np.zeros((3, 4), np.float32)), (-1, np.zeros((3, 4), np.float32)),
                    (1.0, np.zeros((3, 4), np.float32)), (0, np.zeros((3, 5), np.float32)),
                    (0, np.zeros(3, np.float32)), (0, np.zeros((3, 4), np.float64)), (0, 1, 2)):
            with pytest.raises(cnrstore.InvalidArgument):
                store.read_tables({"w": bad})


def test_read_table_out_of_the_wrong_shape_or_dtype_raises(tmp_path):
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("w", 10, 4, codec="fp32")
        with store.checkpoint() as ck:
            ck.put_rows("w", np.arange(10), np.ones((10, 4), np.float32))
        for bad in (np.zeros((10, 5), np.float32), np.zeros((10, 4), np.float64), np.zeros((4, 10), np.float32).T,
                    [[0.0] * 4] * 10):
            with pytest.raises(cnrstore.InvalidArgument, match="out"):
                store.read_table("w", out=bad)
        with pytest.raises(cnrstore.TableNotFound):
            store.read_tables({"w": None, "nope": None})


# -- what a whole-table read lets go of (SegmentStorage.release) ------------------------------------------------

@pytest.mark.parametrize("into", ["out", "new"])
def test_a_whole_table_read_lets_go_of_each_record_once_used(tmp_path, monkeypatch, into):
    """The storage hears of every record a whole-table read reads (``release``), after its read: into given
    arrays twice, once verified (every record of the read verified before the first decoded one is let go
    of again) and once decoded; into new arrays once, decoded. The local storage drops their pages past
    ``mapped_read_release_bytes`` (tests/test_segments.py: RssFile while the read runs); a read that lets go
    of nothing keeps the whole read's bytes mapped until it ends (a restore peaked 900 MB above its model)."""
    from cnrstore.engine import fs
    from cnrstore.engine.storage import LocalSegmentStorage
    from cnrstore.store import Store
    from support.recording_storage import RecordingStorage

    monkeypatch.setattr(knobs, "DECODE_THREADS", 2)
    monkeypatch.setattr(knobs, "DECODE_INLINE_BYTES", 0)  # (through the pool)
    path = str(tmp_path / "s")
    rng = np.random.default_rng(3)
    values = rng.standard_normal((1000, 8)).astype(np.float32)
    with cnrstore.open(path, create=True) as store:
        store.create_table("t", 1000, 8, codec="fp32", block_rows=64)
        for v in range(3):  # a baseline, two increments: chains of up to three records
            rows = np.arange(1000) if v == 0 else np.sort(rng.choice(1000, 200, replace=False))
            values[rows] = rng.standard_normal((rows.size, 8))
            with store.checkpoint() as ck:
                ck.put_rows("t", rows, values[rows])
    recording = RecordingStorage(LocalSegmentStorage(path))
    store = Store(path, create=False, readonly=True, filesystem=fs.DEFAULT, storage=recording)
    try:
        del recording.calls[:]
        got = np.zeros_like(values) if into == "out" else None
        got = store.read_tables({"t": got})["t"]
        np.testing.assert_array_equal(got, values)
        calls = list(recording.calls)
    finally:
        store.close()
    reads = [(i, args) for i, (name, args, _kw) in enumerate(calls) if name == "read"]
    released = [(i, tuple(r)) for i, (name, args, _kw) in enumerate(calls) if name == "release" for r in args[0]]
    assert reads and {args for _i, args in reads} == {r for _i, r in released}  # every record read, no other
    per_record = {args: [i for i, r in released if r == args] for _i, args in reads}
    read_at = {args: i for i, args in reads}
    assert all(min(at) > read_at[r] for r, at in per_record.items())
    assert {len(at) for at in per_record.values()} == ({2} if into == "out" else {1})
    if into == "out":  # the second time (decoded) only once every record of the read is verified
        assert min(max(at) for at in per_record.values()) > max(read_at.values())


def test_a_table_named_by_anything_but_a_str_is_an_invalid_argument_and_names_alone_read_whole(tmp_path):
    """Found beside issue 49: read_rows(5, ...) raised TypeError and read_table(5) AttributeError; a list of
    names given to read_tables raised AttributeError."""
    import cnrstore
    from cnrstore.errors import InvalidArgument

    with cnrstore.open(tmp_path / "s", create=True) as s:
        s.create_table("t", 8, 2)
        s.create_table("u", 4, 3)
        with s.checkpoint() as ck:
            ck.put_rows("t", np.arange(8), np.ones((8, 2), np.float32))
            ck.put_rows("u", np.arange(4), np.full((4, 3), 2, np.float32))
        for call in (lambda: s.read_rows(5, [0]), lambda: s.read_table(5), lambda: s.read_tables({5: None}),
                     lambda: s.read_tables([b"t"])):
            with pytest.raises(InvalidArgument, match="name"):
                call()
        both = s.read_tables(["t", "u"])
        assert (both["t"] == 1).all() and (both["u"] == 2).all()
        assert list(s.read_tables("u")) == ["u"]
