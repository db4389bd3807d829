"""Dynamic embedding tables (issue 50): a keyed cnrstore table against DCP full dumps and dynamicemb-style deltas.

A numpy emulation of a dynamic-embedding trainer (no model): one table of int64 ids from a 2^40 key space, dim
64 fp32, with two metadata columns per id (``score`` float32: a decayed lookup count, ``last_step`` int64).
Each interval (between two saves) draws a Zipf(1.1) id stream over the 2^40 key space (rank r -> id
``splitmix64(r) mod 2^40``) until a share of 10-20% of the live count (uniform per interval) of ids not in the
table has been seen: those are *admitted*; the live ids the stream looked up are *updated* (value moved, score
and last step set). Then the ids of lowest score (``count * 0.5^(steps since last lookup)``) are *evicted* to
bring the live count back to its target (``--keys``). The table starts holding the stream's ``--keys`` hottest
ids. The same state sequence is checkpointed three ways:

- ``cnrstore keyed``: a keyed table (``create_table(keyed=True, partitions=P, columns=...)``); each save
  ``put_keys`` of the ids admitted or updated (values, score, last_step) and ``delete_keys`` of the ids evicted
  (an id admitted and evicted within one interval is neither); fp32, so every save is exact;
- ``DCP full dump``: ``torch.distributed.checkpoint.save`` of the whole table (keys, values, score, last_step
  tensors) into a new directory per save, one process, no process group (``no_dist=True``); only the newest
  directory is kept on disk;
- ``dynamicemb-style``: a full dump (``torch.save`` of keys, values, score, last_step) every ``--full-every``
  saves and in between a key-only delta (``torch.save`` of the keys and embeddings of the ids admitted or
  updated: no metadata, no evictions), as dynamicemb's incremental dump does.

Per method: bytes per save (cnrstore: ``VersionInfo.bytes``, every byte the version appended; the others: the
files' sizes), and for cnrstore the ratio of those bytes to the bytes of the interval's changes in the table's
codec with their metadata (each id put: its key, value and columns, ``8 + 4 * dim + 4 + 8`` bytes; each id
deleted: its key, 8 bytes; the issue's target is <= 1.2x); the save stall (the wall time of the save call,
gathering its rows from the emulated table included); the restore of the newest version (page cache warm),
checked against the emulator's state: keys, values, score and last_step bit for bit (dynamicemb-style cannot
be exact: it says how many evicted ids come back and how many rows' metadata is stale).

Resharding: the same saves also go to N=2 writer-rank stores, rank r holding the ids whose partition p has
``p * N // P == r``; then M=3 reader ranks each read only their partition range (``p * M // P == j``) from both
stores with ``read_keyed(partitions=...)``. Bytes read are the lengths of the records the reads fetched and
verified (every record fetch of a keyed read goes through ``keyed_reader.fetch``, counted for the duration
of the reads), against the bytes the reader owns (its live ids' keys and rows in the codec); measured on the
stores as saved (each partition's chain: a baseline and one run per save) and after ``compact()`` (one
baseline per partition). The issue's target is <= 1.1x. Against it, the dynamicemb/DCP-style reshard: the
state dumped as N=2 rank files (``torch.save``, ids owned by ``key % N``), each of the M=3 readers loading
every old rank's file whole and keeping its own ids (W-fold reads).

Serving with evictions (issue 50: a follower never serves an evicted id's old vector, and its p99 freshness
stays within the local goal bench_serving.py meets, 2.4 s): a table of ``--follow-keys`` ids from the same
trainer, saved every ``--follow-save-s`` s into a store of its own while ``cnrstore.serving.Follower`` follows
it into a ``KeyedReplica`` in a spawned process polling every ``--poll-s`` s (bench_serving.py's method; its
full sync not measured). Freshness: a version's commit (``VersionInfo.created``) to the poll that applied it
returning, ``time.time()`` on one machine, p50 and p99 over the versions. Before each commit the trainer
writes what the version changes (every id put and deleted, and a sample of the put ids with their rows) to a
file; after each update the follower checks that every id a covered version evicted (and no later one put
again) is not found, and that the sampled rows (not changed since) read bit for bit; at the end its whole
replica against the trainer's state. Any stale read or wrong row: exit 1. Bytes: the key-run records the
follower fetched per update (``keyed_reader.fetch`` counted in the follower's process) against the changes'
bytes, and the follower's own ``stats["bytes_read"]``.

    python benchmarks/bench_dynamic.py [--quick] [--keys N] [--saves S] [--follow-keys N] [--no-follow |
                                       --follow-only] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import dir_bytes, fmt_bytes, load_average, machine_description, peak_rss  # noqa: E402

KEY_BITS = 40
COLUMNS = {"score": "float32", "last_step": "int64"}
WRITERS, READERS = 2, 3
METHODS = ("cnrstore keyed", "DCP full dump", "dynamicemb-style")

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of uint64 ``x`` (a fixed pseudo-random permutation of 2^64)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def ids_of_ranks(ranks: np.ndarray) -> np.ndarray:
    """The id of each popularity rank: spread over the 2^40 key space."""
    return (splitmix(ranks) & np.uint64((1 << KEY_BITS) - 1)).astype(np.int64)


class Interval:
    """What one interval changed: ``put`` (sorted ids admitted or updated and still live), ``deleted`` (sorted
    ids live at the previous save and evicted), and the counts."""

    def __init__(self, put, deleted, admitted, updated, evicted, lookups):
        self.put, self.deleted = put, deleted
        self.admitted, self.updated, self.evicted, self.lookups = admitted, updated, evicted, lookups


class Emulator:
    """The dynamic table: rows in slots (``values``, ``score`` (a lookup count), ``last_step``, ``key``), the
    live ones indexed by a sorted key array; admission from a Zipf id stream, eviction by decayed score."""

    DECAY = 0.5

    def __init__(self, target: int, dim: int, seed: int, zipf_a: float = 1.1, admit=(0.10, 0.20)):
        self.target, self.dim, self.zipf_a, self.admit = target, dim, zipf_a, admit
        self.rng = np.random.default_rng(seed)
        cap = int(target * (1 + admit[1]) + 16)
        self.key = np.full(cap, -1, np.int64)
        self.values = np.zeros((cap, dim), np.float32)
        self.score = np.zeros(cap, np.float32)
        self.last_step = np.zeros(cap, np.int64)
        self.live = np.zeros(cap, bool)
        self.noise = (self.rng.standard_normal((1 << 16, dim), dtype=np.float32) * 0.01).astype(np.float32)
        self.noise_at = 0
        # the table starts with the stream's `target` hottest ids (ranks 1..target)
        keys = ids_of_ranks(np.arange(1, target + 1, dtype=np.uint64))
        keys = np.unique(keys)  # (collisions in 2^40: a handful at 10^7)
        n = keys.size
        self.key[:n] = keys
        self.values[:n] = self._noise(n) * 100
        self.score[:n] = 1.0
        self.live[:n] = True
        self.sorted_keys = keys.copy()  # ascending
        self.sorted_slots = np.arange(n, dtype=np.int64)
        self.free = np.arange(n, cap, dtype=np.int64)[::-1].copy()  # a stack of free slots
        self.step = 0

    def _noise(self, n: int) -> np.ndarray:
        """n rows of small deterministic noise (a rolling window over a fixed block: cheap, and rows differ)."""
        b = self.noise.shape[0]
        idx = (np.arange(n, dtype=np.int64) * 7 + self.noise_at) % b
        self.noise_at = (self.noise_at + 7919 * n + 1) % b
        return self.noise[idx]

    def _slots_of(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hit mask, slots of the hits) of ``keys`` among the live ids."""
        at = np.searchsorted(self.sorted_keys, keys)
        at_c = np.minimum(at, self.sorted_keys.size - 1)
        hit = self.sorted_keys[at_c] == keys
        return hit, self.sorted_slots[at_c[hit]]

    def _stream(self, need: int) -> np.ndarray:
        """The interval's lookups: Zipf draws until ``need`` distinct ids not in the table were seen."""
        parts, new_seen = [], np.zeros(0, np.int64)
        chunk = max(1 << 16, int(need * 6))
        while True:
            ids = ids_of_ranks(self.rng.zipf(self.zipf_a, chunk).astype(np.uint64))
            hit, _ = self._slots_of(ids)
            fresh = np.flatnonzero(~hit)
            # distinct new ids in order of first sight (earlier chunks' first)
            uniq, first = np.unique(ids[fresh], return_index=True)
            keep = ~np.isin(uniq, new_seen)
            firsts = np.sort(fresh[first[keep]])
            if new_seen.size + firsts.size >= need:
                cut = firsts[need - new_seen.size - 1] + 1
                parts.append(ids[:cut])
                return np.concatenate(parts)
            parts.append(ids)
            new_seen = np.union1d(new_seen, uniq[keep])

    def advance(self) -> Interval:
        self.step += 1
        t = self.step
        share = self.rng.uniform(*self.admit)
        need = max(1, int(round(share * self.target)))
        stream = self._stream(need)
        uniq, counts = np.unique(stream, return_counts=True)
        hit, slots = self._slots_of(uniq)
        # updated: decayed count plus this interval's lookups, the value moved
        age = (t - self.last_step[slots]).astype(np.float32)
        self.score[slots] = self.score[slots] * np.float32(self.DECAY) ** age + counts[hit].astype(np.float32)
        self.last_step[slots] = t
        self.values[slots] += self._noise(slots.size)
        # admitted: new slots
        new_keys = uniq[~hit]
        new_slots = self.free[-new_keys.size:][::-1].copy()
        self.free = self.free[:-new_keys.size]
        self.key[new_slots] = new_keys
        self.values[new_slots] = self._noise(new_keys.size) * 100
        self.score[new_slots] = counts[~hit].astype(np.float32)
        self.last_step[new_slots] = t
        self.live[new_slots] = True
        # evicted: the lowest decayed scores, down to the target
        live_slots = np.flatnonzero(self.live)
        over = live_slots.size - self.target
        if over > 0:
            prio = self.score[live_slots] * np.float32(self.DECAY) ** (t - self.last_step[live_slots]).astype(np.float32)
            gone_slots = live_slots[np.argpartition(prio, over - 1)[:over]]
        else:
            gone_slots = np.zeros(0, np.int64)
        gone_keys = self.key[gone_slots]
        self.live[gone_slots] = False
        self.free = np.concatenate([self.free, gone_slots])
        # the sorted index: drop the evicted that were live before, add the admitted that survived
        was_new = self.last_step[gone_slots] == t
        was_new &= np.isin(gone_keys, new_keys, assume_unique=True)
        evicted_old = np.sort(gone_keys[~was_new])
        keep = np.ones(self.sorted_keys.size, bool)
        keep[np.searchsorted(self.sorted_keys, evicted_old)] = False
        sk, ss = self.sorted_keys[keep], self.sorted_slots[keep]
        survivors = self.live[new_slots]
        add_k, add_s = new_keys[survivors], new_slots[survivors]  # new_keys ascending (np.unique)
        at = np.searchsorted(sk, add_k)
        self.sorted_keys, self.sorted_slots = np.insert(sk, at, add_k), np.insert(ss, at, add_s)
        updated = uniq[hit]
        put = np.union1d(updated[~np.isin(updated, evicted_old, assume_unique=True)], add_k)
        return Interval(put, evicted_old, int(add_k.size), int(put.size - add_k.size), int(evicted_old.size),
                        int(stream.size))

    def rows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, score, last_step) of live ``keys`` (gathered copies)."""
        hit, slots = self._slots_of(keys)
        assert hit.all()
        return self.values[slots], self.score[slots], self.last_step[slots]

    def state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys ascending, values, score, last_step) of every live id (gathered copies)."""
        s = self.sorted_slots
        return self.sorted_keys.copy(), self.values[s], self.score[s], self.last_step[s]


# ---- the three methods ------------------------------------------------------------------------------------

class CnrstoreKeyed:
    """One store, one keyed table; ``save`` puts the interval's puts and deletes its evictions."""

    def __init__(self, path: str, dim: int, partitions: int):
        import cnrstore

        self.path = path
        self.store = cnrstore.open(path, create=True)
        self.store.create_table("ids", dim=dim, keyed=True, partitions=partitions, columns=COLUMNS)

    def save(self, em: Emulator, put: np.ndarray, deleted: np.ndarray, step: int) -> int:
        values, score, last = em.rows(put)
        with self.store.checkpoint(step=step) as ck:  # (buffered by the writer: one record per partition;
            if deleted.size:                          # evictions first, as API.md advises)
                ck.delete_keys("ids", deleted)
            if put.size:
                ck.put_keys("ids", put, values, columns={"score": score, "last_step": last})
        return ck.version


def owned_by(parts: np.ndarray, partitions: int, world: int, rank: int) -> np.ndarray:
    """Whether each partition is rank ``rank``'s of ``world`` (ownership by partition range)."""
    return parts * world // partitions == rank


def dcp_save(d: str, keys, values, score, last) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"keys": torch.from_numpy(keys), "values": torch.from_numpy(values), "score": torch.from_numpy(score),
             "last_step": torch.from_numpy(last)}
    dcp.save(state, checkpoint_id=d, no_dist=True)


def dcp_load(d: str) -> tuple:
    import torch
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(d).read_metadata().state_dict_metadata
    dtypes = {"keys": torch.int64, "values": torch.float32, "score": torch.float32, "last_step": torch.int64}
    state = {name: torch.empty(tuple(meta[name].size), dtype=dt) for name, dt in dtypes.items()}
    dcp.load(state, checkpoint_id=d, no_dist=True)
    return tuple(state[n].numpy() for n in dtypes)


def torch_save(path: str, arrays: dict) -> None:
    import torch

    torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}, path)


def torch_load(path: str) -> dict:
    import torch

    return {k: v.numpy() for k, v in torch.load(path, weights_only=True).items()}


def dynamicemb_restore(files: list[str]) -> tuple:
    """The newest state from a full dump and the deltas after it (``files``, oldest first): (keys ascending,
    values, score, last_step) -- score and last_step as the full dump had them (the deltas carry none)."""
    full = torch_load(files[0])
    keys, values, score, last = full["keys"], full["values"], full["score"], full["last_step"]
    for f in files[1:]:
        d = torch_load(f)
        at = np.searchsorted(keys, d["keys"])
        at_c = np.minimum(at, keys.size - 1)
        hit = keys[at_c] == d["keys"] if keys.size else np.zeros(d["keys"].size, bool)
        values[at_c[hit]] = d["values"][hit]
        new_k, new_v = d["keys"][~hit], d["values"][~hit]
        pos = np.searchsorted(keys, new_k)
        keys = np.insert(keys, pos, new_k)
        values = np.insert(values, pos, new_v, axis=0)
        score = np.insert(score, pos, np.float32(0))
        last = np.insert(last, pos, np.int64(-1))
    return keys, values, score, last


class CountReads:
    """Bytes and records a keyed read fetched: each record of a keyed read is fetched and checksum-verified by
    ``keyed_reader.fetch``, wrapped for the duration of the ``with`` block (its index entry's length)."""

    def __enter__(self):
        from cnrstore.engine import keyed_reader

        self.module, self.inner = keyed_reader, keyed_reader.fetch
        self.bytes = self.records = 0

        def counting(storage, loc, expect=None):
            self.bytes += int(loc.length)
            self.records += 1
            return self.inner(storage, loc, expect)

        keyed_reader.fetch = counting
        return self

    def __exit__(self, *exc):
        self.module.fetch = self.inner


# ---- the run ---------------------------------------------------------------------------------------------

def equal_state(got: tuple, want: tuple) -> bool:
    return all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(got, want))


def run(args) -> dict:
    import cnrstore
    import torch
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    dim, target = args.dim, args.keys
    P = args.partitions or max(16, 1 << max(0, math.ceil(math.log2(max(1, target) / (1 << 15)))))
    row_bytes = 4 * dim + 4 + 8  # fp32 value, score, last_step
    root = tempfile.mkdtemp(prefix="bench-dynamic-", dir=args.dir)
    out: dict = {"P": P, "keys": target, "dim": dim, "row_bytes": row_bytes, "saves": []}
    t_all = time.perf_counter()
    try:
        t0 = time.perf_counter()
        em = Emulator(target, dim, args.seed)
        out["setup_s"] = time.perf_counter() - t0
        single = CnrstoreKeyed(os.path.join(root, "keyed"), dim, P)
        ranks = [CnrstoreKeyed(os.path.join(root, f"rank{r}"), dim, P) for r in range(WRITERS)]
        dcp_dirs: list[str] = []
        dyn_files: list[str] = []
        emu_s = 0.0
        for i in range(args.saves):
            t0 = time.perf_counter()
            if i == 0:  # the first save: the table as it starts (every id put)
                iv = Interval(em.sorted_keys.copy(), np.zeros(0, np.int64), int(em.sorted_keys.size), 0, 0, 0)
            else:
                iv = em.advance()
            emu_s += time.perf_counter() - t0
            rec = {"admitted": iv.admitted, "updated": iv.updated, "evicted": iv.evicted, "lookups": iv.lookups,
                   "put": int(iv.put.size), "deleted": int(iv.deleted.size),
                   "ideal": int(iv.put.size) * (8 + row_bytes) + int(iv.deleted.size) * 8}
            # (a) cnrstore keyed
            os.sync()  # each method's save starts with no other method's writes pending
            t0 = time.perf_counter()
            v = single.save(em, iv.put, iv.deleted, i)
            rec["cnr_stall"] = time.perf_counter() - t0
            rec["cnr_bytes"] = single.store.versions()[-1].bytes
            rec["cnr_version"] = v
            # the N=2 writer ranks: each its own partitions' puts and deletions
            pp = single.store.partition_of("ids", iv.put)
            pd = single.store.partition_of("ids", iv.deleted)
            rank_stall = []
            os.sync()
            for r, st in enumerate(ranks):
                t0 = time.perf_counter()
                st.save(em, iv.put[owned_by(pp, P, WRITERS, r)], iv.deleted[owned_by(pd, P, WRITERS, r)], i)
                rank_stall.append(time.perf_counter() - t0)
            rec["rank_stall"] = rank_stall
            # (b) DCP full dump of the whole table, a new directory per save (only the newest kept)
            os.sync()
            t0 = time.perf_counter()
            d = os.path.join(root, f"dcp-{i}")
            dcp_save(d, *em.state())
            rec["dcp_stall"] = time.perf_counter() - t0
            rec["dcp_bytes"] = dir_bytes(d)
            for old in dcp_dirs:
                shutil.rmtree(old)
            dcp_dirs = [d]
            # (c) dynamicemb-style: a full dump every K saves, key-only deltas between
            os.sync()
            t0 = time.perf_counter()
            f = os.path.join(root, f"dyn-{i}.pt")
            if i % args.full_every == 0:
                keys, values, score, last = em.state()
                torch_save(f, {"keys": keys, "values": values, "score": score, "last_step": last})
                for old in dyn_files:
                    os.remove(old)
                dyn_files = [f]
                rec["dyn_kind"] = "full"
            else:
                values, _s, _l = em.rows(iv.put)
                torch_save(f, {"keys": iv.put, "values": values})
                dyn_files.append(f)
                rec["dyn_kind"] = "delta"
            rec["dyn_stall"] = time.perf_counter() - t0
            rec["dyn_bytes"] = os.path.getsize(f)
            out["saves"].append(rec)
            print(f"save {i}: put {iv.put.size:,} (admitted {iv.admitted:,}, updated {iv.updated:,}), deleted "
                  f"{iv.deleted.size:,}; cnrstore {fmt_bytes(rec['cnr_bytes'])} in {rec['cnr_stall']:.2f} s "
                  f"({rec['cnr_bytes'] / rec['ideal']:.2f}x ideal); DCP {fmt_bytes(rec['dcp_bytes'])} in "
                  f"{rec['dcp_stall']:.2f} s; dynamicemb {rec['dyn_kind']} {fmt_bytes(rec['dyn_bytes'])} in "
                  f"{rec['dyn_stall']:.2f} s; peak RSS {peak_rss() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        out["emulate_s"] = emu_s
        out["cnr_disk"] = dir_bytes(single.path)
        want = em.state()
        out["live"] = int(want[0].size)
        del em  # (the emulated table: the reads below compare with `want`)

        # restores of the newest, each checked against the emulator's state
        single.store.close()
        t0 = time.perf_counter()
        with cnrstore.open(single.path, readonly=True) as st:
            kr = st.read_keyed("ids")
        out["cnr_restore"] = time.perf_counter() - t0
        out["cnr_exact"] = equal_state((kr.keys, kr.values, kr.columns["score"], kr.columns["last_step"]), want)
        del kr
        with cnrstore.open(single.path) as st:  # the same restore once the chains are one baseline each
            st.compact()
        t0 = time.perf_counter()
        with cnrstore.open(single.path, readonly=True) as st:
            kr = st.read_keyed("ids")
        out["cnr_restore_compacted"] = time.perf_counter() - t0
        out["cnr_exact"] &= equal_state((kr.keys, kr.values, kr.columns["score"], kr.columns["last_step"]), want)
        del kr
        t0 = time.perf_counter()
        got = dcp_load(dcp_dirs[-1])
        out["dcp_restore"] = time.perf_counter() - t0
        out["dcp_exact"] = equal_state(got, want)
        del got
        t0 = time.perf_counter()
        keys, values, score, last = dynamicemb_restore(dyn_files)
        out["dyn_restore"] = time.perf_counter() - t0
        at = np.minimum(np.searchsorted(keys, want[0]), max(keys.size - 1, 0))
        present = keys[at] == want[0]
        out["dyn_missing"] = int((~present).sum())
        out["dyn_stale_keys"] = int(keys.size - present.sum())
        out["dyn_values_exact"] = bool(present.all() and np.array_equal(values[at], want[1]))
        out["dyn_stale_meta"] = int(((score[at] != want[2]) | (last[at] != want[3])).sum())
        out["dyn_exact"] = out["dyn_missing"] == 0 and out["dyn_stale_keys"] == 0 and out["dyn_values_exact"] \
            and out["dyn_stale_meta"] == 0
        del keys, values, score, last

        print(f"restores: cnrstore {out['cnr_restore']:.2f} s (compacted {out['cnr_restore_compacted']:.2f} s), DCP {out['dcp_restore']:.2f} s, dynamicemb "
              f"{out['dyn_restore']:.2f} s; peak RSS {peak_rss() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        # resharding N=2 -> M=3 by partition range
        for st in ranks:
            st.store.close()
        out["reshard"] = reshard(args, [st.path for st in ranks], P, want, row_bytes, root)
        out["exact"] = out["cnr_exact"] and out["dcp_exact"] and all(
            r["exact"] for r in out["reshard"]["cnr"] + out["reshard"]["cnr_compacted"] + out["reshard"]["dyn"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["wall_s"] = time.perf_counter() - t_all
    out["peak_rss"] = peak_rss()
    return out


def reshard(args, paths: list[str], P: int, want: tuple, row_bytes: int, root: str) -> dict:
    """Reader ranks j < M reading their partition range from every writer store; then the same after
    compact(); then the dynamicemb/DCP-style reshard from N rank files."""
    import cnrstore

    keys_all = want[0]
    with cnrstore.open(paths[0], readonly=True) as st:
        parts_all = st.partition_of("ids", keys_all)

    def read_cnr() -> list[dict]:
        rows = []
        for j in range(READERS):
            mine = np.flatnonzero(owned_by(np.arange(P), P, READERS, j))
            got_k, got_v, got_s, got_l = [], [], [], []
            t0 = time.perf_counter()
            with CountReads() as count:
                for r, path in enumerate(paths):
                    theirs = mine[owned_by(mine, P, WRITERS, r)]  # the writer plan says which store holds which
                    if not theirs.size:
                        continue
                    with cnrstore.open(path, readonly=True) as st:
                        kr = st.read_keyed("ids", partitions=theirs)
                    got_k.append(kr.keys), got_v.append(kr.values)
                    got_s.append(kr.columns["score"]), got_l.append(kr.columns["last_step"])
            seconds = time.perf_counter() - t0
            k = np.concatenate(got_k)
            order = np.argsort(k)
            own = owned_by(parts_all, P, READERS, j)
            exact = equal_state((k[order], np.concatenate(got_v)[order], np.concatenate(got_s)[order],
                                 np.concatenate(got_l)[order]), tuple(a[own] for a in want))
            owned_bytes = int(own.sum()) * (8 + row_bytes)
            rows.append({"reader": j, "partitions": int(mine.size), "keys": int(own.sum()), "owned": owned_bytes,
                         "read": count.bytes, "records": count.records, "seconds": seconds, "exact": exact})
        return rows

    res = {"cnr": read_cnr()}
    t0 = time.perf_counter()
    compact_bytes = 0
    for path in paths:
        with cnrstore.open(path) as st:
            rep = st.compact()
            compact_bytes += rep.bytes_written
    res["compact_s"] = time.perf_counter() - t0
    res["compact_bytes"] = compact_bytes
    res["cnr_compacted"] = read_cnr()
    # dynamicemb/DCP-style: N rank files, ids owned by key % N; each reader loads every file whole
    files = []
    for r in range(WRITERS):
        mask = keys_all % WRITERS == r
        f = os.path.join(root, f"reshard-rank{r}.pt")
        torch_save(f, {"keys": keys_all[mask], "values": want[1][mask], "score": want[2][mask],
                       "last_step": want[3][mask]})
        files.append(f)
    rows = []
    for j in range(READERS):
        own = owned_by(parts_all, P, READERS, j)  # the same new ownership as cnrstore's readers
        t0 = time.perf_counter()
        read = 0
        got = []
        for f in files:
            read += os.path.getsize(f)
            d = torch_load(f)
            mask = owned_by(np.asarray(partition_of_keys(d["keys"], P)), P, READERS, j)
            got.append({k: v[mask] for k, v in d.items()})
            del d
        seconds = time.perf_counter() - t0
        k = np.concatenate([g["keys"] for g in got])
        order = np.argsort(k)
        exact = equal_state(tuple(np.concatenate([g[n] for g in got])[order] for n in ("keys", "values", "score",
                                                                                          "last_step")),
                            tuple(a[own] for a in want))
        rows.append({"reader": j, "keys": int(own.sum()), "owned": int(own.sum()) * (8 + row_bytes), "read": read,
                     "seconds": seconds, "exact": exact})
    res["dyn"] = rows
    return res


def partition_of_keys(keys: np.ndarray, P: int) -> np.ndarray:
    from cnrstore.engine import keyed_runs

    return keyed_runs.partition_of(keys, P)


# ---- serving: a follower's freshness with evictions ------------------------------------------------------

GOAL_FRESH_P50_S, GOAL_FRESH_P99_S = 1.0, 2.4  # bench_serving.py's local goals (issue 40), issue 50 keeps them
EXPECT_SAMPLE = 2000  # put ids per version whose rows the follower checks bit for bit


def _expect_path(d: str, version: int) -> str:
    return os.path.join(d, f"v{version}.npz")


def write_expect(d: str, version: int, put: np.ndarray, deleted: np.ndarray, values, score, last,
                 rng: np.random.Generator) -> None:
    """What version ``version`` changed, for the follower's checks: every id put and every id deleted, and a
    sample of the put ids with their rows. Written (atomically) before the version commits, so it is there
    whenever the follower applies the version."""
    pick = np.sort(rng.choice(put.size, min(EXPECT_SAMPLE, put.size), replace=False)) if put.size else \
        np.zeros(0, np.int64)
    tmp = os.path.join(d, f".v{version}.tmp.npz")
    np.savez(tmp, put=put, deleted=deleted, skeys=put[pick], svalues=values[pick], sscore=score[pick],
             slast=last[pick])
    os.replace(tmp, _expect_path(d, version))


def check_update(rep, expect: dict, since: int, until: int) -> dict:
    """The replica at ``until`` (the follower just applied ``(since, until]``), against what each version of
    ``(since, until]`` changed: every id version u evicted and no later version of them put again is not found
    (and reads as zeros); each sampled id u put and no later version of them put or deleted is found with its
    row bit for bit (value, score, last_step)."""
    stale = wrong = evicted_checked = put_checked = 0
    later_put = later_del = np.zeros(0, np.int64)
    for u in range(until, since, -1):  # newest first: what a later version changed is left out of u's checks
        e = expect[u]
        gone = e["deleted"][~np.isin(e["deleted"], later_put)]
        found, values = rep.lookup(gone)
        stale += int(found.sum()) + int(values[~found].any(axis=1).sum())
        evicted_checked += int(gone.size)
        keep = ~np.isin(e["skeys"], later_put) & ~np.isin(e["skeys"], later_del)
        got = rep.read(e["skeys"][keep])
        ok = got.found & (got.values.view(np.uint32) == e["svalues"][keep].view(np.uint32)).all(axis=1) \
            & (got.columns["score"].view(np.uint32) == e["sscore"][keep].view(np.uint32)) \
            & (got.columns["last_step"] == e["slast"][keep])
        wrong += int((~ok).sum())
        put_checked += int(keep.sum())
        later_put, later_del = np.union1d(later_put, e["put"]), np.union1d(later_del, e["deleted"])
    return {"stale": stale, "wrong": wrong, "evicted_checked": evicted_checked, "put_checked": put_checked}


def follow_child(path: str, expect_dir: str, poll_s: float, ready, stop, results) -> None:
    """The serving process: follows ``path`` into a KeyedReplica, polling every ``poll_s`` s until ``stop``;
    after each update, ``check_update``; at the end, the whole replica against the trainer's final state.
    Puts its per-update log."""
    from cnrstore.serving import Follower, KeyedReplica

    rep = KeyedReplica()
    f = Follower(path, {"ids": rep}, version=None)  # the full sync, not measured
    ready.set()
    log, expect = [], {}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with CountReads() as count:
        while True:
            stopping = stop.is_set()  # (one more poll after stop: the last version)
            t0, c0, v0 = time.perf_counter(), time.process_time(), f.version
            b0, r0, n0 = f.stats["bytes_read"], count.bytes, count.records
            got = f.poll()
            if got is not None:
                at = time.time()
                u = {"from": v0, "to": got, "at": at, "wall_s": time.perf_counter() - t0,
                     "cpu_s": time.process_time() - c0, "stats_bytes": f.stats["bytes_read"] - b0,
                     "fetched": count.bytes - r0, "records": count.records - n0}
                t1 = time.perf_counter()
                for v in range(v0 + 1, got + 1):
                    if v not in expect:
                        with np.load(_expect_path(expect_dir, v)) as z:
                            expect[v] = {k: z[k] for k in z.files}
                u.update(check_update(rep, expect, v0, got))
                u["check_s"] = time.perf_counter() - t1
                for v in [v for v in expect if v <= got]:
                    del expect[v]
                log.append(u)
            if stopping:
                break
            time.sleep(max(0.0, poll_s - (time.perf_counter() - t0)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    final = {"version": f.version, "exact": False}
    with np.load(os.path.join(expect_dir, "final.npz")) as z:
        rows = rep.rows()
        final["want_version"] = int(z["version"])
        final["exact"] = final["version"] == final["want_version"] and equal_state(
            (rows.keys, rows.values, rows.columns["score"], rows.columns["last_step"]),
            (z["keys"], z["values"], z["score"], z["last_step"]))
    f.close()
    results.put({"log": log, "cpu_s": cpu, "wall_s": wall, "final": final})


def follow(args, root: str) -> dict:
    """A keyed table of ``--follow-keys`` ids saved every ``--follow-save-s`` s (``--follow-saves`` saves
    after the first) while a spawned process follows it (``follow_child``): freshness, checks, bytes."""
    import multiprocessing as mp

    import cnrstore

    dim, target = args.dim, args.follow_keys
    P = args.partitions or max(16, 1 << max(0, math.ceil(math.log2(max(1, target) / (1 << 15)))))
    row_bytes = 4 * dim + 4 + 8
    path, expect_dir = os.path.join(root, "follow"), os.path.join(root, "follow-expect")
    os.makedirs(expect_dir)
    em = Emulator(target, dim, args.seed + 1)
    rng = np.random.default_rng(args.seed + 2)
    tab = CnrstoreKeyed(path, dim, P)
    ideal, counts, emu, stall = {}, {}, [], []

    def save(iv: Interval, step: int) -> int:
        values, score, last = em.rows(iv.put)
        t0 = time.perf_counter()
        with tab.store.checkpoint(step=step) as ck:
            write_expect(expect_dir, ck.version, iv.put, iv.deleted, values, score, last, rng)
            if iv.deleted.size:
                ck.delete_keys("ids", iv.deleted)
            if iv.put.size:
                ck.put_keys("ids", iv.put, values, columns={"score": score, "last_step": last})
        stall.append(time.perf_counter() - t0)
        ideal[ck.version] = int(iv.put.size) * (8 + row_bytes) + int(iv.deleted.size) * 8
        counts[ck.version] = (int(iv.put.size), int(iv.deleted.size))
        return ck.version

    save(Interval(em.sorted_keys.copy(), np.zeros(0, np.int64), int(em.sorted_keys.size), 0, 0, 0), 0)
    ctx = mp.get_context("spawn")
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=follow_child, args=(path, expect_dir, args.poll_s, ready, stop, results), daemon=True)
    child.start()
    try:
        if not ready.wait(600):
            raise RuntimeError("the follower did not finish its full sync in 600 s")
        t_start = time.perf_counter()
        for i in range(1, args.follow_saves + 1):
            t0 = time.perf_counter()
            iv = em.advance()
            emu.append(time.perf_counter() - t0)
            time.sleep(max(0.0, t_start + i * args.follow_save_s - time.perf_counter()))  # the save's tick
            v = save(iv, i)
        keys, values, score, last = em.state()
        np.savez(os.path.join(expect_dir, "final.npz"), version=v, keys=keys, values=values, score=score,
                 last_step=last)
        del keys, values, score, last
        time.sleep(max(1.0, 4 * args.poll_s))  # the follower catches up with the last save
        stop.set()
        out = results.get(timeout=600)
        child.join(60)
        created = {x.version: x.created for x in tab.store.versions()}
    finally:
        if child.is_alive():
            child.terminate()
        tab.store.close()
    fresh = {}
    for u in out["log"]:
        for v in range(u["from"] + 1, u["to"] + 1):
            fresh[v] = u["at"] - created[v]
            u["ideal"] = u.get("ideal", 0) + ideal[v]
            u["put"] = u.get("put", 0) + counts[v][0]
            u["deleted"] = u.get("deleted", 0) + counts[v][1]
    return {"keys": target, "P": P, "row_bytes": row_bytes, "saves": args.follow_saves, "save_s": args.follow_save_s,
            "poll_s": args.poll_s, "fresh": [fresh[v] for v in sorted(fresh)], "versions": sorted(fresh),
            "updates": out["log"], "cpu_s": out["cpu_s"], "wall_s": out["wall_s"], "final": out["final"],
            "emulate_s": float(np.median(emu)), "stall_s": float(np.median(stall[1:])),
            "missing": sorted(set(ideal) - {min(ideal)} - set(fresh))}


# ---- the report ------------------------------------------------------------------------------------------

def report(r: dict, args) -> str:
    import cnrstore

    saves = r["saves"]
    inc = saves[1:] or saves
    med = lambda xs: float(np.median(xs))  # noqa: E731
    mb = lambda n: fmt_bytes(n)  # noqa: E731
    lines = ["### Dynamic embedding tables: a keyed table against DCP full dumps and dynamicemb-style deltas", ""]
    lines += [f"- {x}" for x in machine_description()]
    lines += [f"- load average at the end: {load_average()}",
              f"- table: {r['live']:,} live ids (`--keys {r['keys']}`) x dim {r['dim']} fp32 + score (float32) + "
              f"last_step (int64) = {r['row_bytes'] + 8} bytes an id with its key; {r['P']} partitions; ids from a "
              f"2^{KEY_BITS} space; {len(saves)} saves (the first: the table as it starts, then {len(saves) - 1} "
              f"intervals); dynamicemb-style full dump every {args.full_every} saves",
              f"- per interval (medians of the {len(inc)} intervals): {med([s['lookups'] for s in inc]):,.0f} lookups, "
              f"{med([s['admitted'] for s in inc]):,.0f} ids admitted ({med([s['admitted'] for s in inc]) / r['live']:.1%}), "
              f"{med([s['updated'] for s in inc]):,.0f} updated ({med([s['updated'] for s in inc]) / r['live']:.1%}), "
              f"{med([s['evicted'] for s in inc]):,.0f} evicted: {med([s['put'] for s in inc]) / r['live']:.1%} of the "
              "table put per save",
              f"- whole benchmark {r['wall_s']:.0f} s (emulating the trainer: {r['emulate_s']:.0f} s); peak RSS "
              f"{r['peak_rss'] / 2**30:.2f} GiB", ""]
    lines += ["| method | bytes, first save | bytes per save (median of the rest) | stall, first save | stall "
              "(median of the rest) | stall p100 | restore newest | restored exactly |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    dyn_exact = ("yes" if r["dyn_exact"] else
                 f"no: {r['dyn_stale_keys']:,} evicted ids come back, {r['dyn_stale_meta']:,} rows' metadata stale"
                 + ("" if r["dyn_values_exact"] else ", values differ") + (f", {r['dyn_missing']:,} ids missing"
                                                                          if r["dyn_missing"] else ""))
    for name, key, exact in (("cnrstore keyed (fp32)", "cnr", "yes" if r["cnr_exact"] else "**NO**"),
                             ("DCP full dump (dcp.save)", "dcp", "yes" if r["dcp_exact"] else "**NO**"),
                             ("dynamicemb-style (torch.save)", "dyn", dyn_exact)):
        st = [s[f"{key}_stall"] for s in saves]
        by = [s[f"{key}_bytes"] for s in saves]
        lines.append(f"| {name} | {mb(by[0])} | {mb(med(by[1:] or by))} | {st[0] * 1e3:.0f} ms | "
                     f"{med(st[1:] or st) * 1e3:.0f} ms | {max(st) * 1e3:.0f} ms | {r[f'{key}_restore'] * 1e3:.0f} ms | "
                     f"{exact} |")
    lines += ["", f"- cnrstore's restore of the newest after `compact()` (one baseline per partition instead of a "
              f"baseline and the runs since its last merge): {r['cnr_restore_compacted'] * 1e3:.0f} ms "
              f"({r['dcp_restore'] / r['cnr_restore_compacted']:.2f}x dcp.load's speed; as saved: "
              f"{r['dcp_restore'] / r['cnr_restore']:.2f}x)"]
    cnr_b = med([s["cnr_bytes"] for s in inc])
    lines += ["", "Ratios against cnrstore in the same run (above 1x: cnrstore writes or stalls less):", "",
              "| against | bytes per save | stall per save (median) | restore newest |", "|---|---:|---:|---:|"]
    for name, key in (("DCP full dump", "dcp"), ("dynamicemb-style, every save", "dyn")):
        lines.append(f"| {name} | {med([s[f'{key}_bytes'] for s in inc]) / cnr_b:.2f}x | "
                     f"{med([s[f'{key}_stall'] for s in inc]) / med([s['cnr_stall'] for s in inc]):.2f}x | "
                     f"{r[f'{key}_restore'] / r['cnr_restore']:.2f}x |")
    dyn_avg = np.mean([s["dyn_bytes"] for s in inc])
    lines.append(f"| dynamicemb-style, mean over the cycle | {dyn_avg / np.mean([s['cnr_bytes'] for s in inc]):.2f}x "
                 "(means) | | |")
    # cnrstore's bytes against the changes' bytes
    ratios = [s["cnr_bytes"] / s["ideal"] for s in inc]
    worst = max(range(len(inc)), key=lambda i: ratios[i])
    lines += ["", "cnrstore's bytes per save against the interval's changes in the table's codec with their "
              "metadata (each id put: key + value + columns; each id deleted: its key):", "",
              "| save | ids put | ids deleted | changes' bytes | appended (VersionInfo.bytes) | ratio | stall |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for i, s in enumerate(saves):
        lines.append(f"| {i} | {s['put']:,} | {s['deleted']:,} | {mb(s['ideal'])} | {mb(s['cnr_bytes'])} | "
                     f"{s['cnr_bytes'] / s['ideal']:.3f}x | {s['cnr_stall'] * 1e3:.0f} ms |")
    target_bytes = max(ratios) <= 1.2
    lines += ["", f"- bytes per save over the changes' bytes: median {med(ratios):.3f}x, worst {max(ratios):.3f}x "
              f"(save {worst + 1}; first save {saves[0]['cnr_bytes'] / saves[0]['ideal']:.3f}x), all saves after the "
              f"first together {sum(s['cnr_bytes'] for s in inc) / sum(s['ideal'] for s in inc):.3f}x; target <= 1.2x: "
              f"**{'met' if target_bytes else 'missed'}**; saves that merged partitions into baselines (their runs "
              f"at {cnrstore.knobs.KEYED_MERGE_RATIO:g}x the baseline, within {cnrstore.knobs.KEYED_MERGE_BUDGET:g} of "
              f"the save's bytes): {sum(r_ > 1.01 for r_ in ratios)} of {len(inc)}"
              + ("" if len(saves) > 30 else f" (a short run: `--saves 70` shows them)")]
    # resharding
    rs = r["reshard"]
    lines += ["", f"Restore at another world size: {WRITERS} writer ranks (one store each, partitions by range) read "
              f"by {READERS} reader ranks, each its partition range from both stores (`read_keyed(partitions=)`); "
              "bytes read: the records the reads fetched; owned: the reader's live ids' keys and rows in the codec. "
              f"Compaction of both stores (one baseline per partition): {rs['compact_s']:.1f} s, "
              f"{mb(rs['compact_bytes'])} written.", "",
              "| reader | partitions | ids owned | bytes owned | cnrstore as saved: read (records) | ratio | seconds | "
              "cnrstore compacted: read | ratio | seconds | dynamicemb/DCP-style: read (every old rank's file) | "
              "ratio | seconds | exact (as saved / compacted / dynamicemb) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for a, c, d in zip(rs["cnr"], rs["cnr_compacted"], rs["dyn"]):
        lines.append(f"| {a['reader']} | {a['partitions']} | {a['keys']:,} | {mb(a['owned'])} | {mb(a['read'])} "
                     f"({a['records']}) | {a['read'] / a['owned']:.3f}x | {a['seconds']:.2f} | {mb(c['read'])} | "
                     f"{c['read'] / c['owned']:.3f}x | {c['seconds']:.2f} | {mb(d['read'])} | "
                     f"{d['read'] / d['owned']:.3f}x | {d['seconds']:.2f} | "
                     f"{'/'.join('yes' if x['exact'] else 'NO' for x in (a, c, d))} |")
    as_saved = max(a["read"] / a["owned"] for a in rs["cnr"])
    compacted = max(c["read"] / c["owned"] for c in rs["cnr_compacted"])
    dyn_r = max(d["read"] / d["owned"] for d in rs["dyn"])
    lines += ["", f"- bytes read per reader over bytes owned, target <= 1.1x: compacted {compacted:.3f}x "
              f"**{'met' if compacted <= 1.1 else 'missed'}**; as saved (each partition's baseline and the runs since its "
              f"last merge, up to {cnrstore.knobs.KEYED_MERGE_RATIO:g}x the baseline) "
              f"{as_saved:.3f}x **{'met' if as_saved <= 1.1 else 'missed'}**; dynamicemb/DCP-style "
              f"{dyn_r:.3f}x ({WRITERS} files of {READERS}: each reader reads the whole table)",
              f"- every restore checked against the emulator's state (keys, values, score, last_step bit for bit): "
              f"{'all exact' if r['exact'] else '**MISMATCH**'} (dynamicemb-style is exact for values only by design)",
              "- cnrstore's stall includes fsync and the index commit; dcp.save and torch.save do not fsync (their "
              "writeback goes on after the call); `os.sync()` before each method's save, outside its stall, so that "
              "no method waits on another's writes; restores read from a warm page cache",
              f"- reproduce: `python benchmarks/bench_dynamic.py {' '.join(args.argv)}`".rstrip() + ""]
    return "\n".join(lines) + "\n"


def report_follow(fo: dict) -> str:
    """The follower's part of the report."""
    fr = np.array(fo["fresh"])
    ups = fo["updates"]
    p50, p99 = float(np.percentile(fr, 50)), float(np.percentile(fr, 99))
    stale, wrong = sum(u["stale"] for u in ups), sum(u["wrong"] for u in ups)
    ratio = np.array([u["fetched"] / u["ideal"] for u in ups])
    med = lambda k: float(np.median([u[k] for u in ups]))  # noqa: E731
    ms = lambda x: f"{x * 1e3:.0f} ms"  # noqa: E731
    jumps = sum(1 for u in ups if u["to"] - u["from"] > 1)
    fin = fo["final"]
    lines = ["", f"Serving with evictions: a keyed table of {fo['keys']:,} ids (`--follow-keys`; {fo['P']} partitions, the "
             f"same trainer) saved every {fo['save_s']:g} s ({fo['saves']} saves after the first; save stall "
             f"{ms(fo['stall_s'])} median, emulating an interval {ms(fo['emulate_s'])}) while "
             f"`cnrstore.serving.Follower` follows the store into a `KeyedReplica` in a spawned process, polling every "
             f"{fo['poll_s']:g} s (bench_serving.py's method). Freshness: a version's commit (`VersionInfo.created`) to "
             "the poll that applied it returning (`time.time()`, one machine). After each update the follower checks "
             "the replica against what the versions it covered changed (the trainer writes them to a file before each "
             "commit): every id evicted and not put again since must not be found (nor read as anything but zeros); "
             f"{EXPECT_SAMPLE:,} sampled put ids per version, not changed since, must read their rows bit for bit "
             "(value, score, last_step); at the end the whole replica against the trainer's state.", "",
             "| freshness: commit -> the follower's replica | p50 | p99 | max | versions |", "|---|---:|---:|---:|---:|",
             f"| local store, keyed table with evictions | {ms(p50)} | {ms(p99)} | {ms(float(fr.max()))} | {fr.size} |", "",
             "| update | versions | ids put / deleted (changes) | changes' bytes | records fetched | bytes fetched | "
             "ratio | follower's `bytes_read` | update time | check time | evicted ids checked | put ids checked | "
             "stale / wrong |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for i, u in enumerate(ups):
        lines.append(f"| {i + 1} | {u['from'] + 1}-{u['to']} | {u['put']:,} / {u['deleted']:,} | {fmt_bytes(u['ideal'])} | "
                     f"{u['records']} | {fmt_bytes(u['fetched'])} | {u['fetched'] / u['ideal']:.2f}x | "
                     f"{fmt_bytes(u['stats_bytes'])} | {ms(u['wall_s'])} | {ms(u['check_s'])} | "
                     f"{u['evicted_checked']:,} | {u['put_checked']:,} | {u['stale']} / {u['wrong']} |")
    lines += ["", f"- versions followed: {fr.size} of {fo['saves']}" + (f" (missing: {fo['missing']})" if fo["missing"]
              else "") + f", in {len(ups)} updates ({jumps} covering more than one version); evicted ids checked "
              f"{sum(u['evicted_checked'] for u in ups):,}, put ids checked {sum(u['put_checked'] for u in ups):,}: "
              f"**{stale} stale reads** (an evicted id found or read as non-zero), {wrong} wrong rows; the final "
              f"replica (version {fin['version']}) equal to the trainer's state: {'yes' if fin['exact'] else '**NO**'}",
              f"- bytes the follower fetched per update (the key-run records it read: of each partition the update "
              f"touched, its runs newer than the version held, or, past a baseline written since, its chain at both "
              f"versions) over the changes' bytes: median {np.median(ratio):.2f}x, "
              f"max {ratio.max():.2f}x; its `stats[\"bytes_read\"]` counts the decoded changes only "
              f"({fmt_bytes(med('stats_bytes'))} median); update time {ms(med('wall_s'))} median, follower CPU "
              f"{fo['cpu_s'] / fo['wall_s']:.0%} of one core over the run",
              f"- freshness p50 {ms(p50)} (goal <= {GOAL_FRESH_P50_S:g} s): **{'met' if p50 <= GOAL_FRESH_P50_S else 'missed'}**; "
              f"p99 {ms(p99)} (goal <= {GOAL_FRESH_P99_S:g} s, the local goal bench_serving.py meets): "
              f"**{'met' if p99 <= GOAL_FRESH_P99_S else 'missed'}**; never an evicted id's old vector: "
              f"**{'met' if stale == 0 and wrong == 0 and fin['exact'] else 'MISSED'}**"]
    return "\n".join(lines) + "\n"


def follow_ok(fo: dict) -> bool:
    return fo["final"]["exact"] and not fo["missing"] and all(u["stale"] == 0 and u["wrong"] == 0 for u in fo["updates"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=None, help="live ids (default 2,000,000; --quick 100,000)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--saves", type=int, default=None, help="saves, the first of the starting table (default 10; "
                    "--quick 6)")
    ap.add_argument("--partitions", type=int, default=None, help="partitions of the keyed table (default: the "
                    "power of two giving at most 2^15 ids each, at least 16)")
    ap.add_argument("--full-every", type=int, default=4, help="dynamicemb-style: a full dump every K saves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where the stores and dumps go (default: the system's temp)")
    ap.add_argument("--quick", action="store_true", help="100,000 ids, 6 saves: seconds (the tests run it)")
    ap.add_argument("--out", help="also write the markdown report here")
    ap.add_argument("--follow-keys", type=int, default=None, help="the follower's table: live ids (default "
                    "1,000,000; --quick 5,000)")
    ap.add_argument("--follow-saves", type=int, default=None, help="saves the follower follows after the first "
                    "(default 30; --quick 3)")
    ap.add_argument("--follow-save-s", type=float, default=None, help="seconds between those saves (default 2; "
                    "--quick 0.2)")
    ap.add_argument("--poll-s", type=float, default=None, help="the follower's polling interval (default 0.2, as "
                    "bench_serving.py; --quick 0.05)")
    ap.add_argument("--no-follow", action="store_true", help="leave out the follower's part")
    ap.add_argument("--follow-only", action="store_true", help="only the follower's part")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.argv = [a for i, a in enumerate(args.argv) if a != "--out" and (i == 0 or args.argv[i - 1] != "--out")]
    if args.keys is None:
        args.keys = 100_000 if args.quick else 2_000_000
    if args.saves is None:
        args.saves = 6 if args.quick else 10
    for name, full, quick in (("follow_keys", 1_000_000, 5_000), ("follow_saves", 30, 3), ("follow_save_s", 2.0, 0.2),
                              ("poll_s", 0.2, 0.05)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.keys < 1000 or args.saves < 2 or args.full_every < 1:
        ap.error("--keys >= 1000, --saves >= 2, --full-every >= 1")
    if args.follow_keys < 1000 or args.follow_saves < 1 or args.follow_save_s < 0 or args.poll_s <= 0:
        ap.error("--follow-keys >= 1000, --follow-saves >= 1, --follow-save-s >= 0, --poll-s > 0")
    if args.no_follow and args.follow_only:
        ap.error("--no-follow and --follow-only exclude each other")
    ok, md = True, ""
    if not args.follow_only:
        r = run(args)
        md = report(r, args)
        ok = r["exact"]
    if not args.no_follow:
        root = tempfile.mkdtemp(prefix="bench-dynamic-follow-", dir=args.dir)
        try:
            fo = follow(args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if args.follow_only:
            md = "### Dynamic embedding tables: a follower's freshness with evictions\n\n" + "\n".join(
                f"- {x}" for x in machine_description()) + f"\n- load average at the end: {load_average()}\n"
        md += report_follow(fo) + (f"- reproduce: `python benchmarks/bench_dynamic.py {' '.join(args.argv)}`\n"
                                    if args.follow_only else "")
        ok = ok and follow_ok(fo)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
