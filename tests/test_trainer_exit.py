"""A trainer's exit: no thread of cnrstore outlives ``close()`` (a daemon thread left releasing torch objects
while the interpreter shuts down aborts the process: "terminate called without an active exception", exit
134); a hook that raises anything never wedges the save queue; SIGTERM commits the saves ``save()`` returned
(``on_sigterm="finish"``, the default) and saves the step in progress too (``"save"``), with real signals sent
to a trainer subprocess (tests/support/trainer_worker.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import cnrstore
from cnrstore.torch import Checkpointer
from cnrstore.torch.preemption import EXIT_STATUS

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "support", "trainer_worker.py")


def cnrstore_threads(before=()) -> list[str]:
    """The threads of cnrstore alive now that were not in ``before`` (threads, e.g. of other tests' stores)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("cnrstore") and t not in before]


def small():
    model = nn.EmbeddingBag(1000, 8, sparse=True)
    return model, torch.optim.Adagrad(model.parameters())


def step(model, opt):
    model(torch.randint(0, 1000, (16, 3))).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("closing", ["checkpointer", "context", "store"])
def test_no_thread_of_cnrstore_outlives_close(tmp_path, closing):
    before = set(threading.enumerate())
    model, opt = small()
    store = cnrstore.open(tmp_path / "s", create=True)
    ck = Checkpointer(store, model, opt, codec="fp32")
    for i in range(3):
        step(model, opt)
        ck.save(i)
    if closing == "checkpointer":
        ck.close()
        store.close()
    elif closing == "context":
        with ck:
            pass
        store.close()
    else:
        store.close()  # the store's close waits for the Checkpointer's saves: their thread ends too
    assert cnrstore_threads(before) == []


def test_a_hook_raising_anything_never_wedges_the_save_queue(tmp_path, caplog):
    """on_report raising SystemExit, KeyboardInterrupt or GeneratorExit on the writer's thread: logged, and the
    saves queued behind it commit; wait() and close() return."""
    raised = iter([SystemExit(3), KeyboardInterrupt(), GeneratorExit(), RuntimeError("x")])

    def hook(report):
        exc = next(raised, None)
        if exc is not None:
            raise exc

    before = set(threading.enumerate())
    model, opt = small()
    with Checkpointer(tmp_path / "s", model, opt, codec="fp32", on_report=hook) as ck:
        pending = []
        for i in range(6):
            step(model, opt)
            pending.append(ck.save(i))
        versions = [p.wait() for p in pending]
        assert versions == sorted(versions) and len(set(versions)) == 6
        assert [v.step for v in ck.store.versions()] == list(range(6))
    assert "on_report hook failed" in caplog.text
    assert cnrstore_threads(before) == []


def run_worker(tmp_path, *args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, WORKER, str(tmp_path / "store"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("run", range(3))
def test_a_users_trainer_exits_0(tmp_path, run):
    """The trial's trainer shape (tables of 1M, 500k and 100k rows x 64, sparse Adagrad, Adam on the dense
    part), a few steps and saves, close(), the end of the program: exit 0 with no cnrstore thread left. Before
    close() joined the save thread, 2 runs in 6 of this aborted (134). (--runslow: 20 runs.)"""
    out = run_worker(tmp_path, "--steps", "6", "--every", "2")
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "closed []" in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("run", range(20))
def test_a_users_trainer_exits_0_twenty_times(tmp_path, run):
    test_a_users_trainer_exits_0(tmp_path, run)


def sigterm_run(tmp_path, on_sigterm: str, saves_before: int = 3):
    """The trainer (small tables, writes slowed to 0.4 s each) until it printed ``saves_before`` returned saves,
    then SIGTERM; returns (exit status, steps whose save() returned, the store's versions)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, WORKER, str(tmp_path / "store"), "--rows", "5000,2000", "--dim", "16",
                             "--every", "3", "--forever", "--slow-write", "0.4", "--on-sigterm", on_sigterm],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    returned = []
    for line in proc.stdout:
        if line.startswith("saved "):
            returned.append(int(line.split()[1]))
            if len(returned) == saves_before:
                proc.send_signal(signal.SIGTERM)
                break
    rest, err = proc.communicate(timeout=120)
    with cnrstore.open(tmp_path / "store", readonly=True) as store:
        versions = store.versions()
    return proc.returncode, returned, versions, err


def test_sigterm_commits_every_save_that_returned(tmp_path):
    status, returned, versions, err = sigterm_run(tmp_path, "finish")
    assert status == EXIT_STATUS, err[-2000:]
    assert set(returned) <= {v.step for v in versions}, (returned, [v.step for v in versions])


def test_sigterm_with_save_also_saves_the_step_in_progress(tmp_path):
    status, returned, versions, err = sigterm_run(tmp_path, "save")
    assert status == EXIT_STATUS, err[-2000:]
    steps = [v.step for v in versions]
    assert set(returned) <= set(steps)
    last = versions[-1]
    assert last.meta.get("sigterm") is True and last.step > max(returned), (steps, last.meta)


def test_without_a_handler_sigterm_loses_the_saves_in_flight(tmp_path):
    """on_sigterm=None leaves SIGTERM to its default action: the process ends at once (-15), and the saves in
    flight are not committed -- what the default protects against."""
    status, returned, versions, _err = sigterm_run(tmp_path, "none")
    assert status == -signal.SIGTERM
    assert len(versions) < len(returned)


def signalled_run(tmp_path, *signals: str, steps: int | None = None, slow: float = 0.5, sigint_ignored: bool = False):
    """The trainer saving every step with writes slower than a step (0.5 s each), so that with ``max_lag=2``
    each ``save()`` waits for room; ``steps`` of them (None: until a signal ends it). Each ``POINT:SIGNAL`` of
    ``signals`` is sent the first time the trainer reaches that pause point. Returns (exit status, steps whose
    save() returned, the store's versions, the output)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, WORKER, str(tmp_path / "store"), "--rows", "5000,2000", "--dim", "16", "--every", "1",
           "--slow-write", str(slow)] + (["--forever"] if steps is None else ["--steps", str(steps)])
    for spec in signals:
        cmd += ["--signal-at", spec]
    # (sigint_ignored: the trainer started with SIGINT ignored, as a background job of a shell is)
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, preexec_fn=ignore)
    returned = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("saved ")]
    with cnrstore.open(tmp_path / "store", readonly=True) as store:
        versions = store.versions()
        assert store.verify().ok
    return proc.returncode, returned, versions, proc.stdout + proc.stderr


STATUS = {"SIGTERM": EXIT_STATUS, "SIGINT": -signal.SIGINT}


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_while_save_waits_for_room_commits_every_save_that_returned(tmp_path, signame):
    """Issue 48 fault 6: the first SIGTERM (or Ctrl-C) landing while save() waits for room in the queue
    (max_lag=2, a save every step, writes slower than a step) cancelled every queued save, those save()
    had returned included: the process exited 143 with an empty store. Now they commit, then it exits."""
    status, returned, versions, out = signalled_run(tmp_path, f"checkpointer_waits_for_room:{signame}")
    assert f"signal {signame} at checkpointer_waits_for_room" in out
    assert status == STATUS[signame], out[-3000:]
    assert returned and [v.step for v in versions] == returned, out[-3000:]
    assert "cancelled" not in out


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_first_signal_while_close_waits_commits_the_saves(tmp_path, signame):
    """SIGTERM, or a first Ctrl-C, landing while close() (the with block's exit, at the end of training)
    waits for the queued saves: they commit, then the signal ends the process."""
    status, returned, versions, out = signalled_run(tmp_path, f"checkpointer_waits_for_save:{signame}", steps=3)
    assert f"signal {signame} at checkpointer_waits_for_save" in out
    assert status == STATUS[signame], out[-3000:]
    assert returned == [1, 2, 3] and [v.step for v in versions] == returned, out[-3000:]


def test_a_second_ctrl_c_gives_up_the_saves_consistently(tmp_path):
    """The first Ctrl-C lands while save() waits for room, the second while the with block's exit waits for
    the queued saves: those still in flight are given up (nothing of them commits), and the store is
    consistent (signalled_run verifies it)."""
    status, returned, versions, out = signalled_run(tmp_path, "checkpointer_waits_for_room:SIGINT",
                                                    "checkpointer_waits_for_save:SIGINT", slow=2.0)
    assert "signal SIGINT at checkpointer_waits_for_save" in out
    assert status == -signal.SIGINT, out[-3000:]
    assert len(versions) < len(returned) and {v.step for v in versions} <= set(returned), out[-3000:]


@pytest.mark.parametrize("restored", [False, True])
def test_sigterm_with_save_saves_the_index_of_the_step_just_finished(tmp_path, restored):
    """on_sigterm="save" saves the step in progress as the last save's step plus the steps since: counted from
    the restored version's step after a restore (it saved step None there, and `info.step + 1` then failed),
    and from -1 in a process that has neither saved nor restored (its first step is step 0)."""
    model, opt = small()
    store = cnrstore.open(tmp_path / "s", create=True)
    if restored:
        with Checkpointer(store, model, opt, codec="fp32", on_sigterm=None) as first:
            step(model, opt)
            first.save(10).wait()
    ck = Checkpointer(store, model, opt, codec="fp32", on_sigterm="save")
    try:
        if restored:
            assert ck.restore().step == 10
        step(model, opt)
        ck.sigterm_received()  # (what the SIGTERM handler does)
        with pytest.raises(SystemExit) as exc:
            step(model, opt)  # the second step after it: its post-hook saves, then exits
        assert exc.value.code == EXIT_STATUS
    finally:
        ck.close()
    newest = store.latest()
    assert newest.step == (12 if restored else 1) and newest.meta.get("sigterm") is True
    store.close()


def test_ctrl_c_reaches_a_trainer_started_with_sigint_ignored(tmp_path):
    """A process started with SIGINT ignored (a shell's background job) passes that on across exec, and Python
    then installs no KeyboardInterrupt handler: the worker restores Ctrl-C, so the first one still commits the
    saves and ends the process (before: it exited 0, or trained on until the test's timeout)."""
    status, _returned, _versions, out = signalled_run(tmp_path, "checkpointer_waits_for_save:SIGINT", steps=3,
                                                      sigint_ignored=True)
    assert status == STATUS["SIGINT"], out[-3000:]
