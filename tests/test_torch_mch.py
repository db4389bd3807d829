"""TorchRec managed-collision (MCH) models checkpointed by the torch Checkpointer with their remap state as
keyed rows (cnrstore/torch/mc_saves.py): each save writes the ids admitted, evicted or touched, and a
restore reproduces every buffer (slots, counts, last access, the free-slot tail) bit for bit."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")

import cnrstore  # noqa: E402
from cnrstore.torch import Checkpointer  # noqa: E402

ZCH = 64


def _model():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy, ManagedCollisionCollection,
                                             MCHManagedCollisionModule)
    torch.manual_seed(0)
    cfg = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=ZCH, feature_names=["f"])]
    ebc = EmbeddingBagCollection(tables=cfg, device=torch.device("cpu"))
    mch = MCHManagedCollisionModule(zch_size=ZCH, device=torch.device("cpu"), eviction_interval=2,
                                    input_hash_size=2 ** 40, eviction_policy=DistanceLFU_EvictionPolicy())
    mcc = ManagedCollisionCollection({"t": mch}, embedding_configs=cfg)
    model = ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=False)
    return model, torch.optim.Adagrad(model.parameters(), lr=0.1)


def _step(model, opt, i):
    from torchrec import KeyedJaggedTensor
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 40 + 8 * i, (24,), generator=g)  # new ids every step: admissions, then evictions
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.ones(24, dtype=torch.int64))
    out = model(kjt)
    out = out[0] if isinstance(out, tuple) else out
    opt.zero_grad()
    out["f"].pow(2).sum().backward()
    opt.step()


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_an_mch_model_resumes_bit_for_bit_with_its_remap_state_saved_as_changed_ids(tmp_path):
    path = str(tmp_path / "ckpt")
    model, opt = _model()
    ck = Checkpointer(path, model, opt)
    for i in range(6):
        _step(model, opt, i)
        ck.save(step=i).wait()
    want = _state(model)
    for i in range(6, 9):  # the run that was not killed
        _step(model, opt, i)
    after = _state(model)
    ck.close()

    with cnrstore.open(path, readonly=True) as s:
        tables = s.tables()
        (keyed,) = [n for n, t in tables.items() if t.keyed]
        assert not any("_mch_sorted_raw_ids" in n and not n.startswith("torch.keyed-tail/") for n in s.dense_names())
        live = s.keys(keyed)
        assert 0 < live.size <= ZCH
        vs = [v.version for v in s.versions()]
        changed = []
        for a, b in zip(vs, vs[1:]):  # a save writes the ids it changed (MCH remaps every 2 steps), not the table
            (ch,) = s.changes(a, b, [keyed])
            changed.append(ch.rows.size)
            assert ch.rows.size <= 2 * 24
        assert max(changed) > 0 and min(changed) == 0

    model2, opt2 = _model()
    ck2 = Checkpointer(path, model2, opt2)
    ck2.restore()
    got = _state(model2)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for i in range(6, 9):  # and it goes on exactly as the uninterrupted run
        _step(model2, opt2, i)
    for k, v in _state(model2).items():
        assert torch.equal(v, after[k]), k
    ck2.save(step=9).wait()  # a save after the restore: its delta is against the restored version
    ck2.close()
    with cnrstore.open(path, readonly=True) as s:
        assert s.verify().ok
