"""``RecordingStorage``: a ``SegmentStorage`` (cnrstore/engine/storage.py) that delegates every method of the
seam to another storage and records each call (name, args), so that a test can show what the engine asked of
its storage, and nothing else: an attribute that is not the seam's is recorded as ``("<not in the seam>",
name)`` and raises AttributeError. ``appends=False`` makes it a storage without appends (the ABC's
``appender``: ReadOnlyError), delegating everything else."""

from __future__ import annotations

import threading

from cnrstore.engine.storage import SegmentStorage

#: every public attribute of the seam (methods and the capability flag)
SEAM = frozenset(name for name in vars(SegmentStorage) if not name.startswith("_"))
#: what ``calls`` records for an attribute the seam does not have
NOT_IN_SEAM = "<not in the seam>"


class RecordingStorage(SegmentStorage):
    """``inner``'s segments, through the seam only; ``calls``: [(name, args, kwargs)] in the order made."""

    def __init__(self, inner: SegmentStorage, *, appends: bool | None = None):
        self.inner = inner
        self.supports_appends = inner.supports_appends if appends is None else appends
        self.removes_at_once = inner.removes_at_once
        self.calls: list[tuple] = []
        self._calls_lock = threading.Lock()

    def names(self) -> set[str]:
        """Names of the methods called so far."""
        with self._calls_lock:
            return {c[0] for c in self.calls}

    def _call(self, name, *args, **kwargs):
        with self._calls_lock:
            self.calls.append((name, args, kwargs))
        return getattr(self.inner, name)(*args, **kwargs)

    def __getattr__(self, name):  # (only for attributes not found otherwise: never the seam's)
        if not name.startswith("__"):
            with self.__dict__["_calls_lock"]:
                self.__dict__["calls"].append((NOT_IN_SEAM, (name,), {}))
        raise AttributeError(f"{type(self).__name__} has no {name!r}: it is not part of the storage seam")

    # the abstract methods
    def read(self, seg, offset, length):
        return self._call("read", seg, offset, length)

    def path(self, seg):
        return self._call("path", seg)

    def size(self, seg):
        return self._call("size", seg)

    def list(self):
        return self._call("list")

    def remove(self, seg):
        return self._call("remove", seg)

    # the rest of the seam
    def release_pages(self):
        return self._call("release_pages")

    def keep_pages(self):
        return self._call("keep_pages")

    def release(self, ranges):
        return self._call("release", ranges)

    def prefetch(self, ranges, *, bounded):
        return self._call("prefetch", ranges, bounded=bounded)

    def sync_removals(self):
        return self._call("sync_removals")

    def disk_bytes(self):
        return self._call("disk_bytes")

    def appender(self, committed, format_version, ids, **kwargs):
        if not self.supports_appends:
            with self._calls_lock:
                self.calls.append(("appender", (committed, format_version, ids), kwargs))
            return SegmentStorage.appender(self, committed, format_version, ids, **kwargs)  # ReadOnlyError
        return self._call("appender", committed, format_version, ids, **kwargs)

    def recover(self, committed, doomed=(), **kwargs):
        return self._call("recover", committed, doomed, **kwargs)

    def check_writable(self, what):
        return self._call("check_writable", what)

    def scan(self, seg):
        return self._call("scan", seg)

    def unreadable(self, seg):
        return self._call("unreadable", seg)

    def quarantine(self, seg):
        return self._call("quarantine", seg)

    def quarantined(self):
        return self._call("quarantined")

    def sealed(self, seg):
        return self._call("sealed", seg)

    def segment_ids_from(self, high):
        return self._call("segment_ids_from", high)

    def use_options(self, options):
        return self._call("use_options", options)

    def forget(self, seg):
        return self._call("forget", seg)

    def close(self):
        return self._call("close")
