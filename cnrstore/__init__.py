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
from .marker import FORMAT_VERSION
from .store import Store, open
from .repair import RepairReport, repair
from .types import Snapshot, TableInfo, VerifyReport, VersionInfo
from .writer import CheckpointWriter

__version__ = "0.1.0"

__all__ = [
    "open", "repair", "RepairReport", "Store", "CheckpointWriter", "TableInfo", "VersionInfo", "Snapshot", "VerifyReport",
    "FORMAT_VERSION", "codecs", "errors",
    "CnrError", "StoreNotFound", "StoreLocked", "InvalidArgument", "VersionNotFound", "TableNotFound",
    "MissingRows", "CorruptionError", "FormatVersionError", "StorageFull", "StoreClosed", "ReadOnlyError",
    "CheckpointInProgress", "GlobalCommitError", "IndexDamaged", "StorageIOError", "IndexBusy", "CompactionFailed",
    "ExportFailed", "PermissionDenied", "StoreMoved", "UnsafePayload", "SaveSkipped",
]
