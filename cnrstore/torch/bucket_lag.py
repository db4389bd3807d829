"""A trainer's bound on how far the bucket trails its saves (``Checkpointer(remote_lag_s=..., on_remote_lag=...)``).

On a store with a remote tier the local commit is the save's durability point; the Checkpointer makes the
store's copy points run behind the commits (engine/uploads.py), so that ``save()`` never waits for the
bucket. The bucket's lag (the age of the oldest committed version it lacks, and how many it lacks) is then a
metric (``SaveReport.bucket_lag_s`` / ``bucket_lag_versions``, ``Store.stats()["remote"]``) with a bound:
a save that finds the lag past ``remote_lag_s`` seconds waits until it is back within the bound (``"wait"``,
the default: what a node loss costs stays what the user chose, and the wait is reported as
``SaveReport.bucket_wait_s`` and logged each minute) or raises ``RemoteLagging`` without taking its snapshot
(``"raise"``: for a trainer that prefers to keep training and alert).
"""

from __future__ import annotations

from .. import checks
from ..errors import InvalidArgument, RemoteLagging

__all__ = ["DEFAULT_REMOTE_LAG_S", "ON_REMOTE_LAG", "BucketBound", "check_remote_lag_s"]

#: Default bound on the bucket's lag, seconds: ten minutes, well past a multi-GB baseline's upload at
#: a few hundred MB/s, so that only uploads that do not keep up (or a failing endpoint) reach it.
DEFAULT_REMOTE_LAG_S = 600.0
ON_REMOTE_LAG = ("wait", "raise")


def check_remote_lag_s(value) -> float:
    """``remote_lag_s`` as seconds (> 0; ``math.inf``: no bound), else InvalidArgument."""
    return checks.number(value, "remote_lag_s (the seconds the bucket may trail the saves; math.inf: no bound)",
                         positive=True, finite=False)


class BucketBound:
    """The bound of one Checkpointer on its store's bucket (module doc). ``active``: the store has a remote
    tier whose copy points now run behind the commits (False for a local store, and for a rank store of a
    multi-rank root, whose publication bounds it)."""

    def __init__(self, remote_lag_s, on_remote_lag):
        self.remote_lag_s = check_remote_lag_s(remote_lag_s)
        if on_remote_lag not in ON_REMOTE_LAG:
            raise InvalidArgument(f"on_remote_lag must be 'wait' (a save past remote_lag_s waits for the bucket) "
                                  f"or 'raise' (it raises RemoteLagging, taking nothing); got {on_remote_lag!r}")
        self.on_remote_lag = on_remote_lag
        self.active = False
        self._engine = None

    def attach(self, store) -> None:
        """Make ``store``'s copy points run behind its commits, if it has a remote tier."""
        engine = getattr(store, "engine", None)
        if engine is not None and callable(getattr(engine, "copy_points_behind", None)):
            self.active = engine.copy_points_behind()
            self._engine = engine if self.active else None

    def lag(self) -> tuple[float, int] | None:
        """(seconds, versions) the bucket trails the store by; None without a bucket."""
        if not self.active:
            return None
        status = self._engine.replication_status()
        return float(status["lag_s"]), int(status["lag_versions"])

    def before_save(self, describe: str) -> tuple[float | None, int | None, float]:
        """Asked as a save starts, before its snapshot: (lag seconds, lag versions, seconds waited); waits,
        or raises RemoteLagging, past the bound."""
        lag = self.lag()
        if lag is None:
            return None, None, 0.0
        lag_s, lag_versions = lag
        if lag_s <= self.remote_lag_s:
            return lag_s, lag_versions, 0.0
        if self.on_remote_lag == "raise":
            raise RemoteLagging(
                f"{describe} was not taken: the bucket lacks {lag_versions} committed version(s), the oldest "
                f"{lag_s:.3g} s old, past remote_lag_s={self.remote_lag_s:g} (on_remote_lag='raise'); they stand "
                "locally and are uploading behind. Save again later; a node lost now loses them. "
                "Store.stats()['remote'] says why (last_error)", lag_s, lag_versions)
        waited = self._engine.wait_for_bucket(self.remote_lag_s, describe)
        return lag_s, lag_versions, waited
