"""cnrstore/arguments.py: the argument checks every write and read path shares. Each refuses with
InvalidArgument naming the table, the first offending row and the fix; each accepts what API.md allows.
(The same checks as a caller meets them: test_writer.py, test_store.py, test_limits.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from cnrstore import knobs
from cnrstore.engine import record, arguments
from cnrstore.errors import InvalidArgument


def test_row_ids_become_int64_and_may_repeat():
    for rows in ([3, 1, 3], np.array([3, 1, 3], dtype=np.uint8), (3, 1, 3), np.array([3, 1, 3], dtype=np.uint64)):
        out = arguments.row_ids(rows, 4, "t")
        assert out.dtype == np.int64 and out.tolist() == [3, 1, 3]
    assert arguments.row_ids([], 4, "t").dtype == np.int64


@pytest.mark.parametrize("rows,why", [
    ([0, 4], "row 4 of table 't' is outside \\[0, 4\\)"),
    ([-1], "row -1 "),
    ([2**70], "row 1180591620717411303424 "),
    (np.array([2**63], dtype=np.uint64), "row 9223372036854775808 "),
    ([[1, 2]], "1-D"),
    ([1.0], "integers, got dtype float64"),
    ([True], "integers, got dtype bool"),
])
def test_row_ids_outside_the_table_or_not_integers_are_refused(rows, why):
    with pytest.raises(InvalidArgument, match=why):
        arguments.row_ids(rows, 4, "t")


def test_sorted_unique_rows_gives_the_sorting_permutation_or_names_a_duplicate():
    assert arguments.sorted_unique_rows(np.array([1, 2, 5]), "t") is None
    order = arguments.sorted_unique_rows(np.array([5, 1, 2]), "t")
    assert order.tolist() == [1, 2, 0]
    with pytest.raises(InvalidArgument, match="row 2 of table 't' is put twice"):
        arguments.sorted_unique_rows(np.array([5, 2, 1, 2]), "t")


def test_row_values_become_contiguous_float32_with_their_range():
    values = np.arange(6, dtype=np.float64).reshape(2, 3)[:, ::-1]      # not contiguous, float64
    out, (lo, hi) = arguments.row_values(values, np.array([0, 1]), 3, "t")
    assert out.dtype == np.float32 and out.flags.c_contiguous and (lo, hi) == (0.0, 5.0)
    assert np.array_equal(out, values)


@pytest.mark.parametrize("values,why", [
    (np.zeros((2, 4), np.float32), "shape \\(2, 3\\)"),
    (np.zeros((2, 3), np.int32), "floating point"),
    (np.array([[0, 0, 0], [0, np.inf, 0]], np.float32), "row 11 of table 't' are not finite"),
    (np.array([[0, 0, 0], [1e39, 0, 0]], np.float64), "beyond float32 range"),
])
def test_row_values_of_the_wrong_shape_type_or_not_finite_are_refused(values, why):
    with pytest.raises(InvalidArgument, match=why):
        arguments.row_values(values, np.array([10, 11]), 3, "t")


@pytest.mark.parametrize("value,ok", [("emb", True), ("", False), ("a\x00b", False), ("x" * 401, False),
                                      (3, False), ("é" * 200, True), ("é" * 201, False)])
def test_names_are_short_strings_without_nul(value, ok):
    if ok:
        assert arguments.name(value, "table name") == value
    else:
        with pytest.raises(InvalidArgument, match="table name must be"):
            arguments.name(value, "table name")


@pytest.mark.parametrize("fn,good,bad", [
    (lambda v: arguments.positive_int(v, "n"), [1, np.int64(7)], [0, -1, True, 1.0]),
    (arguments.version_arg, [None, 0, 2**70, np.uint64(5)], [-1, True, 1.5, "1"]),
    (arguments.step_arg, [None, -2**63, 2**64 - 1], [2**64, -2**63 - 1, False, 1.0]),
    (lambda v: arguments.number(v, "x"), [0, 2.5, np.float32(0.5), np.int64(3)],
     [-1, True, "1", None, float("nan"), float("inf"), -float("inf")]),
    (lambda v: arguments.number(v, "x", positive=True), [1e-9, 3], [0, 0.0, -0.5, float("inf"), False]),
], ids=["positive_int", "version_arg", "step_arg", "number", "positive number"])
def test_number_arguments(fn, good, bad):
    for v in good:
        assert fn(v) == v
    for v in bad:
        with pytest.raises(InvalidArgument):
            fn(v)


def test_what_fits_a_record_follows_the_record_size_knob(monkeypatch):
    assert arguments.max_dense_bytes() == knobs.MAX_RECORD_BYTES - record.HEADER_BYTES - record.TRAILER_BYTES - 656
    rows = arguments.max_block_rows(4)
    assert rows & (rows - 1) == 0 and rows >= 65536
    monkeypatch.setattr(knobs, "MAX_RECORD_BYTES", 10_000)
    rows = arguments.max_block_rows(4)
    widest = arguments.widest_row_bytes(4)
    assert record.HEADER_BYTES + record.TRAILER_BYTES + rows * (2 + widest) <= 10_000
    assert record.HEADER_BYTES + record.TRAILER_BYTES + 2 * rows * (2 + widest) > 10_000   # the largest power of 2
    arguments.dense_size("d", np.zeros(arguments.max_dense_bytes(), np.uint8))
    with pytest.raises(InvalidArgument, match="split the dense array"):
        arguments.dense_size("d", np.zeros(arguments.max_dense_bytes() + 1, np.uint8))
    arguments.table_shape("t", 10, 100)
    with pytest.raises(InvalidArgument, match="does not fit one record"):
        arguments.table_shape("t", 10, 10_000)
    with pytest.raises(InvalidArgument, match="2\\*\\*63-1"):
        arguments.table_shape("t", 2**63, 1)


@pytest.mark.parametrize("value,out", [(None, None), ("t", ["t"]), (["a", "b"], ["a", "b"]), (("a",), ["a"]),
                                       ({"a": 1}, ["a"]), (iter(["a"]), ["a"]), ([], [])])
def test_table_names_are_none_a_name_or_names(value, out):
    assert arguments.table_names(value) == out


@pytest.mark.parametrize("value,why", [(5, "got 5$"), (b"t", "got b't'$"), ([5], "got 5 in \\[5\\]"),
                                       (["a", None], "got None in \\['a', None\\]"), (bytearray(b"t"), "got bytearray")])
def test_table_names_of_another_type_are_refused_naming_the_argument(value, why):
    with pytest.raises(InvalidArgument, match="^names must be None, a name or an iterable of names \\(str\\), " + why):
        arguments.table_names(value, "names")


def test_versions_that_mean_a_committed_one_and_flags():
    assert arguments.version_arg(np.int64(1), "v", least=1, optional=False) == 1
    for bad in (0, None, True):
        with pytest.raises(InvalidArgument, match="^v must be a version number \\(an integer >= 1\\), got"):
            arguments.version_arg(bad, "v", least=1, optional=False)
    assert arguments.flag(True, "encoded") is True and arguments.flag(np.bool_(False), "encoded") is False
    for bad in (None, 1, "no"):
        with pytest.raises(InvalidArgument, match="^encoded must be True or False"):
            arguments.flag(bad, "encoded")
