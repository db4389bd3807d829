"""Arithmetic in GF(2^8) and the systematic erasure code ECRM's parity uses (docs/DESIGN.md, "ECRM").

Bytes are field elements (polynomial basis, reduction polynomial x^8 + x^4 + x^3 + x^2 + 1, 0x11d, as in
most Reed-Solomon storage codes). Addition is XOR; multiplication goes through log/exp tables, and the
product of one constant with a whole byte array is one lookup in a 256-entry row of ``MUL`` (vectorized
numpy fancy indexing). Large arrays go through a 65536-entry table per constant that multiplies two bytes
in one lookup (``mul``, ``mul_words``: about twice the speed of the byte table; benchmarks/bench_gf256.py
measures both against zfec and galois). Everything is exact: a decoded shard equals the lost one bit for
bit.

The code: ``k`` data shards and ``r`` parity shards, parity ``j`` = XOR over ``i`` of ``E[j, i] · data_i``.
``E`` is a Cauchy matrix scaled so that its first row is all ones: parity 0 is the plain XOR of the data
(r = 1 is RAID-5's code) and every square submatrix of ``[I; E]`` is invertible, so any ``k`` of the
``k + r`` shards recover the rest (MDS). Scaling rows and columns of a Cauchy matrix by non-zero
constants keeps every square submatrix non-singular.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument

__all__ = ["MUL", "INV", "mul", "mul_words", "pair_table", "encode_matrix", "generator_matrix", "invert",
           "decode_matrix"]

_POLY = 0x11D


def _tables() -> tuple[np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.int64)
    log = np.zeros(256, dtype=np.int64)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= _POLY
    exp[255:510] = exp[:255]
    return exp, log


_EXP, _LOG = _tables()


def _mul_table() -> np.ndarray:
    a = np.arange(256)
    table = _EXP[(_LOG[a][:, None] + _LOG[a][None, :])].astype(np.uint8)
    table[0, :] = 0
    table[:, 0] = 0
    return table


#: ``MUL[a, b]`` = a · b in GF(2^8); ``MUL[c][array]`` multiplies a uint8 array by the constant ``c``.
MUL = _mul_table()
#: ``INV[a]`` = 1 / a (``INV[0]`` is 0 and never used).
INV = np.zeros(256, dtype=np.uint8)
INV[1:] = _EXP[255 - _LOG[np.arange(1, 256)]].astype(np.uint8)


#: Arrays shorter than this (bytes) use the 256-entry byte table: building a pair table costs more.
PAIR_MIN_BYTES = 1 << 12
_PAIRS: dict[int, np.ndarray] = {}


def pair_table(c: int) -> np.ndarray:
    """The 65536-entry uint16 table of ``c`` · (two bytes at once): ``pair_table(c)[x]`` for a uint16 ``x``
    holds the products of its two bytes in their places. Built once per constant (128 KiB); a code uses
    at most ``k · r`` constants."""
    c = int(c)
    table = _PAIRS.get(c)
    if table is None:
        x = np.arange(1 << 16, dtype=np.uint32)
        row = MUL[c].astype(np.uint16)
        table = row[x & 0xFF] | (row[x >> 8] << 8)
        table = _PAIRS.setdefault(c, table.astype(np.uint16))
    return table


def mul(c: int, data: np.ndarray) -> np.ndarray:
    """``c`` · ``data`` for a uint8 array ``data`` (any shape): a new array. ``c`` = 1 returns a copy."""
    c = int(c)
    if c == 1:
        return data.copy()
    if c == 0:
        return np.zeros_like(data)
    if data.size >= PAIR_MIN_BYTES and data.size % 2 == 0 and data.flags.c_contiguous:
        return pair_table(c)[data.reshape(-1).view(np.uint16)].view(np.uint8).reshape(data.shape)
    return MUL[c][data]


def mul_words(words: np.ndarray, coefs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Consecutive runs of a uint32 array, each times its own constant: run ``n`` is ``lens[n]`` words
    and is multiplied (byte by byte) by ``coefs[n]``. Returns a new array; ``words`` is not changed. One
    vectorized pass per distinct constant (at most ``k`` of them in a code's row), none per run."""
    words = np.ascontiguousarray(words, dtype=np.uint32).reshape(-1)
    coefs = np.asarray(coefs, dtype=np.uint8).reshape(-1)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    if int(lens.sum()) != words.size:
        raise InvalidArgument(f"mul_words: the runs cover {int(lens.sum())} words, the array has {words.size}")
    out = words.copy()
    for c in np.unique(coefs).tolist():
        if c == 1:
            continue
        sel = np.repeat(coefs == c, lens)
        if c == 0:
            out[sel] = 0
        else:
            out[sel] = pair_table(c)[words[sel].view(np.uint16)].view(np.uint32)
    return out


def encode_matrix(k: int, r: int) -> np.ndarray:
    """The ``r × k`` parity coefficients (uint8; module doc). Needs ``k + r <= 256``."""
    if k < 1 or r < 0 or k + r > 256:
        raise InvalidArgument(f"a GF(2^8) code needs k >= 1, r >= 0 and k + r <= 256; got k={k}, r={r}")
    xs = np.arange(r)
    ys = r + np.arange(k)
    cauchy = INV[xs[:, None] ^ ys[None, :]]
    if r:
        cauchy = MUL[cauchy, INV[cauchy[0]][None, :]]   # scale column i by 1 / C[0, i]: row 0 all ones
    return cauchy.astype(np.uint8)


def generator_matrix(k: int, r: int) -> np.ndarray:
    """``[I_k; E]``: row ``m`` gives shard ``m`` (data ``0..k-1``, then parity ``0..r-1``) from the data."""
    return np.concatenate([np.eye(k, dtype=np.uint8), encode_matrix(k, r)])


def invert(a: np.ndarray) -> np.ndarray:
    """The inverse of a square uint8 matrix over GF(2^8) (Gauss-Jordan; the matrices are k × k, small).
    Raises InvalidArgument if it is singular."""
    n = a.shape[0]
    m = np.concatenate([a.astype(np.uint8), np.eye(n, dtype=np.uint8)], axis=1)
    for col in range(n):
        pivot = next((row for row in range(col, n) if m[row, col]), None)
        if pivot is None:
            raise InvalidArgument("singular matrix over GF(2^8): these shards do not determine the data")
        if pivot != col:
            m[[col, pivot]] = m[[pivot, col]]
        m[col] = MUL[INV[m[col, col]]][m[col]]
        for row in range(n):
            if row != col and m[row, col]:
                m[row] ^= MUL[m[row, col]][m[col]]
    return m[:, n:].copy()


def decode_matrix(k: int, r: int, available: list[int]) -> np.ndarray:
    """For ``k`` available shard indices (data ``0..k-1``, parity ``k..k+r-1``), the ``k × k`` matrix
    ``D`` with data ``i`` = XOR over ``m`` of ``D[i, m] · shard[available[m]]``."""
    if len(available) != k or len(set(available)) != k:
        raise InvalidArgument(f"decoding needs exactly k={k} distinct shards, got {available}")
    return invert(generator_matrix(k, r)[list(available)])
