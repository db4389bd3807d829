"""What the library logs during a command (cli.Notes): a failed command's stderr is still its one line, with
the warnings folded into it; a command that succeeds writes them after its output, on stderr, so that
``--json`` output stays one JSON object. The command is `gc --take-over` on a bucket root (fsspec's in-memory
file system) beside a running job, as in the report of a failing run that printed a WARNING line too."""

from __future__ import annotations

import json
import logging

import pytest

from cnrstore import cli
from cnrstore.distributed import ShardingPlan
from cnrstore.engine import fs
from cnrstore.engine.objects import FsspecObjectStore
from cnrstore.errors import RemoteConflict

from support import dist_bucket_states as db

PLAN = ShardingPlan.row_wise(db.table_shapes(), db.WORLD)


def _root(tmp_path, name):
    url = f"memory://notes-{name}/job"
    job = db.Job(str(tmp_path / "node"), FsspecObjectStore(url), seed=1)
    job.start(PLAN)
    job.save()
    return url, job


@pytest.mark.parametrize("fails", [True, False], ids=["failing", "succeeding"])
def test_warnings_during_gc_take_over_fold_into_the_one_line_of_a_failure(tmp_path, capsys, fails):
    url, job = _root(tmp_path, "fail" if fails else "ok")

    def at_claim(_name, *_detail):  # what the library does beside a live job: a warning, then maybe a refusal
        logging.getLogger("cnrstore.engine.remote").warning("cnrstore: the writer X went on to generation 7\nwhile "
                                                            "this store took the prefix over from generation 6")
        logging.getLogger("cnrstore.engine.remote").error("cnrstore: the store was taken over by another")
        if fails:
            raise RemoteConflict("the job 1234 is still saving to the multi-rank root; stop that job first")

    fs.pause_at("root_claimed", at_claim)
    try:
        status = cli.main(["--remote", url, "gc", str(tmp_path / "admin"), "--take-over", "--json"])
    finally:
        fs.pause_at("root_claimed", None)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    if fails:
        assert status == 2 and out == ""
        assert len(lines) == 1, err
        assert lines[0].startswith("cnrstore gc: RemoteConflict: the job 1234 is still saving"), lines[0]
        assert "also logged: the writer X went on to generation 7 while this store took the prefix over" in lines[0]
        assert "the store was taken over by another" in lines[0]
    else:
        assert status == 0
        json.loads(out)  # (the notes are not in it)
        assert lines == ["cnrstore gc: note: the writer X went on to generation 7 while this store took the prefix "
                         "over from generation 6", "cnrstore gc: note: the store was taken over by another"]
    assert logging.getLogger("cnrstore").propagate  # (the command gave the logger back as it found it)
    for store in job.stores:
        try:
            store.close()
        except Exception:  # noqa: BLE001 - the job was taken over by the gc (or not): irrelevant here
            pass
