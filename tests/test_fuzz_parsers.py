"""Every parser of store bytes over mutated bytes (issue 26, docs/DESIGN.md "Security"): no untyped exception
and no allocation beyond a bound proportional to the input.

Mutations are applied *behind* the checksums (each is recomputed), as an attacker who hands over a store
would: XXH3 is an integrity check, not a signature. The bound is measured with tracemalloc (Python's
allocator, which msgpack's and numpy's objects use): at most ``_PER_BYTE`` bytes per input byte plus a
constant."""

from __future__ import annotations

import os
import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cnrstore.engine import index as index_mod
from cnrstore.engine import marker, record
from cnrstore.errors import CnrError, CorruptionError, InvalidArgument, UnsafePayload
from cnrstore.engine.msgpack_safe import unpack_bounded

_PER_BYTE = 128
_CONST = 1 << 20
FUZZ = settings(max_examples=int(os.environ.get("CNRSTORE_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _mutations():
    """A list of (position fraction, kind, value) edits: flip, set, insert, delete, truncate, or a
    msgpack length header made huge."""
    edit = st.tuples(st.floats(0, 1, allow_nan=False), st.sampled_from(["flip", "set", "insert", "delete", "cut",
                                                                         "huge"]),
                     st.integers(0, 255))
    return st.lists(edit, min_size=1, max_size=6)


def _mutate(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for frac, kind, val in edits:
        if not b and kind not in ("insert",):
            continue
        i = min(int(frac * len(b)), max(len(b) - 1, 0))
        if kind == "flip":
            b[i] ^= 1 << (val % 8)
        elif kind == "set":
            b[i] = val
        elif kind == "insert":
            b[i:i] = bytes([val])
        elif kind == "delete":
            del b[i]
        elif kind == "cut":
            del b[i:]
        else:  # a map32 / array32 / bin32 / str32 header claiming 2^32-1 entries or bytes
            b[i:i] = bytes([(0xDF, 0xDD, 0xC6, 0xDB)[val % 4]]) + b"\xff\xff\xff\xff"
    return bytes(b)


def _bounded(fn, size: int, allowed=(CorruptionError,)):
    """Run ``fn``; it may raise only ``allowed``; its peak allocation must stay within the bound."""
    tracemalloc.start()
    try:
        try:
            fn()
        except allowed:
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= _PER_BYTE * size + _CONST, (peak, size)


def _commit_body() -> dict:
    return {"version": 7, "parent": 6, "step": 70, "meta": {"a": [1, 2.5, "x"]}, "created": 1.5, "bytes": 100,
            "tables": ["emb"], "dense": ["d"],
            "catalog": [{"id": 1, "name": "emb", "num_rows": 100, "dim": 4, "codec": "int4", "block_rows": 64,
                         "created": 1.0}],
            "dense_ids": {"d": 1},
            "blocks": {1: [np.arange(2, dtype="<u8").tobytes(), np.array([64, 36], "<u4").tobytes(),
                           np.array([3, 3], "<u1").tobytes()]}}


def _anchor_body() -> dict:
    return {"version": 7, "dropped_below": 2, "catalog": _commit_body()["catalog"], "dense_names": {"d": 1},
            "heads": {1: [np.arange(2, dtype="<u8").tobytes(), np.array([7, 5], "<u8").tobytes(),
                          np.array([64, 36], "<u4").tobytes(), np.array([3, 1], "<u1").tobytes()]},
            "dense": {1: 7}}


_BODIES = [(record.KIND_COMMIT, _commit_body()), (record.KIND_ANCHOR, _anchor_body()),
           (record.KIND_DROP, {"seq": 3, "latest": 9, "kept": [8, 9]})]


@FUZZ
@given(st.sampled_from(range(len(_BODIES))), _mutations())
def test_msgpack_values_and_log_bodies_decode_typed_and_bounded(which, edits):
    kind, body = _BODIES[which]
    data = _mutate(msgpack.packb(body, use_bin_type=True), edits)
    _bounded(lambda: unpack_bounded(data), len(data))
    _bounded(lambda: record.check_log_body(kind, unpack_bounded(data)), len(data))


def _reseal_record(buf: bytes) -> bytes:
    """``buf`` with its trailing checksum recomputed (a mutation behind the checksum)."""
    if len(buf) < 8:
        return buf
    return buf[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(buf[:-8]))


def _records():
    dense = b"".join(bytes(b) for b in record.dense_record(3, 5, np.arange(12, dtype="<f4").reshape(3, 4))[0])
    logs = [b"".join(bytes(b) for b in record.log_record(k, 7, body)[0]) for k, body in _BODIES]
    rows = b"".join(bytes(b) for b in record.rows_record(1, 0, 1, 0, 5, np.array([1, 3], "<u2"),
                                                          np.zeros((2, 8), np.uint8))[0])
    return [dense, rows, *logs]


_RECORDS = _records()


@FUZZ
@given(st.sampled_from(range(len(_RECORDS))), _mutations())
def test_records_parse_typed_and_bounded_behind_their_checksum(which, edits):
    data = _reseal_record(_mutate(_RECORDS[which], edits))

    def parse():
        rec = record.parse(np.frombuffer(data, dtype=np.uint8), "seg", 0)
        if rec.kind == record.KIND_DENSE:
            desc = rec.dense_descriptor()
            rec.body.view(np.dtype(desc["dtype"])).reshape(desc["shape"])
        elif rec.kind == record.KIND_ROWS:
            rec.offsets(), rec.base()
        else:
            record.log_body(rec)

    _bounded(parse, len(data))


@FUZZ
@given(_mutations())
def test_the_store_marker_parses_typed_and_bounded(tmp_path_factory, edits):
    root = tmp_path_factory.mktemp("m")
    data = _mutate(marker.marker_bytes(), edits)
    (root / "CNRSTORE").write_bytes(data)
    _bounded(lambda: marker.read_marker(str(root)), len(data))


@FUZZ
@given(st.binary(max_size=40), st.sampled_from(["ROW_KEY", "DENSE_KEY", "VERSION_KEY", "LOG_KEY", "ROW_LOC",
                                                "ROW_LOC_DELTA", "DENSE_LOC"]))
def test_index_keys_and_values_of_any_length_are_typed(raw, name):
    try:
        getattr(index_mod, name).unpack(raw)
    except CorruptionError:
        pass
    try:
        index_mod._row_loc(raw)
    except CorruptionError:
        pass


def _manifest_body() -> dict:
    return {"format": 1, "version": 2, "step": 5, "meta": None, "created": 1.0, "generation": 1,
            "plan": {"world_size": 2, "tables": {"emb": [10, 4]}, "shards": [["emb", 0, 0, 5], ["emb", 1, 5, 10]]},
            "local_versions": [3, 4], "stores": ["gen-000001/rank-00000", "gen-000001/rank-00001"],
            "priority": False}


@FUZZ
@given(_mutations())
def test_distributed_manifests_parse_typed_and_bounded_behind_their_checksum(tmp_path_factory, edits):
    pytest.importorskip("torch")
    from cnrstore.distributed.manifest import GLOBAL_DIR, MARKER, Root, seal as _seal

    root = tmp_path_factory.mktemp("root")
    (root / GLOBAL_DIR).mkdir()
    (root / MARKER).write_bytes(_seal(MARKER, {"format": 1, "created": 1.0}))
    sealed = _seal("manifest", _manifest_body())
    body = _mutate(sealed[:-8], edits)
    data = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    (root / GLOBAL_DIR / "g-000000000002.cnrg").write_bytes(data)
    from cnrstore.errors import FormatVersionError

    _bounded(lambda: Root(str(root)).read(2), len(data), (CorruptionError, FormatVersionError))
    _bounded(lambda: Root(str(root)).versions(), len(data), (CorruptionError, FormatVersionError))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations())
def test_trainer_payloads_decode_typed(edits):
    """The payload's zip and pickle (torch's reader and weights_only unpickler, behind cnrstore's static
    scan): only UnsafePayload or InvalidArgument."""
    torch = pytest.importorskip("torch")
    from cnrstore.torch import payload

    blob = payload.encode({"format": 2, "mode": "incremental", "tables": ["emb"], "dense_dtypes": {"lin.weight": "float32"},
                           "optimizers": [{"state": {0: {"step": torch.tensor(3.0)}},
                                           "param_groups": [{"lr": 0.1, "params": [0]}]}],
                           "extra": {"loader": {"pos": 3}}, "param_names": [["emb.weight"]]})
    data = _mutate(blob.tobytes(), edits)
    try:
        payload.decode(np.frombuffer(data, dtype=np.uint8), 1)
    except (UnsafePayload, InvalidArgument):
        pass
    assert not os.path.exists("RAN")
    assert issubclass(UnsafePayload, CnrError)


# -- index values: well-formed msgpack (or struct) of the wrong shape ---------------------------------------
# A crafted index value that decodes within its bounds may still hold a string where an int belongs, a
# negative row count, a dim of 2**40, an unknown codec, a delta based on itself... Each is rewritten into a
# small real store with lmdb directly, and every read path runs over it: only cnrstore's typed errors may
# come out, and memory stays within the bound of the store's size.

_INDEX_DBS = (b"meta", b"tables", b"versions", b"segments", b"rows", b"dense_names", b"dense", b"log")
_STRUCT_VALUES = {b"rows": None, b"dense": index_mod.DENSE_LOC, b"log": index_mod.DENSE_LOC,
                  b"dense_names": index_mod._DENSE_ID}
_index_base: dict = {}


def _index_store(tmp_path_factory) -> tuple[str, list[tuple[bytes, bytes, bytes]]]:
    """A store of two tables over six versions (cumulative deltas included) and a dense array, built once,
    and every (database, key, value) of its index."""
    if "path" not in _index_base:
        import lmdb

        import cnrstore

        path = str(tmp_path_factory.mktemp("index-base") / "s")
        rng = np.random.default_rng(0)
        with cnrstore.open(path, create=True) as s:
            s.create_table("emb", 300, 4, codec="int4", block_rows=64)
            s.create_table("e2", 50, 3, codec="fp32")
            for v in range(6):
                with s.checkpoint(step=v, meta={"k": v}) as w:
                    rows = np.arange(300) if v == 0 else rng.choice(300, 20, replace=False)
                    w.put_rows("emb", rows, rng.random((rows.size, 4)))
                    if v < 2:
                        w.put_rows("e2", np.arange(50), rng.random((50, 3)))
                    w.put_dense("d", np.arange(5.0) + v)
        env = lmdb.open(os.path.join(path, "index"), max_dbs=len(_INDEX_DBS), readonly=True, lock=False)
        items = []
        with env.begin() as txn:
            for name in _INDEX_DBS:
                db = env.open_db(name, txn=txn, create=False)
                items += [(name, bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
        env.close()
        assert {len(v) for db, _k, v in items if db == b"rows"} == {17, 25}  # plain and delta entries
        _index_base.update(path=path, items=items)
    return _index_base["path"], _index_base["items"]


_ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.floats(), st.text(max_size=6), st.binary(max_size=6),
    st.sampled_from([0, -1, 1, 3, 63, 64, 2**16, 2**16 + 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1,
                     2**64 - 1, -2**63, "int4", "nope", "emb", [], [1, -1], {}, {"length": 1}, [["emb"]]]),
    st.integers(-2**63, 2**64 - 1), st.lists(st.integers(-2, 70), max_size=3),
    st.dictionaries(st.sampled_from(["version", "bytes", "high", "pending", "table", "block", "why", "dense", 1]),
                    st.integers(-2, 3), max_size=3))
_U_FIELD = st.one_of(st.sampled_from([0, 1, 7, 63, 64, 2**16, 2**16 + 1, 255, 2**32 - 1]), st.integers(0, 2**32 - 1))


@st.composite
def _index_edit(draw, items):
    """(database, key, new value) for one value of the index: a field replaced or dropped, the whole value
    replaced, or its bytes mutated."""
    db, key, raw = items[draw(st.integers(0, len(items) - 1))]
    how = draw(st.sampled_from(["field", "field", "field", "drop", "whole", "bytes"]))
    if how == "bytes":
        return db, key, _mutate(raw, draw(_mutations()))
    if db in _STRUCT_VALUES:
        if how != "field":
            return db, key, msgpack.packb(draw(_ODD_VALUES), use_bin_type=True)[:25] if how == "whole" else raw[:-1]
        if db == b"rows":
            fields = list(index_mod._row_loc(raw))
            i = draw(st.integers(0, 5))
            version = index_mod.ROW_KEY.unpack(key)[2]
            fields[i] = (draw(st.sampled_from([0, 1, version - 1, version, version + 1, 2**64 - 1])) if i == 5
                         else draw(_U_FIELD) % (256 if i == 4 else 2**32))
            if i == 5 and fields[5]:
                fields[4] |= record.FLAG_DELTA
            return db, key, index_mod._row_loc_bytes(index_mod.RowLoc(*fields))
        fmt = _STRUCT_VALUES[db]
        fields = list(fmt.unpack(raw))
        fields[draw(st.integers(0, len(fields) - 1))] = draw(_U_FIELD)
        return db, key, fmt.pack(*fields)
    value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    if how == "whole" or not isinstance(value, dict) or not value:
        return db, key, msgpack.packb(draw(_ODD_VALUES), use_bin_type=True)
    field = draw(st.sampled_from(sorted(value, key=str)))
    if how == "drop":
        value.pop(field)
    else:
        value[field] = draw(_ODD_VALUES)
    return db, key, msgpack.packb(value, use_bin_type=True)


def _read_everything(path: str) -> None:
    """open, ls, info, verify and every read of the store at ``path``; CnrError from any one is fine."""
    import contextlib
    import io

    import cnrstore
    from cnrstore import cli

    def each(*calls):
        for call in calls:
            try:
                call()
            except CnrError:
                pass

    def api():
        with cnrstore.open(path, readonly=True) as s:
            tables = {}

            def catalog():
                tables.update(s.tables())

            each(catalog, s.versions, s.latest, s.stats, s.verify, s.restore, lambda: s.read_dense("d"),
                 lambda: s.read_dense("d", 2))
            for name in ("emb", "e2", *tables):
                each(lambda: s.read_table(name), lambda: s.read_table(name, 3), lambda: s.read_rows(name, [0, 7, 49]))

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        each(api)
        for argv in (["ls"], ["info"], ["info", "--json"], ["verify"]):
            cli.main([*argv, path])  # a CnrError is exit status 2; anything else escapes


def _rewrite_index_value(path: str, db: bytes, key: bytes, value: bytes) -> None:
    import lmdb

    env = lmdb.open(os.path.join(path, "index"), max_dbs=len(_INDEX_DBS))
    try:
        with env.begin(write=True) as txn:
            txn.put(key, value, db=env.open_db(db, txn=txn, create=False))
    finally:
        env.close()


def _store_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _dirs, names in os.walk(path) for n in names)


def _check_edit(tmp_path_factory, db: bytes, key: bytes, value: bytes) -> None:
    import shutil

    base, _items = _index_store(tmp_path_factory)
    path = str(tmp_path_factory.mktemp("ix") / "s")
    shutil.copytree(base, path)
    _rewrite_index_value(path, db, key, value)
    _bounded(lambda: _read_everything(path), _store_bytes(path), (CnrError,))
    shutil.rmtree(path)


@settings(max_examples=int(os.environ.get("CNRSTORE_FUZZ_EXAMPLES", "20")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_index_values_of_the_wrong_shape_are_typed_errors_in_every_read(tmp_path_factory, data):
    _base, items = _index_store(tmp_path_factory)
    _check_edit(tmp_path_factory, *data.draw(_index_edit(items), label="edit"))


def _table_value(**fields) -> bytes:
    info = {"id": 1, "name": "emb", "num_rows": 300, "dim": 4, "codec": "int4", "block_rows": 64, "created": 1.0}
    return msgpack.packb({**info, **fields}, use_bin_type=True)


_CRAFTED = {  # (database, key, value) each of which reached the code using it before its field checks
    "negative num_rows": (b"tables", b"emb", _table_value(num_rows=-1)),
    "huge num_rows": (b"tables", b"emb", _table_value(num_rows=2**40)),
    "dim 0": (b"tables", b"emb", _table_value(dim=0)),
    "dim 2**40": (b"tables", b"emb", _table_value(dim=2**40)),
    "unknown codec": (b"tables", b"emb", _table_value(codec="int99")),
    "block_rows 0": (b"tables", b"emb", _table_value(block_rows=0)),
    "string id": (b"tables", b"emb", _table_value(id="1")),
    "num_rows below the records": (b"tables", b"emb", _table_value(num_rows=1)),
    "another table's id": (b"tables", b"e2", msgpack.packb({**msgpack.unpackb(_table_value(name="e2")), "num_rows": 50,
                                                             "dim": 3, "codec": "fp32"})),
    "no id": (b"tables", b"emb", msgpack.packb({k: v for k, v in msgpack.unpackb(_table_value()).items() if k != "id"})),
    "step bytes": (b"versions", index_mod.VERSION_KEY.pack(1),
                      msgpack.packb({"step": b"x", "meta": None, "created": 1.0, "parent": None, "tables": [],
                                     "dense": [], "bytes": 0})),
    "created beyond time_t": (b"versions", index_mod.VERSION_KEY.pack(1),
                              msgpack.packb({"step": 0, "meta": None, "created": 2**64 - 1, "parent": None,
                                             "tables": [], "dense": [], "bytes": 0})),
    "segment length nil": (b"segments", index_mod.VERSION_KEY.pack(1), msgpack.packb({"length": None})),
    "bytes_written a string": (b"meta", b"bytes_written", msgpack.packb("x")),
    "bytes_written nil": (b"meta", b"bytes_written", msgpack.packb(None)),
    "dense id of 3 bytes": (b"dense_names", b"d", b"\0\0\1"),
    "save_bytes a string": (b"meta", b"save_bytes", msgpack.packb("")),
    "merge_bytes a string": (b"meta", b"merge_bytes", msgpack.packb("x")),
}


def test_every_meta_key_is_checked_when_read():
    """A MetaKey left out of schema.META_KEYS is read unchecked (save_bytes and merge_bytes were: a
    damaged one reached stats() as a string)."""
    from cnrstore.engine import schema

    defined = {k.name for k in vars(schema).values() if isinstance(k, schema.MetaKey)}
    assert defined == set(schema.META_KEYS)


@pytest.mark.parametrize("case", sorted(_CRAFTED))
def test_crafted_index_values_are_typed_errors_in_every_read(tmp_path_factory, case):
    _check_edit(tmp_path_factory, *_CRAFTED[case])


def test_a_delta_entry_based_on_itself_is_damage_not_an_endless_read_chain(tmp_path_factory):
    """A cumulative delta's base at or above its own version would send a read chain round for ever."""
    import itertools
    import shutil

    import cnrstore
    from cnrstore.errors import IndexDamaged

    base, items = _index_store(tmp_path_factory)
    key, raw = next((k, v) for db, k, v in items if db == b"rows" and len(v) == index_mod.ROW_LOC_DELTA.size)
    table, block, version = index_mod.ROW_KEY.unpack(key)
    for based_on in (version, version + 1):
        path = str(tmp_path_factory.mktemp("loop") / "s")
        shutil.copytree(base, path)
        _rewrite_index_value(path, b"rows", key, index_mod._row_loc_bytes(index_mod._row_loc(raw)._replace(base=based_on)))
        with cnrstore.open(path, readonly=True) as s:
            with s.engine.read() as view, pytest.raises(IndexDamaged, match="base"):
                list(itertools.islice(view.row_chain(table, block, version), 20))
            with pytest.raises(CorruptionError):
                s.read_table("emb", version)
        _bounded(lambda: _read_everything(path), _store_bytes(path), (CnrError,))


@settings(max_examples=int(os.environ.get("CNRSTORE_FUZZ_EXAMPLES", "15")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_mutations(), st.booleans(), st.booleans())
def test_repair_of_mutated_segment_bytes_is_typed(tmp_path_factory, edits, reseal, drop_index):
    """`cnrstore repair` over a segment whose bytes were mutated (the record holding the first edit resealed
    or not) and an index kept or lost: only typed errors, and a store that verify then reads typed too."""
    import glob
    import shutil

    import cnrstore

    base, _items = _index_store(tmp_path_factory)
    path = str(tmp_path_factory.mktemp("rp") / "s")
    shutil.copytree(base, path)
    (seg,) = glob.glob(os.path.join(path, "segments", "*.seg"))
    data = open(seg, "rb").read()
    mutated = _mutate(data, edits)
    if reseal:  # recompute the checksum of the record the first edit fell in (records found by their lengths)
        mutated = _reseal_at(mutated, int(edits[0][0] * len(mutated)))
    with open(seg, "wb") as f:
        f.write(mutated)
    if drop_index:
        shutil.rmtree(os.path.join(path, "index"))

    def run():
        try:
            cnrstore.repair(path)
        except CnrError:
            pass
        _read_everything(path)

    _bounded(run, _store_bytes(path), (CnrError,))
    shutil.rmtree(path)


def _reseal_at(data: bytes, at: int) -> bytes:
    """``data`` (a segment) with the checksum of the record around byte ``at`` recomputed, walking records by
    the lengths in their headers from the segment header; unchanged if the walk does not reach it."""
    from cnrstore.engine import segments

    pos = segments.SEGMENT_HEADER_BYTES
    while pos + record.HEADER_BYTES <= len(data):
        fields = record.HEADER.unpack_from(data, pos)
        end = pos + record.HEADER_BYTES + fields[-2] + fields[-1] + record.TRAILER_BYTES
        if end > len(data) or end <= pos:
            return data
        if pos <= at < end:
            return data[:pos] + _reseal_record(data[pos:end]) + data[end:]
        pos = end
    return data
