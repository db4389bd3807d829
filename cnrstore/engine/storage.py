"""The segment storage seam: where segments are appended, read, measured, listed, recovered and removed.

The engine, GC and repair touch segments only through a ``SegmentStorage`` (leveldb's ``Env``,
torchsnapshot's ``StoragePlugin``, zarr v3's ``abc/store.py``), so that another store for segments can be
added without touching them; tests/test_engine.py proves it with an audit hook that sees every file
access. ``LocalSegmentStorage`` is today's: files under ``<store>/segments/``, read through mmap
(segments.SegmentReader), appended, truncated, renamed and removed through the file-system seam
(cnrstore/engine/fs.py), so that the crash-state explorer sees every effect.

What a storage can do is stated by a capability flag (``supports_appends``): a writable open refuses a
storage without it, which never hands out an appender. An appender (``appender``) calls
``sealed(seg)`` once it will never append to ``seg`` again (it rolled over to a new segment, or GC sealed
it): the hook where the remote tier (engine/remote.py, ``RemoteSegmentStorage``) uploads the now
immutable file, whose reads it may later serve from the object store, and where a local one has nothing
to do. Copy points (what keeps a remote copy current) are not this seam's: the engine drives them through
a ``Replicator`` (replication.py). tests/support/storage_conformance.py runs the same contract tests
against every implementation.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import mmap
import os
import stat
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from .. import errors
from . import filenames, fs, record
from .index import RowLoc
from .range_fetch import ByteRange
from ..options import Options
from .segments import SEGMENT_FIX, SegmentAppender, SegmentIds, SegmentReader, recover

#: suffix repair gives a segment whose header is damaged (kept as evidence, never read or reused)
QUARANTINE_SUFFIX = ".damaged"


class Expect(NamedTuple):
    """What the index entry that led to a record says of it (None: not checked)."""

    kind: int
    object_id: int | None = None
    version: int | None = None
    block: int | None = None


def mismatch(rec: record.Record, loc, expect: Expect) -> str | None:
    """Why ``rec`` (read at index location ``loc``) is not the record ``expect`` names, or None if it is:
    its kind, object, version and block, and for a row entry (``index.RowLoc``) its row count, flags and
    delta base too."""
    if (rec.kind != expect.kind or (expect.object_id is not None and rec.object_id != expect.object_id)
            or (expect.version is not None and rec.version != expect.version)
            or (expect.block is not None and rec.block != expect.block)):
        return "record does not match its index entry (kind, object, block or version)"
    if isinstance(loc, RowLoc) and (rec.count != loc.count or rec.flags != loc.flags or rec.base() != loc.base):
        return "record row count, flags or delta base disagree with the index"
    return None


def fetch(storage: "SegmentStorage", loc, expect: Expect | None = None) -> record.Record:
    """The checksum-verified record at ``loc`` (an index location), read through ``storage``: the one
    place beneath reads, merges, verify and compaction where a record is fetched and checked against its
    index entry. With ``expect`` it must be the record that entry names (``mismatch``). Raises
    CorruptionError (naming the place) for damage or a mismatch."""
    path = storage.path(loc.segment)
    rec = record.parse(storage.read(loc.segment, loc.offset, loc.length), path, loc.offset)
    why = mismatch(rec, loc, expect) if expect is not None else None
    if why is not None:
        raise errors.CorruptionError(f"record at {path}:{loc.offset} is not the one the index names: {why}",
                                     path, loc.offset)
    return rec


class SegmentStorage(abc.ABC):
    """What the engine needs of the place segments live. Implementations must be thread-safe for reads."""

    #: hands out appenders (``appender``): a writable open refuses a storage without it (ReadOnlyError)
    supports_appends: bool = False
    #: ``remove`` + ``sync_removals`` make the segment gone at once (``size`` None, not in ``list``, a second
    #: ``remove`` FileNotFoundError). False: a copy kept elsewhere (the remote tier's object) stays, and is
    #: still served, until a later copy point no longer needs it; only the local copy goes at once.
    removes_at_once: bool = True

    @abc.abstractmethod
    def read(self, seg: int, offset: int, length: int) -> np.ndarray:
        """A read-only uint8 view of ``length`` bytes at ``offset`` of segment ``seg`` (CorruptionError if
        the segment is missing or shorter)."""

    @abc.abstractmethod
    def path(self, seg: int) -> str:
        """Where segment ``seg`` lives, for messages (a path, or a URL)."""

    def use_options(self, options: Options) -> None:
        """The store's options (cnrstore.Options), given by the engine as it opens, before any append: the
        local storage's appenders roll segments at ``options.segment_bytes`` and its reads drop their mapped
        pages past ``options.mapped_read_release_bytes``. Default: nothing to configure."""

    def release_pages(self) -> None:
        """Drop from this process's resident set the pages reads have mapped (past the store's
        ``Options.mapped_read_release_bytes``); the bytes stay readable. Default: nothing to drop."""

    def keep_pages(self):
        """A context within which reads drop no mapped pages by their count, and which drops them all at its
        end (a whole-table read, which says what it is done with: ``release``). Default: nothing to keep."""
        return contextlib.nullcontext()

    def release(self, ranges: Sequence[ByteRange]) -> None:
        """A read is done with ``ranges`` (range_fetch.ByteRange: records it read, verified or decoded): their
        pages may leave this process's resident set (past the store's ``Options.mapped_read_release_bytes`` of
        such bytes); the bytes stay readable. Default: nothing to drop."""

    def prefetch(self, ranges: Sequence[ByteRange], *, bounded: bool):
        """A context within which this thread's reads of ``ranges`` (range_fetch.ByteRange: the records a
        read is about to fetch, in the order it will fetch them) may be served from bytes fetched ahead of
        it, concurrently. ``read`` keeps its contract inside (the same bytes, or CorruptionError), and a read
        of anything else is a plain read. ``bounded``: the reader lets go of each record once it has used
        it, so the storage may bound the bytes it holds ahead (a remote storage: the store's
        ``Options.remote_read_window_bytes``); else it may hold every range until the context ends. An error
        fetching a range is raised by the read that needs it, as that read would raise it; leaving the
        context stops every fetch. Default: nothing to fetch ahead (the segments are local)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def size(self, seg: int) -> int | None:
        """Bytes of segment ``seg`` as stored, or None if it does not exist."""

    @abc.abstractmethod
    def list(self) -> list[int]:
        """Ids of every segment stored, ascending."""

    @abc.abstractmethod
    def remove(self, seg: int) -> None:
        """Delete segment ``seg`` (GC freed it and no reader can need it any more). FileNotFoundError if
        it is already gone. Durable once ``sync_removals`` returns (see ``removes_at_once``)."""

    def sync_removals(self) -> None:
        """Make the removals so far durable."""

    def disk_bytes(self) -> int:
        """Bytes the segments occupy on this machine's disk (allocated, where the storage knows; else their
        sizes): what ``Store.stats()["bytes_on_disk"]`` counts. A storage with a remote side counts its local
        copies only; at least the sizes of the segments stored locally."""
        return sum(self.size(seg) or 0 for seg in self.list())

    def appender(self, committed: dict[int, int], format_version: int, ids: SegmentIds, *,
                 active=None, resume: bool = False, on_sealed=None) -> SegmentAppender:
        """An appender of segments here (segments.SegmentAppender): ``committed`` maps segment → committed
        length; with ``resume`` appends go on in the newest committed segment, else in ``active`` (None:
        a new segment on the first append)."""
        raise errors.ReadOnlyError(f"{type(self).__name__} takes no appends: open the store readonly=True")

    def recover(self, committed: dict[int, int], doomed=(), *, max_deleted: int = 0, ids=None) -> list[str]:
        """Bring the stored segments in line with the index after a crash (writer only, at open): see
        segments.recover. Returns notes of what it did."""
        return []

    def check_writable(self, what: str) -> None:
        """PermissionDenied (saying ``what`` was being done) unless appends and removals can succeed."""

    @contextlib.contextmanager
    def scan(self, seg: int) -> Iterator[bytes]:
        """The whole stored segment (repair scans it record by record): a bytes-like object with ``find``.
        The local storage maps it unchecked; this default goes through ``read``, which may check the
        segment's header. CorruptionError if it cannot be read."""
        size = self.size(seg)
        yield b"" if not size else bytes(self.read(seg, 0, size))

    def unreadable(self, seg: int) -> str | None:
        """Why segment ``seg``, though listed, cannot be read at all ("is a FIFO, not a regular file"), or
        None (it can be tried: reads and ``scan`` say what is wrong, if anything)."""
        return None

    def quarantine(self, seg: int) -> str:
        """Move segment ``seg`` (its header is damaged) out of the store's way, kept as evidence; returns
        where it went. Its id is never reused (``quarantined``)."""
        raise errors.ReadOnlyError(f"{type(self).__name__} cannot set a damaged segment aside")

    def quarantined(self) -> list[int]:
        """Ids of the segments ``quarantine`` set aside."""
        return []

    def sealed(self, seg: int) -> None:
        """Segment ``seg`` will never be appended to again (its committed bytes are final)."""

    def segment_ids_from(self, high: int) -> int:
        """The first segment id the engine may hand out, ``high`` being the largest its index used (a
        remote writer that took a prefix over starts past the ids the writers before it used)."""
        return high + 1

    def forget(self, seg: int) -> None:
        """Drop what is cached of segment ``seg`` (it left the index)."""

    def close(self) -> None:
        """Release every resource (mappings, handles)."""


class LocalSegmentStorage(SegmentStorage):
    """Segment files under ``<root>/segments/``, read through mmap, written through ``filesystem``."""

    supports_appends = True

    def __init__(self, root: str, filesystem: fs.FileSystem = fs.DEFAULT):
        """CorruptionError if ``<root>/segments`` is there but is not a directory of its own (a symbolic
        link: the store would read and write another directory's files; a file)."""
        self.root = root
        self.fs = filesystem
        self.check_directory(root)
        self._options = Options()  # until the engine gives its own (use_options)
        self._reader = SegmentReader(root, self._options.mapped_read_release_bytes)

    @staticmethod
    def check_directory(root: str) -> None:
        """CorruptionError if ``<root>/segments`` is there but is not a directory of its own: a symbolic link
        (never followed: the store would read, and its writer write, another directory's files), a FIFO, a
        file. A missing one passes (its callers say what that means)."""
        fs.check_kind(filenames.segments_dir(root), "the segments directory",
                      "a store's segments/ is a directory inside it: restore it from a copy", directory=True)

    @staticmethod
    def create(root: str, filesystem: fs.FileSystem = fs.DEFAULT) -> None:
        """Make ``<root>/segments/`` for a new store (nothing if it exists: a creation is retried)."""
        if not os.path.isdir(filenames.segments_dir(root)):
            filesystem.mkdir(filenames.segments_dir(root))

    def use_options(self, options: Options) -> None:
        self._options = options
        self._reader.release_bytes = options.mapped_read_release_bytes

    def read(self, seg: int, offset: int, length: int) -> np.ndarray:
        return self._reader.read(seg, offset, length)

    def release_pages(self) -> None:
        self._reader.release_pages()

    def keep_pages(self):
        return self._reader.keep_pages()

    def release(self, ranges: Sequence[ByteRange]) -> None:
        self._reader.release(ranges)

    def path(self, seg: int) -> str:
        return self._reader.path(seg)

    def size(self, seg: int) -> int | None:
        """(A segment file that is not a regular file -- a link, a FIFO, a device -- holds 0 bytes the
        store reads: its reads raise CorruptionError saying what it is.)"""
        try:
            st = os.lstat(filenames.segment_path(self.root, seg))
        except FileNotFoundError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    def list(self) -> list[int]:
        ids = (filenames.parse_segment_name(n) for n in os.listdir(filenames.segments_dir(self.root)))
        return sorted(s for s in ids if s is not None)

    def remove(self, seg: int) -> None:
        self._reader.forget(seg)
        self.fs.remove(filenames.segment_path(self.root, seg))

    def sync_removals(self) -> None:
        self.fs.fsync_dir(filenames.segments_dir(self.root))

    def disk_bytes(self) -> int:
        """Blocks allocated to every file in segments/ (set-aside damaged ones too)."""
        return fs.allocated_bytes(filenames.segments_dir(self.root))

    def appender(self, committed: dict[int, int], format_version: int, ids: SegmentIds, *,
                 active=None, resume: bool = False, on_sealed=None) -> SegmentAppender:
        if resume:
            active = max(committed) if committed else None
        return SegmentAppender(self.root, committed, format_version, self.fs, ids, active=active, on_sealed=on_sealed,
                               options=self._options)

    def recover(self, committed: dict[int, int], doomed=(), *, max_deleted: int = 0, ids=None) -> list[str]:
        return recover(self.root, committed, self.fs, doomed, max_deleted=max_deleted, ids=ids)

    def check_writable(self, what: str) -> None:
        seg_dir = filenames.segments_dir(self.root)
        needs = [(seg_dir, os.W_OK | os.X_OK, "write and search (-wx)")]
        try:
            names = sorted(os.listdir(seg_dir))
        except FileNotFoundError:
            raise errors.CorruptionError(
                f"the segments directory {seg_dir} of store {self.root!r} is missing: the data of every version "
                "that wrote to it is gone. Restore the directory from a copy; `cnrstore verify` lists what is "
                "lost", seg_dir, None) from None
        except PermissionError as exc:
            raise fs.permission_denied(exc, what, seg_dir, needs="read, write and search (rwx)") from None
        needs += [(os.path.join(seg_dir, n), os.R_OK | os.W_OK, "read and write") for n in names
                  if filenames.parse_segment_name(n) is not None]
        for path, mode, need in needs:
            if not os.access(path, mode):
                try:
                    code = errno.EROFS if os.statvfs(path).f_flag & os.ST_RDONLY else errno.EACCES
                except OSError:
                    code = errno.EACCES
                raise fs.permission_denied(OSError(code, os.strerror(code)), what, path, needs=need)

    @contextlib.contextmanager
    def scan(self, seg: int) -> Iterator[bytes]:
        path = filenames.segment_path(self.root, seg)
        with open(fs.open_regular(path, "segment", SEGMENT_FIX), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                yield b""
                return
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        try:
            yield mm
        finally:
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping is closed when it is collected

    def unreadable(self, seg: int) -> str | None:
        try:
            mode = os.lstat(filenames.segment_path(self.root, seg)).st_mode
        except FileNotFoundError:
            return None
        return None if stat.S_ISREG(mode) else f"is {fs.file_kind(mode)}, not a regular file"

    def quarantine(self, seg: int) -> str:
        path = filenames.segment_path(self.root, seg)
        self._reader.forget(seg)
        self.fs.rename(path, path + QUARANTINE_SUFFIX)
        return path + QUARANTINE_SUFFIX

    def quarantined(self) -> list[int]:
        out = []
        for name in os.listdir(filenames.segments_dir(self.root)):
            if name.endswith(QUARANTINE_SUFFIX):
                seg = filenames.parse_segment_name(name[: -len(QUARANTINE_SUFFIX)])
                if seg is not None:
                    out.append(seg)
        return sorted(out)

    def forget(self, seg: int) -> None:
        self._reader.forget(seg)

    def close(self) -> None:
        self._reader.close()
