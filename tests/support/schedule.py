"""Races by schedule: stop a thread at a named pause point (``cnrstore.engine.fs.pause_point``; every crash
point is one) while the test runs other work, then let it go on. The same interleaving every run.

    with Pause("gc_planned") as gc_paused:
        t = run_in_thread(store.gc)
        gc_paused.wait_reached()
        ...  # what must happen between GC's plan and its commit
        gc_paused.release()
        t.result()
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from cnrstore.engine import fs

TIMEOUT_S = 60.0


class Pause:
    """Holds the first ``times`` threads that reach pause point ``name`` until ``release``."""

    def __init__(self, name: str, *, times: int = 1):
        self.name = name
        self.times = times
        self.hits = 0
        self._reached = threading.Event()
        self._go = threading.Event()
        self._lock = threading.Lock()

    def _hook(self, _name: str, *_detail) -> None:
        with self._lock:
            if self.hits >= self.times:
                return
            self.hits += 1
        self._reached.set()
        if not self._go.wait(TIMEOUT_S):
            raise AssertionError(f"pause point {self.name!r} was never released")

    def wait_reached(self) -> None:
        if not self._reached.wait(TIMEOUT_S):
            raise AssertionError(f"no thread reached pause point {self.name!r}")

    def release(self) -> None:
        self._go.set()

    def __enter__(self) -> "Pause":
        fs.pause_at(self.name, self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        fs.pause_at(self.name, None)


def run_in_thread(fn, *args, **kwargs) -> Future:
    """Run ``fn`` in a new thread; the Future gives its result or re-raises its exception."""
    future: Future = Future()

    def body():
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the test through the future
            future.set_exception(exc)

    threading.Thread(target=body, daemon=True).start()
    return future
