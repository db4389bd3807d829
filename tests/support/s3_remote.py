"""What the tests of the object-store tier share (test_remote.py, test_remote_ownership.py): the remote_options
for the session's S3 endpoint (conftest.py), the fault proxy in front of it (support/s3_proxy.py) and a fresh
prefix behind it as fixtures, small segments, listings of the bucket, and a trainer that keeps what every version
must read."""

from __future__ import annotations

import os

import boto3
import numpy as np
import pytest

import cnrstore
from cnrstore import knobs
from cnrstore.engine import filenames

from .s3_proxy import FaultProxy


def s3_options(endpoint: str, **config) -> dict:
    """remote_options for s3fs against ``endpoint``: fake credentials, few retries (tests stay fast)."""
    key, secret = os.environ.get("CNRSTORE_TEST_S3_KEY", "testing"), os.environ.get("CNRSTORE_TEST_S3_SECRET", "testing")
    return {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 5,
                              "read_timeout": 10, **config}}


ROWS, DIM = 2048, 16


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    """32 KiB segments: every save rolls over a few, so there is something to seal, upload and evict."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 32 << 10)


@pytest.fixture
def proxy(s3_endpoint, monkeypatch):
    """The fault proxy in front of the session's endpoint. s3fs retries a failed request 5 times with backoff,
    each through botocore's own retries: ~10 s per request that fails for good; 1 keeps the tests fast."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    p = FaultProxy(s3_endpoint)
    yield p
    p.close()


@pytest.fixture
def remote(s3_bucket, proxy):
    """(URL, remote_options) of a fresh prefix, reached through the proxy."""
    return f"s3://{s3_bucket}/ckpt", s3_options(proxy.url)


def open_remote(path, remote, **kwargs):
    """A new store at ``path`` whose remote is ``remote`` ((url, options), the fixture)."""
    url, opts = remote
    return cnrstore.open(path, create=True, remote=url, remote_options=opts, **kwargs)


def objects(s3_endpoint, bucket, folder="") -> dict[str, int]:
    """{key under ckpt/: size} of every object whose key starts with ``folder``."""
    opts = s3_options(s3_endpoint)
    client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id=opts["key"],
                          aws_secret_access_key=opts["secret"], region_name="us-east-1")
    out = client.list_objects_v2(Bucket=bucket, Prefix=f"ckpt/{folder}")
    return {o["Key"][len("ckpt/"):]: o["Size"] for o in out.get("Contents", [])}


def segment_ids(listing: dict[str, int]) -> set[int]:
    """Segment ids of the segment objects in ``listing`` (in any writer's folder)."""
    return {filenames.parse_segment_name(k.split("/")[-1]) for k in listing if k.split("/")[-2:-1] == ["segments"]}


def snapshots(listing: dict[str, int]) -> list[str]:
    return [k for k in listing if k.split("/")[-2:-1] == ["index"]]


class Trainer:
    """Saves of a table with a fraction of rows touched each time; keeps what every version must read."""

    def __init__(self, store, seed=0):
        self.store = store
        self.rng = np.random.default_rng(seed)
        self.model = self.rng.standard_normal((ROWS, DIM), dtype=np.float32)
        self.content: dict[int, np.ndarray] = {}
        if "t" not in store.tables():
            store.create_table("t", ROWS, DIM, codec="fp32")

    def resume(self, other: "Trainer") -> None:
        """Go on from ``other``'s newest version (a machine that recovered what ``other`` wrote)."""
        self.content = dict(other.content)
        self.model = other.content[max(other.content)].copy()

    def save(self, touched=256) -> int:
        first = not self.content and not self.store.versions()
        rows = np.arange(ROWS) if first else np.sort(self.rng.choice(ROWS, touched, replace=False))
        self.model[rows] = self.rng.standard_normal((len(rows), DIM), dtype=np.float32)
        w = self.store.checkpoint(step=len(self.content))
        w.put_rows("t", rows, self.model[rows])
        v = w.commit()
        self.content[v] = self.model.copy()
        return v

    def check_fresh(self, where, remote, versions=None) -> None:
        """Recovery from the remote alone (``where``: an empty directory, ``remote``: (url, options)) lists
        ``versions`` (default: every one saved), each reading back bit for bit, and verifies clean."""
        url, opts = remote
        with cnrstore.open(where, readonly=True, remote=url, remote_options=opts) as fresh:
            self.check(fresh, versions)
            assert not fresh.verify().problems

    def check(self, store, versions=None) -> None:
        versions = sorted(self.content) if versions is None else versions
        assert [v.version for v in store.versions()] == versions
        for v in versions:
            np.testing.assert_array_equal(store.read_table("t", v), self.content[v])
