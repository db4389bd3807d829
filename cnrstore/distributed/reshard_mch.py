"""TorchRec managed-collision (MCH) state of a DMP-sharded model restored under another plan or world size.

TorchRec's row-wise MCH sharding is positional: rank r of W runs a module over slots ``[offset, offset + S)``
(its row shard of the managed embedding table) and holds the raw ids ``RwSparseFeaturesDist`` routes to it,
``id // ceil(H / W)`` (H the module's ``input_size()``). Restoring a global version written at world size N
on rank r of M is a *remap*, not a reshard by rows (docs/DESIGN.md, "Managed-collision state at another world
size"); for each MCH module of this rank, :class:`Remap`:

1. reads the module's saved group (keyed rows, or dense buffers from an older version) from the stores of
   the old ranks whose id range overlaps rank r's new one, only those; checks that every id read lies in
   ``[0, H)`` and in its old rank's range and that its slot lies in that rank's old row shard (else
   ``InvalidArgument``: routed otherwise than cnrstore assumes), and takes the ids rank r now gets;
2. if they outnumber the S slots, keeps S of them (:func:`keep`: the most recently accessed, then the most
   counted, then the smallest id) and warns (``RuntimeWarning``) how many ids it dropped: their rows,
   optimizer state and metadata are not restored (they are admitted again, fresh, if they come back);
3. builds the buffers (:func:`buffers`): the kept ids ascending, then the empty value; the mapping
   ``arange(offset, offset + S)``, so the i-th kept id gets slot ``offset + i`` (slots are renumbered);
   each kept id's metadata (counts, last access) as saved, zeros (a fresh module's) in the free tail;
   ``_current_iter_tensor`` as saved (the old ranks read must agree), ``_output_segments_tensor`` the live
   module's (the new layout);
4. moves rows (:meth:`Remap.rows`): the managed table's weight row and every row-wise optimizer state row of
   slot ``offset + i`` come from the old global row of the i-th kept id, in the store of the old rank that
   held it (one read per old rank and stored table). Rows of free slots are left as the positional read
   gave them (MCH resets a slot's row when it hands the slot to an id).

MPZCH modules (``HashZchManagedCollisionModule``) are not remapped but resharded by position: torchrec routes
an id to a hash *bucket* (``total_num_buckets`` of them, a multiple of the world size) and the module places it
among its bucket's slots, so a slot keeps its global row at any world size whose ranks hold whole buckets.
Rank r's identity and metadata buffers are then the saved buffers' global slots ``[row_start, row_end)`` of
its shard (:class:`_ZchGroup`, read from the old ranks whose shards overlap, keyed rows or dense buffers), its
rows and optimizer state the positional read's, and ``_hash_zch_bucket`` the live module's. Refused: a
``total_num_buckets`` that is not a multiple of both world sizes (torchrec's own rule).

Refused with ``InvalidArgument`` before anything changes: a module with an ``input_hash_func`` (its stored ids are hashed values, so
their routing cannot be recomputed) or an input size of 0, a module whose ``buckets()`` is not the world size,
a managed table that is not one row-wise shard per rank on the module's slots, and any rank-local state key
this module does not know. The remapped model is not the saved one (ids dropped in 2, slots renumbered in 3):
what holds is that each kept id keeps its embedding row, row-wise optimizer state, counts and last access.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidArgument, MissingRows, TableNotFound
from ..torch import mc_buffers as kb
from ..torch import mc_saves
from ..torch.payload import DENSE_PREFIX

__all__ = ["Remap", "plan", "block", "overlapping", "keep", "buffers"]

COUNTS = "_mch_counts"
LAST_ACCESS = "_mch_last_access_iter"
CURRENT_ITER = "_current_iter_tensor"
OUTPUT_SEGMENTS = "_output_segments_tensor"
ZCH_BUCKET = "_hash_zch_bucket"
#: the path from a managed-collision embedding collection to its MCH modules (by table name)
_MODULES = "_managed_collision_collection._managed_collision_modules."
#: the paths from that collection to its embedding tables (bag and sequence collections)
_TABLES = ("_embedding_module.embedding_bags.", "_embedding_module.embeddings.")


def block(input_size: int, world: int) -> int:
    """The raw ids per rank torchrec's row-wise input distribution routes: rank ``id // block``."""
    return -(-int(input_size) // int(world))


def overlapping(rank: int, world: int, old_world: int, input_size: int) -> list[int]:
    """The ranks of ``old_world`` whose raw-id range meets ``rank``'s at ``world`` (ids in [0, input_size))."""
    bn, bo = block(input_size, world), block(input_size, old_world)
    lo, hi = rank * bn, min((rank + 1) * bn, input_size)
    return [s for s in range(old_world) if s * bo < hi and lo < min((s + 1) * bo, input_size)]


def keep(ids: np.ndarray, columns: dict, slots: int) -> np.ndarray:
    """Positions (ascending) of the ids to keep when ``ids`` (ascending) outnumber ``slots``: the largest
    ``_mch_last_access_iter`` first, then the largest ``_mch_counts``, then the smallest id (a column
    ``columns`` lacks is left out of the order). All positions when they fit."""
    n = ids.shape[0]
    if n <= slots:
        return np.arange(n)
    order_keys = [ids]  # (np.lexsort: the last key is the primary one)
    for name in (COUNTS, LAST_ACCESS):
        if name in columns:
            order_keys.append(-np.asarray(columns[name]).reshape(n).astype(np.int64))
    return np.sort(np.lexsort(order_keys)[:slots])


def buffers(ids: np.ndarray, columns: dict, offset: int, size: int, dtypes: dict) -> dict:
    """{buffer name: array of ``size``} of an MCH module over slots ``[offset, offset + size)`` holding
    ``ids`` (ascending, at most ``size``): ``_mch_sorted_raw_ids`` the ids then int64 max; the mapping
    ``arange(offset, offset + size)`` (id i at slot ``offset + i``, the free slots after, in order); every
    other buffer of ``dtypes`` (name -> dtype: the metadata) the ids' ``columns`` then zeros."""
    n = ids.shape[0]
    if n > size:
        raise InvalidArgument(f"{n} ids for {size} slots: choose them with keep() first")
    out = {}
    for name, dtype in dtypes.items():
        if name == kb.MCH_IDS:
            arr = np.full(size, kb.MCH_EMPTY, dtype=dtype)
            arr[:n] = ids
        elif name == kb.MCH_MAPPING:
            arr = np.arange(offset, offset + size).astype(dtype)
        else:
            arr = np.zeros(size, dtype=dtype)
            arr[:n] = np.asarray(columns[name]).reshape(n)
        out[name] = arr
    return out


@dataclass
class _Group:
    """One MCH module of this rank: its state-dict ``prefix``, the live module's routing and slots, the
    managed ``table``; once read, the kept ``ids`` (ascending) with their old rank, old global row and
    metadata columns."""

    prefix: str
    module: str            # (its state-dict path, for messages)
    table: str
    input_size: int
    offset: int
    size: int
    dtypes: dict           # buffer name -> numpy dtype (the live module's)
    ids: np.ndarray | None = None
    source: np.ndarray | None = None
    old_rows: np.ndarray | None = None
    columns: dict = field(default_factory=dict)
    current_iter: np.ndarray | None = None


@dataclass
class _ZchGroup:
    """One MPZCH module of this rank: its state-dict ``prefix``, the managed ``table``, this rank's global slots
    ``[start, end)``, and each buffer's (dtype, trailing shape) as live."""

    prefix: str
    module: str
    table: str
    start: int
    end: int
    buffers: dict  # buffer name -> (numpy dtype, trailing shape)


class Remap:
    """This rank's MCH remap of one restore (module doc): :meth:`state` gives the rank-local state to load,
    :meth:`rows` moves the kept ids' rows in what the positional read gave. Reads happen at first use, through
    ``store_of(old rank)`` (the caller's read-only stores, which it closes)."""

    def __init__(self, gv, world: int, rank: int, store_of, groups: list[_Group], live: dict,
                 zch: list[_ZchGroup] = ()):
        self.gv = gv
        self.world = world
        self.rank = rank
        self.store_of = store_of
        self.groups = groups
        self.zch = list(zch)
        self._live = live  # rank-local key -> live tensor
        self._by_table = {g.table: g for g in groups}
        self._read_done = False

    # -- reads ----------------------------------------------------------------------------------------
    def _old_shard(self, table: str, rank: int):
        shards = [s for s in self.gv.plan.shards_of_table(table) if s.rank == rank]
        if len(shards) != 1:
            raise InvalidArgument(f"global version {self.gv.version}: rank {rank} holds {len(shards)} shards of "
                                  f"{table!r}; a managed-collision table is restored at another world size from "
                                  "one row-wise shard per rank only")
        return shards[0]

    def _old_group(self, g: _Group, rank: int, slots: int) -> tuple[np.ndarray, dict]:
        """(ids ascending, {column: 1-D array}) of ``g`` in old ``rank``'s store at the global version: its
        keyed rows (mc_saves), or its dense buffers in a version written before those."""
        gv = self.gv
        st, v = self.store_of(rank), gv.local_versions[rank]
        table = g.prefix.rstrip(".") + ".keyed"
        names = [n for n in g.dtypes if n != kb.MCH_IDS]
        try:
            tail = None
            if table in st.tables():  # (the version holds the group keyed iff it holds its tail)
                try:
                    tail = st.read_dense(mc_saves.TAIL_PREFIX + g.prefix + kb.MCH_IDS, v)
                except MissingRows:
                    tail = None
            if tail is not None:
                got = st.read_keyed(table, v)
                missing = [n for n in names if n not in got.columns]
                if missing:
                    raise InvalidArgument(f"{table!r} in global version {gv.version} (rank {rank}'s store) holds no "
                                          f"column {missing[0]!r} of the model's module; restore into a model of "
                                          "the stored kind")
                n = got.keys.shape[0]
                if n + tail.shape[0] != slots:
                    raise InvalidArgument(f"{table!r} in global version {gv.version} (rank {rank}'s store) holds {n} "
                                          f"ids and {tail.shape[0]} free slots for the {slots} rows of that rank's "
                                          f"shard of {g.table!r}; not the layout cnrstore remaps")
                return got.keys, {c: got.columns[c].reshape(n) for c in names}
            arrays = {g.prefix + n: st.read_dense(DENSE_PREFIX + g.prefix + n, v) for n in g.dtypes}
        except (MissingRows, TableNotFound) as exc:
            raise InvalidArgument(f"global version {gv.version}: rank {rank}'s store lacks the managed-collision "
                                  f"state of {g.module!r} ({exc})") from exc
        if any(a.shape != (slots,) for a in arrays.values()):
            raise InvalidArgument(f"global version {gv.version}: rank {rank}'s buffers of {g.module!r} are not of the "
                                  f"{slots} rows of its shard of {g.table!r}; not the layout cnrstore remaps")
        (group,) = [x for x in kb.find_groups(arrays) if x.prefix == g.prefix] or [None]
        if group is None or group.kind != "mch":
            raise InvalidArgument(f"global version {gv.version}: rank {rank}'s buffers of {g.module!r} are not an "
                                  "MCH module's; restore into a model of the stored kind")
        keys, cols, _tail = kb.group_rows(group, arrays)
        return keys, {c: cols[c].reshape(keys.shape[0]) for c in names}

    def _read(self) -> None:
        if self._read_done:
            return
        for g in self.groups:
            self._read_group(g)
        self._read_done = True

    def _read_group(self, g: _Group) -> None:
        gv = self.gv
        old_world, world, rank = gv.plan.world_size, self.world, self.rank
        bo, bn = block(g.input_size, old_world), block(g.input_size, world)
        ids, source, rows, cols = [], [], [], []
        for s in overlapping(rank, world, old_world, g.input_size):
            shard = self._old_shard(g.table, s)
            keys, c = self._old_group(g, s, shard.num_rows)
            mapping = c[kb.MCH_MAPPING].astype(np.int64)
            bad = (keys < 0) | (keys >= g.input_size) | (keys // bo != s)
            if bad.any():
                raise InvalidArgument(
                    f"global version {gv.version}: rank {s} of {old_world} holds id {int(keys[bad][0])} in "
                    f"{g.module!r}, outside the ids [{s * bo}, {min((s + 1) * bo, g.input_size)}) torchrec routes to "
                    "it by range: the ids were routed otherwise than cnrstore assumes, so they cannot be re-routed; "
                    "restore at the world size and plan the version was written with")
            if ((mapping < shard.row_start) | (mapping >= shard.row_end)).any():
                raise InvalidArgument(
                    f"global version {gv.version}: rank {s}'s {g.module!r} maps ids outside its rows "
                    f"[{shard.row_start}, {shard.row_end}) of {g.table!r}; restore at the world size and plan the "
                    "version was written with")
            mine = keys // bn == rank
            ids.append(keys[mine])
            source.append(np.full(int(mine.sum()), s, dtype=np.int64))
            rows.append(mapping[mine])
            cols.append({n: a[mine] for n, a in c.items()})
        names = [n for n in g.dtypes if n not in (kb.MCH_IDS, kb.MCH_MAPPING)]
        all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        columns = {n: (np.concatenate([c[n] for c in cols]) if cols else np.zeros(0, g.dtypes[n])) for n in names}
        if all_ids.size > 1 and not (all_ids[1:] > all_ids[:-1]).all():  # (old ranges ascend: so do their ids)
            raise InvalidArgument(f"global version {gv.version}: the saved ids of {g.module!r} repeat or are out of "
                                  "order across ranks; restore at the world size and plan it was written with")
        kept = keep(all_ids, columns, g.size)
        if kept.size < all_ids.size:
            warnings.warn(
                f"{g.module}: rank {rank} of {world} gets {all_ids.size} ids of global version {gv.version} (written "
                f"at world size {old_world}) for its {g.size} slots; kept the {g.size} most recently accessed (then "
                f"most counted, then smallest), dropped {all_ids.size - kept.size}: their rows, optimizer state and "
                "metadata are not restored", RuntimeWarning, stacklevel=4)
        g.ids = all_ids[kept]
        g.source = np.concatenate(source)[kept] if source else np.zeros(0, np.int64)
        g.old_rows = np.concatenate(rows)[kept] if rows else np.zeros(0, np.int64)
        g.columns = {n: a[kept] for n, a in columns.items()}
        g.current_iter = self._current_iter(g, sorted({0, *np.unique(g.source).tolist()}))

    def _current_iter(self, g: _Group, ranks: list[int]) -> np.ndarray:
        gv, key = self.gv, g.prefix + CURRENT_ITER
        seen = {}
        for s in ranks:
            try:
                seen[s] = self.store_of(s).read_dense(DENSE_PREFIX + key, gv.local_versions[s])
            except (MissingRows, TableNotFound) as exc:
                raise InvalidArgument(f"global version {gv.version}: rank {s}'s store lacks {key!r} ({exc})") from exc
        first = seen[ranks[0]]
        for s, arr in seen.items():
            if arr.shape != first.shape or not np.array_equal(arr, first):
                raise InvalidArgument(f"global version {gv.version}: {key!r} is {first.tolist()} on rank {ranks[0]} "
                                      f"and {arr.tolist()} on rank {s}; the ranks' modules disagree on the "
                                      "iteration, so there is no one value to resume from")
        if first.shape != tuple(self._live[key].shape):
            raise InvalidArgument(f"state {key!r}: global version {gv.version} has shape {first.shape}, the model "
                                  f"{tuple(self._live[key].shape)}")
        return first

    # -- results --------------------------------------------------------------------------------------
    def state(self) -> dict:
        """{rank-local state-dict key: tensor} to load: every MCH module's buffers remapped, its iteration as
        saved, its output segments as live."""
        self._read()
        out = {}
        for g in self.groups:
            for name, arr in buffers(g.ids, g.columns, g.offset, g.size, g.dtypes).items():
                out[g.prefix + name] = torch.from_numpy(arr)
            cur = g.prefix + CURRENT_ITER
            out[cur] = torch.from_numpy(g.current_iter.copy()).to(self._live[cur].dtype)
            if g.prefix + OUTPUT_SEGMENTS in self._live:
                out[g.prefix + OUTPUT_SEGMENTS] = self._live[g.prefix + OUTPUT_SEGMENTS].detach().clone()
        for z in self.zch:
            out.update(self._zch_state(z))
        return out

    def _zch_state(self, z: _ZchGroup) -> dict:
        """An MPZCH module's buffers for this rank's slots, by global slot from the old ranks' (module doc)."""
        gv = self.gv
        out = {n: np.empty((z.end - z.start,) + shape, dtype) for n, (dtype, shape) in z.buffers.items()}
        filled = 0
        for shard in gv.plan.shards_of_table(z.table):
            lo, hi = max(z.start, shard.row_start), min(z.end, shard.row_end)
            if lo >= hi:
                continue
            st, v = self.store_of(shard.rank), gv.local_versions[shard.rank]
            targets = {z.prefix + n: torch.empty((shard.num_rows,) + shape, dtype=_torch_dtype(dtype))
                       for n, (dtype, shape) in z.buffers.items()}
            got = mc_saves.restore_groups(st, targets, v)  # (the keyed group; a version before it: dense)
            for n in z.buffers:
                key = z.prefix + n
                try:
                    arr = got[key].numpy() if key in got else st.read_dense(DENSE_PREFIX + key, v)
                except (MissingRows, TableNotFound) as exc:
                    raise InvalidArgument(f"global version {gv.version}: rank {shard.rank}'s store lacks {key!r} "
                                          f"({exc})") from exc
                if arr.shape != tuple(targets[key].shape):
                    raise InvalidArgument(f"global version {gv.version}: rank {shard.rank}'s {key!r} has shape "
                                          f"{arr.shape}, not its {shard.num_rows} slots of {z.table!r}")
                out[n][lo - z.start:hi - z.start] = arr[lo - shard.row_start:hi - shard.row_start]
            filled += hi - lo
        if filled != z.end - z.start:
            raise InvalidArgument(f"global version {gv.version}: its shards of {z.table!r} do not cover slots "
                                  f"[{z.start}, {z.end}) of {z.module!r}")
        state = {z.prefix + n: torch.from_numpy(a) for n, a in out.items()}
        if z.prefix + ZCH_BUCKET in self._live:
            state[z.prefix + ZCH_BUCKET] = self._live[z.prefix + ZCH_BUCKET].detach().clone()
        return state

    def rows(self, name: str, table: str, out: np.ndarray) -> np.ndarray:
        """``out`` (this rank's rows of ``table`` from stored table ``name``, read by position) with the rows
        of the kept ids' new slots taken from their old slots: unchanged for a table no MCH module manages."""
        g = self._by_table.get(table)
        if g is None:
            return out
        self._read()
        gv = self.gv
        width = out.shape[1]
        for s in np.unique(g.source).tolist():
            sel = np.flatnonzero(g.source == s)
            old = g.old_rows[sel]
            lo, hi = int(old.min()), int(old.max()) + 1
            buf = np.empty((hi - lo, width), dtype=np.float32)
            first = lo if gv.plan.row_ids == "global" else lo - self._old_shard(table, s).row_start
            try:
                self.store_of(s).read_tables({name: (first, buf)}, gv.local_versions[s])
            except (TableNotFound, MissingRows) as exc:
                raise InvalidArgument(f"global version {gv.version}: rank {s}'s store lacks {name!r} rows "
                                      f"[{lo}, {hi}) of the ids {g.module!r} held there ({exc})") from exc
            out[sel] = buf[old - lo]  # (slot offset + i is this shard's row i: plan() checked offset)
        return out


def _torch_dtype(dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype)).dtype


def _zch_module_of(model, prefix: str):
    """The one MPZCH module whose state-dict prefix is ``prefix``, or None."""
    found = [m for p, m in model.named_modules()
             if ("." + p + ".").endswith("." + prefix) and hasattr(m, kb.ZCH_IDENTITIES)]
    return found[0] if len(found) == 1 else None


def _managed_table(where: str, path: str, tables: set) -> str:
    """The one embedding table of ``tables`` the managed-collision module at ``path`` manages (else refused)."""
    head, sep, tname = ("." + path).rpartition("." + _MODULES.rstrip("."))
    base = head[1:]
    tname = tname.lstrip(".")
    looked = [f"{base}.{t}{tname}" if base else f"{t}{tname}" for t in _TABLES] if sep else []
    cands = [c for c in looked if c in tables]
    if len(cands) != 1:
        raise InvalidArgument(f"{where}: no one row-wise sharded embedding table of the model is managed by "
                              f"{path!r} (looked for {' or '.join(map(repr, looked)) or 'a collection around it'}"
                              "); cannot move its rows, restore at the saved world size")
    return cands[0]


def _plan_zch(where: str, bg, path: str, model, tables: set, shards: dict, arrays: dict, gv, world: int):
    """The positional reshard of an MPZCH module (module doc), or InvalidArgument."""
    module = _zch_module_of(model, bg.prefix)
    if module is None:
        raise InvalidArgument(f"{where}: no single MPZCH module of the model has the state {path!r}")
    buckets = int(module.buckets())
    for w in (world, gv.plan.world_size):
        if buckets % w:
            raise InvalidArgument(f"{where}: {path!r} has total_num_buckets {buckets}, not a multiple of world size "
                                  f"{w}: MPZCH moves between world sizes by whole buckets (torchrec's rule), so "
                                  "restore at the saved world size")
    table = _managed_table(where, path, tables)
    shard = shards.get(table)
    if shard is None or shard.row_end - shard.row_start != bg.size:
        raise InvalidArgument(f"{where}: {path!r} holds {bg.size} slots on this rank, its table {table!r} shard is "
                              f"{None if shard is None else (shard.row_start, shard.row_end)}; cnrstore reshards an "
                              "MPZCH module over its table's row-wise shard only")
    bufs = {n: (arrays[bg.prefix + n].dtype, tuple(arrays[bg.prefix + n].shape[1:])) for n in bg.names}
    return _ZchGroup(bg.prefix, path, table, shard.row_start, shard.row_end, bufs)


def _module_of(model, prefix: str):
    """The one MCH module whose state-dict prefix is ``prefix`` (its path may hold DMP's wrapper names before
    it), or None."""
    found = [m for p, m in model.named_modules() if ("." + p + ".").endswith("." + prefix) and hasattr(m, kb.MCH_IDS)]
    return found[0] if len(found) == 1 else None


def plan(gv, new_plan, rank: int, model, state, rank_local: list[str], shards: dict, store_of) -> Remap | None:
    """The MCH remap of restoring global version ``gv`` on ``rank`` of ``new_plan`` into ``model`` (the DMP
    model, its modules searched by path) whose checkpointer's ``state`` (``TrainerState``) holds the
    ``rank_local`` keys and this rank's ``shards`` ({table: plan Shard}); ``store_of(old rank)`` gives that
    rank's store, read-only. None when there is nothing to remap: no managed-collision state, or a version
    of this very plan (each rank's state is then its own). Checks everything it can without reading a store,
    and refuses (module doc) before anything changes."""
    if not rank_local or gv.plan == new_plan:
        return None
    world = new_plan.world_size
    where = (f"global version {gv.version} was written under another sharding plan (world size "
             f"{gv.plan.world_size}, this job {world}) by a model with TorchRec managed-collision modules")
    live = {k: state.dense[k] for k in rank_local}
    arrays = {k: v.detach().cpu().numpy() for k, v in live.items() if v.dtype != torch.bfloat16}
    tables = {t.name for t in state.tables}
    groups, zch, known = [], [], set()
    for bg in kb.find_groups(arrays):
        path = bg.prefix.rstrip(".")
        if bg.kind != "mch":
            zch.append(_plan_zch(where, bg, path, model, tables, shards, arrays, gv, world))
            known.update(bg.keys_of(arrays))
            known.add(bg.prefix + ZCH_BUCKET)
            continue
        module = _module_of(model, bg.prefix)
        if module is None:
            raise InvalidArgument(f"{where}: no single MCH module of the model has the state {path!r}; cannot "
                                  "tell how torchrec routes its ids, so it cannot be remapped")
        if getattr(module, "_input_hash_func", None) is not None:
            raise InvalidArgument(f"{where}: {path!r} hashes its input (input_hash_func), so its saved ids are hash "
                                  "values whose routing cannot be recomputed; restore at the saved world size")
        input_size, buckets = int(module.input_size()), int(module.buckets())
        if input_size <= 0:
            raise InvalidArgument(f"{where}: {path!r} has input size {input_size}: torchrec routes its ids by a "
                                  "range of the input size, which it lacks; restore at the saved world size")
        if buckets != world:
            raise InvalidArgument(f"{where}: {path!r} has {buckets} buckets for {world} ranks; "
                                  "cnrstore remaps MCH state routed one id range per rank only")
        table = _managed_table(where, path, tables)
        shard = shards.get(table)
        offset, size = int(module._output_global_offset), int(module.output_size())
        if shard is None or (shard.row_start, shard.row_end) != (offset, offset + size) or bg.size != size:
            raise InvalidArgument(f"{where}: {path!r} runs slots [{offset}, {offset + size}) on this rank, its "
                                  f"table {table!r} shard is "
                                  f"{None if shard is None else (shard.row_start, shard.row_end)}; cnrstore remaps "
                                  "an MCH module over its table's row-wise shard only")
        if table in {g.table for g in groups}:
            raise InvalidArgument(f"{where}: two MCH modules manage table {table!r}; cannot remap them")
        dtypes = {n: arrays[bg.prefix + n].dtype for n in bg.names}
        cur = bg.prefix + CURRENT_ITER
        if cur not in live:
            raise InvalidArgument(f"{where}: {path!r} has no {CURRENT_ITER}; not an MCH module cnrstore knows")
        groups.append(_Group(bg.prefix, path, table, input_size, offset, size, dtypes))
        known.update(bg.keys_of(arrays))
        known.update({cur, bg.prefix + OUTPUT_SEGMENTS})
    unknown = sorted(set(live) - known)
    if unknown:
        raise InvalidArgument(f"{where}: state {unknown[0]!r} belongs to a managed-collision module but is no MCH "
                              "buffer cnrstore knows how to move to another world size; restore at the world size "
                              "and plan the version was written with")
    return Remap(gv, world, rank, store_of, groups, live, zch)
