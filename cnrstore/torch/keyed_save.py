"""How a ``Checkpointer`` saves and restores a ``KeyedEmbedding`` (``keyed_embedding.py``): as keyed tables
(API.md "Keyed tables"), incrementally, the version being the state at ``save()``.

What goes where (``KeyedTracker``):

- the keyed table ``<path>`` (the module's path in the model; ``"keyed_embedding"`` for a model that is one):
  key = the id, value = its weight row (in the Checkpointer's ``codec``), columns ``slot``, ``last_step``,
  ``count`` (int64);
- each row-wise optimizer state tensor of the weight (leading dimension ``capacity``: Adagrad's ``sum``, Adam's
  ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``), a float tensor, is the keyed table
  ``<path>.optim.<state>`` (value: the slot's state row, trailing dimensions flattened, fp32: lossless for
  fp32, fp16 and bf16 state), created at the first save that finds it; the payload's optimizer state holds a
  ``KEYED_MARK`` marker in its place;
- ``step`` and ``seed`` (the init generator's state) are ordinary dense arrays of the model.

**Which ids a save writes.** At each ``save()`` every slot is fingerprinted over its weight row, its id, its
``last_step`` and ``count`` and its row-wise optimizer state (``fingerprint.py``: the Checkpointer's digest,
one pass), and the slot ids are compared with the last save's copy of them (exact). A slot whose fingerprint
or id differs is changed, whatever changed it (a lookup, an optimizer step, weight decay, a write of your
own): its current id is put (value, columns, and its state in every state table), and the id it held at the
last save, if no slot holds that id any more, is deleted (``delete_keys``). An id that moved to another slot
changes both slots, so it is put with its new slot. Everything is taken at ``save()`` (host copies of the
changed rows), so later training never reaches the version.

A *full* save (the Checkpointer's baseline: its first save, the first after a failure or a restore of an
older version, a coalesced save; or a state table met for the first time) puts every live id and deletes,
when the version is written, every key the store's newest version holds that is not live: the version reads
exactly the live ids whatever the store held before.

Limits: the fingerprint's (``fingerprint.py``: two different rows with the same 64-bit digest would be
missed; the ids are compared exactly). Keyed tables are saved incrementally in every ``mode`` (the engine
bounds their read chains itself) and whole in priority saves (``top`` limits positional tables only).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..errors import InvalidArgument
from . import payload as _payload
from .fingerprint import fingerprints
from .keyed_embedding import KeyedEmbedding
from .payload import KEYED_MARK

__all__ = ["COLUMNS", "KeyedJob", "KeyedTracker", "find_keyed", "marked_tables", "marker_tensor", "slot_tensors",
           "state_rows", "with_keyed_state", "write_job"]

#: The columns of a KeyedEmbedding's main keyed table.
COLUMNS = {"slot": "int64", "last_step": "int64", "count": "int64"}


class KeyedJob(NamedTuple):
    """One keyed table's part of a save: put ``keys`` (values, columns), delete ``deleted``; ``full``: also
    delete every key the store's newest version holds beyond ``keys`` (computed when written)."""

    name: str
    keys: np.ndarray
    values: np.ndarray
    columns: dict | None
    deleted: np.ndarray
    codec: str | None
    full: bool


def find_keyed(model: torch.nn.Module) -> list:
    """``KeyedTracker`` of each ``KeyedEmbedding`` of ``model``, in module order."""
    return [KeyedTracker(path or "keyed_embedding", m) for path, m in model.named_modules()
            if isinstance(m, KeyedEmbedding)]


def write_job(store, ck, job: KeyedJob) -> None:
    """Write ``job`` into the open version ``ck`` of ``store`` (on the writer's thread, whose versions commit in
    order: the store's newest version is the one ``ck`` follows)."""
    deleted = job.deleted
    if job.full:
        stored = store.keys(job.name) if store.latest() is not None else np.empty(0, np.int64)
        deleted = np.setdiff1d(stored, job.keys, assume_unique=True)
    if job.keys.size or deleted.size:
        # evictions first: they are keys alone, so the writer's buffer holds them whatever the puts' size, and
        # a put too large for the buffer flushes both in one record per partition (never a partition twice)
        ck.delete_keys(job.name, deleted)
        ck.put_keys(job.name, job.keys, job.values, columns=job.columns, codec=job.codec)


class KeyedTracker:
    """A ``KeyedEmbedding`` as a ``Checkpointer`` saves it (module doc): ``name`` its keyed table, ``saved``
    the fingerprint of each slot and ``saved_ids`` its id as of the last save (None before one),
    ``full_written`` the state tables written whole in this session."""

    def __init__(self, name: str, module: KeyedEmbedding):
        self.name = name
        self.module = module
        self.saved: np.ndarray | None = None
        self.saved_ids: np.ndarray | None = None
        self.full_written: set = set()
        self._now = None  # (fingerprints, ids) taken by the last pick()

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.module.weight

    def row_tensors(self) -> list:
        """The module's tensors saved by rows (not dense arrays)."""
        m = self.module
        return [m.weight, m.slot_ids, m.last_step, m.count]

    def states(self, optimizers) -> list:
        """(state name, tensor) of the row-wise optimizer state of the weight, in a stable order."""
        out = []
        cap = self.module.capacity
        for opt in optimizers:
            state = opt.state.get(self.module.weight)
            for key in sorted(state or (), key=str):
                v = state[key]
                if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == cap:
                    if v.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                        raise InvalidArgument(f"keyed embedding {self.name!r}: optimizer state {key!r} is {v.dtype}; "
                                              "keyed tables hold float32, float16 or bfloat16 row-wise state")
                    out.append((str(key), v))
        return out

    def ensure_tables(self, store, existing: dict, codec: str, states) -> None:
        """Create the keyed tables (main, and one per state) if missing; InvalidArgument for another shape."""
        m = self.module
        want = [(self.name, m.dim, codec, COLUMNS)] + [
            (f"{self.name}.optim.{k}", max(1, s[0].numel()), "fp32", None) for k, s in states]
        for name, dim, c, columns in want:
            info = existing.get(name)
            if info is None:
                if getattr(store, "readonly", False):
                    continue
                store.create_table(name, dim=dim, keyed=True, partitions=m.partitions, codec=c, columns=columns)
                existing[name] = store.tables()[name]
            elif not getattr(info, "keyed", False) or info.dim != dim:
                raise InvalidArgument(f"table {name!r} in the store is not a keyed table of dim {dim} (the keyed "
                                      f"embedding's); use a new store, or a model of the stored shape")

    def _fingerprint(self, states) -> np.ndarray:
        m = self.module
        fp = fingerprints([m.weight.detach(), m.slot_ids, m.last_step, m.count]
                          + [s.detach().reshape(m.capacity, -1) for _k, s in states])
        return fp if isinstance(fp, np.ndarray) else fp.cpu().numpy()

    def snapshot(self, optimizers, full: bool, codec: str, store, existing: dict) -> tuple[list, int]:
        """The ``KeyedJob``s of a save (``full``: every live id) and the ids it puts; host copies, now."""
        m = self.module
        states = self.states(optimizers)
        self.ensure_tables(store, existing, codec, states)
        with torch.no_grad():
            now = self._fingerprint(states)
            ids = m.slot_ids.cpu().numpy().copy()
            full = full or self.saved is None
            if full:
                slots = np.flatnonzero(ids >= 0)
                deleted = np.empty(0, np.int64)
            else:
                changed = (now != self.saved) | (ids != self.saved_ids)
                cslots = np.flatnonzero(changed)
                slots = cslots[ids[cslots] >= 0]
                old = self.saved_ids[cslots]
                deleted = np.setdiff1d(old[old >= 0], ids[slots])
            keys = ids[slots]
            order = np.argsort(keys, kind="stable")
            slots, keys = slots[order], keys[order]
            t_slots = torch.from_numpy(slots).to(m.weight.device)
            cols = {"slot": slots.astype(np.int64),
                    "last_step": m.last_step[t_slots].cpu().numpy(), "count": m.count[t_slots].cpu().numpy()}
            jobs = [KeyedJob(self.name, keys, m.weight.detach()[t_slots].float().cpu().numpy(), cols, deleted,
                             codec, full)]
            all_slots = None
            for key, s in states:
                name = f"{self.name}.optim.{key}"
                st_full = full or name not in self.full_written
                if st_full and not full:
                    if all_slots is None:
                        all_slots = np.flatnonzero(ids >= 0)
                        all_slots = all_slots[np.argsort(ids[all_slots], kind="stable")]
                    use = all_slots
                else:
                    use = slots
                t_use = torch.from_numpy(use).to(s.device)
                vals = s.detach()[t_use].reshape(use.size, max(1, s[0].numel())).float().cpu().numpy()
                jobs.append(KeyedJob(name, ids[use], vals, None, deleted, None, st_full))
        self._now = (now, ids, [f"{self.name}.optim.{k}" for k, _s in states])
        return jobs, int(keys.size)

    def settle(self) -> None:
        """The snapshot was taken: its fingerprints and ids become the last save's."""
        now, ids, names = self._now
        self.saved, self.saved_ids = now, ids
        self.full_written.update(names)
        self._now = None

    def note_restore(self, optimizers) -> None:
        """The live module was just loaded from a version: it is what the last save holds (when it is not
        the store's newest, the Checkpointer's next save is full anyway)."""
        states = self.states(optimizers)
        with torch.no_grad():
            self.saved = self._fingerprint(states)
            self.saved_ids = self.module.slot_ids.cpu().numpy().copy()
        self.full_written = {f"{self.name}.optim.{k}" for k, _s in states}

    def free_value(self, key: str, state: torch.Tensor) -> float:
        """The value every free slot's row of ``state`` holds (the payload's ``KEYED_MARK`` records it: a
        restore fills the free slots with it); InvalidArgument if they differ (such a save is refused)."""
        free = self.module.slot_ids < 0
        if not bool(free.any()):
            return 0.0
        rows = state.detach()[free.to(state.device)].reshape(-1)
        if not rows.numel():
            return 0.0
        ints = {2: torch.int16, 4: torch.int32}[rows.element_size()]
        bits = rows.view(ints)
        if not bool((bits == bits[0]).all()):
            raise InvalidArgument(f"keyed embedding {self.name!r}: the free slots hold different optimizer state "
                                  f"{key!r}, which a keyed table cannot save (only the slots of live ids are "
                                  "saved); reset it, or bind_optimizer() the optimizer before training")
        return float(rows[0])

    # -- restore --------------------------------------------------------------------------------------
    def read(self, store, v: int, catalog: dict) -> dict:
        """The module's row tensors and optimizer state rows at version ``v``, as new host tensors
        ({"weight", "slot_ids", "last_step", "count"} and {"optim.<state>": (capacity, width) float32 with the
        rows of the live ids}); InvalidArgument if the version does not fit the module."""
        m = self.module
        info = catalog.get(self.name)
        if info is None or not getattr(info, "keyed", False):
            raise InvalidArgument(f"version {v} has no keyed table {self.name!r} for the model's keyed embedding")
        if info.dim != m.dim:
            raise InvalidArgument(f"keyed table {self.name!r}: the store has dim {info.dim}, the model {m.dim}; "
                                  "restore into a model of the stored shape")
        rows = store.read_keyed(self.name, v)
        slots = rows.columns["slot"]
        if slots.size and (slots.min() < 0 or slots.max() >= m.capacity or np.unique(slots).size != slots.size):
            raise InvalidArgument(f"keyed table {self.name!r} at version {v}: its slots do not fit the model's "
                                  f"capacity {m.capacity} (saved from a larger KeyedEmbedding?)")
        out = slot_tensors(m.capacity, m.dim, slots, rows.keys, rows.values, rows.columns["last_step"],
                           rows.columns["count"])
        prefix = f"{self.name}.optim."
        for name, ti in catalog.items():
            if not name.startswith(prefix) or not getattr(ti, "keyed", False):
                continue
            srows = store.read_keyed(name, v)
            pos = np.zeros(0, np.int64)
            if srows.keys.size:
                pos = np.searchsorted(rows.keys, srows.keys)
                pos = np.minimum(pos, max(rows.keys.size - 1, 0))
                if not rows.keys.size or not np.array_equal(rows.keys[pos], srows.keys):
                    raise InvalidArgument(f"version {v}: keyed table {name!r} holds ids {self.name!r} does not")
            out[name[len(self.name) + 1:]] = state_rows(m.capacity, ti.dim, slots[pos], srows.values)
        return out

    def load(self, read: dict) -> None:
        """Put :meth:`read`'s row tensors into the live module (in place) and rebuild its id map."""
        m = self.module
        with torch.no_grad():
            m.weight.copy_(read["weight"].to(m.weight.dtype))
            m.slot_ids.copy_(read["slot_ids"])
            m.last_step.copy_(read["last_step"])
            m.count.copy_(read["count"])
        m.rebuild_index()


def slot_tensors(capacity: int, dim: int, slots: np.ndarray, keys: np.ndarray, values: np.ndarray,
                 last_step: np.ndarray, count: np.ndarray) -> dict:
    """A ``KeyedEmbedding``'s row tensors (new host tensors, ``capacity`` slots) holding ``keys`` at ``slots``
    with their ``values``, ``last_step`` and ``count``; every other slot free (id -1, zeros)."""
    t = torch.from_numpy(np.ascontiguousarray(slots, np.int64))
    out = {"weight": torch.zeros(capacity, dim, dtype=torch.float32),
           "slot_ids": torch.full((capacity,), -1, dtype=torch.int64),
           "last_step": torch.zeros(capacity, dtype=torch.int64), "count": torch.zeros(capacity, dtype=torch.int64)}
    for name, arr in (("weight", values), ("slot_ids", keys), ("last_step", last_step), ("count", count)):
        out[name][t] = torch.from_numpy(np.ascontiguousarray(arr))
    return out


def state_rows(capacity: int, width: int, slots: np.ndarray, values: np.ndarray) -> torch.Tensor:
    """A row-wise optimizer state read from a keyed state table: ``(capacity, width)`` float32, ``values`` at
    ``slots``, zeros elsewhere (the payload's marker gives the free slots their value)."""
    st = torch.zeros(capacity, width, dtype=torch.float32)
    if slots.size:
        st[torch.from_numpy(np.ascontiguousarray(slots, np.int64))] = torch.from_numpy(
            np.ascontiguousarray(values).reshape(slots.size, width))
    return st


# -- the payload's KEYED_MARK markers -------------------------------------------------------------------
def marked_tables(payload: dict) -> set:
    """The keyed state tables the payload's ``KEYED_MARK`` markers name."""
    out = set()
    for sd in payload.get("optimizers") or []:
        for st in sd.get("state", {}).values():
            for val in st.values():
                if isinstance(val, dict) and KEYED_MARK in val:
                    out.add(val[KEYED_MARK])
    return out


def marker_tensor(marker: dict, reads: dict):
    """The tensor a payload's ``KEYED_MARK`` marker stands for, or None if nothing in ``reads`` ({module table:
    ``KeyedTracker.read``-shaped rows}) holds its table: the rows read at their slots, the free slots holding
    the marker's value, shaped ``(the module's capacity,) + the marker's trailing shape``, in its dtype."""
    name = marker[KEYED_MARK]
    for n, r in reads.items():
        if name.startswith(f"{n}.optim.") and name[len(n) + 1:] in r:
            rows = r[name[len(n) + 1:]].clone()
            rows[r["slot_ids"] < 0] = float(marker["free"])
            shape = (r["slot_ids"].shape[0],) + tuple(marker["shape"][1:])
            return rows.reshape(shape).to(_payload.torch_dtype(marker["dtype"], None))
    return None


def with_keyed_state(sd: dict, reads: dict) -> dict:
    """The stored optimizer state dict ``sd`` with each ``KEYED_MARK`` marker replaced by its tensor
    (``marker_tensor``; a marker nothing read is dropped: ``restore(strict=False)``)."""
    state = {}
    for idx, st in sd["state"].items():
        out = {}
        for k, val in st.items():
            if isinstance(val, dict) and KEYED_MARK in val:
                val = marker_tensor(val, reads)
                if val is None:
                    continue
            out[k] = val
        state[idx] = out
    return {**sd, "state": state}
