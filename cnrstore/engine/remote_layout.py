"""What the remote tier writes besides segments and snapshots, as bytes: the pointer ``CURRENT``, the
writers' history it carries, and the local ``REMOTE`` identity file (docs/FORMAT.md, "Remote layout").
Every field is checked where it is decoded: a damaged or crafted file is a CorruptionError naming the
field and the fix, never a KeyError or TypeError (docs/DESIGN.md, "Security").

**Writers.** Each writer of a prefix puts its objects in a folder of its own, ``w/<store id>/``, so that
no two writers ever write one object: a stale writer can only add objects nobody reads. Segment ids are
allocated by each store from its index, so a writer that took the prefix over allocates from where its
snapshot left off; ``Writers`` is the history that says, for a segment id, whose folder holds it: writer
``i`` wrote the ids from ``first[i]`` up to ``first[i+1]``. A takeover appends an entry starting past
every id of the snapshot it took over from, so an id that any snapshot names always resolves to the
same folder, in every later history.
"""

from __future__ import annotations

import json
import math
import time
from typing import NamedTuple

import xxhash

from . import filenames
from ..errors import CorruptionError

#: On remote storage: the pointer's format. 1: one writer's objects at the prefix's root (read, never
#: written); 2: writers' folders and their history. Never reuse a number.
POINTER_FORMAT = 2
#: On local disk: the REMOTE file's format (1: {"url", "store_id", "after"}, read, never written).
IDENTITY_FORMAT = 2
#: Roles of a local directory with a remote tier (REMOTE's "role").
WRITER, CACHE = "writer", "cache"
#: Bounds on what a pointer or REMOTE file may claim (checked before anything is built from them)
MAX_WRITERS = 1 << 16
MAX_BYTES = 16 << 20  # of a pointer or REMOTE file
_U63 = (1 << 63) - 1
_U32 = (1 << 32) - 1


def _damaged(where: str, what: str, fix: str) -> CorruptionError:
    return CorruptionError(f"{where} is damaged: {what}; {fix}", where, 0)


def _load(data: bytes, where: str, fix: str, what: str):
    """``data`` as JSON, at most MAX_BYTES of it (CorruptionError otherwise)."""
    if len(data) > MAX_BYTES:
        raise _damaged(where, f"it is {len(data)} bytes, more than a {what}'s {MAX_BYTES}", fix)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _damaged(where, f"it is not JSON ({exc})", fix) from None


def _field(body: dict, name: str, check, want: str, where: str, fix: str):
    """``body[name]`` if ``check`` accepts it, else CorruptionError saying what it should be."""
    value = body.get(name)
    if not check(value):
        raise _damaged(where, f"its field {name!r} is {value!r}, not {want}", fix)
    return value


def _checksummed(body: dict) -> bytes:
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"pointer": body, "xxh3": f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"},
                      sort_keys=True).encode() + b"\n"


# -- writers ------------------------------------------------------------------------------------------------

class Writers(tuple):
    """The writers' history of a prefix: ``((folder writer id, first segment id), ...)``, first ids strictly
    increasing from 0; the folder "" is a pointer-format-1 prefix's root."""

    def __new__(cls, entries=()):
        return super().__new__(cls, tuple((str(w), int(f)) for w, f in entries))

    def writer_of(self, seg: int) -> str:
        """The writer whose folder holds segment ``seg``."""
        owner = self[0][0]
        for writer, first in self:
            if first > seg:
                break
            owner = writer
        return owner

    def segment_key(self, seg: int) -> str:
        return filenames.remote_segment_key(seg, filenames.remote_folder(self.writer_of(seg)))

    def writers(self) -> list[str]:
        return [w for w, _ in self]

    def then(self, writer: str, first: int) -> "Writers":
        """This history with ``writer`` writing the ids from ``first`` on (a takeover: ``first`` is past
        every id the snapshot it took over from names, and past every range already given out)."""
        if self and first <= self[-1][1]:
            raise ValueError(f"writer {writer} cannot start at segment {first}: {self[-1][0]!r} starts at {self[-1][1]}")
        return Writers([*self, (writer, first)])

    def to_json(self) -> list:
        return [[w, f] for w, f in self]

    @classmethod
    def check(cls, value, where: str, fix: str) -> "Writers":
        if not isinstance(value, list) or not value or len(value) > MAX_WRITERS:
            raise _damaged(where, f"its writers' history is {type(value).__name__}, not a list of 1 to "
                                  f"{MAX_WRITERS} [writer, first segment] pairs", fix)
        last = -1
        for entry in value:
            if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                    or not (entry[0] == "" or filenames.is_writer_id(entry[0]))
                    or isinstance(entry[1], bool) or not isinstance(entry[1], int) or not last < entry[1] <= _U32):
                raise _damaged(where, f"its writers' history has the entry {entry!r} (a writer id of 32 hex digits "
                                      "and the first segment id it wrote, increasing)", fix)
            last = entry[1]
        if value[0][1] != 0:
            raise _damaged(where, "its writers' history does not start at segment 0", fix)
        return cls(value)


LEGACY_WRITERS = Writers([("", 0)])


# -- the pointer --------------------------------------------------------------------------------------------

class Pointer(NamedTuple):
    """A decoded pointer. ``tag``: what the object store tagged it with when read (its ETag), for the
    compare-and-swap that replaces it."""

    generation: int
    snapshot: str  # the snapshot's key
    snapshot_bytes: int
    snapshot_xxh3: str
    writer: str
    writers: Writers
    versions: int
    newest_version: int | None
    format: int = POINTER_FORMAT
    tag: str | None = None

    def encode(self) -> bytes:
        return encode_pointer(self.generation, self.snapshot, self.snapshot_bytes, self.snapshot_xxh3,
                              self.writer, self.writers, self.versions, self.newest_version)


def encode_pointer(generation: int, snapshot_key: str, snapshot_bytes: int, snapshot_xxh3: str, writer: str,
                   writers: Writers, versions: int, newest_version: int | None) -> bytes:
    """The pointer object (format ``POINTER_FORMAT``) naming snapshot ``snapshot_key``."""
    return _checksummed({"format": POINTER_FORMAT, "generation": generation, "snapshot": snapshot_key,
                         "snapshot_bytes": snapshot_bytes, "snapshot_xxh3": snapshot_xxh3, "writer": writer,
                         "writers": writers.to_json(), "versions": versions, "newest_version": newest_version,
                         "written": time.time()})


def decode_pointer(data: bytes, where: str, fix: str, tag: str | None = None) -> Pointer:
    """The pointer in ``data`` (read from ``where``); CorruptionError naming the field and ``fix`` if it is
    damaged, FormatVersion-like CorruptionError if it is of a newer format."""
    outer = _load(data, where, fix, "pointer")
    if not isinstance(outer, dict) or not isinstance(outer.get("pointer"), dict) or not isinstance(outer.get("xxh3"), str):
        raise _damaged(where, 'it is not {"pointer": {...}, "xxh3": "..."}', fix)
    body = outer["pointer"]
    if outer["xxh3"] != f"{xxhash.xxh3_64_intdigest(json.dumps(body, sort_keys=True).encode()):016x}":
        raise _damaged(where, "its checksum does not match", fix)
    fmt = body.get("format")
    if fmt not in (1, POINTER_FORMAT):
        if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > POINTER_FORMAT:
            raise CorruptionError(f"the remote pointer {where} has format {fmt}; this cnrstore reads up to "
                                  f"{POINTER_FORMAT}: upgrade cnrstore", where, 0)
        raise _damaged(where, f"its format is {fmt!r}", fix)

    def field(name, check, want):
        return _field(body, name, check, want, where, fix)

    def count(lo, hi):
        return lambda v: not isinstance(v, bool) and isinstance(v, int) and lo <= v <= hi

    generation = field("generation", count(1, _U63), "a generation >= 1")
    snapshot = field("snapshot", filenames.is_remote_snapshot_key, "a snapshot's object name")
    snapshot_bytes = field("snapshot_bytes", count(0, _U63), "a byte count")
    xxh3 = field("snapshot_xxh3", lambda v: isinstance(v, str) and len(v) == 16
                 and all(c in "0123456789abcdef" for c in v), "16 hex digits")
    versions = field("versions", count(0, _U63), "a count")
    newest = field("newest_version", lambda v: v is None or count(1, _U63)(v), "a version or null")
    written = body.get("written")
    if written is not None and (isinstance(written, bool) or not isinstance(written, (int, float))
                                or not math.isfinite(written)):
        raise _damaged(where, f"its field 'written' is {written!r}, not a time", fix)
    if fmt == 1:  # one writer, its objects at the prefix's root
        writer = field("store_id", filenames.is_writer_id, "a store id (32 hex digits)")
        writers = LEGACY_WRITERS
        if snapshot.startswith(filenames.REMOTE_WRITERS_DIR + "/"):
            raise _damaged(where, f"its field 'snapshot' is {snapshot!r}, not a format-1 snapshot's name", fix)
    else:
        writer = field("writer", filenames.is_writer_id, "a store id (32 hex digits)")
        writers = Writers.check(body.get("writers"), where, fix)
    return Pointer(generation, snapshot, snapshot_bytes, xxh3, writer, writers, versions, newest, fmt, tag)


# -- the local identity (REMOTE) ------------------------------------------------------------------------------

class Identity(NamedTuple):
    """A local directory's REMOTE file: the remote's URL, the store id this directory writes (or reads) as,
    its role (``WRITER``: it writes the prefix, or did; ``CACHE``: a read cache that follows the pointer),
    a writer's history (None: a format-1 file, whose segments are at the prefix's root), and the pointer
    a writer may replace besides its own: ``claimed_from`` = (writer, generation) of the pointer it
    recovered from, until its first copy point makes the prefix its own (generation None: any, format 1)."""

    url: str
    store_id: str
    role: str
    writers: Writers | None = None
    claimed_from: tuple[str, int | None] | None = None

    def encode(self) -> bytes:
        claimed = None if self.claimed_from is None else {"writer": self.claimed_from[0],
                                                          "generation": self.claimed_from[1]}
        return json.dumps({"format": IDENTITY_FORMAT, "url": self.url, "store_id": self.store_id, "role": self.role,
                           "writers": None if self.writers is None else self.writers.to_json(),
                           "claimed_from": claimed}, sort_keys=True).encode() + b"\n"

    def may_replace(self, pointer: Pointer | None) -> bool:
        """Whether this directory may replace ``pointer``: its own, or the one it recovered from."""
        if pointer is None:
            return self.claimed_from is None
        if pointer.writer == self.store_id:
            return True
        if self.claimed_from is None:
            return False
        writer, generation = self.claimed_from
        return pointer.writer == writer and generation in (None, pointer.generation)


def decode_identity(data: bytes, where: str) -> Identity:
    """The identity in a REMOTE file's ``data``; CorruptionError naming the field and the fix."""
    fix = ("it names the store's remote and this directory's store id: rewrite it from a copy, or recover from "
           "the remote into a new directory (`cnrstore --remote URL ls NEWDIR`)")
    body = _load(data, where, fix, "REMOTE file")
    if not isinstance(body, dict):
        raise _damaged(where, "it is not a JSON object", fix)

    def field(name, check, want):
        return _field(body, name, check, want, where, fix)

    url = field("url", lambda v: isinstance(v, str) and "://" in v and len(v) < 4096, "a URL")
    store_id = field("store_id", filenames.is_writer_id, "a store id (32 hex digits)")
    fmt = body.get("format", 1)
    if fmt == 1:
        after = field("after", lambda v: v is None or filenames.is_writer_id(v), "a store id or null")
        return Identity(url.rstrip("/"), store_id, WRITER, None, None if after is None else (after, None))
    if fmt != IDENTITY_FORMAT:
        raise _damaged(where, f"its format is {fmt!r} (this cnrstore reads 1 and {IDENTITY_FORMAT}; a newer one "
                              "needs a newer cnrstore)", fix)
    role = field("role", lambda v: v in (WRITER, CACHE), f"{WRITER!r} or {CACHE!r}")
    writers = body.get("writers")
    writers = None if writers is None else Writers.check(writers, where, fix)
    claimed = body.get("claimed_from")
    if claimed is not None:
        if (not isinstance(claimed, dict) or not isinstance(claimed.get("writer"), str)
                or not (claimed["writer"] == "" or filenames.is_writer_id(claimed["writer"]))
                or not (claimed.get("generation") is None or (isinstance(claimed["generation"], int)
                                                              and not isinstance(claimed["generation"], bool)
                                                              and 0 <= claimed["generation"] <= _U63))):
            raise _damaged(where, f"its field 'claimed_from' is {claimed!r}", fix)
        claimed = (claimed["writer"], claimed.get("generation"))
    if role == WRITER and writers is None:
        raise _damaged(where, "a writer's REMOTE file has no writers' history", fix)
    return Identity(url.rstrip("/"), store_id, role, writers, claimed)
