"""The replication seam: what keeps a copy of a store elsewhere (an object store) current, driven by the
engine. The segment storage (storage.py) is pure I/O: where segments are appended, read, listed and
removed. A ``Replicator`` is told by the engine when the store opened, before a checkpoint begins, after
one commits and as the store closes, and makes its copy points then (in the commit's thread, or, once
``run_behind()`` was asked, in a thread of its own behind the commits); ``Store.sync_remote`` asks for
one at once (``Engine.copy_point``).

The one implementation is the remote tier's ``RemoteSegmentStorage`` (remote.py), which is both: it
serves the segments (local while active or cached, remote once sealed and uploaded) and makes the copy
points (every segment the index references uploaded, the index snapshot uploaded, the pointer replaced
by compare-and-swap). A local store has no replicator.
"""

from __future__ import annotations

import abc
from typing import Callable


class Replicator(abc.ABC):
    """Makes copy points of a store, when its engine says (see the module docstring)."""

    @abc.abstractmethod
    def attach(self, index, seal_writer: Callable[[], None]) -> None:
        """The engine opened (after crash recovery): ``index`` is its Index (copy points snapshot it) and
        ``seal_writer()`` seals the checkpoint writer's active segment if no checkpoint is open (a copy
        point uploads only sealed segments)."""

    @abc.abstractmethod
    def before_checkpoint(self) -> None:
        """A checkpoint is about to begin: raise if this store may no longer take checkpoints (another writer
        took the prefix over: RemoteTakenOver)."""

    @abc.abstractmethod
    def after_commit(self) -> None:
        """A checkpoint committed: make a copy point if one is due (or mark it due, behind). Never raises for a remote fault (that is
        logged and retried at the next one), except RemoteTakenOver once (the commit stands locally)."""

    @abc.abstractmethod
    def copy_point(self) -> None:
        """Make a copy point now. RemoteStorageError if the object store fails (the copy then still reads at
        its previous copy point)."""

    @abc.abstractmethod
    def run_behind(self) -> bool:
        """Make the copy points after commits in a thread of the replicator's from now on (a commit marks one
        due and returns; they coalesce); False if this replicator's copy points stay as they are."""

    @abc.abstractmethod
    def wait_for_bucket(self, bound_s: float, what: str) -> float:
        """Block until the oldest commit the copy lacks is at most ``bound_s`` seconds old; the seconds
        waited."""

    @abc.abstractmethod
    def flush(self) -> None:
        """A writable store is closing: make the copy current (a last copy point) if anything changed since
        the last one. May raise RemoteStorageError; the store closes all the same."""

    @abc.abstractmethod
    def status(self) -> dict:
        """What ``Store.stats()["remote"]`` reports: the copy's state and counters."""
