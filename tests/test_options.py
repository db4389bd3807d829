"""Per-store options (cnrstore/options.py, API.md "Per-store options"): ``Options()`` takes its defaults from
``cnrstore.knobs`` as it is made, a bad value raises InvalidArgument naming the field, and each store of one
process reads only its own options: segment size, the save path's read-chain bound and background merges.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import cnrstore
from cnrstore import knobs
from cnrstore.errors import InvalidArgument
from cnrstore.policy import IntermittentRule

from support.store_helpers import rand


# Options itself ---------------------------------------------------------------------------------------
def test_every_default_is_its_knob_as_the_options_are_made(monkeypatch):
    fields = dataclasses.fields(cnrstore.Options)
    assert {f.name: getattr(cnrstore.Options(), f.name) for f in fields} == {
        f.name: getattr(knobs, f.name.upper()) for f in fields}
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 4096)
    monkeypatch.setattr(knobs, "MERGE_TRIGGER", None)
    made = cnrstore.Options()
    assert (made.segment_bytes, made.merge_trigger) == (4096, None)
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 8192)
    assert made.segment_bytes == 4096, "an Options made before keeps its value"
    assert cnrstore.Options(segment_bytes=1 << 20).segment_bytes == 1 << 20


def test_options_are_frozen_and_replace_makes_another():
    options = cnrstore.Options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.segment_bytes = 1
    smaller = dataclasses.replace(options, segment_bytes=4096)
    assert smaller.segment_bytes == 4096 and options.segment_bytes == knobs.SEGMENT_BYTES


@pytest.mark.parametrize("field,value,says", [
    ("segment_bytes", 0, "at least 1"),
    ("segment_bytes", -4096, "at least 1"),
    ("segment_bytes", 4096.0, "an int"),
    ("segment_bytes", True, "an int"),
    ("segment_bytes", None, "an int"),
    ("writev_buffers", 0, "at least 1"),
    ("index_map_bytes", 0, "at least 1"),
    ("min_block_rows", 3, "a power of two"),
    ("min_block_rows", knobs.MAX_BLOCK_ROWS * 2, "at most"),
    ("encode_chunk_rows", 0, "at least 1"),
    ("gc_live_fraction", -0.1, "at least 0"),
    ("gc_space_bound", 0.5, "at least 1"),
    ("read_record_cost_s", float("nan"), "a number"),
    ("merge_trigger", 0.5, "at least 1"),
    ("read_amp_bound", "3", "a number"),
    ("read_chain_bound", 0, "at least 1"),
    ("merge_rate_bytes", 0, "(or None)"),
    ("decode_threads", 0, "at least 1"),
    ("decode_inline_bytes", -1, "at least 0"),
    ("mapped_read_release_bytes", -1, "at least 0"),
    ("remote_read_requests", 0, "at least 1"),
    ("remote_read_gap_bytes", -1, "at least 0"),
    ("remote_read_request_bytes", 0, "at least 1"),
    ("remote_read_window_bytes", None, "an int"),
])
def test_a_bad_value_raises_invalid_argument_naming_the_field_and_what_to_pass(field, value, says):
    with pytest.raises(InvalidArgument, match=f"Options.{field}") as info:
        cnrstore.Options(**{field: value})
    assert says in str(info.value) and f"pass e.g. {field}=" in str(info.value)


def test_the_none_a_field_allows_passes():
    options = cnrstore.Options(merge_trigger=None, read_amp_bound=None, read_chain_bound=None,
                               merge_rate_bytes=None, decode_threads=None, mapped_read_release_bytes=None)
    assert options.read_chain_bound is None


def test_open_takes_only_options(tmp_path):
    with pytest.raises(InvalidArgument, match="options= takes a cnrstore.Options"):
        cnrstore.open(tmp_path / "s", create=True, options={"segment_bytes": 4096})
    assert not os.path.exists(tmp_path / "s")


# each store its own ----------------------------------------------------------------------------------
def _segment_sizes(store) -> list[int]:
    seg_dir = os.path.join(store.path, "segments")
    return [os.path.getsize(os.path.join(seg_dir, n)) for n in sorted(os.listdir(seg_dir))]


def test_two_stores_roll_segments_at_their_own_size(tmp_path, monkeypatch):
    """Interleaved saves of a block each: the store opened with 8 KiB segments seals one once it holds 8 KiB
    and begins the next, the one opened with the knobs' size (which then change under it) keeps one."""
    small = cnrstore.open(tmp_path / "small", create=True, options=cnrstore.Options(segment_bytes=8 << 10))
    default = cnrstore.open(tmp_path / "default", create=True)
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 1024)  # after open: neither store sees it
    with small, default:
        assert small.options.segment_bytes == 8 << 10 and default.options.segment_bytes == 256 << 20
        for store in (small, default):
            store.create_table("t", 4096, 4, codec="fp32", block_rows=64)  # 1 KiB a block
        for v in range(30):
            for store in (small, default):
                with store.checkpoint(step=v) as ck:
                    ck.put_rows("t", np.arange(64) + 64 * v, rand(64, 4, seed=v))
        *sealed, _active = _segment_sizes(small)
        assert len(sealed) >= 3
        assert all(8 << 10 <= size < 10 << 10 for size in sealed), sealed  # each sealed once past 8 KiB
        assert len(_segment_sizes(default)) == 1
        for store in (small, default):
            assert np.array_equal(store.read_rows("t", np.arange(64) + 64 * 29), rand(64, 4, seed=29))


def test_two_stores_bound_their_read_chains_on_the_save_path_by_their_own_options(tmp_path):
    """A store with a read-chain bound of 3 (cost bound and merges off) merges on the save path; the store
    beside it with none writes plain increments, its chains one record longer each save."""
    bounded = cnrstore.open(tmp_path / "bounded", create=True, options=cnrstore.Options(
        read_chain_bound=3, read_amp_bound=None, merge_trigger=None))
    plain = cnrstore.open(tmp_path / "plain", create=True, options=cnrstore.Options(read_chain_bound=None))
    with bounded, plain:
        for store in (bounded, plain):
            store.create_table("emb", 256, 8, codec="fp32", block_rows=64)
            with store.checkpoint() as ck:
                ck.put_rows("emb", np.arange(256), rand(256))
        chains = {id(bounded): [], id(plain): []}
        for i in range(6):
            for store in (bounded, plain):
                with store.checkpoint() as ck:
                    ck.put_rows("emb", [3 + i, 70], rand(2, seed=i))
                chains[id(store)].append(store.stats()["max_read_chain"])
        assert chains[id(bounded)] == [2, 3, 3, 3, 3, 3]
        assert chains[id(plain)] == [2, 3, 4, 5, 6, 7]
        for store in (bounded, plain):
            assert np.array_equal(store.read_rows("emb", [8, 70]), rand(2, seed=5))


def test_two_stores_merge_in_the_background_by_their_own_trigger(tmp_path):
    """Both stores run background compaction; only the one whose merge trigger is set merges (the other's
    chains stay within its hard bound, so its saves never merge either)."""
    costless = dict(read_record_cost_s=0.0, read_amp_bound=2.0)
    merging = cnrstore.open(tmp_path / "merging", create=True, compaction="auto",
                            options=cnrstore.Options(merge_trigger=1.3, **costless))
    still = cnrstore.open(tmp_path / "still", create=True, compaction="auto",
                          options=cnrstore.Options(merge_trigger=None, **costless))
    rng = np.random.default_rng(0)
    with merging, still:
        for store in (merging, still):
            store.create_table("t", 1024, 8, codec="fp32", block_rows=64)
            with store.checkpoint() as ck:
                ck.put_rows("t", np.arange(1024), rand(1024))
        for i in range(8):
            rows = np.sort(rng.choice(1024, 48, replace=False))
            for store in (merging, still):
                with store.checkpoint() as ck:
                    ck.put_rows("t", rows, rand(48, seed=i))
                assert store.wait_for_compaction(60)
        assert merging.stats()["merge_bytes"] > 0 and merging._compactor.merges
        assert still.stats()["merge_bytes"] == 0 and not still._compactor.merges
        assert merging.read_amplification()["t"].max() <= 2.0
        assert np.array_equal(merging.read_table("t"), still.read_table("t"))


def test_auto_compaction_follows_the_stores_read_chain_bound(tmp_path):
    """``compaction="auto"`` materializes in the background only where the store's writer does not bound
    read chains (``CompactionPolicy`` ``default_materialize``)."""
    with cnrstore.open(tmp_path / "a", create=True, compaction="auto") as bounded:
        assert bounded._compactor.policy.materialize is None
    with cnrstore.open(tmp_path / "b", create=True, compaction="auto",
                       options=cnrstore.Options(read_chain_bound=None)) as unbounded:
        assert isinstance(unbounded._compactor.policy.materialize, IntermittentRule)


def test_a_readonly_store_takes_options_of_its_own(tmp_path):
    """``open(readonly=True, options=...)``: the reader's options (decode threads, the inline bound, the
    mapped-page release) are its own, whatever the writer beside it was opened with."""
    path = tmp_path / "s"
    writer = cnrstore.open(path, create=True, options=cnrstore.Options(segment_bytes=4096))
    with writer:
        writer.create_table("t", 512, 4, codec="fp32", block_rows=64)
        with writer.checkpoint() as ck:
            ck.put_rows("t", np.arange(512), rand(512, 4))
        reading = cnrstore.Options(decode_threads=2, decode_inline_bytes=0, mapped_read_release_bytes=1024)
        with cnrstore.open(path, readonly=True, options=reading) as ro:
            assert ro.options is reading and ro.readonly
            assert np.array_equal(ro.read_table("t"), rand(512, 4))
            with pytest.raises(AttributeError):
                ro.options = cnrstore.Options()
        assert writer.options.segment_bytes == 4096 and writer.options.decode_threads == knobs.DECODE_THREADS
    with cnrstore.open(path, readonly=True) as ro:
        assert ro.options == cnrstore.Options()
