"""Stateful property test: a real store driven side by side with an in-memory model (I1, I2 for reopen).

The model is what every committed version must read as: for each version, each table's float32 rows
(and which rows were ever written at or before it), and each dense array as put. A row put with codec
C reads as ``C'.decode(C'.encode(row))``, where C' is C or the first of its fallbacks that represents
every row the same put wrote into that row's block (writer.py ``_codec_groups``/``_codec_for``); codecs
are row-independent, so the model encodes each row alone.

Rules begin, fill, commit and abort checkpoints (also through the ``with`` block, an exception in it
aborting), create tables, read at random committed versions while a checkpoint is open or not, ask for
the changes between two of them (``Store.changes``), and close and reopen the store. Maintenance rules (I2) compact at a random retained version, retain the
newest 1-4 versions (the model drops the others, which must raise VersionNotFound from then on) and
collect garbage, while a checkpoint is open or not. After every step that changes what is committed
(commit, abort, reopen, a new table, maintenance that did something), the invariant reads EVERY
retained version back and compares it bit for bit with the model; MissingRows is expected exactly
where the model has a row never written at or before it.

In the style of zarr ``src/zarr/testing/stateful.py`` and leveldb's ModelDB test. A second machine
runs the same rules with tiny knobs (segments of 2 KiB, a small LMDB map, 7-row encode chunks, short
writev batches, small default blocks) so that segment rolls, map growth and chunking across blocks
happen within a few steps.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cnrstore
from cnrstore import codecs, knobs
from cnrstore.maintenance import compaction
from cnrstore.engine import fs
from cnrstore.store import Store

from support import crash_states as cs
from cnrstore.errors import (
    CheckpointInProgress,
    InvalidArgument,
    MissingRows,
    StoreClosed,
    TableNotFound,
    VersionNotFound,
    VersionNotRetained,
)

#: Codecs under test: those of the wish list that this cnrstore has.
CODECS = [n for n in ("fp32", "fp16", "int8", "int4", "int3", "int2", "adaptive4", "adaptive2",
                      "kmeans4", "kmeans2") if n in codecs.names()]
DIMS = [1, 2, 3, 4, 7, 8, 16]
BLOCK_ROWS = [None, 1, 2, 4, 16, 64]
MAX_TABLES = 5
DENSE_NAMES = ["d0", "d1", "opt/state", "loader"]
DENSE_DTYPES = ["<f4", "<f8", "<f2", "|i1", "<i4", "<i8", "|u1", "<u2", ">i4", ">f8", "|b1", "<c8"]
STEPS = int(os.environ.get("CNRSTORE_STATEFUL_STEPS", "30"))

# Values for special rows. 7e4 and 1e5 are past fp16's range (int4/int2/fp16 fall back); 1e38 is past
# int8's 2**126 (int8 falls back to fp32); 1e-30 underflows fp16; 0.1 and pi are not fp16 values, so
# int4/int2 constant rows of them decode only approximately.
CONSTANTS = [0.0, -0.0, 1.0, 0.1, 3.1415927, -2.5, 7e4, 1e5, -1e5, 1e38]
SPECIAL_KINDS = ["const", "large", "huge", "tiny", "negzero", "wide"]

meta_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=8),
    st.floats(allow_nan=False), st.binary(max_size=8), st.lists(st.integers(-5, 5), max_size=3),
)
metas = st.one_of(st.none(), st.dictionaries(st.text(max_size=6), meta_values, max_size=4))
steps = st.one_of(st.none(), st.integers(0, 2**62))


# ---------------------------------------------------------------------------------------------------
# model helpers


def codec_for_group(name: str, values: np.ndarray):
    """The codec that stores ``values`` (the rows one put writes into one block): ``name`` or the first
    of its fallbacks that represents all of them."""
    c = codecs.get(name)
    while c.fallback is not None and c.unrepresentable(values).any():
        c = codecs.get(c.fallback)
    return c


def expected_put(codec_name: str, rows: np.ndarray, values: np.ndarray, block_rows: int, dim: int):
    """What each of ``rows`` (unique, any order) reads as after one put of ``values`` with ``codec_name``,
    and the codec name each touched block is stored with."""
    out = np.empty_like(values)
    used = {}
    blocks = rows // block_rows
    for b in np.unique(blocks):
        sel = np.flatnonzero(blocks == b)
        c = codec_for_group(codec_name, values[sel])
        used[int(b)] = c.name
        for i in sel:  # one row at a time: a row's encoding does not depend on the others in the call
            out[i] = c.decode(c.encode(values[i][None]), dim)[0]
    return out, used


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert isinstance(actual, np.ndarray), what
    assert actual.dtype == np.float32, f"{what}: dtype {actual.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.array_equal(actual, expected), f"{what}: values differ"
    bad = np.flatnonzero((actual.view(np.uint32) != expected.view(np.uint32)).any(axis=-1)) \
        if actual.ndim == 2 else []
    assert len(bad) == 0 and np.array_equal(actual.view(np.uint32), expected.view(np.uint32)), \
        f"{what}: bits differ (first rows {list(bad[:5])})"


def assert_dense_equal(actual, expected: np.ndarray, what: str) -> None:
    assert isinstance(actual, np.ndarray), what
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.tobytes() == expected.tobytes(), f"{what}: bytes differ"


class TableModel:
    def __init__(self, name, num_rows, dim, codec, block_rows):
        self.name, self.num_rows, self.dim, self.codec, self.block_rows = name, num_rows, dim, codec, block_rows

    def empty_state(self):
        return np.zeros((self.num_rows, self.dim), dtype=np.float32), np.zeros(self.num_rows, dtype=bool)


class VersionModel:
    """What one committed version reads as."""

    def __init__(self, version, step, meta, parent, tables, dense, put_tables, maybe_tables, put_dense, began):
        self.version, self.step, self.meta, self.parent = version, step, meta, parent
        self.tables = tables  # name -> (values float32 (num_rows, dim), written bool (num_rows,))
        self.dense = dense  # name -> array
        self.put_tables = put_tables  # tables that got rows in this version
        self.maybe_tables = maybe_tables  # ... or at least a put_rows call (possibly of no rows)
        self.put_dense = put_dense
        self.began = began


class PendingModel:
    """The open checkpoint: the committed head plus this version's puts."""

    def __init__(self, ck, step, meta, parent, tables, dense, began):
        self.ck, self.step, self.meta, self.parent, self.began = ck, step, meta, parent, began
        self.tables = {n: (v.copy(), w.copy()) for n, (v, w) in tables.items()}
        self.dense = dict(dense)
        self.put_rows: dict[str, set] = {}  # table -> rows put in this version
        self.blocks: dict[str, dict[int, str]] = {}  # table -> block -> codec of its first put (for events)
        self.maybe_tables: set = set()
        self.put_dense: set = set()


# ---------------------------------------------------------------------------------------------------
# the machine


@dataclass
class LastOp:
    """The last commit or maintenance call: the files before it, its effects [start, end), the model
    before it, and the version it committed (None for maintenance)."""

    fmodel: "cs.FileModel"
    start: int
    end: int
    versions: list
    head_tables: dict
    head_dense: dict
    dead_versions: list
    committed: int | None


class StoreMachine(RuleBasedStateMachine):
    """A store and its model. ``versions`` holds what each committed version reads as, oldest first;
    ``head_tables``/``head_dense`` the newest committed state; ``pending`` the open checkpoint."""

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="cnr-stateful-")
        self.path = os.path.join(self.tmp, "store")
        self.store = None
        self._open(create=True)
        self.crashes = 0
        self.tables: dict[str, TableModel] = {}
        self.versions: list[VersionModel] = []
        self.head_tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.head_dense: dict[str, np.ndarray] = {}
        self.pending: PendingModel | None = None
        self.dead_versions: list[int] = []  # aborted version numbers: never visible, never reused
        self.max_version = 0
        self.dirty = True
        self.dense_ever: set = set()

    def teardown(self):
        try:
            self.store.close()
        finally:
            fs.pause_at("index_committed", None)
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- crash states (tests/support/crash_states.py) ---------------------------------------------------------

    def _open(self, create: bool = False) -> None:
        """Open the store at ``self.path`` through a file system that records every effect, with the file
        model of the store at rest, so that the crash rule can rebuild any state in the next operation."""
        self.rec = cs.RecordingFileSystem(self.path)
        self.fmodel = cs.FileModel.of_directory(self.path) if not create else None
        self.applied = 0
        self.last_op: LastOp | None = None
        self.store = Store(self.path, create=create, readonly=False, filesystem=self.rec)
        fs.pause_at("index_committed", self.rec.index_committed)
        if create:
            self.store.close()
            self.store = None
            self._open()

    def _recreate_unwritten_tables(self) -> None:
        """After a repair: only the index knew tables no committed version wrote (API.md, Repair)."""
        for name, t in self.tables.items():
            if name not in self.store.tables():
                self.store.create_table(name, t.num_rows, t.dim, codec=t.codec, block_rows=t.block_rows)

    def _op_begin(self) -> "LastOp":
        """Before a commit or a maintenance call: where its effects start, and the model before it."""
        for e in self.rec.effects[self.applied:]:
            self.fmodel.apply(e)
        self.applied = len(self.rec.effects)
        return LastOp(copy.deepcopy(self.fmodel), self.applied, 0, list(self.versions), self.head_tables,
                      dict(self.head_dense), list(self.dead_versions), None)

    def _op_end(self, op: "LastOp", committed: int | None = None) -> None:
        op.end = len(self.rec.effects)
        op.committed = committed
        self.last_op = op

    # -- helpers -------------------------------------------------------------------------------------

    def state_at(self, version: int | None) -> VersionModel:
        if version is None:
            return self.versions[-1]
        return next(v for v in self.versions if v.version == version)

    def table_state(self, vm: VersionModel, name: str):
        if name in vm.tables:
            return vm.tables[name]
        return self.tables[name].empty_state()  # created after vm: nothing written at or before it

    def draw_version(self, data):
        """A committed version number, or None (the newest)."""
        return data.draw(st.one_of(st.none(), st.sampled_from([v.version for v in self.versions])), label="version")

    def draw_rows_to_put(self, data, table: TableModel, available: np.ndarray,
                         modes=("all", "range", "subset", "one", "empty")) -> np.ndarray:
        mode = data.draw(st.sampled_from(modes), label="rows mode")
        if mode == "all":
            rows = available
        elif mode == "range":
            start = data.draw(st.integers(0, available.size - 1), label="range start")
            length = data.draw(st.integers(1, available.size - start), label="range length")
            rows = available[start : start + length]
        elif mode == "subset":
            idx = data.draw(st.lists(st.integers(0, available.size - 1), unique=True, min_size=1,
                                     max_size=min(24, available.size)), label="subset")
            rows = available[np.array(idx, dtype=np.int64)]
        elif mode == "one":
            rows = available[[data.draw(st.integers(0, available.size - 1), label="row")]]
        else:
            rows = available[:0]
        rows = np.array(rows, dtype=np.int64)
        if data.draw(st.booleans(), label="shuffle rows"):
            np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="shuffle seed")).shuffle(rows)
        return rows

    def draw_values(self, data, n: int, dim: int, kinds=None) -> np.ndarray:
        """float64 (n, dim) finite values, with some special rows (constants, out of fp16/int8 range...)."""
        seed = data.draw(st.integers(0, 2**32 - 1), label="values seed")
        scale = data.draw(st.sampled_from([1e-3, 1.0, 50.0, 3e4]), label="scale")
        if kinds is None:
            kinds = data.draw(st.lists(st.sampled_from(SPECIAL_KINDS), unique=True, max_size=3), label="special kinds")
        p = data.draw(st.sampled_from([0.05, 0.3, 1.0]), label="special fraction")
        rng = np.random.default_rng(seed)
        v = rng.standard_normal((n, dim)) * scale
        for kind in kinds:
            rows = np.flatnonzero(rng.random(n) < p)
            if not rows.size:
                continue
            if kind == "const":
                v[rows] = CONSTANTS[int(rng.integers(len(CONSTANTS)))]
            elif kind == "large":  # one value past fp16's range: int4/int2/fp16 blocks fall back
                v[rows, rng.integers(dim, size=rows.size)] = rng.choice([7e4, -1e5, 65520.0], size=rows.size)
            elif kind == "huge":  # past int8's range: falls back to fp32
                v[rows, rng.integers(dim, size=rows.size)] = rng.choice([1e38, -3e38], size=rows.size)
            elif kind == "tiny":
                v[rows] *= 1e-30
            elif kind == "negzero":
                v[rows, rng.integers(dim, size=rows.size)] = -0.0
            elif kind == "wide":  # the largest row range fp16 scale/bias still hold
                v[rows, 0], v[rows, -1] = -65504.0, 65504.0
        return v

    def draw_value_input(self, data, v64: np.ndarray):
        """(what to pass as values, the float32 the store must take it as)."""
        form = data.draw(st.sampled_from(["f32", "f64", "torch32", "torch16", "bf16", "f32-strided"]), label="form")
        v32 = v64.astype(np.float32)
        if form == "f64":
            return v64, v32
        if form == "torch32":
            return torch.from_numpy(v32.copy()), v32
        if form in ("torch16", "bf16"):
            t = torch.from_numpy(v32.copy()).to(torch.float16 if form == "torch16" else torch.bfloat16)
            as32 = t.float().numpy()
            if np.isfinite(as32).all():
                return t, as32
            return v32, v32
        if form == "f32-strided":  # a non-contiguous view
            wide = np.repeat(v32, 2, axis=1)
            return wide[:, ::2], v32
        return v32, v32

    def check_version_list(self):
        infos = self.store.versions()
        assert [i.version for i in infos] == [v.version for v in self.versions]
        for info, vm in zip(infos, self.versions):
            assert info.step == vm.step, (info.version, info.step, vm.step)
            assert info.meta == vm.meta, (info.version, info.meta, vm.meta)
            assert info.parent == vm.parent, (info.version, info.parent, vm.parent)
            assert vm.put_tables <= set(info.tables) <= vm.maybe_tables, (info.tables, vm.put_tables)
            assert list(info.tables) == sorted(info.tables)
            assert set(info.dense) == vm.put_dense, (info.dense, vm.put_dense)
            assert (info.bytes > 0) == bool(vm.put_tables or vm.put_dense), (info.version, info.bytes)
            assert vm.began - 1 <= info.created <= time.time() + 1
        latest = self.store.latest()
        if self.versions:
            assert latest is not None and latest.version == self.versions[-1].version
        else:
            assert latest is None

    def check_read_table(self, vm: VersionModel, name: str, version_arg) -> None:
        values, written = self.table_state(vm, name)
        if written.all():
            got = self.store.read_table(name, version=version_arg)
            assert_bits_equal(got, values, f"read_table({name!r}, {version_arg})")
        else:
            with pytest.raises(MissingRows):
                self.store.read_table(name, version=version_arg)

    def check_version(self, vm: VersionModel) -> None:
        """Every row and dense array of ``vm`` as the model has it (read_table, or read_rows of the
        written rows of a partly written table), and MissingRows for the rest."""
        for name, table in self.tables.items():
            values, written = self.table_state(vm, name)
            if written.all():
                self.check_read_table(vm, name, vm.version)
                continue
            with pytest.raises(MissingRows):
                self.store.read_table(name, version=vm.version)
            rows = np.flatnonzero(written)
            got = self.store.read_rows(name, rows, version=vm.version)
            assert_bits_equal(got, values[rows], f"read_rows({name!r}, written rows, {vm.version})")
            unwritten = np.flatnonzero(~written)
            with pytest.raises(MissingRows):
                self.store.read_rows(name, unwritten[:3], version=vm.version)
        for name in self.dense_ever:
            if name in vm.dense:
                assert_dense_equal(self.store.read_dense(name, version=vm.version), vm.dense[name],
                                   f"read_dense({name!r}, {vm.version})")
            else:
                with pytest.raises(MissingRows):
                    self.store.read_dense(name, version=vm.version)

    # -- invariants ----------------------------------------------------------------------------------

    @invariant()
    def versions_are_the_committed_ones(self):
        """versions()/latest() list exactly the committed versions, never the open or an aborted one."""
        self.check_version_list()

    @invariant()
    def every_committed_version_reads_as_the_model(self):
        """After anything that changes what is committed (a commit, an abort, a reopen, a new table):
        every committed version, read in full, bit for bit."""
        if not self.dirty:
            return
        self.dirty = False
        for vm in self.versions:
            self.check_version(vm)
        for v in self.dead_versions:
            with pytest.raises(VersionNotFound):
                self.store.read_rows(next(iter(self.tables)), [0], version=v) if self.tables \
                    else self.store.restore(v)

    # -- tables --------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.tables) < MAX_TABLES)
    @rule(num_rows=st.integers(1, 300), dim=st.sampled_from(DIMS), codec=st.sampled_from(CODECS),
          block_rows=st.sampled_from(BLOCK_ROWS))
    def create_table(self, num_rows, dim, codec, block_rows):
        name = f"t{len(self.tables)}"
        info = self.store.create_table(name, num_rows, dim, codec=codec, block_rows=block_rows)
        assert (info.name, info.num_rows, info.dim, info.codec) == (name, num_rows, dim, codec)
        if block_rows is None:
            assert info.block_rows & (info.block_rows - 1) == 0
            assert knobs.MIN_BLOCK_ROWS <= info.block_rows <= knobs.MAX_BLOCK_ROWS
        else:
            assert info.block_rows == block_rows
        self.tables[name] = TableModel(name, num_rows, dim, codec, info.block_rows)
        assert self.store.tables()[name] == info
        self.dirty = True

    # -- writing -------------------------------------------------------------------------------------

    @precondition(lambda self: self.pending is None)
    @rule(step=steps, meta=metas)
    def begin(self, step, meta):
        began = time.time()
        ck = self.store.checkpoint(step=step, meta=meta)
        assert ck.version > self.max_version, "version numbers must strictly increase, never be reused"
        self.max_version = ck.version
        parent = self.versions[-1].version if self.versions else None
        self.pending = PendingModel(ck, step, meta, parent, self.head_tables, self.head_dense, began)
        note(f"begin version {ck.version}")

    def available_rows(self, pend: PendingModel, name: str) -> np.ndarray:
        """Rows of ``name`` not yet put in the open version."""
        return np.array(sorted(set(range(self.tables[name].num_rows)) - pend.put_rows.get(name, set())),
                        dtype=np.int64)

    def _put_rows(self, data, pend: PendingModel, ck, name: str | None = None, rows=None, kinds=None) -> None:
        if name is None:
            name = data.draw(st.sampled_from(sorted(self.tables)), label="table")
        table = self.tables[name]
        done = pend.put_rows.setdefault(name, set())
        if rows is None:
            available = self.available_rows(pend, name)
            if not available.size:
                return
            rows = self.draw_rows_to_put(data, table, available)
        v64 = self.draw_values(data, rows.size, table.dim, kinds)
        values, v32 = self.draw_value_input(data, v64)
        codec = data.draw(st.one_of(st.none(), st.sampled_from(CODECS)), label="codec override")
        rows_arg = data.draw(st.sampled_from(["np", "list", "i32", "torch"]), label="rows form")
        rows_in = {"np": rows, "list": rows.tolist(), "i32": rows.astype(np.int32),
                   "torch": torch.from_numpy(rows.copy())}[rows_arg]
        note(f"put_rows {name} ({table.codec}, block_rows {table.block_rows}) {rows.size} rows, codec={codec}")
        ck.put_rows(name, rows_in, values, codec=codec)
        pend.maybe_tables.add(name)
        if rows.size:
            tv, tw = pend.tables.setdefault(name, table.empty_state())
            tv[rows], used = expected_put(codec or table.codec, rows, v32, table.block_rows, table.dim)
            tw[rows] = True
            seen = pend.blocks.setdefault(name, {})
            for block, cname in used.items():
                if cname != (codec or table.codec):
                    event(f"put_rows: block falls back {codec or table.codec} -> {cname}")
                if block in seen:
                    event("put_rows: merge into a block of this version, " +
                          ("same codec" if seen[block] == cname else "different codecs"))
                    if cname != (codec or table.codec):
                        event("put_rows: merge into a block of this version, the new part falls back")
                seen.setdefault(block, cname)
            done.update(rows.tolist())

    def _put_dense(self, data, pend: PendingModel, ck) -> None:
        free = [n for n in DENSE_NAMES if n not in pend.put_dense]
        if not free:
            return
        name = data.draw(st.sampled_from(free), label="dense name")
        dtype = np.dtype(data.draw(st.sampled_from(DENSE_DTYPES), label="dtype"))
        shape = tuple(data.draw(st.lists(st.integers(0, 5), max_size=3), label="shape"))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="dense seed"))
        n = int(np.prod(shape, dtype=np.int64))
        if dtype.kind == "b":
            arr = (rng.random(n) < 0.5).reshape(shape)
        else:  # random bytes: every NaN payload and -0.0 must come back as put
            arr = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)
        form = data.draw(st.sampled_from(["np", "torch", "strided"]), label="dense form")
        passed = arr
        if form == "torch" and dtype.str in ("<f4", "<i8", "<f2", "|b1", "<i4", "|u1"):
            passed = torch.from_numpy(arr.copy())
        elif form == "strided" and arr.ndim >= 1:
            passed = np.repeat(arr, 2, axis=-1)[..., ::2]
        note(f"put_dense {name} {arr.dtype} {arr.shape} as {type(passed).__name__}")
        ck.put_dense(name, passed)
        pend.dense[name] = arr.copy()
        pend.put_dense.add(name)
        self.dense_ever.add(name)

    @precondition(lambda self: self.pending is not None and self.tables)
    @rule(data=st.data())
    def put_rows(self, data):
        self._put_rows(data, self.pending, self.pending.ck)

    @precondition(lambda self: self.pending is not None and self.tables)
    @rule(data=st.data(), parts=st.integers(2, 3))
    def put_rows_in_parts(self, data, parts):
        """Several puts to one table in one version, their rows interleaved so that they share blocks:
        the writer merges each shared block into one record (same codec: bytes concatenated; different
        codecs, an override or a fallback: fp32 of each part's decoded values)."""
        name = data.draw(st.sampled_from(sorted(self.tables)), label="table")
        available = self.available_rows(self.pending, name)
        if available.size < 2:
            return
        rows = self.draw_rows_to_put(data, self.tables[name], available, modes=("all", "range", "subset"))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="split seed"))
        part_of = rng.integers(parts, size=rows.size)
        for p in range(parts):
            # often one part holds rows its codec cannot represent: the merge then mixes codecs
            kinds = data.draw(st.sampled_from([None, ["large"], ["huge"]]), label="part kinds")
            self._put_rows(data, self.pending, self.pending.ck, name, rows[part_of == p], kinds)

    @precondition(lambda self: self.pending is not None)
    @rule(data=st.data())
    def put_dense(self, data):
        self._put_dense(data, self.pending, self.pending.ck)

    @precondition(lambda self: self.pending is not None and self.tables)
    @rule(data=st.data())
    def put_rows_invalid(self, data):
        """A bad put raises and leaves the open version as it was (checked when it commits)."""
        pend = self.pending
        name = data.draw(st.sampled_from(sorted(self.tables)), label="table")
        table = self.tables[name]
        done = sorted(pend.put_rows.get(name, ()))
        kinds = ["out of range", "negative", "nan", "inf", "shape", "codec", "dup in call", "unknown table",
                 "float rows"]
        if done:
            kinds.append("dup in version")
        kind = data.draw(st.sampled_from(kinds), label="invalid kind")
        free = sorted(set(range(table.num_rows)) - set(done))
        rows = np.array(free[:2], dtype=np.int64)
        values = np.ones((rows.size, table.dim), dtype=np.float32)
        codec = None
        error = InvalidArgument
        if kind == "out of range":
            rows = np.r_[rows, table.num_rows]
        elif kind == "negative":
            rows = np.r_[-1, rows]
        elif kind == "nan" and rows.size:
            values[-1, -1] = np.nan
        elif kind == "inf" and rows.size:
            values[0, 0] = -np.inf
        elif kind == "shape":
            values = np.ones((rows.size, table.dim + 1), dtype=np.float32)
        elif kind == "codec":
            codec = "int9"
        elif kind == "dup in call" and rows.size:
            rows = np.r_[rows, rows[:1]]
        elif kind == "dup in version":
            rows = np.r_[rows, done[data.draw(st.integers(0, len(done) - 1), label="dup row")]]
        elif kind == "unknown table":
            name, error = "no-such-table", TableNotFound
        elif kind == "float rows":
            rows = np.r_[rows, 0.0]  # float dtype, even when every value is integral
        else:  # the kind needs a free row and there is none: fall back to an out-of-range row
            rows = np.r_[rows, table.num_rows]
        if values.shape[0] != rows.size and kind != "shape":
            values = np.ones((rows.size, table.dim), dtype=np.float32)
        note(f"invalid put ({kind}) {name} rows {rows.tolist()}")
        with pytest.raises(error):
            pend.ck.put_rows(name, rows, values, codec=codec)

    def _committed(self, pend: PendingModel, version: int) -> None:
        vm = VersionModel(version, pend.step, pend.meta, pend.parent, pend.tables, pend.dense,
                          {t for t, rows in pend.put_rows.items() if rows}, pend.maybe_tables, pend.put_dense,
                          pend.began)
        self.versions.append(vm)
        self.head_tables = {n: (v.copy(), w.copy()) for n, (v, w) in pend.tables.items()}
        self.head_dense = dict(pend.dense)
        self.dirty = True

    @precondition(lambda self: self.pending is not None)
    @rule(how=st.sampled_from(["commit", "exit", "commit", "exit", "abort", "exit with exception"]))
    def finish(self, how):
        """Commit (``commit()`` or leaving the ``with`` block) or abort (``abort()`` or an exception
        leaving the block) the open version; commits twice as likely as aborts."""
        pend, self.pending = self.pending, None
        op = self._op_begin()
        if how == "commit":
            assert pend.ck.commit() == pend.ck.version
            assert pend.ck.commit() == pend.ck.version  # idempotent
        elif how == "exit":
            assert pend.ck.__exit__(None, None, None) is False
        elif how == "abort":
            pend.ck.abort()
            pend.ck.abort()  # idempotent
        else:
            exc = RuntimeError("trainer failed")
            assert pend.ck.__exit__(RuntimeError, exc, None) is False  # the exception propagates
        if how in ("commit", "exit"):
            note(f"committed version {pend.ck.version}")
            self._committed(pend, pend.ck.version)
            self._op_end(op, pend.ck.version)
            return
        with pytest.raises(StoreClosed):
            pend.ck.put_rows(next(iter(self.tables)) if self.tables else "x", [0], np.zeros((1, 1)))
        note(f"aborted version {pend.ck.version}")
        self.dead_versions.append(pend.ck.version)
        self.dirty = True

    @precondition(lambda self: self.pending is None)
    @rule(data=st.data(), step=steps, meta=metas, fail=st.sampled_from([False, False, False, True]))
    def checkpoint_in_with_block(self, data, step, meta, fail):
        """A whole version in one ``with`` block; an exception raised inside it aborts the version."""
        began = time.time()
        parent = self.versions[-1].version if self.versions else None
        n_puts = data.draw(st.integers(0, 3), label="puts")

        class TrainerFailed(Exception):
            pass

        pend = None
        try:
            with self.store.checkpoint(step=step, meta=meta) as ck:
                assert ck.version > self.max_version
                self.max_version = ck.version
                pend = PendingModel(ck, step, meta, parent, self.head_tables, self.head_dense, began)
                for _ in range(n_puts):
                    if self.tables and data.draw(st.booleans(), label="rows or dense"):
                        self._put_rows(data, pend, ck)
                    else:
                        self._put_dense(data, pend, ck)
                if fail:
                    raise TrainerFailed()
        except TrainerFailed:
            assert fail
            note(f"with block raised: version {pend.ck.version} aborted")
            self.dead_versions.append(pend.ck.version)
            self.dirty = True
            return
        assert not fail, "the exception raised inside the with block must propagate"
        note(f"with block committed version {pend.ck.version}")
        self._committed(pend, pend.ck.version)

    # -- reading -------------------------------------------------------------------------------------

    @precondition(lambda self: self.versions and self.tables)
    @rule(data=st.data())
    def read_rows(self, data):
        version = self.draw_version(data)
        vm = self.state_at(version)
        name = data.draw(st.sampled_from(sorted(self.tables)), label="table")
        table = self.tables[name]
        values, written = self.table_state(vm, name)
        if written.any() and data.draw(st.booleans(), label="written rows only"):
            pool = np.flatnonzero(written)
            idx = data.draw(st.lists(st.integers(0, pool.size - 1), max_size=24), label="rows idx")
            rows = pool[np.array(idx, dtype=np.int64)]
        else:
            rows = np.array(data.draw(st.lists(st.integers(0, table.num_rows - 1), max_size=24), label="rows"),
                            dtype=np.int64)
        rows_in = rows.tolist() if data.draw(st.booleans(), label="as list") else rows
        if written[rows].all():
            got = self.store.read_rows(name, rows_in, version=version)
            assert_bits_equal(got, values[rows].reshape(rows.size, table.dim), f"read_rows({name!r}, {version})")
        else:
            with pytest.raises(MissingRows):
                self.store.read_rows(name, rows_in, version=version)

    @precondition(lambda self: self.versions and self.tables)
    @rule(data=st.data())
    def read_table(self, data):
        version = self.draw_version(data)
        name = data.draw(st.sampled_from(sorted(self.tables)), label="table")
        self.check_read_table(self.state_at(version), name, version)

    @precondition(lambda self: self.versions and self.dense_ever)
    @rule(data=st.data())
    def read_dense(self, data):
        version = self.draw_version(data)
        vm = self.state_at(version)
        name = data.draw(st.sampled_from(sorted(self.dense_ever)), label="dense name")
        if name in vm.dense:
            assert_dense_equal(self.store.read_dense(name, version=version), vm.dense[name],
                               f"read_dense({name!r}, {version})")
        else:
            with pytest.raises(MissingRows):
                self.store.read_dense(name, version=version)

    @precondition(lambda self: self.versions)
    @rule(data=st.data())
    def restore(self, data):
        version = self.draw_version(data)
        vm = self.state_at(version)
        states = {name: self.table_state(vm, name) for name in self.tables}
        if any(w.any() and not w.all() for _v, w in states.values()):
            with pytest.raises(MissingRows):
                self.store.restore(version)
            return
        snap = self.store.restore(version)
        assert (snap.version, snap.step, snap.meta) == (vm.version, vm.step, vm.meta)
        assert set(snap.tables) == {name for name, (_v, w) in states.items() if w.all()}
        for name, arr in snap.tables.items():
            assert_bits_equal(arr, states[name][0], f"restore({version}).tables[{name!r}]")
        assert set(snap.dense) == set(vm.dense)
        for name, arr in snap.dense.items():
            assert_dense_equal(arr, vm.dense[name], f"restore({version}).dense[{name!r}]")

    @precondition(lambda self: self.versions)
    @rule(data=st.data())
    def changes(self, data):
        """Store.changes between two retained versions (or from none): every row it reports reads as the model
        at until, bit for bit (encoded rows decoded too); every row whose value, or being written, differs
        from since is reported; dense_changes holds every array that differs. A dropped or aborted since is
        VersionNotRetained."""
        versions = [vm.version for vm in self.versions]
        until = data.draw(st.sampled_from(versions), label="until")
        since = data.draw(st.one_of(st.none(), st.sampled_from([v for v in versions if v <= until])), label="since")
        encoded = data.draw(st.booleans(), label="encoded")
        um, sm = self.state_at(until), (self.state_at(since) if since else None)
        seen = set()
        for tc in self.store.changes(since, until, encoded=encoded):
            seen.add(tc.table)
            values, written = self.table_state(um, tc.table)
            assert tc.encoded == encoded and np.all(np.diff(tc.rows) > 0) and written[tc.rows].all()
            assert_bits_equal(tc.decoded(), values[tc.rows], f"changes({since}, {until})[{tc.table!r}]")
            differs = written.copy()
            if sm is not None:
                old, old_written = self.table_state(sm, tc.table)
                differs &= ~old_written | (old.view(np.uint32) != values.view(np.uint32)).any(axis=1)
            reported = np.zeros_like(written)
            reported[tc.rows] = True
            missed = np.flatnonzero(differs & ~reported)
            assert not missed.size, f"changes({since}, {until})[{tc.table!r}] misses rows {missed[:8]}"
        assert seen == set(self.store.tables())
        dense = self.store.dense_changes(since, until)
        for name, arr in um.dense.items():
            if sm is None or name not in sm.dense or sm.dense[name].tobytes() != arr.tobytes() \
                    or sm.dense[name].dtype != arr.dtype or sm.dense[name].shape != arr.shape:
                assert name in dense, f"dense_changes({since}, {until}) misses {name!r}"
        for name, arr in dense.items():
            assert_dense_equal(arr, um.dense[name], f"dense_changes({since}, {until})[{name!r}]")
        gone = [v for v in self.dead_versions if v < versions[-1]]
        if gone:
            with pytest.raises(VersionNotRetained):
                self.store.changes(data.draw(st.sampled_from(gone), label="gone since"))
        event("changes: rows reported" if since else "changes: a full sync")

    @rule(data=st.data())
    def misuse(self, data):
        """Calls that must be refused and change nothing (checked by the invariant and later rules)."""
        kinds = ["future version"]
        if self.dead_versions:
            kinds.append("dead version")
        if self.versions:
            kinds.append("unknown table")  # (with no version at all, VersionNotFound may come first)
        if self.tables:
            kinds.append("duplicate table")
        if self.pending is not None:
            kinds.append("begin while open")
            if self.pending.put_dense:
                kinds.append("dense twice")
        kind = data.draw(st.sampled_from(kinds), label="misuse")
        if kind == "unknown table":
            with pytest.raises(TableNotFound):
                self.store.read_rows("no-such-table", [0])
            with pytest.raises(TableNotFound):
                self.store.read_table("no-such-table", version=self.versions[0].version)
        elif kind == "duplicate table":
            name = data.draw(st.sampled_from(sorted(self.tables)), label="table")
            with pytest.raises(InvalidArgument):
                self.store.create_table(name, 10, 4)
            assert len(self.store.tables()) == len(self.tables)
        elif kind == "begin while open":
            with pytest.raises(CheckpointInProgress):
                self.store.checkpoint()
        elif kind == "dense twice":
            name = data.draw(st.sampled_from(sorted(self.pending.put_dense)), label="dense name")
            with pytest.raises(InvalidArgument):
                self.pending.ck.put_dense(name, np.zeros(3))
        else:
            if kind == "dead version":
                version = data.draw(st.sampled_from(self.dead_versions), label="dead version")
            else:
                version = self.max_version + data.draw(st.integers(1, 3), label="ahead")
            with pytest.raises(VersionNotFound):
                self.store.restore(version)
            if self.tables:
                with pytest.raises(VersionNotFound):
                    self.store.read_table(next(iter(self.tables)), version=version)

    # -- maintenance: compact, retain, gc (tests/test_compaction.py has the targeted tests) ----------

    @precondition(lambda self: self.versions)
    @rule(data=st.data())
    def compact(self, data):
        """Materialize baselines at a retained version (possibly while a checkpoint is open): every
        block's read chain there is one record long, and every retained version reads as before."""
        version = self.draw_version(data)
        op = self._op_begin()
        report = self.store.compact(version)
        self._op_end(op)
        v = self.versions[-1].version if version is None else version
        assert report.version == v
        note(f"compact({version}): {report.blocks_materialized} blocks")
        if report.blocks_materialized:
            event("compact: materialized baselines")
        with self.store.engine.read() as view:
            assert all(len(chain) == 1 for chain in compaction.block_chains(view, v).values())
        self.dirty = self.dirty or report.blocks_materialized > 0  # (the invariant reads every version)

    @precondition(lambda self: self.versions)
    @rule(keep_last=st.integers(1, 4))
    def retain(self, keep_last):
        """Drop all but the newest ``keep_last`` versions: they raise VersionNotFound from now on (the
        invariant checks them with the aborted ones); the others read as before."""
        op = self._op_begin()
        dropped = self.store.retain(keep_last=keep_last)
        assert dropped == [vm.version for vm in self.versions[:-keep_last]]
        assert self.store.retain(keep_last=keep_last) == []
        note(f"retain({keep_last}) dropped {dropped}")
        if dropped:
            event("retain: dropped versions")
        self.versions = self.versions[-keep_last:]
        self.dead_versions.extend(dropped)
        self._op_end(op)
        assert self.store.stats()["versions"] == len(self.versions)
        self.dirty = self.dirty or bool(dropped)

    @rule()
    def gc(self):
        """Collect garbage (possibly while a checkpoint is open): nothing retained changes, and the
        store still verifies."""
        op = self._op_begin()
        report = self.store.gc()
        self._op_end(op)
        note(f"gc: {report}")
        if report.segments_deleted:
            event("gc: deleted segments")
        if report.segments_rewritten:
            event("gc: rewrote segments")
        assert report.bytes_pending == 0, "no reader holds a transaction"
        if report.segments_deleted or report.segments_rewritten:
            verified = self.store.verify()
            assert verified.ok, verified.problems[:3]
            self.dirty = True

    @precondition(lambda self: self.pending is None and self.tables)
    @rule(data=st.data(), commits=st.integers(2, 4))
    def checkpoints_then_maintenance(self, data, commits):
        """A few versions (so that read chains grow), then compact, retain and gc on them: alone, the
        maintenance rules above mostly find too short a history to change anything."""
        for _ in range(commits):
            self.begin(None, None)
            self._put_rows(data, self.pending, self.pending.ck)
            self.finish("commit")
        self.compact(data)
        self.retain(data.draw(st.integers(1, 2), label="keep_last"))
        self.gc()

    # -- reopen --------------------------------------------------------------------------------------

    @rule()
    def reopen(self):
        """Close and open again: every committed version reads as before (I2); an open checkpoint is
        aborted by close."""
        old = self.store
        old.close()
        old.close()  # idempotent
        with pytest.raises(StoreClosed):
            old.versions()
        if self.pending is not None:
            pend, self.pending = self.pending, None
            with pytest.raises(StoreClosed):
                pend.ck.put_dense("after-close", np.zeros(1))
            self.dead_versions.append(pend.ck.version)
            note(f"reopen aborted version {pend.ck.version}")
        self._open()
        self.dirty = True

    @precondition(lambda self: self.pending is None and self.last_op is not None
                  and self.last_op.end == len(self.rec.effects))
    @rule(data=st.data(), variant=st.sampled_from(["kill", "power", "torn"]))
    def crash_in_last_operation(self, data, variant):
        """The process dies (kill), or the machine loses power (power; torn: in the middle of an
        unsynced append), at a point drawn within the last commit, compact, retain or gc: the store
        recovers at open with the versions before that operation or after it, each reading as the model
        says, and goes on (tests/support/crash_states.py rebuilds the state from the recorded effects)."""
        op = self.last_op
        k = data.draw(st.integers(op.start, op.end), label="effects applied")
        model = op.fmodel
        for e in self.rec.effects[op.start:k]:
            model.apply(e)
        files = model.state(variant) or model.state("kill")
        self.store.close()
        self.crashes += 1
        self.path = os.path.join(self.tmp, f"crashed-{self.crashes}")
        cs.write_state(files, self.path)
        self._open()
        listed = [v.version for v in self.store.versions()]
        after = [vm.version for vm in self.versions]
        note(f"crash ({variant}) after {k - op.start} of {op.end - op.start} effects: lists {listed}")
        if listed != after:
            assert listed == [vm.version for vm in op.versions], (listed, after)
            self.versions, self.head_tables, self.head_dense = op.versions, op.head_tables, op.head_dense
            self.dead_versions = op.dead_versions + ([op.committed] if op.committed else [])
            event("crash: the operation in flight is undone")
        else:
            event("crash: the operation in flight survived")
        self.dirty = True

    @precondition(lambda self: self.pending is None)
    @rule()
    def repair_with_the_index_intact(self):
        """Repair of a healthy store keeps what its index proves: every version, bit for bit (the
        invariant reads them all), and a second repair finds the same."""
        self.store.close()
        first = cnrstore.repair(self.path)
        second = cnrstore.repair(self.path)
        for report in (first, second):
            assert report.ok, report.versions_lost
            assert report.versions_recovered == [vm.version for vm in self.versions]
        event("repair with the index intact")
        self._open()
        self._recreate_unwritten_tables()
        self.dirty = True

    @precondition(lambda self: self.pending is None)
    @rule()
    def lose_index_and_repair(self):
        """index/data.mdb is lost: the open refuses (deleting nothing); repair brings back every committed
        version bit for bit (the invariant reads them all), and the store goes on."""
        self.store.close()
        os.remove(os.path.join(self.path, "index", "data.mdb"))
        with pytest.raises(cnrstore.CorruptionError, match="cnrstore repair"):
            cnrstore.open(self.path)
        report = cnrstore.repair(self.path)
        assert report.ok, report.versions_lost
        assert report.versions_recovered == [vm.version for vm in self.versions]
        event("repair")
        self._open()
        self._recreate_unwritten_tables()
        # an aborted checkpoint newer than every record left no trace: its number may come again
        with self.store.engine.read() as view:
            next_version = view.meta("next_version")
        self.dead_versions = [v for v in self.dead_versions if v < next_version]
        self.max_version = next_version - 1
        self.dirty = True


class TinyKnobsStoreMachine(StoreMachine):
    """The same rules with knobs small enough that segments roll, the LMDB map grows, writes are
    split into 7-row encode chunks and short writev batches, and default blocks are small."""

    TINY = {
        "SEGMENT_BYTES": 2048,
        "INDEX_MAP_BYTES": 16 << 10,  # about the least LMDB opens with; it must grow
        "ENCODE_CHUNK_ROWS": 7,
        "WRITEV_BUFFERS": 3,
        "BLOCK_TARGET_BYTES": 96,
        "MIN_BLOCK_ROWS": 2,
    }

    def __init__(self):
        self._saved_knobs = {k: getattr(knobs, k) for k in self.TINY}
        try:
            for k, v in self.TINY.items():
                setattr(knobs, k, v)
            super().__init__()
        except BaseException:
            self._restore_knobs()
            raise

    def _restore_knobs(self):
        for k, v in self._saved_knobs.items():
            setattr(knobs, k, v)

    def teardown(self):
        try:
            super().teardown()
        finally:
            self._restore_knobs()


StoreMachine.TestCase.settings = settings(stateful_step_count=STEPS)
TinyKnobsStoreMachine.TestCase.settings = settings(stateful_step_count=STEPS)

TestStoreMachine = StoreMachine.TestCase
TestTinyKnobsStoreMachine = TinyKnobsStoreMachine.TestCase

# torch on one thread in this process (conftest.py): the machines make thousands of small codec calls, which
# OpenMP's barriers made up to ~500x slower each on a loaded 2-core machine (the 2-bit unpack was a third of
# the run); every result is the same on one thread
pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def test_tiny_knobs_are_restored():
    """The tiny-knobs machine puts every knob back, even when a run fails."""
    before = {k: getattr(knobs, k) for k in TinyKnobsStoreMachine.TINY}
    m = TinyKnobsStoreMachine()
    try:
        assert knobs.SEGMENT_BYTES == 2048
    finally:
        m.teardown()
    assert {k: getattr(knobs, k) for k in TinyKnobsStoreMachine.TINY} == before
