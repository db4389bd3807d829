"""Export one version to a file other tools read: npz (numpy), safetensors, or torch.

Tables are exported as fp32 arrays named ``tables/<name>`` and dense arrays as ``dense/<name>``
(npz and safetensors); the torch file holds a dict (see cnrstore/torch/export.py).

The file appears atomically: it is written to a temporary file beside ``path`` and renamed over it, so a
failed export (disk full, I/O error, interrupted) leaves no truncated file and an older file at ``path``
unchanged. Every failure is a typed error (see :func:`export`).
"""

from __future__ import annotations

import errno
import os
import re

import numpy as np

from .errors import ExportFailed, InvalidArgument, StorageFull
from .types import Snapshot

FORMATS = ("torch", "safetensors", "npz")

_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                errno.ENAMETOOLONG, errno.ELOOP}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def check_path(path) -> str:
    """``path`` as a str if a file can be written there: its directory exists, is a directory and is
    writable, and ``path`` itself is not a directory. Raises InvalidArgument saying what to fix."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise InvalidArgument(f"export path must be a file path, got {path!r}") from None
    if not path or "\x00" in path:
        raise InvalidArgument(f"export path must be a non-empty file path without NUL, got {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InvalidArgument(f"export path {path!r} is a directory; name a file in it, e.g. "
                              f"{os.path.join(path, 'export.bin')!r}")
    if not os.path.exists(parent):
        raise InvalidArgument(f"cannot export to {path!r}: directory {parent!r} does not exist; create it "
                              "(mkdir -p) or choose another path")
    if not os.path.isdir(parent):
        raise InvalidArgument(f"cannot export to {path!r}: {parent!r} is not a directory; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgument(f"cannot export to {path!r}: directory {parent!r} is not writable by this user; "
                              "choose a writable directory or fix its permissions")
    return path


def _write_error(exc: BaseException, path: str) -> Exception:
    """The typed error for a failure while writing the export file to ``path``."""
    code = getattr(exc, "errno", None)
    if code is None:  # safetensors and torch report I/O errors as their own types: "... (os error 28)"
        m = re.search(r"os error (\d+)", str(exc))
        code = int(m.group(1)) if m else None
    if code in _FULL_ERRNOS:
        return StorageFull(f"export to {path!r} ran out of space ({exc}); nothing was written there. "
                           "Free space on that file system or export to another one")
    if code in _PATH_ERRNOS:
        return InvalidArgument(f"cannot write the export file {path!r} ({exc}); choose a path in an existing, "
                               "writable directory")
    return ExportFailed(f"export to {path!r} failed ({type(exc).__name__}: {exc}); nothing was written there. "
                        "Check the file system (space, permissions, errors in dmesg) and retry", path)


def export(snapshot: Snapshot, fmt: str, path) -> None:
    """Write ``snapshot`` to ``path`` in format ``fmt`` (one of FORMATS), atomically.

    Raises InvalidArgument for an unknown format or a path that cannot be written (missing or
    non-writable directory, a directory), StorageFull when the file system fills up, and ExportFailed
    for any other write failure; in every case ``path`` is left as it was.
    """
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    path = check_path(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".{os.path.basename(path)}.cnrstore-export-{os.getpid()}.tmp")
    try:
        _write(snapshot, fmt, tmp)
        os.replace(tmp, path)
    except InvalidArgument:
        _remove(tmp)
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure removes the partial file
        _remove(tmp)
        if isinstance(exc, (KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        raise _write_error(exc, path) from exc


def _remove(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _write(snapshot: Snapshot, fmt: str, path: str) -> None:
    if fmt == "torch":
        try:
            from .torch.export import save
        except ImportError as exc:
            raise InvalidArgument("export to torch needs PyTorch (pip install torch), or choose --format "
                                  "npz or safetensors") from exc

        with open(path, "wb") as f:
            save(snapshot, f)
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
