"""Row fingerprints: one 64-bit digest per row of a table, to find the rows that changed between two saves
whatever changed them, and to check that a streamed save wrote every row as it was at ``save()``.

A ``Checkpointer`` fingerprints every row of every embedding table, and of its row-wise optimizer state, at
each ``save()``: the rows whose fingerprint differs from the one they had at the previous save are the rows
the increment writes. Nothing has to announce a change -- an optimizer step, a gradient that came from a tied
output layer or an L2 penalty, an in-place write through ``.data``, numpy or ``load_state_dict`` are all seen
-- so an increment never misses a row that changed (docs/DESIGN.md, "What a save writes").

**The digest.** A row of ``b`` bytes is read as ``m`` little-endian words of 4 bytes (2 or 1 when ``b`` is not
a multiple of 4), each sign-extended to 64 bits, and its fingerprint is ``sum_j c_j * w_j mod 2**64`` with
``c_j`` fixed odd 64-bit constants (drawn once from a seeded generator). A table's row is its weight row and
the same row of each of its row-wise optimizer state tensors: one digest over all their words (each part with
constants of its own), 8 bytes a row whatever the optimizer. The sum is exact integer arithmetic:
the same bytes give the same fingerprint on every call, whatever the chunking or the number of threads. A
row that differs in a single word always gets another fingerprint (``c_j`` is odd and the word's change is
below ``2**32`` in magnitude); changes to several words of a row cancel only if the ``c_j``-weighted sum of
their differences is a multiple of ``2**64``, about one chance in ``2**32`` for the least favourable
patterns (every difference a multiple of ``2**31``: sign flips alone) and far less otherwise. It is a
checksum against accidents, not against an adversary.

**Cost.** One pass over the table's bytes: numpy's ``einsum`` over chunks of rows, on several threads for
large tables (numpy releases the GIL), about 9 GB/s per core here; on a CUDA device, torch's integer
kernels on the device (``numpy=False`` selects that path on the CPU too, for tests). Memory: 8 bytes per
row per table (weights and state together), kept from one save to the next.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

__all__ = ["fingerprints"]

#: Rows per chunk: the chunk's 64-bit words (a temporary of this many rows) stay in the cache.
CHUNK_ROWS = 1 << 13
#: A table of at least this many bytes per thread is fingerprinted on several threads (at most THREADS).
THREAD_MIN_BYTES = 32 << 20
THREADS = 4
_SEED = 0x5EED_F1A6

_constants: dict[tuple, np.ndarray] = {}
_constants_lock = threading.Lock()


def _weights(words: int, part: int = 0) -> np.ndarray:
    """The odd constants ``c_0 .. c_{words-1}`` (int64, wrapping) of part ``part`` of a row (the weight is
    part 0, its row-wise state tables 1, 2, ...), the same in every process."""
    key = (words, part)
    with _constants_lock:
        c = _constants.get(key)
        if c is None:
            rng = np.random.default_rng([_SEED, part])
            c = rng.integers(0, 2**63, size=max(words, 1), dtype=np.int64, endpoint=False) | 1
            _constants[key] = c = c[:words]
        return c


def _word_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``num_rows x width``, any dtype, C-contiguous rows) as ``num_rows x m`` signed words of 4, 2 or 1
    bytes (the widest that divides a row's bytes)."""
    t = t.detach()
    if t.dim() == 1:
        t = t.reshape(-1, 1)
    t = t.reshape(t.shape[0], -1)
    if not t.is_contiguous():
        t = t.contiguous()
    row_bytes = t.shape[1] * t.element_size()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    for size, dtype in ((4, torch.int32), (2, torch.int16), (1, torch.int8)):
        if row_bytes % size == 0:
            return raw.view(dtype).reshape(t.shape[0], row_bytes // size)
    raise AssertionError("unreachable: every row is a whole number of bytes")


def _numpy_rows(parts: list, out: np.ndarray, lo: int, hi: int) -> None:
    """``out[lo:hi]`` = the fingerprints of rows ``lo..hi-1``: the sum over ``parts`` ((words, constants))."""
    wide = [np.empty((min(CHUNK_ROWS, hi - lo), w.shape[1]), dtype=np.int64) for w, _c in parts]
    part_out = np.empty(min(CHUNK_ROWS, hi - lo), dtype=np.int64)
    for start in range(lo, hi, CHUNK_ROWS):
        stop = min(hi, start + CHUNK_ROWS)
        dest = out[start:stop]
        for k, ((words, c), buf) in enumerate(zip(parts, wide)):
            chunk = buf[:stop - start]
            chunk[...] = words[start:stop]  # (sign-extended to 64 bits)
            with np.errstate(over="ignore"):
                np.einsum("ij,j->i", chunk, c, out=dest if k == 0 else part_out[:stop - start])
                if k:
                    dest += part_out[:stop - start]


def fingerprints(sources, *, numpy: bool | None = None) -> np.ndarray | torch.Tensor:
    """The fingerprint of each row of ``sources`` -- a tensor, or a list of tensors with the same number of
    rows (an embedding weight, then its row-wise optimizer state: one digest of the row across all of them,
    each part with constants of its own) -- as an int64 numpy array for CPU tensors, an int64 tensor on their
    device otherwise (``numpy=False`` takes the device path on the CPU too). Trailing dimensions are
    flattened."""
    tensors = [sources] if torch.is_tensor(sources) else list(sources)
    words = [_word_view(t) for t in tensors]
    n = words[0].shape[0]
    assert all(w.shape[0] == n for w in words), [w.shape for w in words]
    consts = [_weights(w.shape[1], k) for k, w in enumerate(words)]
    if (tensors[0].device.type == "cpu") if numpy is None else numpy:
        parts = [(w.numpy(), c) for w, c in zip(words, consts)]
        out = np.empty(n, dtype=np.int64)
        row_bytes = sum(w.shape[1] * w.itemsize for w, _c in parts)
        threads = max(1, min(THREADS, os.cpu_count() or 1, (n * row_bytes) // THREAD_MIN_BYTES))
        if threads == 1 or n < 2 * CHUNK_ROWS:
            _numpy_rows(parts, out, 0, n)
            return out
        bounds = [n * i // threads for i in range(threads + 1)]
        workers = [threading.Thread(target=_numpy_rows, args=(parts, out, lo, hi), name="cnrstore-fingerprint")
                   for lo, hi in zip(bounds[1:-1], bounds[2:])]
        for worker in workers:
            worker.start()
        try:
            _numpy_rows(parts, out, bounds[0], bounds[1])
        finally:
            for worker in workers:
                worker.join()
        return out
    device = words[0].device
    out = torch.zeros(n, dtype=torch.int64, device=device)
    for w, c in zip(words, consts):
        ct = torch.from_numpy(c).to(device)
        for start in range(0, n, CHUNK_ROWS):
            stop = min(n, start + CHUNK_ROWS)
            # (int64 products and sums wrap, as the numpy path's do: the same fingerprints on every device)
            out[start:stop] += (w[start:stop].to(torch.int64) * ct).sum(dim=1)
    return out
