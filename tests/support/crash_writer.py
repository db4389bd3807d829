"""Writer process for the crash tests (tests/test_crash.py), and the workload it writes.

The content of every version is a pure function of its version number (``version_puts``), so a test
can recompute what any committed version must read as (``Model``) without trusting the crashed
process. The writer prints, flushing each line::

    ready              the store is open (recovery done)
    begin <v>          checkpoint v is open
    committed <v>      checkpoint v's commit returned: it is acknowledged, so it must survive a crash
    done               it wrote every version it was asked for

Run directly::

    python tests/support/crash_writer.py write STORE [--count N] [--segment-bytes B] [--arm-after K]

``--arm-after K`` keeps ``$CNRSTORE_CRASH_AT`` disarmed for the first K versions of this run and arms
it for the next, so a named crash point fires with K acknowledged versions behind it.

Or as a fork server (``python tests/support/crash_writer.py serve``), which imports cnrstore once and forks
one writer child per JSON command read from stdin (``{"store": ..., "count": ..., "segment_bytes":
..., "crash_at": ..., "arm_after": ...}``, or ``{"mode": "maintain", "store": ..., "ops": ...,
"segment_bytes": ..., "crash_at": ..., "seed": ...}`` for ``run_maintainer``); for each child the server prints ``pid <pid>`` (possibly
after the child's first lines) and, once the child is gone, ``exit <pid> <wait status>``. That spares each crash iteration the ~2 s of
importing torch.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

#: Tables of the workload: name -> (num_rows, dim, codec, block_rows).
TABLES = {
    "emb_fp32": (600, 8, "fp32", 64),
    "emb_int4": (1000, 16, "int4", 128),
    "emb_int8": (300, 4, "int8", None),
}
#: step and meta of every version the workload writes.
STEP = 7
META = {"loader": [1, 2, 3], "lr": 0.5}


def create_tables(store) -> None:
    for name, (num_rows, dim, codec, block_rows) in TABLES.items():
        store.create_table(name, num_rows, dim, codec=codec, block_rows=block_rows)


def version_puts(v: int) -> list[tuple]:
    """The puts of version ``v``, in call order: ("rows", table, rows, values, codec) or ("dense", name, array).

    Version 1 writes every row of every table (so whole tables read at every later version); later
    versions write a random subset in one to three calls per table, sometimes with another codec.
    """
    rng = np.random.default_rng([v, 20220404])
    puts: list[tuple] = []
    for name, (num_rows, dim, _codec, _block_rows) in TABLES.items():
        if v == 1:
            rows = rng.permutation(num_rows)
        else:
            rows = rng.choice(num_rows, size=int(rng.integers(1, num_rows // 3)), replace=False)
        calls = 1 if rows.size < 3 else int(rng.integers(1, 4))
        for i, part in enumerate(np.array_split(rows, calls)):
            if not part.size:
                continue
            scale = float(rng.uniform(0.01, 3.0))
            values = (rng.standard_normal((part.size, dim)) * scale + rng.uniform(-1, 1)).astype(np.float32)
            codec = None
            if i > 0 and name == "emb_int4" and rng.random() < 0.5:
                codec = "int8"  # a second codec in the same version: merged blocks are stored in fp32
            puts.append(("rows", name, part, values, codec))
    puts.append(("dense", "step", np.array([v, 2 * v], dtype=np.int64)))
    if v == 1 or rng.random() < 0.5:
        puts.append(("dense", "weights", rng.standard_normal((7, 3))))  # float64, stored exactly
    if v == 1 or rng.random() < 0.3:
        puts.append(("dense", "mask", rng.random(13) < 0.5))
    return puts


def write_version(ck) -> None:
    """Put version ``ck.version``'s content into ``ck``, opened as ``store.checkpoint(step=STEP, meta=META)``."""
    for put in version_puts(ck.version):
        if put[0] == "rows":
            _, table, rows, values, codec = put
            ck.put_rows(table, rows, values, codec=codec)
        else:
            ck.put_dense(put[1], put[2])


class Model:
    """What each version must read as, built from ``version_puts`` of the committed versions only.

    Lossy puts are expected as the codec's decode(encode(values)); each version is applied on top of
    the state of the newest committed version before it (incremental semantics).
    """

    def __init__(self):
        from cnrstore import codecs

        self._codecs = codecs
        self.states: dict[tuple, tuple[dict, dict]] = {}  # committed versions up to v -> (tables, dense)

    def state(self, committed: list[int], v: int) -> tuple[dict, dict]:
        """State at version ``v`` given the (sorted) committed versions; caches every state it builds."""
        key = tuple(u for u in committed if u <= v)
        if key in self.states:
            return self.states[key]
        older = [u for u in committed if u < v]
        if older:
            prev_tables, prev_dense = self.state(committed, older[-1])
        else:
            prev_tables = {n: np.full((r, d), np.nan, np.float32) for n, (r, d, _c, _b) in TABLES.items()}
            prev_dense = {}
        tables = {n: a.copy() for n, a in prev_tables.items()}
        dense = dict(prev_dense)
        for put in version_puts(v):
            if put[0] == "rows":
                _, table, rows, values, codec = put
                c = self._codecs.get(codec or TABLES[table][2])
                tables[table][rows] = c.decode(c.encode(values), TABLES[table][1])
            else:
                dense[put[1]] = put[2]
        self.states[key] = (tables, dense)
        return self.states[key]


def check_version(store, model: Model, committed: list[int], v: int) -> None:
    """Assert that version ``v`` of ``store`` reads exactly as the model says (whole tables, dense)."""
    tables, dense = model.state(committed, v)
    for name, expect in tables.items():
        got = store.read_table(name, version=v)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expect, err_msg=f"table {name} at version {v}")
    for name, expect in dense.items():
        got = store.read_dense(name, version=v)
        assert got.dtype == expect.dtype and got.shape == expect.shape, (name, v)
        np.testing.assert_array_equal(got, expect, err_msg=f"dense {name} at version {v}")
    info = {i.version: i for i in store.versions()}[v]
    assert info.step == STEP and info.meta == META, (v, info)


# -- the writer process ------------------------------------------------------------------------------

def _say(*words) -> None:
    """Print one line with one write(2): the server and its child share the pipe, and a line of
    under PIPE_BUF bytes is never interleaved with another (print() may split it, e.g. under
    PYTHONUNBUFFERED)."""
    line = " ".join(str(w) for w in words)[:2000] + "\n"
    os.write(sys.stdout.fileno(), line.encode())


def run_writer(store_path: str, count: int | None, segment_bytes: int | None, arm_after: int | None) -> None:
    import cnrstore
    from cnrstore.engine import fs
    from cnrstore import knobs

    crash_at = os.environ.pop(fs.CRASH_ENV, None)
    if arm_after is None and crash_at is not None:
        os.environ[fs.CRASH_ENV] = crash_at
    if segment_bytes is not None:
        knobs.SEGMENT_BYTES = segment_bytes
    store = cnrstore.open(store_path)
    _say("ready")
    written = 0
    while count is None or written < count:
        if arm_after is not None and written == arm_after and crash_at is not None:
            os.environ[fs.CRASH_ENV] = crash_at
        with store.checkpoint(step=STEP, meta=META) as ck:
            _say("begin", ck.version)
            write_version(ck)
        _say("committed", ck.version)
        written += 1
    store.close()
    _say("done")


def run_maintainer(store_path: str, ops: list | None, segment_bytes: int | None, seed: int = 0) -> None:
    """Run maintenance on the store (tests/test_compaction_crash.py), printing, flushing each line::

        ready                 the store is open (recovery done)
        op <i> <name> <arg>   operation i begins (arg: a version, keep_last, or None)
        begin / committed <v> as ``run_writer`` prints them, for a checkpoint operation
        dropped <v> ...       the versions a retain returned
        did <i>               operation i returned

    ``ops`` is a list of [name, arg], name one of checkpoint, compact (arg: a version or None), retain
    (arg: keep_last), gc and arm (arg: a crash point, armed from then on); None loops for ever over a checkpoint, sometimes a compact at a random
    retained version, a retain of 1 to 4 versions and a gc.
    """
    import random

    import cnrstore
    from cnrstore.engine import fs
    from cnrstore import knobs

    if segment_bytes is not None:
        knobs.SEGMENT_BYTES = segment_bytes
    store = cnrstore.open(store_path)
    _say("ready")
    rng = random.Random(seed)

    def plan():
        if ops is not None:
            yield from ops
            return
        while True:
            yield ["checkpoint", None]
            if rng.random() < 0.5:
                yield ["compact", rng.choice([i.version for i in store.versions()])]
            yield ["retain", rng.randint(1, 4)]
            yield ["gc", None]

    for i, (name, arg) in enumerate(plan()):
        _say("op", i, name, arg)
        if name == "checkpoint":
            with store.checkpoint(step=STEP, meta=META) as ck:
                _say("begin", ck.version)
                write_version(ck)
            _say("committed", ck.version)
        elif name == "compact":
            store.compact(arg)
        elif name == "retain":
            _say("dropped", *store.retain(keep_last=arg))
        elif name == "gc":
            store.gc()
        elif name == "arm":  # from here on, die at the crash point named by arg
            os.environ[fs.CRASH_ENV] = arg
        else:
            raise ValueError(f"unknown operation {name!r}")
        _say("did", i)
    store.close()
    _say("done")


def _serve() -> None:
    import cnrstore  # noqa: F401  (imported once, before any fork)
    import torch  # noqa: F401  (the codecs import it lazily, at the first encode: once here, not in every child,
    #             whose random kill instants assume a writer already at work)
    from cnrstore.engine import fs

    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                if cmd.get("crash_at"):
                    os.environ[fs.CRASH_ENV] = cmd["crash_at"]
                if cmd.get("mode") == "maintain":
                    run_maintainer(cmd["store"], cmd.get("ops"), cmd.get("segment_bytes"), cmd.get("seed", 0))
                else:
                    run_writer(cmd["store"], cmd.get("count"), cmd.get("segment_bytes"), cmd.get("arm_after"))
            except BaseException as exc:  # report, never fall back into the server loop
                _say("error", repr(exc).replace("\n", " "))
                status = 1
            finally:
                os._exit(status)
        _say("pid", pid)  # from the server, so the test can kill a child that hangs before saying anything
        _, wstatus = os.waitpid(pid, 0)
        _say("exit", pid, wstatus)


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"]:
        _serve()
        return
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["write"])
    p.add_argument("store")
    p.add_argument("--count", type=int)
    p.add_argument("--segment-bytes", type=int)
    p.add_argument("--arm-after", type=int)
    a = p.parse_args(argv)
    run_writer(a.store, a.count, a.segment_bytes, a.arm_after)


if __name__ == "__main__":
    main(sys.argv[1:])
