"""Write a restored version as a file ``torch.load`` reads: {"tables": {...}, "dense": {...}, "meta": ...}."""

from __future__ import annotations

import torch

from ..types import Snapshot


def save(snapshot: Snapshot, path) -> None:
    """Save every table (fp32 tensors) and dense array of ``snapshot`` to ``path`` (a path or a binary file
    object) with ``torch.save``."""
    torch.save(
        {
            "version": snapshot.version,
            "step": snapshot.step,
            "meta": snapshot.meta,
            "tables": {name: torch.from_numpy(arr) for name, arr in snapshot.tables.items()},
            "dense": {name: torch.from_numpy(arr.copy()) for name, arr in snapshot.dense.items()},
        },
        path,
    )
