"""cnrstore — an embedded, log-structured checkpoint store for DLRM training (Check-N-Run).

    import cnrstore
    with cnrstore.open("ckpt", create=True) as store:
        store.create_table("emb", num_rows=1_000_000, dim=64, codec="int4")
        with store.checkpoint(step=100) as ck:
            ck.put_rows("emb", rows, values)
        store.read_rows("emb", [1, 2, 3], version=ck.version)

docs/API.md is the contract; docs/DESIGN.md the architecture; docs/FORMAT.md the bytes on disk.
Importing cnrstore does not import torch (only ``cnrstore.torch``, ``cnrstore.distributed`` and encoding with
the FBGEMM-backed codecs do; see ``cnrstore/codecs/rowwise.py``).
"""

import importlib
import sys

from . import codecs, errors
from .errors import (
    CheckpointInProgress,
    CnrError,
    CompactionFailed,
    CorruptionError,
    ExportFailed,
    IndexBusy,
    FormatVersionError,
    GlobalCommitError,
    IndexDamaged,
    InvalidArgument,
    MissingRows,
    PermissionDenied,
    ReadOnlyError,
    RemoteConflict,
    RemoteObjectMissing,
    RemoteStorageError,
    RemoteTakenOver,
    SaveSkipped,
    StorageFull,
    StorageIOError,
    StoreClosed,
    StoreLocked,
    StoreMoved,
    StoreNotFound,
    TableNotFound,
    UnsafePayload,
    VersionNotFound,
)
from .engine.marker import FORMAT_VERSION
from .store import Store, open
from .maintenance.repair import RepairReport, repair
from .types import Snapshot, TableInfo, VerifyReport, VersionInfo
from .engine.writer import CheckpointWriter

__version__ = "0.1.0"

#: Module paths from before the layout by layer (issue 22) -> where each module lives now. The old path
#: names the same module object (``import cnrstore.compaction``, ``from cnrstore import verify`` and
#: ``monkeypatch.setattr("cnrstore.reader....")`` keep working); new code uses the new path.
MOVED_MODULES = {
    **{m: f"engine.{m}" for m in ("record", "blocks", "segments", "storage", "fs", "lock", "marker",
                                   "filenames", "msgpack_safe", "index", "schema", "version_edit", "reader",
                                   "merge", "writer", "opening")},
    "rowrecords": "engine.block_records",
    "validate": "engine.arguments",
    **{m: f"maintenance.{m}" for m in ("liveness", "compaction", "background", "repair", "verify")},
}


def _alias_moved_modules() -> None:
    for old, new in MOVED_MODULES.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules[f"{__name__}.{old}"] = module
        globals().setdefault(old, module)  # ``cnrstore.repair`` stays the function


_alias_moved_modules()

__all__ = [
    "open", "repair", "RepairReport", "Store", "CheckpointWriter", "TableInfo", "VersionInfo", "Snapshot", "VerifyReport",
    "FORMAT_VERSION", "codecs", "errors",
    "CnrError", "StoreNotFound", "StoreLocked", "InvalidArgument", "VersionNotFound", "TableNotFound",
    "MissingRows", "CorruptionError", "FormatVersionError", "StorageFull", "StoreClosed", "ReadOnlyError",
    "CheckpointInProgress", "GlobalCommitError", "IndexDamaged", "StorageIOError", "IndexBusy", "CompactionFailed",
    "ExportFailed", "PermissionDenied", "StoreMoved", "UnsafePayload", "SaveSkipped", "RemoteStorageError",
    "RemoteObjectMissing", "RemoteConflict", "RemoteTakenOver",
]
