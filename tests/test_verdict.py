"""benchmarks/verdict.py: the table that opens RESULTS.md says what the sections below it measured."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import verdict  # noqa: E402

PEERS = """## Against the peers

| method | bytes written / interval (median) | trainer stall (median) | until durable (median) | restore newest (median) | disk, last 5 kept |
|---|---:|---:|---:|---:|---:|
| cnrstore, incremental + keep-last | 10.0 MiB | 20.0 ms | 300.0 ms | 1.00 s | 1.0 GiB |
| DCP save | 2.0 GiB | 2.00 s | 2.00 s | 2.00 s | 10.0 GiB |
| DCP async_save | 2.0 GiB | 1.00 s | 3.00 s | 2.50 s | 10.0 GiB |
"""


def rows_of(md: str) -> dict[str, list[str]]:
    out = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5:
            out[cells[0]] = cells
    return out


def test_ratios_are_dcp_over_cnrstore_from_the_sections_own_cells():
    rows = rows_of(verdict.verdict(PEERS))
    assert rows["Training stall per save"][1:4] == ["1.00 s (async_save)", "20.0 ms (adaptive4; lossy)", "50.0x"]
    assert rows["Bytes written per save"][3] == "204.8x"
    assert rows["Restore the newest into a freshly built model"][3] == "2.0x"
    # a slower cnrstore says so rather than printing a ratio below 1 as a win
    slow = PEERS.replace("| 300.0 ms |", "| 6.00 s |")
    assert rows_of(verdict.verdict(slow))["Save until durable"][3] == "0.50x (DCP ahead)"


def test_a_section_that_is_missing_reads_not_in_this_file():
    rows = rows_of(verdict.verdict(PEERS))
    assert rows["TorchRec: training stall per save"][1] == verdict.MISSING
    assert "not in this file" in verdict.verdict("")


def test_put_replaces_the_verdict_in_place():
    md = "# Benchmark results\nintro\n\n" + PEERS
    once = verdict.put(md)
    assert once.index(verdict.TITLE) < once.index("## Against the peers")
    assert verdict.put(once) == once  # idempotent: one verdict, re-read from the sections


@pytest.mark.parametrize("cell, value", [("2.0 GiB", 2 << 30), ("51.3 ms", 0.0513), ("**42.8x**", None),
                                         ("1,024 B", 1024), ("-", None)])
def test_quantity(cell, value):
    assert verdict.quantity(cell) == (pytest.approx(value) if value is not None else None)


def test_the_committed_results_file_opens_with_its_own_verdict():
    with open(os.path.join(HERE, "..", "benchmarks", "RESULTS.md")) as f:
        md = f.read()
    assert verdict.put(md) == md, "RESULTS.md's verdict is stale: run python benchmarks/verdict.py benchmarks/RESULTS.md --write"


def test_the_lossless_rows_come_first_from_their_own_sections_and_quantized_ones_say_they_are_lossy():
    """The lossless comparisons (bench_peers --codec fp32) are read from their own sections (the same table
    headers as the quantized run's), lead the table, and carry the worst stall and the host memory held."""
    lossless = PEERS.replace("## Against the peers", f"## {verdict.LOSSLESS_LOW}").replace(
        "cnrstore, incremental + keep-last |", "cnrstore, incremental + keep-last |", 1)
    md = lossless + "\n" + PEERS
    table = verdict.verdict(md)
    rows = rows_of(table)
    first = [line for line in table.splitlines() if line.startswith("| ")][1]
    assert first.startswith("| Lossless, ~0.4% of rows changed: training stall per save")
    assert rows["Lossless, ~0.4% of rows changed: training stall per save (median)"][2] == "20.0 ms (fp32)"
    assert rows["Lossless, ~20% of rows changed: bytes written per save"][1] == verdict.MISSING
    assert "lossy" in rows["Training stall per save"][2]
