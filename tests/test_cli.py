"""The `cnrstore` command, run for real in a subprocess (python -m cnrstore.cli, and the console script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cnrstore

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(*args, check_rc=0):
    proc = subprocess.run([sys.executable, "-m", "cnrstore.cli", *map(str, args)], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert proc.returncode == check_rc, (proc.returncode, proc.stdout, proc.stderr)
    return proc


@pytest.fixture(scope="module")
def made_store(tmp_path_factory):
    """A store with 5 versions of an int4 table and a dense array; expected reads per version."""
    path = str(tmp_path_factory.mktemp("cli") / "store")
    rng = np.random.default_rng(7)
    expected = {}
    with cnrstore.open(path, create=True) as store:
        store.create_table("emb", 600, 8, codec="int4", block_rows=128)
        for v in range(5):
            rows = np.arange(600) if v == 0 else np.unique(rng.integers(0, 600, 150))
            with store.checkpoint(step=100 * v, meta={"pos": v}) as ck:
                ck.put_rows("emb", rows, rng.standard_normal((rows.size, 8)).astype(np.float32))
                ck.put_dense("w", np.full((2, 3), v, dtype=np.float64))
            expected[ck.version] = store.read_table("emb", ck.version)
    return path, expected


def test_help_everywhere():
    assert "COMMAND" in run("--help").stdout
    for cmd in ("ls", "info", "verify", "compact", "retain", "gc", "export", "rows"):
        assert "usage: cnrstore " + cmd in run(cmd, "--help").stdout


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "cnrstore")
    assert os.path.exists(script), "pip install -e . must install the cnrstore console script"
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0 and "verify" in proc.stdout


def test_ls_and_info(made_store):
    path, expected = made_store
    out = run("ls", path).stdout
    assert "5 version(s)" in out and "400" in out  # step of the last version
    listing = json.loads(run("ls", path, "--json").stdout)
    assert [r["version"] for r in listing] == sorted(expected)
    assert [r["read_chain"] for r in listing] == [1, 2, 3, 4, 5]
    assert all(r["bytes"] > 0 and r["tables"] == ["emb"] for r in listing)
    info = json.loads(run("info", path, "--json").stdout)
    assert info["tables"]["emb"]["codec"] == "int4" and info["stats"]["versions"] == 5
    assert "live_ratio" in run("info", path).stdout


def test_rows_prints_what_the_store_reads(made_store):
    path, expected = made_store
    v = sorted(expected)[2]
    out = run("rows", path, "emb", 3, 599, "--version", v).stdout.splitlines()
    assert out[0].startswith("3: ") and out[1].startswith("599: ")
    printed = np.array([float(x) for x in out[0].split("[")[1].rstrip("]").split()])
    assert np.allclose(printed, expected[v][3], atol=1e-5)


def test_export_formats_load_in_their_libraries(made_store, tmp_path):
    path, expected = made_store
    v = sorted(expected)[1]
    run("export", path, "--version", v, "--format", "npz", tmp_path / "x.npz")
    with np.load(tmp_path / "x.npz") as z:
        assert np.array_equal(z["tables/emb"], expected[v]) and z["dense/w"][0, 0] == v - 1
    run("export", path, "--version", v, "--format", "safetensors", tmp_path / "x.st")
    from safetensors.numpy import load_file

    assert np.array_equal(load_file(str(tmp_path / "x.st"))["tables/emb"], expected[v])
    run("export", path, "--version", v, "--format", "torch", tmp_path / "x.pt")
    import torch

    saved = torch.load(tmp_path / "x.pt")
    assert saved["version"] == v and np.array_equal(saved["tables"]["emb"].numpy(), expected[v])


def test_verify_exit_status(made_store, tmp_path):
    path, _ = made_store
    assert "ok:" in run("verify", path).stdout
    assert json.loads(run("verify", path, "--json").stdout)["ok"] is True
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", path, str(damaged)], check=True)
    seg_dir = damaged / "segments"
    seg = sorted(os.listdir(seg_dir))[0]
    with open(seg_dir / seg, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = run("verify", damaged, check_rc=1)
    assert "DAMAGED" in proc.stdout and "problem:" in proc.stdout


def test_maintenance_keeps_reads_and_reclaims(made_store, tmp_path):
    src, expected = made_store
    path = tmp_path / "m"
    subprocess.run(["cp", "-r", src, str(path)], check=True)
    assert "baseline" in run("compact", path).stdout
    assert "dropped 3 version(s)" in run("retain", path, "--keep-last", "2").stdout
    assert "reclaimed" in run("gc", path).stdout
    with cnrstore.open(path, readonly=True) as store:
        kept = [v.version for v in store.versions()]
        assert kept == sorted(expected)[-2:]
        for v in kept:
            assert np.array_equal(store.read_table("emb", v), expected[v])
        assert store.verify().ok


def test_errors_exit_2_with_a_reason(made_store, tmp_path):
    path, _ = made_store
    proc = run("ls", tmp_path / "nope", check_rc=2)
    assert "StoreNotFound" in proc.stderr and "nope" in proc.stderr
    assert "VersionNotFound" in run("rows", path, "emb", 1, "--version", 999, check_rc=2).stderr
    assert "TableNotFound" in run("rows", path, "nope", 1, check_rc=2).stderr
    assert "InvalidArgument" in run("rows", path, "emb", 10_000, check_rc=2).stderr
    assert "keep-last" in run("retain", path, check_rc=2).stderr  # argparse: required option
    assert "InvalidArgument" in run("retain", path, "--keep-last", "0", check_rc=2).stderr


def test_maintenance_on_a_store_a_trainer_holds_is_refused(made_store, tmp_path):
    src, _ = made_store
    path = tmp_path / "held"
    subprocess.run(["cp", "-r", src, str(path)], check=True)
    with cnrstore.open(path):  # this process plays the trainer
        proc = run("gc", path, check_rc=2)
        assert "StoreLocked" in proc.stderr and str(os.getpid()) in proc.stderr
        assert "5 version(s)" in run("ls", path).stdout  # readonly commands still work
