"""Helpers of the Store API tests (tests/test_store*.py): the reference table's shape, expected decodes, random
rows, bit equality, a snapshot of every committed read, and Python run in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

import cnrstore
from cnrstore import codecs

DIM = 8
ROWS = 1000
BLOCK = 64


def dd(codec: str, values) -> np.ndarray:
    """What ``codec`` reads back for ``values``: decode(encode(values)), row by row."""
    c = codecs.get(codec)
    v = np.ascontiguousarray(values, dtype=np.float32)
    return c.decode(c.encode(v), v.shape[1])


def rand(n, dim=DIM, seed=0, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, dim)) * scale).astype(np.float32)


def assert_bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def snapshot_state(store):
    """Everything observable of committed versions: infos, and every table at every version."""
    infos = store.versions()
    reads = {}
    for info in infos:
        for name in store.tables():
            try:
                reads[(info.version, name)] = store.read_table(name, version=info.version).tobytes()
            except cnrstore.MissingRows as exc:
                reads[(info.version, name)] = str(exc)
    return infos, reads


def run_python(code: str, *args, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(cnrstore.engine.fs.CRASH_ENV, None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def last_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
