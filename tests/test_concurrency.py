"""I5: a reader sees one committed version in full while a writer commits.

The data make every read self-identifying: every version writes row 0 with its version number, and
every row it writes holds (writing version, row, a function of both) exactly (fp32). A read at
``version=None`` names the version it saw in row 0, and must equal that version's full state.

(a) reader threads of this process (on the writer's Store and on a readonly Store opened beside it)
    race a writer thread that commits, and sometimes aborts, versions in a loop;
(b) a readonly reader in another process reads the newest version over and over while this process
    commits; it must see every read consistent, and see new versions appear.
The index map starts tiny so that it grows (across threads and processes) while the readers read.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import cnrstore
from cnrstore import knobs

NUM_ROWS, DIM, BLOCK = 512, 6, 64

#: Shared by this process and the reader subprocess: version v's rows and values are functions of v.
WORKLOAD = textwrap.dedent('''
    import numpy as np

    def rows_of(v, num_rows):
        """Rows written by version v: row 0, and a random subset (every row for version 1)."""
        if v == 1:
            return np.arange(num_rows)
        rng = np.random.default_rng(v)
        rows = rng.choice(np.arange(1, num_rows), size=int(rng.integers(1, num_rows // 2)), replace=False)
        return np.r_[0, rows]

    def values_of(v, rows, dim):
        """(writing version, row, a mix of both, ...): integers below 2**24, exact in fp32."""
        rows = np.asarray(rows, dtype=np.int64)
        cols = np.arange(dim - 2)
        mix = (v * 7919 + rows[:, None] * 31 + cols[None, :] * 977) % 65521
        out = np.empty((rows.size, dim), dtype=np.float32)
        out[:, 0] = v
        out[:, 1] = rows
        out[:, 2:] = mix
        return out

    class States:
        """Expected content of each version, given that versions 1..V all committed."""

        def __init__(self, num_rows, dim):
            self.num_rows, self.dim = num_rows, dim
            self.states = {0: np.full((num_rows, dim), np.nan, dtype=np.float32)}

        def at(self, v):
            while v not in self.states:
                u = max(self.states)
                s = self.states[u].copy()
                rows = rows_of(u + 1, self.num_rows)
                s[rows] = values_of(u + 1, rows, self.dim)
                self.states[u + 1] = s
            return self.states[v]
''')
_ns: dict = {}
exec(WORKLOAD, _ns)
rows_of, values_of, States = _ns["rows_of"], _ns["values_of"], _ns["States"]


def _put_version(ck, v_rows: np.ndarray, values: np.ndarray) -> None:
    """Two put_rows calls (blocks shared between them are merged), rows in a shuffled order."""
    half = v_rows.size // 2
    ck.put_rows("t", v_rows[:half], values[:half])
    ck.put_rows("t", v_rows[half:], values[half:])
    ck.put_dense("stamp", np.array([ck.version], dtype=np.int64))


# -- (a) threads of one process ---------------------------------------------------------------------------

def test_reader_threads_see_whole_committed_versions(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 24 << 10)  # readers keep mapping new segments
    monkeypatch.setattr(knobs, "INDEX_MAP_BYTES", 32 << 10)  # the map grows under the readers
    path = str(tmp_path / "store")
    store = cnrstore.open(path, create=True)
    store.create_table("t", NUM_ROWS, DIM, codec="fp32", block_rows=BLOCK)
    expected: dict[int, np.ndarray] = {}  # filled before each commit, so any visible version is here
    committed: list[int] = []  # appended once each commit has returned
    aborted: set[int] = set()
    state = np.full((NUM_ROWS, DIM), np.nan, dtype=np.float32)
    with store.checkpoint() as ck:
        rows = np.arange(NUM_ROWS)
        _put_version(ck, rows, values_of(ck.version, rows, DIM))
        state[rows] = values_of(ck.version, rows, DIM)
        expected[ck.version] = state.copy()
    committed.append(ck.version)
    side = cnrstore.open(path, readonly=True)  # a readonly Store beside the writer, in this process
    stop = threading.Event()
    errors: list[str] = []
    counts = {"latest": 0, "old": 0, "distinct": set()}
    lock = threading.Lock()

    class Aborted(Exception):
        pass

    def writer():
        nonlocal state
        rng = random.Random(1)
        try:
            deadline = time.monotonic() + 2.5
            n = 0
            while time.monotonic() < deadline or n < 15:
                n += 1
                abort = rng.random() < 0.2
                if n % 4 == 0:  # a failed index write (its transaction aborts) amid the readers
                    with pytest.raises(cnrstore.InvalidArgument):
                        store.create_table("t", NUM_ROWS, DIM)
                try:
                    with store.checkpoint() as ck:
                        v = ck.version
                        rows = rows_of(v, NUM_ROWS)
                        vals = values_of(v, rows, DIM)
                        perm = np.random.default_rng(v).permutation(rows.size)
                        _put_version(ck, rows[perm], vals[perm])
                        if abort:
                            aborted.add(v)
                            raise Aborted()
                        nxt = state.copy()
                        nxt[rows] = vals
                        expected[v] = nxt
                    state = nxt
                    committed.append(v)
                except Aborted:
                    pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"writer: {exc!r}")
        finally:
            stop.set()

    def check(table: np.ndarray, v: int, rows=None, what="") -> None:
        want = expected.get(v)
        if want is None:
            errors.append(f"{what}: read version {v}, which was never committed (aborted: {v in aborted})")
            return
        want = want if rows is None else want[rows]
        if not np.array_equal(table, want):
            bad = np.argwhere(table != want)[:3].tolist()
            errors.append(f"{what}: version {v} read wrong values at {bad}")

    def reader(seed: int, s):
        rng = np.random.default_rng(seed)
        last = 0
        try:
            while not stop.is_set():
                op = int(rng.integers(5))
                if op == 0:
                    out = s.read_table("t")
                    v = int(out[0, 0])
                    check(out, v, what="read_table(None)")
                elif op == 1:
                    rows = np.r_[0, rng.integers(0, NUM_ROWS, 40)]  # repeats allowed
                    out = s.read_rows("t", rows)
                    v = int(out[0, 0])
                    check(out, v, rows, what="read_rows(None)")
                elif op == 2:
                    snap = s.restore()
                    v = snap.version
                    check(snap.tables["t"], v, what="restore(None)")
                    if int(snap.dense["stamp"][0]) != v:
                        errors.append(f"restore({v}) read stamp {snap.dense['stamp']}")
                else:
                    u = committed[int(rng.integers(len(committed)))]  # committed, maybe long ago
                    if op == 3:
                        check(s.read_table("t", version=u), u, what=f"read_table({u})")
                    else:
                        rows = rng.integers(0, NUM_ROWS, 25)
                        check(s.read_rows("t", rows, version=u), u, rows, what=f"read_rows({u})")
                        if int(s.read_dense("stamp", version=u)[0]) != u:
                            errors.append(f"read_dense(stamp, {u}) is wrong")
                    with lock:
                        counts["old"] += 1
                    continue
                if v < last:
                    errors.append(f"newest version went back from {last} to {v}")
                last = v
                with lock:
                    counts["latest"] += 1
                    counts["distinct"].add(v)
        except BaseException as exc:  # noqa: BLE001 - no reader may ever see an error
            errors.append(f"reader {seed}: {exc!r}")

    threads = [threading.Thread(target=writer, daemon=True)]
    threads += [threading.Thread(target=reader, args=(i, store if i % 2 else side), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    threads[0].join(60)
    stop.set()  # should the writer hang, stop the readers anyway
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "the writer (or a reader) hung"
    try:
        assert not errors, errors[:10]
        assert counts["latest"] > 20 and counts["old"] > 10, counts
        assert len(counts["distinct"]) >= 3, "readers saw new versions appear"
        assert aborted and not aborted & {i.version for i in store.versions()}
        newest = max(expected)
        assert side.latest().version == newest == store.latest().version
        np.testing.assert_array_equal(side.read_table("t"), expected[newest])
        assert store.engine._index.map_size() > 32 << 10, "the index map grew while the readers read"
    finally:
        side.close()
        store.close()


# -- (b) a readonly reader in another process -------------------------------------------------------------

READER = WORKLOAD + textwrap.dedent('''
    import os, sys
    import cnrstore
    from cnrstore import knobs

    knobs.INDEX_MAP_BYTES = 32 << 10
    path, stop_file, num_rows, dim = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    states = States(num_rows, dim)

    def check(out, v, rows=None):
        want = states.at(v) if rows is None else states.at(v)[rows]
        if not np.array_equal(out, want):
            print("error version", v, "read wrong values at", np.argwhere(out != want)[:3].tolist(), flush=True)
            sys.exit(1)

    rng = np.random.default_rng(0)
    last = 0
    with cnrstore.open(path, readonly=True) as store:
        print("ready", flush=True)
        while True:
            stopping = os.path.exists(stop_file)  # created after the writer's last commit
            out = store.read_table("t")
            v = int(out[0, 0])
            check(out, v)
            rows = np.r_[0, rng.integers(0, num_rows, 30)]
            part = store.read_rows("t", rows)
            check(part, int(part[0, 0]), rows)
            if int(part[0, 0]) < v or v < last:
                print("error newest version went back", last, v, int(part[0, 0]), flush=True)
                sys.exit(1)
            last = int(part[0, 0])
            u = int(rng.integers(1, last + 1))
            check(store.read_table("t", version=u), u)
            print("seen", last, flush=True)
            if stopping:
                print("final", last, store.latest().version, flush=True)
                break
''')


def test_readonly_process_reads_while_this_process_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 24 << 10)
    monkeypatch.setattr(knobs, "INDEX_MAP_BYTES", 32 << 10)
    path = str(tmp_path / "store")
    script = tmp_path / "reader.py"
    script.write_text(READER)
    stop_file = str(tmp_path / "stop")
    with cnrstore.open(path, create=True) as store:
        store.create_table("t", NUM_ROWS, DIM, codec="fp32", block_rows=BLOCK)

        def commit_next():
            with store.checkpoint() as ck:
                rows = rows_of(ck.version, NUM_ROWS)
                _put_version(ck, rows, values_of(ck.version, rows, DIM))
            return ck.version

        assert commit_next() == 1
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, str(script), path, stop_file, str(NUM_ROWS), str(DIM)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout.readline().split() == ["ready"], proc.stderr.read()
            deadline = time.monotonic() + 2.0
            last = 1
            while time.monotonic() < deadline or last < 15:
                last = commit_next()
            open(stop_file, "w").close()
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, (out[-2000:], err[-4000:])
    lines = [line.split() for line in out.splitlines()]
    assert not [w for w in lines if w[0] == "error"], out
    seen = [int(w[1]) for w in lines if w[0] == "seen"]
    assert seen == sorted(seen), "the newest version never goes back"
    assert len(set(seen)) >= 3, f"the reader saw new versions appear: {sorted(set(seen))}"
    assert lines[-1] == ["final", str(last), str(last)], "after the writer stops, it sees the newest version"
