"""Layer 2 — the segment log: append-only segment files, rolled at a size limit, read through mmap.

A segment file is a 32-byte header followed by records (record.py). Only the prefix up to the
segment's *committed length* (kept in the index) holds data of committed versions; bytes past it are
the torn tail of a crash or of an aborted checkpoint and are truncated by the writer on open.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import threading

import numpy as np
import xxhash

from . import filenames, fs
from .. import knobs
from ..errors import CorruptionError, IndexDamaged, InvalidArgument
from ..options import Options

log = logging.getLogger("cnrstore.engine.segments")
# On disk: never change. magic, segment id u64, format version u32, reserved u32 (0), xxh3-64 of the
# preceding 24 bytes.
SEGMENT_MAGIC = b"CNRSEG\x00\x01"
SEGMENT_HEADER = struct.Struct("<8sQII")
SEGMENT_HEADER_BYTES = SEGMENT_HEADER.size + 8  # 32
#: What to do about a segment that is not a regular file (a link, a FIFO, a device, a directory).
SEGMENT_FIX = ("a store's files are regular files: restore it from a copy, or run `cnrstore repair`, which sets "
               "it aside (the versions that read it are then reported as damaged)")


def segment_header(segment_id: int, format_version: int) -> bytes:
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, segment_id, format_version, 0)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def check_segment_header(buf, segment_id: int, path: str) -> None:
    """Raise CorruptionError unless ``buf`` starts with a valid header of segment ``segment_id``."""
    if len(buf) < SEGMENT_HEADER_BYTES:
        raise CorruptionError(f"segment {path} is shorter than its header", path, 0)
    head = bytes(buf[: SEGMENT_HEADER.size])
    (stored,) = struct.unpack_from("<Q", buf, SEGMENT_HEADER.size)
    magic, seg_id, _fmt, _ = SEGMENT_HEADER.unpack(head)
    if xxhash.xxh3_64_intdigest(head) != stored or magic != SEGMENT_MAGIC or seg_id != segment_id:
        raise CorruptionError(f"bad segment header in {path}", path, 0)


_NEWEST = object()
_OMITTED = object()


class SegmentIds:
    """Hands out segment ids, never twice (thread-safe; shared by every appender of a store).

    It also tracks the ids handed out whose segment is not yet committed (nor removed): each index commit
    records ``state()`` (meta ``segment_ids``), which is what lets ``recover`` prove that a segment file
    the index does not know is the leftover of an uncommitted write rather than lost data.
    """

    def __init__(self, first: int):
        self._next = first
        self._outstanding: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            seg = self._next
            if seg > 0xFFFFFFFF:  # index entries hold segment ids as u32
                raise InvalidArgument("the store has used up its 2**32 segment ids; write new checkpoints in a "
                                      "new store")
            self._next = seg + 1
            self._outstanding.add(seg)
            return seg

    def settled(self, segments) -> None:
        """These segments were committed (or their file removed): no longer outstanding."""
        with self._lock:
            self._outstanding.difference_update(segments)

    def state(self, committing=()) -> dict:
        """{"high": largest id handed out, "pending": ids handed out and not committed by now, except
        ``committing`` (the ones the caller's index transaction commits)}: for meta ``segment_ids``."""
        with self._lock:
            return {"high": self._next - 1, "pending": sorted(self._outstanding - set(committing))}


class SegmentAppender:
    """One appending side of the log. Not thread-safe: one user at a time (the checkpoint writer, or
    compaction, each with an appender and an active segment of its own).

    ``committed`` maps segment id → committed length of the segments this appender appends to, as last
    recorded in the index. Appends go past those lengths; ``sync`` makes them durable and returns the
    new lengths to commit; ``rollback`` throws them away.
    """

    def __init__(self, root: str, committed: dict[int, int], format_version: int, filesystem: fs.FileSystem,
                 ids: SegmentIds | None = None, active: int | None | object = _NEWEST, on_sealed=None,
                 options: Options | None = None):
        """``ids`` defaults to an allocator of its own past ``committed``; ``active`` (the segment appends
        go to first) to the newest committed segment, None meaning a new segment on the first append.
        ``on_sealed(seg)`` is called once the appender will never append to ``seg`` again and its bytes
        are committed (the storage seam's ``sealed`` hook, storage.py). ``options`` (the store's; None:
        ``Options()``): a segment is sealed once it holds ``segment_bytes``; a write hands at most
        ``writev_buffers`` buffers to one writev call."""
        if ids is None:
            ids = SegmentIds(max(committed, default=0) + 1)
        if active is _NEWEST:
            active = max(committed) if committed else None
        options = options if options is not None else Options()
        self.root = root
        self.fs = filesystem
        self.format_version = format_version
        self._segment_bytes = options.segment_bytes
        self._writev_buffers = options.writev_buffers
        self.committed = dict(committed)
        self._sizes = dict(committed)  # current (possibly uncommitted) length of each segment
        self._fds: dict[int, int] = {}  # open fds of segments written since the last sync/rollback
        self._created: set[int] = set()  # segments created since the last sync/rollback
        self._ids = ids
        self.active: int | None = active
        self._committed_active = active  # where appends resume after a rollback
        #: What the appender noticed and worked around (a segment file deleted behind its back).
        self.notes: list[str] = []
        self._on_sealed = on_sealed
        self._retired: set[int] = set()  # segments rolled away from, sealed once their bytes are committed

    def busy(self) -> set[int]:
        """Segments this appender is appending to: GC must leave them alone."""
        return set(self._fds) | ({self.active} if self.active is not None else set())

    def append(self, buffers: list, length: int) -> tuple[int, int]:
        """Append one record (its buffers, ``length`` bytes in all); returns (segment id, offset)."""
        return self.append_many([(buffers, length)])[0]

    def append_many(self, records: list[tuple[list, int]]) -> list[tuple[int, int]]:
        """Append several records, coalescing them into few writes. Returns their (segment, offset).

        On failure nothing is recorded as appended; whatever bytes reached the file lie past every
        committed length and are truncated by ``rollback`` (or by ``recover`` at the next open).
        """
        if not records:
            return []
        seg = self.active
        if seg is not None and not self._present(seg):
            if self._sizes[seg] != self.committed.get(seg):  # this operation's appends went to the lost file
                raise self._lost(seg)
            self._abandon(seg)
            seg = None
        if seg is None or (self._sizes[seg] > SEGMENT_HEADER_BYTES and (
                self._sizes[seg] >= self._segment_bytes or self._sizes[seg] > knobs.MAX_SEGMENT_OFFSET)):
            seg = self._new_segment()
        locations, batch, start = [], [], self._sizes[seg]
        pos = start
        for i, (buffers, length) in enumerate(records):
            if pos > knobs.MAX_SEGMENT_OFFSET and i:  # index entries hold u32 offsets: go on in a new segment
                self._write_batch(seg, batch, start, pos)
                self._new_segment()
                return locations + self.append_many(records[i:])
            locations.append((seg, pos))
            batch.extend(buffers)
            pos += length
        self._write_batch(seg, batch, start, pos)
        return locations

    def _write_batch(self, seg: int, batch: list, start: int, pos: int) -> None:
        fd = self._fd(seg)
        try:
            for i in range(0, len(batch), self._writev_buffers):
                chunk = batch[i : i + self._writev_buffers]
                start += self.fs.pwritev(fd, chunk, start)
        except OSError as exc:
            raise fs.wrap_os_error(exc, f"appending to {filenames.segment_path(self.root, seg)}") from exc
        self._sizes[seg] = pos

    def dirty(self) -> bool:
        return any(self._sizes[s] != self.committed.get(s) for s in self._fds)

    def sync(self) -> dict[int, int]:
        """fsync every segment written since the last sync (and the directory for new ones).

        Returns {segment id: length} of those segments, for the index commit. Does not yet treat
        them as committed: call ``mark_committed`` once the index transaction has committed.
        """
        for seg, fd in list(self._fds.items()):
            if os.fstat(fd).st_nlink == 0:
                raise self._lost(seg)
        try:
            for fd in self._fds.values():
                self.fs.fsync(fd)
            if self._created:
                self.fs.fsync_dir(filenames.segments_dir(self.root))
        except OSError as exc:
            raise fs.wrap_os_error(exc, f"syncing segments of {self.root}") from exc
        for seg, fd in self._fds.items():  # bytes in a file unlinked meanwhile would be lost once committed
            path = filenames.segment_path(self.root, seg)
            if not fs.same_file(fd, path):
                raise CorruptionError(
                    f"segment {path} was deleted or replaced while open for appending; the checkpoint was not "
                    "committed. Close the store and reopen it, then run verify: versions stored in that "
                    "file are lost with it", path, None)
        return {s: self._sizes[s] for s in self._fds}

    def ids_state(self, committing=()) -> dict:
        """The id allocator's ``state`` to record in an index commit (meta ``segment_ids``)."""
        return self._ids.state(committing)

    def mark_committed(self, lengths: dict[int, int]) -> None:
        self.committed.update(lengths)
        self._ids.settled(lengths)
        self._release_fds(keep=self.active)
        self._created.clear()
        self._committed_active = self.active
        self._announce_sealed()

    def _announce_sealed(self) -> None:
        """Tell the storage about segments left behind for good, now that their bytes are committed."""
        retired, self._retired = self._retired - {self.active}, self._retired & {self.active}
        if self._on_sealed is not None:
            for seg in sorted(retired):
                if seg in self.committed:
                    self._on_sealed(seg)

    def rollback(self) -> None:
        """Throw away everything appended since the last commit (truncate; remove new segments)."""
        for seg in list(self._fds):
            path = filenames.segment_path(self.root, seg)
            if not fs.same_file(self._fds[seg], path):
                continue  # the store was moved (StoreMoved): that path is not ours to truncate or remove
            try:
                if seg in self._created and seg not in self.committed:
                    self.fs.close(self._fds.pop(seg))
                    self.fs.remove(path)
                    self._sizes.pop(seg, None)
                    self._ids.settled([seg])
                else:
                    self.fs.truncate(path, self.committed[seg])
                    self._sizes[seg] = self.committed[seg]
            except OSError:
                pass  # the next open truncates or removes what is left: it is past every committed length
        self._created.clear()
        self._release_fds(keep=None)
        self.active = self._committed_active

    def seal(self) -> None:
        """Stop appending to the active segment: the next append starts a new one. With nothing
        uncommitted, the segment's file is closed too, so that it is no longer ``busy``."""
        if self.active is not None:
            self._retired.add(self.active)
        self.active = self._committed_active = None
        if not self.dirty():
            self._release_fds(keep=None)
            self._announce_sealed()

    def forget(self, segments: list[int]) -> None:
        """Stop tracking segments that left the index (freed by GC; never the active one)."""
        for seg in segments:
            self.committed.pop(seg, None)
            self._sizes.pop(seg, None)
            if seg in self._fds:
                self.fs.close(self._fds.pop(seg))

    def close(self) -> None:
        self._release_fds(keep=None)

    def _release_fds(self, keep: int | None) -> None:
        for seg in list(self._fds):
            if seg != keep:
                self.fs.close(self._fds.pop(seg))

    def _fd(self, seg: int) -> int:
        fd = self._fds.get(seg)
        if fd is None:
            path = filenames.segment_path(self.root, seg)
            try:
                fd = self._fds[seg] = self.fs.open_append(path, create=False)
            except OSError as exc:
                err = fs.wrap_os_error(exc, f"opening {path} to append")
                if err is exc:
                    raise  # e.g. FileNotFoundError: the caller decides (_present)
                raise err from exc
        return fd

    # A segment file deleted by hand (or by a tool) must not fail every later checkpoint: appends move on
    # to a new segment. The versions that read the lost one fail their reads with CorruptionError and
    # ``verify`` reports them.
    def _present(self, seg: int) -> bool:
        """Whether segment ``seg``'s file still exists (opening it for appending if it is not open)."""
        fd = self._fds.get(seg)
        if fd is not None:
            return os.fstat(fd).st_nlink > 0  # an open fd of an unlinked file would swallow the appends
        try:
            self._fd(seg)
            return True
        except FileNotFoundError:
            return False

    def _abandon(self, seg: int) -> None:
        """Seal a segment whose file is gone: the next append starts a new segment."""
        if seg in self._fds:
            self.fs.close(self._fds.pop(seg))
        path = filenames.segment_path(self.root, seg)
        note = (f"segment {path} is missing (deleted by hand?): appending to a new segment; versions that "
                "read it are damaged: run `cnrstore verify`, then restore an older version or retain past them")
        self.notes.append(note)
        log.warning(note)
        if self._committed_active == seg:
            self._committed_active = None
        if self.active == seg:
            self.active = None

    def _lost(self, seg: int) -> CorruptionError:
        """The error for appends (not yet committed) that went to a segment file deleted meanwhile."""
        path = filenames.segment_path(self.root, seg)
        self._abandon(seg)
        return CorruptionError(f"segment {path} was deleted while being appended to: this operation is aborted "
                               "and nothing of it was committed; retry it (it goes to a new segment), and run "
                               "`cnrstore verify` to find the committed versions that read the lost segment",
                               path, None)

    def _new_segment(self) -> int:
        if self.active is not None:
            self._retired.add(self.active)  # rolled over: sealed once this operation commits
        seg = self._ids.take()
        path = filenames.segment_path(self.root, seg)
        try:
            self._fds[seg] = self.fs.open_append(path, create=True)
        except OSError as exc:
            raise fs.wrap_os_error(exc, f"creating {path}") from exc
        self._created.add(seg)
        header = segment_header(seg, self.format_version)
        try:
            self.fs.pwritev(self._fds[seg], [header], 0)
        except OSError as exc:
            raise fs.wrap_os_error(exc, f"creating {path}") from exc
        self._sizes[seg] = len(header)
        self.active = seg
        return seg


def leftover_rule(committed, doomed=(), max_deleted: int = 0, ids: dict | None = None):
    """(high, pending): a segment id the index does not know is *provably* the leftover of an uncommitted
    write exactly when it is > high (handed out after the last commit that recorded ids) or in pending
    (handed out, not committed, as of that commit). ``ids`` is meta ``segment_ids`` (absent in stores
    written before it existed: then only ids past every id the index knows count as leftovers)."""
    ids = ids or {}
    high = max([0, *committed, *doomed, max_deleted, ids.get("high", 0)])
    return high, set(ids.get("pending", ()))


def recover(root: str, committed: dict[int, int], filesystem: fs.FileSystem, doomed=(), *,
            max_deleted: int = 0, ids: dict | None = None) -> list[str]:
    """Bring segments/ in line with the index after a crash (writer only, at open).

    Truncates each committed segment to its committed length (a torn tail) and removes segment files the
    index does not know that are provably leftovers of a write that never committed (``leftover_rule``);
    ``doomed`` ones (freed by GC) are left for GC to delete once no reader needs them. Any other unknown
    segment file means the index lost track of data: raises IndexDamaged (naming ``cnrstore repair``)
    before deleting or truncating anything. Returns notes of what it did.
    """
    notes = []
    seg_dir = filenames.segments_dir(root)
    high, pending = leftover_rule(committed, doomed, max_deleted, ids)
    names = sorted(os.listdir(seg_dir))
    for name in names:  # nothing is truncated through a link (out of the store) or removed before this holds
        if filenames.parse_segment_name(name) is not None:
            fs.check_kind(os.path.join(seg_dir, name), "segment", SEGMENT_FIX)
    unknown = [n for n in names if (s := filenames.parse_segment_name(n)) is not None
               and s not in committed and s not in doomed and s <= high and s not in pending]
    if unknown:
        raise IndexDamaged(
            f"segment file(s) {', '.join(unknown[:5])} in {seg_dir} hold data the index of "
            f"{os.path.dirname(seg_dir)} does not know about (the index is damaged or was replaced); "
            f"nothing was deleted. Run `cnrstore repair {os.path.dirname(seg_dir)}` to rebuild the index "
            "from the segment log", os.path.join(seg_dir, unknown[0]), None)
    for name in names:
        seg = filenames.parse_segment_name(name)
        path = os.path.join(seg_dir, name)
        if seg is None or seg in doomed:
            continue
        if seg not in committed:
            filesystem.remove(path)
            notes.append(f"removed uncommitted segment {name}")
            continue
        size = os.path.getsize(path)
        if size > committed[seg]:
            filesystem.truncate(path, committed[seg])
            notes.append(f"truncated torn tail of {name}: {size - committed[seg]} bytes")
    if notes:
        filesystem.fsync_dir(seg_dir)
    return notes



def _map_whole(fd: int, need: int, path: str) -> mmap.mmap:
    """Map the whole open segment file read-only; it must hold at least ``need`` bytes.

    The writer may truncate an uncommitted tail (``rollback``) between this reader's ``fstat`` and its
    ``mmap``, which then fails with ValueError; the size is read again and the map retried. Only a file
    shorter than the committed bytes the index needs is an error (CorruptionError)."""
    while True:
        size = os.fstat(fd).st_size
        if size < need:
            raise CorruptionError(f"segment {path} holds {size} bytes but the index needs {need}", path, size)
        try:
            return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        except ValueError:
            if os.fstat(fd).st_size >= size:
                raise  # not a concurrent truncation


def _joined(ranges) -> list[tuple[int, int, int]]:
    """(segment, start, end) of ``ranges`` (``(segment, offset, length)`` each) sorted, the overlapping or
    adjacent ones joined."""
    out: list[list[int]] = []
    for seg, offset, length in sorted((r[0], r[1], r[2]) for r in ranges):
        if out and out[-1][0] == seg and offset <= out[-1][2]:
            out[-1][2] = max(out[-1][2], offset + length)
        else:
            out.append([seg, offset, offset + length])
    return [(seg, start, end) for seg, start, end in out]


class SegmentReader:
    """Thread-safe mmap access to segment bytes. Mappings grow as segments do."""

    def __init__(self, root: str, release_bytes: int | None | object = _OMITTED):
        """``release_bytes``: drop the mapped pages after this many bytes read (None: never; omitted:
        ``Options().mapped_read_release_bytes``). Settable: a storage hands on its store's (``use_options``)."""
        self.root = root
        self.release_bytes = Options().mapped_read_release_bytes if release_bytes is _OMITTED else release_bytes
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()
        self._read_since_release = 0  # bytes read since the mapped pages were last dropped
        self._keeping = 0  # keep_pages() in progress: no drop until they end
        self._done: list = []  # (segment, offset, length) a read is done with, not dropped yet (release)
        self._done_bytes = 0
        # segments are opened relative to the directory as it was at open: a store renamed while open
        # goes on reading its own files, never those of whatever the old path names now
        try:
            self._dir_fd: int | None = os.open(filenames.segments_dir(root), os.O_RDONLY | os.O_DIRECTORY |
                                               os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            self._dir_fd = None  # (missing or unreadable: each read then names the problem)

    def read(self, seg: int, offset: int, length: int) -> np.ndarray:
        """A read-only uint8 view of ``length`` bytes at ``offset`` of segment ``seg``.

        Raises CorruptionError if the segment is missing or shorter than that.
        """
        entry = self._maps.get(seg)
        if entry is None or offset + length > entry[1].shape[0]:
            entry = self._map(seg, offset + length)
        bound = self.release_bytes
        if bound is not None:
            self._read_since_release += length
            if self._read_since_release > bound and not self._keeping:
                self.release_pages()
        return entry[1][offset : offset + length]

    @contextlib.contextmanager
    def keep_pages(self):
        """Within it, reads drop no mapped pages by their count (a whole-table read verifies each block's
        records, then decodes them: a drop in between would fault pages of blocks in hand in again); the read
        drops what it is done with itself (``release``), and everything is dropped at its end."""
        with self._lock:
            self._keeping += 1
        try:
            yield
        finally:
            with self._lock:
                self._keeping -= 1
            if self.release_bytes is not None:
                self.release_pages()

    def release(self, ranges) -> None:
        """A read is done with these bytes it read (``(segment, offset, length)`` each: range_fetch.ByteRange,
        a record): once such bytes add up to more than ``release_bytes`` since the last drop, the pages wholly
        inside them (contiguous ranges joined) leave this process's resident set (``madvise(MADV_DONTNEED)``
        on those pages of the mapping only: a page that also holds bytes not released stays). Nothing with
        ``release_bytes`` None. The bytes stay readable: a view still in use faults them back in from the
        page cache."""
        if self.release_bytes is None:
            return
        ranges = list(ranges)
        with self._lock:
            self._done += ranges
            self._done_bytes += sum(r[2] for r in ranges)
            if self._done_bytes <= self.release_bytes:
                return
            done, self._done, self._done_bytes = self._done, [], 0
            maps = {seg: self._maps.get(seg) for seg in {r[0] for r in done}}
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None:
            return
        page = mmap.PAGESIZE
        for seg, start, end in _joined(done):
            entry = maps.get(seg)
            if entry is None:
                continue  # (not mapped here: served from elsewhere, such as a remote fetch)
            first, stop = -(-start // page) * page, min(end, entry[1].shape[0]) // page * page
            if stop > first:
                try:
                    entry[0].madvise(advice, first, stop - first)
                except (ValueError, OSError):  # (closed meanwhile, or a platform that refuses: a cost, not a fault)
                    pass

    def release_pages(self) -> None:
        """Drop the pages reads have touched from this process's resident set (``madvise(MADV_DONTNEED)`` on
        every mapping): they stay in the page cache, and a view still in use faults them back in (the files'
        bytes are unchanged: the mappings are read-only and segments are append-only)."""
        self._read_since_release = 0
        with self._lock:
            self._done, self._done_bytes = [], 0
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None:
            return
        for mm, _view in list(self._maps.values()):
            try:
                mm.madvise(advice)
            except (ValueError, OSError):  # (closed meanwhile, or a platform that refuses: a cost, not a fault)
                pass

    def path(self, seg: int) -> str:
        path = self._paths.get(seg)
        if path is None:
            path = self._paths[seg] = filenames.segment_path(self.root, seg)
        return path

    def _map(self, seg: int, need: int):
        path = filenames.segment_path(self.root, seg)
        with self._lock:
            entry = self._maps.get(seg)
            if entry is not None and need <= entry[1].shape[0]:
                return entry
            try:
                # a regular file only (fs.open_regular): a FIFO would block here, a device or a link map
                # what is not the store's
                opened = fs.open_regular(path, "segment", SEGMENT_FIX, dir_fd=self._dir_fd,
                                         name=os.path.basename(path))
                with open(opened, "rb") as f:
                    mm = _map_whole(f.fileno(), need, path)
            except FileNotFoundError:
                raise CorruptionError(f"segment {path} is missing (deleted?): the versions that read it are damaged; "
                                      "run `cnrstore verify` to list them and read or restore another version",
                                      path, None) from None
            except PermissionError as exc:
                raise fs.permission_denied(exc, f"cannot read segment {path}", path, needs="read",
                                           writing=False) from None
            view = np.frombuffer(mm, dtype=np.uint8)
            if entry is None:
                check_segment_header(view, seg, path)
            # an older mapping stays alive while views of it exist; it is closed when they are gone
            self._maps[seg] = (mm, view)
            return self._maps[seg]

    def forget(self, seg: int) -> None:
        with self._lock:
            self._maps.pop(seg, None)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
            dir_fd, self._dir_fd = self._dir_fd, None
        if dir_fd is not None:
            os.close(dir_fd)
        for mm, _view in maps.values():
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping is closed when it is collected
