"""Managed-collision buffers as keyed rows (cnrstore/torch/mc_buffers.py): TorchRec MCH and MPZCH states
split into keyed rows and a tail, compared save to save, and rebuilt bit for bit."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cnrstore.torch import mc_buffers as kb  # noqa: E402


def _mch_state(rng, size=16, n=10, prefix="m."):
    ids = np.full(size, kb.MCH_EMPTY, np.int64)
    ids[:n] = np.sort(rng.choice(1 << 40, n, replace=False))
    return {prefix + kb.MCH_IDS: ids, prefix + kb.MCH_MAPPING: rng.permutation(size).astype(np.int64),
            prefix + "_mch_counts": rng.integers(0, 9, size), prefix + "_mch_last_access_iter": rng.integers(0, 9, size),
            prefix + "_output_segments_tensor": np.arange(5)}


def test_an_mch_state_round_trips_and_its_delta_is_the_changed_ids():
    rng = np.random.default_rng(0)
    state = _mch_state(rng)
    (g,) = kb.find_groups(state)
    assert g.kind == "mch" and g.table() == "m.keyed" and "_output_segments_tensor" not in g.names
    keys, cols, tail = kb.group_rows(g, state)
    assert keys.size == 10 and tail[kb.MCH_IDS].size == 6
    back = kb.rebuild(g, keys, cols, tail, state)
    for k in g.keys_of(state):
        assert np.array_equal(back[k], state[k]) and back[k].dtype == state[k].dtype
    # an admission (a smaller id shifts every position), a touch and an eviction
    new = dict(state)
    ids = state["m." + kb.MCH_IDS][:10].copy()
    counts = state["m._mch_counts"].copy()
    counts[3] += 1  # the id at position 3 touched
    gone = ids[7]
    kept = np.delete(np.arange(10), 7)
    order = np.argsort(np.concatenate([ids[kept], [5]]))
    new_ids = np.concatenate([ids[kept], [5]])[order]
    new["m." + kb.MCH_IDS] = np.concatenate([new_ids, state["m." + kb.MCH_IDS][10:]])
    for name, src in (("_mch_counts", counts), ("_mch_last_access_iter", state["m._mch_last_access_iter"]),
                      (kb.MCH_MAPPING, state["m." + kb.MCH_MAPPING])):
        new["m." + name] = np.concatenate([np.concatenate([src[:10][kept], [0]])[order], src[10:]])
    k2, c2, t2 = kb.group_rows(g, new)
    changed, deleted = kb.delta((keys, cols), k2, c2)
    assert sorted(k2[changed].tolist()) == sorted([5, int(ids[3])]) and deleted.tolist() == [gone]


def test_an_mpzch_state_is_keyed_by_slot():
    rng = np.random.default_rng(1)
    ident = np.full((8, 1), -1, np.int64)
    ident[[1, 4]] = [[77], [1 << 45]]
    state = {"z._hash_zch_identities": ident, "z._hash_zch_metadata": rng.integers(0, 5, (8, 1)).astype(np.int32)}
    (g,) = kb.find_groups(state)
    assert g.kind == "zch"
    keys, cols, tail = kb.group_rows(g, state)
    back = kb.rebuild(g, keys, cols, tail, state)
    assert all(np.array_equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in g.keys_of(state))
    ident2 = ident.copy()
    ident2[4] = -1  # evicted
    ident2[6] = 9  # admitted
    k2, c2, _ = kb.group_rows(g, {**state, "z._hash_zch_identities": ident2})
    changed, deleted = kb.delta((keys, cols), k2, c2)
    assert changed.tolist() == [4, 6] and deleted.size == 0


def test_real_torchrec_mch_buffers_are_found():
    mc = pytest.importorskip("torchrec.modules.mc_modules")
    m = mc.MCHManagedCollisionModule(zch_size=32, device=torch.device("cpu"), eviction_interval=2,
                                     input_hash_size=2 ** 40, eviction_policy=mc.DistanceLFU_EvictionPolicy())
    state = {k: v.numpy() for k, v in m.state_dict().items()}
    (g,) = kb.find_groups(state)
    assert g.kind == "mch" and set(g.names) >= {kb.MCH_IDS, kb.MCH_MAPPING, "_mch_counts", "_mch_last_access_iter"}
    keys, _cols, tail = kb.group_rows(g, state)
    assert keys.size == 0 and tail[kb.MCH_IDS].size == 32
