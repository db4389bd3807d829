"""The crash-state explorer for a multi-rank root in a bucket (cnrstore/distributed/remote_root.py), used by
tests/test_crash_states_dist_bucket.py. No torch.distributed: one process drives the distributed protocol
directly, as ``DistributedCheckpointer._commit_global``/``_decide`` and its start-up and retention do, with a
job's two rank stores opened through ``RemoteRoot.open_store``.

1. **Record.** Every object put and delete of the bucket (the root's marker, PLANs, ``ROOT`` and manifests,
   and the rank stores' segments, index snapshots and ``gen-G/rank-R/CURRENT`` pointers, which reach the
   bucket through ``objects.sub(rel)``) is logged in order, whole (``RecordingBucket``). A job (``Job``)
   keeps the model: what every one of its global versions reads, rank by rank (``content``, by manifest
   key: a version number with the job that committed it).
2. **Rebuild.** The bucket as of each prefix of that log: the objects put and not deleted since. A crash
   of every job at that instant leaves exactly that (an object put is whole and durable when the put
   returns; the node-local directories are lost: a fresh machine has none).
3. **Check** (``check_bucket``). Recovery from the bucket alone, on empty local directories: the global
   versions listed are exactly those of the last ``ROOT`` put (none before the first), and every one restores
   bit for bit (each rank's store opened readonly from the bucket, each table read at the local version the
   manifest names). Identical rank-store states are opened once (``RankCache``).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field

import numpy as np

from cnrstore.distributed import GlobalVersion, RemoteRoot, ShardingPlan
from cnrstore.distributed.manifest import GLOBAL_DIR, ROOT_POINTER
from cnrstore.distributed.remote_root import RootPointer, decode_pointer, manifest_key

from .crash_states import DictObjectStore

WORLD = 2


# -- 1. record ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ObjectEffect:
    kind: str  # put | delete
    key: str
    data: bytes = b""


class RecordingBucket(DictObjectStore):
    """A bucket in memory that logs every put and delete (conditional puts too: ``put_if`` puts through
    ``put``), in the order the bucket applied them."""

    def __init__(self, objects: dict[str, bytes] | None = None):
        super().__init__(objects)
        self.effects: list[ObjectEffect] = []

    def put(self, key: str, data) -> None:
        with self._lock:  # (the log's order is the bucket's)
            super().put(key, data)
            self.effects.append(ObjectEffect("put", key, bytes(data)))

    def delete(self, key: str) -> None:
        with self._lock:
            if key in self.objects:
                super().delete(key)
                self.effects.append(ObjectEffect("delete", key))


def table_shapes(extra: bool = False) -> dict[str, tuple[int, int]]:
    """The tables of the workload's plans: another plan (``extra``) adds one (a new generation)."""
    tables = {"emb.a": (96, 4), "emb.b": (40, 2)}
    if extra:
        tables["emb.c"] = (24, 3)
    return tables


class Job:
    """One job on the root: its rank 0's ``RemoteRoot`` (the writes) and its ranks' stores, driven as the
    distributed checkpointer drives them; ``content`` is what each of its global versions reads."""

    def __init__(self, local_dir: str, bucket, content: dict | None = None, seed: int = 0):
        self.root = RemoteRoot(local_dir, objects=bucket)
        self.rng = np.random.default_rng(seed)
        self.stores: list = []
        self.plan: ShardingPlan | None = None
        self.generation = 0
        self.model: list[dict[str, np.ndarray]] = []
        self.content = {} if content is None else content  # manifest key -> [rank -> {table: values}]

    def start(self, plan: ShardingPlan) -> None:
        """Rank 0 claims the root and finds the plan's generation; each rank opens its store (taking it over
        from the bucket if another node wrote it) and drops the local versions no global version names."""
        self.root.create()
        self.join(plan)

    def join(self, plan: ShardingPlan) -> None:
        """``start`` after the claim: the plan's generation, the rank stores opened."""
        self.generation = self.root.generation_for(plan)
        self._open(plan, startup=True)

    def change_plan(self, plan: ShardingPlan) -> None:
        """Another plan: a new generation (the old rank stores closed: their close makes a copy point)."""
        self.close()
        self.generation = self.root.generation_for(plan)
        self._open(plan, startup=True)

    def _open(self, plan: ShardingPlan, startup: bool) -> None:
        self.plan = plan
        self.stores = [self.root.open_store(self.root.store_rel(self.generation, r), create=True)
                       for r in range(WORLD)]
        latest = self.root.latest()
        self.model = []
        for rank, store in enumerate(self.stores):
            have = store.tables()
            for name, shard in plan.shards_of(rank).items():
                if name not in have:
                    store.create_table(name, shard.num_rows, plan.tables[name][1], codec="fp32", block_rows=16)
            ours = latest is not None and latest.generation == self.generation
            self.model.append({name: (store.read_table(name, version=latest.local_versions[rank]) if ours and
                                      name in store.tables() and latest.local_versions[rank] else
                                      np.zeros((shard.num_rows, plan.tables[name][1]), np.float32))
                               for name, shard in plan.shards_of(rank).items()})
            self.reclaim(rank, startup=startup)

    def save(self, rows: int = 8) -> int:
        """One global save (``DistributedCheckpointer._commit_global``): each rank's local checkpoint and copy
        point, then rank 0's manifest and pointer swap. Returns the global version."""
        written = self.write_local(rows)
        self.copy_points()
        return self.commit(written)

    def write_local(self, rows: int = 8) -> list:
        """Each rank's local checkpoint (``write_local_rank``)."""
        return [self.write_local_rank(rank, rows) for rank in range(len(self.stores))]

    def write_local_rank(self, rank: int, rows: int = 8) -> tuple[int, dict]:
        """Rank ``rank``'s local checkpoint of ``rows`` new rows per table (every row in a store's first): its
        local version and what every table reads at it."""
        store = self.stores[rank]
        first = not store.versions()
        with store.checkpoint() as ck:
            for name, values in self.model[rank].items():
                n = values.shape[0] if first else min(rows, values.shape[0])
                idx = np.sort(self.rng.choice(values.shape[0], size=n, replace=False))
                new = self.rng.standard_normal((idx.size, values.shape[1])).astype(np.float32)
                ck.put_rows(name, idx, new)
                values[idx] = new
        return ck.version, {name: values.copy() for name, values in self.model[rank].items()}

    def seal(self) -> None:
        """Each rank's seal after its local write (on a bucket root the checkpointer seals each save's segment
        before the next save opens, and publishes the save behind it: ``_gather_outcomes``)."""
        for store in self.stores:
            store.engine.seal_idle_writer_segment()

    def copy_points(self) -> None:
        for store in self.stores:
            store.sync_remote()

    def commit(self, written: list) -> int:
        """Rank 0's ``root.commit`` of a global version naming each rank's local version in ``written``. Its
        content is in ``content`` from before the manifest's put (a crash state may list it from the pointer
        swap on) and taken out again if the commit fails."""
        return self.commit_many([written])[0]

    def commit_many(self, saves: list) -> list[int]:
        """Rank 0's ``root.commit_many``: a publication listing several saves at once (each a ``written``)."""
        first = max(self.root.version_numbers(), default=0) + 1
        numbers = list(range(first, first + len(saves)))
        keys = [manifest_key(number, self.root.job) for number in numbers]
        for key, written in zip(keys, saves):
            self.content[key] = [tables for _v, tables in written]
        try:
            self.root.commit_many([GlobalVersion(
                version=number, step=number, meta=None, created=time.time(), generation=self.generation,
                plan=self.plan, local_versions=tuple(v for v, _tables in written),
                stores=tuple(self.root.store_rel(self.generation, r) for r in range(WORLD)))
                for number, written in zip(numbers, saves)])
        except BaseException:
            for key in keys:
                del self.content[key]
            raise
        return numbers

    def retain(self, keep_last: int) -> None:
        """``keep_last`` as the checkpointer applies it after a save: rank 0 drops old global versions and
        unreferenced generations; then each rank drops the older local versions none names, and collects
        (their remote objects go at the next copy point)."""
        self.drop_listed(keep_last)
        for rank in range(WORLD):
            self.reclaim(rank)

    def drop_listed(self, keep_last: int) -> None:
        """Rank 0's part of ``keep_last``, after it listed a version (``DistributedCheckpointer._decide``)."""
        numbers = self.root.version_numbers()
        self.root.drop(numbers[:-keep_last])
        self.root.remove_unreferenced_generations(self.generation)

    def reclaim(self, rank: int, startup: bool = False) -> None:
        """``DistributedCheckpointer._reclaim_local``."""
        store = self.stores[rank]
        referenced = {gv.local_versions[rank] for gv in self.root.versions() if gv.generation == self.generation}
        newest = max(referenced, default=0)
        drop = {vi.version for vi in store.versions()
                if vi.version not in referenced and (startup or vi.version < newest)}
        if drop:
            store.drop_versions(drop, allow_newest=startup)
            store.gc()

    def close(self) -> None:
        for store in self.stores:
            store.close()
        self.stores = []


# -- 2. rebuild and 3. check --------------------------------------------------------------------------------

def replay(effects, upto: int, objects: dict[str, bytes] | None = None) -> dict[str, bytes]:
    out = dict(objects or {})
    for e in effects[:upto]:
        if e.kind == "put":
            out[e.key] = e.data
        else:
            out.pop(e.key, None)
    return out


def pointer_of(objects: dict[str, bytes]) -> RootPointer | None:
    data = objects.get(ROOT_POINTER)
    return None if data is None else decode_pointer(data, ROOT_POINTER, None)


def _digest(objects: dict[str, bytes], folder: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(k for k in objects if k.startswith(folder + "/")):
        h.update(key.encode() + b"\0" + hashlib.blake2b(objects[key], digest_size=16).digest())
    return h.digest()


@dataclass
class RankCache:
    """Rank-store restores already checked, by (store, digest of its objects, local version): a rank store's
    readonly recovery depends only on its own objects."""

    workdir: str
    checked: set = field(default_factory=set)
    opens: int = 0

    def check(self, objects: dict[str, bytes], rel: str, local_version: int, want: dict[str, np.ndarray],
              what: str) -> None:
        key = (rel, _digest(objects, rel), local_version)
        if key in self.checked:
            return
        self.opens += 1
        root = RemoteRoot(os.path.join(self.workdir, f"open-{self.opens}"), objects=DictObjectStore(objects))
        with root.open_store(rel, readonly=True) as store:
            assert local_version in [v.version for v in store.versions()], (
                f"{what}: {rel} recovered from the bucket lacks local version {local_version} "
                f"(it lists {[v.version for v in store.versions()]})")
            for name, values in want.items():
                np.testing.assert_array_equal(store.read_table(name, version=local_version), values,
                                              err_msg=f"{what}: {rel} table {name!r} at local version {local_version}")
        self.checked.add(key)


def check_bucket(objects: dict[str, bytes], content: dict, cache: RankCache, workdir: str, what: str,
                 restore: bool = True) -> list[str]:
    """Recovery from ``objects`` alone (module docstring, step 3): the manifest keys it lists, which must be
    exactly the last pointer's; each restored bit for bit against ``content`` unless ``restore`` is False."""
    pointer = pointer_of(objects)
    want = [] if pointer is None else [manifest_key(v, job) for v, job in pointer.versions]
    root = RemoteRoot(workdir, objects=DictObjectStore(objects))
    gvs = root.versions()
    listed = [manifest_key(gv.version, dict(pointer.versions)[gv.version]) for gv in gvs]
    assert listed == want, f"{what}: recovery lists {listed}; the last pointer put lists {want}"
    for key, gv in zip(listed, gvs):
        assert key in content, f"{what}: {key} is listed but no job committed it"
        if restore:
            for rank, rel in enumerate(gv.stores):
                cache.check(objects, rel, gv.local_versions[rank], content[key][rank], f"{what}, {key}")
    return listed


def check_claim(objects: dict[str, bytes], workdir: str, what: str) -> None:
    """A new job claiming the root in this state keeps its global versions, deletes every manifest the
    pointer does not list and every object of the doomed generations, and leaves none doomed."""
    bucket = DictObjectStore(objects)
    before = pointer_of(objects)
    root = RemoteRoot(workdir, objects=bucket)
    if not root.exists():
        return
    root.create()
    after = root.pointer()
    assert after.versions == (() if before is None else before.versions), what
    assert after.doomed == (), what
    listed = {manifest_key(v, job) for v, job in after.versions}
    assert {k for k in bucket.objects if k.startswith(GLOBAL_DIR + "/")} == listed, what
    for g in (() if before is None else before.doomed):
        assert not [k for k in bucket.objects if k.startswith(f"gen-{g:06d}/")], f"{what}: generation {g} left"

