"""The conformance suite of the segment storage seam (cnrstore/engine/storage.py, ``SegmentStorage``), in the
style of zarr v3's ``zarr/testing/store.py`` ``StoreTests``: ``StorageTests`` states the seam's contract as the
engine relies on it, and each implementation runs it through a subclass (tests/test_storage_conformance.py)
that provides the ``storage`` fixture: an empty storage (no segments yet) whose segments directory exists.

A subclass may also override the hooks:

- ``writer(storage)``: the storage that appends the segments a test reads (default ``storage``; a storage
  without appends reads what another one wrote into the same place);
- ``committed(storage, lengths)``: ``lengths`` ({segment: length}) were committed and their segments sealed,
  as an index commit would record them (a remote storage makes its copy point here, uploading and evicting
  the local copies, so that the reads that follow go to the object store).

Every test takes the ``storage`` fixture alone, so that a test may also call one directly on a storage that
breaks it (tests/test_storage_conformance.py does, to show that each test can fail).
"""

from __future__ import annotations

import contextlib

import threading

import numpy as np
import pytest

from cnrstore.engine.marker import FORMAT_VERSION
from cnrstore.engine.range_fetch import ByteRange
from cnrstore.engine.segments import SEGMENT_HEADER_BYTES, SegmentAppender, SegmentIds, segment_header
from cnrstore.errors import CorruptionError, ReadOnlyError

#: a segment id no test writes
MISSING = 0xBEEF


def payloads(seed: int, sizes) -> list[bytes]:
    """Random records' worth of bytes, one of each size."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]


class Written(dict):
    """{segment: [(offset, payload)]} of what ``StorageTests.write`` appended, with ``whole(seg)``: the segment's
    bytes as stored (its header, then the payloads)."""

    def whole(self, seg: int) -> bytes:
        return segment_header(seg, FORMAT_VERSION) + b"".join(p for _off, p in self[seg])


class StorageTests:
    """The seam's contract. Not collected itself (no ``Test`` prefix); a subclass named ``Test...`` provides
    the ``storage`` fixture and runs every test below against its implementation."""

    @pytest.fixture
    def storage(self):
        raise NotImplementedError("a subclass provides the storage under test")

    # hooks -------------------------------------------------------------------------------------------
    def writer(self, storage):
        """The storage that appends the segments ``storage``'s tests read."""
        return storage

    def committed(self, storage, lengths: dict[int, int]) -> None:
        """``lengths`` were committed and their segments sealed (an index commit)."""

    def removal_pending(self, storage, seg: int) -> None:
        """For a storage whose removals are not at once (``removes_at_once`` False): check what it states of
        ``seg`` between ``remove`` + ``sync_removals`` and the copy point that deletes the copy kept elsewhere.
        The base class has no such storage to check against."""
        raise AssertionError(f"{type(storage).__name__} keeps removed segments: its suite must say how")

    def local_bytes(self, storage, written, sizes: int) -> int:
        """The bytes of ``written``'s segments stored on this machine's disk (``sizes``: all of them)."""
        return sizes

    # helpers -----------------------------------------------------------------------------------------
    def appender(self, storage, first: int = 1) -> SegmentAppender:
        """A fresh appender of ``storage`` handing out segment ids from ``first``, a new segment first."""
        return storage.appender({}, FORMAT_VERSION, SegmentIds(first), active=None, on_sealed=storage.sealed)

    def write(self, storage, segments: list[list[bytes]], first: int = 1) -> Written:
        """Each list of payloads appended into a segment of its own (ids from ``first``), synced, committed
        and sealed (``committed`` told)."""
        target = self.writer(storage)
        app = self.appender(target, first)
        out = Written()
        lengths = {}
        try:
            for records in segments:
                locs = app.append_many([([p], len(p)) for p in records])
                (seg,) = {s for s, _off in locs}
                out[seg] = [(off, p) for (_s, off), p in zip(locs, records)]
                synced = app.sync()
                app.mark_committed(synced)
                app.seal()
                lengths.update(synced)
        finally:
            app.close()
        assert lengths == {seg: len(out.whole(seg)) for seg in out}, "the appender's own lengths"
        self.committed(storage, lengths)
        return out

    def needs_appends(self, storage) -> None:
        if not storage.supports_appends:
            pytest.skip(f"{type(storage).__name__} takes no appends")

    # the contract ------------------------------------------------------------------------------------
    def test_appended_bytes_read_back_exactly(self, storage):
        written = self.write(storage, [payloads(1, [100, 1, 4000]), payloads(2, [7, 300])])
        assert len(written) == 2
        for seg, records in written.items():
            for off, payload in records:
                view = storage.read(seg, off, len(payload))
                assert isinstance(view, np.ndarray) and view.dtype == np.uint8 and view.shape == (len(payload),)
                assert not view.flags.writeable, "reads hand out read-only views"
                assert view.tobytes() == payload, f"segment {seg} at {off}"
            whole = written.whole(seg)
            assert storage.read(seg, 0, len(whole)).tobytes() == whole
            assert storage.read(seg, len(whole) - 1, 1).tobytes() == whole[-1:]

    def test_read_of_a_missing_segment_raises_corruption_error(self, storage):
        self.write(storage, [payloads(3, [64, 64])])
        with pytest.raises(CorruptionError) as missing:
            storage.read(MISSING, 0, SEGMENT_HEADER_BYTES)
        assert missing.value.path == storage.path(MISSING), "the error names where the segment would be"

    def test_read_past_the_end_raises_corruption_error(self, storage):
        written = self.write(storage, [payloads(3, [64, 64])])
        (seg,) = written
        size = len(written.whole(seg))
        for offset, length in ((size - 8, 16), (size, 1), (size + 100, 10)):
            with pytest.raises(CorruptionError):
                storage.read(seg, offset, length)
        assert storage.read(seg, size - 8, 8).tobytes() == written.whole(seg)[-8:], "still readable after"

    def test_size_is_none_for_a_missing_segment_and_the_stored_length_otherwise(self, storage):
        assert storage.size(1) is None and storage.size(MISSING) is None
        written = self.write(storage, [payloads(4, [10]), payloads(5, [1000, 20])])
        for seg in written:
            assert storage.size(seg) == len(written.whole(seg))
        assert storage.size(MISSING) is None

    def test_list_is_ascending_and_exactly_the_stored_ids(self, storage):
        assert storage.list() == []
        high = self.write(storage, [payloads(6, [50])], first=9)
        low = self.write(storage, [payloads(7, [50]), payloads(8, [50])], first=3)  # written after a higher id
        assert sorted(high) == [9] and sorted(low) == [3, 4]
        assert storage.list() == [3, 4, 9]

    def test_remove_then_sync_removals_makes_it_gone(self, storage):
        written = self.write(storage, [payloads(9, [80]), payloads(10, [90])])
        gone, kept = sorted(written)
        storage.remove(gone)
        storage.sync_removals()
        if not storage.removes_at_once:  # (the copy kept elsewhere stays until a later copy point)
            self.removal_pending(storage, gone)
            return
        assert storage.size(gone) is None
        assert storage.list() == [kept]
        with pytest.raises(CorruptionError):
            storage.read(gone, 0, SEGMENT_HEADER_BYTES)
        off, payload = written[kept][0]
        assert storage.read(kept, off, len(payload)).tobytes() == payload, "the other segment is untouched"

    def test_removing_a_segment_again_raises_file_not_found(self, storage):
        (seg,) = self.write(storage, [payloads(11, [80])])
        storage.remove(seg)
        storage.sync_removals()
        if storage.removes_at_once:
            with pytest.raises(FileNotFoundError):
                storage.remove(seg)
        with pytest.raises(FileNotFoundError):
            storage.remove(MISSING)

    def test_rollback_throws_away_uncommitted_appends(self, storage):
        self.needs_appends(storage)
        app = self.appender(storage)
        try:
            first, second, third = payloads(12, [200, 300, 400])
            (seg, off), = app.append_many([([first], len(first))])
            committed = app.sync()
            app.mark_committed(committed)
            length = committed[seg]
            (seg2, off2), = app.append_many([([second], len(second))])
            assert (seg2, off2) == (seg, length), "appends go on past the committed length"
            app.rollback()
            assert storage.size(seg) == length, "the uncommitted tail is gone"
            with pytest.raises(CorruptionError):
                storage.read(seg, length, len(second))
            app.seal()
            (new, _off), = app.append_many([([third], len(third))])  # in a new segment, never committed
            assert new != seg and storage.size(new) is not None
            app.rollback()
            assert storage.size(new) is None and storage.list() == [seg], "the uncommitted segment is gone"
            assert storage.read(seg, off, len(first)).tobytes() == first
        finally:
            app.close()

    def test_recover_truncates_a_torn_tail_past_the_committed_length(self, storage):
        self.needs_appends(storage)
        app = self.appender(storage)
        first, torn, leftover = payloads(13, [256, 512, 128])
        try:
            (seg, off), = app.append_many([([first], len(first))])
            committed = app.sync()
            app.mark_committed(committed)
            app.append_many([([torn], len(torn))])
            app.sync()  # durable, never committed: then the process dies
            app.seal()
            (new, _off), = app.append_many([([leftover], len(leftover))])
            app.sync()
        finally:
            app.close()
        assert storage.size(seg) == committed[seg] + len(torn) and storage.size(new) is not None
        notes = storage.recover(committed)
        assert notes, "recover says what it did"
        assert storage.size(seg) == committed[seg], "truncated to the committed length"
        assert storage.size(new) is None and storage.list() == [seg], "the leftover segment is removed"
        assert storage.read(seg, off, len(first)).tobytes() == first
        with pytest.raises(CorruptionError):
            storage.read(seg, committed[seg], len(torn))
        assert storage.recover(committed) == [], "nothing left to do"

    def test_scan_yields_the_whole_segment(self, storage):
        written = self.write(storage, [payloads(14, [333, 17]), payloads(15, [2048])])
        for seg, records in written.items():
            with storage.scan(seg) as data:
                assert bytes(data) == written.whole(seg)
                off, payload = records[-1]
                assert data.find(payload) == off, "repair finds records in it"

    def test_disk_bytes_is_at_least_the_stored_sizes(self, storage):
        written = self.write(storage, [payloads(16, [5000]), payloads(17, [3000, 3000])])
        sizes = sum(storage.size(seg) for seg in written)
        assert sizes == sum(len(written.whole(seg)) for seg in written)
        assert storage.disk_bytes() >= self.local_bytes(storage, written, sizes)

    def test_path_names_the_segment(self, storage):
        written = self.write(storage, [payloads(18, [10]), payloads(19, [10])])
        paths = {seg: storage.path(seg) for seg in [*written, MISSING]}
        for seg, path in paths.items():
            assert isinstance(path, str) and f"{seg:016x}" in path, path
        assert len(set(paths.values())) == len(paths)

    def test_concurrent_reads_of_different_ranges_give_the_right_bytes(self, storage):
        written = self.write(storage, [payloads(20 + i, [997, 1500, 31, 4096]) for i in range(3)])
        wholes = {seg: written.whole(seg) for seg in written}
        rng = np.random.default_rng(7)
        threads, reads_each = 4, 16
        plans = []
        for _ in range(threads):
            plan = []
            for _ in range(reads_each):
                seg = int(rng.choice(sorted(wholes)))
                start = int(rng.integers(0, len(wholes[seg]) - 1))
                plan.append((seg, start, int(rng.integers(1, len(wholes[seg]) - start + 1))))
            plans.append(plan)
        barrier = threading.Barrier(threads)
        wrong: list = []

        def reader(plan):
            barrier.wait()
            for seg, start, length in plan:
                try:
                    got = storage.read(seg, start, length).tobytes()
                except Exception as exc:  # noqa: BLE001 - reported below
                    got = exc
                if got != wholes[seg][start:start + length]:
                    wrong.append((seg, start, length, got if isinstance(got, Exception) else len(got)))

        pool = [threading.Thread(target=reader, args=(plan,)) for plan in plans]
        for t in pool:
            t.start()
        for t in pool:
            t.join(60)
        assert not any(t.is_alive() for t in pool), "a read hung"
        assert not wrong, f"{len(wrong)} of {threads * reads_each} concurrent reads went wrong: {wrong[:3]}"

    def test_prefetched_reads_give_the_bytes_of_plain_reads(self, storage):
        """Within ``prefetch`` of a read's ranges (in the order it reads them), every read gives the bytes a
        plain read gives, of the planned ranges and of any other (a header, a range across two records); a
        range past a segment's end is CorruptionError as always; after the context, reads go on as before."""
        written = self.write(storage, [payloads(30, [300, 5, 2000, 64]), payloads(31, [1000, 10, 700])])
        wholes = {seg: written.whole(seg) for seg in written}
        planned = [ByteRange(seg, off, len(p)) for seg, records in written.items() for off, p in records]
        order = planned[1::2] + planned[::2]  # the segments' records interleaved, out of offset order
        for bounded in (True, False):
            with storage.prefetch(order, bounded=bounded):
                for seg, off, length in order:
                    view = storage.read(seg, off, length)
                    assert not view.flags.writeable
                    assert view.tobytes() == wholes[seg][off:off + length], (seg, off, length, bounded)
                seg = min(wholes)
                assert storage.read(seg, 0, 40).tobytes() == wholes[seg][:40]
                assert storage.read(seg, 10, 600).tobytes() == wholes[seg][10:610]
                with pytest.raises(CorruptionError):
                    storage.read(seg, len(wholes[seg]) - 4, 8)
        for seg, off, length in order:
            assert storage.read(seg, off, length).tobytes() == wholes[seg][off:off + length]

    def test_released_ranges_stay_readable(self, storage):
        """``release`` (a whole-table read is done with these records) may drop their pages from the resident
        set, never their bytes: views read before it, and reads after it, give the stored bytes, inside
        ``keep_pages`` (as a whole-table read calls it) and outside; ranges of segments never read are no
        error."""
        from cnrstore.options import Options

        storage.use_options(Options(mapped_read_release_bytes=0))  # (every release drops at once)
        written = self.write(storage, [payloads(40, [20000, 5, 70000, 3000]), payloads(41, [9000])])
        wholes = {seg: written.whole(seg) for seg in written}
        ranges = [ByteRange(seg, off, len(p)) for seg, records in written.items() for off, p in records]
        for keeping in (True, False):
            with storage.keep_pages() if keeping else contextlib.nullcontext():
                views = [(r, storage.read(*r)) for r in ranges]
                assert all(v.tobytes() == wholes[r.segment][r.offset:r.offset + r.length] for r, v in views)
                storage.release(ranges[:2])
                storage.release(ranges[2:] + [ByteRange(max(wholes) + 7, 0, 4096)])
                for r, view in views:
                    assert view.tobytes() == wholes[r.segment][r.offset:r.offset + r.length], (r, keeping)
                    assert storage.read(*r).tobytes() == wholes[r.segment][r.offset:r.offset + r.length]

    def test_appender_is_given_exactly_when_appends_are_supported(self, storage):
        if storage.supports_appends:
            app = self.appender(storage)
            try:
                assert isinstance(app, SegmentAppender)
            finally:
                app.close()
        else:
            with pytest.raises(ReadOnlyError, match="readonly=True"):
                self.appender(storage)
