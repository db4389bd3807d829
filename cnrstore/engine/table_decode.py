"""Whole-table reads decoded in parallel: every table of a read is planned (each record it needs verified,
``reader.plan_table``) before any destination array is written, then its blocks are decoded straight into
those arrays on a pool of threads (the decode kernels, numpy's and FBGEMM's, release the GIL).

This is what ``Store.read_table``, ``Store.read_tables`` and ``Store.restore`` run inside their read
transaction: the plans are views of the segments' maps, decoded before the transaction ends.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import knobs
from ..codecs.base import as_out
from . import blocks as blocks_math
from .index import IndexView
from .reader import decode_block, plan_table
from .schema import TableRecord
from .segments import SegmentReader

__all__ = ["check_out", "decode_threads", "read_tables"]

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def decode_threads() -> int:
    """Threads a parallel decode uses: ``knobs.DECODE_THREADS``, or every core this process may run on."""
    if knobs.DECODE_THREADS:
        return max(1, int(knobs.DECODE_THREADS))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _executor(threads: int) -> ThreadPoolExecutor:
    """The process's decode pool, (re)made with ``threads`` workers; shared by every store."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(threads, thread_name_prefix="cnrstore-decode"), threads
        return _pool


def _forget_pool_after_fork() -> None:
    # a forked child has none of the parent's threads: it makes its own pool on first use
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def check_out(out, table: TableRecord, what: str) -> np.ndarray:
    """``out`` as a numpy array sharing its memory, if it is a writable C-contiguous float32 array (or CPU
    torch tensor) of the table's shape ``(num_rows, dim)``; else InvalidArgument naming the table."""
    return as_out(out, (table.num_rows, table.dim), f"{what} of table {table.name!r} ({table.num_rows} x {table.dim})")


def read_tables(view: IndexView, segments: SegmentReader, jobs: Sequence[tuple[TableRecord, np.ndarray | None]],
                version: int) -> list[np.ndarray]:
    """Each table of ``jobs`` ((table, destination or None for a new array)) as of ``version``, decoded into
    its destination (checked with :func:`check_out` by the caller), in ``jobs`` order.

    Every table is planned first, so every record the read needs is verified (and every row found)
    before any destination is written: a CorruptionError or MissingRows leaves them all untouched. The
    blocks are then decoded on :func:`decode_threads` threads; an error there (none is expected once the
    records are verified, short of running out of memory) is raised after every block has finished.
    """
    plans = [plan_table(view, segments, table, version) for table, _ in jobs]
    outs = [np.empty((t.num_rows, t.dim), dtype=np.float32) if out is None else out for t, out in jobs]
    tasks = [(out, blocks_math.base(block, table.block_rows), pieces, table.dim)
             for (table, _), out, blocks in zip(jobs, outs, plans) for block, pieces in blocks]
    threads = min(decode_threads(), len(tasks))
    if threads <= 1:
        for task in tasks:
            decode_block(*task)
        return outs
    # the biggest blocks first, so that the pool does not end waiting on one large block
    tasks.sort(key=lambda task: -sum(p.count for p in task[2]))
    futures = [_executor(decode_threads()).submit(decode_block, *task) for task in tasks]
    errors = [f.exception() for f in futures]  # waits for every block: none may still write afterwards
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return outs
