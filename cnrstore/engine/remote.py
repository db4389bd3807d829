"""The object-store tier: a store whose sealed segments live under a remote prefix (``s3://bucket/prefix``
or any fsspec URL), read back by byte range, with a bounded local cache; the index and the active
segments stay local, and their remote copy is made at copy points (docs/DESIGN.md, "The remote tier").

Three parts:

- ``ObjectStore``: the seam for remote effects (put, ranged get, size, list, delete of objects named
  relative to the prefix), over an fsspec file system (s3fs for ``s3://``). Every third-party error is
  wrapped here: RemoteObjectMissing for an object that is not there, RemoteStorageError for anything
  else the client could not get through after its own retries. Tests wrap it to record every put and
  delete (the crash-state explorer) and put a fault-injecting proxy in front of the endpoint.
- ``RemoteSegmentStorage``: the ``SegmentStorage`` (storage.py) of such a store. Local files under
  ``segments/`` as before; a segment is uploaded when it is sealed (``sealed``), after which its local
  copy is cache, evicted least-recently-read first beyond ``cache_bytes``; reads of an evicted segment go
  to the object store by range and are checked by the record checksums as every read is.
- Copy points (``copy_point``): after every ``every``-th committed checkpoint and at close, the writer
  seals its idle segment, uploads every segment the index references that the remote lacks (or holds
  shorter), uploads a compact copy of the index as a new immutable object, then replaces the pointer
  ``CURRENT`` naming it. Only then are remote segments no index needs deleted (GC, drop and merge freed
  them locally earlier): a crash at any point leaves the remote readable at the last pointer.

``prepare`` gets the local directory ready before the engine opens it: on an empty directory it fetches
the pointer's index snapshot (recovery from the remote alone); it also keeps the one-writer-per-prefix
guard (the pointer names the store id of its writer).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from typing import Callable, Iterator, NamedTuple

import numpy as np
import xxhash

from . import filenames, fs, schema
from .marker import marker_bytes
from .opening import check_no_leftovers, find
from .storage import LocalSegmentStorage
from ..errors import (CnrError, CorruptionError, InvalidArgument, RemoteObjectMissing, RemoteStorageError,
                      StoreNotFound)

log = logging.getLogger("cnrstore.engine.remote")

#: On remote storage: the pointer's format (docs/FORMAT.md, "Remote layout"). Never reuse a number.
POINTER_FORMAT = 1
#: Default copy-point interval: a copy point after every committed checkpoint.
DEFAULT_EVERY = 1
#: Default bound on the local copies of sealed segments (bytes).
DEFAULT_CACHE_BYTES = 4 << 30

_CHECK = "what to check: the endpoint URL and network, the credentials and the bucket (remote_options)"


def _fsspec():
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - the s3 extra is missing
        raise InvalidArgument("remote= needs fsspec (and s3fs for s3:// URLs): pip install 'cnrstore[s3]'") from exc
    return fsspec


class ObjectStore:
    """Objects under one remote prefix, named relative to it (``segments/<id>.seg``, ...). Thread-safe.

    Every method raises RemoteObjectMissing (a CorruptionError too) for an object that is not there where
    one must be, and RemoteStorageError for any other failure the client's retries did not get through
    (endpoint down, credentials refused, throttling that outlasted the retries)."""

    def __init__(self, url: str, options: dict | None = None):
        """``url``: an fsspec URL (``s3://bucket/prefix``, ``file:///dir``, ``memory://x``); ``options`` go to
        the file system (``fsspec.filesystem``), e.g. ``{"client_kwargs": {"endpoint_url": ...}}``."""
        if not isinstance(url, str) or "://" not in url:
            raise InvalidArgument(f"remote={url!r} is not a URL: pass e.g. 's3://bucket/prefix'")
        opts = {"skip_instance_cache": True, **(options or {})}
        try:
            self.fs, root = _fsspec().core.url_to_fs(url, **opts)
        except ImportError as exc:
            raise InvalidArgument(f"remote={url!r}: {exc} (for s3:// install 'cnrstore[s3]')") from exc
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"remote={url!r} or remote_options are not valid: {exc}") from exc
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")

    def where(self, key: str) -> str:
        """The URL of object ``key`` (for messages)."""
        return f"{self.url}/{key}"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    @contextlib.contextmanager
    def _calling(self, what: str, key: str, *, reading: bool = True) -> Iterator[None]:
        """Client errors as typed ones: a missing object that was to be read RemoteObjectMissing (a
        CorruptionError); anything else, a write to a bucket that does not exist included,
        RemoteStorageError."""
        try:
            yield
        except CnrError:
            raise
        except FileNotFoundError as exc:
            if not reading:  # (s3fs: NoSuchBucket) not damage: the URL names no bucket or folder
                raise RemoteStorageError(f"{what} {self.where(key)}: the bucket (or folder) does not exist "
                                         f"({exc}); create it, or check the URL") from exc
            raise RemoteObjectMissing(f"{what} {self.where(key)}: the object is missing from the object store",
                                      self.where(key), None) from exc
        except Exception as exc:  # noqa: BLE001 - the boundary: every client error becomes a typed one
            text = f"{type(exc).__name__}: {exc}"
            hint = _CHECK
            # s3fs reports throttling (503 SlowDown, Service Unavailable) as EBUSY
            if getattr(exc, "errno", None) == errno.EBUSY or any(t in text for t in ("SlowDown", "Throttl")):
                hint = ("the object store kept throttling (503 SlowDown) past the client's retries: save less "
                        "often (a larger remote_every), or raise the client's retries (remote_options "
                        "config_kwargs={'retries': {'max_attempts': N}})")
            raise RemoteStorageError(f"{what} {self.where(key)} failed after the client's retries: {text}; "
                                     f"{hint}") from exc

    def put(self, key: str, data) -> None:
        """Store ``data`` (bytes-like) as object ``key``, replacing it whole (an object store's PUT is
        atomic: readers see the old object or the new one), and check the stored size."""
        data = bytes(data)
        with self._calling("uploading", key, reading=False):
            self.fs.pipe_file(self._path(key), data)
        stored = self.size(key)
        if stored != len(data):
            raise RemoteStorageError(f"uploading {self.where(key)}: the object store holds {stored} bytes, "
                                     f"not the {len(data)} uploaded; {_CHECK}")

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of object ``key`` (the whole object by default)."""
        with self._calling("reading", key):
            return self.fs.cat_file(self._path(key), start=start, end=end)

    def size(self, key: str) -> int | None:
        """Size of object ``key``, or None if there is none."""
        try:
            with self._calling("asking the size of", key):
                self.fs.invalidate_cache(self._path(key))
                return int(self.fs.info(self._path(key))["size"])
        except RemoteObjectMissing:
            return None

    def list(self, folder: str) -> dict[str, int]:
        """{name: size} of the objects in ``folder`` (one level)."""
        path = self._path(folder)
        try:
            with self._calling("listing", folder):
                self.fs.invalidate_cache(path)
                entries = self.fs.ls(path, detail=True)
        except RemoteObjectMissing:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries
                if e.get("type") != "directory"}

    def delete(self, key: str) -> None:
        """Delete object ``key`` (nothing if it is gone already)."""
        with contextlib.suppress(RemoteObjectMissing), self._calling("deleting", key):
            self.fs.rm_file(self._path(key))


# -- the pointer --------------------------------------------------------------------------------------------

def encode_pointer(generation: int, snapshot: bytes, store_id: str, versions: list[int]) -> bytes:
    """The pointer object naming snapshot ``generation`` (docs/FORMAT.md, "Remote layout")."""
    body = {"format": POINTER_FORMAT, "generation": generation,
            "snapshot": filenames.remote_snapshot_key(generation), "snapshot_bytes": len(snapshot),
            "snapshot_xxh3": f"{xxhash.xxh3_64_intdigest(snapshot):016x}", "store_id": store_id,
            "versions": len(versions), "newest_version": max(versions, default=None), "written": time.time()}
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"pointer": body, "xxh3": f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"},
                      sort_keys=True).encode() + b"\n"


def decode_pointer(data: bytes, where: str) -> dict:
    """The pointer's body; CorruptionError if it is damaged or of a newer format."""
    try:
        outer = json.loads(data)
        body = outer["pointer"]
        ok = outer["xxh3"] == f"{xxhash.xxh3_64_intdigest(json.dumps(body, sort_keys=True).encode()):016x}"
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CorruptionError(f"the remote pointer {where} is damaged (bad JSON or checksum)", where, 0)
    if body.get("format") != POINTER_FORMAT:
        raise CorruptionError(f"the remote pointer {where} has format {body.get('format')}, this cnrstore reads "
                              f"{POINTER_FORMAT}: upgrade cnrstore", where, 0)
    return body


def read_pointer(objects: ObjectStore) -> dict | None:
    """The remote's pointer (None if it has none yet)."""
    try:
        data = objects.get(filenames.REMOTE_POINTER)
    except RemoteObjectMissing:
        return None
    return decode_pointer(data, objects.where(filenames.REMOTE_POINTER))


def fetch_snapshot(objects: ObjectStore, pointer: dict) -> bytes:
    """The index snapshot ``pointer`` names, checked against the size and hash the pointer records."""
    key = pointer["snapshot"]
    data = objects.get(key)
    if len(data) != pointer["snapshot_bytes"] or f"{xxhash.xxh3_64_intdigest(data):016x}" != pointer["snapshot_xxh3"]:
        raise CorruptionError(f"the index snapshot {objects.where(key)} does not match the pointer "
                              f"{objects.where(filenames.REMOTE_POINTER)} (size or checksum)", objects.where(key), 0)
    return data


# -- the local side -----------------------------------------------------------------------------------------

def _read_identity(root: str) -> dict | None:
    try:
        return json.loads(fs.read_regular(filenames.remote_path(root), 1 << 20, "remote identity file",
                                          'a store\'s files are regular files: rewrite it as {"url": URL, "store_id": ID}'))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise CorruptionError(f"{filenames.remote_path(root)} is damaged ({exc}); it names the store's remote: "
                              "rewrite it as {\"url\": URL, \"store_id\": ID} or recover into a new directory",
                              filenames.remote_path(root), 0) from exc


def _identity_for(root: str, url: str) -> dict | None:
    """The ``REMOTE`` identity of the store at ``root`` (None if it has none); InvalidArgument if it names
    another remote than ``url``."""
    ident = _read_identity(root)
    if ident is not None and ident["url"].rstrip("/") != url:
        raise InvalidArgument(f"store {root!r} keeps its segments at {ident['url']!r}, not {url!r}: pass "
                              "that remote= (or recover from this remote into an empty directory)")
    return ident


def _write_identity(root: str, url: str, store_id: str, filesystem: fs.FileSystem, after: str | None = None) -> None:
    """``after``: the store id whose pointer this store took over (recovered from), until its own replaces it."""
    data = json.dumps({"url": url, "store_id": store_id, "after": after}).encode()
    filesystem.write_file_atomic(filenames.remote_path(root), filenames.remote_path(root) + ".tmp", data)


def kept_remotely(root: str) -> str | None:
    """The URL of the remote tier of the local store at ``root``, or None if it has none."""
    ident = _read_identity(root)
    return None if ident is None else ident["url"]


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


class Prepared(NamedTuple):
    """What ``prepare`` found: the store id this process writes (or reads) as, the store ids whose pointer
    it may replace (its own, and the one it recovered from), and the generation the remote's pointer names
    (0: none yet)."""

    store_id: str
    owners: set
    generation: int


def prepare(root: str, objects: ObjectStore, filesystem: fs.FileSystem, *, readonly: bool,
            create: bool) -> Prepared:
    """Get the local directory ``root`` ready for a store whose remote is ``objects`` (``Prepared``).

    - ``root`` holds a store: its ``REMOTE`` file must name this URL (InvalidArgument otherwise); a
      writable open is refused (RemoteStorageError) when the pointer names another store id: another
      writer took the prefix over (recovered it elsewhere). A store with no ``REMOTE`` file is attached
      to the remote: its first copy point uploads it.
    - ``root`` holds no store and the remote has a pointer: recovery from the remote alone. The snapshot
      is downloaded (checked against the pointer) as the local index, then the marker is written last; a
      writable open takes the prefix over under a new store id.
    - neither: with ``create`` the new store's ``REMOTE`` file is written (the engine then creates the
      store), else StoreNotFound.
    """
    url = objects.url
    pointer = read_pointer(objects)
    generation = pointer["generation"] if pointer is not None else 0
    if find(root, readonly):
        ident = _identity_for(root, url)
        if ident is None:
            if readonly:
                raise InvalidArgument(f"store {root!r} has no remote tier: open it without remote= (or writable, "
                                      f"to attach it to {url!r})")
            if pointer is not None:
                raise RemoteStorageError(f"{url} already holds another store's copy (its pointer names store "
                                         f"{pointer['store_id']}); choose another prefix to attach {root!r} to")
            ident = {"url": url, "store_id": uuid.uuid4().hex}
            _write_identity(root, url, ident["store_id"], filesystem)
        owners = {ident["store_id"], ident.get("after")} - {None}
        if not readonly and pointer is not None and pointer["store_id"] not in owners:
            raise RemoteStorageError(
                f"{url} is written by another store (its pointer names store {pointer['store_id']}, this local "
                f"directory is store {ident['store_id']}): one writer per prefix. Another machine recovered it "
                "and writes it now; open this one readonly, or recover from the remote into an empty directory")
        return Prepared(ident["store_id"], owners, generation)
    if pointer is None:
        if not create or readonly:
            raise StoreNotFound(f"no cnrstore store at {root!r}, and {url} holds none (no "
                                f"{filenames.REMOTE_POINTER}){'' if readonly else '; pass create=True to make one'}")
        store_id = uuid.uuid4().hex
        os.makedirs(root, exist_ok=True)
        if not set(os.listdir(root)) - filenames.BEFORE_MARKER:  # (else the engine's create refuses the directory)
            _write_identity(root, url, store_id, filesystem)
        return Prepared(store_id, {store_id}, generation)
    _recover_from_remote(root, objects, pointer, filesystem)
    store_id = pointer["store_id"] if readonly else uuid.uuid4().hex
    _write_identity(root, url, store_id, filesystem, after=pointer["store_id"])
    # the marker last: a store exists exactly when its marker does
    filesystem.write_file_atomic(filenames.marker_path(root), filenames.marker_tmp_path(root), marker_bytes())
    return Prepared(store_id, {store_id, pointer["store_id"]}, generation)


def _recover_from_remote(root: str, objects: ObjectStore, pointer: dict, filesystem: fs.FileSystem) -> None:
    """Lay out a store's index (the pointer's snapshot) and an empty segments/ in ``root``, which must hold no
    store files yet (the marker is written by the caller)."""
    os.makedirs(root, exist_ok=True)
    check_no_leftovers(root, "recover from the remote into an empty or new directory")
    data = fetch_snapshot(objects, pointer)
    if not os.path.isdir(filenames.index_dir(root)):
        filesystem.mkdir(filenames.index_dir(root))
    LocalSegmentStorage.create(root, filesystem)
    index_file = filenames.index_data_path(filenames.index_dir(root))
    filesystem.write_file_atomic(index_file, index_file + ".tmp", data)
    filesystem.fsync_dir(root)


def open_storage(root: str, url: str, options: dict | None, filesystem: fs.FileSystem, *, readonly: bool,
                 create: bool, cache_bytes: int | None = None, every: int | None = None) -> "RemoteSegmentStorage":
    """The storage of the store at ``root`` (an absolute path) with its remote at ``url``: ``prepare``s the
    directory (recovering the store from the remote into an empty one), then connects."""
    if cache_bytes is None:
        cache_bytes = DEFAULT_CACHE_BYTES
    if every is None:
        every = DEFAULT_EVERY
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise InvalidArgument(f"cache_bytes={cache_bytes!r}: pass a byte count >= 0")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InvalidArgument(f"remote_every={every!r}: pass a commit count >= 1")
    return storage_for(root, ObjectStore(url, options), filesystem, readonly=readonly, create=create,
                       cache_bytes=cache_bytes, every=every)


def repair_storage(root: str, url: str, options: dict | None, filesystem: fs.FileSystem) -> "RemoteSegmentStorage":
    """The storage ``cnrstore repair --remote`` scans (the index is lost or damaged): every segment object
    under the prefix counts, as well as the local files; nothing is uploaded, evicted or deleted."""
    objects = ObjectStore(url, options)
    ident = _identity_for(root, objects.url) or {}
    storage = RemoteSegmentStorage(root, filesystem, objects, store_id=ident.get("store_id", ""), readonly=True)
    storage.adopt_every_object()
    return storage


def storage_for(root: str, objects: ObjectStore, filesystem: fs.FileSystem, *, readonly: bool, create: bool,
                cache_bytes: int = DEFAULT_CACHE_BYTES, every: int = DEFAULT_EVERY) -> "RemoteSegmentStorage":
    """``open_storage`` with the object store given (a test's recording one)."""
    found = prepare(root, objects, filesystem, readonly=readonly, create=create)
    return RemoteSegmentStorage(root, filesystem, objects, store_id=found.store_id, owners=found.owners,
                                generation=found.generation, readonly=readonly,
                                cache_bytes=cache_bytes, every=every)


class RemoteSegmentStorage(LocalSegmentStorage):
    """Segments under ``<root>/segments/`` while active or cached, and under the remote prefix once sealed.

    Reads go to the local copy when there is one and to the object store by range otherwise. The local
    copy of a sealed segment is evictable once the remote holds it whole; ``cache_bytes`` bounds the
    evictable copies (active segments, and sealed ones whose upload failed, are never evicted and come on
    top). A failed upload is logged and retried at the next copy point; the commit it followed stands.
    While the last upload or copy point failed, segments sealed meanwhile wait for the next copy point (so
    that a failing endpoint costs one round of client retries per copy point, not one per segment)."""

    def __init__(self, root: str, filesystem: fs.FileSystem, objects: ObjectStore, *, store_id: str,
                 owners: set[str] | None = None, generation: int = 0, readonly: bool, cache_bytes: int = DEFAULT_CACHE_BYTES, every: int = DEFAULT_EVERY):
        super().__init__(root, filesystem)
        self.objects = objects
        self.store_id = store_id
        self.owners = set(owners or ()) | {store_id}  # whose pointer this store may replace
        self.readonly = readonly
        self.cache_bytes = cache_bytes
        self.every = every
        self._lock = threading.RLock()  # guards the maps below
        self._copy_lock = threading.Lock()  # one copy point at a time
        self._remote: dict[int, int] = {}  # segment -> size of its remote object (of this store)
        self._cache: "OrderedDict[int, int]" = OrderedDict()  # final local copies, least recently read first
        self._evicted: set[int] = set()  # segments with no local copy: read remotely
        self._index = None
        self._seal_writer: Callable[[], None] | None = None
        self._commits = 0
        self._copied_txn: int | None = None  # the index transaction the last copy point uploaded
        self.generation = generation  # the pointer's, as the open found it (prepare)
        #: the last failure of an upload or copy point not yet made good (None: the remote is current as of
        #: the last copy point)
        self.last_error: BaseException | None = None
        #: counters (``Store.stats()["remote"]``)
        self.counters = {"bytes_uploaded": 0, "objects_uploaded": 0, "remote_reads": 0, "remote_read_bytes": 0,
                         "copy_points": 0, "copy_point_seconds": 0.0, "segments_evicted": 0,
                         "remote_segments_deleted": 0}

    # the engine's hooks --------------------------------------------------------------------------------
    def attach(self, index, seal_writer: Callable[[], None]) -> None:
        with index.read() as view:
            known = set(view.segments()) | set(schema.DOOMED_SEGMENTS.get(view))
        # an object this index does not know is a leftover (deleted at the next copy point): never taken for
        # the upload of a segment that may get its id
        local = self._adopt(lambda seg: seg in known)
        with self._lock:
            self._index, self._seal_writer = index, seal_writer
            for seg in sorted(local):  # the writable open never appends to these again (appender)
                size = os.path.getsize(filenames.segment_path(self.root, seg))
                self._cache[seg] = size
        self._evict()

    def adopt_every_object(self) -> None:
        """Count every segment object under the prefix as this store's (repair: no index says which are)."""
        self._adopt(lambda seg: True)

    def _adopt(self, ours: Callable[[int], bool]) -> set[int]:
        """Count the segment objects under the prefix that ``ours`` accepts as this store's uploads, and those
        with no local copy as evicted; returns the local segments' ids."""
        listing = self.objects.list(filenames.REMOTE_SEGMENTS_DIR)
        local = set(super().list())
        with self._lock:
            for name, size in listing.items():
                seg = filenames.parse_segment_name(name)
                if seg is not None and ours(seg):
                    self._remote[seg] = size
            self._evicted = set(self._remote) - local
        return local

    def after_commit(self) -> None:
        if self.readonly:
            return
        self._commits += 1
        if self._commits % self.every:
            return
        try:
            self.copy_point()
        except Exception as exc:  # noqa: BLE001 - the commit has happened: never fail it after the fact
            self.last_error = exc
            log.warning("cnrstore: the remote copy point after a commit failed; the commit stands locally and "
                        "the copy is retried at the next one: %s: %s", type(exc).__name__, exc)

    def flush(self) -> None:
        if self.readonly or self._index is None:
            return
        with self._index.read() as view:
            unchanged = view.txn_id() == self._copied_txn and self.last_error is None
        if not unchanged:
            self.copy_point()

    # reads -------------------------------------------------------------------------------------------
    def read(self, seg: int, offset: int, length: int) -> np.ndarray:
        if seg not in self._evicted:
            fs.pause_point("remote_read_local", seg)
            try:
                view = super().read(seg, offset, length)
            except CorruptionError:
                if seg not in self._remote or os.path.exists(filenames.segment_path(self.root, seg)):
                    raise
                with self._lock:  # the local copy was evicted meanwhile (or lost): the remote holds it
                    self._evicted.add(seg)
            else:
                if seg in self._cache:
                    with self._lock:
                        if seg in self._cache:
                            self._cache.move_to_end(seg)
                return view
        if self._fetch_whole(seg):
            return super().read(seg, offset, length)
        key = filenames.remote_segment_key(seg)
        data = self.objects.get(key, offset, offset + length)
        with self._lock:
            self.counters["remote_reads"] += 1
            self.counters["remote_read_bytes"] += len(data)
        if len(data) != length:
            raise CorruptionError(f"remote segment {self.objects.where(key)} holds fewer bytes than the index needs "
                                  f"({offset + len(data)} < {offset + length})", self.objects.where(key), offset)
        return np.frombuffer(data, dtype=np.uint8)

    def _fetch_whole(self, seg: int) -> bool:
        """Bring an evicted segment back into the cache with one GET when it is small beside the cache (at most
        a quarter of ``cache_bytes``): a restore then makes one request per segment, not one per record.
        False (read by range instead) for a larger segment, or when the local copy cannot be written."""
        size = self._remote.get(seg)
        if size is None or size > self.cache_bytes // 4:
            return False
        data = self.objects.get(filenames.remote_segment_key(seg))
        if len(data) != size:
            return False
        path = filenames.segment_path(self.root, seg)
        try:
            self.fs.write_file_atomic(path, filenames.segment_download_tmp(self.root, seg), data)
        except (OSError, CnrError):
            return False  # (a read-only directory, a full disk: ranged reads still work)
        with self._lock:
            self._cache[seg] = size
            self._evicted.discard(seg)
            self.counters["remote_reads"] += 1
            self.counters["remote_read_bytes"] += size
        self._evict()
        return True

    def path(self, seg: int) -> str:
        if seg in self._evicted:
            return self.objects.where(filenames.remote_segment_key(seg))
        return super().path(seg)

    def size(self, seg: int) -> int | None:
        local = super().size(seg)
        return local if local is not None else self._remote.get(seg)

    def list(self) -> list[int]:
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
        yield self.objects.get(filenames.remote_segment_key(seg))

    def appender(self, committed, format_version, ids, *, active=None, resume=False, on_sealed=None):
        # never resume in a segment of an earlier process: every segment on disk at open is final (it may be
        # uploaded whole and evicted); appends start a new one
        return super().appender(committed, format_version, ids, active=None, resume=False, on_sealed=on_sealed)

    # uploads, copy points, eviction -----------------------------------------------------------------------
    def sealed(self, seg: int) -> None:
        """Upload the now final segment; a failure is logged and retried at the next copy point."""
        if self.readonly:
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
        if self.last_error is not None:
            return  # the object store is failing: one attempt per copy point, not one per sealed segment
        try:
            self._upload(seg, size)
        except CnrError as exc:
            self.last_error = exc
            log.warning("cnrstore: uploading sealed segment %d failed; its local copy is kept and the upload is "
                        "retried at the next copy point: %s", seg, exc)
            return
        self._evict()

    def _upload(self, seg: int, length: int) -> None:
        """Upload bytes ``[0, length)`` of the local segment (final, or a committed prefix of an active one)."""
        try:
            with builtins.open(filenames.segment_path(self.root, seg), "rb") as f:
                data = f.read(length)
        except FileNotFoundError:
            raise CorruptionError(f"segment {self.path(seg)} is missing locally and the remote {self.objects.url} "
                                  "does not hold it: the versions that read it are damaged; run `cnrstore verify`",
                                  self.path(seg), None) from None
        if len(data) != length:
            raise CorruptionError(f"segment {self.path(seg)} holds {len(data)} bytes, the index needs {length}",
                                  self.path(seg), len(data))
        fs.pause_point("remote_upload", seg)
        self.objects.put(filenames.remote_segment_key(seg), data)
        with self._lock:
            self._remote[seg] = length
        self.counters["bytes_uploaded"] += length
        self.counters["objects_uploaded"] += 1

    def copy_point(self) -> None:
        """Make the remote copy current: every segment the index references uploaded, the index snapshot
        uploaded as a new object, the pointer replaced; then the remote objects no index needs deleted.
        RemoteStorageError (or RemoteObjectMissing) if the object store fails: the remote then still reads
        at the previous pointer, and the next copy point starts again."""
        with self._copy_lock:
            started = time.monotonic()
            if self._seal_writer is not None:
                self._seal_writer()  # an idle writer's segment: uploaded whole now, never re-uploaded
            pointer = read_pointer(self.objects)
            if pointer is not None and pointer["store_id"] not in self.owners:
                raise RemoteStorageError(f"{self.objects.url} was taken over by another store (its pointer names "
                                         f"store {pointer['store_id']}): this store no longer writes there. Close it")
            tmp = filenames.remote_snapshot_tmp(self.root)
            self.fs.remove_tree(tmp)
            self.fs.mkdir(tmp)
            try:
                # one read of the index: the snapshot is its state, and LMDB keeps every segment it references
                # from GC's deletion while the read is open (delete_doomed waits for older readers)
                with self._index.read() as view:
                    txn = view.txn_id()
                    segments = view.segments()
                    versions = view.version_numbers()
                    self._index.copy_to(tmp, view)
                    for seg, length in sorted(segments.items()):
                        if self._remote.get(seg, -1) < length:
                            self._upload(seg, length)
                with builtins.open(filenames.index_data_path(tmp), "rb") as f:
                    snapshot = f.read()
            finally:
                self.fs.remove_tree(tmp)
            generation = self.generation + 1
            self.objects.put(filenames.remote_snapshot_key(generation), snapshot)
            fs.pause_point("remote_snapshot_uploaded", generation)
            self.objects.put(filenames.REMOTE_POINTER, encode_pointer(generation, snapshot, self.store_id, versions))
            self.generation = generation
            self._copied_txn = txn
            self.counters["bytes_uploaded"] += len(snapshot) + 1
            self.counters["objects_uploaded"] += 2
            fs.pause_point("remote_pointer_replaced", generation)
            self._collect(set(segments), generation)
            self.last_error = None
            self.counters["copy_points"] += 1
            self.counters["copy_point_seconds"] += time.monotonic() - started
        self._evict()

    def _collect(self, snapshot_segments: set[int], generation: int) -> None:
        """Delete the remote objects neither the pointer's snapshot nor the local index needs (listed first,
        then the index read: a segment uploaded after the listing is not in it)."""
        listing = self.objects.list(filenames.REMOTE_SEGMENTS_DIR)
        snapshots = self.objects.list(filenames.REMOTE_INDEX_DIR)
        with self._index.read() as view:
            keep = snapshot_segments | set(view.segments()) | set(schema.DOOMED_SEGMENTS.get(view))
        for name in listing:
            seg = filenames.parse_segment_name(name)
            if seg is not None and seg not in keep:
                self.objects.delete(filenames.remote_segment_key(seg))
                self.counters["remote_segments_deleted"] += 1
                with self._lock:
                    self._remote.pop(seg, None)
                    self._evicted.discard(seg)
        for name in snapshots:
            gen = filenames.parse_remote_snapshot_name(name)
            if gen is not None and gen < generation:
                self.objects.delete(filenames.remote_snapshot_key(gen))

    def sync_cache(self) -> None:
        """Bring the local copies within ``cache_bytes`` now (after a change of it)."""
        self._evict()

    def _evict(self) -> None:
        """Delete local copies of segments the remote holds whole, least recently read first, until the
        evictable ones fit ``cache_bytes``. A readonly open deletes nothing: beside a writer of another
        process it cannot tell that writer's active segment (whose committed prefix the remote may hold
        whole) from a sealed one; the writer's own evictions bound the directory."""
        if self.readonly:
            return
        with self._lock:
            total = sum(self._cache.values())
            for seg in list(self._cache):
                if total <= self.cache_bytes:
                    break
                size = self._cache[seg]
                if self._remote.get(seg) != size:
                    continue  # not uploaded whole yet (the next copy point does)
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

    def remote_status(self) -> dict:
        """What ``Store.stats()["remote"]`` reports."""
        with self._lock:
            return {"url": self.objects.url, "generation": self.generation, "cached_bytes": sum(self._cache.values()),
                    "cache_bytes": self.cache_bytes, "remote_segments": len(self._remote),
                    "evicted_segments": len(self._evicted),
                    "last_error": None if self.last_error is None else str(self.last_error), **self.counters}
