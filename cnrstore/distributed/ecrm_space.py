"""ECRM's data space as one arena (docs/DESIGN.md, "ECRM").

A rank's protected tensors -- its embedding weights and their optimizer state -- are moved into one
int32 buffer laid out as the data space (``stripes``): each tensor keeps its identity (the same
``Parameter`` and state objects, whose ``.data`` now views the arena), so the model and its optimizer
train as before. In exchange, what a step does to the parity is a handful of vectorized operations for
every table at once: the rows a step may change become word ranges of the data space (``pieces``), and
the undo log, the code deltas and a rollback are one gather or scatter over the arena. Recovery reads
and writes the arena as the ``[m, k, U]`` array the layout defines, without a copy on the CPU.

The arena lives on the tensors' device (one device per rank); on the CPU the code works on a zero-copy
numpy view, on a GPU it gathers on the device and copies the words to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidArgument
from .stripes import fingerprint_range

__all__ = ["DataSpace", "positions"]


def positions(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The concatenated ranges ``[s, s + n)`` (vectorized)."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.cumsum(lens) - lens
    return np.repeat(starts - offs, lens) + np.arange(total, dtype=np.int64)


class DataSpace:
    """The arena holding ``items`` (objects with ``tensor``, ``base``, ``rows``, ``width`` and ``table``:
    ``ecrm``'s protected tensors at word offset ``base``, ``rows x width`` words, row-tracked in table
    ``table`` or None for small state rewritten every step) in ``words`` int32 words (the padded data
    space). ``table_rows[t]``: rows of table ``t``. Moves every item's tensor into the arena (its
    ``.data`` is rebound; its values are kept) and points ``item.words`` at its ``[rows, width]`` view."""

    def __init__(self, items, table_rows, words: int):
        # the rank's device is its row-tracked tensors' (weights, row-wise state); small state an optimizer
        # keeps elsewhere (torch keeps Adagrad's and Adam's ``step`` on the CPU for a CUDA parameter) moves
        # into the arena with the rest, as every protected tensor does
        devices = {it.tensor.device for it in items if it.table is not None} or {it.tensor.device for it in items}
        if len(devices) > 1:
            raise InvalidArgument(f"ECRM protects tensors on one device per rank; this rank's embedding shards and "
                                  f"their optimizer state are on {sorted(str(d) for d in devices)}: move them to one")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.words = int(words)
        self.arena = torch.zeros(self.words, dtype=torch.int32, device=self.device)
        with torch.no_grad():
            for it in items:
                n = it.rows * it.width
                if n == 0:
                    continue
                view = self.arena[it.base:it.base + n]
                view.copy_(it.words.reshape(-1))
                it.tensor.data = view.view(it.tensor.dtype).view(it.tensor.shape)
                it.words = view.view(it.rows, it.width)
        self.host = self.arena.numpy().view(np.uint32) if self.device.type == "cpu" else None
        # tracking: one mask over every table's rows; each table's hook writes its own slice
        self.row_start = np.concatenate([[0], np.cumsum(np.asarray(table_rows, dtype=np.int64))])
        self.touched = torch.zeros(int(self.row_start[-1]), dtype=torch.bool, device=self.device)
        # the row-tracked items of each table (CSR), and the words of the items rewritten every step
        row_items = [it for it in items if it.table is not None and it.rows * it.width]
        row_items.sort(key=lambda it: it.table)
        tables = np.array([it.table for it in row_items], dtype=np.int64)
        self.item_base = np.array([it.base for it in row_items], dtype=np.int64)
        self.item_width = np.array([it.width for it in row_items], dtype=np.int64)
        self.table_ptr = np.searchsorted(tables, np.arange(len(table_rows) + 1)).astype(np.int64)
        fixed = [it for it in items if it.table is None and it.rows * it.width]
        self.fixed_starts = np.array([it.base for it in fixed], dtype=np.int64)
        self.fixed_lens = np.array([it.rows * it.width for it in fixed], dtype=np.int64)

    def table_mask(self, table: int) -> torch.Tensor:
        """The slice of the tracking mask that belongs to ``table`` (a view: writes mark its rows)."""
        return self.touched[int(self.row_start[table]):int(self.row_start[table + 1])]

    def touched_rows(self) -> np.ndarray:
        """Global row numbers (table ``t``'s row ``i`` is ``row_start[t] + i``) marked since ``clear()``."""
        return np.flatnonzero(self.touched.cpu().numpy()).astype(np.int64)

    def clear(self) -> None:
        self.touched.zero_()

    def pieces(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The word ranges ``(starts, lens)`` of the data space that global ``rows`` (sorted, distinct) cover
        in every item of their tables, then the items rewritten every step. Vectorized over rows and
        tables."""
        rows = np.asarray(rows, dtype=np.int64)
        table = np.searchsorted(self.row_start, rows, side="right") - 1
        local = rows - self.row_start[table]
        count = self.table_ptr[table + 1] - self.table_ptr[table]
        owner = np.repeat(np.arange(rows.size), count)
        nth = np.arange(owner.size) - np.repeat(np.cumsum(count) - count, count)
        item = self.table_ptr[table[owner]] + nth
        starts = self.item_base[item] + local[owner] * self.item_width[item]
        return (np.concatenate([starts, self.fixed_starts]),
                np.concatenate([self.item_width[item], self.fixed_lens]))

    def gather(self, pos: np.ndarray) -> np.ndarray:
        """A uint32 copy of the words at ``pos``."""
        if self.host is not None:
            return self.host[pos]
        index = torch.from_numpy(pos).to(self.device)
        return self.arena.index_select(0, index).cpu().numpy().view(np.uint32)

    def scatter(self, pos: np.ndarray, values: np.ndarray) -> None:
        """Write uint32 ``values`` at ``pos``."""
        if self.host is not None:
            self.host[pos] = values
            return
        index = torch.from_numpy(pos).to(self.device)
        with torch.no_grad():
            self.arena.index_copy_(0, index, torch.from_numpy(values.view(np.int32)).to(self.device))

    def rows_where_nonzero(self, item) -> np.ndarray:
        """Local rows of ``item`` with any non-zero bit (for optimizers that move rows whose state is
        non-zero)."""
        return np.flatnonzero((item.words != 0).any(dim=1).cpu().numpy()).astype(np.int64)

    def host_words(self) -> np.ndarray:
        """Every word of the arena as uint32 (on the CPU a view, else a copy)."""
        return self.host if self.host is not None else self.arena.cpu().numpy().view(np.uint32)

    def load(self, words: np.ndarray) -> None:
        """Overwrite the arena with ``words`` (uint32, ``self.words`` of them)."""
        with torch.no_grad():
            self.arena.copy_(torch.from_numpy(np.ascontiguousarray(words).reshape(-1).view(np.int32)))

    def fingerprint(self) -> int:
        """``stripes.fingerprint_range`` of the whole data space (padding words are zero: they add 0)."""
        return fingerprint_range(self.host_words(), 0)
