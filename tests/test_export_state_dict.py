"""cnrstore.export of versions written by cnrstore.torch.Checkpointer: state-dict-shaped exports (torch,
safetensors, DCP, npz), the checkpoint layout with optimizer state, the nested layout of key-value stores,
and atomicity with typed errors (cnrstore/export.py, cnrstore/torch/export.py)."""

from __future__ import annotations

import errno
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import cnrstore
from cnrstore import codecs
from cnrstore import export as export_mod
from cnrstore.errors import InvalidArgument, StorageFull
from cnrstore.export import export, export_path
from cnrstore.torch import Checkpointer
from cnrstore.torch.checkpointer import STATE_BLOB


class Model(nn.Module):
    """Embeddings, a bfloat16 layer and buffers of three dtypes (BatchNorm's int64 counter)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.ModuleList([nn.Embedding(120, 8), nn.EmbeddingBag(40, 4, mode="sum")])
        self.dense = nn.Linear(12, 3).to(torch.bfloat16)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, ids):
        x = torch.cat([self.emb[0](ids).sum(0, keepdim=True), self.emb[1](ids % 40, torch.tensor([0]))], dim=1)
        y = self.dense(x.to(torch.bfloat16)).float()
        return y.pow(2).sum() + self.bn(torch.cat([y, 2 * y + 1])).pow(3).sum()


def train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randint(120, (6,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()


def same(a: dict, b: dict) -> None:
    assert list(a) == list(b) or set(a) == set(b), (sorted(a), sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype, (k, a[k].dtype, b[k].dtype)
        assert torch.equal(a[k], b[k]), k


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Checkpointer store (fp32 tables) with two versions; the model and optimizer state at each."""
    path = str(tmp_path_factory.mktemp("sd") / "store")
    model = Model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    states, optims = {}, {}
    with cnrstore.open(path, create=True) as store:
        ck = Checkpointer(store, model, opt, codec="fp32", mode="incremental")
        for i in range(2):
            train(model, opt, 3, seed=i)
            v = ck.save(step=10 * (i + 1), meta={"pos": i}).wait()
            states[v] = state(model)
            optims[v] = {k: v_.clone() for k, v_ in opt.state[model.emb[0].weight].items()}
        ck.close()
    return path, states, optims


def test_the_state_blob_name_is_the_checkpointers():
    assert export_mod.TORCH_STATE == STATE_BLOB


def test_torch_export_loads_with_strict_load_state_dict(trained, tmp_path):
    path, states, _ = trained
    v = max(states)
    report = export_path(path, "torch", tmp_path / "m.pt")
    assert (report.layout, report.version, report.step, report.tables) == ("state_dict", v, 20, 2)
    sd = torch.load(tmp_path / "m.pt")
    assert set(sd) == set(Model().state_dict())  # nothing else at the top level
    fresh = Model(seed=5)
    fresh.load_state_dict(sd)  # strict
    same(state(fresh), states[v])
    assert sd["dense.weight"].dtype == torch.bfloat16 and sd["bn.num_batches_tracked"].dtype == torch.int64


def test_any_version_exports(trained, tmp_path):
    path, states, _ = trained
    v = min(states)
    export_path(path, "torch", tmp_path / "old.pt", version=v)
    same(torch.load(tmp_path / "old.pt"), states[v])
    assert not torch.equal(states[v]["emb.0.weight"], states[max(states)]["emb.0.weight"])


def test_safetensors_export_has_the_same_keys_and_the_version_in_its_header(trained, tmp_path):
    path, states, _ = trained
    v = max(states)
    export_path(path, "safetensors", tmp_path / "m.safetensors")
    fresh = Model(seed=3)
    fresh.load_state_dict(load_file(str(tmp_path / "m.safetensors")))
    same(state(fresh), states[v])
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["version"] == str(v) and meta["step"] == "20" and meta["layout"] == "state_dict"
    assert meta["meta"] == '{"pos": 1}'


def test_dcp_export_loads_into_a_freshly_built_model(trained, tmp_path):
    path, states, _ = trained
    out = tmp_path / "m.dcp"
    report = export_path(path, "dcp", out)
    assert report.format == "dcp" and os.path.exists(out / ".metadata")
    model = Model(seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(model.state_dict(), checkpoint_id=out)
    same(state(model), states[max(states)])
    assert [n for n in os.listdir(tmp_path) if n != "m.dcp"] == []  # no temporary directory left


def test_checkpoint_layout_holds_the_optimizer_and_meta(trained, tmp_path):
    path, states, optims = trained
    v = max(states)
    export_path(path, "torch", tmp_path / "ck.pt", layout="checkpoint")
    ck = torch.load(tmp_path / "ck.pt")
    assert set(ck) == {"model", "optimizers", "param_names", "embedding_tables", "extra", "version", "step", "meta"}
    assert ck["embedding_tables"] == ["emb.0", "emb.1"]
    assert ck["param_names"] == [[n for n, _ in Model().named_parameters()]]
    assert (ck["version"], ck["step"], ck["meta"]) == (v, 20, {"pos": 1})
    model = Model(seed=1)
    model.load_state_dict(ck["model"])
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    opt.load_state_dict(ck["optimizers"][0])
    got = opt.state[model.emb[0].weight]
    assert torch.equal(got["sum"], optims[v]["sum"]) and torch.equal(got["step"], optims[v]["step"])
    for fmt in ("safetensors", "dcp", "npz"):
        with pytest.raises(InvalidArgument, match="only as torch"):
            export_path(path, fmt, tmp_path / f"ck.{fmt}", layout="checkpoint")


def test_npz_refuses_bfloat16_and_leaves_nothing(trained, tmp_path):
    path, _, _ = trained
    with pytest.raises(InvalidArgument, match="bfloat16"):
        export_path(path, "npz", tmp_path / "m.npz")
    assert os.listdir(tmp_path) == []


def test_npz_state_dict_without_bfloat16(tmp_path):
    model = nn.Sequential(nn.Embedding(30, 4), nn.Linear(4, 2))
    with cnrstore.open(tmp_path / "s", create=True) as store:
        Checkpointer(store, model, codec="fp32").save(1).wait()
        export(store.restore(), "npz", tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz") as z:
        assert sorted(z.files) == ["0.weight", "1.bias", "1.weight"]
        np.testing.assert_array_equal(z["0.weight"], model[0].weight.detach().numpy())


def test_quantized_tables_export_as_the_codec_decodes(tmp_path):
    model = nn.Sequential(nn.Embedding(300, 16), nn.Linear(16, 1))
    with cnrstore.open(tmp_path / "s", create=True) as store:
        Checkpointer(store, model, codec="int4").save(1).wait()
    export_path(tmp_path / "s", "torch", tmp_path / "m.pt")
    w = model[0].weight.detach().numpy()
    c = codecs.get("int4")
    np.testing.assert_array_equal(torch.load(tmp_path / "m.pt")["0.weight"].numpy(), c.decode(c.encode(w), 16))


def test_nested_layout_of_a_checkpointer_store(trained, tmp_path):
    path, states, _ = trained
    export_path(path, "npz", tmp_path / "n.npz", layout="nested")
    with np.load(tmp_path / "n.npz") as z:
        assert "tables/emb.0" in z.files and "tables/emb.0.optim.sum" in z.files and f"dense/{STATE_BLOB}" in z.files
        np.testing.assert_array_equal(z["tables/emb.0"], states[max(states)]["emb.0.weight"].numpy())


@pytest.fixture
def plain(tmp_path):
    """A key-value store (no Checkpointer): tables and a dense array, no parameter names."""
    path = tmp_path / "plain"
    rng = np.random.default_rng(1)
    with cnrstore.open(path, create=True) as store:
        store.create_table("user", 50, 4, codec="fp32")
        with store.checkpoint(step=7) as ck:
            ck.put_rows("user", np.arange(50), rng.standard_normal((50, 4)).astype(np.float32))
            ck.put_dense("w", np.arange(6, dtype=np.float64).reshape(2, 3))
        table = store.read_table("user")
    return path, table


def test_plain_stores_keep_the_nested_layout_in_every_format(plain, tmp_path):
    path, table = plain
    for fmt in ("npz", "safetensors", "torch", "dcp"):
        report = export_path(path, fmt, tmp_path / f"x.{fmt}")
        assert report.layout == "nested" and report.tensors == 2
    with np.load(tmp_path / "x.npz") as z:
        np.testing.assert_array_equal(z["tables/user"], table)
    np.testing.assert_array_equal(load_file(str(tmp_path / "x.safetensors"))["tables/user"].numpy(), table)
    saved = torch.load(tmp_path / "x.torch")
    assert saved["step"] == 7 and torch.equal(saved["dense"]["w"], torch.arange(6, dtype=torch.float64).view(2, 3))
    target = {"tables": {"user": torch.zeros(50, 4)}, "dense": {"w": torch.zeros(2, 3, dtype=torch.float64)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=tmp_path / "x.dcp")
    np.testing.assert_array_equal(target["tables"]["user"].numpy(), table)
    with pytest.raises(InvalidArgument, match="nested"):
        export_path(path, "torch", tmp_path / "sd.pt", layout="state_dict")
    with pytest.raises(InvalidArgument, match="layout"):
        export_path(path, "torch", tmp_path / "sd.pt", layout="flat")
    with pytest.raises(InvalidArgument, match="format"):
        export_path(path, "hdf5", tmp_path / "sd.h5")


def test_model_names_tied_and_bare_embedding_keys(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Embedding(20, 4)
            self.out = nn.Embedding(20, 4)
            self.out.weight = self.inp.weight

    for model in (Tied(), nn.Embedding(25, 3)):
        store_path = tmp_path / type(model).__name__
        with cnrstore.open(store_path, create=True) as store:
            Checkpointer(store, model, codec="fp32").save(1).wait()
            snap = store.restore()
        out = tmp_path / f"{type(model).__name__}.st"
        export(snap, "safetensors", out, model=model)
        fresh = type(model)() if isinstance(model, Tied) else nn.Embedding(25, 3)
        fresh.load_state_dict(load_file(str(out)))  # strict: every key, tied ones too
        same(state(fresh), state(model))
        with pytest.raises(InvalidArgument, match="checkpointed"):
            export(snap, "torch", tmp_path / "x.pt", model=nn.Linear(2, 2))


def test_bare_embedding_with_an_optimizer_is_keyed_weight_without_a_model(tmp_path):
    model = nn.Embedding(25, 3)
    with cnrstore.open(tmp_path / "s", create=True) as store:
        Checkpointer(store, model, torch.optim.SGD(model.parameters(), lr=0.1), codec="fp32").save(1).wait()
    export_path(tmp_path / "s", "torch", tmp_path / "m.pt")
    assert list(torch.load(tmp_path / "m.pt")) == ["weight"]


def test_dcp_refuses_to_merge_into_an_existing_directory(trained, tmp_path):
    path, _, _ = trained
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep").write_text("x")
    with pytest.raises(InvalidArgument, match="non-empty directory"):
        export_path(path, "dcp", tmp_path / "old")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgument, match="a file"):
        export_path(path, "dcp", tmp_path / "file")
    (tmp_path / "empty").mkdir()
    export_path(path, "dcp", tmp_path / "empty")  # an empty directory is taken
    assert os.path.exists(tmp_path / "empty" / ".metadata")
    with pytest.raises(InvalidArgument, match="does not exist"):
        export_path(path, "dcp", tmp_path / "no" / "dir")


def test_a_dcp_write_that_fills_the_disk_is_storage_full_and_leaves_nothing(trained, tmp_path, monkeypatch):
    from cnrstore.torch import export as torch_export

    path, _, _ = trained

    def full(fd):  # DCP fsyncs each file it writes (sync_files=True): the disk fills there
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        with pytest.raises(StorageFull, match="space"):
            export_path(path, "dcp", tmp_path / "m.dcp")
    assert os.listdir(tmp_path) == []

    def broken(data, fmt, layout, tmp, metadata):
        raise RuntimeError("[Errno 5] Input/output error")

    monkeypatch.setattr(torch_export, "write", broken)
    with pytest.raises(cnrstore.ExportFailed):
        export_path(path, "torch", tmp_path / "m.pt")
    assert os.listdir(tmp_path) == []


def test_export_path_of_something_that_is_no_store(tmp_path):
    with pytest.raises(cnrstore.StoreNotFound):
        export_path(tmp_path, "torch", tmp_path / "m.pt")


# --- issue 21, fault 12: an export replaces a regular file only, and only when asked ------------------------
def _special_files(tmp_path):
    """(name, path) of every kind of non-regular file an export must refuse; a device node only as root."""
    import socket
    import stat

    (tmp_path / "target.pt").write_bytes(b"the link's target")
    os.symlink(tmp_path / "target.pt", tmp_path / "link.pt")
    os.symlink(tmp_path / "nowhere.pt", tmp_path / "dangling.pt")
    os.mkfifo(tmp_path / "fifo.pt")
    out = [("symbolic link", tmp_path / "link.pt"), ("dangling symbolic link", tmp_path / "dangling.pt"),
           ("FIFO", tmp_path / "fifo.pt")]
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.pt"))
    sock.close()
    out.append(("socket", tmp_path / "sock.pt"))
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null.pt", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # what /dev/null is
        out.append(("character device", tmp_path / "null.pt"))
    return out


def _fingerprint(path):
    st = os.lstat(path)
    return (st.st_mode, st.st_ino, st.st_size, os.readlink(path) if os.path.islink(path) else None)


def test_export_refuses_an_existing_file_unless_overwrite_and_never_a_link_fifo_socket_or_device(trained, tmp_path):
    """Fault 12 of issue 21: `export` replaced whatever lay at its path -- a symlink, a FIFO, a device node.
    Now an existing regular file is replaced only with overwrite=True; anything else is refused with it too,
    and left exactly as it was, with no temporary file behind."""
    path, states, _ = trained
    old = tmp_path / "old.pt"
    old.write_bytes(b"an older export")
    with pytest.raises(InvalidArgument, match=r"exists; pass --force \(overwrite=True\)"):
        export_path(path, "torch", old)
    assert old.read_bytes() == b"an older export"
    report = export_path(path, "torch", old, overwrite=True)
    same(torch.load(old), states[report.version])
    specials = _special_files(tmp_path)
    before = {p: _fingerprint(p) for _, p in specials}
    for fmt in ("torch", "safetensors", "npz", "dcp"):
        for kind, target in specials:
            for overwrite in (False, True):
                with pytest.raises(InvalidArgument, match="symbolic link|FIFO|socket|device") as info:
                    export_path(path, fmt, target, overwrite=overwrite,
                                layout="nested" if fmt == "npz" else "auto")
                assert ("symbolic link" if "link" in kind else kind) in str(info.value)
    assert {p: _fingerprint(p) for _, p in specials} == before
    assert (tmp_path / "target.pt").read_bytes() == b"the link's target"
    assert not [n for n in os.listdir(tmp_path) if "cnrstore-export" in n]


def test_export_without_overwrite_never_replaces_what_appears_during_the_write(trained, tmp_path, monkeypatch):
    """The check before the write is not enough: a link created at the path while the file is written is not
    replaced either (the file is moved into place with link(2), which fails on anything there)."""
    path, _, _ = trained
    out = tmp_path / "m.pt"
    real = export_mod._write

    def racing(content, fmt, tmp):
        real(content, fmt, tmp)
        os.symlink("/etc/passwd", out)

    monkeypatch.setattr(export_mod, "_write", racing)
    with pytest.raises(InvalidArgument, match="symbolic link"):
        export_path(path, "torch", out)
    assert os.readlink(out) == "/etc/passwd"
    os.unlink(out)

    def racing_file(content, fmt, tmp):
        real(content, fmt, tmp)
        out.write_bytes(b"someone else's")

    monkeypatch.setattr(export_mod, "_write", racing_file)
    with pytest.raises(InvalidArgument, match="exists"):
        export_path(path, "torch", out)
    assert out.read_bytes() == b"someone else's"
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "npz", "dcp"])
def test_exports_of_every_format_get_the_mode_a_new_file_gets(tmp_path, fmt):
    """safetensors' writer made its file 0600 while torch's was 0644: every format now gets 0666 (0777 for a
    DCP directory) less the umask."""
    import stat

    import cnrstore
    from cnrstore.export import export_path

    with cnrstore.open(tmp_path / "s", create=True) as s:
        s.create_table("t", 8, 2)
        with s.checkpoint() as ck:
            ck.put_rows("t", range(8), np.ones((8, 2), np.float32))
    out = tmp_path / f"out.{fmt}"
    old = os.umask(0o022)
    try:
        export_path(str(tmp_path / "s"), fmt, str(out))
    finally:
        os.umask(old)
    paths = [out] if fmt != "dcp" else [out, *out.iterdir()]
    for p in paths:
        want = 0o755 if p.is_dir() else 0o644
        assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))
