"""cnrstore.torch.Checkpointer's defaults (issue 24): a path for the store, retention (keep_last,
keep_every_n_steps), context-manager use, and the report hook (on_report, or logging at INFO)."""

import logging
import os
import pathlib

import pytest
import torch
from torch import nn

import cnrstore
from cnrstore.errors import InvalidArgument, StoreLocked
from cnrstore.torch import Checkpointer, RestoreReport, SaveReport


def make(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.EmbeddingBag(60, 4, mode="sum"), nn.Linear(4, 1))
    return model, torch.optim.Adagrad(model.parameters(), lr=0.1)


def train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randint(0, 60, (8, 3), generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def steps_of(path):
    with cnrstore.open(path, readonly=True) as s:
        return [v.step for v in s.versions()]


def assert_writable_now(path):
    """The Checkpointer closed the store it opened: a writable open succeeds."""
    with cnrstore.open(path):
        pass


# -- a path for the store ---------------------------------------------------------------------------
@pytest.mark.parametrize("as_path", [str, pathlib.Path], ids=["str", "PathLike"])
def test_a_path_opens_creates_and_closes_the_store(tmp_path, as_path):
    path = tmp_path / "ckpt"
    model, opt = make()
    ckpt = Checkpointer(as_path(path), model, opt, codec="fp32")  # the AttributeError
    assert isinstance(ckpt.store, cnrstore.Store) and ckpt.store.path == os.path.abspath(path)
    with pytest.raises(StoreLocked):  # the Checkpointer holds it
        cnrstore.open(path)
    train(model, opt, 1)
    ckpt.save(1)
    saved = state(model)
    ckpt.close()
    assert_writable_now(path)
    assert steps_of(path) == [1]

    model2, opt2 = make(seed=5)
    with Checkpointer(as_path(path), model2, opt2, codec="fp32") as again:
        assert again.restore().step == 1
    for k, v in saved.items():
        assert torch.equal(model2.state_dict()[k], v), k
    assert_writable_now(path)


def test_a_store_given_stays_open_after_close(tmp_path):
    model, opt = make()
    with cnrstore.open(tmp_path / "s", create=True) as store:
        with Checkpointer(store, model, opt) as ckpt:
            ckpt.save(1)
        assert [v.step for v in store.versions()] == [1]  # still open: the caller's store


@pytest.mark.parametrize("bad", [None, 3, b"ckpt", ["ckpt"]])
def test_a_store_that_is_neither_raises(bad):
    model, _ = make()
    with pytest.raises(InvalidArgument, match="store must be a cnrstore.Store or a path"):
        Checkpointer(bad, model)


@pytest.mark.parametrize("kwargs", [dict(codec="int9"), dict(optimizer_codec="nope"), dict(mode="x"),
                                    dict(keep_last=0), dict(on_report=3), dict(extra=object())])
def test_bad_arguments_with_a_path_create_nothing(tmp_path, kwargs):
    model, opt = make()
    with pytest.raises(InvalidArgument):
        Checkpointer(tmp_path / "ckpt", model, opt, **kwargs)
    assert not (tmp_path / "ckpt").exists()


def test_a_failed_constructor_closes_the_store_it_opened(tmp_path):
    path = tmp_path / "ckpt"
    with cnrstore.open(path, create=True) as store:
        store.create_table("0", 10, 4)  # the model's table "0" has 60 rows
    model, opt = make()
    with pytest.raises(InvalidArgument, match="60 x 4"):
        Checkpointer(path, model, opt)
    assert_writable_now(path)


def test_context_manager_waits_for_saves_and_closes(tmp_path):
    model, opt = make()
    with Checkpointer(tmp_path / "c", model, opt) as ckpt:
        for step in range(1, 4):
            train(model, opt, step)
            ckpt.save(step)
    assert steps_of(tmp_path / "c") == [1, 2, 3]
    with pytest.raises(InvalidArgument, match="closed"):
        ckpt.save(4)


# -- retention --------------------------------------------------------------------------------------
def run(path, steps, **kwargs):
    """Save after each step; returns {step: model state} and the reports."""
    model, opt = make()
    saved, reports = {}, []
    with Checkpointer(path, model, opt, codec="fp32", on_report=reports.append, **kwargs) as ckpt:
        for step in steps:
            train(model, opt, step)
            ckpt.save(step).wait()
            saved[step] = state(model)
    return saved, [r for r in reports if isinstance(r, SaveReport)]


def test_keep_last_keeps_the_newest_versions(tmp_path):
    _saved, reports = run(tmp_path / "c", range(1, 8), keep_last=3)
    assert steps_of(tmp_path / "c") == [5, 6, 7]
    assert [r.dropped for r in reports] == [[], [], [], [1], [2], [3], [4]]  # versions 1.. are steps 1..


def test_keep_last_and_every_n_steps_keep_what_either_keeps_and_reads_stay_exact(tmp_path):
    saved, _ = run(tmp_path / "c", range(1, 13), keep_last=2, keep_every_n_steps=5)
    assert steps_of(tmp_path / "c") == [5, 10, 11, 12]
    for version_step in (5, 10, 12):  # the kept versions still read back as saved, bit for bit (fp32)
        model, opt = make(seed=9)
        with Checkpointer(tmp_path / "c", model, opt, codec="fp32") as ckpt:
            info = next(v for v in ckpt.store.versions() if v.step == version_step)
            ckpt.restore(info.version)
        for k, v in saved[version_step].items():
            assert torch.equal(model.state_dict()[k], v), (version_step, k)


def test_keep_every_n_steps_alone_keeps_the_multiples_and_the_newest(tmp_path):
    run(tmp_path / "c", range(1, 8), keep_every_n_steps=3)
    assert steps_of(tmp_path / "c") == [3, 6, 7]


def test_retention_applies_to_versions_of_earlier_runs(tmp_path):
    run(tmp_path / "c", range(1, 6))  # no retention: every version kept
    assert steps_of(tmp_path / "c") == [1, 2, 3, 4, 5]
    run(tmp_path / "c", [6], keep_last=2)
    assert steps_of(tmp_path / "c") == [5, 6]


def test_retention_collects_the_space_of_dropped_versions(tmp_path):
    """20 versions kept grow the store (the issue's 2.3 GB); keep_last=2 bounds it: dropped versions' rows
    are collected, what the kept versions read stays."""
    sizes = {}
    for name, kwargs in (("all", {}), ("last2", {"keep_last": 2})):
        torch.manual_seed(0)
        model = nn.EmbeddingBag(20_000, 16, mode="sum")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Checkpointer(tmp_path / name, model, opt, codec="fp32", **kwargs) as ckpt:
            for step in range(1, 21):
                model(torch.randint(0, 20_000, (1000, 4))).sum().backward()
                opt.step()
                ckpt.save(step)
        with cnrstore.open(tmp_path / name) as s:
            sizes[name] = s.stats()["bytes_on_disk"]
            assert len(s.versions()) == (20 if name == "all" else 2)
    assert sizes["last2"] < 0.25 * sizes["all"], sizes  # measured: 2.1 MB against 12.9 MB


@pytest.mark.parametrize("name", ["keep_last", "keep_every_n_steps"])
@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3"])
def test_retention_arguments_say_what_to_pass(tmp_path, name, bad):
    model, opt = make()
    with pytest.raises(InvalidArgument, match=rf"{name} must be None \(keep every version\) or a positive integer"):
        Checkpointer(tmp_path / "c", model, opt, **{name: bad})


def test_a_failing_retention_does_not_fail_the_save(tmp_path, caplog, monkeypatch):
    model, opt = make()
    with cnrstore.open(tmp_path / "c", create=True) as store:
        def refuse(*a, **k):
            raise OSError("no space for the drop")

        monkeypatch.setattr(store, "drop_versions", refuse)
        with Checkpointer(store, model, opt, keep_last=1) as ckpt:
            ckpt.save(1).wait()
            with caplog.at_level(logging.WARNING, logger="cnrstore.torch"):
                pending = ckpt.save(2)
                assert pending.wait() == 2 and pending.report.dropped == []
            ckpt.save(3).wait()  # the next save works (and retries)
        assert [v.step for v in store.versions()] == [1, 2, 3]
    assert any("retention after the save of step 2" in r.getMessage() and "no space for the drop" in r.getMessage()
               for r in caplog.records)


# -- reports ----------------------------------------------------------------------------------------
def test_on_report_gets_each_save_report_before_wait_returns_and_each_restore(tmp_path):
    got = []
    model, opt = make()
    with Checkpointer(tmp_path / "c", model, opt, on_report=got.append) as ckpt:
        for step in (10, 20):
            train(model, opt, step)
            pending = ckpt.save(step)
            version = pending.wait()
            assert got[-1] is pending.report and got[-1].version == version
        info = ckpt.restore()
        versions = {v.version: v for v in ckpt.store.versions()}
    saves = got[:2]
    assert [r.step for r in saves] == [10, 20] and [r.baseline for r in saves] == [True, False]
    for r in saves:
        assert r.bytes_written == versions[r.version].bytes > 0
        assert r.write_s > 0 and r.stall_s > 0 and r.rows["0"] > 0
    assert isinstance(got[2], RestoreReport) and len(got) == 3
    assert (got[2].version, got[2].step) == (info.version, 20) and got[2].seconds > 0


def test_without_a_hook_reports_are_logged_at_info(tmp_path, caplog):
    model, opt = make()
    with caplog.at_level(logging.INFO, logger="cnrstore.torch"):
        with Checkpointer(tmp_path / "c", model, opt, keep_last=1) as ckpt:
            ckpt.save(7).wait()
            ckpt.save(8).wait()
            ckpt.restore()
    lines = [r.getMessage() for r in caplog.records if r.name == "cnrstore.torch" and r.levelno == logging.INFO]
    assert len(lines) == 3, lines
    assert lines[0].startswith("save of step 7 -> version 1 (baseline):") and "stall" in lines[0]
    assert lines[1].startswith("save of step 8 -> version 2 (increment):") and "dropped versions [1]" in lines[1]
    assert lines[2].startswith("restored version 2 (step 8) in ")


def test_a_failing_hook_is_logged_and_changes_nothing(tmp_path, caplog):
    def hook(report):
        raise RuntimeError("tensorboard is gone")

    model, opt = make()
    with caplog.at_level(logging.ERROR, logger="cnrstore.torch"):
        with Checkpointer(tmp_path / "c", model, opt, on_report=hook) as ckpt:
            assert ckpt.save(1).wait() == 1
            assert ckpt.save(2).wait() == 2
            assert ckpt.restore().version == 2
    failures = [r for r in caplog.records if "on_report hook failed" in r.getMessage()]
    assert len(failures) == 3 and all(r.exc_info and "tensorboard is gone" in str(r.exc_info[1]) for r in failures)
    assert steps_of(tmp_path / "c") == [1, 2]


def test_a_failed_save_is_not_reported(tmp_path):
    got = []
    model, opt = make()
    with cnrstore.open(tmp_path / "c", create=True) as store:
        with Checkpointer(store, model, opt, on_report=got.append) as ckpt:
            with store.checkpoint(step=0):  # holds the writer slot: the background write fails
                pending = ckpt.save(1)
                with pytest.raises(cnrstore.errors.CheckpointInProgress):
                    pending.wait()
            assert got == []
            with pytest.raises(cnrstore.errors.CheckpointInProgress):
                ckpt.save(2)  # (the failure is raised once more by the next save, which takes no snapshot)
            ckpt.save(3).wait()
    assert [r.step for r in got] == [3]


def test_the_api_pages_tensorboard_example(tmp_path, monkeypatch):
    """docs/API.md's on_report example, run as written: with tensorboard when it is installed, else against a
    stand-in SummaryWriter that records add_scalar (cnrstore does not depend on tensorboard)."""
    import re
    import sys
    import types

    api = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "API.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", api, re.S) if "to_tensorboard" in b]
    block = "\n".join(line[2:] if line.startswith("  ") else line for line in block.splitlines())
    try:
        import torch.utils.tensorboard  # noqa: F401
        real = True
    except ImportError:
        real = False
        scalars = []

        class SummaryWriter:
            def __init__(self, logdir):
                self.logdir = logdir

            def add_scalar(self, tag, value, step):
                scalars.append((tag, float(value), step))

        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    monkeypatch.chdir(tmp_path)
    model, optimizer = make()
    scope = {"model": model, "optimizer": optimizer}
    exec(compile(block, "docs/API.md", "exec"), scope)
    ckpt = scope["ckpt"]
    for step in (100, 200):
        train(model, optimizer, step)
        ckpt.save(step).wait()
    ckpt.restore()
    ckpt.close()
    if real:
        scope["tb"].close()
        return
    tags = [(tag, step) for tag, _v, step in scalars]
    assert tags == [(t, s) for s in (100, 200) for t in ("ckpt/stall_ms", "ckpt/write_ms", "ckpt/bytes",
                                                          "ckpt/rows")] + [("ckpt/restore_s", 200)]
    assert all(v > 0 for _t, v, _s in scalars)
