"""Runs operations on stores, distributed roots and import sources whose files are not regular files, for
tests/test_special_files.py, and reports each outcome as JSON:
``python special_files_worker.py JOBS OUT ADDRESS_SPACE_BYTES``.

JOBS is a JSON list of ``{"key": ..., "kind": "store" | "root" | "import", "path": ..., "ops": [...]}``
(an import job also has ``"source"``); OUT receives one JSON line ``{"key", "op", "outcome"}`` per operation
as it finishes. An outcome is
``{"rc": exit status, "stdout": ..., "stderr": ...}`` for a command (``cnrstore.cli.main``, in this
process) and ``{"raised": type name or None, "cnr": is a CnrError, "message": ..., "value": ...}`` for a
Python call; an operation still running after ``OP_TIMEOUT_S`` is stopped (SIGALRM) and reported as
``{"hung": true}``, so one hang does not hide the other outcomes. The worker limits its own address space
first (RLIMIT_AS, 2 GiB from the tests): reading ``/dev/zero`` without end ends in MemoryError, reported
like any exception.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import sys

OP_TIMEOUT_S = 10


class Hung(BaseException):
    """Raised by the alarm: the operation ran past OP_TIMEOUT_S (blocked on a FIFO, reading without end)."""


def _alarm(signum, frame):
    raise Hung()


def _call(fn) -> dict:
    from cnrstore.errors import CnrError

    signal.alarm(OP_TIMEOUT_S)
    try:
        value = fn()
    except Hung:
        return {"hung": True}
    except BaseException as exc:  # noqa: BLE001 - every outcome is reported to the test
        return {"raised": type(exc).__name__, "cnr": isinstance(exc, CnrError), "message": str(exc)}
    finally:
        signal.alarm(0)
    return {"raised": None, "value": value}


def _cli(argv: list[str]) -> dict:
    from cnrstore import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        outcome = _call(lambda: cli.main([str(a) for a in argv]))
    if outcome.get("hung"):
        return outcome
    if outcome["raised"] is not None:  # main() must never raise: report it as a failure of the test
        return {"rc": None, "raised": outcome["raised"], "message": outcome["message"]}
    return {"rc": outcome["value"], "stdout": out.getvalue(), "stderr": err.getvalue()}


# -- operations on a store --------------------------------------------------------------------------------
def _read_everything(path: str):
    import cnrstore

    with cnrstore.open(path, readonly=True) as s:
        versions = [v.version for v in s.versions()]
        tables = {name: s.read_table(name).shape for name in s.tables()}
    return {"versions": versions, "tables": {k: list(v) for k, v in tables.items()}}


def _verify(path: str):
    import cnrstore

    with cnrstore.open(path, readonly=True) as s:
        report = s.verify()
    return {"ok": report.ok, "problems": report.problems}


def _open_writable(path: str):
    import cnrstore

    with cnrstore.open(path) as s:
        return [v.version for v in s.versions()]


def _store_op(op: str, path: str, out_dir: str) -> dict:
    if op == "api_read":
        return _call(lambda: _read_everything(path))
    if op == "api_verify":
        return _call(lambda: _verify(path))
    if op == "api_open_writable":
        return _call(lambda: _open_writable(path))
    if op == "export":
        return _cli(["export", path, "--format", "npz", os.path.join(out_dir, "export.npz")])
    return _cli([op, path])  # ls, info, verify, gc, repair


# -- operations on a distributed root ---------------------------------------------------------------------
def _root_read(path: str):
    from cnrstore.distributed.manifest import Root

    root = Root(path)
    root.check()
    gvs = root.versions()
    plans = [root.plan_of(g).world_size for g in root.generations()]
    stores = [root.store_path(rel) for gv in gvs for rel in root.rank_stores(gv)]
    return {"versions": [g.version for g in gvs], "plans": plans, "stores": len(stores)}


def _root_verify(path: str):
    from cnrstore.distributed.verify import verify_root

    report = verify_root(path)
    return {"ok": report.ok, "problems": report.problems}


def _root_op(op: str, path: str) -> dict:
    if op == "api_read":
        return _call(lambda: _root_read(path))
    if op == "api_verify":
        return _call(lambda: _root_verify(path))
    return _cli([op, path])  # ls, verify


# -- import -----------------------------------------------------------------------------------------------
def _import_op(op: str, store: str, source: str) -> dict:
    if op == "api_import":
        def run():
            from cnrstore.torch.imports import import_checkpoint

            return import_checkpoint(store + "-api", source).version
        return _call(run)
    return _cli(["import", store, source])


def main(jobs_path: str, out_path: str, address_space: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))  # before anything is imported
    signal.signal(signal.SIGALRM, _alarm)
    with open(jobs_path) as f:
        jobs = json.load(f)
    with open(out_path, "w") as out:
        for job in jobs:
            for op in job["ops"]:
                if job["kind"] == "store":
                    got = _store_op(op, job["path"], job["out"])
                elif job["kind"] == "root":
                    got = _root_op(op, job["path"])
                else:
                    got = _import_op(op, job["path"], job["source"])
                # one line per outcome, written at once: a worker killed later still reports these
                out.write(json.dumps({"key": job["key"], "op": op, "outcome": got}) + "\n")
                out.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
