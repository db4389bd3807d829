"""Shared fixtures and hypothesis profiles: dev (default), ci (derandomized), deep (opt-in, long)."""

import os
import sys

#: torch (OpenMP) on one thread in the test processes and the subprocesses they start, unless OMP_NUM_THREADS
#: says otherwise; set before anything imports torch. The tests make many small codec calls, and each worker
#: shares CI's 2 cores with two more: there OpenMP's barriers made a small call up to ~500x slower (test_delta,
#: test_codecs*, test_fuzz_parsers: 47.5 s -> 18.8 s of CPU with it). Results are the same on one thread; the
#: store's own decode threads (Options.decode_threads) are Python threads, unaffected.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # (imported already by a plugin: then the env variable comes too late)
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run long soak/stress tests")


#: Modules whose tests take longest (several seconds to a minute each: subprocess trainers, spawned jobs,
#: crash-state sweeps), longest first. Their tests are run first: pytest-xdist's worksteal then gives the other
#: worker the short tests and has it steal from the long queue, so that the run ends on short tests, not on one
#: worker busy with a long one while the other idles.
#: (test_stateful was first while it ran a minute on one worker; on one torch thread it takes ~10 s)
HEAVY_FIRST = ("test_train_dlrm_dist", "test_crash_states", "test_train_dlrm", "test_trainer_exit",
               "test_readme", "test_distributed_bucket", "test_crash_states_remote", "test_stateful",
               "test_crash_states_takeover", "test_distributed", "test_remote_ownership", "test_cli_root_bucket",
               "test_ecrm", "test_lifecycle", "test_remote", "test_remote_reads", "test_crash_states_dist_bucket",
               "test_serve_follow", "test_serving", "test_changes")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: opt in with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


#: Set to 0 to keep ram_tmp_path on disk (tmp_path) even where /dev/shm has room.
RAM_TMP_ENV = "CNRSTORE_TEST_RAM_TMP"


@pytest.fixture
def ram_tmp_path(tmp_path):
    """A new directory in memory (tmpfs, /dev/shm) where the machine has one with room, else ``tmp_path``;
    removed after the test. For the crash-state sweeps, which build, recover and check thousands of small stores
    whose durability they model themselves (support/crash_states.py): every fsync and LMDB commit there is the
    disk's cost, not the test's subject: in memory they ran 2.5x faster on a busy disk, 1.1-1.5x on an idle one.
    $CNRSTORE_TEST_RAM_TMP=0: on disk."""
    import shutil
    import tempfile
    from pathlib import Path

    shm = "/dev/shm"
    if (os.environ.get(RAM_TMP_ENV, "1") == "0" or not os.path.isdir(shm) or not os.access(shm, os.W_OK)
            or shutil.disk_usage(shm).free < 1 << 30):
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="cnrstore-test-", dir=shm)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "store")


@pytest.fixture
def store(store_path):
    import cnrstore

    s = cnrstore.open(store_path, create=True)
    yield s
    s.close()


@pytest.fixture
def emb(store):
    """A store with table 'emb' (fp32, 1000 x 8, block 64) fully written in version 1 (tests/test_store*.py)."""
    import numpy as np

    from support.store_helpers import BLOCK, DIM, ROWS, rand

    store.create_table("emb", ROWS, DIM, codec="fp32", block_rows=BLOCK)
    with store.checkpoint(step=1) as ck:
        ck.put_rows("emb", np.arange(ROWS), rand(ROWS, seed=1))
    return store


@pytest.fixture(scope="module")
def single_threaded_torch():
    """torch (FBGEMM) on one thread for a module that makes many small codec calls in the test process:
    on a loaded 2-core machine, OpenMP barriers make each small call up to ~500x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group (the default group) for the test, destroyed after it."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


# -- S3: an in-process moto endpoint (what s3fs's own tests use), a fresh bucket per test ----------------------

#: opt-in: run the S3 tests against a real implementation (radosgw, MinIO) instead of moto: its URL, with
#: CNRSTORE_TEST_S3_KEY / CNRSTORE_TEST_S3_SECRET as its credentials
S3_ENDPOINT_ENV = "CNRSTORE_TEST_S3_ENDPOINT"


@pytest.fixture(scope="session")
def s3_endpoint():
    """The URL of an S3 endpoint on localhost (moto's server mode, in this process) for the whole session
    (or the one $CNRSTORE_TEST_S3_ENDPOINT names)."""
    import logging

    if os.environ.get(S3_ENDPOINT_ENV):
        yield os.environ[S3_ENDPOINT_ENV]
        return

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """A new, empty bucket on the session's endpoint; its name."""
    import re
    import uuid

    import boto3

    from support.s3_remote import s3_options

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    opts = s3_options(s3_endpoint)
    boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id=opts["key"], aws_secret_access_key=opts["secret"],
                 region_name="us-east-1").create_bucket(Bucket=name)
    return name
