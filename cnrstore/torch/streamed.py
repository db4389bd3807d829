"""A baseline written from the live tables while training goes on: copy-on-write by row.

A baseline writes every row of a table. Copying all of them into host memory inside ``save()`` stalls the
trainer for the whole table (and its row-wise optimizer state) and doubles their host memory. A
:class:`StreamedTable` copies nothing at ``save()``: the background writer reads the live tensors chunk by
chunk, in row order, and *just before* an optimizer step changes a row the writer has not read yet, the
trainer's thread copies that row's value as of the save aside (:meth:`StreamedTable.preserve`, from an
optimizer step pre-hook). Host memory is then bounded by the rows changed while the baseline is written,
not by the table (DataStates-LLM, HPDC'24: lazy copies while tensors are immutable; DECK, PVLDB'25).

**Why the written version equals the state at ``save()``, bit for bit** (docs/DESIGN.md, "Streamed
baselines"). Let *cursor* be the first row the writer has not finished reading (rows below it are read).

1. Between ``save()`` and the end of the write, a row of a streamed table changes only inside an optimizer
   step, and only if it was looked up since the previous step: the table's drift is None (plain SGD,
   Adagrad, SparseAdam, no weight decay: ``optim_state.table_drift``), its weight is on the CPU, and every
   optimizer holding it is one of the Checkpointer's (their step pre-hooks run). The ids of every lookup
   are recorded while a streamed table is open (``Table.note``), the rows looked up since the previous save
   included (the touched mask at ``save()``: a forward pass before ``save()`` whose step comes after).
2. Before any optimizer step, the pre-hook calls :meth:`preserve` with those ids: under the lock, every id
   at or above *cursor* not preserved yet is copied from the live tensors (weights and row-wise state, not
   yet changed since the save by 1 and by induction) into the preserved buffers.
3. The writer reads rows ``[a, b)`` from the live tensors *without* the lock, then, under it, moves
   *cursor* to ``b`` and overlays the preserved value of every row of ``[a, b)`` preserved by then
   (:meth:`take`). A row the trainer changed during that read was preserved before the change (2: it was
   at or above *cursor* = ``a``), so the overlay replaces whatever the read saw. A row not preserved by
   then was not changed before the cursor moved past it, so the read saw its value as of the save.
4. After the cursor passed a row, the trainer's changes to it are never read by this baseline.

Tables that break 1 (a CUDA weight, drift "state" or "all", a weight no optimizer of the Checkpointer
holds, a TorchRec shard with its fused optimizer) are copied at ``save()`` as before.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from ..engine import fs

__all__ = ["StreamedTable", "chunk_rows"]

#: About how many bytes of a table's rows (weights and row-wise state together) the writer reads at a time.
CHUNK_BYTES = 8 << 20


def chunk_rows(block_rows: list[int], row_bytes: int) -> int:
    """The rows of a streamed baseline's chunk: about ``CHUNK_BYTES`` of rows of ``row_bytes``, a multiple of
    each of ``block_rows`` (their least common multiple; their largest if that is over 1M rows: a chunk
    that splits a block only costs the writer a merge of that block's two puts)."""
    block = math.lcm(*block_rows)
    if block > 1 << 20:
        block = max(block_rows)
    return block * max(1, CHUNK_BYTES // max(1, row_bytes * block))


class StreamedTable:
    """One table's baseline, read from the live tensors by the writer (module doc).

    ``sources``: (store table name, live tensor viewed as ``num_rows`` x width, codec or None) -- the
    weight first, then its row-wise optimizer state; ``offset``: the global id of local row 0;
    ``chunk_rows``: the rows the writer reads at a time (a multiple of every source table's block rows, so
    that each chunk writes whole blocks)."""

    def __init__(self, sources: list, num_rows: int, chunk_rows: int, offset: int = 0):
        self.sources = sources
        self.num_rows = num_rows
        self.chunk_rows = chunk_rows
        self.offset = offset
        self._lock = threading.Lock()
        self._cursor = 0  # rows below it are read by the writer: the trainer may change them freely
        self._slot = np.full(num_rows, -1, dtype=np.int64)  # row -> its index in the preserved buffers
        self._kept = [np.empty((0, src.shape[1]), dtype=np.float32) for _n, src, _c in sources]
        self._count = 0  # preserved rows
        self.peak_bytes = 0  # the most host bytes the preserved rows held at once
        self.closed = False

    @property
    def preserved_bytes(self) -> int:
        """Host bytes the preserved rows hold now."""
        return sum(k.shape[0] * k.shape[1] * 4 for k in self._kept)

    @property
    def cursor(self) -> int:
        return self._cursor

    def preserve(self, ids: torch.Tensor) -> None:
        """Before an optimizer step that may change the local rows ``ids`` (any shape, duplicates allowed):
        copy aside the current value of each one the writer has not read and that is not preserved yet
        (on the trainer's thread)."""
        if self.closed:
            return
        ids_np = ids.reshape(-1).cpu().numpy() if ids.numel() else np.empty(0, dtype=np.int64)
        with self._lock:
            if self.closed:
                return
            rows = np.unique(ids_np[(ids_np >= self._cursor) & (ids_np < self.num_rows)])  # (a bad id: the lookup raised)
            if not rows.size:
                return
            rows = rows[self._slot[rows] < 0]
            if not rows.size:
                return
            n = rows.size
            self._grow(self._count + n)
            for kept, (_name, src, _codec) in zip(self._kept, self.sources):
                np.take(src.numpy(), rows, axis=0, out=kept[self._count:self._count + n], mode="clip")  # (in range)
            self._slot[rows] = np.arange(self._count, self._count + n)
            self._count += n
            self.peak_bytes = max(self.peak_bytes, self._count * sum(k.shape[1] for k in self._kept) * 4)

    def _grow(self, need: int) -> None:
        if need <= self._kept[0].shape[0]:
            return
        size = max(need, 2 * self._kept[0].shape[0], 1024)
        grown = []
        for kept in self._kept:
            new = np.empty((size, kept.shape[1]), dtype=np.float32)
            new[:self._count] = kept[:self._count]
            grown.append(new)
        self._kept = grown

    def take(self, start: int, stop: int, outs: list) -> None:
        """The rows ``[start, stop)`` of every source as of the save, into ``outs`` (one float32 array of
        ``stop - start`` rows per source), and move the cursor past them (on the writer's thread; ``start``
        is the cursor: chunks are taken in order)."""
        assert start == self._cursor, (start, self._cursor)
        for out, (_name, src, _codec) in zip(outs, self.sources):
            out.copy_(src[start:stop])  # (no lock: rows changed meanwhile were preserved first)
        fs.pause_point("streamed_chunk_read", start)  # (tests: a step between the read and the cursor)
        with self._lock:
            self._cursor = stop
            slots = self._slot[start:stop]
            hit = np.flatnonzero(slots >= 0)
            if hit.size:
                for out, kept in zip(outs, self._kept):
                    out.numpy()[hit] = kept[slots[hit]]

    def close(self) -> None:
        """The write has ended (committed or not): stop preserving and free the preserved rows."""
        with self._lock:
            self.closed = True
            self._cursor = self.num_rows
            self._kept = [k[:0] for k in self._kept]
            self._slot = np.empty(0, dtype=np.int64)
            self._count = 0
