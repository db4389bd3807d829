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

from cnrstore import index as index_mod
from cnrstore import marker, record
from cnrstore.errors import CnrError, CorruptionError, InvalidArgument, UnsafePayload
from cnrstore.msgpack_safe import unpack_bounded

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
    from cnrstore.distributed.manifest import GLOBAL_DIR, MARKER, Root, _seal

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
