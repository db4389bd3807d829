"""The processes of test_serving.py's kill test: ``writer PATH`` saves deterministic versions with background
compaction, retention and GC until killed; ``follower PATH LOG`` follows the store with a
``cnrstore.serving.Follower`` and, after each poll, checks its arrays bit for bit against the version it
holds (table ``s`` holds the step a version was saved at; ``expected(step)`` is table ``t`` then),
appending ``ok VERSION STEP`` to LOG, or writing MISMATCH to stderr and exiting 1."""

from __future__ import annotations

import random
import sys
import time

import numpy as np

ROWS, DIM, PER_STEP = 256, 4, 16


def step_rows(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows step ``step`` puts in table ``t`` and their values (step 0: every row)."""
    rng = np.random.default_rng(1000 + step)
    rows = np.arange(ROWS) if step == 0 else np.sort(rng.choice(ROWS, PER_STEP, replace=False))
    return rows, rng.standard_normal((rows.size, DIM), dtype=np.float32)


class Expected:
    """``expected(step)`` computed incrementally (steps only go up within a follower process)."""

    def __init__(self):
        self.step = -1
        self.table = np.zeros((ROWS, DIM), np.float32)

    def at(self, step: int) -> np.ndarray:
        if step < self.step:
            self.__init__()
        while self.step < step:
            self.step += 1
            rows, vals = step_rows(self.step)
            self.table[rows] = vals
        return self.table


def expected(step: int) -> np.ndarray:
    return Expected().at(step).copy()


def writer(path: str) -> None:
    import cnrstore

    store = cnrstore.open(path, create=True, compaction="auto")
    store.create_table("t", ROWS, DIM, block_rows=32, exist_ok=True)
    store.create_table("s", 1, 1, exist_ok=True)
    latest = store.latest()
    step = 0 if latest is None else latest.step + 1
    while True:
        rows, vals = step_rows(step)
        with store.checkpoint(step=step) as ck:
            ck.put_rows("t", rows, vals)
            ck.put_rows("s", [0], np.full((1, 1), step, np.float32))
        if step % 5 == 4:
            store.retain(keep_last=2)
        if step % 9 == 8:
            store.gc()
        step += 1
        time.sleep(0.005)


def follower(path: str, log_path: str) -> None:
    from cnrstore.errors import CnrError
    from cnrstore.serving import Follower

    deadline = time.monotonic() + 20
    while True:
        target: dict = {}
        try:
            f = Follower(path, target)
            break
        except CnrError:  # no store, no table or no version yet: the writer is starting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    exp = Expected()
    with open(log_path, "a") as log:
        while True:
            with f.serving() as v:
                step = int(target["s"][0, 0])
                ok = np.array_equal(target["t"].view(np.uint32), exp.at(step).view(np.uint32))
            if not ok:
                print(f"MISMATCH at version {v} step {step}", file=sys.stderr, flush=True)
                sys.exit(1)
            log.write(f"ok {v} {step} {f.stats['full_syncs']}\n")
            log.flush()
            time.sleep(random.random() * 0.05)  # sometimes behind retention's keep_last=2: a re-sync
            while f.poll() is None:
                time.sleep(0.005)


if __name__ == "__main__":
    {"writer": writer, "follower": follower}[sys.argv[1]](*sys.argv[2:])
