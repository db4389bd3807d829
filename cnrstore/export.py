"""Export one version to a file other tools read: npz (numpy), safetensors, or torch.

Tables are exported as fp32 arrays named ``tables/<name>`` and dense arrays as ``dense/<name>``
(npz and safetensors); the torch file holds a dict (see cnrstore/torch/export.py).
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgument
from .types import Snapshot

FORMATS = ("torch", "safetensors", "npz")


def export(snapshot: Snapshot, fmt: str, path: str) -> None:
    """Write ``snapshot`` to ``path`` in format ``fmt`` (one of FORMATS)."""
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "torch":
        from .torch.export import save

        save(snapshot, path)
        return
    arrays = {f"tables/{name}": arr for name, arr in snapshot.tables.items()}
    arrays.update({f"dense/{name}": np.ascontiguousarray(arr) for name, arr in snapshot.dense.items()})
    if fmt == "npz":
        with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a bare path
            np.savez(f, **arrays)
        return
    try:
        from safetensors.numpy import save_file
    except ImportError as exc:
        raise InvalidArgument("export to safetensors needs the safetensors package: "
                              "pip install 'cnrstore[export]'") from exc
    meta = {"version": str(snapshot.version), "step": str(snapshot.step)}
    save_file(arrays, path, metadata=meta)
