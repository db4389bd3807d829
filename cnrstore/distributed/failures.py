"""Prompt failure detection for multi-rank jobs: survivors learn of a failed peer at once and leave the
collective they are blocked in, without waiting out the process group's timeout (docs/DESIGN.md,
"Recovery without timeouts").

Why this is needed (measured on torch 2.13, gloo): a collective blocked on a peer is not always told that
the peer is gone. A dead peer's closed sockets fail the collectives that wait on *it*, but a rank whose
collective waits on a live peer that has left the group (it saw the failure first and destroyed its
groups) waits the full timeout; and neither ``destroy_process_group``, ``ProcessGroup.abort()`` nor
``shutdown()`` on the blocked rank itself makes its own wait return. So the waits are made escapable:

- the **failure board**: one key per failure epoch, ``cnrstore/failure/<epoch>``, in a torch.distributed
  ``TCPStore`` that outlives the process groups (:class:`FailureBoard`, hosted by the launcher). The
  launcher posts the key the moment a rank's process dies; a rank whose collective raised posts it too;
- a :class:`FailureWatch` per rank: a thread blocked on the key in the store (the store pushes it: no
  polling interval in the detection) that wakes every waiter the moment it appears;
- every collective of ``cnrstore.distributed`` (and a trainer's own, through :func:`all_reduce` and
  kin) is issued asynchronously and waited on through :func:`wait`: it returns when the work completes
  and raises :class:`~cnrstore.errors.PeerFailure` the moment the failure is known, whichever comes
  first. The abandoned work and its group are kept referenced for the life of the process (a destructor
  would join gloo's worker thread, which stays blocked in the abandoned operation).

Without an installed watch (:func:`install`), the helpers are the plain blocking collectives, so the
library behaves as before for callers that do not opt in. After a failure a rank calls
:func:`leave_group` (drop the broken default group), re-forms the group with the replacement, and calls
``watch.rearm(epoch + 1)``; a replacement installs its watch at that epoch.
"""

from __future__ import annotations

import json
import pickle
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import InvalidArgument, PeerFailure

__all__ = ["FailureBoard", "FailureWatch", "install", "current", "uninstall", "wait", "all_reduce", "all_gather",
           "all_gather_object", "broadcast_object_list", "batch_isend_irecv", "leave_group", "message_device",
           "KEY_PREFIX"]

#: The board's key of failure epoch ``e`` is ``KEY_PREFIX + str(e)``.
KEY_PREFIX = "cnrstore/failure/"
#: How long one wait of the watch thread on the board lasts before it is renewed (a posted key wakes it
#: at once; rearm() and close() post or find the key, so nothing waits this out).
WATCH_WAIT_S = 24 * 3600.0

_WATCH: "FailureWatch | None" = None
#: Work abandoned after a failure, with the groups it ran in: never destroyed while the process lives.
_ABANDONED: list = []


def _key(epoch: int) -> str:
    return f"{KEY_PREFIX}{int(epoch)}"


class FailureBoard:
    """The launcher's side: hosts the board (a ``TCPStore`` server on ``host``, a free port) and posts
    failures. Workers connect with ``FailureWatch(board.host, board.port, ...)``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.port = int(self.store.port)

    def post(self, epoch: int, cause: str, *, source: str = "launcher") -> None:
        """Announce failure ``epoch`` (idempotent: the first post of an epoch is the one read)."""
        _post(self.store, epoch, cause, source)

    def posted(self, epoch: int) -> dict | None:
        """What was posted for ``epoch``, or None."""
        if not self.store.check([_key(epoch)]):
            return None
        return json.loads(self.store.get(_key(epoch)))


def _post(store, epoch: int, cause: str, source: str) -> None:
    value = json.dumps({"source": source, "cause": cause, "time": time.time()})
    store.compare_set(_key(epoch), "", value)        # only the first post of an epoch sticks


class FailureWatch:
    """This rank's view of the board (see the module doc). ``epoch`` is the failure epoch the rank's
    current process group belongs to (failures so far). Thread-safe; ``close()`` stops the thread."""

    def __init__(self, host: str, port: int, rank: int, epoch: int = 0):
        self.rank = int(rank)
        self._cond = threading.Condition()
        self._epoch = int(epoch)
        self._seen: dict | None = None           # the post read for the current epoch
        self._waiters: set[threading.Event] = set()
        self._closed = False
        # two clients: the watch thread blocks in wait() on one, posts go through the other
        self._post_store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self._wait_store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self._thread = threading.Thread(target=self._run, name="cnrstore-failure-watch", daemon=True)
        self._thread.start()

    @property
    def epoch(self) -> int:
        return self._epoch

    def failure(self) -> dict | None:
        """The failure posted for the current epoch (``source``, ``cause``, ``time``), or None."""
        with self._cond:
            return self._seen

    def report(self, cause: str) -> None:
        """Post a failure of the current epoch (a collective of this rank raised): every rank learns it."""
        try:
            _post(self._post_store, self._epoch, cause, f"rank {self.rank}")
        except Exception:   # the launcher (and its board) is gone: the collectives still fail on their own
            pass

    def rearm(self, epoch: int) -> None:
        """Watch failure ``epoch`` from now on (after the group was re-formed for it). The epoch left
        behind is marked failed on the board if nobody did (so the watch thread, which may be waiting on
        its key, moves on at once)."""
        if int(epoch) != self._epoch:
            self.report("moved on to the next process group")
        with self._cond:
            self._epoch = int(epoch)
            self._seen = None
            self._cond.notify_all()

    def check(self) -> None:
        """Raise PeerFailure if a failure of the current epoch is known."""
        seen = self.failure()
        if seen is not None:
            raise self._error(seen, "board")

    def _error(self, seen: dict, learned: str) -> PeerFailure:
        what = f"{seen.get('source')}: {seen.get('cause')}"
        return PeerFailure(f"rank {self.rank}: a peer failed (failure epoch {self._epoch}; {what}); this rank left "
                           "its collective. Re-form the process group with the replacement and recover.",
                           learned=learned, cause=what, epoch=self._epoch)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                epoch, seen = self._epoch, self._seen
                if seen is not None:          # this epoch's failure is known: wait for rearm() or close()
                    self._cond.wait()
                    continue
            try:
                self._wait_store.wait([_key(epoch)], timedelta(seconds=WATCH_WAIT_S))
                value = json.loads(self._wait_store.get(_key(epoch)))
            except Exception:                 # the board is gone (the launcher exited), or a day passed
                if self._closed or not self._board_alive():
                    return
                continue
            with self._cond:
                if self._epoch == epoch and self._seen is None:
                    self._seen = value
                    for ev in self._waiters:
                        ev.set()

    def _board_alive(self) -> bool:
        try:
            self._wait_store.check([_key(self._epoch)])
            return True
        except Exception:
            return False

    def _register(self, ev: threading.Event) -> None:
        with self._cond:
            self._waiters.add(ev)
            if self._seen is not None:
                ev.set()

    def _unregister(self, ev: threading.Event) -> None:
        with self._cond:
            self._waiters.discard(ev)

    def close(self) -> None:
        """Stop watching (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def install(watch: FailureWatch | None) -> None:
    """Make ``watch`` the process's watch: every collective of this module waits through it."""
    global _WATCH
    _WATCH = watch


def current() -> FailureWatch | None:
    return _WATCH


def uninstall() -> None:
    """Close and remove the installed watch."""
    global _WATCH
    watch, _WATCH = _WATCH, None
    if watch is not None:
        watch.close()


def _completion_event(works: list, done: threading.Event) -> dict:
    """Arrange for ``done`` to be set once every work has completed (successfully or not). Returns the
    state: ``complete`` turns True at that moment; ``errors`` holds what a helper thread's wait raised
    (works without futures, gloo's point-to-point ones, are waited on in a daemon thread)."""
    state = {"complete": False, "errors": [], "waited": False}
    futures = []
    for w in works:
        try:
            futures.append(w.get_future())
        except RuntimeError:              # "getFuture not implemented"
            futures = None
            break
    if futures is not None:
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_fut) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    state["complete"] = True
                    done.set()
        if not futures:
            state["complete"] = True
            done.set()
        for f in futures:
            f.add_done_callback(one_done)
        return state

    state["waited"] = True                # a second wait() on gloo's point-to-point work blocks

    def waiter() -> None:
        try:
            for w in works:
                w.wait()
        except BaseException as exc:     # re-raised by wait() in the caller's thread
            state["errors"].append(exc)
        state["complete"] = True
        done.set()
    threading.Thread(target=waiter, name="cnrstore-collective-wait", daemon=True).start()
    return state


def wait(works, group=None) -> None:
    """Wait for ``works`` (one or a list of ``dist.Work``) issued on ``group`` (None: the default group).

    Without an installed watch: ``work.wait()``. With one: returns when they complete; raises PeerFailure
    as soon as the current epoch's failure is known (the work is abandoned and kept referenced), or when a
    work fails (then the failure is posted on the board first, so that the other ranks learn it at once)."""
    works = list(works) if isinstance(works, (list, tuple)) else [works]
    watch = _WATCH
    if watch is None:
        for w in works:
            w.wait()
        return
    done = threading.Event()
    watch._register(done)
    try:
        state = _completion_event(works, done)
        done.wait()
    finally:
        watch._unregister(done)
    if not state["complete"]:             # woken by the watch: leave the work behind
        _ABANDONED.append((works, group if group is not None else dist.group.WORLD))
        raise watch._error(watch.failure() or {}, "board")
    try:
        if state["errors"]:
            raise state["errors"][0]
        if not state["waited"]:
            for w in works:               # completed: returns at once, or raises the work's error
                w.wait()
    except RuntimeError as exc:           # gloo: a peer closed its sockets (it died, or left the group)
        watch.report(f"{type(exc).__name__}: {str(exc)[:200]}")
        raise PeerFailure(f"rank {watch.rank}: a collective failed ({exc}); the failure is posted on the board. "
                          "Re-form the process group with the replacement and recover.",
                          learned="collective", cause=str(exc)[:200], epoch=watch.epoch) from exc


def _checked() -> None:
    if _WATCH is not None:
        _WATCH.check()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    """``dist.all_reduce`` (in place), waited on through :func:`wait`."""
    _checked()
    wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), group)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None) -> None:
    """``dist.all_gather``, waited on through :func:`wait`."""
    _checked()
    wait(dist.all_gather(tensor_list, tensor, group=group, async_op=True), group)


def batch_isend_irecv(ops: list) -> None:
    """``dist.batch_isend_irecv(ops)`` and wait for every one of them through :func:`wait`."""
    if not ops:
        return
    _checked()
    wait(dist.batch_isend_irecv(ops), ops[0].group)


def _to_bytes(obj, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def message_device(group=None) -> torch.device:
    """Where the tensors of an object collective on ``group`` (None: the default group) must live: the
    current CUDA device for an NCCL group (NCCL moves device memory only; as with torch's own object
    collectives, each rank must have called ``torch.cuda.set_device`` to its own GPU), the CPU otherwise
    (gloo). ``cnrstore.distributed``'s own collectives run on gloo groups of their own, so the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(object_list: list, obj, group=None) -> None:
    """``dist.all_gather_object`` on async tensor collectives (so :func:`wait` can leave it): fills
    ``object_list[r]`` with rank r's ``obj``. Objects are pickled; peers are trusted as with torch's. On
    an NCCL group the messages go through the current CUDA device (:func:`message_device`)."""
    if _WATCH is None:
        dist.all_gather_object(object_list, obj, group=group)
        return
    n = dist.get_world_size(group)
    if len(object_list) != n:
        raise InvalidArgument(f"object_list must have {n} entries, got {len(object_list)}")
    device = message_device(group)
    data = _to_bytes(obj, device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group)
    sizes = [int(s) for s in sizes]
    width = max(sizes)
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    out = [torch.empty(width, dtype=torch.uint8, device=device) for _ in range(n)]
    all_gather(out, padded, group)
    for r in range(n):
        object_list[r] = pickle.loads(out[r][:sizes[r]].cpu().numpy().tobytes())


def broadcast_object_list(object_list: list, src: int, group=None) -> None:
    """``dist.broadcast_object_list`` on async tensor collectives: every rank's ``object_list`` becomes
    rank ``src``'s (a global rank, as torch's). On an NCCL group the messages go through the current CUDA
    device (:func:`message_device`)."""
    if _WATCH is None:
        dist.broadcast_object_list(object_list, src=src, group=group)
        return
    _checked()
    device = message_device(group)
    mine = dist.get_rank() == src
    data = _to_bytes(list(object_list), device) if mine else torch.zeros(0, dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    wait(dist.broadcast(size, src=src, group=group, async_op=True), group)
    buf = data if mine else torch.empty(int(size), dtype=torch.uint8, device=device)
    wait(dist.broadcast(buf, src=src, group=group, async_op=True), group)
    if not mine:
        object_list[:] = pickle.loads(buf.cpu().numpy().tobytes())


def leave_group() -> None:
    """Destroy the default process group (and every group made in it) after a failure, without waiting
    for the work abandoned in it: the groups are kept referenced, so that no destructor joins gloo's
    worker threads, which stay blocked in that work."""
    if not dist.is_initialized():
        return
    _ABANDONED.append(dist.group.WORLD)
    dist.destroy_process_group()
