#!/usr/bin/env python3
"""The user's verdict at the top of RESULTS.md: "DCP or cnrstore?", read off the sections below it.

Nothing here is measured: every figure is parsed from a table that a benchmark wrote into the same
RESULTS.md (``bench_peers``, ``bench_torchrec``, ``bench_restore``, ``bench_accuracy``), so the verdict
always says what the sections under it say; a row whose section is missing or failed reads "not in this
file". ``make_results.py`` calls :func:`verdict` on the file it assembles; run this module on a
RESULTS.md to print the table (``python benchmarks/verdict.py benchmarks/RESULTS.md``), with ``--write`` to
put it in place in that file (after sections were re-run alone and spliced in).
"""

from __future__ import annotations

import re
import sys

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
         "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}

#: the cnrstore configurations the verdict quotes (names as the benchmarks print them)
PEERS_CNR = "cnrstore, incremental + keep-last"
PEERS_CNR_INT8 = "cnrstore, incremental + keep-last, optimizer int8"
MISSING = "not in this file"

#: the lossless comparisons' section headings (bench_peers --codec fp32 --title ...), as make_results runs them
LOSSLESS_LOW = "Lossless against the peers: the reference DLRM's touched share"
LOSSLESS_HIGH = "Lossless against the peers: a fifth of the rows touched per save"
#: where the verdict's rows come from: a table (its first two headers) and how the row names it; a key with a
#: section heading looks for the table in that section only
SOURCES = {
    "lossless": (("method", "bytes written / interval (median)"), "Lossless, ~0.4% touched (1 GiB DLRM)",
                 LOSSLESS_LOW),
    "lossless20": (("method", "bytes written / interval (median)"), "Lossless, ~20% touched (256 MiB DLRM)",
                   LOSSLESS_HIGH),
    "peers": (("method", "bytes written / interval (median)"), "Against the peers (1 GiB DLRM, 1 process)"),
    "torchrec": (("method", "trainer stall / save (median)"), "TorchRec (DMP, 2 ranks)"),
    "s3": (("method", "save 0"), "Checkpoints on S3 (fp32, moto in its own process)"),
    "dist_s3": (("method", "save 0 stall"), "Many nodes, one bucket"),
    "serving": (("method", "bytes read per update (median)"), "Serving follows training"),
    "restore_rss": (("method", "peak RSS (ru_maxrss)"), "Restore's peak memory (issue 37's trainer, fresh process)"),
}
#: (question, source, DCP's row, its label, cnrstore's row, its label, the column both are read from)
LOSSLESS_ROWS = [
    ("training stall per save (median)", "trainer stall (median)", "DCP async_save", "async_save"),
    ("worst stall of the run (p100, baseline included)", "stall (max)", "DCP async_save", "async_save"),
    ("bytes written per save", "bytes written / interval (median)", "DCP async_save", "async_save"),
    ("save until durable", "until durable (median)", "DCP async_save", "async_save"),
    ("host memory a save holds (peak)", "host memory held (max)", "DCP async_save", "async_save"),
    ("restore the newest into a freshly built model", "restore newest (median)", "DCP save", "save"),
]
ROWS = [
    *[(f"Lossless, ~0.4% of rows changed: {what}", "lossless", dcp, label, PEERS_CNR, "fp32", column)
      for what, column, dcp, label in LOSSLESS_ROWS],
    *[(f"Lossless, ~20% of rows changed: {what}", "lossless20", dcp, label, PEERS_CNR, "fp32", column)
      for what, column, dcp, label in LOSSLESS_ROWS],
    ("Training stall per save", "peers", "DCP async_save", "async_save", PEERS_CNR, "adaptive4",
     "trainer stall (median)"),
    ("Bytes written per save", "peers", "DCP async_save", "async_save", PEERS_CNR, "adaptive4",
     "bytes written / interval (median)"),
    ("... with the optimizer state in int8", "peers", "DCP async_save", "async_save", PEERS_CNR_INT8,
     "adaptive4 + int8 state", "bytes written / interval (median)"),
    ("Save until durable", "peers", "DCP async_save", "async_save", PEERS_CNR, "adaptive4", "until durable (median)"),
    ("Disk, last 5 checkpoints kept", "peers", "DCP save", "save", PEERS_CNR, "adaptive4", "disk, last 5 kept"),
    ("Restore the newest into a freshly built model", "peers", "DCP save", "save", PEERS_CNR, "adaptive4",
     "restore newest (median)"),
    ("TorchRec: training stall per save", "torchrec", "DCP async_save", "async_save", "cnrstore, int4", "int4",
     "trainer stall / save (median)"),
    ("TorchRec: bytes per save", "torchrec", "DCP async_save", "async_save", "cnrstore, int4", "int4",
     "bytes on disk / save (median)"),
    ("TorchRec: bytes per save, lossless", "torchrec", "DCP async_save", "async_save", "cnrstore, fp32", "fp32",
     "bytes on disk / save (median)"),
    ("TorchRec: restore the newest", "torchrec", "DCP async_save", "async_save", "cnrstore, fp32", "fp32",
     "restore newest"),
    ("S3: seconds per save", "s3", "DCP FsspecWriter -> S3", "FsspecWriter", "cnrstore -> S3", "fp32, remote tier",
     "later saves (median)"),
    ("S3: bytes uploaded per save", "s3", "DCP FsspecWriter -> S3", "FsspecWriter", "cnrstore -> S3",
     "fp32, remote tier", "later save uploaded (median)"),
    ("S3: restore on a fresh machine", "s3", "DCP FsspecWriter -> S3", "dcp.load", "cnrstore -> S3",
     "fp32, remote tier", "restore newest, fresh machine"),
    ("Bucket, 2 ranks: stall per save (median)", "dist_s3", "DCP FsspecWriter -> S3", "FsspecWriter, blocking",
     "cnrstore -> S3", "fp32, bucket root", "later stall (median)"),
    ("Bucket, 2 ranks: bytes uploaded per save", "dist_s3", "DCP FsspecWriter -> S3", "FsspecWriter",
     "cnrstore -> S3", "fp32, bucket root", "later uploaded (median)"),
    ("Serving: bytes a replica reads per update", "serving", "dcp.load of a full checkpoint", "dcp.load",
     "cnrstore follower", "fp32, changed rows", "bytes read per update (median)"),
    ("Serving: time a replica takes per update", "serving", "dcp.load of a full checkpoint", "dcp.load",
     "cnrstore follower", "fp32, changed rows", "update time (median)"),
    ("Bucket, 2 ranks: a lost node's replacement restores", "dist_s3", "DCP FsspecWriter -> S3", "dcp.load",
     "cnrstore -> S3", "fp32, empty directory", "restore, node lost (rank 1)"),
    ("Restore: peak RSS of the restoring process", "restore_rss", "dcp.load", "dcp.load", "cnrstore", "fp32",
     "peak RSS (ru_maxrss)"),
]


def quantity(cell: str) -> float | None:
    """The value of a cell such as ``2.0 GiB`` or ``51.3 ms`` in bytes or seconds (None if not one)."""
    m = re.match(r"\s*\**([0-9][0-9,]*(?:\.[0-9]+)?)\s*(B|KiB|MiB|GiB|TiB|us|µs|ms|s)\b", cell)
    return float(m.group(1).replace(",", "")) * UNITS[m.group(2)] if m else None


def table(md: str, first_header: str, second_header: str | None = None) -> list[dict[str, str]]:
    """The rows (header -> cell) of the first markdown table in ``md`` whose header row starts with
    ``| first_header | second_header``; [] if there is none."""
    lines = md.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first_header and (second_header is None or cells[1:2] == [second_header]):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                values = [c.strip() for c in row.strip().strip("|").split("|")]
                rows.append(dict(zip(cells, values)))
            return rows
    return []


def row(rows: list[dict], **match) -> dict | None:
    """The first row whose cells equal ``match`` (keys are headers; spaces as underscores not needed)."""
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def ratio(theirs: str, ours: str) -> str:
    """``theirs / ours`` as ``12.3x``, or '-' when either is not a quantity."""
    a, b = quantity(theirs), quantity(ours)
    if not a or not b:
        return "-"
    return f"{a / b:.1f}x" if a >= b else f"{a / b:.2f}x (DCP ahead)"


def verdict(md: str) -> str:
    """The verdict section (markdown) for a RESULTS.md whose sections are ``md``."""
    out = []

    def line(question, dcp_label, dcp, cnr_label, cnr, where):
        if dcp is None or cnr is None:
            out.append(f"| {question} | {MISSING} | | | {where} |")
            return
        out.append(f"| {question} | {dcp} ({dcp_label}) | {cnr} ({cnr_label}) | {ratio(dcp, cnr)} | {where} |")

    get = (lambda r, k: r.get(k) if r else None)
    acc = table(md, "paper's cell", "family")
    a4 = row(acc, codec="adaptive4")
    lossy = f"lossy: {a4['logloss degradation']} logloss after 20 restores" if a4 else "lossy"
    for question, source, dcp_method, dcp_label, cnr_method, cnr_label, column in ROWS:
        header, where, *heading = SOURCES[source]
        rows = {r["method"]: r for r in table(section(md, heading[0]) if heading else md, *header)}
        if not cnr_label.startswith("fp32"):  # a quantized codec: say so, and what it cost where measured
            cnr_label = f"{cnr_label}; {lossy if cnr_label.startswith('adaptive4') else 'lossy'}"
        line(question, dcp_label, get(rows.get(dcp_method), column), cnr_label,
             get(rows.get(cnr_method), column), where)

    rest = table(md, "state", "method")
    first_state = rest[0]["state"] if rest else None
    r_dcp = row(rest, state=first_state, method="dcp.load")
    r32 = row(rest, state=first_state, method="cnrstore fp32")
    line(f"Restore into the live model ({first_state} state)", "dcp.load", get(r_dcp, "restore (median)"),
         "fp32", get(r32, "restore (median)"), "Restore into a live model")

    i8 = row(acc, codec="int8")
    accuracy = []
    if a4:
        accuracy.append(f"adaptive4 after 20 restores: {a4['logloss degradation']} logloss ({a4['verdict']})")
    if i8:
        accuracy.append(f"int8 after 40 restores: {i8['logloss degradation']} ({i8['verdict']})")

    head = [TITLE, "",
            "Read off the sections below (each measured on this 2-core CPU machine, in one run; ratios are DCP's "
            "figure over cnrstore's, so above 1x cnrstore is ahead). DCP writes every byte of the state at every "
            "save; cnrstore writes the rows touched since the previous save. The first rows are lossless on both "
            "sides (fp32 tables, fp32 optimizer state: what a DCP user switching with the defaults gets), at the "
            "reference DLRM's share of rows touched per save and at a fifth of them; the quantized rows after them "
            "are lossy, and say what it cost in accuracy.", "",
            "| what you pay | DCP | cnrstore | DCP / cnrstore | measured in |", "|---|---:|---:|---:|---|", *out, "",
            "When to stay with DCP, or choose cnrstore's lossless settings:", "",
            "- **Accuracy.** fp32 (and the optimizer state, by default) is restored bit-exactly. Quantized weights "
            "are not: " + ("; ".join(accuracy) if accuracy else MISSING) + " against the same run without "
            "failures (Accuracy section; the bound the paper promises is 0.01%). The README's decision table says "
            "which codec to pick for how many restores you expect.",
            "- **Optimizers that move untouched rows, and GPU tables.** cnrstore writes a save of a CPU table "
            "trained by Adagrad, SparseAdam or plain SGD from the live tensors (streamed saves: the worst stall and "
            "host memory rows above). With Adam-like optimizers, weight decay, TorchRec's fused optimizers or CUDA "
            "tables it copies the save's rows inside save(): its first save of a run (a baseline) then stalls for a "
            "copy of every row and holds it in host memory, as DCP async_save's every save does.",
            "- **Dense models.** cnrstore saves dense layers whole at every save, as DCP does: its gain is in "
            "embedding tables of which a save touches a small share (at a fifth of the rows touched, a few times "
            "DCP's figures, not the hundreds at the reference DLRM's share).",
            "- **Where these figures come from.** A 2-core CPU machine; GPU figures, where a GPU was lent, are in "
            "the GPU section. Your step time, touched-row share and storage decide the ratios: re-run "
            "`make bench` on your own hardware before you commit to them.", ""]
    return "\n".join(head)


TITLE = "## The verdict: DCP or cnrstore?"


def section(md: str, heading: str) -> str:
    """The text of the ``## `` section of ``md`` whose heading starts with ``heading`` ("" if none)."""
    for part in re.split(r"(?m)^(?=## )", md):
        if part.startswith("## " + heading):
            return part
    return ""


def put(md: str) -> str:
    """``md`` with its verdict section replaced (or, if it has none, inserted before its first section)."""
    sections = re.split(r"(?m)^(?=## )", md)
    sections = [s for s in sections if not s.startswith(TITLE)]
    body = "".join(sections)
    table = verdict(body) + "\n"
    at = next((i for i, s in enumerate(sections) if s.startswith("## ")), len(sections))
    return "".join(sections[:at]) + table + "".join(sections[at:])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    write = "--write" in argv
    paths = [a for a in argv if a != "--write"]
    if len(paths) != 1:
        print("usage: python benchmarks/verdict.py RESULTS.md [--write]", file=sys.stderr)
        return 2
    with open(paths[0]) as f:
        md = f.read()
    if write:
        with open(paths[0], "w") as f:
            f.write(put(md))
    else:
        print(verdict(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
