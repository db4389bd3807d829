"""Two jobs on one bucket root, interleaved request by request (tests/test_crash_states_claim_races.py): a
client of the shared bucket per job that counts its requests and runs a hook just before a chosen one.

A job's ``RemoteRoot`` and its rank stores (through ``objects.sub(rel)``) reach the bucket through its
``Client``; every request (get, ranged get, tagged get, size, list, listing of a tree, put, conditional put,
delete) counts once, and a conditional put is one request (the endpoint compares and replaces atomically,
nothing runs in between). The bucket itself (``dist_bucket_states.RecordingBucket``) logs every put and
delete in the order it applied them.
"""

from __future__ import annotations

from cnrstore.engine.objects import ObjectStore

from .crash_states import DictObjectStore
from .dist_bucket_states import RecordingBucket


class Client(ObjectStore):
    """One job's connection to ``bucket``. ``arm(k, hook)``: ``hook()`` runs once, just before the ``k``-th
    request from then on (``k == 0``: the next one); ``count`` is the number of requests since ``arm``."""

    def __init__(self, bucket: RecordingBucket):
        super().__init__()
        self.bucket = bucket
        self.url = bucket.url
        self.count = 0
        self.trigger: int | None = None
        self.hook = None
        self.fired_at: int | None = None

    def arm(self, trigger: int | None, hook=None) -> None:
        self.count, self.trigger, self.hook, self.fired_at = 0, trigger, hook, None

    def _request(self) -> None:
        n, self.count = self.count, self.count + 1
        if n == self.trigger and self.hook is not None:
            hook, self.hook = self.hook, None
            self.fired_at = n
            hook()

    def put(self, key, data):
        self._request()
        self.bucket.put(key, data)

    def put_if(self, key, data, tag):
        self._request()
        DictObjectStore.put_if(self.bucket, key, data, tag)  # (under the bucket's lock: one atomic request)

    def get(self, key, start=None, end=None):
        self._request()
        return self.bucket.get(key, start, end)

    def get_tagged(self, key):
        self._request()
        return self.bucket.get_tagged(key)

    def size(self, key):
        self._request()
        return self.bucket.size(key)

    def list(self, folder):
        self._request()
        return self.bucket.list(folder)

    def list_tree(self, folder):
        self._request()
        return self.bucket.list_tree(folder)

    def delete(self, key):
        self._request()
        self.bucket.delete(key)
