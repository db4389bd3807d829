"""Whole-table and row-range reads decoded in parallel, on a pool of threads (the decode kernels, numpy's
and FBGEMM's, release the GIL).

A read into the caller's arrays plans every table first (each record it needs verified,
``reader.plan_table``) before any of them is written, then decodes the blocks straight into them. A read
into new arrays (``Store.read_tables`` with None, ``Store.restore``) decodes each block as soon as its records
are verified (``reader.iter_plan``): nobody sees its arrays unless it succeeds, and it holds no more of the
fetched records than the blocks being decoded need.

Either tells the storage what it is done with (``SegmentStorage.release``: each block's records, once
verified for a read into the caller's arrays and once decoded), so that a local storage drops those mapped
pages from the process's resident set as the read goes, not only at its end: a restore would otherwise hold
every byte it reads resident at once.

Before either, the storage is told every record the read will fetch, in order, from the index alone
(``fetch_ahead``: ``reader.plan_reads``, ``SegmentStorage.prefetch``): the remote tier fetches them with
concurrent, coalesced requests while the read verifies and decodes what has arrived; a local storage has
nothing to do.

This is what ``Store.read_table``, ``Store.read_tables`` and ``Store.restore`` run inside their read
transaction: the plans are views of the segments' maps, decoded before the transaction ends.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

from ..codecs.base import as_out
from ..errors import InvalidArgument
from ..options import Options
from .index import IndexView
from .range_fetch import ByteRange
from .reader import BlockPlan, decode_block, every_block_written, iter_plan, plan_reads
from .schema import TableRecord
from .storage import SegmentStorage

__all__ = ["check_out", "decode_threads", "fetch_ahead", "read_tables"]

_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}  # by size: stores of one process may ask for different sizes


def decode_threads(configured: int | None = None) -> int:
    """Threads a parallel decode uses: ``configured`` (a store's ``Options.decode_threads``), or, for
    None, every core this process may run on."""
    if configured:
        return max(1, int(configured))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _executor(threads: int) -> ThreadPoolExecutor:
    """The process's decode pool of ``threads`` workers, made on first use; shared by every store that
    decodes on that many."""
    with _pool_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="cnrstore-decode")
        return pool


def _forget_pool_after_fork() -> None:
    # a forked child has none of the parent's threads: it makes its own pools on first use
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def check_out(out, table: TableRecord, what: str, start: int | None = None) -> np.ndarray:
    """``out`` as a numpy array sharing its memory, if it is a writable C-contiguous float32 array (or CPU
    torch tensor) of the table's shape ``(num_rows, dim)``; with ``start``, of shape ``(n, dim)`` for rows
    ``start .. start + n - 1`` of the table (``0 <= start``, ``start + n <= num_rows``); else InvalidArgument
    naming the table."""
    name = f"{what} of table {table.name!r} ({table.num_rows} x {table.dim})"
    if start is None:
        return as_out(out, (table.num_rows, table.dim), name)
    shape = getattr(out, "shape", None)
    if shape is None or len(shape) != 2:
        return as_out(out, (0, table.dim), name)  # raises, saying what was expected
    n = int(shape[0])
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start <= table.num_rows - n:
        raise InvalidArgument(f"{name}: rows {start!r} .. {start!r} + {n} - 1 are not within the table's "
                              f"rows 0 .. {table.num_rows - 1}")
    return as_out(out, (n, table.dim), f"{name}, rows {start}..{int(start) + n - 1}")


def _stop(table: TableRecord, out: np.ndarray | None, start: int) -> int:
    return table.num_rows if out is None else start + out.shape[0]


def fetch_ahead(view: IndexView, segments: SegmentStorage, jobs: Sequence[tuple[TableRecord, np.ndarray | None, int]],
                version: int, *, then: Sequence = (), bounded: bool):
    """A context within which ``segments`` may fetch ahead (``SegmentStorage.prefetch``) every record that
    ``read_tables(view, segments, jobs, version, ...)`` will read, in its order (``reader.plan_reads``), and
    then the records at the index locations ``then`` (a caller's next reads on this thread, such as
    ``Store.restore``'s dense arrays). ``bounded``: the reads let go of the records as they decode them
    (a read into new arrays), so the storage may bound what it holds ahead."""
    ranges = [ByteRange(loc.segment, loc.offset, loc.length) for table, out, start in jobs
              for loc in plan_reads(view, table, version, start, _stop(table, out, start))]
    ranges += [ByteRange(loc.segment, loc.offset, loc.length) for loc in then]
    return segments.prefetch(ranges, bounded=bounded)


def read_tables(view: IndexView, segments: SegmentStorage, jobs: Sequence[tuple[TableRecord, np.ndarray | None, int]],
                version: int, progress: Callable[[int, int], None] | None = None, *,
                options: Options, fetched: bool = False) -> list[np.ndarray]:
    """Each job of ``jobs`` ((table, destination, first row)) as of ``version``: rows ``first .. first +
    len(destination) - 1`` of the table decoded into its destination (checked with :func:`check_out` by the
    caller), or, for a destination None (first row 0), the whole table into a new array; in ``jobs`` order.

    With a destination given, every job is planned first, so every record the read needs is verified (and
    every row found) before any destination is written: a CorruptionError or MissingRows leaves them all
    untouched. With none (every destination new), each block is decoded as soon as its records are
    verified, and an error leaves nothing behind (the new arrays are dropped); but where the index shows a
    block never written, the read is planned first, so that it raises MissingRows before it allocates. The blocks are decoded on
    ``options.decode_threads`` threads (the store's Options; :func:`decode_threads`), on this one under
    ``options.decode_inline_bytes`` of destinations; an error there (none is expected once the records are
    verified, short of running out of memory) is raised after every block has finished.

    The storage fetches the read's records ahead of it (:func:`fetch_ahead`) unless ``fetched`` says the
    caller opened that context already.

    ``progress(done, total)``, if given, is called on this thread as blocks are decoded: fp32 bytes of the
    destinations decoded so far, of their total (once with 0 before the first block, last with ``total``).
    """
    # new arrays are decoded block by block, unless the index shows rows missing (a block never written): that
    # read raises MissingRows, and must do so before it allocates any output (a sparse table of 2^31 rows)
    streamed = all(out is None for _table, out, _start in jobs) and all(
        every_block_written(view, table, version, start) for table, _out, start in jobs)
    # a whole-table read maps much of the store: it lets go of each block's records once it has verified them
    # (a read into given arrays: they fault in again when decoded) and once it has decoded them
    # (``SegmentStorage.release``), rather than by the count of bytes read, and drops every page at its end
    with segments.keep_pages(), (contextlib.nullcontext() if fetched
                                 else fetch_ahead(view, segments, jobs, version, bounded=streamed)):
        if streamed:
            return _stream_tables(view, segments, jobs, version, progress, options)
        return _read_tables(view, segments, jobs, version, progress, options)


def _planned(view, segments, table, version, start, stop) -> list[BlockPlan]:
    """``plan_table``, letting go of each block's records once verified: every record of a read into given
    arrays is verified before any is decoded, so keeping them all mapped meanwhile would hold the read's
    every byte in the resident set (the pages fault in again from the page cache when decoded)."""
    blocks = []
    for block in iter_plan(view, segments, table, version, start, stop):
        segments.release(block.ranges)
        blocks.append(block)
    return blocks


def _decode(segments, out: np.ndarray, base: int, block: BlockPlan, dim: int) -> None:
    """``decode_block`` of ``block`` into ``out`` from row ``base``, then its records let go of."""
    decode_block(out, base, block.pieces, dim)
    segments.release(block.ranges)


def _read_tables(view, segments, jobs, version, progress, options: Options) -> list[np.ndarray]:
    plans = [_planned(view, segments, table, version, start, _stop(table, out, start)) for table, out, start in jobs]
    outs = [np.empty((t.num_rows, t.dim), dtype=np.float32) if out is None else out for t, out, _start in jobs]
    tasks = [(segments, out, block.offset, block, table.dim)
             for (table, _, _), out, blocks in zip(jobs, outs, plans) for block in blocks]
    total, done = sum(out.nbytes for out in outs), 0
    if progress is not None:
        progress(0, total)
    workers = decode_threads(options.decode_threads)
    if min(workers, len(tasks)) <= 1 or total < options.decode_inline_bytes:
        _decode_inline(tasks, progress, total)
        return outs
    # the biggest blocks first, so that the pool does not end waiting on one large block
    tasks.sort(key=lambda task: -_task_bytes(task))
    pool = _executor(workers)
    futures = {pool.submit(_decode, *task): task for task in tasks}
    try:
        if progress is not None:
            for future in as_completed(futures):
                done += _task_bytes(futures[future])
                progress(done, total)
    finally:  # even when progress raises (Ctrl-C): no block may still write afterwards
        errors = [f.exception() for f in futures]  # waits for every block
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return outs


def _decode_inline(tasks, progress, total: int) -> None:
    """Decode ``tasks`` (``_decode``'s arguments) one after another on this thread, reporting each."""
    done = 0
    for task in tasks:
        _decode(*task)
        if progress is not None:
            done += _task_bytes(task)
            progress(done, total)


def _stream_tables(view, segments, jobs, version, progress, options: Options) -> list[np.ndarray]:
    """``read_tables`` into new arrays: each block decoded once its records are verified, at most a few
    blocks per decoding thread queued at once (the fetched records they hold stay few)."""
    try:
        outs = [np.empty((t.num_rows, t.dim), dtype=np.float32) for t, _out, _start in jobs]
    except MemoryError:  # (a table whose blocks each hold a few rows: planned first, it raises MissingRows)
        return _read_tables(view, segments, jobs, version, progress, options)
    total, done = sum(out.nbytes for out in outs), 0
    if progress is not None:
        progress(0, total)
    blocks = ((segments, out, block.offset, block, table.dim) for (table, _, start), out in zip(jobs, outs)
              for block in iter_plan(view, segments, table, version, start, table.num_rows))
    workers = decode_threads(options.decode_threads)
    if workers <= 1 or total < options.decode_inline_bytes:
        _decode_inline(blocks, progress, total)
        return outs
    pool = _executor(workers)
    queued: collections.deque = collections.deque()  # (future, fp32 bytes it writes), oldest first
    try:
        for task in blocks:
            queued.append((pool.submit(_decode, *task), _task_bytes(task)))
            del task  # (the pool holds the block's pieces until it has decoded them)
            while queued and (len(queued) > 2 * workers or queued[0][0].done()):
                future, nbytes = queued.popleft()
                future.result()
                if progress is not None:
                    done += nbytes
                    progress(done, total)
        while queued:
            future, nbytes = queued.popleft()
            future.result()
            if progress is not None:
                done += nbytes
                progress(done, total)
    finally:  # a failed plan, decode or progress: no block may still write afterwards
        for future, _nbytes in queued:
            future.exception()
    return outs


def _task_bytes(task) -> int:
    """fp32 bytes a decode task (``_decode``'s arguments) writes."""
    return sum(p.count for p in task[3].pieces) * task[4] * 4
