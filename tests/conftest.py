"""Shared fixtures and hypothesis profiles: dev (default), ci (derandomized), deep (opt-in, long)."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run long soak/stress tests")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: opt in with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "store")


@pytest.fixture
def store(store_path):
    import cnrstore

    s = cnrstore.open(store_path, create=True)
    yield s
    s.close()


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
