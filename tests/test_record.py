"""cnrstore/engine/record.py: the bytes of one record (docs/FORMAT.md, "Records"), built and parsed without a
store. Damage found through a store is test_corruption.py's; mutated bytes are test_fuzz_parsers.py's."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import xxhash

from cnrstore import codecs
from cnrstore.engine import record
from cnrstore.errors import CorruptionError

FP32 = codecs.get("fp32")


def _bytes(buffers) -> np.ndarray:
    return np.frombuffer(b"".join(bytes(b) for b in buffers), dtype=np.uint8)


def _built(buffers, length) -> np.ndarray:
    buf = _bytes(buffers)
    assert buf.size == length
    return buf


def _resealed(buf: np.ndarray, **fields) -> np.ndarray:
    """``buf`` with header ``fields`` changed and its checksum made right again."""
    names = ("magic", "kind", "codec_id", "flags", "object_id", "count", "block", "version", "aux_len", "body_len")
    header = dict(zip(names, record.HEADER.unpack_from(buf, 0)))
    header.update(fields)
    out = bytearray(buf.tobytes())
    record.HEADER.pack_into(out, 0, *(header[n] for n in names))
    record.CHECKSUM.pack_into(out, len(out) - 8, xxhash.xxh3_64_intdigest(bytes(out[:-8])))
    return np.frombuffer(bytes(out), dtype=np.uint8)


def test_the_header_is_40_little_endian_bytes_in_the_documented_order():
    rows = np.array([[1.0, 2.0]], dtype=np.float32)
    buf = _built(*record.rows_record(FP32.codec_id, 0, 7, 3, 9, np.array([5]), FP32.encode(rows)))
    assert record.HEADER_BYTES == 40 and record.TRAILER_BYTES == 8
    # magic, kind u8, codec u8, flags u16, object u32, count u32, block u64, version u64, aux_len u32, body_len u32
    want = (b"CNRr" + bytes([1, FP32.codec_id]) + struct.pack("<H", 0) + struct.pack("<IIQQII", 7, 1, 3, 9, 2, 8))
    assert buf[:40].tobytes() == want
    assert buf[40:42].tobytes() == struct.pack("<H", 5)                     # the one row offset, u16
    assert buf[42:50].tobytes() == rows.tobytes()                           # fp32 rows as stored
    assert buf[50:].tobytes() == struct.pack("<Q", xxhash.xxh3_64_intdigest(buf[:50].tobytes()))


def test_on_disk_constants_keep_their_values():
    assert (record.KIND_ROWS, record.KIND_DENSE, record.KIND_COMMIT, record.KIND_ANCHOR, record.KIND_DROP) == (1, 2, 3, 4, 5)
    assert (record.FLAG_BASELINE, record.FLAG_FULL, record.FLAG_COMPACTED, record.FLAG_DELTA) == (1, 2, 4, 8)
    assert record.MAGIC == b"CNRr" and record.BASE.size == 16


def test_a_rows_record_parses_back_with_its_offsets():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    offsets = np.array([2, 9, 40], dtype=np.int64)
    buf = _built(*record.rows_record(FP32.codec_id, record.FLAG_COMPACTED, 11, 6, 21, offsets, FP32.encode(values)))
    rec = record.parse(buf, "seg", 100)
    assert (rec.kind, rec.codec_id, rec.flags, rec.object_id, rec.count, rec.block, rec.version) == (
        record.KIND_ROWS, FP32.codec_id, record.FLAG_COMPACTED, 11, 3, 6, 21)
    assert rec.offsets().dtype == np.int64 and rec.offsets().tolist() == [2, 9, 40]
    assert rec.stored_offsets().dtype == record.OFFSET_DTYPE
    assert np.array_equal(FP32.decode(rec.body.reshape(3, -1), 4), values)
    assert rec.base() == 0 and rec.copied() == 0


def test_a_full_record_stores_no_offsets_and_reads_as_rows_0_to_count():
    body = FP32.encode(np.ones((5, 2), dtype=np.float32))
    buf = _built(*record.rows_record(FP32.codec_id, record.FLAG_FULL | record.FLAG_BASELINE, 1, 0, 1, None, body))
    rec = record.parse(buf, "seg", 0)
    assert rec.aux.size == 0 and rec.offsets().tolist() == [0, 1, 2, 3, 4]
    assert buf.size == record.HEADER_BYTES + body.nbytes + record.TRAILER_BYTES


def test_a_cumulative_delta_carries_its_base_and_copied_count_ahead_of_its_offsets():
    body = FP32.encode(np.zeros((2, 2), dtype=np.float32))
    buf = _built(*record.rows_record(FP32.codec_id, record.FLAG_DELTA, 1, 0, 8, np.array([3, 4]), body,
                                     base=5, copied=17))
    rec = record.parse(buf, "seg", 0)
    assert rec.base() == 5 and rec.copied() == 17
    assert rec.offsets().tolist() == [3, 4]
    assert rec.aux[:16].tobytes() == struct.pack("<QQ", 5, 17)


@pytest.mark.parametrize("array", [
    np.arange(6, dtype=np.int16).reshape(2, 3),
    np.array(3.5, dtype=np.float64),                        # 0-d
    np.array([True, False]),
    np.zeros((0, 4), dtype=np.float32),                     # empty
    np.arange(6, dtype=np.float32).reshape(2, 3).T,         # not C-contiguous
])
def test_a_dense_record_holds_the_array_exactly(array):
    rec = record.parse(_built(*record.dense_record(4, 2, array)), "seg", 0)
    assert (rec.kind, rec.object_id, rec.version) == (record.KIND_DENSE, 4, 2)
    desc = rec.dense_descriptor()
    assert desc == {"dtype": array.dtype.str, "shape": list(array.shape)}
    back = rec.body.view(np.dtype(desc["dtype"])).reshape(desc["shape"])
    assert back.dtype == array.dtype and np.array_equal(back, array)


def test_a_dense_descriptor_that_disagrees_with_the_body_is_corruption():
    buf = _built(*record.dense_record(1, 1, np.zeros(4, dtype=np.float32)))
    rec = record.parse(buf, "seg", 0)
    with pytest.raises(CorruptionError, match="16 bytes"):
        rec._replace(body=rec.body[:12]).dense_descriptor()
    for desc in ({"dtype": "O", "shape": [4]}, {"dtype": "<f4", "shape": [-4]}, [1, 2], {"shape": [4]}):
        bad = rec._replace(aux=np.frombuffer(msgpack.packb(desc), dtype=np.uint8))
        with pytest.raises(CorruptionError, match="dense descriptor"):
            bad.dense_descriptor()


@pytest.mark.parametrize("kind,body", [
    (record.KIND_COMMIT, {"version": 3, "parent": 2, "tables": ["a"], "dense": [], "meta": {"lr": 0.1},
                          "catalog": [{"id": 1, "name": "a", "num_rows": 10, "dim": 4, "codec": "int4",
                                       "block_rows": 8}],
                          "dense_ids": {"x": 1}, "blocks": {1: [b"\0" * 8, b"\0" * 4, b"\0"]}}),
    (record.KIND_ANCHOR, {"version": 5, "dropped_below": 4, "catalog": [], "dense_names": {}, "dense": {},
                          "heads": {}}),
    (record.KIND_DROP, {"seq": 1, "latest": 9, "kept": [8, 9]}),
])
def test_log_records_round_trip_their_msgpack_body(kind, body):
    rec = record.parse(_built(*record.log_record(kind, 7, body)), "seg", 0)
    assert rec.kind == kind and rec.version == 7
    assert record.log_body(rec) == body


@pytest.mark.parametrize("kind,body,why", [
    (record.KIND_COMMIT, {"version": -1}, "version"),
    (record.KIND_COMMIT, {"version": 1, "tables": "a"}, "tables"),
    (record.KIND_COMMIT, {"version": 1, "catalog": [{"id": 1}]}, "catalog"),
    (record.KIND_COMMIT, {"version": 1, "blocks": {1: [b"\0" * 8, b"\0" * 8, b"\0"]}}, "unequal length"),
    (record.KIND_ANCHOR, {"version": 1, "heads": {"t": []}}, "heads"),
    (record.KIND_DROP, {"seq": 1, "latest": 2, "kept": [True]}, "kept"),
    (record.KIND_ROWS, {}, "no log body"),
    (record.KIND_DROP, [1, 2], "not a map"),
])
def test_a_log_body_of_the_wrong_layout_is_corruption(kind, body, why):
    with pytest.raises(CorruptionError, match=why):
        record.check_log_body(kind, body)


def test_every_flipped_byte_of_a_record_is_found():
    buf = _built(*record.rows_record(FP32.codec_id, 0, 1, 0, 1, np.array([1, 3]),
                                     FP32.encode(np.ones((2, 2), dtype=np.float32))))
    record.parse(buf, "seg", 0)
    for i in range(buf.size):
        bad = buf.copy()
        bad[i] ^= 0x20
        with pytest.raises(CorruptionError, match="seg:64"):
            record.parse(bad, "seg", 64)


def test_parse_names_what_is_wrong_behind_a_valid_checksum():
    buf = _built(*record.rows_record(FP32.codec_id, 0, 1, 0, 1, np.array([1, 3]),
                                     FP32.encode(np.ones((2, 2), dtype=np.float32))))
    with pytest.raises(CorruptionError, match="shorter than a header"):
        record.parse(buf[:30], "seg", 0)
    with pytest.raises(CorruptionError, match="bad record header"):
        record.parse(_resealed(buf, kind=9), "seg", 0)
    with pytest.raises(CorruptionError, match="bad record header"):
        record.parse(_resealed(buf, flags=0x40), "seg", 0)
    with pytest.raises(CorruptionError, match="lengths disagree"):
        record.parse(_resealed(buf, body_len=4), "seg", 0)
    with pytest.raises(CorruptionError, match="offsets length"):
        record.parse(_resealed(buf, count=3), "seg", 0)
