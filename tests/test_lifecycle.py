"""Issue 21, "never lose a version": work a user was told is done or pending survives close() and the
interpreter's exit.

- fault 10: retention runs for one-checkpoint-per-process jobs (close() finishes the pending policy step,
  a writable open catches up);
- fault 11: a save() that returned commits when the process then dies of Ctrl-C or an uncaught exception
  (the store's exit hook waits for it, bounded by ``store.EXIT_WAIT_S``; an interrupt while waiting
  abandons it, leaving the store as kill -9 would: consistent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import fs
from cnrstore.policy import CompactionPolicy, KeepLast, Retention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(cnrstore.__file__)))
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def _child(tmp_path, body: str, *args, env=None, **kw) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script), *map(str, args)], env={**CHILD_ENV, **(env or {})},
                          capture_output=True, text=True, timeout=kw.get("timeout", 120))


# -- fault 10: retention for one-checkpoint-per-process jobs ----------------------------------------------

def _session(path, i, policy, close=True, **close_kw):
    store = cnrstore.open(path, create=True, compaction=policy)
    if "e" not in store.tables():
        store.create_table("e", 1000, 4, codec="fp32")
    values = np.full((1000, 4), i, np.float32)
    with store.checkpoint(step=i) as ck:
        ck.put_rows("e", np.arange(1000), values)
    if close:
        store.close(**close_kw)
    return store


def test_keep_last_2_over_10_one_checkpoint_sessions_leaves_2_versions(store_path):
    """Issue 21 fault 10: each session opens, saves one version and closes; the policy's plan is applied
    for every committed version however short the process (before: close() dropped the pending step and
    10 sessions left 10 versions)."""
    policy = CompactionPolicy(retention=Retention(KeepLast(2)))
    for i in range(10):
        _session(store_path, i, policy)
    with cnrstore.open(store_path) as store:
        assert [v.step for v in store.versions()] == [8, 9]
        for v in store.versions():
            assert np.array_equal(store.read_table("e", v.version), np.full((1000, 4), v.step, np.float32))
        assert store.verify().ok


def test_keep_last_2_over_10_one_checkpoint_processes_that_never_close(tmp_path, store_path):
    """The same with processes that exit without close(): the exit hook finishes the pending step (and
    whatever one misses, the next writable open catches up)."""
    body = """
        import sys, numpy as np, cnrstore
        from cnrstore.policy import CompactionPolicy, KeepLast, Retention
        store = cnrstore.open(sys.argv[1], create=True, compaction=CompactionPolicy(retention=Retention(KeepLast(2))))
        if "e" not in store.tables():
            store.create_table("e", 1000, 4, codec="fp32")
        with store.checkpoint(step=int(sys.argv[2])) as ck:
            ck.put_rows("e", np.arange(1000), np.full((1000, 4), int(sys.argv[2]), np.float32))
        # no close(): the process just ends
    """
    for i in range(10):
        proc = _child(tmp_path, body, store_path, i)
        assert proc.returncode == 0, proc.stderr
    with cnrstore.open(store_path) as store:
        assert [v.step for v in store.versions()] == [8, 9]
        assert store.verify().ok


def test_a_writable_open_with_a_policy_catches_up_on_the_history(store_path):
    """Versions committed without the policy (another process, a crash, close(finish_compaction=False))
    are dropped by the next writable open's catch-up step, without a new commit."""
    for i in range(6):
        _session(store_path, i, None)
    with cnrstore.open(store_path, readonly=True) as store:
        assert len(store.versions()) == 6  # a readonly open changes nothing
    store = cnrstore.open(store_path, compaction=CompactionPolicy(retention=Retention(KeepLast(2))))
    assert store._compactor.wait_idle(30)
    assert [v.step for v in store.versions()] == [4, 5]
    store.close()


class _GatedPolicy(CompactionPolicy):
    """A policy whose first plan waits for ``gate``: the commits meanwhile leave a step pending."""

    def plan(self, history):
        if not self.__dict__.get("_passed"):
            object.__setattr__(self, "_passed", True)
            assert self.__dict__["_gate"].wait(30)
        return super().plan(history)


def _gated(gate):
    policy = _GatedPolicy(retention=Retention(KeepLast(2)))
    object.__setattr__(policy, "_gate", gate)
    return policy


@pytest.mark.parametrize("finish", [True, False])
def test_close_finishes_the_pending_step_unless_told_to_skip_it(store_path, finish):
    gate = threading.Event()
    store = cnrstore.open(store_path, create=True, compaction=_gated(gate))  # its catch-up step waits
    store.create_table("e", 1000, 4, codec="fp32")
    for i in range(4):  # commits while the worker is busy: one step pending
        with store.checkpoint(step=i) as ck:
            ck.put_rows("e", np.arange(1000), np.full((1000, 4), i, np.float32))
    assert store._compactor.pending
    threading.Timer(0.2, gate.set).start()
    store.close(finish_compaction=finish)
    with cnrstore.open(store_path) as again:
        assert [v.step for v in again.versions()] == ([2, 3] if finish else [0, 1, 2, 3])
    if not finish:  # skipped at close: the next open with the policy catches up
        with cnrstore.open(store_path, compaction=CompactionPolicy(retention=Retention(KeepLast(2)))) as again:
            again._compactor.wait_idle(30)
            assert [v.step for v in again.versions()] == [2, 3]


# -- fault 11: a returned save() commits when the process dies of Ctrl-C or an uncaught exception ---------

SAVER = """
    import os, sys, time, pickle, signal
    # Ctrl-C as in an interactive Python, whatever this test process passed on: an ignored or blocked
    # SIGINT is inherited across fork and exec (and Python then installs no KeyboardInterrupt handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    import numpy as np, torch
    from torch import nn
    import cnrstore
    from cnrstore.engine import writer
    from cnrstore.torch import Checkpointer

    path, how, slow = sys.argv[1], sys.argv[2], float(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(200, 8), nn.Linear(8, 1))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)

    def train(i):
        opt.zero_grad()
        model(torch.randint(0, 200, (16,), generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()

    store = cnrstore.open(path, create=True)
    ckpt = Checkpointer(store, model, opt, codec="fp32")
    train(0)
    ckpt.save(1).wait()
    train(1)
    real = writer.CheckpointWriter.put_rows
    def put_rows(self, *a, **kw):  # a slow device: the save is surely in flight when the process dies
        time.sleep(slow)
        return real(self, *a, **kw)
    writer.CheckpointWriter.put_rows = put_rows
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(2)  # returns at once; the write runs in the background
    with open(path + ".expected", "wb") as f:
        pickle.dump({k: v.numpy() for k, v in expected.items()}, f)
    print("saved", flush=True)
    # say when the exit (or close) starts waiting for the save: the parent's Ctrl-C then lands in the wait
    cnrstore.engine.fs.pause_at("checkpointer_waits_for_save", lambda _name: print("waiting", flush=True))
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "error":
        raise RuntimeError("the trainer crashed")
    if how == "with":  # the store's with-block: close() waits for the save, not aborts it
        with store:
            raise KeyboardInterrupt
    if how == "sleep":
        time.sleep(600)
"""


def _restored(path, version):
    import torch
    from torch import nn
    from cnrstore.torch import Checkpointer

    model = nn.Sequential(nn.Embedding(200, 8), nn.Linear(8, 1))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with cnrstore.open(path) as store:
        Checkpointer(store, model, opt, codec="fp32").restore(version)
        assert store.verify().ok
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("how", ["interrupt", "error", "with"])
def test_save_then_ctrl_c_or_uncaught_exception_commits_the_save(tmp_path, store_path, how):
    """Issue 21 fault 11: Ctrl-C (KeyboardInterrupt) or any uncaught exception right after save() returns
    used to lose that save (a daemon thread, and the next open truncated its torn tail). Now the exit
    hook (or the with-block's close()) waits for it: the version is committed and bit-exact."""
    import pickle

    proc = _child(tmp_path, SAVER, store_path, how, 0.3)
    assert proc.returncode != 0 and "saved" in proc.stdout
    assert ("KeyboardInterrupt" if how != "error" else "the trainer crashed") in proc.stderr
    with cnrstore.open(store_path) as store:
        assert [v.step for v in store.versions()] == [1, 2], proc.stderr
        assert store.recovery_notes == []  # nothing torn to truncate: the save ended cleanly
    with open(store_path + ".expected", "rb") as f:
        expected = pickle.load(f)
    got = _restored(store_path, None)
    assert expected.keys() == got.keys()
    for k in expected:
        assert np.array_equal(expected[k].view(np.uint8), got[k].view(np.uint8)), k


def test_a_hung_save_cannot_hang_the_exit_forever(tmp_path, store_path):
    """A save that outlives store.EXIT_WAIT_S is abandoned: the process exits, the store is as kill -9
    leaves it (the version absent, every committed one intact)."""
    start = time.monotonic()
    proc = _child(tmp_path, SAVER, store_path, "interrupt", 120, env={"CNRSTORE_EXIT_WAIT_S": "1"})
    assert time.monotonic() - start < 60
    assert "not closed" in proc.stderr and "EXIT_WAIT_S" in proc.stderr
    with cnrstore.open(store_path) as store:
        assert [v.step for v in store.versions()] == [1]
        assert store.verify().ok
    assert _restored(store_path, None)  # version 1 restores


def test_ctrl_c_while_the_exit_waits_abandons_the_save_consistently(tmp_path, store_path):
    """A second Ctrl-C while the exit waits for the save gives up on it at once: the store is consistent."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(SAVER))
    proc = subprocess.Popen([sys.executable, str(script), store_path, "interrupt", "120"], env=CHILD_ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved"
        assert proc.stdout.readline().strip() == "waiting"  # the exit hook is waiting for the save
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "interrupted" in err and "not closed" in err
    with cnrstore.open(store_path) as store:
        assert [v.step for v in store.versions()] == [1]
        assert store.verify().ok


def test_interrupt_while_close_waits_for_a_save_leaves_the_store_open_and_consistent(store_path, monkeypatch):
    """A second Ctrl-C while store.close() waits for a save (the first one is what the trainer is exiting
    on): the save is told to abort at its next step, the store stays open (never closed under the writing
    thread); the next close() finishes."""
    import torch
    from torch import nn
    from cnrstore.engine import writer
    from cnrstore.torch import Checkpointer

    model = nn.Sequential(nn.Embedding(50, 4), nn.Embedding(50, 4))
    store = cnrstore.open(store_path, create=True)
    ckpt = Checkpointer(store, model, codec="fp32")
    ckpt.save(1).wait()
    real = writer.CheckpointWriter.put_rows
    go_on = threading.Event()

    def put_rows(self, *a, **kw):  # the save stays in flight until the test has interrupted close()
        assert go_on.wait(60)
        return real(self, *a, **kw)

    monkeypatch.setattr(writer.CheckpointWriter, "put_rows", put_rows)
    for emb in model:  # rows to write: two put_rows
        emb(torch.arange(50))
    pending = ckpt.save(2)

    def ctrl_c(_name):  # Ctrl-C, as close() starts waiting for the save
        fs.pause_at("checkpointer_waits_for_save", None)
        raise KeyboardInterrupt

    fs.pause_at("checkpointer_waits_for_save", ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                raise KeyboardInterrupt  # the first Ctrl-C, in the training loop
            except KeyboardInterrupt:
                store.close()
    finally:
        fs.pause_at("checkpointer_waits_for_save", None)
        go_on.set()
    assert not store._closed
    store.close()  # waits for the cancelled save to abort, then closes
    assert pending.done()
    with pytest.raises(KeyboardInterrupt, match="cancelled"):
        pending.wait()
    with cnrstore.open(store_path) as again:
        assert [v.step for v in again.versions()] == [1] and again.verify().ok


DIST_SAVER = """
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch import nn
    from cnrstore.engine import writer
    from cnrstore.distributed import DistributedCheckpointer, ShardingPlan

    root, rdzv = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 4), nn.Linear(4, 1))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ckpt = DistributedCheckpointer(root, model, opt, plan=ShardingPlan.row_wise({"0": (100, 4)}, 1), codec="fp32")
    model(torch.arange(10)).sum().backward(); opt.step()
    ckpt.save(1).wait()
    model(torch.arange(20)).sum().backward(); opt.step()
    real = writer.CheckpointWriter.put_rows
    def put_rows(self, *a, **kw):
        time.sleep(0.3)
        return real(self, *a, **kw)
    writer.CheckpointWriter.put_rows = put_rows
    torch.save(model.state_dict(), root + ".expected")
    ckpt.save(2)
    print("saved", flush=True)
    raise KeyboardInterrupt
"""


def test_distributed_save_then_ctrl_c_becomes_a_global_version(tmp_path):
    """The DistributedCheckpointer's global commit runs in a daemon thread of its own after the local
    write: the exit waits for it too, so the save becomes a global version (here one rank; with more,
    as long as the other ranks live to take part in the commit's collectives)."""
    import torch
    from cnrstore.distributed import versions

    root = tmp_path / "root"
    proc = _child(tmp_path, DIST_SAVER, root, tmp_path / "rdzv")
    assert proc.returncode != 0 and "saved" in proc.stdout and "KeyboardInterrupt" in proc.stderr
    assert [gv.step for gv in versions(root)] == [1, 2], proc.stderr
    expected = torch.load(str(root) + ".expected")
    gv = versions(root)[-1]
    with cnrstore.open(os.path.join(root, gv.stores[0]), readonly=True) as store:
        weight = store.read_table("0", gv.local_versions[0])
    assert np.array_equal(weight.view(np.uint32), expected["0.weight"].numpy().view(np.uint32))


def test_a_compaction_failure_of_a_store_left_open_is_logged_at_exit(tmp_path, store_path):
    body = """
        import sys, numpy as np, cnrstore
        from cnrstore.maintenance import compaction
        from cnrstore.policy import CompactionPolicy, MaxChain
        def materialize(*a, **kw):
            raise cnrstore.StorageFull("injected: no space left on device")
        compaction.materialize = materialize
        store = cnrstore.open(sys.argv[1], create=True, compaction=CompactionPolicy(materialize=MaxChain(1)))
        store.create_table("e", 100, 4, codec="fp32")
        for i in range(2):
            with store.checkpoint(step=i) as ck:
                ck.put_rows("e", np.arange(100), np.full((100, 4), i, np.float32))
    """
    proc = _child(tmp_path, body, store_path)
    assert proc.returncode == 0, proc.stderr
    assert "background compaction of store" in proc.stderr and "injected" in proc.stderr
    with cnrstore.open(store_path) as store:
        assert [v.step for v in store.versions()] == [0, 1] and store.verify().ok


def test_a_forked_child_exiting_leaves_the_parents_store_open_and_locked(store_path):
    store = cnrstore.open(store_path, create=True)
    try:
        pid = os.fork()
        if pid == 0:  # the child runs cnrstore's exit hook (as its interpreter's exit would): it must skip our store
            # (only cnrstore's: the others this test process registered -- a test server's shutdown -- take seconds)
            from cnrstore.store import _close_at_exit

            _close_at_exit()
            os._exit(0)
        _pid, status = os.waitpid(pid, 0)
        with pytest.raises(cnrstore.StoreLocked):
            cnrstore.open(store_path)
        store.create_table("e", 10, 2)  # still open and writable
    finally:
        store.close()
