"""cnrstore/distributed/failures.py in one process: the failure board wakes a wait on work that never
completes (a collective whose peers left the group alive, which gloo never fails), a failing work posts
the failure so that every rank learns it, and without a watch the helpers are plain waits."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from cnrstore.distributed import failures  # noqa: E402
from cnrstore.errors import PeerFailure  # noqa: E402


class Never:
    """A ``dist.Work`` that never completes, like gloo's point-to-point work (no future)."""

    def __init__(self):
        self.release = threading.Event()

    def get_future(self):
        raise RuntimeError("getFuture not implemented")

    def wait(self, timeout=None):
        self.release.wait()
        return True


class Broken(Never):
    """A work whose wait raises as gloo's does when a peer closed its sockets."""

    def wait(self, timeout=None):
        raise RuntimeError("Connection closed by peer")


@pytest.fixture
def watch():
    board = failures.FailureBoard()
    w = failures.FailureWatch(board.host, board.port, rank=0, epoch=0)
    failures.install(w)
    try:
        yield board, w
    finally:
        failures.uninstall()


def test_a_post_on_the_board_ends_a_wait_that_would_never_end(watch):
    board, w = watch
    work = Never()
    raised = []

    def waiter():
        try:
            failures.wait([work])
        except PeerFailure as exc:
            raised.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and not raised, "the wait returned before any failure was posted"
    board.post(0, "rank 3 died")
    t.join(timeout=30)
    assert not t.is_alive(), "the post did not end the wait"
    assert raised and raised[0].learned == "board" and "rank 3 died" in raised[0].cause
    with pytest.raises(PeerFailure):      # the epoch's failure is known: the next collective refuses at once
        failures.wait([Never()])
    work.release.set()


def test_a_failed_work_posts_the_failure_for_every_rank(watch):
    board, w = watch
    with pytest.raises(PeerFailure) as info:
        failures.wait([Broken()])
    assert info.value.learned == "collective"
    posted = board.posted(0)
    assert posted is not None and posted["source"] == "rank 0" and "Connection closed" in posted["cause"]


def test_rearm_watches_the_next_epoch_only(watch):
    board, w = watch
    board.post(0, "first failure")
    deadline = time.monotonic() + 30
    while w.failure() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.failure() is not None
    w.rearm(1)
    assert w.epoch == 1 and w.failure() is None
    done = threading.Event()
    work = Never()
    threading.Thread(target=lambda: (failures.wait([work]), done.set()), daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set(), "a failure of the old epoch ended a wait of the new one"
    work.release.set()
    assert done.wait(30), "the completed work was not noticed"


def test_without_a_watch_the_helpers_are_plain_waits():
    failures.uninstall()
    work = Never()
    work.release.set()
    failures.wait([work])                # returns: the work completed
    with pytest.raises(RuntimeError, match="Connection closed"):
        failures.wait([Broken()])        # gloo's own error, as torch raises it


def test_object_collectives_under_a_watch_carry_objects_on_the_groups_device(watch, group):
    """The watched object collectives (async tensor collectives underneath) on a gloo group: CPU messages
    (an NCCL group would get them on the current CUDA device: tests/test_cuda.py)."""
    import torch.distributed as dist

    assert failures.message_device() == torch.device("cpu")
    side = dist.new_group(backend="gloo")
    try:
        got = [None]
        failures.all_gather_object(got, {"rank": 0, "rows": [1, 2, 3]}, group=side)
        assert got == [{"rank": 0, "rows": [1, 2, 3]}]
        answer = [("ok", 7)]
        failures.broadcast_object_list(answer, src=0, group=side)
        assert answer == [("ok", 7)]
    finally:
        dist.destroy_process_group(side)
