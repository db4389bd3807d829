"""The store's marker file (``CNRSTORE``): a store exists exactly when its marker does, and the marker
records the store's format version (docs/FORMAT.md).

Beneath store.py and repair.py, which both read it (so that repair need not import the Store).
"""

from __future__ import annotations

import struct
import time

import msgpack
import xxhash

from . import filenames, fs
from ..errors import CorruptionError

#: On disk: the format this code writes and the newest it reads. Bump on any incompatible change.
#: 2: COMMIT / ANCHOR / DROP records and the index's ``log`` database (repair). Format 1 is still read;
#: a writable open upgrades its marker (docs/FORMAT.md).
#: 3: cumulative delta records (record.FLAG_DELTA, index ROW_LOC_DELTA). Formats 1 and 2 are still read.
#: 4: keyed tables (record.FLAG_KEYS key runs; "keyed" and "columns" catalog fields). Formats 1-3 are still read.
FORMAT_VERSION = 4
MARKER_MAGIC = b"CNRSTORE"
_MARKER_HEAD = struct.Struct("<8sII")  # magic, format version, msgpack length
#: A marker is about 60 bytes; a file larger than this is not one (it is never read past this).
MAX_MARKER_BYTES = 64 << 10
#: What to do about a marker that is not a regular file.
MARKER_FIX = ("a store's files are regular files: restore it from a copy, or remove it and open the store with "
              "create=True, which writes a new marker and keeps the store's files")


def marker_bytes() -> bytes:
    """The marker of a store of format ``FORMAT_VERSION`` created now."""
    payload = msgpack.packb({"format_version": FORMAT_VERSION, "created": time.time()})
    head = _MARKER_HEAD.pack(MARKER_MAGIC, FORMAT_VERSION, len(payload)) + payload
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def read_marker(root: str) -> int:
    """Format version recorded in the store's marker file (verified).

    CorruptionError if the marker is damaged, larger than ``MAX_MARKER_BYTES``, or not a regular file (a
    symbolic link, a FIFO, a device, a directory: ``fs.read_regular``); FileNotFoundError and
    PermissionError propagate (the caller's StoreNotFound and PermissionDenied)."""
    path = filenames.marker_path(root)
    data = fs.read_regular(path, MAX_MARKER_BYTES, "store marker", MARKER_FIX)
    if len(data) < _MARKER_HEAD.size + 8:
        raise CorruptionError(f"store marker {path} is truncated", path, 0)
    magic, fmt, n = _MARKER_HEAD.unpack_from(data)
    body = data[: _MARKER_HEAD.size + n]
    if magic != MARKER_MAGIC or len(data) != len(body) + 8 or \
            struct.unpack_from("<Q", data, len(body))[0] != xxhash.xxh3_64_intdigest(body):
        raise CorruptionError(f"store marker {path} is corrupt", path, 0)
    return fmt
