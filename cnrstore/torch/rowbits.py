"""A packed set of row ids: one bit per row of an embedding table (``tracking.Table.since_baseline``).

Row ``r`` is bit ``r % 32`` of the int32 word ``r // 32``, so the words viewed as little-endian bytes are
``numpy.packbits(mask, bitorder="little")``. Bits past ``num_rows`` are always zero. The words live on the
weight's device and are allocated at the first set bit: a mask that is never set (``since_baseline`` in
incremental mode) holds no memory.

Setting bits is vectorized and exact with duplicate ids and with ids sharing a word (an OR scatter): on
CPU through numpy (single-threaded; the OR scatter ``np.bitwise_or.at`` only for the ids whose bit is not set
yet), on other devices through torch with no host synchronization (a sort drops duplicate ids, then each
word gets the sum of its bits that are not set yet, which is their OR).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["RowBits"]

_WORD_BITS = 32
#: 1 << k as int32 (bit 31 is the sign bit: a two's-complement pattern, which is what the OR needs).
_BIT = (np.uint32(1) << np.arange(_WORD_BITS, dtype=np.uint32)).view(np.int32)


def _words(num_rows: int) -> int:
    return -(-num_rows // _WORD_BITS)


class RowBits:
    """A set of rows of a table of ``num_rows`` rows, one bit each, on ``device``. ``numpy`` picks the
    implementation: None (numpy on CPU, torch elsewhere); False forces torch's (tests run the device path
    on CPU with it)."""

    def __init__(self, num_rows: int, device, *, numpy: bool | None = None):
        self.num_rows = int(num_rows)
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu" if numpy is None else bool(numpy)
        self.words: torch.Tensor | None = None  # int32, allocated by the first set bit
        self._np: np.ndarray | None = None      # its numpy view (CPU)

    def _alloc(self) -> np.ndarray | torch.Tensor:
        if self.words is None:
            self.words = torch.zeros(_words(self.num_rows), dtype=torch.int32, device=self.device)
            if self.on_cpu:
                self._np = self.words.numpy()
        return self._np if self.on_cpu else self.words

    @property
    def nbytes(self) -> int:
        """Bytes the bits hold (0 until the first bit is set)."""
        return 0 if self.words is None else self.words.nbytes

    # -- updates ---------------------------------------------------------------------------------------
    def set(self, ids: torch.Tensor) -> None:
        """Add the rows ``ids`` (an integer tensor of any shape on this device, duplicates allowed, each in
        ``[0, num_rows)``)."""
        if self.on_cpu:
            words = self._alloc()
            a = ids.numpy().reshape(-1)  # (integer ids never require grad)
            word, bit = a >> 5, np.take(_BIT, a & 31)
            new = np.take(words, word)
            np.bitwise_and(new, bit, out=new)
            # most looked-up rows are set already: the OR scatter (np.bitwise_or.at has no fast path in
            # numpy, ~4x the cost of the test) runs on the new ones only
            if np.count_nonzero(new) != new.size:
                new = new == 0
                np.bitwise_or.at(words, word[new], bit[new])
        else:
            self._set_device(ids.detach().reshape(-1))

    def _set_device(self, ids: torch.Tensor) -> None:
        if not ids.numel():
            return
        self._alloc()
        words = self.words
        s = torch.sort(ids.to(torch.int64)).values
        w = s >> 5
        bit = torch.bitwise_left_shift(torch.ones_like(s, dtype=torch.int32), (s & 31).to(torch.int32))
        fresh = torch.ones_like(s, dtype=torch.bool)
        fresh[1:] = s[1:] != s[:-1]                      # each id once
        bit = torch.where(fresh, bit, torch.zeros_like(bit)) & ~words[w]
        words.index_add_(0, w, bit)                      # distinct unset bits: their sum is their OR

    def _tail_mask(self) -> int:
        """The bits of the last word that stand for rows (-1: all of them)."""
        tail = self.num_rows % _WORD_BITS
        return (1 << tail) - 1 if tail else -1

    def clear(self) -> None:
        """Remove every row (the memory stays allocated)."""
        if self.words is not None:
            if self.on_cpu:
                self._np.fill(0)
            else:
                self.words.zero_()

    def or_mask(self, mask: torch.Tensor) -> None:
        """Add the rows where the bool tensor ``mask`` (one entry per row, on this device) is True."""
        words = self._alloc()
        if self.on_cpu:
            packed = np.packbits(mask.numpy(), bitorder="little")
            view = words.view(np.uint8)
            np.bitwise_or(view[:packed.size], packed, out=view[:packed.size])
        else:
            n = words.numel() * _WORD_BITS
            padded = torch.zeros(n, dtype=torch.int32, device=self.device)
            padded[:self.num_rows] = mask.to(torch.int32)
            shifts = torch.arange(_WORD_BITS, dtype=torch.int32, device=self.device)
            words |= (torch.bitwise_left_shift(padded.view(-1, _WORD_BITS), shifts)).sum(1, dtype=torch.int32)

    # -- queries ---------------------------------------------------------------------------------------
    def rows(self) -> torch.Tensor:
        """The rows in the set, ascending (int64, on this device)."""
        if self.words is None:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        if self.on_cpu:
            nz = np.flatnonzero(self._np)
            bits = np.unpackbits(self._np[nz].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
            sub, pos = np.nonzero(bits)   # row-major: ascending word, then ascending bit
            rows = nz[sub] * _WORD_BITS + pos
            # (a bit past num_rows: only from an id the lookup itself rejects, e.g. -1)
            return torch.from_numpy(rows[:np.searchsorted(rows, self.num_rows)])
        nz = self.words.nonzero().squeeze(1)
        shifts = torch.arange(_WORD_BITS, dtype=torch.int32, device=self.device)
        bits = (torch.bitwise_right_shift(self.words[nz].unsqueeze(1), shifts) & 1).bool()
        sub, pos = bits.nonzero(as_tuple=True)
        rows = nz[sub] * _WORD_BITS + pos
        return rows[rows < self.num_rows]

    def count(self) -> int:
        """How many rows are in the set."""
        if self.words is None:
            return 0
        if self.on_cpu:
            words = self._np.view(np.uint32)
            last = words[-1] & np.int32(self._tail_mask()).view(np.uint32)
            return int(np.bitwise_count(words[:-1]).sum(dtype=np.int64)) + int(np.bitwise_count(last))
        return int(self.rows().numel())
