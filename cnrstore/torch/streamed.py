"""A save written from the live tables while training goes on: copy-on-write by row, checked row by row.

A save copies the rows it writes (every row, for a baseline) into host memory inside ``save()``: that
stalls the trainer for the copy and holds the copy in host memory until written. A :class:`StreamedTable`
copies nothing at ``save()``: the background writer reads the rows from the live tensors chunk by chunk, in
row order, and *just before* something the Checkpointer can see changes a row the writer has not read yet,
the trainer's thread copies that row's value as of the save aside (:meth:`StreamedTable.preserve`, from
``guard.StepGuard``'s hooks). Host memory is then bounded by the rows changed while the save is written,
not by the rows it writes (DataStates-LLM, HPDC'24: lazy copies while tensors are immutable; DECK, PVLDB'25).

**Why the written version equals the state at ``save()``, bit for bit, or is refused** (docs/DESIGN.md,
"Streamed saves"). Let *cursor* be the first row of the save the writer has not finished reading (rows of
the save below it are read).

1. ``save()`` fingerprints every row of the save, weights and row-wise state together (``fingerprint.py``):
   ``expected``.
2. Before an optimizer step, a closure's gradient or an announced write changes rows of a streamed table,
   ``guard.StepGuard`` calls :meth:`preserve` with them (or :meth:`preserve_all`): under the lock, every row
   the save writes at or above *cursor* and not preserved yet is copied from the live tensors (weights and
   row-wise state: not yet changed since the save, by induction) into the preserved buffers.
3. The writer reads a chunk of the save's rows from the live tensors *without* the lock, then, under it,
   moves *cursor* past them and overlays the preserved value of every row of the chunk preserved by then
   (:meth:`take`). A row changed during that read after being preserved (2: it was at or above *cursor*)
   gets its preserved value back from the overlay; a row not preserved by then and changed by nothing 2
   sees was read as it was at the save.
4. Then the writer fingerprints the chunk it is about to write and compares with ``expected``
   (:meth:`check`): a row that differs was changed by something 2 did not see (an in-place write through
   ``.data``, numpy, ``copy_``...) before the cursor passed it. The save is refused
   (:class:`~cnrstore.errors.SaveRefused`): nothing of it commits. So a version committed from a stream is
   the state at ``save()``, whatever the trainer did.
5. After the cursor passed a row, the trainer's changes to it are never read by this save.

Tables whose rows change in ways 2 cannot see coming at all (a CUDA weight, drift "state" or "all", a
``max_norm`` embedding, a weight no optimizer of the Checkpointer holds, a TorchRec shard with its fused
optimizer, a table where 4 refused a save before) are copied at ``save()``.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from ..engine import fs
from ..errors import SaveRefused
from .fingerprint import fingerprints

__all__ = ["StreamedTable", "block_multiple"]

#: About how many bytes of a table's rows (weights and row-wise state together) the writer reads at a time.
CHUNK_BYTES = 8 << 20


def block_multiple(block_rows: list[int]) -> int:
    """The least number of rows that is a whole number of blocks of every table in ``block_rows`` (their
    least common multiple; their largest if that is over 1M rows: a chunk that splits a block only costs
    the writer a merge of that block's two puts)."""
    block = math.lcm(*block_rows)
    return max(block_rows) if block > 1 << 20 else block


class StreamedTable:
    """One table's save, read from the live tensors by the writer (module doc).

    ``sources``: (store table name, live tensor viewed as ``num_rows`` x width, codec or None) -- the
    weight first, then its row-wise optimizer state; ``rows``: the local rows the save writes (sorted,
    unique int64), or None for every row (a baseline); ``block``: a whole number of blocks of every source
    table (``block_multiple``: each chunk the writer takes ends on a block boundary, so that it writes whole
    blocks); ``offset``: the global id of local row 0; ``expected``: the fingerprints of the rows at
    ``save()`` (weight and state together), in position order (:meth:`check` compares each chunk with them).

    Rows are addressed by *position* in the save (``rows[p]``, or ``p`` for a baseline); the cursor is a
    position, and rows are taken in order, so "not yet passed" is "at or above the cursor's row"."""

    def __init__(self, sources: list, num_rows: int, block: int, rows: np.ndarray | None = None, offset: int = 0,
                 expected: np.ndarray | None = None):
        self.sources = sources
        #: the fingerprint of each position's row at ``save()``, across the sources (None: not checked)
        self.expected = expected
        self.num_rows = num_rows
        self.rows = rows
        self.count = num_rows if rows is None else int(rows.size)  # positions
        self.block = block
        row_bytes = 4 * sum(src.shape[1] for _n, src, _c in sources)
        step = max(1, CHUNK_BYTES // row_bytes)
        self.step = step if rows is not None else block * max(1, step // block)  # positions per chunk (about)
        self.offset = offset
        self._lock = threading.Lock()
        self._cursor = 0  # positions below it are read by the writer: the trainer may change them freely
        # position -> its index in the preserved buffers (-1: not preserved); made at the first preserve, so
        # that a save nothing changes during its write costs neither the stall nor the memory (4 B a row)
        self._slot: np.ndarray | None = None
        # the preserved rows, per source: room for every position of the save, reserved at the first preserve
        # and filled in order (pages the kernel commits as they are written: host memory grows by the rows
        # preserved, and never by a copy of a growing buffer)
        self._kept = [np.empty((0, src.shape[1]), dtype=np.float32) for _n, src, _c in sources]
        self._n_kept = 0  # preserved rows
        self.peak_bytes = 0  # the most host bytes the preserved rows held at once
        self.closed = False

    @property
    def preserved_bytes(self) -> int:
        """Host bytes the preserved rows hold now."""
        return self._n_kept * sum(k.shape[1] for k in self._kept) * 4

    def chunks(self):
        """(start, stop) positions of the chunks the writer takes, in order: about ``step`` positions each,
        ending on a block boundary."""
        start = 0
        while start < self.count:
            stop = min(self.count, start + self.step)
            if self.rows is not None and stop < self.count:  # extend to the end of the last row's block
                boundary = (int(self.rows[stop - 1]) // self.block + 1) * self.block
                stop = int(np.searchsorted(self.rows, boundary))
            yield start, stop
            start = stop

    def row_ids(self, start: int, stop: int) -> np.ndarray:
        """The global row ids of positions ``[start, stop)``."""
        local = np.arange(start, stop, dtype=np.int64) if self.rows is None else self.rows[start:stop]
        return local + self.offset if self.offset else local

    def _positions(self, ids: np.ndarray) -> np.ndarray:
        """The positions of ``ids`` (local rows) that this save writes, at or above the cursor (unique)."""
        if self.rows is None:
            pos = ids[(ids >= self._cursor) & (ids < self.num_rows)]  # (a bad id: the lookup itself raised)
        else:
            pos = np.searchsorted(self.rows, ids)
            inside = pos < self.count
            pos, ids = pos[inside], ids[inside]
            pos = pos[(self.rows[pos] == ids) & (pos >= self._cursor)]
        return np.unique(pos)

    def preserve(self, ids: torch.Tensor) -> None:
        """Before an optimizer step that may change the local rows ``ids`` (any shape, duplicates allowed):
        copy aside the current value of each one this save writes, the writer has not read and that is not
        preserved yet (on the trainer's thread)."""
        if self.closed:
            return
        ids_np = ids.reshape(-1).cpu().numpy().astype(np.int64, copy=False) if ids.numel() else np.empty(0, np.int64)
        with self._lock:
            if self.closed:
                return
            pos = self._positions(ids_np)
            if not pos.size:
                return
            if self._slot is None:
                self._slot = np.full(self.count, -1, dtype=np.int32 if self.count < 2**31 else np.int64)
            pos = pos[self._slot[pos] < 0]
            if not pos.size:
                return
            n = pos.size
            src_rows = pos if self.rows is None else self.rows[pos]
            self._grow(self._n_kept + n)
            for kept, (_name, src, _codec) in zip(self._kept, self.sources):
                np.take(src.numpy(), src_rows, axis=0, out=kept[self._n_kept:self._n_kept + n], mode="clip")  # (in range)
            self._slot[pos] = np.arange(self._n_kept, self._n_kept + n)
            self._n_kept += n
            self.peak_bytes = max(self.peak_bytes, self._n_kept * sum(k.shape[1] for k in self._kept) * 4)

    def preserve_all(self) -> None:
        """Before something that may change any row: copy aside every row the writer has not read yet that
        is not preserved yet (on the trainer's thread)."""
        if self.closed:
            return
        with self._lock:
            cursor = self._cursor
        rows = np.arange(cursor, self.count, dtype=np.int64) if self.rows is None else self.rows[cursor:]
        self.preserve(torch.from_numpy(rows))

    def _grow(self, need: int) -> None:
        """Room for ``need`` preserved rows: every position of the save, reserved once (untouched pages hold no
        memory; a large reservation is its own mapping, returned to the system when the save ends)."""
        if need <= self._kept[0].shape[0]:
            return
        self._kept = [np.empty((self.count, kept.shape[1]), dtype=np.float32) for kept in self._kept]

    def take(self, start: int, stop: int, outs: list) -> None:
        """The rows of positions ``[start, stop)`` of every source as of the save, into ``outs`` (one float32
        tensor of ``stop - start`` rows per source), and move the cursor past them (on the writer's thread;
        ``start`` is the cursor: chunks are taken in order)."""
        assert start == self._cursor, (start, self._cursor)
        for out, (_name, src, _codec) in zip(outs, self.sources):  # (no lock: rows changed meanwhile were preserved first)
            if self.rows is None:
                out.copy_(src[start:stop])
            else:
                np.take(src.numpy(), self.rows[start:stop], axis=0, out=out.numpy(), mode="clip")
        fs.pause_point("streamed_chunk_read", start)  # (tests: a step between the read and the cursor)
        with self._lock:
            self._cursor = stop
            if self._slot is None:
                return
            slots = self._slot[start:stop]
            hit = np.flatnonzero(slots >= 0)
            if hit.size:
                for out, kept in zip(outs, self._kept):
                    out.numpy()[hit] = kept[slots[hit]]

    def check(self, start: int, stop: int, outs: list, step=None) -> None:
        """Compare the fingerprints of the rows ``outs`` holds for positions ``[start, stop)`` (what
        :meth:`take` gave) with those at ``save()``; raise :class:`SaveRefused` naming the rows that differ:
        something changed them after ``save()`` and before the writer read them, unseen (module doc, 4)."""
        if self.expected is None:
            return
        bad = np.flatnonzero(fingerprints(outs) != self.expected[start:stop])
        if bad.size:
            name = self.sources[0][0]
            rows = self.row_ids(start, stop)[bad]
            shown = ", ".join(str(int(r)) for r in rows[:5]) + (", ..." if rows.size > 5 else "")
            raise SaveRefused(
                f"the save of step {step} was refused: {rows.size} row(s) of table {name!r} (rows {shown}; "
                "their weights or optimizer state) changed after save() and before the background write read "
                "them, by something that is not an optimizer step (an in-place write: through .data, numpy, "
                "copy_, load_state_dict, nn.init...). Nothing of this save was committed; the versions before "
                "it are intact. Announce such writes with Checkpointer.changing() or reset_rows(), or make the "
                "Checkpointer with stream_saves=False; the table is copied at save() from now on",
                table=name, rows=rows)

    def close(self) -> None:
        """The write has ended (committed or not): stop preserving and free the preserved rows."""
        with self._lock:
            self.closed = True
            self._cursor = self.count
            self._kept = [np.empty((0, k.shape[1]), dtype=np.float32) for k in self._kept]  # (frees them)
            self._slot = None
            self._n_kept = 0
