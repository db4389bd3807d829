"""I2 + I3 for maintenance: a crash at any point of compact, retain or gc loses no retained version.

A maintainer subprocess (tests/support/crash_writer.py ``run_maintainer``, forked by the crash writer's fork
server) runs compact / retain / gc / checkpoints on a prepared store and dies by SIGKILL:

- at each named crash point of compaction and GC (``compact_after_append``,
  ``compact_inside_index_commit``, ``gc_after_append``, ``gc_inside_index_commit``), reached through
  ``compact``, through ``retain``'s drop, and through ``gc``'s cleaning;
- at random instants of a loop of checkpoint + compact + retain + gc.

After each crash: the set of versions is the one before the operation in flight or the one after it
(a retain killed before its commit dropped nothing); every version in it reads exactly (the workload
is a function of the version number, so the expected content is recomputed here, over every version
ever committed, dropped ones included); a readonly open reads through whatever the crash left; a
writable open leaves exactly the index's segments on disk (no stray file, and no doomed one once no
reader needs it); ``verify()`` passes; and checkpoints and maintenance work again.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import time

import pytest

import cnrstore
from cnrstore import knobs

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, folder: str = HERE):
    spec = importlib.util.spec_from_file_location(f"_{name}_for_compaction", os.path.join(folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cw = _load("crash_writer", os.path.join(HERE, "support"))
tc = _load("test_crash")  # its fork-server client (WriterServer, Run) and segment helpers

SEGMENT_BYTES = 12 << 10  # a version of the workload is ~10-20 KiB: a store of 8 versions has ~15 segments


#: the expected values are computed with the codecs here too: keep that fast (conftest.py)
pytestmark = pytest.mark.usefixtures("single_threaded_torch")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = tc.WriterServer(str(tmp_path_factory.mktemp("server") / "stderr.txt"))
    yield srv
    srv.close()


def prepare(path: str, versions: int = 8) -> list[int]:
    """A store of the crash workload with ``versions`` versions in small segments."""
    old = knobs.SEGMENT_BYTES
    knobs.SEGMENT_BYTES = SEGMENT_BYTES
    try:
        with cnrstore.open(path, create=True) as store:
            cw.create_tables(store)
            for _ in range(versions):
                with store.checkpoint(step=cw.STEP, meta=cw.META) as ck:
                    cw.write_version(ck)
            return [i.version for i in store.versions()]
    finally:
        knobs.SEGMENT_BYTES = old


def index_meta(store) -> tuple[dict[int, int], set[int]]:
    with store.engine.read() as view:
        return view.segments(), {int(k) for k in view.meta("doomed_segments", {})}


def check_after_crash(path: str, model, ever: list[int], allowed: list[list[int]], *,
                      torn: bool | None = None) -> list[int]:
    """Readonly, then writable (recovering) opens of a crashed store; returns its versions. ``torn``:
    whether the crash must have left (True) or cannot have left (False) bytes past the index."""
    with cnrstore.open(path, readonly=True) as ro:  # reads through torn tails and uncommitted segments
        now = [i.version for i in ro.versions()]
        assert now in allowed, (now, allowed)
        committed, doomed = index_meta(ro)
        assert set(committed) <= set(tc.segment_files(path)), "no committed segment was deleted"
        assert not doomed & set(committed)
        files = {s: n for s, n in tc.segment_files(path).items() if s not in doomed}
        if torn is not None:
            assert (files != committed) == torn, (files, committed)
        for v in now:
            cw.check_version(ro, model, ever, v)
    with cnrstore.open(path) as store:
        assert [i.version for i in store.versions()] == now
        committed, doomed = index_meta(store)
        assert not doomed, "no reader: a writable open deletes every doomed segment"
        assert tc.segment_files(path) == committed, "exactly the index's segments remain, none torn"
        report = store.verify()
        assert report.ok, report.problems[:5]
        for v in now:
            cw.check_version(store, model, ever, v)
    return now


def work_again(path: str, model, ever: list[int], now: list[int]) -> None:
    """After recovery: a checkpoint, then compact + retain + gc of this process, all reading right."""
    with cnrstore.open(path) as store:
        with store.checkpoint(step=cw.STEP, meta=cw.META) as ck:
            cw.write_version(ck)
        assert ck.version > max(ever)
        ever = ever + [ck.version]
        store.compact(now[-1])
        store.compact()
        dropped = store.retain(keep_last=2)
        assert dropped == now[:-1]
        store.gc()
        kept = [i.version for i in store.versions()]
        assert kept == [now[-1], ck.version]
        for v in kept:
            cw.check_version(store, model, ever, v)
        assert store.verify().ok
        committed, doomed = index_meta(store)
        assert not doomed and tc.segment_files(path) == committed


def run_ops(server, path: str, ops: list, crash_at: str | None = None) -> "tc.Run":
    pid = server.start(mode="maintain", store=path, ops=ops, segment_bytes=SEGMENT_BYTES, crash_at=crash_at)
    return server.finish(pid, timeout=60)


def op_events(run) -> list[tuple]:
    """("op", i, name, arg) / ("did", i) / ("dropped", [versions]) in the order the child printed them."""
    out = []
    for words in run.lines:
        if words[0] == "op":
            arg = None if words[3] == "None" else int(words[3]) if words[3].isdigit() else words[3]
            out.append(("op", int(words[1]), words[2], arg))
        elif words[0] == "did":
            out.append(("did", int(words[1])))
        elif words[0] == "dropped":
            out.append(("dropped", [int(w) for w in words[1:]]))
    return out


# -- named crash points --------------------------------------------------------------------------------

NAMED = [
    ("compact_after_append", [["compact", None]], "before"),
    ("compact_after_append", [["compact", 4]], "before"),
    ("compact_inside_index_commit", [["compact", 5]], "before"),
    ("drop_after_append", [["retain", 3]], "before"),  # retain's DROP record appended, not committed
    ("drop_inside_index_commit", [["retain", 3]], "before"),
    ("gc_cleaned_segment", [["retain", 3], ["gc", None]], "after"),  # live rows copied, not committed
    ("gc_after_append", [["retain", 3], ["gc", None]], "after"),
    ("gc_inside_index_commit", [["retain", 3], ["gc", None]], "after"),
]


@pytest.mark.parametrize("point,ops,expect", NAMED,
                         ids=[f"{p}-{'+'.join(o[0] for o in ops)}" for p, ops, _e in NAMED])
def test_named_crash_point(server, tmp_path, point, ops, expect):
    path = str(tmp_path / "store")
    before = prepare(path)
    after = before[-3:]
    run = run_ops(server, path, ops, crash_at=point)
    assert run.killed, (run.status, run.lines)
    events = op_events(run)
    assert events[-1][0] == "op", "the crash point was reached inside an operation"
    if expect == "after":
        assert ("dropped", before[:-3]) in events, "the retain before the gc returned"
    model = cw.Model()
    # compaction appended baselines, and GC copies of partly live segments, past the index before dying
    now = check_after_crash(path, model, before, [before if expect == "before" else after], torn=True)
    if point.startswith("gc"):
        with cnrstore.open(path, readonly=True) as ro:
            assert ro.stats()["versions"] == 3
    work_again(path, model, before, now)


def test_crash_in_gc_with_segments_still_doomed(server, tmp_path):
    """A reader keeps the segments a first gc freed on disk (doomed); a second gc dies mid-commit. The
    doomed segments stay listed and on disk until the reader is done; the writable open after it
    deletes them, and nothing else is lost or left behind."""
    path = str(tmp_path / "store")
    before = prepare(path)
    holder = cnrstore.open(path, readonly=True)
    try:
        with holder.engine.read():  # a reader in the middle of a read, from before both gcs
            run = run_ops(server, path, [["retain", 4], ["gc", None], ["checkpoint", None], ["compact", None],
                                         ["retain", 2], ["arm", "gc_inside_index_commit"], ["gc", None]])
            assert run.killed, run.lines
            new = run.committed
            assert len(new) == 1
            ever = before + new
            with cnrstore.open(path, readonly=True) as ro:
                assert [i.version for i in ro.versions()] == [before[-1], new[0]]
                committed, doomed = index_meta(ro)
            assert doomed, "the first gc's segments wait for the reader"
            assert doomed <= set(tc.segment_files(path)) and not doomed & set(committed)
    finally:
        holder.close()
    model = cw.Model()
    now = check_after_crash(path, model, ever, [[before[-1], new[0]]])
    assert not doomed & set(tc.segment_files(path))
    work_again(path, model, ever, now)


# -- random instants -----------------------------------------------------------------------------------

def expected_sets(present: list[int], events: list[tuple], begun: list[int]) -> tuple[list[int], list[list[int]]]:
    """Versions after the last acknowledged operation, and the sets the store may hold after a kill
    in the operation in flight (the before set, or the after set of that operation)."""
    state = list(present)
    pending = None  # the operation begun and not acknowledged
    for ev in events:
        if ev[0] == "op":
            pending = ev
        elif ev[0] == "did":
            if pending[2] == "checkpoint":
                state.append(begun.pop(0))
            elif pending[2] == "retain":
                state = state[-pending[3]:]
            pending = None
        elif ev[0] == "dropped":
            assert ev[1] == state[:-pending[3]], (ev, state, pending)
    allowed = [state]
    if pending is not None and pending[2] == "checkpoint" and begun:
        allowed.append(state + [begun[0]])  # committed, not yet acknowledged
    elif pending is not None and pending[2] == "retain" and len(state) > pending[3]:
        allowed.append(state[-pending[3]:])  # dropped, not yet acknowledged
    return state, allowed


def test_sigkill_at_random_instants(server, tmp_path):
    """Kills of a process that checkpoints, compacts, retains and collects in a loop."""
    path = str(tmp_path / "store")
    present = prepare(path, versions=4)
    ever = list(present)
    model = cw.Model()
    rng = random.Random(20220405)
    landed: dict[str, int] = {}
    for i in range(10):
        pid = server.start(mode="maintain", store=path, ops=None, segment_bytes=SEGMENT_BYTES, seed=i)
        time.sleep(rng.uniform(0.3, 0.9))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended by itself: only an error ends the endless loop
            pass
        run = server.finish(pid)
        assert run.killed and not run.done, run.lines
        events = op_events(run)
        # checkpoints in the order begun; the acknowledged ones are known committed
        begun = list(run.begun)
        ever = sorted(set(ever) | set(run.committed))
        _state, allowed = expected_sets(present, events, list(begun))
        in_flight = next((ev for ev in reversed(events) if ev[0] == "op"), None)
        if in_flight is not None and not any(ev == ("did", in_flight[1]) for ev in events):
            landed[in_flight[2]] = landed.get(in_flight[2], 0) + 1
        with cnrstore.open(path, readonly=True) as ro:
            now = [info.version for info in ro.versions()]
        ever = sorted(set(ever) | set(now))  # a checkpoint that committed before its acknowledgement
        present = check_after_crash(path, model, ever, allowed)
        assert present == now
    # about half the kills land in maintenance (the rest in checkpoints): at least one, all but surely
    assert sum(landed.get(op, 0) for op in ("compact", "retain", "gc")) >= 1, landed
    assert max(ever) > 10, "the maintainer made progress between kills"
    work_again(path, model, ever, present)
