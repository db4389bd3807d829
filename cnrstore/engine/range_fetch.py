"""Planned reads of segments that live elsewhere: the byte ranges a read will need, known before it starts,
coalesced into requests and fetched concurrently ahead of it (docs/DESIGN.md, "The remote tier", "Planned
reads").

A whole-version read (``table_decode.read_tables``) knows every record it will fetch from the index alone
(``reader.plan_reads``), in the order it will fetch them. ``coalesce`` turns that list into requests;
``Fetcher`` issues them, a bounded number at a time, and hands the read each record from what has arrived
while the rest are in flight. The storage seam's ``prefetch`` (storage.py) is where a storage whose
segments are remote (remote.py) puts one in front of its reads; a record the plan did not name, or whose
request failed to come back whole, is read the usual way (or raises, below), so a plan that is wrong costs
time, never a wrong byte: every record is still parsed and checksummed by ``storage.fetch``.

The bounds, where the read's options (``cnrstore.Options``) set them:

- **requests**: at most ``remote_read_requests`` at once (a thread each: the object store's client is
  thread-safe and gives every request its deadline and its typed errors), each streamed into a buffer of its
  own (``ObjectStore.read_into``), so that a record is read as soon as its bytes have landed;
- **request size**: the records of one segment whose gaps are at most ``remote_read_gap_bytes`` form one
  run, cut into requests every ``remote_read_request_bytes`` from its start, at the records' starts: a
  request passes that size by at most one record;
- **memory**: with a window, the bytes of the requests issued and not yet freed -- in flight, arrived and
  not read, or read and still referenced by what the caller was handed -- stay within
  ``remote_read_window_bytes``, except that a request the read is waiting for is always issued (a read
  never waits on bytes it holds itself), so the window can be passed by the requests the read has begun
  and not finished; without one (None) the read holds every record until it ends anyway (a read into the
  caller's arrays verifies every record before it writes any: its bound is the bytes it reads).
"""

from __future__ import annotations

import bisect
import collections
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple, Sequence

import numpy as np

__all__ = ["ByteRange", "Request", "coalesce", "Fetcher"]

#: ``coalesce`` keeps segments apart by placing segment number k of a plan at k << this (offsets are u32)
_SEGMENT_SHIFT = 34


class ByteRange(NamedTuple):
    """``length`` bytes at ``offset`` of segment ``segment``: one record a read will fetch."""

    segment: int
    offset: int
    length: int


class Request(NamedTuple):
    """Bytes ``[start, end)`` of segment ``segment`` in one request, holding the planned records at read
    positions ``first`` .. ``last`` (their places in the read's order) and ``records`` of them in all."""

    segment: int
    start: int
    end: int
    first: int
    last: int
    records: int


def coalesce(ranges: Sequence[ByteRange], gap: int, most: int) -> list[Request]:
    """The requests that fetch ``ranges`` (in the order a read wants them): the ranges of one segment in
    offset order form a run while each starts at most ``gap`` bytes past the furthest end before it, and a
    run is cut into requests every ``most`` bytes from its start (a range belongs to the request its start
    falls in: a request is at most ``most`` plus one range long). Requests are ordered by the first read
    position they serve. Vectorized: a few array operations whatever the number of ranges."""
    n = len(ranges)
    if not n:
        return []
    arr = np.asarray(ranges, dtype=np.int64).reshape(n, 3)
    segs, offsets, lengths = arr[:, 0], arr[:, 1], arr[:, 2]
    order = np.lexsort((offsets, segs))
    seg, off, length, pos = segs[order], offsets[order], lengths[order], order
    rank = np.cumsum(np.r_[0, seg[1:] != seg[:-1]])  # segment number within the plan, ascending
    start = (rank << _SEGMENT_SHIFT) + off  # one line: segments lie 2**34 bytes apart, farther than any gap
    end = start + length
    reach = np.maximum.accumulate(end)  # the furthest byte any range so far reaches
    new_run = np.r_[True, start[1:] - reach[:-1] > gap]
    run_start = start[new_run][np.cumsum(new_run) - 1]
    bucket = (start - run_start) // max(1, most)
    new_request = new_run | np.r_[False, bucket[1:] != bucket[:-1]]
    heads = np.flatnonzero(new_request)
    ends = np.maximum.reduceat(end, heads) - (rank[heads] << _SEGMENT_SHIFT)
    firsts = np.minimum.reduceat(pos, heads)
    lasts = np.maximum.reduceat(pos, heads)
    counts = np.diff(np.r_[heads, n])
    out = [Request(*fields) for fields in zip(seg[heads].tolist(), off[heads].tolist(), ends.tolist(),
                                              firsts.tolist(), lasts.tolist(), counts.tolist())]
    out.sort(key=lambda r: r.first)
    return out


# states of a request in a Fetcher
_PENDING, _FLIGHT, _DONE, _FAILED, _GONE = range(5)

#: ``fetch(segment, start, buffer, arrived) -> bytes fetched``: bytes ``[start, start + len(buffer))`` of a
#: segment into ``buffer`` (a writable memoryview), in order, ``arrived(count so far)`` called as they land; fewer
#: than ``len(buffer)`` if the object ends first (``ObjectStore.read_into``)
FetchInto = Callable[[int, int, memoryview, Callable[[int], None]], int]


class _Slot:
    """A request and what became of it (guarded by its Fetcher's condition): its buffer, and how many of its
    bytes have landed there (``filled``), in order."""

    __slots__ = ("request", "state", "buffer", "filled", "awaited", "error", "wanted", "__weakref__")

    def __init__(self, request: Request):
        self.request = request
        self.state = _PENDING
        self.buffer: np.ndarray | None = None
        self.filled = 0
        self.awaited = 0  # the count of bytes a reader waits to have landed (0: none waits)
        self.error: BaseException | None = None
        self.wanted = False


class Fetcher:
    """Issues ``requests`` (``coalesce``'s) through ``fetch`` (``FetchInto``) on ``concurrency`` threads, ahead of a
    reader that asks for the planned ranges (``ranges``: in the order it will ask) with ``read``, which is served
    as soon as a range's bytes have landed, while the rest of its request is still arriving. ``window_bytes``
    bounds the bytes it holds (module docstring; None: no bound). ``close`` ends it: requests not issued never
    are. Thread-safe; the reader's positions assume one thread reads in the planned order (another thread's
    reads are served too, at no cost to the order)."""

    def __init__(self, requests: Sequence[Request], ranges: Sequence[ByteRange], fetch: FetchInto, *,
                 concurrency: int, window_bytes: int | None):
        self._fetch_into = fetch
        self._concurrency = max(1, concurrency)
        self._window = window_bytes
        self._cond = threading.Condition(threading.RLock())  # (a freed buffer's finalizer may run under it)
        slots = [_Slot(r) for r in requests]
        self._pending = collections.deque(slots)
        by_segment: dict[int, list[_Slot]] = {}
        for slot in sorted(slots, key=lambda s: (s.request.segment, s.request.start)):
            by_segment.setdefault(slot.request.segment, []).append(slot)
        self._by_segment = {seg: ([s.request.start for s in group], group) for seg, group in by_segment.items()}
        self._positions: dict[tuple[int, int], int] = {}
        for i, r in enumerate(ranges):
            self._positions.setdefault((r.segment, r.offset), i)
        self._issued: list[_Slot] = []  # holding a buffer: in flight or done
        self._in_flight = 0
        self._held = 0
        self._cursor = -1
        self._closed = False
        #: the most bytes held at once, and the most requests in flight at once (for tests and reports)
        self.peak_held = 0
        self.peak_in_flight = 0
        self._pool = ThreadPoolExecutor(self._concurrency, thread_name_prefix="cnrstore-fetch")
        with self._cond:
            self._pump()

    def _find(self, seg: int, offset: int, length: int) -> _Slot | None:
        found = self._by_segment.get(seg)
        if found is None:
            return None
        starts, group = found
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0 or offset + length > group[i].request.end:
            return None
        return group[i]

    def read(self, seg: int, offset: int, length: int) -> np.ndarray | None:
        """The bytes ``[offset, offset + length)`` of segment ``seg`` from its request, once they have landed
        (waiting for them; the request is issued now if it was not yet): a read-only view, shorter than
        ``length`` if the object ended first. None if no request holds them (not planned, or dropped: read
        them the usual way). Raises what fetching its request raised, if that stopped it short of them."""
        slot = self._find(seg, offset, length)
        if slot is None:
            return None
        end = offset + length - slot.request.start
        with self._cond:
            if slot.state == _PENDING:
                slot.wanted = True
                self._pending.remove(slot)
                self._pending.appendleft(slot)  # next in line, whatever the window
                self._pump()
            while (slot.state == _PENDING or (slot.state == _FLIGHT and slot.filled < end)) and not self._closed:
                slot.awaited = end
                self._cond.wait()
            slot.awaited = 0
            buf = slot.buffer
            if buf is None:
                return None
            if slot.state == _FAILED and slot.filled < end:
                raise slot.error
            lo = offset - slot.request.start
            view = buf[lo : min(end, slot.filled)]
            view.flags.writeable = False
            position = self._positions.get((seg, offset))
            if position is not None and position > self._cursor:
                self._cursor = position
                self._release_passed()
        return view

    def _release_passed(self) -> None:
        """Let go of the requests whose every planned read is at or before the cursor (the views the reader was
        handed keep their bytes alive until it drops them); pending ones the read went past are never issued."""
        for slot in [s for s in self._issued if s.request.last <= self._cursor]:
            self._issued.remove(slot)
            slot.buffer = None  # (may free it here: _freed takes the lock again)
            if slot.state != _FLIGHT:
                slot.state = _GONE
        self._pump()

    def _pump(self) -> None:
        """Issue pending requests in order while a lane is free and the window allows (the condition is held)."""
        while self._pending and self._in_flight < self._concurrency and not self._closed:
            slot = self._pending[0]
            request = slot.request
            if request.last <= self._cursor and not slot.wanted:
                self._pending.popleft()  # every read it was for is past: never needed
                slot.state = _GONE
                continue
            size = request.end - request.start
            if (self._window is not None and self._held and self._held + size > self._window
                    and not slot.wanted):
                return
            self._pending.popleft()
            slot.state = _FLIGHT
            slot.buffer = np.empty(size, dtype=np.uint8)
            weakref.finalize(slot.buffer, self._freed, size).atexit = False
            self._issued.append(slot)
            self._in_flight += 1
            self._held += size
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            self.peak_held = max(self.peak_held, self._held)
            self._pool.submit(self._fetch, slot, slot.buffer)

    def _fetch(self, slot: _Slot, buf: np.ndarray) -> None:
        request = slot.request

        def arrived(count: int) -> None:  # (on the client's thread, as bytes land: wake a reader once they are its)
            with self._cond:
                slot.filled = count
                if slot.awaited and count >= slot.awaited:
                    self._cond.notify_all()

        try:
            count = self._fetch_into(request.segment, request.start, memoryview(buf), arrived)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader that waits for it
            with self._cond:
                slot.state, slot.error = _FAILED, exc
                self._in_flight -= 1
                self._pump()
                self._cond.notify_all()
            return
        with self._cond:
            slot.filled = count
            slot.state = _DONE if slot.buffer is not None else _GONE
            self._in_flight -= 1
            self._pump()
            self._cond.notify_all()

    def _freed(self, size: int) -> None:
        """A request's buffer was freed (no view of it is left)."""
        with self._cond:
            self._held -= size
            self._pump()
            self._cond.notify_all()

    def held_bytes(self) -> int:
        """Bytes of the requests' buffers not yet freed."""
        with self._cond:
            return self._held

    def close(self, *, wait: bool = True) -> None:
        """No more requests: those not issued never are, and the buffers are let go (views handed out stay
        valid). ``wait``: until the requests in flight have ended (each within its deadline)."""
        with self._cond:
            self._closed = True
            for slot in self._pending:
                slot.state = _GONE
            self._pending.clear()
            issued, self._issued = self._issued, []
            for slot in issued:
                slot.buffer = None
            self._cond.notify_all()
        self._pool.shutdown(wait=wait, cancel_futures=True)
