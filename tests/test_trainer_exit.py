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
