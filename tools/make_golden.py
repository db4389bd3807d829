"""Write the golden store of the current format version under tests/data/format<N>/ (run once per format).

The store holds one table per codec, two versions (a baseline and an increment), dense arrays and meta;
from format 3 on, two more increments, the second of which is written as cumulative deltas.
Beside it, expected.npz holds what each version must read as, decoded when the store was written, so
tests/test_golden.py fails if a later cnrstore reads the old bytes differently.
"""

import argparse
import os
import shutil

import numpy as np

import cnrstore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data"))
    args = parser.parse_args()
    root = os.path.join(args.out, f"format{cnrstore.FORMAT_VERSION}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    store_path = os.path.join(root, "store")
    rng = np.random.default_rng(20261121)
    expected = {}
    with cnrstore.open(store_path, create=True) as store:
        for codec in ("fp32", "fp16", "int8", "int4", "int2"):
            store.create_table(f"t_{codec}", num_rows=100, dim=7, codec=codec, block_rows=32)
        dense = np.arange(12, dtype=np.int64).reshape(3, 4)
        with store.checkpoint(step=10, meta={"loader_pos": 5}) as ck:
            for name in store.tables():
                ck.put_rows(name, np.arange(100), rng.standard_normal((100, 7)).astype(np.float32))
            ck.put_dense("dense", dense)
        with store.checkpoint(step=20, meta={"loader_pos": 9}) as ck:
            rows = np.array([0, 5, 31, 32, 99])
            for name in store.tables():
                ck.put_rows(name, rows, rng.standard_normal((rows.size, 7)).astype(np.float32) * 3)
            ck.put_dense("dense", dense * 2)
        if cnrstore.FORMAT_VERSION >= 3:  # a chain of three at version 3, so version 4 writes deltas
            for step, rows in ((30, np.array([1, 6, 33])), (40, np.array([2, 5, 64]))):
                with store.checkpoint(step=step, meta={"loader_pos": step // 2}) as ck:
                    for name in store.tables():
                        ck.put_rows(name, rows, rng.standard_normal((rows.size, 7)).astype(np.float32))
        if cnrstore.FORMAT_VERSION >= 4:  # a keyed table: puts and evictions at each version, a chain of runs
            store.create_table("k_fp16", dim=5, keyed=True, partitions=3, codec="fp16",
                               columns={"score": "float32", "last": ("int64", 2)})
            live = np.zeros(0, np.int64)
            for i, v in enumerate(store.versions()):
                with store.checkpoint(step=100 + i) as ck:
                    new = rng.integers(-(1 << 50), 1 << 50, 20)
                    ck.put_keys("k_fp16", new, rng.standard_normal((20, 5)).astype(np.float32),
                                columns={"score": rng.random(20).astype(np.float32),
                                         "last": rng.integers(0, 1000, (20, 2))})
                    if live.size:
                        ck.delete_keys("k_fp16", live[:3])
                    live = np.setdiff1d(np.union1d(live, new), live[:3])
        for v in store.versions():
            for name, info in store.tables().items():
                if info.keyed:
                    if v.version >= 5:
                        got = store.read_keyed(name, v.version)
                        expected[f"v{v.version}/keyed:{name}:keys"] = got.keys
                        expected[f"v{v.version}/keyed:{name}:values"] = got.values
                        for col, arr in got.columns.items():
                            expected[f"v{v.version}/keyed:{name}:col:{col}"] = arr
                    continue
                if v.version >= 5:
                    continue  # (the positional tables were not written after version 4)
                expected[f"v{v.version}/{name}"] = store.read_table(name, v.version)
            if v.version <= 4:
                expected[f"v{v.version}/dense"] = store.read_dense("dense", v.version)
    os.remove(os.path.join(store_path, "LOCK"))
    os.remove(os.path.join(store_path, "index", "lock.mdb"))
    np.savez(os.path.join(root, "expected.npz"), **expected)
    print(f"wrote {root}")


if __name__ == "__main__":
    main()
