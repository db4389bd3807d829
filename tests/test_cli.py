"""The `cnrstore` command, run for real in a subprocess (python -m cnrstore.cli, and the console script)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import cnrstore
from cnrstore.engine import filenames

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
    for cmd in ("ls", "info", "verify", "compact", "retain", "gc", "export", "rows", "diff"):
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
    # within knobs.READ_CHAIN_BOUND (3): version 4 writes cumulative deltas (read with the baseline: 2),
    # version 5 a plain increment on top of them (3)
    assert [r["read_chain"] for r in listing] == [1, 2, 3, 2, 3]
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
        for command in (["gc"], ["compact"], ["retain", "--keep-last", "1"]):
            proc = run(command[0], path, *command[1:], check_rc=2)
            # the holder by pid and command line (this pytest process), and what to do in the command's terms:
            # not the Python API's readonly=True, which these commands do not have
            assert "StoreLocked" in proc.stderr and f"process {os.getpid()} (" in proc.stderr, proc.stderr
            assert "readonly" not in proc.stderr and "wait for that process to finish, or stop it" in proc.stderr
            assert f"`cnrstore {command[0]}` needs the store to itself" in proc.stderr
        assert "5 version(s)" in run("ls", path).stdout  # readonly commands still work
    assert "baseline" in run("compact", path).stdout  # once the holder is gone


def test_describe_holder_names_the_process_and_its_command_line():
    from cnrstore.engine.lock import describe_holder

    holder = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()",
                               "trainer-" + "x" * 100], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"up\n"  # running its own command line now
        shown = describe_holder(holder.pid)
    finally:
        holder.communicate(b"")
    exe = os.path.basename(sys.executable)
    assert shown.startswith(f"process {holder.pid} ({exe} -c import sys; print("), shown
    assert shown.endswith("...)") and len(shown) < 120  # a long command line is cut
    assert describe_holder(None) == "another process (its pid is unknown)"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert describe_holder(int(dead.stdout)) == f"process {int(dead.stdout)}"  # gone: no command line to show


#: what a message that names the Python API looks like: a call, a keyword argument
PYTHON_TERMS = re.compile(r"\w\(\)|\b\w+=(True|False|None)\b|readonly|create=|keep_last")


def test_error_messages_speak_in_command_line_terms(made_store, tmp_path):
    """Issue 24: what the command prints on failure says what to do with the command, not with Python calls."""
    path, _ = made_store
    half = _copy(path, tmp_path / "half")
    os.unlink(half / filenames.MARKER)
    failures = [run("gc", tmp_path / "nope", check_rc=2), run("ls", tmp_path / "nope", check_rc=2),
                run("compact", half, check_rc=2), run("ls", half, check_rc=2),
                run("retain", path, "--keep-last", "0", check_rc=2),
                run("export", path, "--format", "npz", tmp_path / "x.npz", "--version", 99, check_rc=2)]
    for proc in failures:
        line = proc.stderr.strip()
        assert len(line.splitlines()) == 1 and not PYTHON_TERMS.search(line), line
    assert "check the path" in failures[0].stderr and "nope" in failures[0].stderr
    assert "kept" in failures[2].stderr and "creation did not finish" in failures[2].stderr
    assert "--keep-last must be a positive integer" in failures[4].stderr


# --- hardening (issue 11, item 12): every failure a typed one-line error; verify's exit contract ------------

from cnrstore import cli  # noqa: E402


def _main(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _copy(src, dst):
    subprocess.run(["cp", "-r", src, str(dst)], check=True)
    return dst


def test_export_to_a_missing_directory_exits_2_with_one_line_and_no_traceback(made_store, tmp_path):
    path, _ = made_store
    proc = run("export", path, "--format", "npz", tmp_path / "nodir" / "x.npz", check_rc=2)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "InvalidArgument" in proc.stderr and "does not exist" in proc.stderr and "nodir" in proc.stderr
    proc = run("export", path, "--format", "npz", tmp_path, check_rc=2)  # a directory
    assert "is a directory" in proc.stderr
    assert not (tmp_path / "nodir").exists()


@pytest.mark.parametrize("fmt", ["npz", "torch", "safetensors"])
def test_export_disk_full_raises_storage_full_and_leaves_no_partial_file(made_store, tmp_path, capsys,
                                                                        monkeypatch, fmt):
    import errno

    from cnrstore import export as export_mod

    path, _ = made_store
    out = tmp_path / "x.out"
    out.write_bytes(b"older export")

    def full(snapshot, fmt, tmp):
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_mod, "_write", full)
    rc, _out, err = _main(capsys, "export", path, "--format", fmt, out, "--force")  # replace the older export
    assert rc == 2 and "StorageFull" in err and "space" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == b"older export"
    assert os.listdir(tmp_path) == ["x.out"]  # the temporary file is gone


def test_export_to_an_unwritable_path_exits_2(made_store, tmp_path, capsys, monkeypatch):
    import errno

    from cnrstore import export as export_mod

    path, _ = made_store

    def denied(snapshot, fmt, tmp):
        raise PermissionError(errno.EACCES, "Permission denied", tmp)

    monkeypatch.setattr(export_mod, "_write", denied)
    rc, _out, err = _main(capsys, "export", path, "--format", "npz", tmp_path / "x.npz")
    assert rc == 2 and "InvalidArgument" in err and "writable" in err
    monkeypatch.setattr(export_mod.os, "access", lambda *a, **k: False)  # checked before the restore
    rc, _out, err = _main(capsys, "export", path, "--format", "npz", tmp_path / "x.npz")
    assert rc == 2 and "not writable" in err
    assert os.listdir(tmp_path) == []


def test_export_io_error_is_export_failed(made_store, tmp_path, capsys, monkeypatch):
    import errno

    from cnrstore import export as export_mod

    path, _ = made_store
    monkeypatch.setattr(export_mod, "_write", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    rc, _out, err = _main(capsys, "export", path, "--format", "npz", tmp_path / "x.npz")
    assert rc == 2 and "ExportFailed" in err and os.listdir(tmp_path) == []


def test_export_bad_version_exits_2(made_store, tmp_path):
    path, _ = made_store
    assert "VersionNotFound" in run("export", path, "--format", "npz", tmp_path / "x.npz", "--version", 99,
                                    check_rc=2).stderr
    proc = run("export", path, "--format", "npz", tmp_path / "x.npz", "--version", 2 ** 70, check_rc=2)
    assert "VersionNotFound" in proc.stderr and "Traceback" not in proc.stderr
    assert "InvalidArgument" in run("export", path, "--format", "npz", tmp_path / "x.npz", "--version", -1,
                                    check_rc=2).stderr
    assert not os.listdir(tmp_path)


def test_verify_exits_1_when_marker_or_index_is_corrupt_or_missing(made_store, tmp_path, capsys):
    path, _ = made_store
    bad_marker = _copy(path, tmp_path / "marker")
    (bad_marker / "CNRSTORE").write_bytes(b"garbage")
    no_index = _copy(path, tmp_path / "noindex")
    subprocess.run(["rm", "-rf", str(no_index / "index")], check=True)
    no_data = _copy(path, tmp_path / "nodata")
    os.unlink(no_data / "index" / "data.mdb")
    no_marker = _copy(path, tmp_path / "nomarker")
    os.unlink(no_marker / "CNRSTORE")
    for damaged in (bad_marker, no_index, no_data, no_marker):
        rc, out, err = _main(capsys, "verify", damaged)
        assert rc == 1, (damaged, out, err)
        assert "DAMAGED" in out and "problem:" in out
        rc, out, _err = _main(capsys, "verify", damaged, "--json")
        report = json.loads(out)
        assert rc == 1 and report["ok"] is False and report["problems"]
    proc = run("verify", no_index, check_rc=1)  # and as a real process
    assert "Traceback" not in proc.stderr


def test_verify_of_something_not_a_store_exits_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    rc, _out, err = _main(capsys, "verify", tmp_path / "empty")
    assert rc == 2 and "StoreNotFound" in err
    rc, _out, err = _main(capsys, "verify", tmp_path / "absent")
    assert rc == 2 and "StoreNotFound" in err


def test_os_errors_and_interrupts_never_show_a_traceback(made_store, capsys, monkeypatch):
    path, _ = made_store

    def raiser(exc):
        def cmd(args):
            raise exc
        return cmd

    monkeypatch.setattr(cli, "cmd_info", raiser(PermissionError(13, "Permission denied", "/x/segments")))
    rc, _out, err = _main(capsys, "info", path)
    assert rc == 2 and "PermissionError" in err and "/x/segments" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(cli, "cmd_info", raiser(KeyboardInterrupt()))
    rc, _out, err = _main(capsys, "info", path)
    assert rc == 130 and "interrupted" in err and "Traceback" not in err


def test_rows_beyond_int64_is_an_invalid_argument(made_store):
    path, _ = made_store
    proc = run("rows", path, "emb", 2 ** 70, check_rc=2)
    assert "InvalidArgument" in proc.stderr and "outside" in proc.stderr and "Traceback" not in proc.stderr



def test_export_to_torch_without_torch_is_an_invalid_argument(made_store, tmp_path, monkeypatch):
    from cnrstore.export import export

    monkeypatch.setitem(sys.modules, "cnrstore.torch.export", None)  # as if PyTorch were not installed
    with cnrstore.open(made_store[0], readonly=True) as store:
        snap = store.restore()
    with pytest.raises(cnrstore.InvalidArgument, match="needs PyTorch"):
        export(snap, "torch", tmp_path / "x.pt")
    assert not os.listdir(tmp_path)


def test_verify_exits_1_when_the_check_itself_meets_damage_it_cannot_step_over(made_store, capsys, monkeypatch):
    path, _ = made_store

    def broken(self, progress=None):
        raise cnrstore.CorruptionError("index entry of version 3 is not msgpack", "/x/index", None)

    monkeypatch.setattr(cnrstore.Store, "verify", broken)
    rc, out, err = _main(capsys, "verify", path)
    assert rc == 1 and "DAMAGED" in out and "not msgpack" in out and not err


# --- issue 14: no torch import for reads, --json everywhere, progress on request, readable ls ----------------

CODECS = ["int8", "int4", "int2", "fp16", "fp32", "int3", "adaptive4", "kmeans4"]


@pytest.fixture(scope="module")
def codec_store(tmp_path_factory):
    """One table per codec, two versions; the rows as this process (torch loaded: FBGEMM's kernels) reads them."""
    path = str(tmp_path_factory.mktemp("codecs") / "store")
    rng = np.random.default_rng(14)
    with cnrstore.open(path, create=True) as store:
        for name in CODECS:
            store.create_table(f"t_{name}", 300, 13, codec=name)
        for v in range(2):
            with store.checkpoint(step=v) as ck:
                for name in CODECS:
                    rows = np.arange(300) if v == 0 else np.arange(0, 300, 7)
                    scale = 10.0 ** rng.uniform(-3, 3, (rows.size, 1))
                    ck.put_rows(f"t_{name}", rows, (rng.standard_normal((rows.size, 13)) * scale).astype(np.float32))
        expected = {f"t_{name}": store.read_table(f"t_{name}") for name in CODECS}
    return path, expected


NO_TORCH = """
import json, sys
from cnrstore import cli
assert "torch" not in sys.modules, "import cnrstore.cli imported torch"
for argv in json.loads(sys.argv[1]):
    rc = cli.main(argv)
    assert rc == 0, (argv, rc)
    assert "torch" not in sys.modules, f"cnrstore {argv[0]} imported torch"
"""


@pytest.mark.parametrize("command", ["ls", "info", "verify", "rows"])
def test_read_only_commands_never_import_torch(codec_store, command):
    path, _ = codec_store
    if command == "rows":
        argvs = [["rows", path, f"t_{name}", "0", "7", "299", *extra] for name in CODECS for extra in ([], ["--json"])]
    else:
        argvs = [[command, path], [command, path, "--json"]]
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps(argvs)], capture_output=True, text=True,
                          env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_rows_json_reads_the_same_bits_without_torch_as_with_it(codec_store):
    """`rows` in a process without torch decodes with numpy (cnrstore/codecs/rowwise.py); every codec's
    values equal, bit for bit, what this process read through FBGEMM's kernels."""
    path, expected = codec_store
    import torch  # noqa: F401  (this process reads with the kernels)

    for table, full in expected.items():
        rows = [0, 7, 8, 299, 7]
        out = json.loads(run("rows", path, table, *rows, "--json").stdout)
        assert out["table"] == table and out["version"] == 2 and out["rows"] == rows
        got = np.array(out["values"], dtype=np.float32)
        assert got.view(np.uint32).tolist() == full[rows].view(np.uint32).tolist(), table


def test_import_cnrstore_does_not_import_torch():
    proc = subprocess.run([sys.executable, "-c", "import sys, cnrstore, cnrstore.cli; print('torch' in sys.modules)"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr


def test_json_of_maintenance_and_export_commands(made_store, tmp_path):
    src, expected = made_store
    path = _copy(src, tmp_path / "j")
    compacted = json.loads(run("compact", path, "--json").stdout)
    assert compacted["version"] == max(expected) and compacted["blocks_materialized"] > 0
    assert compacted["bytes_written"] > 0
    retained = json.loads(run("retain", path, "--keep-last", "2", "--json").stdout)
    assert retained == {"dropped": sorted(expected)[:3], "kept": sorted(expected)[-2:]}
    collected = json.loads(run("gc", path, "--json").stdout)
    assert collected["bytes_reclaimed"] > 0 and collected["incomplete"] is None
    assert set(collected) >= {"bytes_copied", "segments_deleted", "segments_rewritten", "bytes_pending"}
    out = tmp_path / "x.npz"
    exported = json.loads(run("export", path, "--format", "npz", out, "--json").stdout)
    assert exported["version"] == max(expected) and exported["step"] == 400 and exported["format"] == "npz"
    assert exported["path"] == str(out) and exported["layout"] == "nested"
    assert exported["tables"] == 1 and exported["tensors"] == 2  # the table and the dense array
    with np.load(out) as z:
        assert np.array_equal(z["tables/emb"], expected[max(expected)])


def test_every_command_takes_json_and_long_ones_take_progress():
    for cmd in ("ls", "info", "verify", "rows", "compact", "retain", "gc", "export", "repair"):
        text = run(cmd, "--help").stdout
        assert "--json" in text, cmd
        assert ("--progress" in text) == (cmd not in ("ls", "info", "rows")), cmd


def test_progress_only_on_request_when_stderr_is_not_a_terminal(made_store, tmp_path):
    src, _ = made_store
    path = _copy(src, tmp_path / "p")
    quiet = [run("verify", path), run("compact", path), run("retain", path, "--keep-last", "3"), run("gc", path),
             run("export", path, "--format", "npz", tmp_path / "a.npz")]
    assert [p.stderr for p in quiet] == [""] * 5
    proc = run("verify", path, "--progress")
    assert proc.stderr.splitlines()[-1].startswith("verify: ") and "100.0%" in proc.stderr
    proc = run("compact", path, "--version", 4, "--progress")
    assert proc.stderr.splitlines()[-1].startswith("compact: ") and "100.0%" in proc.stderr
    proc = run("retain", path, "--keep-last", "1", "--progress", "--json")
    assert proc.stderr.splitlines() == ["retain: 0/1   0.0% keeping the newest 1 version(s)",
                                        "retain: 1/1 100.0% dropped 2 version(s)"]
    assert json.loads(proc.stdout)["kept"] == [5]  # progress never mixes into stdout
    proc = run("gc", path, "--progress")
    assert "gc: " in proc.stderr and "100.0%" in proc.stderr
    proc = run("export", path, "--format", "npz", tmp_path / "b.npz", "--progress")
    lines = proc.stderr.splitlines()  # in bytes: the table's 600 x 8 fp32 (18.75 KiB) and the dense array
    assert re.fullmatch(r"export: 0 B/18\.[89] KiB   0\.0% reading the newest version", lines[0]), lines
    assert re.fullmatch(r"export: (18\.[89] KiB)/\1 100\.0% reading the newest version", lines[1]), lines
    assert re.fullmatch(rf"export: 0 B/18\.[89] KiB   0\.0% writing {re.escape(str(tmp_path / 'b.npz'))} \(npz\)",
                        lines[2]), lines
    assert re.fullmatch(rf"export: (18\.[89] KiB)/\1 100\.0% writing {re.escape(str(tmp_path / 'b.npz'))} \(npz\)",
                        lines[-1]), lines


def test_ls_names_few_tables_and_counts_many(tmp_path):
    path = str(tmp_path / "many")
    names = [f"table_{i:02d}" for i in range(30)]
    with cnrstore.open(path, create=True) as store:
        for name in names:
            store.create_table(name, 4, 2, codec="fp32")
        with store.checkpoint() as ck:
            for name in names:
                ck.put_rows(name, [0], [[1.0, 2.0]])
        with store.checkpoint() as ck:
            ck.put_rows("table_03", [1], [[1.0, 2.0]])
    lines = run("ls", path).stdout.splitlines()
    assert lines[1].endswith("30 tables: table_00, table_01, table_02, ...") and len(lines[1]) < 120
    assert lines[2].endswith(" table_03")
    listing = json.loads(run("ls", path, "--json").stdout)
    assert listing[0]["tables"] == names and listing[1]["tables"] == ["table_03"]


def test_verify_names_the_table_of_a_damaged_record(made_store, tmp_path):
    path = _copy(made_store[0], tmp_path / "d")
    with cnrstore.open(path, readonly=True) as store:
        with store.engine.read() as view:
            tid, block, version, loc = next(iter(view.row_entries()))
    with open(filenames.segment_path(str(path), loc.segment), "r+b") as f:  # the record's last byte
        f.seek(loc.offset + loc.length - 1)
        byte = f.read(1)
        f.seek(loc.offset + loc.length - 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = json.loads(run("verify", path, "--json", check_rc=1).stdout)
    assert any(p.startswith(f"table 'emb' (id {tid}) block {block} version {version}: ") for p in report["problems"]), \
        report["problems"]


class _Terminal(__import__("io").StringIO):
    def isatty(self):
        return True


def test_progress_draws_a_bar_on_a_terminal_and_nothing_elsewhere_unless_forced(capsys):
    tty = _Terminal()
    bar = cli.Progress("gc", stream=tty)
    bar(0, 4)
    bar(4, 4)
    assert tty.getvalue().startswith("\rgc [") and tty.getvalue().endswith("] 4/4 100.0%\x1b[K\n")
    quiet = __import__("io").StringIO()
    cli.Progress("gc", stream=quiet)(4, 4)
    assert quiet.getvalue() == ""
    cli.Progress("gc", stream=quiet, force=True)(4, 4, "done")
    assert quiet.getvalue() == "gc: 4/4 100.0% done\n"
    # a failure that cuts a bar short starts its error line on a new line
    tty = _Terminal()
    cli.Progress("export", stream=tty)(1, 2, "writing x.npz")
    cli._fail(__import__("argparse").Namespace(command="export"), "StorageFull: disk full")
    assert tty.getvalue().endswith("writing x.npz\x1b[K\n")
    assert capsys.readouterr().err == "cnrstore export: StorageFull: disk full\n"


def _synopsis_lines(text: str, command: str) -> list[str]:
    """Each usage of ``command``: its line joined with the indented lines continuing it (up to the next
    line naming a command, or a blank one)."""
    out, current = [], None
    for line in text.splitlines():
        if re.match(rf"\s*cnrstore {command}\s", line):
            current = [line]
            out.append(current)
        elif current is not None and line.startswith(" ") and line.strip() and "cnrstore " not in line:
            current.append(line)
        else:
            current = None
    return [" ".join(parts) for parts in out]


def test_docstring_and_readme_synopsis_match_the_parser():
    """The usage lines of cli.py's docstring and of README's synopsis name every command with exactly the
    options its parser takes (and the export formats it accepts)."""
    import argparse
    import pathlib

    from cnrstore.export import FORMATS

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    synopsis = re.search(r"```text\n(cnrstore .*?)```", readme, re.S).group(1)
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"ls", "info", "verify", "rows", "diff", "compact", "retain", "gc", "export",
                                "import", "repair", "migrate-payload"}
    for command, parser in sub.choices.items():
        options = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        for text, where in ((cli.__doc__, "cli.py's docstring"), (synopsis, "README's synopsis")):
            lines = _synopsis_lines(text, command)
            assert len(lines) == 1, (where, command, lines)
            assert set(re.findall(r"--[a-z][a-z-]*", lines[0])) == options, (where, command, lines[0])
    for text in (cli.__doc__, synopsis):
        assert "|".join(FORMATS) in text


def test_import_then_export_through_the_command_line(tmp_path, capsys):
    """`cnrstore import` seeds a new store from a torch.save state dict (per-table codec), `cnrstore export`
    gives back the model's state dict: the fp32 table and the dense tensors exactly, the int8 table as the
    codec decodes it; a second import into the now non-empty store is refused (exit 2), store unchanged."""
    import torch

    from cnrstore import codecs as codec_registry

    g = torch.Generator().manual_seed(0)
    sd = {"emb.0.weight": torch.randn(300, 8, generator=g), "emb.1.weight": torch.randn(50, 4, generator=g),
          "mlp.weight": torch.randn(3, 8, generator=g), "mlp.bias": torch.randn(3, generator=g)}
    torch.save(sd, tmp_path / "model.pt")
    store = str(tmp_path / "store")
    assert cli.main(["import", store, str(tmp_path / "model.pt"), "--table-codec", "emb.1=int8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == 1 and report["source_format"] == "torch"
    assert {k: v[3] for k, v in report["tables"].items()} == {"emb.0": "fp32", "emb.1": "int8"}
    assert cli.main(["export", store, "--format", "torch", str(tmp_path / "out.pt")]) == 0
    out = torch.load(tmp_path / "out.pt")
    assert set(out) == set(sd)
    for key in ("emb.0.weight", "mlp.weight", "mlp.bias"):
        assert torch.equal(out[key], sd[key]), key
    int8 = codec_registry.get("int8")
    assert np.array_equal(out["emb.1.weight"].numpy(), int8.decode(int8.encode(sd["emb.1.weight"].numpy()), 4))
    capsys.readouterr()
    assert cli.main(["import", store, str(tmp_path / "model.pt")]) == 2
    assert "cnrstore import:" in capsys.readouterr().err
    with cnrstore.open(store, readonly=True) as s:
        assert [v.version for v in s.versions()] == [1]


def test_export_refuses_an_existing_out_without_force_and_a_fifo_even_with_it(made_store, tmp_path, capsys):
    """Fault 12 of issue 21 on the command line: an existing OUT is replaced only with --force (the refusal
    names the flag), a FIFO at OUT never (the export neither blocks on it nor replaces it); exit 2, one line."""
    path, _ = made_store
    out = tmp_path / "x.npz"
    out.write_bytes(b"older export")
    rc, _out, err = _main(capsys, "export", path, "--format", "npz", out)
    assert rc == 2 and "--force" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == b"older export"
    rc, _out, err = _main(capsys, "export", path, "--format", "npz", out, "--force")
    assert rc == 0 and np.load(out).files
    os.mkfifo(tmp_path / "fifo")
    for extra in ([], ["--force"]):
        rc, _out, err = _main(capsys, "export", path, "--format", "npz", tmp_path / "fifo", *extra)
        assert rc == 2 and "FIFO" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["fifo", "x.npz"]


@pytest.mark.parametrize("damage", ["truncated data file", "garbage .metadata"])
def test_import_of_a_damaged_dcp_directory_exits_2_with_one_line(tmp_path, damage):
    """Fault 9 of issue 21: `cnrstore import` of a DCP directory with a truncated data file or a garbage
    .metadata printed 40-60 lines (torch's CheckpointException is a BaseException, and DCP's loader logs
    tracebacks on the root logger) and exited 1. Now: exit 2, one line on stderr, no store created."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"emb.0.weight": torch.randn(300, 8), "mlp.bias": torch.randn(3)}, checkpoint_id=src, no_dist=True)
    if damage == "truncated data file":
        data = next(p for p in src.iterdir() if p.suffix == ".distcp")
        os.truncate(data, data.stat().st_size // 3)
    else:
        (src / ".metadata").write_bytes(b"\x80garbage" * 20)
    proc = run("import", tmp_path / "store", src, check_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cnrstore import: InvalidArgument: cannot read"), proc.stderr
    assert "dcp checkpoint" in lines[0] and "copy the checkpoint again" in lines[0]
    assert not (tmp_path / "store").exists()


# --- issue 24, item 8: rank paths in `ls ROOT`, meta in `ls --long`, export progress by bytes ----------------

def test_ls_long_prints_each_versions_meta(made_store):
    path, expected = made_store
    lines = run("ls", path, "--long").stdout.splitlines()
    metas = [line.split("meta: ", 1)[1] for line in lines if line.lstrip().startswith("meta: ")]
    assert metas == [json.dumps({"pos": v}) for v in range(5)]
    assert not any("meta" in line for line in run("ls", path).stdout.splitlines())  # only with --long
    assert [r["meta"] for r in json.loads(run("ls", path, "--json").stdout)] == [{"pos": v} for v in range(5)]


def test_ls_of_a_root_prints_the_rank_stores_that_info_takes(tmp_path, group, capsys):
    """`cnrstore rows ROOT` says to give it ROOT/gen-G/rank-R and to look at `cnrstore ls ROOT`: ls prints
    those paths, and each one works with info; --long shows the global version's meta."""
    import torch
    from torch import nn

    from cnrstore.distributed import DistributedCheckpointer, ShardingPlan

    model = nn.Sequential(nn.EmbeddingBag(64, 4))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    root = str(tmp_path / "root")
    ck = DistributedCheckpointer(root, model, opt, plan=ShardingPlan.row_wise({"0": (64, 4)}, 1), codec="fp32")
    for step in (10, 20):
        model[0](torch.tensor([1, 2]), torch.tensor([0])).sum().backward()
        opt.step()
        ck.save(step, meta={"epoch": step // 10}).wait()
    ck.close()
    assert cli.main(["rows", root, "0", "1"]) == 2
    assert f"see `cnrstore ls {root}`" in capsys.readouterr().err
    assert cli.main(["ls", root, "--long"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("meta: ")[1] for line in out if "meta: " in line] == ['{"epoch": 1}', '{"epoch": 2}']
    assert out[-2].startswith("rank stores of global version(s) 1-2")
    rank_store = out[-1].split("rank 0: ")[1]
    assert rank_store == os.path.join(root, "gen-000001", "rank-00000")
    assert cli.main(["info", rank_store]) == 0 and "store " + rank_store in capsys.readouterr().out
    assert cli.main(["ls", root, "--json"]) == 0
    assert [g["stores"] for g in json.loads(capsys.readouterr().out)] == [["gen-000001/rank-00000"]] * 2
    # a global version that is not there: said without naming a Python call
    assert cli.main(["export", root, "--format", "npz", str(tmp_path / "x.npz"), "--version", "9"]) == 2
    err = capsys.readouterr().err
    assert "VersionNotFound: global version 9" in err and not PYTHON_TERMS.search(err), err
    # a root's export reports bytes per rank, then the file's
    assert cli.main(["export", root, "--format", "npz", str(tmp_path / "x.npz"), "--progress"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "export: 0 B/1.0 KiB   0.0% assembling the newest global version from every rank"
    assert lines[1] == "export: 1.0 KiB/1.0 KiB 100.0% assembling the newest global version from every rank"
    assert lines[-1].endswith(f"100.0% writing {tmp_path / 'x.npz'} (npz)")


def test_export_progress_is_a_stream_of_bytes(tmp_path, capsys, monkeypatch):
    """Not three ticks: the read reports every decoded block and the write the file's size as it grows."""
    import time

    from cnrstore import export as export_mod

    path = str(tmp_path / "s")
    with cnrstore.open(path, create=True) as store:
        store.create_table("emb", 20_000, 16, codec="int8", block_rows=1024)
        with store.checkpoint() as ck:
            ck.put_rows("emb", np.arange(20_000), np.ones((20_000, 16), dtype=np.float32))
    real_write = export_mod._write

    def slow_write(content, fmt, tmp):  # the real file, written in 5 slices a little apart
        real_write(content, fmt, tmp + ".full")
        data = open(tmp + ".full", "rb").read()
        os.unlink(tmp + ".full")
        with open(tmp, "wb") as f:
            for i in range(5):
                f.write(data[i * len(data) // 5:(i + 1) * len(data) // 5])
                f.flush()
                time.sleep(0.25)

    monkeypatch.setattr(export_mod, "_write", slow_write)
    monkeypatch.setattr(cli.Progress, "interval_s", 0.0)  # every update, not one a second
    assert cli.main(["export", path, "--format", "npz", str(tmp_path / "x.npz"), "--progress"]) == 0
    lines = capsys.readouterr().err.splitlines()
    reading = [line for line in lines if line.endswith("reading the newest version")]
    writing = [line for line in lines if "writing" in line]
    total = "1.2 MiB"  # 20,000 x 16 fp32
    assert len(reading) == 1 + 20 and all(f"/{total} " in line for line in reading)  # 0, then each of 20 blocks
    assert reading[-1].startswith(f"export: {total}/{total} 100.0%")
    assert len(writing) >= 5 and writing[0].startswith(f"export: 0 B/{total}")  # 0, the slices, the end
    assert writing[-1].startswith(f"export: {total}/{total} 100.0%")
    percents = [float(line.split("%")[0].split()[-1]) for line in writing]
    assert percents == sorted(percents) and len(set(percents)) >= 4, writing


def test_python_dash_m_cnrstore_is_the_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cnrstore", "ls", str(tmp_path / "none")], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("cnrstore ls: StoreNotFound"), proc.stderr
