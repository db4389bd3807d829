"""cnrstore.torch.import_checkpoint: a PyTorch checkpoint (torch.save, safetensors, DCP) seeds a new store in
the Checkpointer's layout; restore loads it, training goes on with incremental saves, and export gives the
source back (cnrstore/torch/imports.py)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

import cnrstore
from cnrstore import codecs
from cnrstore.errors import InvalidArgument, MissingRows
from cnrstore.export import export_path
from cnrstore.torch import Checkpointer, import_checkpoint
from cnrstore.torch.imports import parse_table_codecs, select_tables

from support.torch_models import Position


class DLRM(nn.Module):
    """Embedding tables named like DLRM's (emb_l), a bfloat16 bottom MLP and BatchNorm buffers."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb_l = nn.ModuleList([nn.EmbeddingBag(200, 8, mode="sum"), nn.EmbeddingBag(64, 8, mode="sum")])
        self.bot = nn.Linear(4, 8).to(torch.bfloat16)
        self.top = nn.Linear(24, 1)
        self.bn = nn.BatchNorm1d(1)

    def forward(self, dense, ids):
        offsets = torch.arange(0, ids.numel(), 3)
        x = torch.cat([self.bot(dense.to(torch.bfloat16)).float(), self.emb_l[0](ids, offsets),
                       self.emb_l[1](ids % 64, offsets)], dim=1)
        return self.bn(self.top(x)).pow(2).mean()


def train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(4, 4, generator=g), torch.randint(200, (12,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b), (sorted(a), sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def restored(path, seed: int) -> dict:
    """The state of a fresh model (init ``seed``) after a plain Checkpointer restores the store at ``path``."""
    model = DLRM(seed=seed)
    with cnrstore.open(path) as store:
        Checkpointer(store, model).restore()
    return state(model)


@pytest.fixture(scope="module")
def trained():
    model = DLRM()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    train(model, opt, 4)
    return model, opt, state(model)


def test_torch_save_import_restore_is_bit_exact_and_training_goes_on(trained, tmp_path):
    _, _, sd_a = trained
    torch.save(sd_a, tmp_path / "a.pt")
    report = import_checkpoint(tmp_path / "s", tmp_path / "a.pt", step=4, meta={"pos": 4})
    assert report.source_format == "torch" and report.version == 1
    assert {n: t[1:] for n, t in report.tables.items()} == {"emb_l.0": (200, 8, "fp32"), "emb_l.1": (64, 8, "fp32")}
    assert set(report.dense) == set(sd_a) - {"emb_l.0.weight", "emb_l.1.weight"}
    b = DLRM(seed=1)
    with cnrstore.open(tmp_path / "s") as store:
        assert store.latest().step == 4 and store.latest().meta == {"pos": 4}
        ck = Checkpointer(store, b, mode="incremental", codec="fp32")
        ck.restore()
        assert_same(state(b), sd_a)
        # training goes on: a few steps, an incremental save, and that version restores too
        opt = torch.optim.Adagrad(b.parameters(), lr=0.1)
        train(b, opt, 2, seed=7)
        rep = ck.save(step=6)
        v = rep.wait()
        after = state(b)
        train(b, opt, 1, seed=8)
        ck.restore(v)
        assert_same(state(b), after)
        ck.close()


def test_a_legacy_torch_save_file_imports(trained, tmp_path):
    _, _, sd_a = trained
    torch.save(sd_a, tmp_path / "old.pt", _use_new_zipfile_serialization=False)  # not memory-mappable
    import_checkpoint(tmp_path / "s", tmp_path / "old.pt")
    assert_same(restored(tmp_path / "s", seed=1), sd_a)


def test_an_npz_of_a_state_dict_imports_and_a_torch_save_zip_is_not_taken_for_one(trained, tmp_path):
    _, _, sd_a = trained
    plain = {k: v for k, v in sd_a.items() if v.dtype != torch.bfloat16}  # (numpy has no bfloat16)
    np.savez(tmp_path / "a.npz", **{k: v.numpy() for k, v in plain.items()})
    torch.save(plain, tmp_path / "a.pt")  # (a zip archive too)
    report = import_checkpoint(tmp_path / "s", tmp_path / "a.npz", model_only=True)
    assert report.source_format == "npz"
    assert import_checkpoint(tmp_path / "t", tmp_path / "a.pt", model_only=True).source_format == "torch"
    with cnrstore.open(tmp_path / "s") as store:
        assert np.array_equal(store.read_table("emb_l.0"), plain["emb_l.0.weight"].numpy())


def test_per_table_codec_restores_as_the_codec_decodes(trained, tmp_path):
    _, _, sd_a = trained
    report = import_checkpoint(tmp_path / "s", sd_a, codecs={"emb_l.0": "int4"})
    assert report.tables["emb_l.0"][3] == "int4" and report.tables["emb_l.1"][3] == "fp32"
    b = DLRM(seed=2)
    with cnrstore.open(tmp_path / "s") as store:
        assert store.tables()["emb_l.0"].codec == "int4"
        Checkpointer(store, b).restore()
    c = codecs.get("int4")
    w = sd_a["emb_l.0.weight"].numpy()
    np.testing.assert_array_equal(b.emb_l[0].weight.detach().numpy(), c.decode(c.encode(w), 8))
    rest = {k: v for k, v in state(b).items() if k != "emb_l.0.weight"}
    assert_same(rest, {k: v for k, v in sd_a.items() if k != "emb_l.0.weight"})


def _write_source(sd: dict, fmt: str, path) -> str:
    if fmt == "torch":
        torch.save(sd, path)
    elif fmt == "safetensors":
        save_file(sd, str(path))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=path, no_dist=True)
    return str(path)


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_import_then_export_gives_the_source_back(trained, tmp_path, fmt):
    _, _, sd_a = trained
    src = _write_source(sd_a, fmt, tmp_path / f"src.{fmt}")
    report = import_checkpoint(tmp_path / "s", src)  # format detected
    assert report.source_format == fmt
    out = tmp_path / f"out.{fmt}"
    assert export_path(tmp_path / "s", fmt, out).layout == "state_dict"
    if fmt == "torch":
        back = torch.load(out)
    elif fmt == "safetensors":
        from safetensors.torch import load_file
        back = load_file(str(out))
    else:
        back = DLRM(seed=3).state_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(back, checkpoint_id=out)
    assert_same(back, sd_a)


def test_a_trainers_checkpoint_dict_is_refused_unless_model_only(trained, tmp_path):
    """Fault 8 of issue 21: a `torch.save({"model", "opt0", ...})` file imported its model and dropped the rest
    without a word. Now entries the import does not understand are refused, named, with the fix; the store
    path is not created. `model_only=True` imports the model and lists what it left out; the trainer's
    optimizer state goes in by loading it into the trainer's optimizer and passing that."""
    model, opt, sd_a = trained
    for ck, words in (({"model": sd_a, "opt0": opt.state_dict(), "epoch": 3}, r"does not understand: \['opt0'\].*--model-only"),
                      # a trainer's one optimizer, keyed by position: only the model names its parameters
                      ({"model": sd_a, "optimizer": opt.state_dict()}, r"keyed by position.*pass optimizer=.*--model-only")):
        torch.save(ck, tmp_path / "ck.pt")
        with pytest.raises(InvalidArgument, match=words):
            import_checkpoint(tmp_path / "s", tmp_path / "ck.pt")
        assert not os.path.exists(tmp_path / "s")
    with pytest.raises(InvalidArgument, match="without 'param_names'.*--model-only"):
        import_checkpoint(tmp_path / "s", {"model": sd_a, "optimizers": [opt.state_dict()]})
    assert not os.path.exists(tmp_path / "s")
    report = import_checkpoint(tmp_path / "s", tmp_path / "ck.pt", model_only=True)
    assert report.ignored == ("optimizer",) and report.optimizers == 0
    assert_same(restored(tmp_path / "s", seed=4), sd_a)
    # the trainer's optimizer state, loaded into its optimizer, is recorded with optimizer=
    b = DLRM(seed=5)
    opt_b = torch.optim.Adagrad(b.parameters(), lr=0.1)
    opt_b.load_state_dict(torch.load(tmp_path / "ck.pt")["optimizer"])
    report = import_checkpoint(tmp_path / "s2", tmp_path / "ck.pt", model=b, optimizer=opt_b, model_only=True)
    assert report.optimizers == 1 and set(report.optimizer_tables) == {"emb_l.0.optim.sum", "emb_l.1.optim.sum"}
    with pytest.raises(InvalidArgument, match="optimizer= is given too"):
        import_checkpoint(tmp_path / "s3", {"model": sd_a, "optimizers": [opt.state_dict()],
                                            "param_names": [[n for n, _ in b.named_parameters()]]},
                          model=b, optimizer=opt_b)


def test_model_and_optimizer_make_the_store_restorable_with_that_optimizer(trained, tmp_path):
    _, opt_a, sd_a = trained
    b = DLRM(seed=5)
    opt_b = torch.optim.Adagrad(b.parameters(), lr=0.1)
    opt_b.load_state_dict(opt_a.state_dict())  # the trainer's optimizer, state loaded from its own checkpoint
    report = import_checkpoint(tmp_path / "s", sd_a, model=b, optimizer=opt_b, codec="fp32")
    assert set(report.optimizer_tables) == {"emb_l.0.optim.sum", "emb_l.1.optim.sum"}
    c = DLRM(seed=6)
    opt_c = torch.optim.Adagrad(c.parameters(), lr=0.1)
    with cnrstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, c, opt_c, codec="fp32")
        ck.restore()
        assert_same(state(c), sd_a)
        for p_a, p_c in zip(opt_b.param_groups[0]["params"], opt_c.param_groups[0]["params"]):
            for k, v in opt_b.state[p_a].items():
                assert torch.equal(opt_c.state[p_c][k], v), k
        train(c, opt_c, 1)
        ck.save(step=1).wait()
        ck.close()


def test_weights_imported_without_an_optimizer_restore_into_a_trainer_with_one(trained, tmp_path):
    """`cnrstore import` takes model weights only: a trainer with an optimizer restores them and leaves its
    optimizer as it was (fresh); its first save then records that optimizer."""
    _, _, sd_a = trained
    import_checkpoint(tmp_path / "s", sd_a)
    b = DLRM(seed=3)
    opt = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    with cnrstore.open(tmp_path / "s") as store:
        ckpt = Checkpointer(store, b, opt)
        ckpt.restore()
        assert_same(state(b), sd_a)
        assert opt.state_dict()["state"] == {}
        train(b, opt, 1)
        ckpt.save(1).wait()
        ckpt.close()
    c = DLRM(seed=4)
    opt_c = torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9)
    with cnrstore.open(tmp_path / "s", readonly=True) as store:
        Checkpointer(store, c, opt_c).restore()
    assert opt_c.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_model_selects_exactly_its_embeddings_and_checks_the_source(trained, tmp_path):
    _, _, sd_a = trained

    class Odd(nn.Module):  # embeddings named without "emb", a tall Linear named like one
        def __init__(self):
            super().__init__()
            self.user = nn.Embedding(30, 4)
            self.emb_proj = nn.Linear(4, 4)

    odd = Odd()
    sd = state(odd)
    assert set(select_tables(sd)) == {"emb_proj"}  # the rule guesses wrong here...
    assert set(select_tables(sd, model=odd)) == {"user"}  # ...the model is exact
    assert set(select_tables(sd, tables=["user.weight"])) == {"user"}
    import_checkpoint(tmp_path / "s", sd, model=Odd())
    fresh = Odd()
    with cnrstore.open(tmp_path / "s") as store:
        Checkpointer(store, fresh).restore()
    assert_same(state(fresh), sd)
    with pytest.raises(InvalidArgument, match="missing keys"):
        select_tables({k: v for k, v in sd.items() if k != "emb_proj.bias"}, model=odd)
    with pytest.raises(InvalidArgument, match="unexpected keys"):
        select_tables({**sd, "extra": torch.zeros(1)}, model=odd)
    with pytest.raises(InvalidArgument, match="shape"):
        select_tables({**sd, "user.weight": torch.zeros(31, 4)}, model=odd)


def test_the_default_rule_and_table_patterns():
    sd = {"weight": torch.zeros(10, 2), "sparse.t0.weight": torch.zeros(100_000, 2),
          "mlp.0.weight": torch.zeros(512, 13), "mlp.0.bias": torch.zeros(512),
          "emb.ids": torch.zeros(10, 2, dtype=torch.int64)}
    assert select_tables(sd) == {"sparse.t0": ["sparse.t0.weight"]}  # tall enough, whatever its name
    assert select_tables(sd, min_rows=500) == {"sparse.t0": ["sparse.t0.weight"], "mlp.0": ["mlp.0.weight"]}
    assert select_tables(sd, tables="weight") == {"embedding": ["weight"]}
    assert set(select_tables(sd, tables=["*.t0.weight", "weight"])) == {"sparse.t0", "embedding"}
    with pytest.raises(InvalidArgument, match="matches no key"):
        select_tables(sd, tables=["emb.*.weight"])
    with pytest.raises(InvalidArgument, match="cannot be an embedding"):
        select_tables(sd, tables=["mlp.0.*"])
    with pytest.raises(InvalidArgument, match="min_rows"):
        select_tables(sd, min_rows=0)


def test_a_bare_weight_is_the_embedding_table_of_a_model_that_is_one(tmp_path):
    emb = nn.Embedding(40, 3)
    report = import_checkpoint(tmp_path / "s", state(emb), tables="weight")
    assert list(report.tables) == ["embedding"]
    fresh = nn.Embedding(40, 3)
    with cnrstore.open(tmp_path / "s") as store:
        Checkpointer(store, fresh).restore()
    assert torch.equal(fresh.weight, emb.weight)


def test_errors_are_typed_and_leave_no_store_behind(trained, tmp_path):
    _, _, sd_a = trained
    new = tmp_path / "new"
    with pytest.raises(InvalidArgument, match="codec"):
        import_checkpoint(new, sd_a, codec="int9")
    with pytest.raises(InvalidArgument, match="not tables"):
        import_checkpoint(new, sd_a, codecs={"emb.0": "int4"})
    with pytest.raises(InvalidArgument, match="does not exist"):
        import_checkpoint(new, tmp_path / "missing.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(InvalidArgument, match="not a model state dict"):
        import_checkpoint(new, tmp_path / "list.pt")
    torch.save({"tables": {"a": torch.zeros(2, 2)}, "dense": {}}, tmp_path / "nested.pt")
    with pytest.raises(InvalidArgument, match="nested"):  # (a nested export is taken back as it is:
        import_checkpoint(new, tmp_path / "nested.pt", tables=["a"])  # tests/test_export_keyed.py)
    save_file({"tables/user": torch.zeros(4, 2), "keyed/k/values": torch.zeros(3)}, str(tmp_path / "nested.st"))
    with pytest.raises(InvalidArgument, match="no keyed table"):
        import_checkpoint(new, tmp_path / "nested.st")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(InvalidArgument, match="cannot read"):
        import_checkpoint(new, tmp_path / "junk.pt")
    with pytest.raises(InvalidArgument, match="needs model"):
        import_checkpoint(new, sd_a, optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1))
    bad = dict(sd_a)
    bad["emb_l.1.weight"] = sd_a["emb_l.1.weight"].clone()
    bad["emb_l.1.weight"][5, 2] = float("nan")
    with pytest.raises(InvalidArgument, match="emb_l.1"):  # the store refuses the row; the import is undone
        import_checkpoint(new, bad)
    assert not os.path.exists(new)
    import_checkpoint(new, sd_a)
    with pytest.raises(InvalidArgument, match="new store"):
        import_checkpoint(new, sd_a)


def test_a_misfiled_tensor_makes_restore_fail_loudly(tmp_path):
    class Small(nn.Module):  # a 10-row table whose name does not say "emb": the rule makes it dense
        def __init__(self):
            super().__init__()
            self.cat = nn.Embedding(10, 2)

    import_checkpoint(tmp_path / "s", state(Small()))
    with cnrstore.open(tmp_path / "s") as store:
        with pytest.raises(InvalidArgument, match=r"no table\(s\) \['cat'\]"):
            Checkpointer(store, Small()).restore()


def test_parse_table_codecs_for_the_cli():
    assert parse_table_codecs(["emb.0=int8", "a=b=fp16"]) == {"emb.0": "int8", "a=b": "fp16"}
    assert parse_table_codecs(None) == {}
    for bad, match in ((["emb.0"], "NAME=CODEC"), (["=int8"], "NAME=CODEC"), (["x=int8", "x=int4"], "twice"),
                       (["x=int9"], "int9")):
        with pytest.raises(InvalidArgument, match=match):
            parse_table_codecs(bad)


# --- issue 21, fault 8: a checkpoint-layout file imports with its optimizer and extra state -----------------
def _restore_all(path):
    """Model state, Adagrad state (per parameter name) and extra state after a Checkpointer restore of the
    store at ``path`` into fresh objects."""
    model = DLRM(seed=9)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    extra = Position()
    with cnrstore.open(path, readonly=True) as store:
        info = Checkpointer(store, model, opt, extra={"loader": extra}).restore()
    names = {p: n for n, p in model.named_parameters()}
    optim = {names[p]: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    return state(model), optim, extra.pos, (info.step, info.meta), opt.state_dict()["param_groups"]


@pytest.mark.parametrize("via", ["api", "cli"])
def test_checkpoint_layout_export_imports_with_its_optimizer_state_bit_exactly(tmp_path, capsys, via):
    """Fault 8 of issue 21: `cnrstore import` of an `export --layout checkpoint` file imported the model and
    dropped the optimizers, extra state and step; a restore then succeeded with Adagrad's accumulators at
    zero. Now the round trip export -> import -> restore equals the restore of the original store, row-wise
    optimizer state (tables `<table>.optim.sum`) included, bit for bit."""
    from cnrstore import cli

    model = DLRM()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with cnrstore.open(tmp_path / "orig", create=True) as store:
        ck = Checkpointer(store, model, opt, codec="fp32", extra={"loader": Position(17)})
        train(model, opt, 3)
        ck.save(step=30, meta={"epoch": 2}).wait()
        ck.close()
    export_path(tmp_path / "orig", "torch", tmp_path / "ck.pt", layout="checkpoint")
    if via == "api":
        report = import_checkpoint(tmp_path / "s", tmp_path / "ck.pt")
        assert report.optimizers == 1 and report.extra == ("loader",) and report.step == 30 and not report.ignored
    else:
        assert cli.main(["import", str(tmp_path / "s"), str(tmp_path / "ck.pt")]) == 0
        out = capsys.readouterr().out
        assert "the state of 1 optimizer(s) (2 row-wise state table(s)), extra state loader" in out, out
    with cnrstore.open(tmp_path / "s", readonly=True) as store:
        assert {"emb_l.0.optim.sum", "emb_l.1.optim.sum"} <= set(store.tables())
    want, got = _restore_all(tmp_path / "orig"), _restore_all(tmp_path / "s")
    assert_same(got[0], want[0])
    assert set(got[1]) == set(want[1]) == {n for n, _ in model.named_parameters()}
    for name in want[1]:
        assert_same(got[1][name], want[1][name])
    assert torch.count_nonzero(got[1]["emb_l.0.weight"]["sum"]) > 0  # not fresh accumulators
    assert got[2:] == want[2:] == (17, (30, {"epoch": 2}), want[4])
    # a Checkpointer without the optimizer cannot take it silently
    with cnrstore.open(tmp_path / "s", readonly=True) as store:
        with pytest.raises(InvalidArgument, match="1 optimizer"):
            Checkpointer(store, DLRM(seed=3), extra={"loader": Position()}).restore()


# --- issue 21, fault 9: a malformed source is a typed error with one line, and leaves nothing ----------------
def _dcp(sd, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path


def _malformed(kind, tmp_path, sd):
    """A source of ``kind`` and the words its error must say."""
    if kind == "dcp truncated data file":
        d = _dcp(sd, tmp_path / "d")
        data = next(p for p in d.iterdir() if p.suffix == ".distcp")
        os.truncate(data, data.stat().st_size // 3)
        return d, "cannot read .* as a dcp checkpoint"
    if kind == "dcp garbage .metadata":
        d = _dcp(sd, tmp_path / "d")
        (d / ".metadata").write_bytes(b"\x80garbage" * 20)
        return d, "cannot read .* as a dcp checkpoint"
    if kind == "truncated torch zip":
        torch.save(sd, tmp_path / "t.pt")
        os.truncate(tmp_path / "t.pt", (tmp_path / "t.pt").stat().st_size // 2)
        return tmp_path / "t.pt", "cannot read .* as a torch checkpoint .*truncated"
    if kind == "safetensors bad header":
        header = b'{"emb.0.weight": {"dtype": "F32", "shape": [4'  # cut short, then garbage
        (tmp_path / "b.st").write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 64)
        return tmp_path / "b.st", "cannot read .* as a safetensors checkpoint"
    if kind == "sparse weight in a file":
        torch.save({**sd, "emb_l.0.weight": sd["emb_l.0.weight"].to_sparse()}, tmp_path / "sp.pt")
        return tmp_path / "sp.pt", r"'emb_l.0.weight' is a sparse tensor .*to_dense\(\)"
    if kind == "sparse dense tensor in memory":
        return {**sd, "top.weight": sd["top.weight"].to_sparse_csr()}, "'top.weight' is a sparse tensor"
    if kind == "quantized tensor":
        q = torch.quantize_per_tensor(sd["top.weight"], 0.1, 0, torch.qint8)
        return {**sd, "top.weight": q}, r"quantized .*dequantize\(\)"
    if kind == "non-tensor values":
        torch.save({"model": {**sd, "note": "hello", "n": 3}}, tmp_path / "n.pt")
        return tmp_path / "n.pt", "not tensors: note \\(str\\), n \\(int\\)"
    if kind == "non-string keys":
        return {**sd, 7: torch.zeros(1)}, "not strings"
    if kind == "complex table":
        return {**sd, "emb_l.1.weight": sd["emb_l.1.weight"].to(torch.complex64)}, \
            "'emb_l.1.weight' is named like an embedding table but has dtype torch.complex64"
    if kind == "int table":
        return {**sd, "emb_l.1.weight": sd["emb_l.1.weight"].to(torch.int64)}, \
            "'emb_l.1.weight' is named like an embedding table but has dtype torch.int64"
    if kind == "float8 dense":
        return {**sd, "top.weight": sd["top.weight"].to(torch.float8_e4m3fn)}, "cannot hold exactly"
    if kind == "infinite row":
        w = sd["emb_l.0.weight"].clone()
        w[7, 1] = float("inf")
        return {**sd, "emb_l.0.weight": w}, "table 'emb_l.0'.*row 7 is not finite"
    raise AssertionError(kind)


MALFORMED = ["dcp truncated data file", "dcp garbage .metadata", "truncated torch zip", "safetensors bad header",
             "sparse weight in a file", "sparse dense tensor in memory", "quantized tensor", "non-tensor values",
             "non-string keys", "complex table", "int table", "float8 dense", "infinite row"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's notes on sparse CSR and quantized tensors
@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_source_is_an_invalid_argument_in_one_line_and_changes_nothing(trained, tmp_path, kind):
    """Fault 9 of issue 21: a DCP directory with a truncated data file or a garbage .metadata raised torch's
    CheckpointException (a BaseException: a 40-60 line traceback from the CLI), a sparse weight a bare
    RuntimeError. Each malformed source is now InvalidArgument with one line naming what to fix, raised
    before the store is touched: a new path is not created, an existing empty store gains no table."""
    _, _, sd_a = trained
    source, words = _malformed(kind, tmp_path, sd_a)
    with pytest.raises(InvalidArgument, match=words) as info:
        import_checkpoint(tmp_path / "new", source)
    assert len(str(info.value).splitlines()) == 1, str(info.value)
    assert not os.path.exists(tmp_path / "new")
    with cnrstore.open(tmp_path / "empty", create=True) as store:
        with pytest.raises(InvalidArgument, match=words):
            import_checkpoint(store, source)
        assert store.tables() == {} and store.versions() == []
    (tmp_path / "dir").mkdir()  # an existing directory that is no store: left as it was
    with pytest.raises(InvalidArgument, match=words):
        import_checkpoint(tmp_path / "dir", source)
    assert os.listdir(tmp_path / "dir") == []


def test_a_failed_write_removes_what_the_import_created_in_an_existing_directory(trained, tmp_path, monkeypatch):
    """A failure after the checks (here the dense write) aborts the version; the store files the import made
    inside an existing empty directory are removed again."""
    from cnrstore.engine import writer

    _, _, sd_a = trained

    def full(self, name, array):
        raise cnrstore.StorageFull("no space left (test)")

    monkeypatch.setattr(writer.CheckpointWriter, "put_dense", full)
    (tmp_path / "dir").mkdir()
    with pytest.raises(cnrstore.StorageFull):
        import_checkpoint(tmp_path / "dir", sd_a)
    assert os.listdir(tmp_path / "dir") == []
