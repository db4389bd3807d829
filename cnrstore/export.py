"""Export one version to files other tools read: torch, safetensors, a DCP directory, or npz.

Two questions decide what is written: the *format* (``FORMATS``) and the *layout* (``LAYOUTS``):

- ``"state_dict"``: the model's ``state_dict()``, keyed by parameter name, for a version written by
  ``cnrstore.torch.Checkpointer``: embedding weights ``"<module path>.weight"`` (fp32, from the tables),
  every other parameter and buffer from the ``torch.model/`` dense arrays in its exact dtype (bfloat16
  included), nothing else. ``model.load_state_dict(torch.load(path))`` loads a ``torch`` export,
  ``dcp.load(model.state_dict(), checkpoint_id=path)`` a ``dcp`` one, ``safetensors.torch.load_file`` a
  ``safetensors`` one (version, step and meta in its metadata header). Optimizer state is not in it: a
  model's state dict has no room for it (``load_state_dict(strict=True)`` rejects unknown keys);
- ``"checkpoint"`` (``torch`` format only): ``{"model": <state dict as above>, "optimizers": [one
  optimizer state_dict() per optimizer the Checkpointer had, row-wise state included], "extra":
  {name: state_dict()}, "version", "step", "meta", "param_names": [per optimizer, the model's name of
  each parameter in param_groups order], "embedding_tables": [table names]}`` --
  ``opt.load_state_dict(ck["optimizers"][0])`` loads an optimizer built over the same parameters in the
  same order, and ``cnrstore import`` takes the whole file back (optimizer and extra state included);
- ``"nested"``: what the store holds, for any store (the plain key-value API has no parameter names):
  tables as fp32 arrays ``tables/<name>`` and dense arrays as stored ``dense/<name>`` (npz,
  safetensors); ``{"version", "step", "meta", "tables": {...}, "dense": {...}}`` (torch, dcp). A keyed
  table is three kinds of flat entries in every format (beside ``tables`` and ``dense`` in torch and dcp):
  ``keyed/<name>/keys`` (int64, ascending), ``keyed/<name>/values`` (float32 ``(n, dim)``) and
  ``keyed/<name>/columns/<column>`` (the column's dtype, ``(n,)`` or ``(n, width)``) and
  ``keyed/<name>/partitions`` (int64 ``(1,)``: the table's partition count): what
  ``Store.read_keyed`` gives, which ``cnrstore import`` (``cnrstore.nested_import``) reads back.
  A keyed table has no place in a state-dict or checkpoint layout (InvalidArgument: export it nested).

``layout="auto"`` (the default) is ``"state_dict"`` for a version holding the Checkpointer's state blob
(``"torch.state"``) and ``"nested"`` otherwise. The state-dict layouts, the torch and dcp formats need
PyTorch (imported only when used: ``import cnrstore`` stays torch-free).

Exports are atomic: a file is written to a temporary file beside ``path``, fsynced and moved into place;
a DCP directory is written to a temporary directory beside ``path`` and renamed to it (``path`` must not
exist, or be an empty directory). A failed export (disk full, I/O error, interrupted) leaves no partial
file and an older file at ``path`` unchanged. Every failure is a typed error (see :func:`export`).

An export never replaces anything but a regular file, and that only when asked: ``path`` may be absent;
an existing regular file is replaced only with ``overwrite=True`` (the command's ``--force``), else
InvalidArgument names the flag; a symbolic link (even to a regular file), a FIFO, a socket or a device
node is refused whatever ``overwrite`` says (an export would replace the link, or write into the pipe or
device). Without ``overwrite`` the file is moved into place with ``link(2)``, which fails if anything
appeared at ``path`` since the check (no race replaces it); with ``overwrite`` ``path`` is checked again
right before ``rename(2)``. A DCP export takes an absent path or an empty directory only (never a link,
never a non-empty directory: it would have to delete a directory tree, which it never does).

A multi-rank job's root exports as one merged model (``export_path``; ``cnrstore.distributed.export``).

What needs a wing is asked of the exporter the wing registered (:func:`register`, :func:`exporter`): the
``"torch"`` one reads the Checkpointer's layout and writes the torch-based formats, the ``"distributed"``
one merges a root's global version. This module imports neither wing; it names the module whose import
registers each (``WINGS``) and imports it the first time an export needs it.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib
import os
import re
import shutil
import stat
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .engine import filenames, fs
from .errors import ExportFailed, InvalidArgument, StorageFull
from .types import Snapshot

FORMATS = ("torch", "safetensors", "dcp", "npz")
LAYOUTS = ("state_dict", "checkpoint", "nested")
#: What ``cnrstore.torch.import_checkpoint`` reads (here, not there, so the CLI's options need no torch).
SOURCE_FORMATS = ("torch", "safetensors", "dcp", "npz")
#: Without model= or tables=, an import files a 2-D ``*.weight`` tensor this tall as an embedding table.
DEFAULT_MIN_ROWS = 100_000
#: The dense array holding ``cnrstore.torch.Checkpointer``'s state blob (``checkpointer.STATE_BLOB``; a
#: test checks the two agree). Its presence marks a version in the Checkpointer's layout.
TORCH_STATE = "torch.state"
#: The prefix of a keyed table's entries in a nested export: ``keyed/<name>/keys``, ``/values``, ``/columns/<c>``.
KEYED_PREFIX = "keyed/"
_LAYOUT_FORMATS = {"state_dict": FORMATS, "checkpoint": ("torch",), "nested": FORMATS}

_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                errno.ENAMETOOLONG, errno.ELOOP}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


#: The exporters the wings register, by name, and the module whose import registers each. ``"torch"``
#: (:class:`TorchExporter`): a version in the Checkpointer's layout read as PyTorch objects, and the
#: torch-based writers. ``"distributed"`` (:class:`RootExporter`): one merged snapshot of a multi-rank root.
WINGS = {"torch": "cnrstore.torch.export", "distributed": "cnrstore.distributed.export"}
_exporters: dict[str, Any] = {}


class TorchExporter(Protocol):
    """What the ``"torch"`` exporter provides (``cnrstore.torch.export`` registers itself)."""

    def CheckpointView(self, snapshot: Snapshot, *, model=None, trust_pickle: bool = False) -> Any:
        """A version in the Checkpointer's layout: ``state_dict()``, ``checkpoint_dict()``, ``meta_json()``,
        ``numpy_compatible(tensor)``, ``table_key_count()``; InvalidArgument if it is not in that layout."""

    def write(self, data, fmt: str, layout: str, path: str, metadata: dict[str, str]) -> None:
        """Write ``data`` to ``path`` as ``fmt`` (torch, safetensors of tensors, dcp)."""


class RootExporter(Protocol):
    """What the ``"distributed"`` exporter provides (``cnrstore.distributed.export`` registers itself)."""

    def is_root(self, path) -> bool:
        """True if ``path`` holds a multi-rank root's marker."""

    def merged_snapshot(self, root, version: int | None = None, *, trust_pickle: bool = False) -> Snapshot:
        """Global ``version`` (default newest) of ``root`` as one snapshot in the Checkpointer's layout."""


def register(name: str, exporter: Any) -> None:
    """Make ``exporter`` the one :func:`exporter` returns for ``name`` (a wing's export module calls this as
    it is imported; a later registration under the same name replaces an earlier one)."""
    _exporters[name] = exporter


def exporter(name: str) -> Any:
    """The exporter registered as ``name``, after importing the module ``WINGS`` names for it (once; that
    import registers it). Raises ImportError when that module cannot be imported (PyTorch missing), and
    KeyError when nothing registered ``name``."""
    if name in WINGS:
        importlib.import_module(WINGS[name])
    try:
        return _exporters[name]
    except KeyError:
        raise KeyError(f"no exporter is registered as {name!r}") from None


def _torch_exporter(message: str) -> TorchExporter:
    """The ``"torch"`` exporter; InvalidArgument with ``message`` when PyTorch is missing."""
    try:
        return exporter("torch")
    except ImportError as exc:
        raise InvalidArgument(message) from exc


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote: ``path`` in ``format`` and ``layout``, from ``version`` (a global version for
    a multi-rank root, ``merged`` then) at ``step``; ``tensors`` is the number of top-level tensors or
    arrays (state dict entries, or tables plus dense arrays), ``tables`` how many came from tables."""

    path: str
    format: str
    layout: str
    version: int
    step: int | None
    tensors: int
    tables: int
    merged: bool = False


@dataclass
class _Content:
    """What to write, built before anything touches the disk (bad requests fail early)."""

    layout: str
    data: Any  # state dict, checkpoint dict, or the nested arrays
    metadata: dict[str, str]
    tensors: int
    tables: int


def _check_parent(path: str, what: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise InvalidArgument(f"cannot export to {path!r}: directory {parent!r} does not exist; create it "
                              "(mkdir -p) or choose another path")
    if not os.path.isdir(parent):
        raise InvalidArgument(f"cannot export to {path!r}: {parent!r} is not a directory; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidArgument(f"cannot export to {path!r}: directory {parent!r} is not writable by this user; "
                              f"choose a writable directory or fix its permissions ({what})")


def _fspath(path) -> str:
    try:
        path = os.fspath(path)
    except TypeError:
        raise InvalidArgument(f"export path must be a file path, got {path!r}") from None
    if not path or "\x00" in path:
        raise InvalidArgument(f"export path must be a non-empty file path without NUL, got {path!r}")
    return path


def _lstat(path: str):
    """``os.lstat(path)``, or None when nothing is there (a missing parent is reported by _check_parent)."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise InvalidArgument(f"cannot export to {path!r}: cannot inspect it ({exc}); choose another path") from exc


def _refuse_existing(path: str, st, overwrite: bool) -> None:
    """Raise InvalidArgument unless what ``st`` (lstat of ``path``, or None) describes may be replaced by a
    file export (module doc)."""
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"export path {path!r} is a directory; name a file in it, e.g. "
                              f"{os.path.join(path, 'export.bin')!r}")
    if stat.S_ISLNK(st.st_mode):
        raise InvalidArgument(f"cannot export to {path!r}: it is a symbolic link (to {os.readlink(path)!r}); an "
                              "export replaces only a regular file and never follows or replaces a link: name the "
                              "link's target, or remove the link")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"cannot export to {path!r}: it is {fs.file_kind(st.st_mode)}, not a regular file; an export "
                              "replaces only a regular file (--force does not change that): name another path")
    if not overwrite:
        raise InvalidArgument(f"export file {path!r} exists; pass --force (overwrite=True) to replace it, or name "
                              "another path")


def check_path(path, fmt: str | None = None, *, overwrite: bool = False) -> str:
    """``path`` as a str if an export in format ``fmt`` can be written there; raises InvalidArgument
    saying what to fix otherwise.

    For a file (every format but ``"dcp"``): its directory exists, is a directory and is writable, and
    ``path`` is absent or -- with ``overwrite`` only -- a regular file (never a directory, a symbolic link,
    a FIFO, a socket or a device). For ``"dcp"`` (a directory): its parent exists and is writable, and
    ``path`` does not exist or is an empty directory (an export never merges into older files, and never
    deletes a directory; ``overwrite`` does not change that)."""
    path = _fspath(path)
    st = _lstat(path)
    if fmt == "dcp":
        if st is not None and not (stat.S_ISDIR(st.st_mode) and not os.listdir(path)):
            kind = "a non-empty directory" if stat.S_ISDIR(st.st_mode) else (
                "a file" if stat.S_ISREG(st.st_mode) else fs.file_kind(st.st_mode))
            raise InvalidArgument(f"cannot export a DCP checkpoint to {path!r}: it is {kind}; a DCP export "
                                  "creates a new directory (and never deletes one, with --force neither): remove "
                                  "it or name a new one")
        _check_parent(path, "a DCP export creates a directory there")
        return path
    _refuse_existing(path, st, overwrite)
    _check_parent(path, "the export file is created there")
    return path


def _place(tmp: str, path: str, overwrite: bool) -> None:
    """Move the written, synced file ``tmp`` to ``path``: with ``overwrite``, ``rename(2)`` after checking
    ``path`` again (absent or a regular file); without, ``link(2)``, which fails if anything is at ``path``
    (a file system without hard links gets the check and the rename)."""
    if overwrite:
        _refuse_existing(path, _lstat(path), True)
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        _refuse_existing(path, _lstat(path), False)  # names what appeared there
        raise InvalidArgument(f"something appeared at {path!r} during the export; name another path") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV):
            raise
        _refuse_existing(path, _lstat(path), False)
        os.replace(tmp, path)
        return
    _remove(tmp)


def resolve_layout(snapshot: Snapshot, fmt: str, layout: str = "auto") -> str:
    """The layout an export of ``snapshot`` in ``fmt`` uses (module doc); raises InvalidArgument for an
    unknown format or layout, a layout the format cannot hold, or a state-dict layout of a version that
    ``cnrstore.torch.Checkpointer`` did not write."""
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if layout == "auto":
        return "state_dict" if TORCH_STATE in snapshot.dense else "nested"
    if layout not in LAYOUTS:
        raise InvalidArgument(f"unknown export layout {layout!r}; choose auto or one of {', '.join(LAYOUTS)}")
    if fmt not in _LAYOUT_FORMATS[layout]:
        raise InvalidArgument(f"layout {layout!r} is written only as {', '.join(_LAYOUT_FORMATS[layout])} "
                              f"(it holds optimizer state and Python objects); choose format torch, or "
                              f"layout state_dict for {fmt}")
    if layout != "nested" and TORCH_STATE not in snapshot.dense:
        raise InvalidArgument(f"version {snapshot.version} was not written by cnrstore.torch.Checkpointer (it has "
                              f"no {TORCH_STATE!r} array), so its arrays have no parameter names; export it with "
                              "layout 'nested'")
    return layout


def _content(snapshot: Snapshot, fmt: str, layout: str, model, trust_pickle: bool = False) -> _Content:
    meta = {"version": str(snapshot.version), "step": str(snapshot.step), "layout": layout}
    if layout == "nested":
        tables = dict(snapshot.tables)
        dense = {name: np.ascontiguousarray(arr) for name, arr in snapshot.dense.items()}
        keyed = keyed_arrays(snapshot.keyed, snapshot.partitions)
        if fmt in ("npz", "safetensors"):
            arrays = {f"tables/{name}": arr for name, arr in tables.items()}
            arrays.update({f"dense/{name}": arr for name, arr in dense.items()})
            data = arrays
        else:
            data = {"version": snapshot.version, "step": snapshot.step, "meta": snapshot.meta,
                    "tables": tables, "dense": dense}
        data.update(keyed)
        return _Content(layout, data, meta, len(tables) + len(dense) + len(keyed), len(tables) + len(snapshot.keyed))
    if snapshot.keyed:
        raise InvalidArgument(f"version {snapshot.version} holds keyed table(s) {sorted(snapshot.keyed)[:5]}, which a "
                              f"model's state dict has no place for; export it with layout nested (--layout nested)")
    torch_exporter = _torch_exporter("this export needs PyTorch (pip install torch), or choose --format npz or "
                                     "safetensors with the nested layout")
    view = torch_exporter.CheckpointView(snapshot, model=model, trust_pickle=trust_pickle)
    meta["meta"] = view.meta_json()
    if layout == "checkpoint":
        data = view.checkpoint_dict()
        sd = data["model"]
    else:
        data = sd = view.state_dict()
    if fmt == "npz":
        odd = [k for k, v in sd.items() if not view.numpy_compatible(v)]
        if odd:
            raise InvalidArgument(f"npz (numpy) cannot hold {', '.join(odd[:3])} exactly (dtype "
                                  f"{sd[odd[0]].dtype}); export as torch, safetensors or dcp")
        data = {k: v.numpy() for k, v in sd.items()}
    return _Content(layout, data, meta, len(sd), view.table_key_count())


def keyed_arrays(keyed: dict, partitions: dict | None = None) -> dict[str, np.ndarray]:
    """The flat entries of keyed tables ({name: KeyedRows}) in a nested export (module doc), with each table's
    partition count (``partitions``: {name: int}) where known."""
    out: dict[str, np.ndarray] = {}
    for name, rows in keyed.items():
        if partitions and name in partitions:
            out[f"{KEYED_PREFIX}{name}/partitions"] = np.array([partitions[name]], np.int64)
        out[f"{KEYED_PREFIX}{name}/keys"] = np.ascontiguousarray(rows.keys, np.int64)
        out[f"{KEYED_PREFIX}{name}/values"] = np.ascontiguousarray(rows.values, np.float32)
        for col, arr in rows.columns.items():
            out[f"{KEYED_PREFIX}{name}/columns/{col}"] = np.ascontiguousarray(arr)
    return out


def _os_cause(exc: BaseException) -> tuple[int | None, BaseException]:
    """(OS error number, the exception that carries it) behind ``exc``: its own, a cause's, or one its
    message quotes (safetensors, torch and DCP report I/O errors as their own types: "... (os error 28)",
    "[Errno 28] ...", DCP's CheckpointException holding each rank's exception); (None, exc) if none."""
    seen = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        code = getattr(cur, "errno", None)
        if isinstance(code, int):
            return code, cur
        failures = getattr(cur, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            for failure in failures.values():  # rank -> (exception, traceback)
                if isinstance(failure, tuple) and failure:
                    failure = failure[0]
                if isinstance(failure, BaseException):
                    found = _os_cause(failure)
                    if found[0] is not None:
                        return found
        m = re.search(r"os error (\d+)|\[Errno (\d+)\]", str(cur))
        if m:
            return int(m.group(1) or m.group(2)), cur
        cur = cur.__cause__ or cur.__context__
    return None, exc


def _write_error(exc: BaseException, path: str) -> Exception:
    """The typed error for a failure while writing the export file to ``path`` (a one-line message)."""
    code, cause = _os_cause(exc)
    what = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    if code in _FULL_ERRNOS:
        return StorageFull(f"export to {path!r} ran out of space ({what}); nothing was written there. "
                           "Free space on that file system or export to another one")
    if code in _PATH_ERRNOS:
        return InvalidArgument(f"cannot write the export file {path!r} ({what}); choose a path in an existing, "
                               "writable directory")
    return ExportFailed(f"export to {path!r} failed ({type(cause).__name__}: {what}); nothing was written there. "
                        "Check the file system (space, permissions, errors in dmesg) and retry", path)


def export(snapshot: Snapshot, fmt: str, path, *, layout: str = "auto", model=None,
           overwrite: bool = False, trust_pickle: bool = False, progress=None) -> ExportReport:
    """Write ``snapshot`` to ``path`` in format ``fmt`` (one of FORMATS) and ``layout`` (module doc),
    atomically.

    ``model`` (a ``torch.nn.Module`` of the checkpointed architecture, optional, state-dict layouts only)
    names the state dict exactly as ``model.state_dict()`` does -- needed only for a model whose keys the
    store cannot know: an embedding weight shared with another module (its second key) or a model that *is*
    an ``nn.Embedding`` saved without an optimizer; the model's embedding dtype is kept; a model that does
    not match the version raises InvalidArgument.

    ``overwrite`` (the command's ``--force``) lets the export replace an existing regular file at ``path``;
    without it an existing file is refused. Nothing else is ever replaced (module doc).

    The trainer payload of a state-dict or checkpoint layout is read as data: a pickle naming code raises
    UnsafePayload unless ``trust_pickle`` (the command's ``--trust-pickle``; it warns, then unpickles).

    ``progress(done, total)``, if given, follows the write in bytes: ``total`` is the size of the arrays
    and tensors written (the file's size, less its headers), ``done`` what the file (or DCP directory) holds
    so far, at most ``total``; it is called from a thread that watches the file, about ten times a second
    while the format's writer runs, and last with ``(total, total)`` once the file is in place. (A writer
    that builds the whole file in memory first, like safetensors', shows as one jump.)

    Raises InvalidArgument for an unknown format or layout, a layout the version or format cannot hold, or a
    path that cannot be written (missing or non-writable directory; a directory, a symbolic link, a FIFO,
    a socket or a device for a file format; an existing file without ``overwrite``; anything but an absent
    path or an empty directory for dcp), StorageFull when the file system fills up, and ExportFailed for any
    other write failure; in every case ``path`` is left as it was.
    """
    layout = resolve_layout(snapshot, fmt, layout)
    if model is not None and layout == "nested":
        raise InvalidArgument("model= names a state dict's keys; the nested layout has none: drop model= or "
                              "choose layout state_dict")
    path = check_path(path, fmt, overwrite=overwrite)
    content = _content(snapshot, fmt, layout, model, trust_pickle)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".{os.path.basename(os.path.normpath(path))}.cnrstore-export-{os.getpid()}.tmp")
    _remove(tmp)  # a leftover of an export killed in this pid's earlier life
    total = _nbytes(content.data)
    watch = None if progress is None else _Watch(tmp, total, progress)
    try:
        try:
            _write(content, fmt, tmp)
            _usual_modes(tmp)
            _sync(tmp)
        finally:
            if watch is not None:
                watch.stop()
        if fmt == "dcp":
            os.rename(tmp, path)  # onto nothing or an empty directory only (ENOTEMPTY, ENOTDIR): never merges
        else:
            _place(tmp, path, overwrite)
        _sync_dir(os.path.dirname(os.path.abspath(path)))
    except InvalidArgument:
        _remove(tmp)
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure removes the partial file
        _remove(tmp)
        if isinstance(exc, (KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        raise _write_error(exc, path) from exc
    if progress is not None:
        progress(total, total)
    return ExportReport(path=path, format=fmt, layout=layout, version=snapshot.version, step=snapshot.step,
                        tensors=content.tensors, tables=content.tables)


def _nbytes(data) -> int:
    """Bytes of the arrays and tensors in ``data`` (nested dicts, lists and tuples; anything else counts 0)."""
    if isinstance(data, dict):
        return sum(_nbytes(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return sum(_nbytes(v) for v in data)
    nbytes = getattr(data, "nbytes", None)  # numpy arrays and torch tensors
    return int(nbytes) if isinstance(nbytes, (int, np.integer)) else 0


def _bytes_at(path: str) -> int:
    """Bytes of the file at ``path``, or of every file under the directory at ``path`` (0 if absent)."""
    try:
        if not os.path.isdir(path):
            return os.stat(path).st_size
        return sum(os.stat(os.path.join(d, f)).st_size for d, _dirs, files in os.walk(path) for f in files)
    except OSError:  # absent yet, or a file of a DCP write renamed meanwhile
        return 0


class _Watch:
    """A thread that reports the bytes at ``path`` to ``progress`` every 0.1 s while they change, until
    ``stop()``: below ``total`` (the file is not in place until the export returns, which reports
    ``total`` itself). An error of ``progress`` ends the watching, not the export."""

    def __init__(self, path: str, total: int, progress):
        self.path, self.total, self.progress = path, total, progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cnrstore-export-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            shown = 0
            self.progress(shown, self.total)
            while not self._stop.wait(0.1):
                done = min(_bytes_at(self.path), max(self.total - 1, 0))
                if done != shown:
                    shown = done
                    self.progress(done, self.total)
        except Exception:  # noqa: BLE001 - a progress display that fails must not fail the export
            pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def export_path(source, fmt: str, path, *, version: int | None = None, layout: str = "auto",
                model=None, overwrite: bool = False, trust_pickle: bool = False) -> ExportReport:
    """Export ``version`` (default newest) of ``source`` to ``path``: ``source`` is an open ``Store``, the
    path of a store, or the root of a multi-rank job (``cnrstore.distributed``), whose global ``version``
    is exported as one merged model (every table assembled from all ranks' shards, dense state from rank 0;
    see ``cnrstore.distributed.export.merged_snapshot``).

    ``layout``, ``model`` and ``overwrite`` are :func:`export`'s. The output path is checked before the (long) read;
    errors as :func:`export`, plus those of opening and reading the source (StoreNotFound,
    VersionNotFound, ...)."""
    from .store import Store, open as open_store

    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    path = check_path(path, fmt, overwrite=overwrite)
    kw = {"layout": layout, "model": model, "overwrite": overwrite, "trust_pickle": trust_pickle}
    if isinstance(source, Store):
        return export(source.restore(version), fmt, path, **kw)
    src = os.fspath(source)
    if not os.path.exists(filenames.marker_path(src)):
        try:
            roots: RootExporter | None = exporter("distributed")  # a root's marker name lives there (needs torch)
        except ImportError:
            roots = None
        if roots is not None and roots.is_root(src):
            if layout == "checkpoint":
                raise InvalidArgument(f"{src} is a multi-rank root: its merged export holds the model only (each "
                                      "rank's optimizer state is its own); choose layout state_dict or nested, or "
                                      "export one rank's store with layout checkpoint")
            report = export(roots.merged_snapshot(src, version, trust_pickle=trust_pickle), fmt, path, **kw)
            return dataclasses.replace(report, merged=True)
    with open_store(src, readonly=True) as store:
        snapshot = store.restore(version)
    return export(snapshot, fmt, path, **kw)


def _remove(tmp: str) -> None:
    try:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.unlink(tmp)
    except OSError:
        pass


def _usual_modes(path: str) -> None:
    """Give the written file (or directory and its files) the mode a new file gets (0666, or 0777 for a
    directory, less the umask), whichever library wrote it: safetensors' writer makes its file 0600, torch's
    and numpy's 0666 less the umask, so that exports of every format are readable alike."""
    umask = _umask()
    if os.path.isdir(path):
        os.chmod(path, 0o777 & ~umask)
        for name in os.listdir(path):
            _usual_modes(os.path.join(path, name))
        return
    os.chmod(path, 0o666 & ~umask)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads' file
    creation): /proc/self/status on Linux, else the common 022."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _sync(path: str) -> None:
    """fsync the written file (or every file of the written directory, and it) before the rename."""
    if os.path.isdir(path):
        for name in os.listdir(path):
            _sync(os.path.join(path, name))
        _sync_dir(path)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(content: _Content, fmt: str, path: str) -> None:
    """Write ``content`` to the temporary ``path`` (a file, or a directory for dcp)."""
    if fmt == "npz":
        with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a bare path
            np.savez(f, **content.data)
        return
    if fmt == "safetensors" and content.layout == "nested":
        try:
            from safetensors.numpy import save_file
        except ImportError as exc:
            raise InvalidArgument("export to safetensors needs the safetensors package: "
                                  "pip install 'cnrstore[export]'") from exc
        save_file(content.data, path, metadata={k: content.metadata[k] for k in ("version", "step")})
        return
    torch_exporter = _torch_exporter(f"export to {fmt} needs PyTorch (pip install torch), or choose --format npz "
                                     "or safetensors")
    torch_exporter.write(content.data, fmt, content.layout, path, content.metadata)
