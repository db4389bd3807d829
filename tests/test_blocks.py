"""Block math (cnrstore/engine/blocks.py): each function against its definition, row by row, on small tables."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import blocks, arguments
from cnrstore import knobs


@pytest.mark.parametrize("block_rows,num_rows", [(1, 5), (64, 64), (64, 65), (64, 1000), (1 << 16, 70_000)])
def test_block_math_matches_the_row_by_row_definition(block_rows, num_rows):
    rng = np.random.default_rng(block_rows + num_rows)
    rows = np.unique(rng.integers(0, num_rows, size=min(num_rows, 300), dtype=np.int64))
    got = blocks.of_rows(rows, block_rows)
    assert got.tolist() == [r // block_rows for r in rows.tolist()]
    starts, bounds = blocks.runs(got)
    assert bounds[-1] == rows.size and np.array_equal(starts, bounds[:-1])
    expected_starts = [i for i in range(rows.size) if i == 0 or got[i] != got[i - 1]]
    assert starts.tolist() == expected_starts
    n_blocks = blocks.count(num_rows, block_rows)
    assert n_blocks == len(range(0, num_rows, block_rows))
    for b in range(n_blocks):
        assert blocks.base(b, block_rows) == b * block_rows
        assert blocks.length(b, block_rows, num_rows) == len(range(b * block_rows, num_rows)[:block_rows])
    bases = np.arange(n_blocks, dtype=np.int64) * block_rows
    assert blocks.lengths(bases, block_rows, num_rows).tolist() == [
        blocks.length(b, block_rows, num_rows) for b in range(n_blocks)]


def test_runs_of_no_rows_is_empty():
    starts, bounds = blocks.runs(np.zeros(0, dtype=np.int64))
    assert starts.size == 0 and bounds.tolist() == [0]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 63, 64, 65, (1 << 40) + 7])
def test_floor_pow2(n):
    p = blocks.floor_pow2(n)
    assert p & (p - 1) == 0 and (p <= n or n < 1) and (2 * p > n)


@pytest.mark.parametrize("codec,dim", [("int4", 1), ("int4", 64), ("fp32", 128), ("fp32", 4096), ("int8", 100_000)])
def test_created_table_gets_the_default_block_rows(tmp_path, codec, dim):
    row_bytes = cnrstore.codecs.get(codec).row_bytes(dim)
    fit = knobs.BLOCK_TARGET_BYTES // row_bytes
    expected = knobs.MAX_BLOCK_ROWS
    while expected > fit and expected > knobs.MIN_BLOCK_ROWS:
        expected //= 2
    expected = min(expected, arguments.max_block_rows(dim))
    assert blocks.default_block_rows(row_bytes, arguments.max_block_rows(dim), knobs.BLOCK_TARGET_BYTES,
                                     knobs.MIN_BLOCK_ROWS) == expected
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        assert store.create_table("t", 10, dim, codec=codec).block_rows == expected


def test_cli_touches_no_private_attribute_of_a_store():
    """The CLI goes through Store's API and the engine's module functions, never ``store._...``."""
    tree = ast.parse(pathlib.Path(cnrstore.__file__).with_name("cli.py").read_text())
    private = [(node.lineno, node.attr) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and isinstance(node.value, ast.Name) and node.value.id == "store" and node.attr.startswith("_")]
    assert private == []
