#!/usr/bin/env python3
"""Codec benchmark: every registered codec beside FBGEMM's plain and greedy row-wise kernels, one table.

For each codec in ``cnrstore.codecs.names()`` (whatever is registered when it runs) and for FBGEMM's
``embedding_bag_{4bit,2bit}_prepack`` plain and with its greedy range search
(``optimized_qparams=True, nbins=200, ratio=0.16``), on the same embedding-like fp32 rows:

- encode and decode throughput in GB/s of fp32 data (``rows * dim * 4`` bytes over the median time of
  ``--repeat`` runs); codecs encode with ``check=False``, as the store's writer calls them (the writer
  validates the values once, before choosing codecs);
- relative L2 error ``||x - x̂|| / ||x||`` over the first ``--slow-rows`` rows, the same rows for all;
- bytes per encoded row at dim 64 and 128.

Rows: ``N(0, 0.1)`` scaled per row by a log-normal factor (sigma 0.5), dim 64. Codecs that encode under
50 MB/s (FBGEMM's greedy search, maybe k-means) are timed on the first ``--slow-rows`` rows; the table says how many rows each figure is from. The machine is shared and
noisy: every figure is a median, and the ratios in the notes compare figures from the same run.

    python benchmarks/bench_codecs.py                # full run (1M rows; ~1-3 minutes on 2 cores)
    python benchmarks/bench_codecs.py --quick        # smoke run (< 30 s)
    python benchmarks/bench_codecs.py --out codecs.md --plot benchmarks/codecs.png
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_average, machine_description, publish  # noqa: E402  (the shared report header and tail)

from cnrstore import codecs  # noqa: E402

DIM = 64
#: A codec that encodes fewer fp32 bytes per second than this is timed on --slow-rows only.
SLOW_BYTES_PER_S = 50e6
#: And on fewer rows still (and fewer reps) if one pass over --slow-rows would take longer than this.
MAX_PASS_S = 10.0
_ops = torch.ops.quantized
#: What the table says a codec is, by the module that implements it (else the module's name).
_KINDS = {"lossless": "IEEE float", "rowwise": "uniform, FBGEMM kernel", "nbit": "uniform, numpy"}


# -- machine description (as in bench_engine.py) ------------------------------------------------------------

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the contenders ------------------------------------------------------------------------------------------

class Contender:
    """Something that encodes fp32 rows to bytes and back: a registered codec or an FBGEMM kernel pair."""

    def __init__(self, label: str, kind: str, encode, decode, row_bytes, bits: int | None):
        self.label, self.kind, self.encode, self.decode, self.row_bytes, self.bits = (
            label, kind, encode, decode, row_bytes, bits)


def codec_contender(name: str) -> Contender:
    c = codecs.get(name)
    module = type(c).__module__.rsplit(".", 1)[-1]
    kind = _KINDS.get(module, module)
    m = re.search(r"(\d+)$", name)
    bits = int(m.group(1)) if m and not name.startswith("fp") else None
    return Contender(name, kind, lambda x: c.encode(x, check=False), lambda e: c.decode(e, DIM), c.row_bytes, bits)


def fbgemm_contenders() -> list[Contender]:
    out = []
    for bits, prepack, unpack in ((4, _ops.embedding_bag_4bit_prepack, _ops.embedding_bag_4bit_unpack),
                                  (2, _ops.embedding_bag_2bit_prepack, _ops.embedding_bag_2bit_unpack)):
        def row_bytes(d, per=8 // bits):
            return -(-d // per) + 4

        def dec(e, unpack=unpack):
            return unpack(torch.from_numpy(e)).numpy()

        out.append(Contender(f"FBGEMM {bits}-bit", "reference", lambda x, p=prepack: p(torch.from_numpy(x)).numpy(),
                             dec, row_bytes, bits))
        try:  # the greedy search: optimized_qparams, nbins, ratio
            prepack(torch.zeros(2, 8), True, 200, 0.16)
        except (RuntimeError, TypeError) as exc:
            log(f"FBGEMM {bits}-bit greedy unavailable: {exc}")
            continue
        out.append(Contender(f"FBGEMM {bits}-bit greedy (200, 0.16)", "reference",
                             lambda x, p=prepack: p(torch.from_numpy(x), True, 200, 0.16).numpy(),
                             dec, row_bytes, bits))
    return out


# -- measuring -----------------------------------------------------------------------------------------------

def embedding_rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, DIM), dtype=np.float32) * np.float32(0.1)
    x *= np.exp(rng.normal(0.0, 0.5, size=(n, 1))).astype(np.float32)
    return x


def timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t0, result


def reps_for(seconds_per_pass: float, repeat: int) -> int:
    """``repeat``, or fewer (at least 1) where ``repeat`` passes would take over ``4 * MAX_PASS_S``."""
    if seconds_per_pass * repeat <= 4 * MAX_PASS_S:
        return repeat
    return max(1, int(4 * MAX_PASS_S / seconds_per_pass))


def measure(ct: Contender, x: np.ndarray, args) -> dict:
    """Times and error of one contender; picks how many rows to time it on from a probe."""
    ct.encode(x[:500])  # warm the code path (first-call initialisation would skew the probe)
    probe_rows = min(len(x), 5000)
    t_probe = min(timed(ct.encode, x[:probe_rows])[0] for _ in range(3))  # the best of 3: noise only slows
    per_row = t_probe / probe_rows
    rows = len(x)
    if x[:probe_rows].nbytes / t_probe < SLOW_BYTES_PER_S:
        rows = min(rows, args.slow_rows)
    if per_row * rows > MAX_PASS_S:
        rows = max(probe_rows, int(MAX_PASS_S / per_row))
    sub = x[:rows]
    reps = reps_for(per_row * rows, args.repeat)
    enc_t = []
    for _ in range(reps):
        t, enc = timed(ct.encode, sub)
        enc_t.append(t)
    t_dec, out = timed(ct.decode, enc)
    # Decode on as many rows as the fast codecs (the encoded rows repeated), so that no decode figure
    # comes from rows that fit in cache.
    dec_in = enc
    if rows < len(x) and t_dec * len(x) / rows <= MAX_PASS_S:
        dec_in = np.tile(enc, (-(-len(x) // rows), 1))[: len(x)]
        t_dec = timed(ct.decode, dec_in)[0]
    dec_reps = reps_for(t_dec, args.repeat)
    dec_t = [timed(ct.decode, dec_in)[0] for _ in range(dec_reps)]
    err_rows = min(args.slow_rows, rows)
    ref = x[:err_rows].astype(np.float64)
    diff = out[:err_rows].astype(np.float64) - ref
    return {
        "rows": rows, "reps": reps, "dec_rows": len(dec_in), "dec_reps": dec_reps, "err_rows": err_rows,
        "enc": sub.nbytes / 1e9 / statistics.median(enc_t),
        "dec": len(dec_in) * DIM * 4 / 1e9 / statistics.median(dec_t),
        "enc_s": statistics.median(enc_t), "dec_s": statistics.median(dec_t),
        "err": float(np.linalg.norm(diff) / np.linalg.norm(ref)),
    }


def fmt_rate(gbps: float) -> str:
    return f"{gbps:.3f}" if gbps < 0.1 else f"{gbps:.2f}"


def _text_box(annotation, renderer):
    """The display box of an annotation's text alone (not its leader line), padded a little."""
    from matplotlib.text import Text  # noqa: PLC0415
    annotation.update_positions(renderer)
    return Text.get_window_extent(annotation, renderer).expanded(1.05, 1.2)


def _place_labels(ax, fig, pts, labels, colors, placed) -> None:
    """Label each point, trying offsets around it until the label overlaps no earlier label (nor a box of
    ``placed``) and no marker."""
    from matplotlib.transforms import Bbox  # noqa: PLC0415
    renderer = fig.canvas.get_renderer()
    trans = ax.transData
    disp = [trans.transform(p) for p in pts]
    markers = [Bbox.from_extents(px - 7, py - 7, px + 7, py + 7) for px, py in disp]
    cands = [(6, 4, "left", "bottom"), (6, -4, "left", "top"), (-6, 4, "right", "bottom"),
             (-6, -4, "right", "top"), (6, 14, "left", "bottom"), (6, -14, "left", "top"),
             (-6, 14, "right", "bottom"), (-6, -14, "right", "top"), (0, 24, "center", "bottom"),
             (0, -24, "center", "top"), (30, 0, "left", "center"), (-30, 0, "right", "center"),
             (12, 26, "left", "bottom"), (12, -26, "left", "top"), (-12, 26, "right", "bottom"),
             (-12, -26, "right", "top")]
    for r in (40, 60, 80):  # farther out, with a leader line
        cands += [(r, r // 2, "left", "bottom"), (r, -r // 2, "left", "top"), (-r, r // 2, "right", "bottom"),
                  (-r, -r // 2, "right", "top"), (0, r, "center", "bottom"), (0, -r, "center", "top")]
    axbox = ax.get_window_extent(renderer)
    for (x, y), (dx, dy), text, color in sorted(zip(pts, disp, labels, colors), key=lambda t: -t[1][1]):
        best, fallback = None, None
        for ox, oy, ha, va in cands:
            t = ax.annotate(text, (x, y), xytext=(ox, oy), textcoords="offset points", ha=ha, va=va, fontsize=7,
                            color=color, arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5")
                            if abs(ox) + abs(oy) > 20 else None)
            bb = _text_box(t, renderer)
            clashes = sum(bb.overlaps(o) for o in placed) + sum(bb.overlaps(m) for m in markers) + (
                0 if axbox.contains(bb.x0, bb.y0) and axbox.contains(bb.x1, bb.y1) else 100)
            if clashes == 0:
                best = bb
                break
            if fallback is None or clashes < fallback[0]:
                fallback = (clashes, (ox, oy, ha, va))
            t.remove()
        if best is None:  # every spot clashes: the least crowded one
            ox, oy, ha, va = fallback[1]
            t = ax.annotate(text, (x, y), xytext=(ox, oy), textcoords="offset points", ha=ha, va=va, fontsize=7,
                            color=color, arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5")
                            if abs(ox) + abs(oy) > 20 else None)
            best = _text_box(t, renderer)
        placed.append(best)


def plot(results, path: str) -> str | None:
    """Encode and decode GB/s (log x) against relative L2 error (log y), one labeled point per codec;
    FBGEMM's kernels as hollow squares. None, or why the plot was skipped."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    errs = [r["err"] for _, r in results if r["err"] > 0]
    floor = 10 ** np.floor(np.log10(min(errs)) - 1) if errs else 1e-6
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5))
    for ax, key, what in ((axes[0], "enc", "encode"), (axes[1], "dec", "decode")):
        pts, labels, colors = [], [], []
        for ct, r in results:
            ref = ct.kind == "reference"
            y = r["err"] if r["err"] > 0 else floor
            color = "tab:red" if ref else ("0.3" if r["err"] == 0 else "tab:blue")
            ax.scatter([r[key]], [y], marker="s" if ref else "o", s=40 if ref else 22,
                       facecolors="none" if ref else color, edgecolors=color, linewidths=1.3, zorder=3)
            pts.append((r[key], y))
            labels.append(ct.label.replace(" greedy (200, 0.16)", " greedy"))
            colors.append(color)
        ax.set(xscale="log", yscale="log", xlabel=f"{what} GB/s of fp32 data (log)",
               ylabel="relative L2 error (log)", title=f"{what} speed against error")
        xs = [p[0] for p in pts]
        ax.set_xlim(min(xs) / 3, max(xs) * 3)
        ax.set_ylim(floor / 3, max(p[1] for p in pts) * 3)
        ax.grid(True, which="major", alpha=0.3)
        placed = []
        if any(r["err"] == 0 for _, r in results):
            ax.axhline(floor, color="0.6", lw=0.8, ls="--")
            t = ax.text(0.01, floor, " error 0 (lossless), drawn on this line", transform=ax.get_yaxis_transform(),
                        ha="left", va="bottom", fontsize=7, color="0.4")
            fig.canvas.draw()
            placed.append(t.get_window_extent(fig.canvas.get_renderer()))
        fig.canvas.draw()
        _place_labels(ax, fig, pts, labels, colors, placed)
    axes[0].scatter([], [], marker="o", s=22, color="tab:blue", label="cnrstore codec")
    axes[0].scatter([], [], marker="s", s=40, facecolors="none", edgecolors="tab:red", label="FBGEMM kernel (reference)")
    fig.legend(loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmark every registered codec beside FBGEMM's kernels.")
    p.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run (< 30 s)")
    p.add_argument("--repeat", type=int, default=None, help="repetitions per measurement (default 3)")
    p.add_argument("--rows", type=int, default=None, help="rows of dim 64 (default 1000000; 100000 with --quick)")
    p.add_argument("--slow-rows", type=int, default=None,
                   help="rows for slow codecs, and for the error of every codec (default 50000; 10000 with --quick)")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--plot", default="none",
                   help="write a PNG of speed against error (e.g. benchmarks/codecs.png); 'none' (default): no plot")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 3
    if args.rows is None:
        args.rows = 100_000 if args.quick else 1_000_000
    if args.slow_rows is None:
        args.slow_rows = 10_000 if args.quick else 50_000
    args.slow_rows = min(args.slow_rows, args.rows)
    if args.repeat < 1 or args.rows < 1 or args.slow_rows < 1:
        p.error("--repeat, --rows and --slow-rows must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    head = machine_description()
    load_start = load_average()
    for line in head:
        print(line, flush=True)
    x = embedding_rows(args.rows, args.seed)
    contenders = [codec_contender(n) for n in codecs.names()] + fbgemm_contenders()
    results = []
    for ct in contenders:
        log(f"{ct.label} ...")
        r = measure(ct, x, args)
        log(f"  encode {r['rows']:,} rows x {r['reps']}: {r['enc_s'] * 1e3:.0f} ms; decode {r['dec_rows']:,} rows "
            f"x {r['dec_reps']}: {r['dec_s'] * 1e3:.0f} ms; rel. L2 error {r['err']:.4g}")
        results.append((ct, r))
    elapsed = time.perf_counter() - t_start

    header = ["codec", "kind", "rows timed", "encode GB/s", "decode GB/s", "rel. L2 error",
              "bytes/row d=64", "bytes/row d=128"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for ct, r in results:
        rows = f"{r['rows']:,}" + ("" if r["reps"] == args.repeat else f" ({r['reps']} reps)")
        if r["dec_rows"] != r["rows"] or r["dec_reps"] != args.repeat:
            rows += f"; decode {r['dec_rows']:,}" + ("" if r["dec_reps"] == args.repeat else f" ({r['dec_reps']} reps)")
        if r["err_rows"] != args.slow_rows:
            rows += f"; error over {r['err_rows']:,}"
        lines.append("| " + " | ".join([
            f"`{ct.label}`" if ct.kind != "reference" else ct.label, ct.kind, rows, fmt_rate(r["enc"]),
            fmt_rate(r["dec"]), f"{r['err']:.4f}", str(ct.row_bytes(64)), str(ct.row_bytes(128)),
        ]) + " |")

    notes = []
    by_label = {ct.label: (ct, r) for ct, r in results}
    for bits in (4, 2):
        greedy = by_label.get(f"FBGEMM {bits}-bit greedy (200, 0.16)")
        plain = by_label.get(f"FBGEMM {bits}-bit")
        for ct, r in results:
            if ct.kind == "reference" or ct.bits != bits:
                continue
            parts = []
            if plain:
                parts.append(f"error {r['err'] / plain[1]['err']:.3f}x FBGEMM plain")
            if greedy:
                parts.append(f"error {r['err'] / greedy[1]['err']:.3f}x FBGEMM greedy, encode "
                             f"{r['enc'] / greedy[1]['enc']:.1f}x its speed")
            if parts:
                notes.append(f"`{ct.label}`: " + "; ".join(parts))

    report = "\n".join([
        "## cnrstore codec benchmark", "",
        *[f"- {line}" for line in head],
        f"- rows: {args.rows:,} x {DIM} fp32 ~ N(0, 0.1) x per-row log-normal scale (sigma 0.5), seed {args.seed}; "
        f"median of {args.repeat} reps{' (--quick)' if args.quick else ''}; total run {elapsed:.0f} s",
        f"- codecs that encode under {SLOW_BYTES_PER_S / 1e6:g} MB/s are timed on the first "
        f"{args.slow_rows:,} rows ('rows timed'), and decoded on those encoded rows repeated to {args.rows:,}; "
        f"the relative L2 error is over the first {args.slow_rows:,} rows for every row of the table",
        "- GB/s of fp32 data; encode with check=False as the store's writer calls it; FBGEMM rows call the "
        "kernels directly (the int4/int2 codecs are the same kernels behind the codec interface)",
        f"- load average (1/5/15 min) at start: {load_start}; at end: {load_average()} "
        f"(a shared machine: other processes compete for the {os.cpu_count()} cores)",
        "",
        *lines,
        "",
        *[f"- {note}" for note in notes],
    ])
    publish(report + "\n", args.out, args.plot, lambda path: plot(results, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
