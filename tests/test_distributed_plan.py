"""cnrstore/distributed/plan.py: a sharding plan cuts every table into contiguous row ranges, one per
holding rank, covering the table exactly once, and round-trips through the dict stored with each global
version. (``from_torchrec`` reads a TorchRec model: test_torchrec.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from cnrstore.distributed import Shard, ShardingPlan
from cnrstore.errors import InvalidArgument


def test_plans_cover_every_row_once():
    tables = {"a": (10, 4), "b": (3, 2), "c": (50, 1)}
    for world in (1, 2, 3, 4, 7):
        for plan in (ShardingPlan.row_wise(tables, world), ShardingPlan.table_wise(tables, world)):
            assert ShardingPlan.from_dict(plan.to_dict()) == plan
            for name, (rows, _dim) in tables.items():
                cover = np.zeros(rows, dtype=int)
                for s in plan.shards_of_table(name):
                    cover[s.row_start:s.row_end] += 1
                assert (cover == 1).all()
            assert sum(plan.rows_of(r) for r in range(world)) == plan.total_rows() == 63


def test_row_wise_cuts_near_equal_ranges_in_rank_order_and_skips_ranks_beyond_the_rows():
    plan = ShardingPlan.row_wise({"a": (10, 4), "b": (2, 8)}, 4)
    assert [(s.rank, s.row_start, s.row_end) for s in plan.shards_of_table("a")] == [
        (0, 0, 2), (1, 2, 5), (2, 5, 7), (3, 7, 10)]
    assert [(s.rank, s.row_start, s.row_end) for s in plan.shards_of_table("b")] == [(1, 0, 1), (3, 1, 2)]
    assert set(plan.shards_of(0)) == {"a"} and plan.shards_of(1)["b"] == Shard("b", 1, 0, 1)
    assert plan.rows_of(1) == 4 and plan.shards_of(1)["a"].num_rows == 3


def test_table_wise_puts_the_largest_tables_first_on_the_least_loaded_rank():
    # bytes: big 100x8 = 800, mid 50x8 = 400, small1 30x10 = 300, small2 10x10 = 100
    plan = ShardingPlan.table_wise({"small2": (10, 10), "mid": (50, 8), "big": (100, 8), "small1": (30, 10)}, 2)
    owner = {s.table: s.rank for s in plan.shards}
    assert owner == {"big": 0, "mid": 1, "small1": 1, "small2": 1}      # 800 | 400 + 300 + 100
    assert all(s.row_start == 0 and s.row_end == plan.tables[s.table][0] for s in plan.shards)


def test_the_stored_dict_keeps_the_row_numbering_and_other_plans_compare_unequal():
    plan = ShardingPlan({"a": (4, 2)}, [Shard("a", 0, 0, 4)], 1, row_ids="global")
    d = plan.to_dict()
    assert d["row_ids"] == "global" and ShardingPlan.from_dict(d).row_ids == "global"
    assert "row_ids" not in ShardingPlan.row_wise({"a": (4, 2)}, 1).to_dict()      # "local": as older plans
    assert ShardingPlan.from_dict(d) == plan and hash(ShardingPlan.from_dict(d)) == hash(plan)
    assert plan != ShardingPlan.row_wise({"a": (4, 2)}, 1)
    assert ShardingPlan.row_wise({"a": (4, 2)}, 2) != ShardingPlan.row_wise({"a": (4, 2)}, 1)


def test_plan_errors_say_what_is_wrong():
    with pytest.raises(InvalidArgument, match="cover"):
        ShardingPlan({"a": (10, 4)}, [Shard("a", 0, 0, 5)], 2)
    with pytest.raises(InvalidArgument, match="two shards"):
        ShardingPlan({"a": (10, 4)}, [Shard("a", 0, 0, 5), Shard("a", 0, 5, 10)], 2)
    with pytest.raises(InvalidArgument, match="rank must be"):
        ShardingPlan({"a": (10, 4)}, [Shard("a", 2, 0, 10)], 2)
    with pytest.raises(InvalidArgument, match="world_size"):
        ShardingPlan.row_wise({"a": (10, 4)}, 0)
    with pytest.raises(InvalidArgument, match="shape"):
        ShardingPlan({"a": 10}, [], 1)


@pytest.mark.parametrize("tables,shards,why", [
    ({"a": (10, 4)}, [Shard("a", 0, 0, 4), Shard("a", 1, 5, 10)], "exactly once"),       # a gap
    ({"a": (10, 4)}, [Shard("a", 0, 0, 6), Shard("a", 1, 4, 10)], "exactly once"),       # an overlap
    ({"a": (10, 4)}, [Shard("b", 0, 0, 10)], "does not list"),
    ({"a": (10, 4)}, [("a", 0, 0, 10)], "Shard objects"),
    ({"a": (0, 4)}, [], "positive"),
    ({"": (1, 1)}, [], "non-empty strings"),
])
def test_a_cut_that_is_not_one_exact_cover_is_refused(tables, shards, why):
    with pytest.raises(InvalidArgument, match=why):
        ShardingPlan(tables, shards, 2)


@pytest.mark.parametrize("data", [{}, {"tables": {"a": [4, 2]}, "shards": [["a", 0, 0]], "world_size": 1},
                                  {"tables": [], "shards": [], "world_size": 1},
                                  {"tables": {}, "shards": [], "world_size": 1, "row_ids": "other"}])
def test_a_description_that_is_no_plan_is_an_invalid_argument(data):
    with pytest.raises(InvalidArgument):
        ShardingPlan.from_dict(data)
