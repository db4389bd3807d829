"""Layer 2, the segment log: appending, syncing, committing, rolling back, rolling, recovery, mmap reads."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from cnrstore.engine import filenames
from cnrstore import knobs
from cnrstore.errors import CorruptionError, StorageFull
from cnrstore.engine.fs import FileSystem
from cnrstore.engine.segments import (
    SEGMENT_HEADER_BYTES, SegmentAppender, SegmentReader, check_segment_header, recover, segment_header,
)

FMT = 1
H = SEGMENT_HEADER_BYTES


class RecordingFS(FileSystem):
    """The real file system, noting every call; ``enospc_after`` bytes of pwritev, then ENOSPC."""

    def __init__(self):
        self.calls = []
        self.enospc_after = None
        self.written = 0

    def pwritev(self, fd, buffers, offset):
        total = sum(memoryview(b).nbytes for b in buffers)
        if self.enospc_after is not None and self.written + total > self.enospc_after:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.calls.append(("pwritev", offset, total))
        self.written += total
        return super().pwritev(fd, buffers, offset)

    def fsync(self, fd):
        self.calls.append(("fsync",))
        super().fsync(fd)

    def fsync_dir(self, path):
        self.calls.append(("fsync_dir", path))
        super().fsync_dir(path)

    def truncate(self, path, length):
        self.calls.append(("truncate", os.path.basename(path), length))
        super().truncate(path, length)

    def remove(self, path):
        self.calls.append(("remove", os.path.basename(path)))
        super().remove(path)


@pytest.fixture
def root(tmp_path):
    os.makedirs(filenames.segments_dir(str(tmp_path)))
    return str(tmp_path)


def seg_path(root, seg):
    return filenames.segment_path(root, seg)


def size(root, seg):
    return os.path.getsize(seg_path(root, seg))


def file_bytes(root, seg):
    with open(seg_path(root, seg), "rb") as f:
        return f.read()


def rec(n, fill):
    return [bytes([fill]) * n], n


# appender -------------------------------------------------------------------------------------------
def test_append_sync_commit_rollback(root):
    fs = RecordingFS()
    app = SegmentAppender(root, {}, FMT, fs)
    assert app.active is None
    assert app.append(*rec(5, 1)) == (1, H)
    assert app.active == 1
    check_segment_header(np.frombuffer(file_bytes(root, 1), np.uint8), 1, seg_path(root, 1))
    # several records, several buffers each, in one call
    locs = app.append_many([([b"ab", np.frombuffer(b"cd", np.uint8)], 4), ([b"xyz"], 3)])
    assert locs == [(1, H + 5), (1, H + 9)]
    assert file_bytes(root, 1)[H:] == b"\x01" * 5 + b"abcdxyz"
    lengths = app.sync()
    assert lengths == {1: H + 12}
    assert ("fsync",) in fs.calls and ("fsync_dir", filenames.segments_dir(root)) in fs.calls  # a new file
    assert app.committed == {}  # not committed until the index says so
    app.mark_committed(lengths)
    assert app.committed == {1: H + 12}

    # an uncommitted tail is thrown away by rollback
    assert app.append(*rec(100, 2)) == (1, H + 12)
    assert size(root, 1) == H + 112
    app.rollback()
    assert size(root, 1) == H + 12
    assert app.append(*rec(3, 3)) == (1, H + 12)  # the space is reused
    fs.calls.clear()
    lengths = app.sync()
    assert lengths == {1: H + 15}
    assert not any(c[0] == "fsync_dir" for c in fs.calls)  # no new file this time
    app.mark_committed(lengths)
    assert file_bytes(root, 1)[H:] == b"\x01" * 5 + b"abcdxyz" + b"\x03" * 3
    # rollback with nothing appended changes nothing
    app.rollback()
    assert size(root, 1) == H + 15
    app.close()


def test_append_many_empty_is_a_no_op(root):
    app = SegmentAppender(root, {}, FMT, FileSystem())
    assert app.append_many([]) == []
    assert os.listdir(filenames.segments_dir(root)) == []
    assert app.sync() == {}
    app.close()


def test_appender_continues_committed_segment(root):
    app = SegmentAppender(root, {}, FMT, FileSystem())
    app.append(*rec(10, 1))
    app.mark_committed(app.sync())
    app.close()
    app = SegmentAppender(root, {1: H + 10}, FMT, FileSystem())
    assert app.append(*rec(4, 2)) == (1, H + 10)
    app.mark_committed(app.sync())
    assert app.committed == {1: H + 14}
    assert os.listdir(filenames.segments_dir(root)) == [os.path.basename(seg_path(root, 1))]
    app.close()


def test_rolling_at_segment_bytes(root, monkeypatch):
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 100)
    app = SegmentAppender(root, {}, FMT, FileSystem())
    locs = [app.append(*rec(40, i)) for i in range(6)]
    # a segment takes records until it holds at least SEGMENT_BYTES, then the next one starts
    assert locs == [(1, H), (1, H + 40), (2, H), (2, H + 40), (3, H), (3, H + 40)]
    big = app.append(*rec(1000, 9))  # a record larger than a segment goes whole into a new one
    assert big == (4, H) and size(root, 4) == H + 1000
    assert app.append(*rec(1, 1)) == (5, H)
    lengths = app.sync()
    assert lengths == {1: H + 80, 2: H + 80, 3: H + 80, 4: H + 1000, 5: H + 1}
    app.mark_committed(lengths)
    for seg in range(1, 6):
        check_segment_header(np.frombuffer(file_bytes(root, seg), np.uint8), seg, seg_path(root, seg))
    app.close()


def test_rollback_removes_new_segments_and_never_reuses_their_ids(root, monkeypatch):
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 100)
    fs = RecordingFS()
    app = SegmentAppender(root, {}, FMT, fs)
    app.append(*rec(40, 1))
    app.mark_committed(app.sync())  # segment 1: H + 40
    app.append(*rec(80, 2))          # segment 1 grows past 100
    app.append(*rec(80, 3))          # segment 2 is new (and full)
    app.append(*rec(200, 4))         # segment 3 is new
    assert sorted(os.listdir(filenames.segments_dir(root))) == [os.path.basename(seg_path(root, s)) for s in (1, 2, 3)]
    app.rollback()
    assert os.listdir(filenames.segments_dir(root)) == [os.path.basename(seg_path(root, 1))]
    assert size(root, 1) == H + 40
    assert app.active == 1
    seg, off = app.append(*rec(30, 5))  # segment 1 again, where the rolled-back bytes were
    assert (seg, off) == (1, H + 40)
    seg, off = app.append(*rec(100, 6))  # segment 1 is full now: a fresh segment, with a fresh id
    assert seg not in (1, 2, 3) and off == H
    lengths = app.sync()
    app.mark_committed(lengths)
    check_segment_header(np.frombuffer(file_bytes(root, seg), np.uint8), seg, seg_path(root, seg))
    app.close()


def test_rollback_of_a_first_segment(root):
    app = SegmentAppender(root, {}, FMT, FileSystem())
    app.append(*rec(10, 1))
    app.rollback()
    assert os.listdir(filenames.segments_dir(root)) == []
    assert app.active is None
    seg, off = app.append(*rec(10, 2))
    assert off == H and seg >= 1
    app.mark_committed(app.sync())
    assert app.committed == {seg: H + 10}
    app.close()


def test_enospc_becomes_storage_full_and_appends_nothing(root):
    fs = RecordingFS()
    app = SegmentAppender(root, {}, FMT, fs)
    app.append(*rec(10, 1))
    app.mark_committed(app.sync())
    fs.enospc_after = fs.written + 5
    with pytest.raises(StorageFull) as ei:
        app.append(*rec(50, 2))
    assert ei.value.errno == errno.ENOSPC and isinstance(ei.value, OSError)
    app.rollback()
    fs.enospc_after = None
    assert app.append(*rec(3, 3)) == (1, H + 10)
    app.mark_committed(app.sync())
    assert file_bytes(root, 1)[H:] == b"\x01" * 10 + b"\x03" * 3
    app.close()


def test_enospc_creating_a_segment(root, monkeypatch):
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 64)
    fs = RecordingFS()
    app = SegmentAppender(root, {}, FMT, fs)
    app.append(*rec(40, 1))
    app.mark_committed(app.sync())
    fs.enospc_after = fs.written  # not even a header fits
    with pytest.raises(StorageFull):
        app.append(*rec(4, 2))
    app.rollback()
    assert os.listdir(filenames.segments_dir(root)) == [os.path.basename(seg_path(root, 1))]
    fs.enospc_after = None
    seg, off = app.append(*rec(4, 2))
    assert seg != 1 and off == H
    app.mark_committed(app.sync())
    app.close()


# recover --------------------------------------------------------------------------------------------
def _write_segment(root, seg, payload: bytes):
    with open(seg_path(root, seg), "wb") as f:
        f.write(segment_header(seg, FMT) + payload)


def test_recover_truncates_torn_tails_and_removes_uncommitted_segments(root):
    _write_segment(root, 1, b"a" * 100)            # committed H + 60: a torn tail of 40
    _write_segment(root, 2, b"b" * 10)             # committed exactly
    _write_segment(root, 3, b"c" * 10)             # unknown to the index: uncommitted
    _write_segment(root, 7, b"")                   # header only, unknown
    junk = os.path.join(filenames.segments_dir(root), "notes.txt")
    open(junk, "w").write("keep me")
    fs = RecordingFS()
    notes = recover(root, {1: H + 60, 2: H + 10}, fs)
    assert size(root, 1) == H + 60 and file_bytes(root, 1)[H:] == b"a" * 60
    assert size(root, 2) == H + 10
    assert not os.path.exists(seg_path(root, 3)) and not os.path.exists(seg_path(root, 7))
    assert open(junk).read() == "keep me"
    assert len(notes) == 3 and any("40 bytes" in n for n in notes)
    assert ("fsync_dir", filenames.segments_dir(root)) in fs.calls
    # a second recovery has nothing to do
    fs.calls.clear()
    assert recover(root, {1: H + 60, 2: H + 10}, fs) == []
    assert fs.calls == []


def test_recover_then_append_continues_at_committed_length(root):
    app = SegmentAppender(root, {}, FMT, FileSystem())
    app.append(*rec(20, 1))
    committed = app.sync()
    app.mark_committed(committed)
    app.append(*rec(500, 2))  # a checkpoint in flight when the process "crashes"
    app.sync()
    app.close()
    assert size(root, 1) == H + 520
    recover(root, committed, FileSystem())
    app = SegmentAppender(root, committed, FMT, FileSystem())
    assert app.append(*rec(1, 3)) == (1, H + 20)
    app.close()


# reader ---------------------------------------------------------------------------------------------
def test_reader_remaps_as_a_segment_grows(root):
    app = SegmentAppender(root, {}, FMT, FileSystem())
    app.append(*rec(10, 1))
    reader = SegmentReader(root)
    first = reader.read(1, H, 10)
    assert first.tobytes() == b"\x01" * 10
    assert not first.flags.writeable
    payloads = []
    for i in range(2, 6):  # grow well past a page each time
        seg, off = app.append(*rec(5000 * i, i))
        payloads.append((off, 5000 * i, i))
        got = reader.read(seg, off, 5000 * i)
        assert got.tobytes() == bytes([i]) * (5000 * i)
    for off, n, i in payloads:
        assert reader.read(1, off, n).tobytes() == bytes([i]) * n
    assert first.tobytes() == b"\x01" * 10  # views of an older mapping stay valid
    assert reader.path(1) == seg_path(root, 1)
    reader.close()
    assert first.tobytes() == b"\x01" * 10  # even after close
    app.close()


def test_reader_missing_segment(root):
    reader = SegmentReader(root)
    with pytest.raises(CorruptionError) as ei:
        reader.read(9, H, 10)
    assert ei.value.path == seg_path(root, 9)
    reader.close()


def test_reader_short_segment(root):
    _write_segment(root, 1, b"z" * 50)
    reader = SegmentReader(root)
    with pytest.raises(CorruptionError) as ei:
        reader.read(1, H + 40, 20)  # ten bytes past the end
    assert ei.value.path == seg_path(root, 1) and ei.value.offset == H + 50
    assert reader.read(1, H + 40, 10).tobytes() == b"z" * 10
    with pytest.raises(CorruptionError):  # also once a (shorter) mapping exists
        reader.read(1, H, 51)
    reader.close()


def test_reader_segment_shorter_than_its_header(root):
    with open(seg_path(root, 1), "wb") as f:
        f.write(segment_header(1, FMT)[:20])
    reader = SegmentReader(root)
    with pytest.raises(CorruptionError):
        reader.read(1, 0, 10)
    with pytest.raises(CorruptionError):
        reader.read(1, H, 1)
    reader.close()


@pytest.mark.parametrize("damage", ["flip", "wrong_id"])
def test_reader_bad_header(root, damage):
    header = bytearray(segment_header(2 if damage == "wrong_id" else 1, FMT))
    if damage == "flip":
        header[3] ^= 0x20
    with open(seg_path(root, 1), "wb") as f:
        f.write(bytes(header) + b"q" * 100)
    reader = SegmentReader(root)
    with pytest.raises(CorruptionError) as ei:
        reader.read(1, H, 10)
    assert ei.value.path == seg_path(root, 1) and ei.value.offset == 0
    reader.close()


def test_reader_concurrent_reads_while_growing(root):
    app = SegmentAppender(root, {}, FMT, FileSystem())
    locs = [(app.append(*rec(100, i % 256)), i % 256) for i in range(50)]
    reader = SegmentReader(root)
    errors = []
    stop = threading.Event()

    def read_loop():
        try:
            while not stop.is_set():
                for (seg, off), fill in list(locs):
                    if reader.read(seg, off, 100).tobytes() != bytes([fill]) * 100:
                        errors.append((seg, off))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=read_loop) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(50, 300):
        locs.append((app.append(*rec(100, i % 256)), i % 256))
    stop.set()
    for t in threads:
        t.join(10)
    assert errors == []
    for (seg, off), fill in locs:
        assert reader.read(seg, off, 100).tobytes() == bytes([fill]) * 100
    reader.close()
    app.close()


def test_a_reader_maps_a_segment_whose_uncommitted_tail_is_truncated_under_it(tmp_path, monkeypatch):
    """The writer's rollback may truncate a segment's uncommitted tail between a reader's fstat and its mmap
    (seen once in CI: ValueError 'mmap length is greater than file size' from a reader thread); the reader
    reads the size again and maps what is there, which still holds every committed byte."""
    import mmap as mmap_module

    from cnrstore.engine import segments

    path = tmp_path / "seg"
    path.write_bytes(b"c" * 4096 + b"u" * 4096)          # 4 KiB committed, 4 KiB uncommitted tail
    real_mmap, calls = mmap_module.mmap, []

    def truncating_mmap(fd, length, **kw):
        calls.append(length)
        if len(calls) == 1:
            os.truncate(path, 4096)                       # the writer's rollback, between fstat and mmap
        return real_mmap(fd, length, **kw)

    monkeypatch.setattr(segments.mmap, "mmap", truncating_mmap)
    with open(path, "rb") as f:
        mm = segments._map_whole(f.fileno(), 4096, str(path))
    assert calls == [8192, 4096]
    assert len(mm) == 4096 and mm[:4096] == b"c" * 4096
    mm.close()


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RssFile is Linux's")
@pytest.mark.parametrize("bound", [None, 8 << 20])
def test_reads_drop_their_mapped_pages_past_the_bound(tmp_path, monkeypatch, bound):
    """Reading a store touches its segments' pages through mmap; past MAPPED_READ_RELEASE_BYTES the reader
    drops them from the resident set (issue 37: a trainer's peak RSS counted the store it merged), and the
    bytes read stay right."""
    import cnrstore
    monkeypatch.setattr(knobs, "MAPPED_READ_RELEASE_BYTES", bound)
    rows, dim = 1 << 17, 128  # 64 MiB of fp32
    values = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("t", rows, dim, codec="fp32")
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(rows), values)
    with cnrstore.open(str(tmp_path / "s"), readonly=True) as store:
        before = _rss_file_kib()
        got = store.read_table("t")
        grown_mib = (_rss_file_kib() - before) / 1024
        np.testing.assert_array_equal(got, values)
    if bound is None:
        assert grown_mib > 48  # (the control: every page read stays resident)
    else:
        # about 12 MiB quiet; 24.0 was seen once in the loaded suite (3 workers on 2 cores: the decode threads
        # verify further ahead of the sampling). Half the 80 MiB the read held before the release, and below
        # the control's 48, so it still fails without the release
        assert grown_mib < 40


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RssFile is Linux's")
@pytest.mark.parametrize("into", ["out", "new"])
@pytest.mark.parametrize("bound", [None, 4 << 20])
def test_whole_table_reads_drop_their_mapped_pages_as_they_go(tmp_path, monkeypatch, bound, into):
    """A whole-table read (restore's) lets go of each block's records once it has verified them and once it
    has decoded them (SegmentStorage.release), so the store's pages it maps stay within the bound while it
    runs, not only after it (a restore of 820 MB of state peaked with all of it mapped: RssFile +900 MB).
    Into the caller's arrays (every record verified before any is decoded) and into new ones (each block
    decoded once verified); RssFile sampled after every block decoded, the bytes read exact. What stays
    mapped: up to the bound of bytes let go of and not dropped yet, and the blocks in hand (two decoding
    threads: two blocks, or up to six verified ahead of them into new arrays; 1.3 MiB each here), about
    12 MiB.
    Before, the read held them all: 80 MiB."""
    import cnrstore
    from cnrstore.engine import table_decode

    monkeypatch.setattr(knobs, "MAPPED_READ_RELEASE_BYTES", bound)
    monkeypatch.setattr(knobs, "DECODE_THREADS", 2)
    rows, dim = 1 << 17, 128  # 64 MiB of fp32, in blocks of 1 MiB
    rng = np.random.default_rng(0)
    values = rng.standard_normal((rows, dim)).astype(np.float32)
    with cnrstore.open(str(tmp_path / "s"), create=True) as store:
        store.create_table("t", rows, dim, codec="fp32", block_rows=2048)
        with store.checkpoint() as ck:
            ck.put_rows("t", np.arange(rows), values)
        changed = np.sort(rng.choice(rows, rows // 4, replace=False))  # an increment: chains of two records
        values[changed] += 1
        with store.checkpoint() as ck:
            ck.put_rows("t", changed, values[changed])
    peak = [0]
    real = table_decode.decode_block

    def sampled(*args):
        real(*args)
        peak[0] = max(peak[0], _rss_file_kib())

    monkeypatch.setattr(table_decode, "decode_block", sampled)
    with cnrstore.open(str(tmp_path / "s"), readonly=True) as store:
        before = _rss_file_kib()
        if into == "out":
            got = np.zeros_like(values)
            store.read_tables({"t": got})
        else:
            got = store.read_table("t")
        grown_mib = (peak[0] - before) / 1024
        np.testing.assert_array_equal(got, values)
    if bound is None:
        assert grown_mib > 48  # (the control: every page read stays resident until the read ends)
    else:
        # about 12 MiB quiet; 24.0 was seen once in the loaded suite (3 workers on 2 cores: the decode threads
        # verify further ahead of the sampling). Half the 80 MiB the read held before the release, and below
        # the control's 48, so it still fails without the release
        assert grown_mib < 40


def test_released_ranges_are_joined_where_they_touch():
    """SegmentReader.release drops the whole pages inside the ranges it was given, adjacent records joined
    first (so that the pages across their boundary go too) and nothing across a gap or another segment."""
    from cnrstore.engine.range_fetch import ByteRange
    from cnrstore.engine.segments import _joined

    got = _joined([ByteRange(2, 100, 50), ByteRange(1, 4096, 10), ByteRange(1, 0, 4096), ByteRange(2, 150, 10),
                   ByteRange(2, 120, 5), ByteRange(2, 161, 1)])
    assert got == [(1, 0, 4106), (2, 100, 160), (2, 161, 162)]
