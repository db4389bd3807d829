"""One merged model from a multi-rank root, for export (``cnrstore.export.export_path``, where this module
registers itself as the ``"distributed"`` exporter on import) or any reader.

``merged_snapshot(root, version)`` reads global ``version`` (default newest) and returns one ``Snapshot``
of the *unsharded* model in ``cnrstore.torch.Checkpointer``'s layout:

- every table of the plan recorded in the version's manifest, assembled from the shards of all ranks
  (row-wise, table-wise or any other cut), each rank's store read at the local version the manifest
  names; row-wise optimizer state tables (``"<table>.optim.<state>"``) are assembled the same way;
- the dense ``torch.model/`` arrays of rank 0 (dense layers are replicated: every rank holds the same);
- a ``"torch.state"`` blob listing every table of the plan and rank 0's dense dtypes, with no optimizer
  and no ``extra`` state: optimizer state and data positions are per rank and have no merged form.

So a ``state_dict`` export of it loads into the unsharded model with ``load_state_dict``. Memory: the whole
model in fp32, plus one rank's shards while they are copied in.
"""

from __future__ import annotations

import sys

import numpy as np

from .. import codecs
from ..errors import CorruptionError, InvalidArgument, MissingRows
from ..export import register
from ..torch import sharded
from ..torch import payload as _payload
from ..torch.export import load_payload
from ..torch.payload import DENSE_PREFIX, STATE_BLOB
from ..types import Snapshot
from .manifest import GlobalVersion, Root

__all__ = ["is_root", "merged_snapshot"]


def is_root(path) -> bool:
    """True if ``path`` holds a distributed root's marker (whether or not it is readable)."""
    return Root(path).exists()


def _global_version(root: Root, version: int | None) -> GlobalVersion:
    root.check()
    gv = root.latest() if version is None else root.read(version)
    if gv is None:
        raise InvalidArgument(f"{root.path} holds no global version yet: nothing is exported until the job's first "
                              "save commits one")
    return gv


def merged_snapshot(root, version: int | None = None, *, trust_pickle: bool = False, progress=None) -> Snapshot:
    """Global ``version`` (default newest) of ``root`` as one unsharded Snapshot (module doc). ``root``: a
    ``Root`` (a bucket's: ``open_root(DIR, remote=URL)``, its rank stores read through ``open_store`` as read
    caches under DIR) or the path of a local root.

    Raises StoreNotFound if ``root`` is not a root, VersionNotFound for an unknown global version,
    InvalidArgument when a rank's store lacks a shard the plan gives it, CorruptionError when the plan
    claims more rows than the rank stores' segments can hold (checked before anything is allocated), and
    the rank stores' own errors (CorruptionError, ...).

    ``progress(done, total)``, if given, is called once before the first rank's store is read and after
    each: fp32 bytes of the plan's tables read so far (the rank's shards), of the plan's total."""
    r = root if isinstance(root, Root) else Root(root)
    gv = _global_version(r, version)
    plan = gv.plan
    states = _check_claims(r, gv)  # before anything is allocated by the sizes the plan claims
    tables = {name: np.empty((n, d), dtype=np.float32) for name, (n, d) in plan.tables.items()}
    row_state: dict[str, np.ndarray] = {}
    covered: dict[str, int] = {}
    dense: dict[str, np.ndarray] = {}
    blob = None
    total, done = sum(n * d * 4 for n, d in plan.tables.values()), 0
    if progress is not None:
        progress(0, total)
    for rank in range(gv.world_size):
        with r.open_store(r.rank_stores(gv)[rank], readonly=True) as st:
            snap = (st.restore(gv.local_versions[rank]) if plan.row_ids == "local"
                    else _shards_by_global_id(st, plan, rank, gv.local_versions[rank]))
        for name, shard in plan.shards_of(rank).items():
            arr = snap.tables.get(name)
            want = (shard.num_rows, plan.tables[name][1])
            if arr is None or arr.shape != want:
                got = "no rows" if arr is None else f"shape {arr.shape}"
                raise InvalidArgument(f"global version {gv.version}: rank {rank}'s store has {got} of table "
                                      f"{name!r} at local version {gv.local_versions[rank]}, its shard is rows "
                                      f"[{shard.row_start}, {shard.row_end}) x {want[1]}; the root is damaged")
            tables[name][shard.row_start:shard.row_end] = arr
            prefix = f"{name}.optim."
            for sname, sarr in snap.tables.items():
                if (not sname.startswith(prefix) or sarr.shape != (shard.num_rows, states.get(sname, -1))):
                    continue
                out = row_state.get(sname)
                if out is None:
                    out = row_state[sname] = np.empty((plan.tables[name][0], sarr.shape[1]), dtype=np.float32)
                out[shard.row_start:shard.row_end] = sarr
                covered[sname] = covered.get(sname, 0) + shard.num_rows
        if rank == 0:
            dense = {k: v for k, v in snap.dense.items() if k.startswith(DENSE_PREFIX)}
            blob = snap.dense.get(STATE_BLOB)
        del snap
        if progress is not None:
            done += sum(shard.num_rows * plan.tables[name][1] * 4 for name, shard in plan.shards_of(rank).items())
            progress(min(done, total), total)
    # a row-state table some shard lacks (an optimizer state a rank never had) has no merged form
    for sname, out in row_state.items():
        owner = sname.split(".optim.")[0]
        if covered.get(sname) == plan.tables[owner][0]:
            tables[sname] = out
    tables = sharded.join_column_slices(tables)
    if blob is not None:
        payload = load_payload(blob, gv.local_versions[0], trust_pickle=trust_pickle)
        names = sorted({sharded.table_of(n) for n in plan.tables})
        merged = {"format": _payload.PAYLOAD_FORMAT, "mode": payload.get("mode"), "tables": names,
                  "dense_dtypes": dict(payload["dense_dtypes"]), "optimizers": [], "extra": {},
                  "param_names": [], "merged": {"global_version": gv.version, "world_size": gv.world_size}}
        dense[STATE_BLOB] = _payload.encode(merged, what="the merged export's state")
    return Snapshot(version=gv.version, step=gv.step, meta=gv.meta, tables=tables, dense=dense)


def _rank_path(r: Root, gv: GlobalVersion, rank: int) -> str:
    return r.store_path(r.rank_stores(gv)[rank])


def _min_row_bytes(dim: int) -> int:
    """Bytes one row of ``dim`` floats takes in a record of the most compact codec for that dim."""
    return min(codecs.get(n).row_bytes(dim) for n in codecs.names())


def _check_claims(r: Root, gv: GlobalVersion) -> dict[str, int]:
    """Check, before the merged tables are allocated by the sizes the plan claims, that the rank stores can
    hold what the plan gives them, and return the row-wise optimizer states that have a merged form
    (``"<table>.optim.<state>"`` -> width). Reads only the rank stores' catalogs and file sizes.

    Each rank store must list every table of its shards with the plan's dim and the shard's rows
    (InvalidArgument, as a missing shard); and its segments must be at least as big as those rows in the
    most compact codec (every row a read returns is in some record): else a crafted plan or manifest claims
    more than the root holds, CorruptionError. So the merged tables cost at most a fixed multiple of the
    segment bytes (fp32 over the most compact codec: ~32x). A row-wise state is merged only if every shard's
    store lists it (same width, the shard's rows) and the states' rows fit each store's segments too.
    """
    plan = gv.plan
    local = plan.row_ids == "local"
    budget: dict[int, int] = {}
    listed: dict[str, dict[int, int]] = {}  # state -> {rank: width} as the catalogs list it
    for rank in range(gv.world_size):
        path = _rank_path(r, gv, rank)
        with r.open_store(r.rank_stores(gv)[rank], readonly=True) as st:
            catalog = st.tables()
            segments = st.engine.storage  # (through the storage seam: the sizes of the segments stored)
            have = sum(segments.size(seg) or 0 for seg in segments.list())
        need = 0
        for name, shard in plan.shards_of(rank).items():
            dim = plan.tables[name][1]
            info = catalog.get(name)
            if (info is None or info.dim != dim
                    or (info.num_rows != shard.num_rows if local else info.num_rows < shard.row_end)):
                got = "no table" if info is None else f"a table of {info.num_rows} rows x {info.dim}"
                raise InvalidArgument(f"global version {gv.version}: rank {rank}'s store has {got} for table "
                                      f"{name!r}, its shard is rows [{shard.row_start}, {shard.row_end}) x {dim}; "
                                      "the root is damaged")
            need += shard.num_rows * _min_row_bytes(dim)
            for sname, sinfo in catalog.items():
                if sname.startswith(f"{name}.optim.") and (sinfo.num_rows == shard.num_rows if local
                                                           else sinfo.num_rows >= shard.row_end):
                    listed.setdefault(sname, {})[rank] = sinfo.dim
        if need > have:
            raise CorruptionError(f"global version {gv.version}: the plan gives rank {rank} rows that take at "
                                  f"least {need:,} bytes in any codec, but its store {path} holds {have:,} bytes "
                                  "of segments: the plan or manifest claims more than the root holds; the root "
                                  "is damaged", path, None)
        budget[rank] = have - need
    states: dict[str, int] = {}
    for sname, widths in sorted(listed.items()):
        owner = plan.shards_of_table(sname.split(".optim.")[0])
        if {s.rank for s in owner} != set(widths) or len(set(widths.values())) != 1:
            continue  # some shard lacks it: no merged form
        width = next(iter(widths.values()))
        cost = {s.rank: s.num_rows * _min_row_bytes(width) for s in owner}
        if all(cost[rank] <= budget[rank] for rank in cost):
            for rank, c in cost.items():
                budget[rank] -= c
            states[sname] = width
    return states


def _shards_by_global_id(st, plan, rank: int, version: int) -> Snapshot:
    """A rank store of a TorchRec job (``plan.row_ids == "global"``: each table holds only this rank's rows,
    under their global ids) as a Snapshot shaped like ``Store.restore`` of a plan with local ids: each shard's
    rows and row-wise optimizer state, from row 0, and the dense arrays."""
    snap = Snapshot(version=version, step=None, meta=None)
    names = st.tables()
    for name, shard in plan.shards_of(rank).items():
        rows = np.arange(shard.row_start, shard.row_end, dtype=np.int64)
        for stored in [name] + sorted(n for n in names if n.startswith(f"{name}.optim.")):
            try:
                snap.tables[stored] = st.read_rows(stored, rows, version)
            except MissingRows:
                if stored == name:
                    raise
    for name in st.dense_names():
        try:
            snap.dense[name] = st.read_dense(name, version)
        except MissingRows:
            continue
    return snap


register("distributed", sys.modules[__name__])   # cnrstore.export's "distributed" exporter (its RootExporter)
