"""The object-store seam of the remote tier: objects named relative to one prefix (``segments/<id>.seg``,
...), put whole, read whole or by range, sized, listed, deleted, and the pointer replaced by a
compare-and-swap (docs/DESIGN.md, "The remote tier").

``ObjectStore`` is the seam (tests put a recording or fault-injecting one in its place); its default
``get_tagged`` / ``put_if`` are a read-then-write check, atomic only within one process.
``FsspecObjectStore`` reaches a real endpoint through fsspec (s3fs for ``s3://``):

- ``read_into`` streams a ranged GET's body into a buffer as it arrives, telling the caller how much has landed
  (planned reads, range_fetch.py, use a record as soon as its bytes are there);
- every request finishes within a deadline (``timeout_s`` plus a second per ``TIMEOUT_BYTES_PER_S`` it
  moves), whatever the client's own retries do: a hung endpoint costs a request that much, never more;
- on S3 the pointer's compare-and-swap is a conditional PUT (``If-Match`` on the ETag last read,
  ``If-None-Match: *`` to create), which the endpoint refuses atomically with 412 when another writer
  replaced the object first (``RemoteConflict``); elsewhere (``file://``, ``memory://``, gcsfs) it is the
  read-then-write check, and ``conditional_writes`` is False;
- every third-party error is wrapped: ``RemoteObjectMissing`` (a CorruptionError) for an object to be
  read that is not there, ``RemoteStorageError`` for anything else (an upload to a bucket that does not
  exist included), throttling and deadlines named as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import threading
from typing import Callable, Iterable, Iterator

import xxhash

from ..errors import CnrError, InvalidArgument, RemoteConflict, RemoteObjectMissing, RemoteStorageError

#: Default deadline of one object-store request, in seconds (``open(remote_timeout_s=...)``) ...
DEFAULT_TIMEOUT_S = 60.0
#: ... plus one second per this many bytes the request moves (a 256 MiB segment: 32 s more).
TIMEOUT_BYTES_PER_S = 8 << 20
#: botocore's timeouts when remote_options set none (its defaults are 60 s each, with retries on top)
_S3_CONNECT_TIMEOUT_S = 10
_S3_READ_TIMEOUT_S = 30

_CHECK = "what to check: the endpoint URL and network, the credentials and the bucket (remote_options)"


def _fsspec():
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - the s3 extra is missing
        raise InvalidArgument("remote= needs fsspec (and s3fs for s3:// URLs): pip install 'cnrstore[s3]'") from exc
    return fsspec


def delete_with_proof(objects: "ObjectStore", keys: Iterable[str], proof: Callable[[list[str]], object]) -> list[str]:
    """Deletion only with proof (docs/DESIGN.md, "Deletion only with proof"): the one way cnrstore deletes
    objects of a bucket that a pointer could name. ``keys`` come from what the caller read *before* this call
    (a listing, the pointer it swapped); ``proof(keys)`` then reads the pointer the caller owns and raises
    (``RemoteTakenOver``, ``RemoteConflict``) unless it is still the caller's and names none of ``keys``;
    only then are they deleted. An object put after the caller's listing is not among ``keys``, and a job or
    writer that takes the pointer over puts its objects only after its claim, which comes after the proof's
    read: nothing a current pointer names, or a new owner wrote, is deleted. Returns the keys deleted (in
    order); none, and no request, if ``keys`` is empty."""
    keys = sorted(set(keys))
    if keys:
        proof(keys)
        for key in keys:
            objects.delete(key)
    return keys


def content_tag(data: bytes) -> str:
    """The tag ``ObjectStore.get_tagged`` gives an object where the endpoint has no ETag: its XXH3."""
    return f"x{xxhash.xxh3_64_intdigest(data):016x}"


class ObjectStore:
    """Objects under one remote prefix. Thread-safe. Subclasses implement ``put``, ``get``, ``size``,
    ``list`` and ``delete``; ``get_tagged`` and ``put_if`` default to a check made by reading first.

    Every method raises RemoteObjectMissing (a CorruptionError too) for an object that must be there and
    is not, and RemoteStorageError for any other failure the client did not get through."""

    url: str = "mem://"
    #: the endpoint itself refuses a conditional put whose condition fails (an atomic compare-and-swap)
    conditional_writes: bool = False

    def __init__(self):
        self._cas_lock = threading.Lock()

    def where(self, key: str) -> str:
        """The URL of object ``key`` (for messages)."""
        return f"{self.url}/{key}"

    def put(self, key: str, data) -> None:
        """Store ``data`` as object ``key``, replacing it whole (readers see the old object or the new)."""
        raise NotImplementedError

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of object ``key`` (the whole object by default)."""
        raise NotImplementedError

    def read_into(self, key: str, start: int, buffer: memoryview, arrived) -> int:
        """Bytes ``[start, start + len(buffer))`` of object ``key`` into ``buffer``, in order, calling
        ``arrived(count)`` with the count landed so far as they land (a reader may use them meanwhile); returns
        the count, fewer than ``len(buffer)`` if the object ends first. Default: one ``get``, then one call."""
        data = self.get(key, start, start + len(buffer))
        buffer[: len(data)] = data
        arrived(len(data))
        return len(data)

    def size(self, key: str) -> int | None:
        """Size of object ``key``, or None if there is none."""
        raise NotImplementedError

    def list(self, folder: str) -> dict[str, int]:
        """{name: size} of the objects directly in ``folder``."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Delete object ``key`` (nothing if it is gone already)."""
        raise NotImplementedError

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        """Object ``key`` and a tag that changes whenever the object is replaced (its ETag, or a hash)."""
        data = self.get(key)
        return data, content_tag(data)

    def put_if(self, key: str, data, tag: str | None) -> None:
        """Replace object ``key`` only if it is still the one ``get_tagged`` tagged ``tag`` (``None``: only
        if there is no such object yet). RemoteConflict if it is not."""
        with self._cas_lock:
            try:
                current = content_tag(self.get(key))
            except RemoteObjectMissing:
                current = None
            if current != tag:
                raise RemoteConflict(f"{self.where(key)} was replaced by another writer since it was read")
            self.put(key, data)

    def bucket_exists(self) -> bool | None:
        """Whether the prefix's bucket exists (None: this store cannot tell)."""
        return None

    def list_tree(self, folder: str) -> dict[str, int]:
        """{key relative to ``folder``: size} of every object under ``folder``, at any depth."""
        raise NotImplementedError

    def sub(self, folder: str) -> "ObjectStore":
        """The objects under ``folder`` as an object store of their own (keys relative to it), sharing this
        one's connection, deadlines and compare-and-swap (a multi-rank root's rank stores)."""
        return PrefixedObjectStore(self, folder)


class PrefixedObjectStore(ObjectStore):
    """The objects of ``parent`` under ``folder`` (``ObjectStore.sub``): every call goes to the parent with
    the key prefixed."""

    def __init__(self, parent: ObjectStore, folder: str):
        super().__init__()
        folder = folder.strip("/")
        if not folder or any(part in ("", ".", "..") for part in folder.split("/")):
            raise InvalidArgument(f"sub-prefix {folder!r} is not a relative folder name")
        self.parent, self.folder = parent, folder
        self.url = f"{parent.url.rstrip('/')}/{folder}"
        self.conditional_writes = parent.conditional_writes

    def _key(self, key: str) -> str:
        return f"{self.folder}/{key}" if key else self.folder

    def put(self, key: str, data) -> None:
        self.parent.put(self._key(key), data)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.parent.get(self._key(key), start, end)

    def read_into(self, key: str, start: int, buffer: memoryview, arrived) -> int:
        return self.parent.read_into(self._key(key), start, buffer, arrived)

    def size(self, key: str) -> int | None:
        return self.parent.size(self._key(key))

    def list(self, folder: str) -> dict[str, int]:
        return self.parent.list(self._key(folder))

    def list_tree(self, folder: str) -> dict[str, int]:
        return self.parent.list_tree(self._key(folder))

    def delete(self, key: str) -> None:
        self.parent.delete(self._key(key))

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        return self.parent.get_tagged(self._key(key))

    def put_if(self, key: str, data, tag: str | None) -> None:
        self.parent.put_if(self._key(key), data, tag)

    def bucket_exists(self) -> bool | None:
        return self.parent.bucket_exists()


class FsspecObjectStore(ObjectStore):
    """Objects under a prefix of an fsspec URL (``s3://bucket/prefix``, ``file:///dir``, ``memory://x``)."""

    def __init__(self, url: str, options: dict | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        """``options`` go to the file system (``fsspec.filesystem``), e.g. ``{"client_kwargs":
        {"endpoint_url": ...}}``; ``timeout_s`` is every request's deadline (module docstring)."""
        super().__init__()
        if not isinstance(url, str) or "://" not in url:
            raise InvalidArgument(f"remote={url!r} is not a URL: pass e.g. 's3://bucket/prefix'")
        if options is not None and not isinstance(options, dict):
            raise InvalidArgument(f"remote_options={options!r}: pass a dict of the file system's options")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidArgument(f"remote_timeout_s={timeout_s!r}: pass a number of seconds > 0")
        self.timeout_s = float(timeout_s)
        self.s3 = url.split("://", 1)[0] in ("s3", "s3a")
        opts = {"skip_instance_cache": True, **(options or {})}
        if self.s3:
            config = dict(opts.get("config_kwargs") or {})
            config.setdefault("connect_timeout", _S3_CONNECT_TIMEOUT_S)
            config.setdefault("read_timeout", _S3_READ_TIMEOUT_S)
            opts["config_kwargs"] = config
        try:
            self.fs, root = _fsspec().core.url_to_fs(url, **opts)
        except ImportError as exc:
            raise InvalidArgument(f"remote={url!r}: {exc} (for s3:// install 'cnrstore[s3]')") from exc
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"remote={url!r} or remote_options are not valid: {exc}") from exc
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")
        self.bucket = self.root.split("/", 1)[0]
        self.asynchronous = bool(getattr(self.fs, "async_impl", False))
        self.conditional_writes = self.s3 and hasattr(self.fs, "_call_s3")
        if self.s3:
            try:  # the client is made lazily: unknown options surface here, not at the first upload
                self._run(self.fs.set_session, what="connecting to", key="")
            except RemoteStorageError as exc:
                if isinstance(exc.__cause__, (TypeError, ValueError)):
                    raise InvalidArgument(f"remote_options are not valid for {url!r}: {exc.__cause__}; see s3fs's "
                                          "S3FileSystem for the options it takes") from exc.__cause__
                raise

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _deadline(self, nbytes: int = 0) -> float:
        return self.timeout_s + nbytes / TIMEOUT_BYTES_PER_S

    def _run(self, func, *args, what: str, key: str, nbytes: int = 0, reading: bool = True, **kwargs):
        """``func(*args, **kwargs)`` (a coroutine function of an asynchronous file system, run on its loop)
        within the deadline, its errors wrapped (``_calling``)."""
        with self._calling(what, key, reading=reading, nbytes=nbytes):
            if self.asynchronous:
                return _fsspec().asyn.sync(self.fs.loop, func, *args, timeout=self._deadline(nbytes), **kwargs)
            return func(*args, **kwargs)

    def _call(self, name: str, *args, what: str, key: str, nbytes: int = 0, reading: bool = True, **kwargs):
        """The file system's method ``name`` (its coroutine ``_name`` where it is asynchronous)."""
        func = getattr(self.fs, "_" + name) if self.asynchronous else getattr(self.fs, name)
        return self._run(func, *args, what=what, key=key, nbytes=nbytes, reading=reading, **kwargs)

    @contextlib.contextmanager
    def _calling(self, what: str, key: str, *, reading: bool = True, nbytes: int = 0) -> Iterator[None]:
        """Client errors as typed ones: a missing object that was to be read RemoteObjectMissing (a
        CorruptionError); a failed condition RemoteConflict; anything else, a write to a bucket that does
        not exist included, RemoteStorageError."""
        fsspec = _fsspec()
        try:
            yield
        except CnrError:
            raise
        except fsspec.exceptions.FSTimeoutError as exc:
            raise RemoteStorageError(f"{what} {self.where(key)}: no answer within {self._deadline(nbytes):.0f} s "
                                     f"(remote_timeout_s={self.timeout_s:g}, plus 1 s per "
                                     f"{TIMEOUT_BYTES_PER_S >> 20} MiB); {_CHECK}, or raise remote_timeout_s "
                                     "for a slow link") from exc
        except FileExistsError as exc:  # (s3fs: If-None-Match failed)
            raise RemoteConflict(f"{what} {self.where(key)}: another writer created it first ({exc})") from exc
        except FileNotFoundError as exc:
            if not reading:  # (s3fs: NoSuchBucket) not damage: the URL names no bucket or folder
                raise RemoteStorageError(f"{what} {self.where(key)}: the bucket (or folder) does not exist "
                                         f"({exc}); create it, or check the URL") from exc
            raise RemoteObjectMissing(f"{what} {self.where(key)}: the object is missing from the object store",
                                      self.where(key), None) from exc
        except Exception as exc:  # noqa: BLE001 - the boundary: every client error becomes a typed one
            if _is_conflict(exc):
                raise RemoteConflict(f"{what} {self.where(key)}: another writer replaced it first") from exc
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
        data = bytes(data)
        self._call("pipe_file", self._path(key), data, what="uploading", key=key, nbytes=len(data), reading=False)
        stored = self.size(key)
        if stored != len(data):
            raise RemoteStorageError(f"uploading {self.where(key)}: the object store holds {stored} bytes, "
                                     f"not the {len(data)} uploaded; {_CHECK}")

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        nbytes = (end - (start or 0)) if end is not None else 0
        return self._call("cat_file", self._path(key), start=start, end=end, what="reading", key=key, nbytes=nbytes)

    def read_into(self, key: str, start: int, buffer: memoryview, arrived) -> int:
        """On S3, one ranged GET streamed into ``buffer`` as its body arrives (``arrived`` is called on the
        client's event loop: it must be quick). A connection cut midway is resumed from the first byte not yet
        landed, as often as the client retries a request; the whole read keeps one deadline."""
        if not self.conditional_writes:  # (no s3 client call to stream with: one get)
            return super().read_into(key, start, buffer, arrived)
        from s3fs.core import S3_RETRYABLE_ERRORS  # noqa: PLC0415 - (s3fs is there: conditional_writes says so)

        size = len(buffer)
        attempts = max(1, int(getattr(self.fs, "retries", 1)))

        async def stream() -> int:
            got = 0
            for attempt in range(attempts):
                try:
                    resp = await self.fs._call_s3("get_object", Bucket=self.bucket,
                                                  Key=self._path(key).split("/", 1)[1],
                                                  Range=f"bytes={start + got}-{start + size - 1}")
                    body = resp["Body"]
                    try:
                        while got < size:
                            n = await body.readinto(buffer[got:])
                            if not n:
                                return got
                            got += n
                            arrived(got)
                    finally:
                        body.close()
                    return got
                except S3_RETRYABLE_ERRORS:
                    if attempt + 1 == attempts:
                        raise
                    await asyncio.sleep(min(1.7 ** attempt * 0.1, 15))  # (s3fs's own backoff)
            return got

        if size == 0:
            return 0
        return self._run(stream, what="reading", key=key, nbytes=size)

    def size(self, key: str) -> int | None:
        try:
            self.fs.invalidate_cache(self._path(key))
            return int(self._call("info", self._path(key), what="asking the size of", key=key)["size"])
        except RemoteObjectMissing:
            return None

    def list(self, folder: str) -> dict[str, int]:
        path = self._path(folder)
        self.fs.invalidate_cache(path)
        try:
            entries = self._call("ls", path, detail=True, what="listing", key=folder)
        except RemoteObjectMissing:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries
                if e.get("type") != "directory"}

    def list_tree(self, folder: str) -> dict[str, int]:
        path = self._path(folder)
        self.fs.invalidate_cache(path)
        try:
            found = self._call("find", path, detail=True, what="listing", key=folder)
        except RemoteObjectMissing:
            return {}
        return {name[len(path) + 1:]: int(e.get("size") or 0) for name, e in found.items()
                if e.get("type") != "directory" and name.startswith(path + "/")}

    def delete(self, key: str) -> None:
        with contextlib.suppress(RemoteObjectMissing):
            self._call("rm_file", self._path(key), what="deleting", key=key)

    def get_tagged(self, key: str) -> tuple[bytes, str]:
        if not self.conditional_writes:
            return super().get_tagged(key)

        async def get():
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self._path(key).split("/", 1)[1])
            try:
                return await resp["Body"].read(), resp["ETag"]
            finally:
                resp["Body"].close()

        return self._run(get, what="reading", key=key)

    def put_if(self, key: str, data, tag: str | None) -> None:
        if not self.conditional_writes:
            return super().put_if(key, data, tag)
        data = bytes(data)
        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}

        async def put():
            return await self.fs._call_s3("put_object", Bucket=self.bucket, Key=self._path(key).split("/", 1)[1],
                                          Body=data, **condition)

        try:
            self._run(put, what="replacing", key=key, nbytes=len(data), reading=False)
        except RemoteConflict:
            # the client retries a request that timed out: if the first attempt landed, the retry's condition
            # fails on our own object (412). Then the object is byte for byte ours, and the write succeeded;
            # taking it for a lost race would delete what the pointer now names
            self.fs.invalidate_cache(self._path(key))
            try:
                landed = self.get(key) == data
            except RemoteObjectMissing:
                landed = False
            if not landed:
                raise
        self.fs.invalidate_cache(self._path(key))

    def bucket_exists(self) -> bool | None:
        if not self.s3:
            return None

        async def head():
            await self.fs._call_s3("head_bucket", Bucket=self.bucket)

        try:
            self._run(head, what="looking up the bucket of", key="")
        except RemoteObjectMissing:
            return False
        except RemoteStorageError as exc:
            if "404" in str(exc) or "NoSuchBucket" in str(exc) or "Not Found" in str(exc):
                return False
            raise
        return True


def _is_conflict(exc: BaseException) -> bool:
    """Whether a client error is a failed precondition (412) or a conditional write's conflict (409)."""
    for e in (exc, exc.__cause__, exc.__context__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return True
    return "PreconditionFailed" in str(exc) or "Precondition Failed" in str(exc)
