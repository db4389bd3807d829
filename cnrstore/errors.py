"""The one error hierarchy of cnrstore.

Every failure a caller may want to handle is a subclass of :class:`CnrError`. Lookup failures also
subclass :class:`LookupError` and bad arguments :class:`ValueError`, so generic handlers keep working.
Errors a user can fix say how in their message. Third-party errors are wrapped at the boundary
(``raise CorruptionError(...) from exc``); no bare ``RuntimeError`` escapes for a storage fault.
"""

from __future__ import annotations

__all__ = [
    "CnrError",
    "StoreNotFound",
    "StoreLocked",
    "InvalidArgument",
    "VersionNotFound",
    "VersionNotRetained",
    "TableNotFound",
    "MissingRows",
    "CorruptionError",
    "IndexDamaged",
    "FormatVersionError",
    "StorageFull",
    "StoreClosed",
    "RecoveryFailed",
    "ReadOnlyError",
    "CheckpointInProgress",
    "GlobalCommitError",
    "SaveSkipped",
    "SaveRefused",
    "SaveSuperseded",
    "ExportFailed",
    "CompactionFailed",
    "StorageIOError",
    "IndexBusy",
    "PermissionDenied",
    "StoreMoved",
    "UnsafePayload",
    "PeerFailure",
    "RemoteStorageError",
    "RemoteObjectMissing",
    "RemoteConflict",
    "RemoteTakenOver",
    "RemoteLagging",
]


class CnrError(Exception):
    """Base class of every error raised by cnrstore."""


class StoreNotFound(CnrError):
    """The path is not a cnrstore store (open it with ``create=True`` to make one)."""


class StoreLocked(CnrError):
    """Another process holds the store open for writing. ``.pid`` is the holder's pid, if known."""

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid


class InvalidArgument(CnrError, ValueError):
    """An argument is malformed; the message names what and how to fix it."""


class VersionNotFound(CnrError, LookupError):
    """The version was never committed, or was dropped by ``retain``."""


class VersionNotRetained(VersionNotFound):
    """``Store.changes`` (or ``dense_changes``, ``cnrstore diff``) was asked for the changes since a version
    the store does not hold: dropped by retention, or never committed. What changed since it cannot be
    told from this store: re-sync with a full read (``since=None``) and follow the store from the version
    that read returns. ``.version`` is the version asked for."""

    def __init__(self, message: str, version: int | None = None):
        super().__init__(message)
        self.version = version


class TableNotFound(CnrError, LookupError):
    """No table of that name exists in the store."""


class MissingRows(CnrError, LookupError):
    """Rows asked for were never written at or before the version read."""


class CorruptionError(CnrError):
    """Stored bytes fail their checksum or are structurally invalid.

    ``.path`` is the damaged file and ``.offset`` the byte offset of the damaged record (None if unknown).
    """

    def __init__(self, message: str, path: str | None = None, offset: int | None = None):
        super().__init__(message)
        self.path = path
        self.offset = offset


class IndexDamaged(CorruptionError):
    """The store's index (``index/``) is missing or damaged. Nothing was deleted: the segment log still
    holds the data. Run ``cnrstore repair PATH`` (or ``cnrstore.repair(path)``) to rebuild the index."""


class FormatVersionError(CnrError):
    """The store was written by a newer cnrstore format than this one reads: upgrade cnrstore."""


class StorageFull(CnrError, OSError):
    """The file system ran out of space (or quota) during a write; the checkpoint was aborted."""


class StorageIOError(CnrError, OSError):
    """The device reported an I/O error (EIO) during a write or fsync; the operation was aborted and
    nothing it wrote was committed (what was committed before is untouched). Check the device, then run
    ``cnrstore verify``; a failed fsync is never retried as if it had succeeded."""


class IndexBusy(CnrError):
    """Every reader slot of the index stayed taken (by this and other processes) for too long; retry
    with fewer concurrent readers, or close idle readonly stores of other processes."""


class StoreClosed(CnrError):
    """The store (or writer) was used after ``close()``."""


class ReadOnlyError(CnrError):
    """A write was attempted on a store opened with ``readonly=True``."""


class PermissionDenied(CnrError, PermissionError):
    """The process may not read or write a file of the store (file modes, ownership, a read-only file
    system). The message names the path and the permission it needs; ``.path`` is that path. Nothing was
    changed: fix the permissions (or open ``readonly=True`` where only writing is refused) and retry."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class StoreMoved(CnrError):
    """The directory of a store open for writing was renamed or removed while open: its path now names
    another directory (or none). The version being committed was not committed; close the store and reopen
    it where it now lies."""


class CheckpointInProgress(CnrError):
    """A second checkpoint writer was opened while one is still open in this process."""


class GlobalCommitError(CnrError):
    """A distributed save did not become a global version: a rank failed its local write, or a rank did
    not answer the commit's collective in time (it may have died). ``.ranks`` lists the ranks known to have
    failed (empty when the cause is a timeout). The previous global version is intact; the local versions
    written for this save are orphans, reclaimed later."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class SaveSkipped(CnrError):
    """A queued ``cnrstore.torch.Checkpointer`` save was not written because the save queued before it did
    not commit (``__cause__`` says why): it held only the rows changed since that one. Nothing of it was
    committed, every version committed before is intact, and the Checkpointer's next save is a baseline.
    ``PendingSave.wait()`` raises it; the failure itself is raised once by the next ``save()``."""


class SaveSuperseded(SaveSkipped):
    """A queued ``cnrstore.torch.Checkpointer`` save that had not started writing was superseded by a newer
    save (``on_backpressure="coalesce"``), which writes its rows too: nothing of it was committed on its own.
    ``.by_step`` is the step of the save that superseded it."""

    def __init__(self, message: str, by_step=None):
        super().__init__(message)
        self.by_step = by_step


class SaveRefused(CnrError):
    """A ``cnrstore.torch.Checkpointer`` save written from the live tensors (a streamed save) was refused:
    rows of it changed after ``save()`` and before the write read them, by something the Checkpointer could
    not see coming (an in-place write outside an optimizer step), so the version would not have been the
    state at ``save()``. Nothing of it was committed. ``.table`` names the table, ``.rows`` the rows found
    changed. The message says how to announce such writes; that table is copied at ``save()`` from then on."""

    def __init__(self, message: str, table: str | None = None, rows=None):
        super().__init__(message)
        self.table = table
        self.rows = rows


class ExportFailed(CnrError, OSError):
    """Writing an export file failed for a reason other than a bad path or a full disk (an I/O error, say).
    ``.path`` is the export file; nothing was written there (exports are atomic)."""

    def __init__(self, message: str, path: str | None = None):
        CnrError.__init__(self, message)
        self.path = path

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CompactionFailed(CnrError):
    """A background compaction step failed (``__cause__`` is the failure, e.g. StorageFull). The store is
    intact: a failed step commits nothing, checkpoints keep working and the worker retries after the next
    commit. Raised once by ``Store.close()``; ``Store.compaction_error`` and ``stats()["compaction_errors"]``
    show failures while the store is open."""


class RecoveryFailed(CnrError):
    """An erasure-coded recovery (``cnrstore.distributed.ECRM.recover``) could not rebuild the failed ranks
    (more failures than parity shards, or a parity found inconsistent) and no checkpoint fallback was
    configured. ``.reason`` says which; restore every rank from a checkpoint, or construct the ECRM with
    ``checkpointer=`` so that it falls back by itself."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class PeerFailure(CnrError, RuntimeError):
    """A peer of a multi-rank job failed, and this rank left the collective it was in without waiting out
    the process group's timeout (``cnrstore.distributed.failures``). ``.learned`` says how this rank
    learned it: "board" (the failure board's key, posted by the launcher or by another rank) or
    "collective" (a collective of this rank raised). ``.cause`` is what the reporter wrote, ``.epoch`` the
    failure epoch. The process group is broken: leave it (``failures.leave_group``), re-form it with the
    replacement and recover. A RuntimeError, as gloo's own errors are."""

    def __init__(self, message: str, *, learned: str = "", cause: str = "", epoch: int | None = None):
        super().__init__(message)
        self.learned = learned
        self.cause = cause
        self.epoch = epoch


class UnsafePayload(CnrError):
    """A version's trainer payload (the dense array ``"torch.state"``) is a pickle that names code: classes
    or functions ``torch.load(weights_only=True)`` does not rebuild. cnrstore never unpickles it by itself,
    since unpickling runs what the pickle names (a store is data, never code: docs/DESIGN.md "Security").
    Stores written by cnrstore before payload format 2 may hold such payloads. If you wrote the store and
    trust it: rewrite the payloads as data once (``cnrstore migrate-payload STORE --trust-pickle``), or
    read with ``trust_pickle=True`` (``--trust-pickle``). ``.version`` is the version, ``.names`` what the
    pickle names (empty when the refusal came from torch's unpickler itself)."""

    def __init__(self, message: str, version: int | None = None, names=()):
        super().__init__(message)
        self.version = version
        self.names = tuple(names)


class RemoteStorageError(CnrError, OSError):
    """The object store of a store's remote tier (``open(..., remote=URL)``) failed a request after the
    client's own retries: the endpoint was unreachable, refused the credentials, or kept throttling
    (503 SlowDown). Nothing committed locally is lost: what could not be uploaded stays in the local
    directory (never evicted) and is uploaded again at the next copy point. The message names the object
    and what to check (endpoint URL, credentials, bucket, network)."""


class RemoteObjectMissing(RemoteStorageError, CorruptionError):
    """An object the remote copy needs (a segment the index names, or the snapshot the pointer names) is
    gone from the object store. ``.path`` is its URL. The versions that read it are damaged: run
    ``cnrstore verify`` to list them."""

    def __init__(self, message: str, path: str | None = None, offset: int | None = None):
        CorruptionError.__init__(self, message, path, offset)


class RemoteConflict(RemoteStorageError):
    """A conditional write to the object store lost: another writer replaced (or created) the object first.
    The remote tier's pointer is replaced only this way (a compare-and-swap), so two writers can never both
    move it: the loser learns here, before anything of its own becomes readable from the bucket."""


class RemoteTakenOver(RemoteStorageError):
    """This store lost its remote prefix: another machine recovered the prefix and moved its pointer on (one
    writer per prefix). What this directory committed stays readable in it (its evicted segments are fetched
    back when this is detected), is never served from the bucket, and new checkpoints are refused: stop this
    writer, or recover from the remote into a new directory to go on from the bucket's newest version.
    ``.writer`` is the store id the pointer now names (None if unknown), ``.version`` the version this
    store had committed locally when it learned (None if it learned at open)."""

    def __init__(self, message: str, writer: str | None = None, version: int | None = None):
        super().__init__(message)
        self.writer = writer
        self.version = version


class RemoteLagging(RemoteStorageError):
    """A save was not taken because the bucket lags the local store by more than the bound the trainer set
    (``Checkpointer(remote_lag_s=..., on_remote_lag="raise")``): uploads are slower than saves, or the
    endpoint fails. Nothing of this save was snapshotted; the committed versions stand locally and are
    uploaded behind. ``.lag_s`` is the age of the oldest version the bucket lacks, ``.lag_versions`` how many
    it lacks. Save again later, or alert: a node lost now loses every version the bucket lacks."""

    def __init__(self, message: str, lag_s: float = 0.0, lag_versions: int = 0):
        super().__init__(message)
        self.lag_s = lag_s
        self.lag_versions = lag_versions
