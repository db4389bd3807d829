"""cnrstore/torch/payload.py and docs/FORMAT.md "Trainer payload": what a Checkpointer's version holds,
name by name and byte by byte as the document says (its example is the model below). Mutated payloads
are test_fuzz_parsers.py's, pickles naming code test_security.py's."""

from __future__ import annotations

import io
import os
import re
import zipfile

import numpy as np
import pytest
import torch

import cnrstore
from cnrstore.errors import InvalidArgument
from cnrstore.torch import Checkpointer, payload

FORMAT_MD = os.path.join(os.path.dirname(__file__), "..", "docs", "FORMAT.md")


class Model(torch.nn.Module):
    """FORMAT.md's example: an embedding and a bfloat16 linear layer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4, 2)
        self.lin = torch.nn.Linear(2, 1, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with cnrstore.open(tmp_path_factory.mktemp("p") / "s", create=True) as store:
        with Checkpointer(store, model, opt, codec="fp32") as ck:
            model.emb(torch.tensor([1, 2])).sum().backward()
            opt.step()
            ck.save(step=1).wait()
        yield store, model, opt


def test_the_constants_are_the_names_format_md_gives():
    doc = open(FORMAT_MD).read()
    assert (payload.STATE_BLOB, payload.DENSE_PREFIX, payload.PAYLOAD_FORMAT) == ("torch.state", "torch.model/", 2)
    assert (payload.ROW_MARK, payload.LIVE_MARK) == ("__cnrstore_row_state__", "__cnrstore_sharded_state__")
    for name in (payload.STATE_BLOB, payload.DENSE_PREFIX, payload.ROW_MARK, payload.LIVE_MARK):
        assert f"`{name}" in doc or f'"{name}"' in doc, name


def test_a_version_holds_the_tables_and_dense_records_format_md_lists(saved):
    store, model, _opt = saved
    tables = store.tables()
    assert {n: (t.num_rows, t.dim, t.codec) for n, t in tables.items()} == {
        "emb": (4, 2, "fp32"), "emb.optim.sum": (4, 2, "fp32")}
    weight = store.read_dense("torch.model/lin.weight")
    assert weight.dtype == np.dtype("<i2") and weight.shape == (1, 2)       # bfloat16 as its raw 16 bits
    assert torch.equal(torch.from_numpy(weight).view(torch.bfloat16), model.lin.weight.detach())
    assert store.read_dense("torch.model/lin.bias").shape == (1,)
    blob = store.read_dense(payload.STATE_BLOB)
    assert blob.dtype == np.uint8 and blob.ndim == 1


def test_the_blob_is_a_torch_save_zip_of_a_protocol_2_pickle_and_raw_storages(saved):
    store, _model, _opt = saved
    z = zipfile.ZipFile(io.BytesIO(store.read_dense(payload.STATE_BLOB).tobytes()))
    names = z.namelist()
    root = names[0].split("/")[0]
    assert all(n.startswith(root + "/") for n in names)
    assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    assert z.read(f"{root}/data.pkl")[:2] == b"\x80\x02" and z.read(f"{root}/byteorder") == b"little"
    storages = sorted(n for n in names if re.fullmatch(rf"{root}/data/\d+", n))
    assert len(storages) == 5          # the three steps and lin's two bfloat16 sums (FORMAT.md's example)


def test_the_payload_reads_as_format_md_s_example(saved):
    store, _model, _opt = saved
    p = payload.decode(store.read_dense(payload.STATE_BLOB), 1)
    assert (p["format"], p["mode"], p["tables"], p["extra"]) == (2, "incremental", ["emb"], {})
    assert p["optimizer_types"] == ["torch.optim.adagrad.Adagrad"]
    assert p["dense_dtypes"] == {"lin.weight": "bfloat16", "lin.bias": "bfloat16"}
    assert p["param_names"] == [["emb.weight", "lin.weight", "lin.bias"]]
    (opt,) = p["optimizers"]
    assert opt["param_groups"][0]["params"] == [0, 1, 2]
    assert opt["state"][0]["sum"] == {payload.ROW_MARK: "emb.optim.sum", "dtype": "float32", "shape": (4, 2)}
    assert opt["state"][1]["sum"].dtype == torch.bfloat16               # dense state stays in the pickle
    assert torch.equal(opt["state"][0]["step"], torch.tensor(1.0))


def test_build_marks_row_wise_and_sharded_state_and_encode_refuses_code():
    weight = torch.nn.Parameter(torch.zeros(3, 2))
    other = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adagrad([weight, other])
    opt.state[weight]["sum"] = torch.ones(3, 2)
    opt.state[other]["sum"] = torch.ones(2)

    class ShardedTensor:       # stands for torch.distributed's (is_sharded_value goes by the type's name)
        dtype = torch.float32
    opt.state[other]["live"] = ShardedTensor()
    p = payload.build(mode="incremental", tables=["w"], dense={}, optimizers=[opt], extra={},
                      param_names={id(weight): "w.weight"}, row_tables={id(weight): ("w", {"sum"})})
    state = p["optimizers"][0]["state"]
    assert state[0]["sum"] == {payload.ROW_MARK: "w.optim.sum", "dtype": "float32", "shape": (3, 2)}
    assert torch.equal(state[1]["sum"], torch.ones(2)) and state[1]["live"] == {payload.LIVE_MARK: True}
    assert p["param_names"] == [["w.weight", None]]
    blob = payload.encode(p)
    assert payload.decode(blob, 1)["optimizers"][0]["state"][0]["sum"][payload.ROW_MARK] == "w.optim.sum"
    with pytest.raises(InvalidArgument, match="add_safe_globals"):
        payload.encode({**p, "extra": {"x": {"f": object()}}})
