"""Planned reads' requests (cnrstore/engine/range_fetch.py): how ``coalesce`` turns a read's records into requests,
and what ``Fetcher`` promises: the bytes asked for, at most so many requests at once, at most so many bytes held,
a failure raised by the read that needs it, nothing issued after ``close``."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cnrstore.engine.range_fetch import ByteRange, Fetcher, coalesce
from cnrstore.errors import RemoteStorageError


def _segments(n_segments=3, size=1 << 16, seed=0) -> dict[int, bytes]:
    rng = np.random.default_rng(seed)
    return {seg: rng.integers(0, 256, size, dtype=np.uint8).tobytes() for seg in range(1, n_segments + 1)}


class SlowGets:
    """``fetch`` (range_fetch.FetchInto) over ``data``: each request lands in two halves, ``delay`` s apart, and
    counts how many run at once; ``fail``: (segment, start) of requests that fail after their first half."""

    def __init__(self, data: dict[int, bytes], delay=0.01, fail: set | None = None):
        self.data, self.delay, self.fail = data, delay, fail or set()
        self.lock = threading.Lock()
        self.running = self.peak = 0
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, seg, start, buffer, arrived):
        end = start + len(buffer)
        with self.lock:
            self.calls.append((seg, start, end))
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            data = self.data[seg][start:end]
            half = len(data) // 2
            buffer[:half] = data[:half]
            arrived(half)
            time.sleep(self.delay)
            if (seg, start) in self.fail:
                raise RemoteStorageError(f"reading segment {seg} at {start}: 503 SlowDown past the retries")
            buffer[half:len(data)] = data[half:]
            arrived(len(data))
            return len(data)
        finally:
            with self.lock:
                self.running -= 1


def _records(n=40, seg_count=3, length=1000, spacing=1200) -> list[ByteRange]:
    """``n`` records spread over segments, in an interleaved read order."""
    return [ByteRange(1 + i % seg_count, 64 + (i // seg_count) * spacing, length) for i in range(n)]


# -- coalesce -----------------------------------------------------------------------------------------

ranges_strategy = st.lists(st.tuples(st.integers(1, 3), st.integers(0, 5000), st.integers(1, 300)), max_size=60)


@given(ranges_strategy, st.integers(0, 400), st.integers(1, 3000))
@example([(1, 0, 3), (1, 232, 1), (1, 462, 1)], 229, 231)  # (a cut 230 bytes past a request's start: a mark passed)
def test_every_range_lies_in_one_request_of_its_segment_within_the_bounds(raw, gap, most):
    ranges = [ByteRange(*r) for r in raw]
    requests = coalesce(ranges, gap, most)
    assert sum(r.records for r in requests) == len(ranges)
    assert [r.first for r in requests] == sorted(r.first for r in requests), "issued in the order of first use"
    longest = max((r.length for r in ranges), default=0)
    for req in requests:
        assert req.end - req.start <= most + longest, "a request passes its size by at most one range"
        mine = [(i, r) for i, r in enumerate(ranges)
                if r.segment == req.segment and req.start <= r.offset and r.offset + r.length <= req.end]
        assert mine, "a request holds at least one range"
        assert req.start == min(r.offset for _i, r in mine) and req.end == max(r.offset + r.length for _i, r in mine)
    for i, r in enumerate(ranges):
        holders = [q for q in requests if q.segment == r.segment and q.start <= r.offset
                   and r.offset + r.length <= q.end]
        assert holders, f"range {r} is in no request"
        assert any(q.first <= i <= q.last for q in holders)
    # between two requests of a segment lies a gap past ``gap`` (a new run) or a cut at a multiple of ``most`` past
    # the run's start: never a merge left undone
    by_seg: dict[int, list] = {}
    for q in requests:
        by_seg.setdefault(q.segment, []).append(q)
    for group in by_seg.values():
        group.sort(key=lambda q: q.start)
        run = group[0].start
        for a, b in zip(group, group[1:]):
            if b.start - a.end > gap:
                run = b.start
                continue
            assert (b.start - run) // most > (a.start - run) // most or b.start < a.end, (a, b, run)


def test_near_records_merge_and_far_ones_do_not():
    ranges = [ByteRange(1, 100, 50), ByteRange(2, 0, 10), ByteRange(1, 160, 40), ByteRange(1, 1000, 10)]
    assert coalesce(ranges, gap=10, most=1 << 20) == [(1, 100, 200, 0, 2, 2), (2, 0, 10, 1, 1, 1),
                                                      (1, 1000, 1010, 3, 3, 1)]
    assert coalesce(ranges, gap=0, most=1 << 20)[0] == (1, 100, 150, 0, 0, 1)
    assert coalesce(ranges, gap=10_000, most=100)[0] == (1, 100, 200, 0, 2, 2), "cut where a record starts past it"


# -- Fetcher --------------------------------------------------------------------------------------------

def test_reads_get_exactly_their_bytes_and_requests_are_fewer_than_records():
    data = _segments()
    ranges = _records()
    requests = coalesce(ranges, gap=400, most=1 << 20)
    assert len(requests) == 3 < len(ranges)
    gets = SlowGets(data, delay=0)
    fetcher = Fetcher(requests, ranges, gets, concurrency=2, window_bytes=None)
    try:
        for r in ranges:
            view = fetcher.read(r.segment, r.offset, r.length)
            assert not view.flags.writeable
            assert view.tobytes() == data[r.segment][r.offset:r.offset + r.length]
        assert fetcher.read(1, 0, 10) is None, "a range no request holds is not the fetcher's"
    finally:
        fetcher.close()
    assert sorted(gets.calls) == sorted((q.segment, q.start, q.end) for q in requests)


def test_a_record_is_served_as_soon_as_its_bytes_have_landed():
    data = _segments(1)
    ranges = [ByteRange(1, 0, 1000), ByteRange(1, 1000, 1000)]  # one request; its first half lands at once
    requests = coalesce(ranges, gap=0, most=1 << 20)
    assert len(requests) == 1
    fetcher = Fetcher(requests, ranges, SlowGets(data, delay=0.5), concurrency=1, window_bytes=None)
    try:
        t0 = time.monotonic()
        assert fetcher.read(1, 0, 1000).tobytes() == data[1][:1000]
        assert time.monotonic() - t0 < 0.25, "waited for the whole request"
        assert fetcher.read(1, 1000, 1000).tobytes() == data[1][1000:2000]
        assert time.monotonic() - t0 >= 0.45
    finally:
        fetcher.close()


def test_at_most_the_given_number_of_requests_is_in_flight():
    data = _segments(4)
    ranges = _records(n=48, seg_count=4)
    requests = coalesce(ranges, gap=0, most=1 << 20)  # a request per record
    gets = SlowGets(data, delay=0.01)
    fetcher = Fetcher(requests, ranges, gets, concurrency=3, window_bytes=None)
    try:
        for r in ranges:
            fetcher.read(r.segment, r.offset, r.length)
    finally:
        fetcher.close()
    assert gets.peak == fetcher.peak_in_flight == 3, (gets.peak, fetcher.peak_in_flight)


def test_the_bytes_held_stay_within_the_window_while_the_reader_lets_go():
    data = _segments(2)
    ranges = _records(n=40, seg_count=2)
    requests = coalesce(ranges, gap=0, most=1 << 20)
    window = 4 * 1000
    fetcher = Fetcher(requests, ranges, SlowGets(data, delay=0.002), concurrency=8, window_bytes=window)
    try:
        for r in ranges:
            view = fetcher.read(r.segment, r.offset, r.length)
            assert view.tobytes() == data[r.segment][r.offset:r.offset + r.length]
            del view  # (decoded: the reader lets go of it)
    finally:
        fetcher.close()
    assert fetcher.peak_held <= window, fetcher.peak_held
    assert fetcher.peak_in_flight <= 4


def test_a_read_waiting_on_a_request_gets_it_whatever_the_window():
    data = _segments(1)
    ranges = [ByteRange(1, 0, 3000), ByteRange(1, 10_000, 3000)]
    requests = coalesce(ranges, gap=0, most=1 << 20)
    fetcher = Fetcher(requests, ranges, SlowGets(data, delay=0), concurrency=4, window_bytes=1000)
    try:
        held = [fetcher.read(r.segment, r.offset, r.length) for r in ranges]  # the reader keeps both
        assert [v.tobytes() for v in held] == [data[1][0:3000], data[1][10_000:13_000]]
    finally:
        fetcher.close()


def test_a_failed_request_is_raised_by_the_read_that_needs_it_and_by_none_other():
    data = _segments(2)
    ranges = _records(n=10, seg_count=2)
    requests = coalesce(ranges, gap=0, most=1 << 20)
    bad = ranges[5]
    fetcher = Fetcher(requests, ranges, SlowGets(data, delay=0, fail={(bad.segment, bad.offset)}),
                      concurrency=4, window_bytes=None)
    try:
        for r in ranges:
            if r == bad:
                with pytest.raises(RemoteStorageError, match="503"):
                    fetcher.read(r.segment, r.offset, r.length)
            else:
                assert fetcher.read(r.segment, r.offset, r.length).tobytes() == \
                    data[r.segment][r.offset:r.offset + r.length]
    finally:
        fetcher.close()


def test_close_issues_nothing_more():
    data = _segments(2)
    ranges = _records(n=30, seg_count=2)
    requests = coalesce(ranges, gap=0, most=1 << 20)
    gets = SlowGets(data, delay=0.02)
    fetcher = Fetcher(requests, ranges, gets, concurrency=2, window_bytes=None)
    fetcher.read(ranges[0].segment, ranges[0].offset, ranges[0].length)
    fetcher.close()
    issued = len(gets.calls)
    time.sleep(0.05)
    assert len(gets.calls) == issued < len(requests)
    assert fetcher.read(ranges[-1].segment, ranges[-1].offset, ranges[-1].length) is None, "read the usual way"


def test_a_request_whose_reads_the_reader_went_past_is_never_issued():
    data = _segments(1)
    ranges = [ByteRange(1, i * 2000, 1000) for i in range(6)]
    requests = coalesce(ranges, gap=0, most=1 << 20)
    gets = SlowGets(data, delay=0)
    fetcher = Fetcher(requests, ranges, gets, concurrency=1, window_bytes=1000)  # one at a time, one ahead
    try:
        fetcher.read(1, 0, 1000)
        fetcher.read(1, 10_000, 1000)  # the reader skipped four records (found its rows sooner)
    finally:
        fetcher.close()
    assert (1, 6000, 7000) not in gets.calls and (1, 8000, 9000) not in gets.calls, gets.calls
