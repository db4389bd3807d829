"""Every file and directory name of a store, in one place: nobody else builds paths.

Layout of a store directory::

    <store>/CNRSTORE            marker: format version, checksummed (written last at creation)
    <store>/LOCK                pid of the writing process (which flocks the store directory)
    <store>/index/              the LMDB environment (data.mdb, lock.mdb)
    <store>/index.repair-tmp/   the index `cnrstore repair` is building (swapped in when done)
    <store>/index.repair-tmp/READY  written once that index is built and durable: repair installs it
    <store>/index.damaged-<time>/  an index repair replaced (kept as evidence; delete it by hand)
    <store>/segments/<id>.seg   append-only segment files, id as 16 hex digits
    <store>/segments/<id>.seg.download  a segment being fetched back from the remote (renamed into place)
    <store>/REMOTE              a store with an object-store tier: its URL, store id and role (engine/remote.py)
    <store>/remote-snapshot.tmp/  the index copy a remote copy point is uploading (remade each time)
    <store>/index/INSTALLED     a read cache's installed pointer (the copy point its index/ came from)
    <store>/index.replaced-<generation>/  a read cache's previous index, while the newer one goes in

Objects under a remote prefix (docs/FORMAT.md, "Remote layout")::

    <prefix>/CURRENT                          the pointer: names the index snapshot of the last copy point
    <prefix>/w/<writer>/index/<generation>.mdb  a compact LMDB copy of the index, generation as 16 hex digits
    <prefix>/w/<writer>/segments/<id>.seg     a segment, as the local file (or a committed prefix of it)
    <prefix>/index/..., <prefix>/segments/... the same, of a prefix written by pointer format 1 (folder "")
"""

from __future__ import annotations

import os
import re

MARKER = "CNRSTORE"
LOCK = "LOCK"
INDEX_DIR = "index"
SEGMENTS_DIR = "segments"
REMOTE = "REMOTE"
REMOTE_SNAPSHOT_TMP = "remote-snapshot.tmp"
#: What a directory may hold before its store exists (a creation or a recovery from a remote that did not
#: finish): a store with a remote tier names it first, in REMOTE.
BEFORE_MARKER = frozenset({INDEX_DIR, SEGMENTS_DIR, LOCK, MARKER + ".tmp", REMOTE, REMOTE + ".tmp"})
_SEGMENT_RE = re.compile(r"^([0-9a-f]{16})\.seg$")
_SNAPSHOT_RE = re.compile(r"^([0-9a-f]{16})\.mdb$")
#: remote object names (relative to the store's prefix)
REMOTE_POINTER = "CURRENT"
REMOTE_INDEX_DIR = "index"
REMOTE_SEGMENTS_DIR = "segments"
REMOTE_WRITERS_DIR = "w"
#: in a read cache's index/: the pointer its index came from (engine/remote.py)
INSTALLED = "INSTALLED"
_WRITER_RE = re.compile(r"^[0-9a-f]{32}$")
_SNAPSHOT_KEY_RE = re.compile(r"^(w/[0-9a-f]{32}/)?index/[0-9a-f]{16}\.mdb$")


def marker_path(root: str) -> str:
    return os.path.join(root, MARKER)


def marker_tmp_path(root: str) -> str:
    return os.path.join(root, MARKER + ".tmp")


def lock_path(root: str) -> str:
    return os.path.join(root, LOCK)


def index_dir(root: str) -> str:
    return os.path.join(root, INDEX_DIR)


def index_repair_tmp(root: str) -> str:
    return os.path.join(root, INDEX_DIR + ".repair-tmp")


def index_repair_ready(root: str) -> str:
    return os.path.join(index_repair_tmp(root), "READY")


def index_damaged(root: str, stamp: str) -> str:
    return os.path.join(root, f"{INDEX_DIR}.damaged-{stamp}")


def segments_dir(root: str) -> str:
    return os.path.join(root, SEGMENTS_DIR)


def segment_path(root: str, segment_id: int) -> str:
    return os.path.join(root, SEGMENTS_DIR, f"{segment_id:016x}.seg")


def parse_segment_name(name: str) -> int | None:
    """Segment id of a file name in segments/, or None if the name is not a segment's."""
    m = _SEGMENT_RE.match(name)
    return int(m.group(1), 16) if m else None


def remote_path(root: str) -> str:
    return os.path.join(root, REMOTE)


def remote_snapshot_tmp(root: str) -> str:
    return os.path.join(root, REMOTE_SNAPSHOT_TMP)


def index_data_path(index_path: str) -> str:
    """The LMDB data file of an index directory."""
    return os.path.join(index_path, "data.mdb")


def segment_download_tmp(root: str, segment_id: int) -> str:
    """Where a segment fetched back from the remote is written before it is renamed into place."""
    return segment_path(root, segment_id) + ".download"


def installed_pointer_path(root: str) -> str:
    """A read cache's installed pointer, inside its index directory (it moves with the index)."""
    return os.path.join(index_dir(root), INSTALLED)


def index_replaced(root: str, generation: int) -> str:
    """Where a read cache moves its previous index while installing the snapshot of ``generation``."""
    return os.path.join(root, f"{INDEX_DIR}.replaced-{generation:016x}")


def is_index_replaced(name: str) -> bool:
    return name.startswith(INDEX_DIR + ".replaced-")


def is_writer_id(name: str) -> bool:
    """Whether ``name`` is a store id (32 lowercase hex digits): a writer's folder under w/."""
    return isinstance(name, str) and bool(_WRITER_RE.match(name))


def remote_folder(writer: str) -> str:
    """The folder of writer ``writer``'s objects under the prefix ("" : a pointer-format-1 prefix's root)."""
    return f"{REMOTE_WRITERS_DIR}/{writer}" if writer else ""


def _under(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def remote_segments_dir(folder: str = "") -> str:
    return _under(folder, REMOTE_SEGMENTS_DIR)


def remote_index_dir(folder: str = "") -> str:
    return _under(folder, REMOTE_INDEX_DIR)


def remote_segment_key(segment_id: int, folder: str = "") -> str:
    return f"{remote_segments_dir(folder)}/{segment_id:016x}.seg"


def remote_snapshot_key(generation: int, folder: str = "") -> str:
    return f"{remote_index_dir(folder)}/{generation:016x}.mdb"


def is_remote_snapshot_key(key: str) -> bool:
    """Whether ``key`` names an index snapshot object (``[w/<writer>/]index/<generation>.mdb``)."""
    return isinstance(key, str) and bool(_SNAPSHOT_KEY_RE.match(key))


def parse_remote_snapshot_name(name: str) -> int | None:
    """Generation of an object name in a remote index/ folder, or None if it is not a snapshot's."""
    m = _SNAPSHOT_RE.match(name)
    return int(m.group(1), 16) if m else None
