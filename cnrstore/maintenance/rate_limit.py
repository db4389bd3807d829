"""A token bucket for background writes (RocksDB's ``RateLimiter`` in miniature).

Background merges ask it before each write; it sleeps just long enough that the bytes written stay within
``rate`` bytes per second on average, with a burst of one second's worth, so that merges leave the disk to
the trainer's saves.
"""

from __future__ import annotations

import time
from typing import Callable


class RateLimiter:
    """``rate`` bytes per second (None: no limit). ``acquire(n)`` blocks until ``n`` bytes may be written;
    ``halted()`` (checked while waiting) cuts a wait short."""

    def __init__(self, rate: float | None, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.rate = rate
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(rate or 0)  # a second's burst to start with
        self._stamp = clock()
        self.waited = 0.0  # seconds spent waiting (reported by merges)

    def acquire(self, n: int, halted: Callable[[], bool] = lambda: False) -> None:
        if self.rate is None or n <= 0:
            return
        self._refill()
        self._tokens -= n  # may go negative: the debt is waited off now, in short sleeps
        while self._tokens < 0 and not halted():
            pause = min(-self._tokens / self.rate, 0.1)
            self._sleep(pause)
            self.waited += pause
            self._refill()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self.rate), self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
