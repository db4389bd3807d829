"""ECRM's data space as one arena (docs/DESIGN.md, "ECRM").

A rank's protected tensors -- its embedding weights and their optimizer state -- are moved into one
int32 buffer laid out as the data space (``stripes``): each tensor keeps its identity (the same
``Parameter`` and state objects, whose ``.data`` now views the arena), so the model and its optimizer
train as before. In exchange, what a step does to the parity is a handful of vectorized operations for
every table at once: the rows a step may change become blocks of the data space (``blocks``: a block is
a few words that every row of every item is made of, usually a whole row), and the undo log, the code
deltas and a rollback are one gather or scatter of blocks over the arena. Recovery reads
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
    ``.data`` is rebound; its values are kept) and points ``item.words`` at its ``[rows, width]`` view.

    ``block``: the words of a *block*, the grain of a step's undo log, code deltas and messages. It must
    divide ``words``, every item's ``base`` and every row-tracked item's ``width`` (``ecrm`` aligns its
    items so): then a row of an item is whole blocks, and the arena is a ``[words / block, block]`` array
    that a step gathers and scatters by block index -- one index per block, not one per word."""

    def __init__(self, items, table_rows, words: int, block: int = 1):
        # the rank's device is its row-tracked tensors' (weights, row-wise state); small state an optimizer
        # keeps elsewhere (torch keeps Adagrad's and Adam's ``step`` on the CPU for a CUDA parameter) moves
        # into the arena with the rest, as every protected tensor does
        devices = {it.tensor.device for it in items if it.table is not None} or {it.tensor.device for it in items}
        if len(devices) > 1:
            raise InvalidArgument(f"ECRM protects tensors on one device per rank; this rank's embedding shards and "
                                  f"their optimizer state are on {sorted(str(d) for d in devices)}: move them to one")
        self.block = g = int(block)
        if g < 1:
            raise InvalidArgument(f"DataSpace: a block is a positive number of words, got {block!r}")
        bad = [it.name for it in items if it.rows * it.width
               and (it.base % g or (it.table is not None and it.width % g))]
        if words % g or bad:
            raise InvalidArgument(f"DataSpace: a block of {block} words must divide the space ({words} words), "
                                  f"every item's base and every row-tracked width; it does not for {bad}")
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
        self.host_blocks = self.host.reshape(-1, g) if self.host is not None else None
        self.arena_blocks = self.arena.view(-1, g)
        # tracking: one mask over every table's rows; each table's hook writes its own slice. ``grad_mask``:
        # the same rows, for the rows of the gradients (``ecrm`` fills it per step)
        self.row_start = np.concatenate([[0], np.cumsum(np.asarray(table_rows, dtype=np.int64))])
        self.touched = torch.zeros(int(self.row_start[-1]), dtype=torch.bool, device=self.device)
        self.grad_mask = torch.zeros_like(self.touched)
        # the row-tracked items of each table (CSR, in blocks), and the blocks of the items rewritten every step
        row_items = [it for it in items if it.table is not None and it.rows * it.width]
        row_items.sort(key=lambda it: it.table)
        tables = np.array([it.table for it in row_items], dtype=np.int64)
        self.item_base = np.array([it.base // g for it in row_items], dtype=np.int64)
        self.item_width = np.array([it.width // g for it in row_items], dtype=np.int64)
        self.table_ptr = np.searchsorted(tables, np.arange(len(table_rows) + 1)).astype(np.int64)
        fixed = [it for it in items if it.table is None and it.rows * it.width]
        self.fixed_blocks = positions(np.array([it.base // g for it in fixed], dtype=np.int64),
                                      np.array([-(-it.rows * it.width // g) for it in fixed], dtype=np.int64))

    def table_mask(self, table: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The slice of the tracking mask (or of ``mask``, e.g. ``grad_mask``) that belongs to ``table``
        (a view: writes mark its rows)."""
        mask = self.touched if mask is None else mask
        return mask[int(self.row_start[table]):int(self.row_start[table + 1])]

    def touched_rows(self, extra: torch.Tensor | None = None) -> np.ndarray:
        """Global row numbers (table ``t``'s row ``i`` is ``row_start[t] + i``) marked since ``clear()``
        (or marked in ``extra``, a mask like ``touched``), sorted."""
        mask = self.touched if extra is None else torch.logical_or(self.touched, extra, out=extra)
        return np.flatnonzero(mask.cpu().numpy()).astype(np.int64)

    def clear(self) -> None:
        self.touched.zero_()

    def blocks(self, rows: np.ndarray) -> np.ndarray:
        """The blocks of the data space that global ``rows`` (distinct) cover in every item of their
        tables, then the blocks of the items rewritten every step: distinct block indices (int64).
        Vectorized over rows and tables."""
        rows = np.asarray(rows, dtype=np.int64)
        table = np.searchsorted(self.row_start, rows, side="right") - 1
        local = rows - self.row_start[table]
        count = self.table_ptr[table + 1] - self.table_ptr[table]
        owner = np.repeat(np.arange(rows.size), count)
        nth = np.arange(owner.size) - np.repeat(np.cumsum(count) - count, count)
        item = self.table_ptr[table[owner]] + nth
        width = self.item_width[item]
        starts = self.item_base[item] + local[owner] * width
        if width.size and width.min() == width.max() == 1:      # a row of an item is one block
            return np.concatenate([starts, self.fixed_blocks])
        return np.concatenate([positions(starts, width), self.fixed_blocks])

    def gather(self, blocks: np.ndarray) -> np.ndarray:
        """A uint32 ``[len(blocks), block]`` copy of the blocks at ``blocks``."""
        if self.host_blocks is not None:
            return self.host_blocks[blocks]
        index = torch.from_numpy(blocks).to(self.device)
        return self.arena_blocks.index_select(0, index).cpu().numpy().view(np.uint32)

    def scatter(self, blocks: np.ndarray, values: np.ndarray) -> None:
        """Write uint32 ``values`` (``[len(blocks), block]``) at ``blocks``."""
        if self.host_blocks is not None:
            self.host_blocks[blocks] = values
            return
        index = torch.from_numpy(blocks).to(self.device)
        with torch.no_grad():
            self.arena_blocks.index_copy_(0, index, torch.from_numpy(np.ascontiguousarray(values).view(np.int32))
                                          .to(self.device))

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
