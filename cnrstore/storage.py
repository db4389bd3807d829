"""The segment storage seam: where sealed and active segment files are read, measured, listed and removed.

The engine reads segment bytes, sizes them, lists them and removes freed ones only through a
``SegmentStorage`` (leveldb's ``Env``, torchsnapshot's ``StoragePlugin``), so that another store for
segments can be added without touching the engine. ``LocalSegmentStorage`` is today's: files under
``<store>/segments/``, read through mmap (segments.SegmentReader), removed through the file-system seam
(cnrstore/fs.py).

Appending stays local: the checkpoint writer and compaction append to local files (SegmentAppender) and
fsync them before each commit. An appender calls ``sealed(seg)`` once it will never append to ``seg``
again (it rolled over to a new segment, or GC sealed it): the hook where a remote implementation would
upload the now immutable file (and could later serve reads of it from the object store), and where a
local one has nothing to do. Crash recovery (segments.recover) works on the local directory.
"""

from __future__ import annotations

import os

import numpy as np

from . import filenames, fs
from .segments import SegmentReader


class SegmentStorage:
    """What the engine needs of the place segments live. Implementations must be thread-safe for reads."""

    def read(self, seg: int, offset: int, length: int) -> np.ndarray:
        """A read-only uint8 view of ``length`` bytes at ``offset`` of segment ``seg`` (CorruptionError if
        the segment is missing or shorter)."""
        raise NotImplementedError

    def path(self, seg: int) -> str:
        """Where segment ``seg`` lives, for messages (a path, or a URL)."""
        raise NotImplementedError

    def size(self, seg: int) -> int | None:
        """Bytes of segment ``seg`` as stored, or None if it does not exist."""
        raise NotImplementedError

    def list(self) -> list[int]:
        """Ids of every segment stored, ascending."""
        raise NotImplementedError

    def remove(self, seg: int) -> None:
        """Delete segment ``seg`` (GC freed it and no reader can need it any more). FileNotFoundError if
        it is already gone."""
        raise NotImplementedError

    def sealed(self, seg: int) -> None:
        """Segment ``seg`` will never be appended to again (its committed bytes are final)."""

    def forget(self, seg: int) -> None:
        """Drop what is cached of segment ``seg`` (it left the index)."""

    def close(self) -> None:
        """Release every resource (mappings, handles)."""


class LocalSegmentStorage(SegmentStorage):
    """Segment files under ``<root>/segments/``, read through mmap, removed through ``filesystem``."""

    def __init__(self, root: str, filesystem: fs.FileSystem = fs.DEFAULT):
        self.root = root
        self.fs = filesystem
        self._reader = SegmentReader(root)

    def read(self, seg: int, offset: int, length: int) -> np.ndarray:
        return self._reader.read(seg, offset, length)

    def path(self, seg: int) -> str:
        return self._reader.path(seg)

    def size(self, seg: int) -> int | None:
        try:
            return os.path.getsize(filenames.segment_path(self.root, seg))
        except FileNotFoundError:
            return None

    def list(self) -> list[int]:
        ids = (filenames.parse_segment_name(n) for n in os.listdir(filenames.segments_dir(self.root)))
        return sorted(s for s in ids if s is not None)

    def remove(self, seg: int) -> None:
        self._reader.forget(seg)
        self.fs.remove(filenames.segment_path(self.root, seg))

    def forget(self, seg: int) -> None:
        self._reader.forget(seg)

    def close(self) -> None:
        self._reader.close()
