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
import importlib.abc
import importlib.util
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
    RemoteLagging,
    SaveRefused,
    SaveSkipped,
    SaveSuperseded,
    StorageFull,
    StorageIOError,
    StoreClosed,
    StoreLocked,
    StoreMoved,
    StoreNotFound,
    TableNotFound,
    UnsafePayload,
    VersionNotFound,
    VersionNotRetained,
)
from .engine.marker import FORMAT_VERSION
from .lazy import lazy_names
from .options import Options
from .store import Store, open
from .types import Snapshot, TableInfo, VerifyReport, VersionInfo
from .engine.changes import EncodedRows, TableChanges
from .engine.writer import CheckpointWriter

__version__ = "0.1.0"

#: Module paths from before the layout by layer -> where each module lives now. The old path
#: names the same module object (``import cnrstore.compaction``, ``from cnrstore import verify`` and
#: ``monkeypatch.setattr("cnrstore.reader....")`` keep working), imported on first use; new code uses the
#: new path. ``cnrstore.repair`` is the function only (the module is ``cnrstore.maintenance.repair``).
MOVED_MODULES = {
    **{m: f"engine.{m}" for m in ("record", "blocks", "segments", "storage", "fs", "lock", "marker",
                                   "filenames", "msgpack_safe", "index", "schema", "version_edit", "reader",
                                   "merge", "writer", "opening")},
    "rowrecords": "engine.block_records",
    "validate": "engine.arguments",
    **{m: f"maintenance.{m}" for m in ("liveness", "compaction", "background", "verify")},
}


class _MovedModule(importlib.abc.Loader):
    """Loads an old module path as the moved module itself (the import system keeps what ``exec_module``
    leaves in ``sys.modules`` under the name)."""

    def __init__(self, target: str):
        self.target = target

    def exec_module(self, module) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _MovedModules(importlib.abc.MetaPathFinder):
    """``import cnrstore.<old path>`` (MOVED_MODULES) finds the moved module."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package != __name__ or old not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModule(f"{__name__}.{MOVED_MODULES[old]}"))


sys.meta_path.append(_MovedModules())


#: Names imported on first use (a trainer's start-up does not pay for them): name -> its module
_LAZY = {"repair": "maintenance.repair", "RepairReport": "maintenance.repair"}
_lazy_getattr = lazy_names(__name__, _LAZY, globals())


def __getattr__(name: str):
    """``cnrstore.<old path>`` as an attribute (``from cnrstore import verify``): the moved module; and the
    names of ``_LAZY``."""
    if name in MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _lazy_getattr(name)

__all__ = [
    "open", "Options", "repair", "RepairReport", "Store", "CheckpointWriter", "TableInfo", "VersionInfo", "Snapshot", "VerifyReport",
    "TableChanges", "EncodedRows",
    "FORMAT_VERSION", "codecs", "errors",
    "CnrError", "StoreNotFound", "StoreLocked", "InvalidArgument", "VersionNotFound", "VersionNotRetained", "TableNotFound",
    "MissingRows", "CorruptionError", "FormatVersionError", "StorageFull", "StoreClosed", "ReadOnlyError",
    "CheckpointInProgress", "GlobalCommitError", "IndexDamaged", "StorageIOError", "IndexBusy", "CompactionFailed",
    "ExportFailed", "PermissionDenied", "StoreMoved", "UnsafePayload", "SaveSkipped", "SaveRefused", "SaveSuperseded",
    "RemoteStorageError",
    "RemoteObjectMissing", "RemoteConflict", "RemoteTakenOver", "RemoteLagging",
]
