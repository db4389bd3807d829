"""Sharding plans: which rank holds which rows of which embedding table.

A plan names every embedding table of the model with its global shape, and cuts each table into shards:
contiguous row ranges ``[row_start, row_end)``, each held by one rank, together covering the table exactly
once. A rank holds at most one shard of a table; its module for that table is an ``nn.Embedding`` /
``nn.EmbeddingBag`` of ``row_end - row_start`` rows at the module path named like the table, and its row
``i`` is the table's row ``row_start + i``.

- ``ShardingPlan.row_wise(tables, world_size)`` cuts every table into ``world_size`` near-equal ranges
  (ranks beyond a table's row count get no shard of it);
- ``ShardingPlan.table_wise(tables, world_size)`` puts each table whole on one rank, largest first on the
  least-loaded rank (by bytes);
- ``ShardingPlan(tables, shards, world_size)`` takes any other cut.

A plan is stored with each global version (``to_dict`` / ``from_dict``), so that a restore can read a
version written under another plan or world size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgument

__all__ = ["Shard", "ShardingPlan"]


@dataclass(frozen=True, order=True)
class Shard:
    """Rows ``[row_start, row_end)`` of ``table``, held by ``rank``."""

    table: str
    rank: int
    row_start: int
    row_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


def _check_world_size(world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise InvalidArgument(f"world_size must be a positive integer, got {world_size!r}")


class ShardingPlan:
    """Tables ``{name: (num_rows, dim)}`` and the shards that cut them over ``world_size`` ranks."""

    def __init__(self, tables: Mapping[str, tuple[int, int]], shards: Iterable[Shard], world_size: int, *,
                 row_ids: str = "local"):
        _check_world_size(world_size)
        if row_ids not in ("local", "global"):
            raise InvalidArgument(f"row_ids must be 'local' or 'global', got {row_ids!r}")
        #: how a rank's store numbers a shard's rows: "local" (0 = the shard's first row: modules holding
        #: only their shard) or "global" (the table's row ids: TorchRec shards, cnrstore.torch.sharded)
        self.row_ids = row_ids
        self.world_size = int(world_size)
        self.tables = {}
        for name, shape in dict(tables).items():
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"table names must be non-empty strings, got {name!r}")
            try:
                num_rows, dim = (int(x) for x in shape)
            except (TypeError, ValueError):
                raise InvalidArgument(f"table {name!r}: give its shape as (num_rows, dim), got {shape!r}") from None
            if num_rows < 1 or dim < 1:
                raise InvalidArgument(f"table {name!r}: num_rows and dim must be positive, got {shape!r}")
            self.tables[name] = (num_rows, dim)
        shards = list(shards)
        for s in shards:
            if not isinstance(s, Shard):
                raise InvalidArgument(f"shards must be Shard objects, got {type(s).__name__}")
        self.shards = tuple(sorted(shards, key=lambda s: (s.table, s.row_start)))
        self._check()

    def _check(self) -> None:
        by_table: dict[str, list[Shard]] = {name: [] for name in self.tables}
        seen: set[tuple[str, int]] = set()
        for s in self.shards:
            if s.table not in by_table:
                raise InvalidArgument(f"shard {s} names a table the plan does not list ({sorted(self.tables)})")
            if not 0 <= s.rank < self.world_size:
                raise InvalidArgument(f"shard {s}: rank must be in [0, {self.world_size})")
            if (s.table, s.rank) in seen:
                raise InvalidArgument(f"rank {s.rank} holds two shards of table {s.table!r}; a rank holds at "
                                      "most one contiguous range of a table")
            seen.add((s.table, s.rank))
            by_table[s.table].append(s)
        for name, shards in by_table.items():
            num_rows = self.tables[name][0]
            edge = 0
            for s in shards:  # sorted by row_start
                if s.row_start != edge or s.row_end <= s.row_start:
                    raise InvalidArgument(
                        f"the shards of table {name!r} must cover rows [0, {num_rows}) exactly once, each a "
                        f"non-empty range; found {[(x.row_start, x.row_end) for x in shards]}")
                edge = s.row_end
            if edge != num_rows:
                raise InvalidArgument(f"the shards of table {name!r} end at row {edge}, the table has "
                                      f"{num_rows} rows; cover every row")

    # -- constructors ---------------------------------------------------------------------------------
    @classmethod
    def row_wise(cls, tables: Mapping[str, tuple[int, int]], world_size: int) -> "ShardingPlan":
        """Every table cut into ``world_size`` contiguous near-equal ranges, in rank order."""
        _check_world_size(world_size)
        shards = []
        for name, shape in dict(tables).items():
            num_rows = int(shape[0])
            edges = [num_rows * r // int(world_size) for r in range(int(world_size) + 1)]
            shards += [Shard(name, r, edges[r], edges[r + 1]) for r in range(int(world_size)) if edges[r + 1] > edges[r]]
        return cls(tables, shards, world_size)

    @classmethod
    def table_wise(cls, tables: Mapping[str, tuple[int, int]], world_size: int) -> "ShardingPlan":
        """Each table whole on one rank: largest tables first, each on the rank with the fewest bytes."""
        _check_world_size(world_size)
        load = [0] * int(world_size)
        shards = []
        for name, (num_rows, dim) in sorted(dict(tables).items(), key=lambda kv: (-kv[1][0] * kv[1][1], kv[0])):
            rank = min(range(len(load)), key=lambda r: (load[r], r))
            load[rank] += int(num_rows) * int(dim)
            shards.append(Shard(name, rank, 0, int(num_rows)))
        return cls(tables, shards, world_size)

    @classmethod
    def from_torchrec(cls, model, world_size: int, group=None) -> "ShardingPlan":
        """The plan a TorchRec ``DistributedModelParallel`` model was sharded with (collective over ``group``,
        default the default group; on an NCCL group each rank must have set its own CUDA device, as for torch's
        object collectives; ``DistributedCheckpointer`` passes its gloo group): one table per stored table of ``cnrstore.torch.sharded`` (a table's FQN,
        or one column slice of it), its shards the ranks' row ranges; rows numbered by global id."""
        from ..torch import sharded  # noqa: PLC0415
        from . import failures  # noqa: PLC0415

        if not sharded.is_sharded(model):
            raise InvalidArgument("the model holds no TorchRec sharded module: give its ShardingPlan as plan=")
        shards, _keys, _feeds = sharded.find_shards(model)
        mine = [(s.name, s.global_rows, int(s.tensor.shape[1]), s.row_offset, s.row_offset + int(s.tensor.shape[0]))
                for s in shards if s.tensor.numel()]
        every: list = [None] * int(world_size)
        failures.all_gather_object(every, mine, group=group)
        tables, out = {}, []
        for rank, entries in enumerate(every):
            for name, rows, width, r0, r1 in entries:
                tables[name] = (rows, width)
                out.append(Shard(name, rank, r0, r1))
        return cls(tables, out, world_size, row_ids="global")

    # -- queries --------------------------------------------------------------------------------------
    def shards_of(self, rank: int) -> dict[str, Shard]:
        """The shards ``rank`` holds, by table name."""
        return {s.table: s for s in self.shards if s.rank == rank}

    def shards_of_table(self, table: str) -> list[Shard]:
        """The shards of ``table``, in row order."""
        return [s for s in self.shards if s.table == table]

    def rows_of(self, rank: int) -> int:
        """How many embedding rows ``rank`` holds over all tables."""
        return sum(s.num_rows for s in self.shards if s.rank == rank)

    def total_rows(self) -> int:
        return sum(num_rows for num_rows, _dim in self.tables.values())

    def __eq__(self, other) -> bool:
        return isinstance(other, ShardingPlan) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.world_size, self.shards))

    def __repr__(self) -> str:
        return f"ShardingPlan({len(self.tables)} tables, {len(self.shards)} shards, world_size={self.world_size})"

    # -- persistence ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A msgpack-able description (stored with every global version)."""
        out = {
            "world_size": self.world_size,
            "tables": {name: [n, d] for name, (n, d) in sorted(self.tables.items())},
            "shards": [[s.table, s.rank, s.row_start, s.row_end] for s in self.shards],
        }
        if self.row_ids != "local":  # absent in plans written before TorchRec shards (all "local")
            out["row_ids"] = self.row_ids
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "ShardingPlan":
        try:
            return cls({k: tuple(v) for k, v in data["tables"].items()},
                       [Shard(t, int(r), int(a), int(b)) for t, r, a, b in data["shards"]], data["world_size"],
                       row_ids=data.get("row_ids", "local"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidArgument(f"not a sharding plan description: {exc}") from exc
