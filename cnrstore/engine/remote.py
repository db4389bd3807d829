"""The object-store tier: a store whose sealed segments live under a remote prefix (``s3://bucket/prefix``
or any fsspec URL), read back by byte range, with a bounded local cache; the index and the active
segments stay local, and their remote copy is made at copy points (docs/DESIGN.md, "The remote tier").

- ``prepare`` gets a local directory ready before the engine opens it, by its role (REMOTE file,
  remote_layout.Identity): a **writer** directory writes the prefix (its writable open is refused once
  another writer took the prefix over); a **read cache** follows the pointer (opened again, it installs
  the newest snapshot); an empty directory is recovered from the pointer's snapshot as a read cache,
  which a writable open then turns into the prefix's new writer (a takeover).
- ``RemoteSegmentStorage`` is the ``SegmentStorage`` (storage.py) of such a store: local files under
  ``segments/`` as before; a sealed segment is uploaded into this writer's own folder, and its local copy
  becomes cache once a pointer this writer wrote names it (evicted least-recently-read first beyond
  ``cache_bytes``); reads of an evicted segment go to the object store, to the folder the writers'
  history names for it, checked by the record checksums as every read is.
- **Copy points** (``copy_point``): after every ``every``-th commit and at close, the writer reads the
  pointer (it must still be its own, or the one it recovered from), seals its idle segment, uploads every
  segment the index references that the remote lacks, uploads a compact copy of the index into its
  folder, then replaces the pointer by a compare-and-swap on the tag it read. Only then are objects no
  index needs deleted. A writer that finds the pointer taken over (``RemoteTakenOver``) fetches back what
  its local index needs, and refuses new checkpoints from then on.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from typing import Callable, Iterator, NamedTuple

import numpy as np
import xxhash

from . import filenames, fs, range_fetch, schema
from .index import Index, install_built_index
from .lock import ProcessLock, SharedLock
from .marker import marker_bytes
from .objects import DEFAULT_TIMEOUT_S, FsspecObjectStore, ObjectStore, delete_with_proof
from .opening import check_no_leftovers, find
from . import remote_layout
from .remote_layout import (CACHE, LEGACY_WRITERS, WRITER, Identity, Pointer, Writers, decode_identity,
                            decode_pointer, encode_pointer)
from .segments import leftover_rule
from .replication import Replicator
from .storage import LocalSegmentStorage
from .uploads import BucketLag, CopyPointsBehind
from ..errors import (CnrError, CorruptionError, InvalidArgument, RemoteConflict, RemoteObjectMissing,
                      RemoteStorageError, RemoteTakenOver, StoreLocked, StoreNotFound)

__all__ = ["ObjectStore", "FsspecObjectStore", "RemoteSegmentStorage", "STORE_FOLDERS", "open_storage", "storage_for",
           "repair_storage", "read_pointer", "pointer_missing", "check_local_only", "kept_remotely"]

log = logging.getLogger("cnrstore.engine.remote")

#: ``every`` of a store whose copy points are all explicit (``copy_point()`` and close, never after a commit on
#: its own): a rank store of a multi-rank root in a bucket, whose distributed commit asks for one per save.
#: Such a store also uploads a sealed segment only at its next copy point, never in the thread that sealed
#: it, so that a trainer's local save never waits for the bucket (the copy point runs behind it).
EXPLICIT_COPY_POINTS = 1 << 62
#: Default copy-point interval: a copy point after every committed checkpoint.
DEFAULT_EVERY = 1
#: Default bound on the local copies of sealed segments (bytes).
DEFAULT_CACHE_BYTES = 4 << 30
#: After a failed copy point, commits make none for this long, doubling up to RETRY_MAX_S (a failing
#: endpoint costs a save one request's deadline at most, and most saves nothing)
RETRY_BASE_S = 5.0
RETRY_MAX_S = 300.0
#: How long a read cache waits for another process installing a snapshot into the same directory
INSTALL_WAIT_S = 30.0

_POINTER_FIX_READER = ("`cnrstore --remote URL repair DIR` (DIR: an empty directory) rebuilds it from the newest index "
                       "snapshot that verifies; or the writer's next copy point rewrites it; or restore CURRENT from a "
                       "copy (a bucket with versioning keeps the previous one)")


def _pointer_fix_writer(root: str) -> str:
    return (f"if {root!r} is the prefix's writer, `cnrstore --remote URL repair {root}` rebuilds the pointer from "
            f"the newest index snapshot that verifies, and its next writable open's copy point rewrites it from its "
            f"index; open it readonly=True to read it meanwhile")


# -- the pointer --------------------------------------------------------------------------------------------

def read_pointer(objects: ObjectStore, fix: str = _POINTER_FIX_READER) -> Pointer | None:
    """The remote's pointer, with the tag to replace it by (None if it has none yet)."""
    try:
        data, tag = objects.get_tagged(filenames.REMOTE_POINTER)
    except RemoteObjectMissing:
        return None
    return decode_pointer(data, objects.where(filenames.REMOTE_POINTER), fix, tag)


#: How many times a reader follows a pointer that moved on while it fetched the snapshot the old one named
FOLLOW_POINTER_TRIES = 5
#: How many times a takeover's claim swaps again after the writer it takes over from moved the pointer first
CLAIM_TRIES = 5


def fetch_snapshot_following(objects: ObjectStore, pointer: Pointer) -> tuple[Pointer, bytes]:
    """(pointer, its snapshot's bytes) for a reader beside a live writer: if the snapshot ``pointer`` names is
    gone, the writer may have moved the pointer on and deleted it since (a copy point); the pointer is read
    again and, if it names another snapshot, that one is fetched (at most ``FOLLOW_POINTER_TRIES`` times).
    Only a snapshot that the current pointer names and that is missing is damage (RemoteObjectMissing)."""
    for _ in range(FOLLOW_POINTER_TRIES):
        try:
            return pointer, fetch_snapshot(objects, pointer)
        except RemoteObjectMissing:
            now = read_pointer(objects)
            if now is None or now.snapshot == pointer.snapshot:
                raise
            fs.pause_point("remote_pointer_followed", now)
            pointer = now
    return pointer, fetch_snapshot(objects, pointer)


def fetch_snapshot(objects: ObjectStore, pointer: Pointer) -> bytes:
    """The index snapshot ``pointer`` names, checked against the size and hash the pointer records."""
    data = objects.get(pointer.snapshot)
    if len(data) != pointer.snapshot_bytes or f"{xxhash.xxh3_64_intdigest(data):016x}" != pointer.snapshot_xxh3:
        where = objects.where(pointer.snapshot)
        raise CorruptionError(f"the index snapshot {where} does not match the pointer "
                              f"{objects.where(filenames.REMOTE_POINTER)} (size or checksum): the bucket is damaged; "
                              f"{_POINTER_FIX_READER}", where, 0)
    return data


def open_snapshot(data: bytes, index_dir: str) -> Index:
    """The index snapshot ``data`` written into ``index_dir`` (an existing, empty directory) and opened
    readonly; the caller closes it. LMDB's own error if the bytes are no environment."""
    with builtins.open(filenames.index_data_path(index_dir), "wb") as f:
        f.write(data)
    return Index(index_dir, readonly=True)


def snapshot_segments(objects: ObjectStore, pointer: Pointer) -> dict[int, int]:
    """{segment: committed length} that the index snapshot ``pointer`` names reads (fetched, checked against
    the pointer, and opened in a temporary directory)."""
    data = fetch_snapshot(objects, pointer)
    tmp = tempfile.mkdtemp(prefix="cnrstore-snapshot-")
    try:
        index = open_snapshot(data, tmp)
        try:
            with index.read() as view:
                return dict(view.segments())
        finally:
            index.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: The top-level folders of a store's objects under its prefix: writers' folders, and format 1's segments and
#: index snapshots (remote_layout.py)
STORE_FOLDERS = (f"{filenames.REMOTE_WRITERS_DIR}/", "segments/", "index/")


def pointer_missing(objects: ObjectStore, pointer: str, folders=STORE_FOLDERS) -> RemoteObjectMissing | None:
    """Damage, if the prefix of ``objects`` holds objects under ``folders`` (those its pointer would name: a
    store's, by default; a multi-rank root's ``gen-*/`` and ``global/``) while ``pointer`` is missing: a pointer
    is never deleted, and none of them is written before it exists, so they without it mean it was deleted (an
    operator's ``rm``, a lifecycle rule, a partial copy). None: there are none (a new, or emptied, prefix;
    other objects beside them are not the store's business). Lists the prefix: called only where the pointer
    is missing."""
    keys = sorted(k for k in objects.list_tree("") if k.startswith(tuple(folders)))
    if not keys:
        return None
    shown = ", ".join(keys[:3]) + (f", ... ({len(keys)} objects)" if len(keys) > 3 else "")
    return RemoteObjectMissing(
        f"{objects.where(pointer)} is missing, but the prefix holds what it pointed to ({shown}): the pointer was "
        "deleted. Nothing was changed, and nothing here is deleted or overwritten while it is missing",
        objects.where(pointer))


def _recover_again(exc: RemoteTakenOver) -> RemoteTakenOver:
    """Mark ``exc`` as a takeover refused because the writer taken over from went on past what was recovered:
    a recovery into an empty directory may discard it and recover again (``recover_again``), unlike a takeover
    lost to another machine's, which stands."""
    exc.recover_again = True
    return exc


def _missing_store(root: str, objects: ObjectStore, readonly: bool) -> CnrError:
    """The error for a path with no store whose remote has no pointer: a bucket that does not exist is the
    URL's fault (RemoteStorageError), a prefix holding a store's objects without its pointer is damage
    (``pointer_missing``), an empty prefix is StoreNotFound."""
    if objects.bucket_exists() is False:
        return RemoteStorageError(f"{objects.url}: the bucket does not exist; create it, or check the URL")
    damage = pointer_missing(objects, filenames.REMOTE_POINTER)
    if damage is not None:
        return RemoteObjectMissing(
            f"{damage}. `cnrstore --remote {objects.url} repair DIR` (cnrstore.repair(DIR, remote=URL); DIR: an "
            f"empty directory) rebuilds {filenames.REMOTE_POINTER} from the newest index snapshot that verifies; or "
            f"put it back (a bucket with versioning keeps the previous one), or open the store's writer directory "
            f"writable (its next copy point rewrites the pointer from its index); `create=True` refuses this prefix",
            damage.path)
    return StoreNotFound(f"no cnrstore store at {root!r}, and {objects.url} holds none (no "
                         f"{filenames.REMOTE_POINTER}){'' if readonly else '; pass create=True to make one'}")


# -- the local side -----------------------------------------------------------------------------------------

def _read_small(path: str, what: str) -> bytes | None:
    """A REMOTE or INSTALLED file's bytes (None if there is none), read with a bound (fs.read_regular): a
    file of another kind (a FIFO, a device, a link) is damage, never a hang."""
    try:
        return fs.read_regular(path, remote_layout.MAX_BYTES, what)
    except FileNotFoundError:
        return None


def read_identity(root: str) -> Identity | None:
    """The REMOTE identity of the local store at ``root`` (None if it has none)."""
    data = _read_small(filenames.remote_path(root), "remote identity file")
    return None if data is None else decode_identity(data, filenames.remote_path(root))


def write_identity(root: str, ident: Identity, filesystem: fs.FileSystem) -> None:
    path = filenames.remote_path(root)
    filesystem.write_file_atomic(path, path + ".tmp", ident.encode())


def _identity_for(root: str, url: str) -> Identity | None:
    """``read_identity``; InvalidArgument if it names another remote than ``url``."""
    ident = read_identity(root)
    if ident is not None and ident.url != url:
        raise InvalidArgument(f"store {root!r} keeps its segments at {ident.url!r}, not {url!r}: pass "
                              "that remote= (or recover from this remote into an empty directory)")
    return ident


def kept_remotely(root: str) -> str | None:
    """The URL of the remote tier of the local store at ``root``, or None if it has none."""
    ident = read_identity(root)
    return None if ident is None else ident.url


def check_local_only(root: str, doing: str) -> None:
    """InvalidArgument if the store at ``root`` keeps its sealed segments in an object store: ``doing``
    (an open, a repair) without that ``remote=`` would see only the cached segments (a repair would then
    index them alone, and the next copy point delete every other object). A directory that may not be read
    passes: what follows reports PermissionDenied naming it (opening.find); a ``REMOTE`` file that may not
    be read in one that may is PermissionDenied here (the store is not taken for a local one)."""
    if not os.path.isdir(root) or not os.access(root, os.R_OK | os.X_OK):
        return
    try:
        url = kept_remotely(root)
    except PermissionError as exc:
        raise fs.permission_denied(exc, f"cannot {doing} store {root!r}", filenames.remote_path(root), needs="read",
                                   writing=False) from None
    if url is not None:
        raise InvalidArgument(f"store {root!r} keeps its sealed segments at {url!r}: {doing} it with that remote= "
                              "(`cnrstore --remote URL ...`)")


def read_installed(root: str) -> Pointer | None:
    """The pointer a read cache's index was installed from (None: not a cache, or not recorded)."""
    path = filenames.installed_pointer_path(root)
    data = _read_small(path, "read cache's installed pointer")
    if data is None:
        return None
    return decode_pointer(data, path, "recover from the remote into a new directory")


# -- prepare ------------------------------------------------------------------------------------------------

class Claim(NamedTuple):
    """A writable open that must make the prefix its own before it writes (at attach: its first copy point
    replaces ``pointer``, None: creates the pointer). ``base``: the writers' history it extends (None: it has
    its entry already, e.g. a pending claim retried)."""

    pointer: Pointer | None
    base: Writers | None
    undo_identity: bool = False  # a local store being attached: drop REMOTE again if the claim fails


class Prepared(NamedTuple):
    """What ``prepare`` found: this directory's identity, the pointer its reads go by (a cache's installed
    one), the claim a writable open must make at attach (None: it owns the prefix already), and the shared
    lock a read cache's open holds until its index is open (released at attach)."""

    identity: Identity
    pointer: Pointer | None
    claim: Claim | None
    open_lock: SharedLock | None = None


def prepare(root: str, objects: ObjectStore, filesystem: fs.FileSystem, *, readonly: bool,
            create: bool) -> Prepared:
    """Get the local directory ``root`` ready for a store whose remote is ``objects`` (``Prepared``).

    - ``root`` is a writer's directory: its readonly open reads it as it is (no request); its writable open
      is refused (RemoteTakenOver) unless the pointer is its own or the one it recovered from.
    - ``root`` is a read cache: the pointer is read again and, if it moved on, its snapshot installed in
      place of the cache's index (``install_snapshot``); a writable open then takes the prefix over.
    - ``root`` holds a store without a REMOTE file: a writable open attaches it (its first copy point, at
      open, uploads it and creates the pointer); a readonly open is refused (InvalidArgument).
    - ``root`` holds no store: with a pointer, the snapshot is installed there as a read cache (recovery
      from the remote alone), taken over by a writable open; without one, ``create`` makes a new store
      (its pointer created at open), else StoreNotFound (RemoteStorageError if the bucket does not exist).
    """
    url = objects.url
    if find(root, readonly):
        ident = _identity_for(root, url)
        if ident is None:
            return _attach_local(root, objects, filesystem, readonly)
        if ident.role == WRITER:
            return _open_writer(root, objects, ident, readonly)
        installed, pointer = _refresh_cache(root, objects, filesystem, readonly)
        return _open_cache(root, objects, ident, installed, pointer, readonly)
    pointer = read_pointer(objects)
    if pointer is None:
        refusal = _missing_store(root, objects, readonly)
        if not create or readonly or not isinstance(refusal, StoreNotFound):  # (no bucket, or a store's objects
            raise refusal                                                      # without their pointer: damage)
        os.makedirs(root, exist_ok=True)
        store_id = uuid.uuid4().hex
        ident = Identity(url, store_id, WRITER, Writers([(store_id, 0)]), None)
        if not set(os.listdir(root)) - filenames.BEFORE_MARKER:  # (else the engine's create refuses the directory)
            write_identity(root, ident, filesystem)
        return Prepared(ident, None, Claim(None, None))
    ident = _recover_from_remote(root, objects, pointer, filesystem)
    installed = read_installed(root) or pointer  # (the pointer it followed, if the writer moved it meanwhile)
    return _open_cache(root, objects, ident, installed, installed, readonly)


def _attach_local(root: str, objects: ObjectStore, filesystem: fs.FileSystem, readonly: bool) -> Prepared:
    url = objects.url
    if readonly:
        raise InvalidArgument(f"store {root!r} has no remote tier: open it without remote= (or writable, "
                              f"to attach it to {url!r})")
    pointer = read_pointer(objects)
    if pointer is not None:
        raise RemoteStorageError(f"{url} already holds another store's copy (its pointer names store "
                                 f"{pointer.writer}); choose another prefix to attach {root!r} to")
    store_id = uuid.uuid4().hex
    ident = Identity(url, store_id, WRITER, Writers([(store_id, 0)]), None)  # every segment it has is its own
    write_identity(root, ident, filesystem)
    return Prepared(ident, None, Claim(None, None, undo_identity=True))


def _open_writer(root: str, objects: ObjectStore, ident: Identity, readonly: bool) -> Prepared:
    if readonly:  # its own files and the folders its history names: no request needed to open
        return Prepared(ident, None, None)
    pointer = read_pointer(objects, _pointer_fix_writer(root))
    if not ident.may_replace(pointer):
        if pointer is None:
            raise RemoteStorageError(
                f"{objects.url} holds no pointer, but {root!r} recovered from one (a prefix emptied since?): "
                "recover into a new directory once the prefix holds a store again")
        raise RemoteTakenOver(
            f"{objects.url} is written by another store (its pointer names store {pointer.writer}, generation "
            f"{pointer.generation}; this local directory is store {ident.store_id}): one writer per prefix. "
            "Another machine recovered it and writes it now; open this one readonly=True to read it, or recover "
            "from the remote into an empty directory to go on from the bucket's newest version", pointer.writer)
    writers = ident.writers
    if pointer is None:  # a new store whose creation copy point did not finish, or an emptied prefix
        return Prepared(ident, None, Claim(None, None if writers is not None else LEGACY_WRITERS))
    if writers is not None and writers[-1][0] == ident.store_id:
        claim = None if pointer.writer == ident.store_id else Claim(pointer, None)
        return Prepared(ident, pointer, claim)
    # a format-1 directory, or a takeover whose claim did not finish: its history gets its own entry
    return Prepared(ident, pointer, Claim(pointer, pointer.writers if pointer.format > 1 else LEGACY_WRITERS))


def _open_cache(root: str, objects: ObjectStore, ident: Identity, installed: Pointer | None,
                pointer: Pointer | None, readonly: bool) -> Prepared:
    """A read cache at the copy point ``installed``, the bucket's pointer being ``pointer``: readonly, read
    as installed; writable, taken over (the cache's index is the pointer's snapshot by now)."""
    if readonly:  # (no install can swap the index until the engine has it open: released at attach)
        return Prepared(ident, installed, None, SharedLock(root, INSTALL_WAIT_S))
    if pointer is None:
        raise StoreNotFound(f"{root!r} is a read cache of {objects.url}, which holds no store any more (no "
                            f"{filenames.REMOTE_POINTER}); recover from another prefix")
    # a takeover: this directory becomes the writer (its REMOTE file is rewritten at attach, before the claim)
    return Prepared(ident._replace(store_id=uuid.uuid4().hex, role=WRITER, writers=None,
                                   claimed_from=(pointer.writer, pointer.generation)),
                    pointer, Claim(pointer, pointer.writers))


def _recover_from_remote(root: str, objects: ObjectStore, pointer: Pointer, filesystem: fs.FileSystem) -> Identity:
    """Lay out a read cache in ``root`` (which must hold no store files yet): the pointer's snapshot as the
    index (with the pointer as ``index/INSTALLED``), an empty segments/, the REMOTE file (a store id of its
    own: never the writer's), the marker last. Returns the cache's identity. Under the directory's lock: of
    processes recovering into one directory at once, one lays it out and the others open what it made."""
    os.makedirs(root, exist_ok=True)
    lock = ProcessLock(root)
    lock.acquire(write_pid=False, wait=lambda: not os.path.exists(filenames.marker_path(root)),
                 timeout=INSTALL_WAIT_S)
    try:
        if os.path.exists(filenames.marker_path(root)):  # (another process recovered it meanwhile)
            made = _identity_for(root, objects.url)
            if made is not None:
                return made
        return _lay_out_cache(root, objects, pointer, filesystem)
    finally:
        lock.release()


def _lay_out_cache(root: str, objects: ObjectStore, pointer: Pointer, filesystem: fs.FileSystem) -> Identity:
    check_no_leftovers(root, "recover from the remote into an empty or new directory")
    for path in (filenames.index_dir(root), filenames.segments_dir(root)):  # (a creation cut short left them)
        fs.check_kind(path, "store directory", directory=True)
    pointer, data = fetch_snapshot_following(objects, pointer)  # (INSTALLED below names the one fetched)
    if not os.path.isdir(filenames.index_dir(root)):
        filesystem.mkdir(filenames.index_dir(root))
    LocalSegmentStorage.create(root, filesystem)
    index_file = filenames.index_data_path(filenames.index_dir(root))
    filesystem.write_file_atomic(index_file, index_file + ".tmp", data)
    installed = filenames.installed_pointer_path(root)
    filesystem.write_file_atomic(installed, installed + ".tmp", pointer.encode())
    ident = Identity(objects.url, uuid.uuid4().hex, CACHE)
    write_identity(root, ident, filesystem)
    # the marker last: a store exists exactly when its marker does
    filesystem.write_file_atomic(filenames.marker_path(root), filenames.marker_tmp_path(root), marker_bytes())
    return ident


def _refresh_cache(root: str, objects: ObjectStore, filesystem: fs.FileSystem,
                   readonly: bool) -> tuple[Pointer | None, Pointer | None]:
    """A read cache opened again follows the bucket: the newest pointer's snapshot installed if it moved on.
    Returns (the pointer the cache's index is now at, the bucket's pointer)."""
    installed = read_installed(root)
    try:
        pointer = read_pointer(objects)
    except RemoteStorageError as exc:
        if not readonly or installed is None or isinstance(exc, CorruptionError):
            raise
        log.warning("cnrstore: read cache %s cannot read the pointer of %s (%s); reading the copy point it holds "
                    "(generation %d)", root, objects.url, exc, installed.generation)
        return installed, None
    if pointer is None:
        log.warning("cnrstore: read cache %s: %s holds no pointer any more; reading what the cache holds", root,
                    objects.url)
        return installed, None
    if installed is not None and _same(installed, pointer) and not _leftovers(root):
        return installed, pointer
    if readonly and not os.access(root, os.W_OK | os.X_OK):
        log.warning("cnrstore: read cache %s is at generation %s of %s, which moved on to %s; the directory "
                    "may not be written, so it reads what it holds", root,
                    None if installed is None else installed.generation, objects.url, pointer.generation)
        return installed, pointer
    installed = install_snapshot(root, objects, pointer, filesystem)  # (``pointer``, or the newer one it followed)
    return installed, installed


def _same(a: Pointer, b: Pointer) -> bool:
    """Whether two pointers name the same copy point."""
    return (a.writer, a.generation, a.snapshot_xxh3) == (b.writer, b.generation, b.snapshot_xxh3)


def install_snapshot(root: str, objects: ObjectStore, pointer: Pointer, filesystem: fs.FileSystem) -> Pointer:
    """Install ``pointer``'s snapshot as the read cache's index (under the store's lock, so that one process
    of several opening the cache does it): the snapshot and INSTALLED are written into index.repair-tmp/,
    marked READY, the old index moved aside, the new renamed in (a crash in between is rolled forward by the
    next open, as for repair); then cached segments the new index does not read as they are are deleted."""
    lock = ProcessLock(root)
    try:
        lock.acquire(write_pid=False, wait=lambda: True, timeout=INSTALL_WAIT_S)
    except StoreLocked as exc:
        raise RemoteStorageError(f"read cache {root!r} is being written by another process ({exc}); a read cache "
                                 "is written only while it installs the bucket's newest snapshot: retry") from exc
    try:
        _roll_forward(root, filesystem)
        installed = read_installed(root)
        if installed is not None and _same(installed, pointer):
            return installed  # another process installed it meanwhile
        pointer, data = fetch_snapshot_following(objects, pointer)
        tmp = filenames.index_repair_tmp(root)
        filesystem.remove_tree(tmp)
        filesystem.mkdir(tmp)
        index_file = filenames.index_data_path(tmp)
        filesystem.write_file_atomic(index_file, index_file + ".tmp", data)
        installed_tmp = os.path.join(tmp, filenames.INSTALLED)
        filesystem.write_file_atomic(installed_tmp, installed_tmp + ".tmp", pointer.encode())
        ready = filenames.index_repair_ready(root)
        filesystem.write_file_atomic(ready, ready + ".tmp", b"")
        aside = filenames.index_replaced(root, pointer.generation)
        filesystem.remove_tree(aside)
        if os.path.isdir(filenames.index_dir(root)):
            filesystem.rename(filenames.index_dir(root), aside)
            filesystem.fsync_dir(root)
        fs.pause_point("remote_install_swapping", root)
        install_built_index(root, filesystem)
        filesystem.remove_tree(aside)  # (another process may still map its files: they live on until closed)
        _drop_stale_cache(root, filesystem)
        return pointer
    finally:
        lock.release()


def _leftovers(root: str) -> bool:
    """Whether an install a crash cut short left anything in the read cache ``root``."""
    return (not os.path.isdir(filenames.index_dir(root)) or os.path.exists(filenames.index_repair_tmp(root))
            or any(filenames.is_index_replaced(name) for name in os.listdir(root)))


def _roll_forward(root: str, filesystem: fs.FileSystem) -> None:
    """Finish an install a crash cut short (the lock is held): no index/ but a READY one is renamed in; an
    unfinished one (no READY) and indexes moved aside are deleted."""
    if not os.path.exists(filenames.index_dir(root)) and os.path.exists(filenames.index_repair_ready(root)):
        install_built_index(root, filesystem)
    if os.path.isdir(filenames.index_dir(root)):
        filesystem.remove_tree(filenames.index_repair_tmp(root))
    for name in os.listdir(root):
        if filenames.is_index_replaced(name):
            filesystem.remove_tree(os.path.join(root, name))


def _drop_stale_cache(root: str, filesystem: fs.FileSystem) -> None:
    """Delete the cached segments the newly installed index does not read as they are: absent from it, or
    shorter than it says (a segment another writer's copy point named when it was shorter)."""
    index = Index(filenames.index_dir(root), readonly=True)
    try:
        with index.read() as view:
            need = view.segments()
    finally:
        index.close()
    seg_dir = filenames.segments_dir(root)
    for name in os.listdir(seg_dir):
        seg = filenames.parse_segment_name(name)
        if seg is None:
            continue
        path = os.path.join(seg_dir, name)
        if seg not in need or os.path.getsize(path) < need[seg]:
            with contextlib.suppress(FileNotFoundError):
                filesystem.remove(path)


# -- opening ------------------------------------------------------------------------------------------------

def open_storage(root: str, url: "str | ObjectStore", options: dict | None, filesystem: fs.FileSystem, *,
                 readonly: bool, create: bool, cache_bytes: int | None = None, every: int | None = None,
                 timeout_s: float | None = None) -> "RemoteSegmentStorage":
    """The storage of the store at ``root`` (an absolute path) with its remote at ``url`` (or in the object
    store ``url``, connected already: a multi-rank root's rank store): ``prepare``s the directory (recovering
    the store from the remote into an empty one), then connects."""
    if cache_bytes is None:
        cache_bytes = DEFAULT_CACHE_BYTES
    if every is None:
        every = DEFAULT_EVERY
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise InvalidArgument(f"cache_bytes={cache_bytes!r}: pass a byte count >= 0")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InvalidArgument(f"remote_every={every!r}: pass a commit count >= 1")
    if isinstance(url, ObjectStore):
        if options is not None or timeout_s is not None:
            raise InvalidArgument("remote_options and remote_timeout_s belong to a remote URL; an ObjectStore "
                                  "given as remote= is connected already")
        objects = url
    else:
        objects = FsspecObjectStore(url, options, timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    return storage_for(root, objects, filesystem, readonly=readonly, create=create, cache_bytes=cache_bytes,
                       every=every)


def storage_for(root: str, objects: ObjectStore, filesystem: fs.FileSystem, *, readonly: bool, create: bool,
                cache_bytes: int = DEFAULT_CACHE_BYTES, every: int = DEFAULT_EVERY) -> "RemoteSegmentStorage":
    """``open_storage`` with the object store given (a test's recording one)."""
    found = prepare(root, objects, filesystem, readonly=readonly, create=create)
    return RemoteSegmentStorage(root, filesystem, objects, found, readonly=readonly, cache_bytes=cache_bytes,
                                every=every)


def repair_storage(root: str, url: str, options: dict | None, filesystem: fs.FileSystem) -> "RemoteSegmentStorage":
    """The storage ``cnrstore repair --remote`` scans (the index is lost or damaged): every segment object
    the writers' history places in a folder counts, as well as the local files; nothing is uploaded,
    evicted or deleted."""
    objects = FsspecObjectStore(url, options)
    ident = _identity_for(root, objects.url)
    if ident is None:
        ident = Identity(objects.url, uuid.uuid4().hex, WRITER, LEGACY_WRITERS)
    pointer = read_installed(root) if ident.role == CACHE else None
    storage = RemoteSegmentStorage(root, filesystem, objects, Prepared(ident, pointer, None), readonly=True)
    storage.adopt_every_object()
    return storage


def reinstall_cache(root: str, url: str, options: dict | None, filesystem: fs.FileSystem) -> Pointer:
    """``cnrstore repair --remote`` of a read cache: its index is the remote's newest snapshot again (whatever
    became of the local one). Returns the pointer installed."""
    objects = FsspecObjectStore(url, options)
    ident = _identity_for(root, objects.url)
    if ident is None or ident.role != CACHE:
        raise InvalidArgument(f"{root!r} is not a read cache of {url}")
    pointer = read_pointer(objects)
    if pointer is None:
        raise _missing_store(root, objects, True)
    with contextlib.suppress(FileNotFoundError):  # (a damaged one must not stop the install)
        filesystem.remove(filenames.installed_pointer_path(root))
    return install_snapshot(root, objects, pointer, filesystem)


# -- the storage --------------------------------------------------------------------------------------------

class RemoteSegmentStorage(LocalSegmentStorage, Replicator):

    """Segments under ``<root>/segments/`` while active or cached, and under the remote prefix once sealed.

    Reads go to the local copy when there is one and to the object store otherwise (whole, for a segment
    under a quarter of ``cache_bytes``, into the cache; else by range). A writer's local copy of a sealed
    segment is evictable once a pointer it wrote names the segment at its full length; ``cache_bytes``
    bounds the evictable copies (active segments, and those not yet named by a pointer, come on top: then
    ``stats()["remote"]["over_bound_bytes"]`` says by how much). A failed upload or copy point is logged and
    retried at a later copy point; the commit it followed stands.

    It is both a segment storage (storage.py: the I/O) and the store's ``Replicator`` (replication.py: the
    copy points the engine asks for)."""

    #: GC's ``remove`` deletes the local copy; the object goes at a later copy point, once the pointer names
    #: an index that no longer needs it (a reader at the previous copy point may still read it)
    removes_at_once = False

    def __init__(self, root: str, filesystem: fs.FileSystem, objects: ObjectStore, prepared: Prepared, *,
                 readonly: bool, cache_bytes: int = DEFAULT_CACHE_BYTES, every: int = DEFAULT_EVERY):
        super().__init__(root, filesystem)
        self.objects = objects
        self.identity = prepared.identity
        self.readonly = readonly
        self.cache_bytes = cache_bytes
        self.every = every
        self._claim = prepared.claim
        self._open_lock = prepared.open_lock
        if self.identity.role == CACHE:
            pointer = prepared.pointer if prepared.pointer is not None else read_installed(root)
            self.writers = pointer.writers if pointer is not None else LEGACY_WRITERS
        else:
            self.writers = self.identity.writers if self.identity.writers is not None else LEGACY_WRITERS
        self.generation = prepared.pointer.generation if prepared.pointer is not None else 0
        self._lock = threading.RLock()  # guards the maps below
        self._copy_lock = threading.Lock()  # one copy point at a time
        #: one upload of a segment at a time: a copy point's upload of an active segment's committed prefix and
        #: the upload of the same segment once sealed may race; the PUT that lands last must be the one recorded
        self._upload_lock = threading.Lock()
        self._remote: dict[int, int] = {}  # segment -> size of its object (in the folder its history names)
        self._listed = False
        self._covered: dict[int, int] = {}  # segment -> length, as the last pointer this writer wrote names it
        self._cache: "OrderedDict[int, int]" = OrderedDict()  # final local copies, least recently read first
        self._evicted: set[int] = set()  # segments with no local copy: read remotely
        self._index = None
        self._seal_writer: Callable[[], None] | None = None
        self._commits = 0
        self._copied_txn: int | None = None  # the index transaction the last copy point uploaded
        self._retry_at = 0.0
        self._failures = 0
        self._sealing = False  # a copy point is sealing the writer's segment (it uploads it itself)
        #: set once another writer took the prefix over (RemoteTakenOver): checkpoints are refused from then on
        self.lost: RemoteTakenOver | None = None
        self._lost_reported = False
        #: the last failure of an upload or copy point not yet made good (None: the remote is current as of
        #: the last copy point)
        self.last_error: BaseException | None = None
        self._reading = threading.local()  # .fetcher: the planned read this thread is in (prefetch)
        #: the commits the bucket does not hold yet (uploads.py)
        self.lag = BucketLag()
        self._behind: CopyPointsBehind | None = None  # copy points in a thread of their own (run_behind)
        #: counters (``Store.stats()["remote"]``)
        self.counters = {"bytes_uploaded": 0, "objects_uploaded": 0, "remote_reads": 0, "remote_read_bytes": 0,
                         "planned_reads": 0, "planned_read_bytes": 0, "copy_points": 0, "copy_point_seconds": 0.0,
                         "segments_evicted": 0, "remote_segments_deleted": 0}

    @property
    def store_id(self) -> str:
        return self.identity.store_id

    @property
    def role(self) -> str:
        return self.identity.role

    @property
    def own_folder(self) -> str:
        return filenames.remote_folder(self.identity.store_id)

    def _key(self, seg: int) -> str:
        return self.writers.segment_key(seg)

    # the engine's hooks (segment ids; the Replicator's attach, before_checkpoint, after_commit, flush) ----------------
    def segment_ids_from(self, high: int) -> int:
        """The first segment id the engine may hand out (``high``: the largest id its index used): a writer
        taking the prefix over starts past every id of the snapshot it took over from, and past every
        range the writers' history already gives out."""
        claim = self._claim
        if claim is not None and claim.base is not None:
            first = max(high + 1, claim.base[-1][1] + 1)
            self.writers = claim.base.then(self.identity.store_id, first)
            self._claim = claim._replace(base=None)
            return first
        own = [f for w, f in self.writers if w == self.identity.store_id]
        return max(high + 1, own[-1] if own else 0)

    def attach(self, index, seal_writer: Callable[[], None]) -> None:
        with index.read() as view:
            known = set(view.segments()) | set(schema.DOOMED_SEGMENTS.get(view))
        with self._lock:
            self._index, self._seal_writer = index, seal_writer
        self._release_open_lock()
        if self.readonly:  # reads find what they need on demand
            if self.role == CACHE and os.access(filenames.segments_dir(self.root), os.W_OK):
                self._track_cached(known)  # a read cache keeps to its bound across opens
            return
        local = self._adopt(lambda seg: seg in known)
        with self._lock:
            for seg in sorted(local):  # the writable open never appends to these again (appender)
                self._cache[seg] = os.path.getsize(filenames.segment_path(self.root, seg))
        if self._claim is not None:
            self._make_claim()
        self._evict()

    def _release_open_lock(self) -> None:
        if self._open_lock is not None:
            lock, self._open_lock = self._open_lock, None
            lock.release()

    def close(self) -> None:
        self._stop_behind()
        self._release_open_lock()
        super().close()

    def _track_cached(self, known: set[int]) -> None:
        """Count a read cache's local copies (least recently used first, by their access times) in the cache
        it bounds, and evict beyond it."""
        seg_dir = filenames.segments_dir(self.root)
        entries = []
        for name in os.listdir(seg_dir):
            seg = filenames.parse_segment_name(name)
            if seg is not None and seg in known:
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(os.path.join(seg_dir, name))
                    entries.append((st.st_atime, seg, st.st_size))
        with self._lock:
            for _atime, seg, size in sorted(entries):
                self._cache[seg] = size
        self._evict()

    def _make_claim(self) -> None:
        """Make the prefix this store's: its REMOTE file names its history (and the pointer it may replace),
        then a copy point replaces the pointer it found (or creates one). Raises (the open fails) if another
        writer moved the pointer first; a local store being attached is then detached again."""
        claim = self._claim
        ident = self.identity._replace(role=WRITER, writers=self.writers)
        try:
            if ident != self.identity or not os.path.exists(filenames.remote_path(self.root)):
                write_identity(self.root, ident, self.fs)
            self.identity = ident
            with contextlib.suppress(FileNotFoundError):  # (a cache's installed pointer: no longer what it is)
                self.fs.remove(filenames.installed_pointer_path(self.root))
            for attempt in range(CLAIM_TRIES):
                try:
                    self.copy_point()
                    break
                except RemoteConflict:  # (the writer taken over from swapped between the read and the swap)
                    if attempt + 1 == CLAIM_TRIES:
                        raise
        except BaseException:
            if claim.undo_identity:
                with contextlib.suppress(OSError):
                    os.remove(filenames.remote_path(self.root))
            raise
        self._claim = None

    def adopt_every_object(self) -> None:
        """Count every segment object its history places in a folder as this store's (repair: no index says
        which are)."""
        self._adopt(lambda seg: True)

    def _adopt(self, ours: Callable[[int], bool]) -> set[int]:
        """Count the segment objects of the history's folders that ``ours`` accepts (each in the folder its
        id resolves to), and those with no local copy as evicted; returns the local segments' ids."""
        found = self._list_remote(ours)
        local = set(super().list())
        with self._lock:
            self._remote.update(found)
            self._listed = True
            self._evicted = set(self._remote) - local
        return local

    def _list_remote(self, ours: Callable[[int], bool] = lambda seg: True) -> dict[int, int]:
        found: dict[int, int] = {}
        for writer in dict.fromkeys(self.writers.writers()):
            listing = self.objects.list(filenames.remote_segments_dir(filenames.remote_folder(writer)))
            for name, size in listing.items():
                seg = filenames.parse_segment_name(name)
                if seg is not None and self.writers.writer_of(seg) == writer and ours(seg):
                    found[seg] = size
        return found

    def before_checkpoint(self) -> None:
        if self.lost is not None:
            raise self.lost

    def run_behind(self) -> bool:
        """Make the copy points after commits in a thread of this store's from now on (uploads.py): a commit
        marks one due and returns; sealed segments are uploaded by the copy points, never in the thread that
        sealed them. False (nothing changed) for a readonly store, and for one whose copy points are all
        explicit (a rank store of a bucket root: its publication thread makes them)."""
        if self.readonly or self.every == EXPLICIT_COPY_POINTS:
            return False
        with self._lock:
            if self._behind is None:
                self._behind = CopyPointsBehind(self._copy_point_behind, self._behind_failed,
                                                lambda: self._retry_at, f"cnrstore-uploads-{self.store_id[:8]}")
        return True

    def _copy_point_behind(self) -> None:
        if self.lost is None:
            self.copy_point()

    def _behind_failed(self, exc: BaseException) -> bool:
        if isinstance(exc, RemoteTakenOver) or self.lost is not None:
            self.lag.wake()  # (a save waiting for the bucket learns at once)
            return False
        log.warning("cnrstore: a remote copy point behind the commits failed; the commits stand locally and the "
                    "copy point is tried again in %.0f s: %s: %s", max(0.0, self._retry_at - time.monotonic()),
                    type(exc).__name__, exc)
        return True

    def _stop_behind(self) -> None:
        behind, self._behind = self._behind, None
        if behind is not None:
            behind.stop()
        self.lag.wake()

    def wait_for_bucket(self, bound_s: float, what: str) -> float:
        """Block until the oldest commit the bucket lacks is at most ``bound_s`` seconds old (uploads.py);
        returns the seconds waited. RemoteTakenOver if this store lost its prefix meanwhile."""
        if self._behind is not None:
            self._behind.due()
        return self.lag.wait_within(bound_s, lambda: self.lost, what)

    def after_commit(self) -> None:
        if self.readonly:
            return
        self._commits += 1
        if self._index is not None:
            with self._index.read() as view:
                self.lag.committed(view.txn_id())
        behind = self._behind
        if (behind is not None or self.every == EXPLICIT_COPY_POINTS) and self._seal_writer is not None:
            # (in the committing thread, before its next checkpoint opens: each save's segment is sealed whole,
            # so the copy point behind uploads it once, never a committed prefix that keeps growing)
            self._seal_writer()
        if behind is not None:
            if self.lost is None:
                behind.due()
        elif self.lost is None and not (self._commits % self.every or time.monotonic() < self._retry_at):
            try:
                self.copy_point()
            except RemoteTakenOver:
                pass
            except Exception as exc:  # noqa: BLE001 - the commit has happened: never fail it for a remote fault
                log.warning("cnrstore: the remote copy point after a commit failed; the commit stands locally and "
                            "the copy is retried at a later one: %s: %s", type(exc).__name__, exc)
        if self.lost is not None and not self._lost_reported:
            self._lost_reported = True
            with self._index.read() as view:
                latest = view.latest()
            self.lost.version = latest[0] if latest else None
            raise self.lost

    def flush(self) -> None:
        self._stop_behind()  # (the copy point in flight ends first; the last one is made here)
        if self.readonly or self._index is None or self.lost is not None:
            return
        with self._index.read() as view:
            unchanged = view.txn_id() == self._copied_txn and self.last_error is None
        if not unchanged:
            self.copy_point()

    # reads -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def prefetch(self, ranges, *, bounded: bool) -> Iterator[None]:
        """The ranges of segments that are not here, fetched ahead of this thread's reads (range_fetch.py):
        coalesced into requests by the store's ``Options.remote_read_gap_bytes`` and
        ``remote_read_request_bytes``, ``remote_read_requests`` of them in flight at once, within
        ``remote_read_window_bytes`` when ``bounded``. A segment the bucket's listing lacks is left to the read
        that needs it (which raises as it would have); a request is cut at the object's end, so that what a
        read needs past it is damage (CorruptionError), as for any read."""
        with self._lock:
            known = self._listed
        if not known:  # (one listing per writer's folder gives every object's size: no request per segment)
            found = self._list_remote()
            with self._lock:
                self._remote.update(found)
                self._listed = True
        here: dict[int, bool] = {}
        for seg in {r.segment for r in ranges}:
            here[seg] = seg not in self._evicted and os.path.exists(filenames.segment_path(self.root, seg))
        with self._lock:
            sizes = {seg: self._remote.get(seg) for seg, local in here.items() if not local}
            self._evicted.update(seg for seg, size in sizes.items() if size is not None)  # (read remotely: path()
            # names the object without asking the file system, record after record)
        wanted = [r for r in ranges if sizes.get(r.segment) is not None]
        if not wanted:
            yield
            return
        options = self._options
        window = options.remote_read_window_bytes if bounded else None
        needed = sum(r.length for r in wanted)
        requests = [r._replace(end=min(r.end, sizes[r.segment]))
                    for r in range_fetch.coalesce(wanted, options.remote_read_gap_bytes,
                                                  options.remote_read_request_bytes)
                    if r.start < sizes[r.segment]]
        fetcher = range_fetch.Fetcher(requests, wanted, self._read_into, concurrency=options.remote_read_requests,
                                      window_bytes=window)
        with self._lock:
            self.counters["planned_reads"] += 1
            self.counters["planned_read_bytes"] += needed
        outer = getattr(self._reading, "fetcher", None)
        self._reading.fetcher = fetcher
        done = False
        try:
            yield
            done = True
        finally:
            self._reading.fetcher = outer
            fetcher.close(wait=done)  # (after an error, requests still in flight end by their deadline, unread)

    def read(self, seg: int, offset: int, length: int) -> np.ndarray:
        fetcher = getattr(self._reading, "fetcher", None)
        if fetcher is not None:
            view = fetcher.read(seg, offset, length)
            if view is not None:
                if view.shape[0] != length:
                    where = self.objects.where(self._key(seg))
                    raise CorruptionError(f"remote segment {where} holds fewer bytes than the index needs "
                                          f"({offset + view.shape[0]} < {offset + length})", where, offset)
                return view
        if seg not in self._evicted:
            fs.pause_point("remote_read_local", seg)
            try:
                view = super().read(seg, offset, length)
            except CorruptionError:
                if os.path.exists(filenames.segment_path(self.root, seg)):
                    raise  # the local copy is damaged: never taken for the remote's
                with self._lock:  # evicted meanwhile, or never here (a reader beside the writer): remote
                    self._evicted.add(seg)
            else:
                if seg in self._cache:
                    with self._lock:
                        if seg in self._cache:
                            self._cache.move_to_end(seg)
                return view
        data = self._fetch_whole(seg)
        if data is not None:
            if offset + length > len(data):
                raise CorruptionError(f"remote segment {self.objects.where(self._key(seg))} holds fewer bytes than the "
                                      f"index needs ({len(data)} < {offset + length})", self.path(seg), len(data))
            return np.frombuffer(data, dtype=np.uint8, count=length, offset=offset)
        key = self._key(seg)
        size = self._remote_size(seg)  # (known: _fetch_whole asked)
        if size is not None and offset + length > size:  # a range past the object's end: damage, not a fault
            raise CorruptionError(f"remote segment {self.objects.where(key)} holds fewer bytes than the index needs "
                                  f"({size} < {offset + length})", self.objects.where(key), size)
        got = self._get(seg, offset, offset + length)
        if len(got) != length:
            raise CorruptionError(f"remote segment {self.objects.where(key)} holds fewer bytes than the index needs "
                                  f"({offset + len(got)} < {offset + length})", self.objects.where(key), offset)
        return np.frombuffer(got, dtype=np.uint8)

    def _get(self, seg: int, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes of segment ``seg``'s object (``[start, end)``, or whole), counted."""
        try:
            data = self.objects.get(self._key(seg), start, end)
        except RemoteObjectMissing:
            raise self._missing(seg) from None
        with self._lock:
            self.counters["remote_reads"] += 1
            self.counters["remote_read_bytes"] += len(data)
        return data

    def _read_into(self, seg: int, start: int, buffer: memoryview, arrived) -> int:
        """Bytes of segment ``seg``'s object from ``start`` into ``buffer`` as they arrive (ObjectStore.read_into),
        counted."""
        try:
            count = self.objects.read_into(self._key(seg), start, buffer, arrived)
        except RemoteObjectMissing:
            raise self._missing(seg) from None
        with self._lock:
            self.counters["remote_reads"] += 1
            self.counters["remote_read_bytes"] += count
        return count

    def _missing(self, seg: int) -> CnrError:
        """The error for segment ``seg``'s object not being there: a read cache whose bucket moved on since it
        installed its index says so (nothing is damaged: reopen it to follow the bucket); anywhere else it is
        damage, RemoteObjectMissing naming the object."""
        where = self.objects.where(self._key(seg))
        if self.role == CACHE:
            try:
                pointer = read_pointer(self.objects)
            except CnrError:
                pointer = None
            installed = read_installed(self.root)
            if pointer is not None and (installed is None or not _same(pointer, installed)):
                return RemoteStorageError(
                    f"read cache {self.root!r} holds copy point {self.generation} of {self.objects.url}; the bucket "
                    f"has moved on to {pointer.generation} and no longer holds {where} (its writer dropped or "
                    "merged what read it): reopen the store to follow the bucket")
        return RemoteObjectMissing(f"reading {where}: the object is missing from the object store", where, None)

    def _remote_size(self, seg: int) -> int | None:
        with self._lock:
            if seg in self._remote:
                return self._remote[seg]
        size = self.objects.size(self._key(seg))
        if size is not None:
            with self._lock:
                self._remote[seg] = size
        return size

    def _fetch_whole(self, seg: int) -> bytes | None:
        """An evicted segment fetched whole with one GET when it is small beside the cache (at most a quarter
        of ``cache_bytes``): a restore then makes one request per segment, not one per record. Its bytes go
        into the cache (not for a readonly open of a writer's directory: that is the writer's to fill), and
        are returned: the caller reads them, whatever an eviction does meanwhile. None: read by range."""
        size = self._remote_size(seg)
        if size is None:
            raise self._missing(seg)
        if size > self.cache_bytes // 4:
            return None
        data = self._get(seg)
        if len(data) != size:
            return data
        if self.readonly and self.role != CACHE:
            return data
        path = filenames.segment_path(self.root, seg)
        try:
            self.fs.write_file_atomic(path, filenames.segment_download_tmp(self.root, seg), data)
        except (OSError, CnrError):
            return data  # (a read-only directory, a full disk: the bytes were read all the same)
        with self._lock:
            self._cache[seg] = size
            self._evicted.discard(seg)
        fs.pause_point("remote_fetched", seg)
        self._evict(keep=seg)
        return data

    def path(self, seg: int) -> str:
        if seg in self._evicted or not os.path.exists(filenames.segment_path(self.root, seg)):
            return self.objects.where(self._key(seg))
        return super().path(seg)

    def size(self, seg: int) -> int | None:
        local = super().size(seg)
        return local if local is not None else self._remote_size(seg)

    def list(self) -> list[int]:
        if not self._listed:
            found = self._list_remote()
            with self._lock:
                self._remote.update(found)
                self._listed = True
        return sorted(set(super().list()) | set(self._remote))

    def remove(self, seg: int) -> None:
        """Delete the local copy; the remote object goes at the next copy point, once the pointer names an
        index that no longer needs it."""
        with self._lock:
            self._cache.pop(seg, None)
            remote = seg in self._remote
            self._evicted.discard(seg)
        try:
            super().remove(seg)
        except FileNotFoundError:
            if not remote:
                raise

    @contextlib.contextmanager
    def scan(self, seg: int) -> Iterator[bytes]:
        if os.path.exists(filenames.segment_path(self.root, seg)):
            with super().scan(seg) as data:
                yield data
            return
        yield self._get(seg)

    def appender(self, committed, format_version, ids, *, active=None, resume=False, on_sealed=None):
        # never resume in a segment of an earlier process: every segment on disk at open is final (it may be
        # uploaded whole and evicted); appends start a new one
        return super().appender(committed, format_version, ids, active=None, resume=False, on_sealed=on_sealed)

    # uploads, copy points, eviction -----------------------------------------------------------------------
    def _check_owner(self) -> Pointer | None:
        """The pointer, if this store may still replace it; else this store has lost the prefix
        (``_lose``) and RemoteTakenOver is raised."""
        pointer = read_pointer(self.objects, _pointer_fix_writer(self.root))
        claiming = self._claim is not None
        if claiming:
            expected = self._claim.pointer
            if (pointer is None and expected is None) or (pointer is not None and expected is not None
                                                          and _same(pointer, expected)):
                return pointer
            if (pointer is not None and expected is not None and pointer.writer == expected.writer
                    and pointer.generation > expected.generation):
                # the writer this open takes the prefix over from went on meanwhile (a stale job's copy point,
                # between this open's recovery and its claim): the takeover replaces that pointer too -- the
                # one started last owns the prefix, and what the stale writer added since is nobody's -- but only
                # with proof that the bucket keeps what this open's index reads: after its swap the stale writer
                # deletes every segment its new snapshot does not name (docs/DESIGN.md, "Deletion only with
                # proof"), so that snapshot must name each one, at least as long
                unkept = self._not_kept_by(pointer)
                if unkept:
                    raise _recover_again(RemoteTakenOver(
                        f"{self.objects.url}: the writer {pointer.writer} went on to generation {pointer.generation} "
                        f"while this store took the prefix over from generation {expected.generation}, and its copy "
                        f"point no longer keeps what this recovery reads (segments {unkept[:4]}): nothing was "
                        "claimed. Recover from the remote into an empty directory again (its newest copy point), "
                        "and stop the other writer", pointer.writer))
                log.warning("cnrstore: %s: the writer %s went on to generation %d while this store took the prefix "
                            "over from generation %d; taking it over from there (what it added since is dropped)",
                            self.objects.url, pointer.writer, pointer.generation, expected.generation)
                return pointer
        if pointer is not None and pointer.writer == self.identity.store_id:
            return pointer
        if pointer is None and not claiming:
            return None  # the pointer was deleted (an emptied prefix): this writer's copy point makes it anew
        self._lose(pointer)
        raise self.lost

    def _not_kept_by(self, pointer: Pointer) -> list[int]:
        """The segments this store's index reads that the snapshot ``pointer`` names shorter or not at all
        (all of them if that snapshot cannot be read: no proof)."""
        with self._index.read() as view:
            need = view.segments()
        try:
            kept = snapshot_segments(self.objects, pointer)
        except (CnrError, OSError) as exc:
            log.info("cnrstore: %s: reading the snapshot of generation %d failed: %s", self.objects.url,
                     pointer.generation, exc)
            return sorted(need) or [-1]
        return sorted(seg for seg, length in need.items() if kept.get(seg, -1) < length)

    def _lose(self, pointer: Pointer | None) -> None:
        """Another writer took the prefix over: remember it (checkpoints are refused from now on) and fetch
        back every segment the local index reads that is not here, while the bucket still holds it."""
        if self.lost is not None:
            return
        writer = None if pointer is None else pointer.writer
        self.lost = RemoteTakenOver(
            f"{self.objects.url} was taken over by another store (its pointer names store {writer}"
            f"{'' if pointer is None else f', generation {pointer.generation}'}; this directory is store "
            f"{self.identity.store_id}): one writer per prefix. What this directory committed stays readable in "
            f"it; new checkpoints are refused. Stop this writer, or recover from the remote into a new "
            f"directory to go on from the bucket's newest version", writer)
        log.error("cnrstore: %s", self.lost)
        if self._index is None:
            return
        with self._index.read() as view:
            need = sorted(view.segments())
        for seg in need:
            if os.path.exists(filenames.segment_path(self.root, seg)):
                continue
            try:
                data = self._get(seg)
                self.fs.write_file_atomic(filenames.segment_path(self.root, seg),
                                          filenames.segment_download_tmp(self.root, seg), data)
            except (CnrError, OSError) as exc:
                log.error("cnrstore: could not fetch back segment %d after losing the prefix: %s", seg, exc)
                continue
            with self._lock:
                self._evicted.discard(seg)
                self._cache.pop(seg, None)  # (never evicted again: this store no longer writes the bucket)

    def sealed(self, seg: int) -> None:
        """Upload the now final segment into this writer's folder (after checking it still owns the prefix);
        a failure is logged and retried at the next copy point."""
        if self.readonly or self.lost is not None:
            return
        size = super().size(seg)
        if size is None:
            return
        with self._lock:
            self._cache[seg] = size
            uploaded = self._remote.get(seg) == size  # (a copy point uploaded it whole already)
        if uploaded:
            self._evict()
            return
        if (self.last_error is not None or self._sealing or self.every == EXPLICIT_COPY_POINTS
                or self._behind is not None):
            # the object store is failing (one attempt per copy point), or the copy point uploads it (this
            # one, sealing it; or the next, for a store whose copy points are explicit or run behind)
            return
        try:
            self._check_owner()
            self._upload(seg, size)
        except RemoteTakenOver:
            return  # (after_commit reports it)
        except CnrError as exc:
            self._failed(exc)  # (the commit's copy point backs off too: one failed request per save at most)
            log.warning("cnrstore: uploading sealed segment %d failed; its local copy is kept and the upload is "
                        "retried at a later copy point: %s", seg, exc)
            return
        self._evict()

    def _upload(self, seg: int, length: int) -> None:
        """Upload bytes ``[0, length)`` of the local segment (final, or a committed prefix of an active one)
        into this writer's folder. Another writer's segment is never uploaded: the remote must hold it."""
        if self.writers.writer_of(seg) != self.identity.store_id:
            if self._remote_size(seg) is None:
                raise RemoteObjectMissing(f"segment {seg:016x}, which store {self.writers.writer_of(seg)} wrote, is "
                                          f"missing from {self.objects.url}: the versions that read it are damaged; "
                                          "run `cnrstore verify`", self.objects.where(self._key(seg)), None)
            return
        with self._upload_lock:
            with self._lock:
                if self._remote.get(seg, -1) >= length:
                    return  # (another thread uploaded it meanwhile, as long or longer: nothing to read)
            try:
                fd = fs.open_regular(filenames.segment_path(self.root, seg), "segment")
                with builtins.open(fd, "rb") as f:
                    data = f.read(length)
            except FileNotFoundError:
                raise CorruptionError(f"segment {self.path(seg)} is missing locally and the remote {self.objects.url} "
                                      "does not hold it: the versions that read it are damaged; run `cnrstore verify`",
                                      self.path(seg), None) from None
            if len(data) != length:
                raise CorruptionError(f"segment {self.path(seg)} holds {len(data)} bytes, the index needs {length}",
                                      self.path(seg), len(data))
            fs.pause_point("remote_upload", seg)
            self.objects.put(self._key(seg), data)
            with self._lock:
                self._remote[seg] = length
        self.counters["bytes_uploaded"] += length
        self.counters["objects_uploaded"] += 1

    def copy_point(self) -> None:
        """Make the remote copy current: the pointer checked (still this store's: else RemoteTakenOver),
        every segment the index references uploaded, the index snapshot uploaded into this writer's folder,
        the pointer replaced by a compare-and-swap; then the objects no index needs deleted.
        RemoteStorageError (or RemoteObjectMissing) if the object store fails: the remote then still reads
        at the previous pointer, and the next copy point starts again."""
        if self.lost is not None:
            raise self.lost
        with self._copy_lock:
            started = time.monotonic()
            try:
                pointer = self._check_owner()
                if self._seal_writer is not None:
                    self._sealing = True  # (its upload is this copy point's, below: one attempt, not two)
                    try:
                        self._seal_writer()  # an idle writer's segment: uploaded whole now, never re-uploaded
                    finally:
                        self._sealing = False
                snapshot, segments, versions, txn = self._snapshot()
                generation = (pointer.generation if pointer is not None else 0) + 1
                key = filenames.remote_snapshot_key(generation, self.own_folder)
                self.objects.put(key, snapshot)
                fs.pause_point("remote_snapshot_uploaded", generation)
                body = encode_pointer(generation, key, len(snapshot), f"{xxhash.xxh3_64_intdigest(snapshot):016x}",
                                      self.identity.store_id, self.writers, len(versions), max(versions, default=None))
                try:
                    self.objects.put_if(filenames.REMOTE_POINTER, body, None if pointer is None else pointer.tag)
                except RemoteConflict:
                    with contextlib.suppress(CnrError):
                        self.objects.delete(key)
                    self._check_owner()  # (raises RemoteTakenOver if another writer moved it)
                    raise
            except RemoteTakenOver:
                raise
            except Exception as exc:
                self._failed(exc)
                raise
            self.generation = generation
            self._copied_txn = txn
            self.lag.copied(txn)
            with self._lock:
                self._covered = dict(segments)
            self.counters["bytes_uploaded"] += len(snapshot) + len(body)
            self.counters["objects_uploaded"] += 2
            fs.pause_point("remote_pointer_replaced", generation)
            try:
                self._collect(segments, key)
            except CnrError as exc:  # the pointer moved: what is left is deleted by a later copy point
                log.warning("cnrstore: deleting remote objects no copy point needs failed: %s", exc)
            self.last_error = None
            self._failures = 0
            self._retry_at = 0.0
            self.counters["copy_points"] += 1
            self.counters["copy_point_seconds"] += time.monotonic() - started
        self._evict()

    def _failed(self, exc: BaseException) -> None:
        self.last_error = exc
        self._failures += 1
        self._retry_at = time.monotonic() + min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (self._failures - 1))

    def _snapshot(self) -> tuple[bytes, dict[int, int], list[int], int]:
        """In one read of the index: a compact copy of it, and every segment it references uploaded (LMDB
        keeps them from GC's deletion while the read is open: delete_doomed waits for older readers).
        Returns (the copy's bytes, {segment: committed length}, versions, the read's transaction id)."""
        tmp = filenames.remote_snapshot_tmp(self.root)
        self.fs.remove_tree(tmp)
        self.fs.mkdir(tmp)
        try:
            with self._index.read() as view:
                txn = view.txn_id()
                segments = view.segments()
                versions = view.version_numbers()
                self._index.copy_to(tmp, view)
                for seg, length in sorted(segments.items()):
                    if self._remote.get(seg, -1) < length:
                        self._upload(seg, length)
            with builtins.open(filenames.index_data_path(tmp), "rb") as f:
                return f.read(), segments, versions, txn
        finally:
            self.fs.remove_tree(tmp)

    def _collect(self, snapshot_segments: dict[int, int], snapshot_key: str) -> None:
        """Delete the objects of the history's folders that neither the pointer's snapshot nor the local index
        needs (listed first, then the index read: a segment uploaded after the listing is not in it), objects
        a folder holds beyond its writer's range (a stale writer's), and every snapshot but the pointer's.
        Folders of writers that are not in this history (one that took the prefix over since) are never
        touched. Deletion only with proof (``objects.delete_with_proof``): after the listings, the pointer must
        still be the one this copy point wrote (else this store lost the prefix: nothing is deleted)."""
        writers = list(dict.fromkeys(self.writers.writers()))
        listings = {w: self.objects.list(filenames.remote_segments_dir(filenames.remote_folder(w))) for w in writers}
        snapshots = {w: self.objects.list(filenames.remote_index_dir(filenames.remote_folder(w))) for w in writers}
        with self._index.read() as view:
            keep = set(snapshot_segments) | set(view.segments()) | set(schema.DOOMED_SEGMENTS.get(view))
        doomed: dict[str, tuple[int, str]] = {}  # key -> (segment, folder's writer)
        for writer, listing in listings.items():
            folder = filenames.remote_folder(writer)
            for name in listing:
                seg = filenames.parse_segment_name(name)
                if seg is None or (seg in keep and self.writers.writer_of(seg) == writer):
                    continue
                doomed[filenames.remote_segment_key(seg, folder)] = (seg, writer)
        garbage = list(doomed)
        for w, names in snapshots.items():
            index_dir = filenames.remote_index_dir(filenames.remote_folder(w))
            garbage += [key for name in names if filenames.parse_remote_snapshot_name(name) is not None
                        and (key := f"{index_dir}/{name}") != snapshot_key]
        generation = self.generation

        def proof(keys: list[str]) -> None:
            pointer = read_pointer(self.objects, _pointer_fix_writer(self.root))
            if pointer is None or pointer.writer != self.identity.store_id or pointer.generation != generation:
                if pointer is not None and pointer.writer != self.identity.store_id:
                    self._lose(pointer)
                    raise self.lost
                raise RemoteConflict(f"{self.objects.where(filenames.REMOTE_POINTER)} is no longer the copy point "
                                     f"{generation} this store wrote: nothing deleted")
            if pointer.snapshot in keys:
                raise RemoteConflict(f"the pointer names {pointer.snapshot}: nothing deleted")

        for key in delete_with_proof(self.objects, garbage, proof):
            if key not in doomed:
                continue
            seg, writer = doomed[key]
            self.counters["remote_segments_deleted"] += 1
            if self.writers.writer_of(seg) == writer:
                with self._lock:
                    self._remote.pop(seg, None)
                    self._evicted.discard(seg)

    def sync_cache(self) -> None:
        """Bring the local copies within ``cache_bytes`` now (after a change of it)."""
        self._evict()

    def _evictable(self, seg: int, size: int) -> bool:
        if self.role == CACHE:
            return True  # a read cache's copies all came from the bucket
        return self._covered.get(seg) == size and self._remote.get(seg) == size

    def _evict(self, keep: int | None = None) -> None:
        """Delete local copies of segments the remote holds whole, least recently read first, until the
        evictable ones fit ``cache_bytes``. A writer evicts only what a pointer it wrote names (a segment a
        stale writer evicted could otherwise be deleted by the writer that took over). A readonly open of a
        writer's directory deletes nothing: beside that writer it cannot tell its active segment from a
        sealed one; the writer's own evictions bound the directory."""
        if self.readonly and self.role != CACHE:
            return
        with self._lock:
            total = sum(self._cache.values())
            for seg in list(self._cache):
                if total <= self.cache_bytes:
                    break
                size = self._cache[seg]
                if seg == keep or not self._evictable(seg, size):
                    continue  # not named by a pointer yet (the next copy point does)
                with contextlib.suppress(FileNotFoundError):
                    super().remove(seg)  # (the local copy only: the remote keeps it)
                del self._cache[seg]
                self._evicted.add(seg)
                total -= size
                self.counters["segments_evicted"] += 1

    def cached_bytes(self) -> int:
        """Bytes of the local copies of final segments (what ``cache_bytes`` bounds)."""
        with self._lock:
            return sum(self._cache.values())

    def status(self) -> dict:
        """What ``Store.stats()["remote"]`` reports."""
        with self._lock:
            cached = sum(self._cache.values())
            return {"url": self.objects.url, "role": self.role, "store_id": self.identity.store_id,
                    "generation": self.generation, "cached_bytes": cached, "cache_bytes": self.cache_bytes,
                    "over_bound_bytes": max(0, cached - self.cache_bytes),
                    "remote_segments": len(self._remote), "evicted_segments": len(self._evicted),
                    "conditional_writes": self.objects.conditional_writes,
                    "taken_over": None if self.lost is None else str(self.lost),
                    "last_error": None if self.last_error is None else str(self.last_error),
                    "next_retry_s": max(0.0, self._retry_at - time.monotonic()) if self.last_error else 0.0,
                    "copy_points_behind": self._behind is not None, "lag_versions": self.lag.versions(),
                    "lag_s": self.lag.seconds(),
                    **self.counters}
