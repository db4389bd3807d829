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
        for v in store.versions():
            for name in store.tables():
                expected[f"v{v.version}/{name}"] = store.read_table(name, v.version)
            expected[f"v{v.version}/dense"] = store.read_dense("dense", v.version)
    os.remove(os.path.join(store_path, "LOCK"))
    os.remove(os.path.join(store_path, "index", "lock.mdb"))
    np.savez(os.path.join(root, "expected.npz"), **expected)
    print(f"wrote {root}")


if __name__ == "__main__":
    main()
