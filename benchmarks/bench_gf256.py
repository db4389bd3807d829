#!/usr/bin/env python3
"""ECRM's GF(2^8) kernels (cnrstore.distributed.gf256) against well-kept libraries, in one run.

Two operations, on random data:

- **encode**: ``r`` parity blocks of ``k`` data blocks of ``--mib`` MiB each (what ``ECRM.rebuild`` and a
  recovery's re-encode do): gf256 (a pair table per coefficient), gf256's byte table (the kernel before
  the pair tables), zfec (Tahoe-LAFS's C Reed-Solomon) and galois (numba-compiled GF arrays), where
  installed (``pip install zfec galois``; missing ones are skipped and named);
- **scale runs**: a step's code deltas, runs of 16 words each times its own coefficient (parity slot
  ``j >= 1`` of ``ECRM.step``): ``gf256.mul_words`` against the per-byte 2-D table lookup it replaced.

Figures are MB/s of data in (the best of ``--repeat``), and ratios against gf256 measured in the same run.
The libraries use other codes (zfec a Vandermonde matrix, galois a matrix product over the same field);
the work per byte is the same: ``k · r`` constant products and XORs.

    python benchmarks/bench_gf256.py --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import load_average, machine_description, publish  # noqa: E402

from cnrstore.distributed import gf256  # noqa: E402


def best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def encode_pairs(matrix: np.ndarray, data: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for j in range(matrix.shape[0]):
        acc = np.zeros_like(data[0])
        for i, d in enumerate(data):
            acc ^= gf256.mul(int(matrix[j, i]), d)
        out.append(acc)
    return out


def encode_bytes(matrix: np.ndarray, data: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for j in range(matrix.shape[0]):
        acc = np.zeros_like(data[0])
        for i, d in enumerate(data):
            acc ^= d if matrix[j, i] == 1 else gf256.MUL[matrix[j, i]][d]
        out.append(acc)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 MiB blocks, 3 repeats")
    p.add_argument("--mib", type=float, default=None, help="MiB per data block (default 8; --quick 1)")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--out", default=None, help="also write the markdown to FILE")
    args = p.parse_args(argv)
    mib = args.mib or (1 if args.quick else 8)
    repeat = args.repeat or (3 if args.quick else 5)
    load_start = load_average()
    n = int(mib * (1 << 20)) // 16 * 16
    rng = np.random.default_rng(0)
    lines = [f"- machine: {machine_description()}; load average at start {load_start}",
             f"- blocks of {n / (1 << 20):.1f} MiB, best of {repeat}; MB/s of data in", ""]
    try:
        import zfec  # noqa: PLC0415
    except ImportError:
        zfec = None
    try:
        import galois  # noqa: PLC0415
        GF = galois.GF(2 ** 8)
    except ImportError:
        galois = GF = None
    missing = [name for name, mod in (("zfec", zfec), ("galois", galois)) if mod is None]
    lines += ["| operation | k,r | gf256 (pair tables) | gf256 byte table | zfec | galois |", "|---|---|---|---|---|---|"]
    for k, r in ((2, 2), (4, 2), (4, 3)):
        data = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]
        matrix = gf256.encode_matrix(k, r)
        size = k * n / 1e6
        ours = best(lambda: encode_pairs(matrix, data), repeat)
        assert all(np.array_equal(a, b) for a, b in zip(encode_pairs(matrix, data), encode_bytes(matrix, data)))
        cells = [size / ours, size / best(lambda: encode_bytes(matrix, data), repeat)]
        if zfec is not None:
            enc = zfec.Encoder(k, k + r)
            blocks = [d.tobytes() for d in data]
            cells.append(size / best(lambda: enc.encode(blocks, list(range(k, k + r))), repeat))
        else:
            cells.append(None)
        if GF is not None:
            gm, gd = GF(matrix), GF(np.stack(data))
            cells.append(size / best(lambda: gm @ gd, repeat))
        else:
            cells.append(None)
        lines.append(f"| encode | {k},{r} | " + " | ".join(
            "-" if c is None else f"{c:,.0f} ({c / cells[0]:.2f}x)" for c in cells) + " |")
    words = n // 4
    lens = np.full(words // 16, 16, dtype=np.int64)
    coefs = gf256.encode_matrix(4, 2)[1][rng.integers(0, 4, lens.size)]
    delta = rng.integers(0, 2 ** 32, words, dtype=np.uint32)
    ours = best(lambda: gf256.mul_words(delta, coefs, lens), repeat)

    def per_byte():
        per_word = np.repeat(coefs, lens)
        return gf256.MUL[per_word[:, None], delta.view(np.uint8).reshape(-1, 4)].reshape(-1).view(np.uint32)

    assert np.array_equal(per_byte(), gf256.mul_words(delta, coefs, lens))
    old = best(per_byte, repeat)
    lines.append(f"| scale runs of 16 words (slot 1 of a 4,2 code) | 4,2 | {n / 1e6 / ours:,.0f} (1.00x) | "
                 f"per-byte 2-D lookup: {n / 1e6 / old:,.0f} ({ours / old:.2f}x) | - | - |")
    if missing:
        lines += ["", f"- not installed, skipped: {', '.join(missing)} (pip install {' '.join(missing)})"]
    publish("\n".join(lines) + "\n", args.out, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
