"""Seed a new store from a PyTorch checkpoint, in ``cnrstore.torch.Checkpointer``'s layout.

    report = import_checkpoint("ckpt", "model.pt", model=model, codec="fp32", codecs={"emb.0": "int4"})
    Checkpointer(cnrstore.open("ckpt"), model, optimizer).restore()    # then train, saving increments

The source is a ``torch.save`` file, a safetensors file, a ``numpy.savez`` file (arrays) or a
``torch.distributed.checkpoint`` (DCP) directory holding a model's ``state_dict()`` -- or a dict holding one under ``"model"`` (or
``"state_dict"``) -- or such a dict in memory. The import writes one version, a baseline, exactly as a
Checkpointer's save would:

- each embedding weight becomes a table named by its module path (``"emb.0.weight"`` -> ``"emb.0"``;
  a top-level ``"weight"`` -> ``"embedding"``), every row written, as float32 values encoded with the
  table's codec: ``codecs[name]`` if given, else ``codec`` (default ``"fp32"``: an import is lossless
  unless asked; later saves use the Checkpointer's own codec);
- every other tensor becomes the dense array ``"torch.model/<key>"``, stored exactly (bfloat16 as its raw
  bits); with ``model=`` a tensor whose dtype differs from the model's is cast to it first, as
  ``load_state_dict`` would (a complex tensor into a real model dtype is refused: the cast drops data);
- the ``"torch.state"`` blob lists the tables and dtypes and holds the optimizer and ``extra`` state (below);
  row-wise optimizer state becomes ``"<table>.optim.<k>"`` tables in ``optimizer_codec``, as the
  Checkpointer writes them.

What else the source holds is imported, or the import is refused -- nothing is dropped without a word.
A dict with a ``"model"`` entry may hold besides it exactly what ``cnrstore export --layout checkpoint``
writes (``CHECKPOINT_KEYS``): ``"optimizers"`` (one ``optimizer.state_dict()`` per optimizer),
``"param_names"`` (per optimizer, the model's name of each parameter in ``param_groups`` order: it tells
which state is an embedding table's row-wise state), ``"embedding_tables"`` (the table names, used as
``tables=`` when neither ``model=`` nor ``tables=`` is given), ``"extra"`` (``{name: state_dict()}``),
``"step"`` and ``"meta"`` (the version's, unless ``step=`` / ``meta=`` are given) and ``"version"``
(recorded in the blob). ``Checkpointer.restore`` of the import then loads the optimizers (row-wise state
included) and ``extra`` exactly as a restore of the exported version would. Any other entry (a trainer's
``"optimizer"``, ``"opt0"``, ``"epoch"``), or ``"optimizers"`` without ``"param_names"`` (optimizer state
keyed by position cannot be matched to tables), raises InvalidArgument naming the entries, unless
``model_only=True`` (``cnrstore import --model-only``): then the model alone is imported and every other
entry is ignored, listed in ``ImportReport.ignored``. To import a trainer's own optimizer state, load it
into the trainer's optimizer and pass that: ``opt.load_state_dict(ck["optimizer"]);
import_checkpoint(store, ck, model=model, optimizer=opt, model_only=True)``. ``optimizer=`` with a source
that holds optimizer state is refused (which one to record would be a guess) unless ``model_only=True``.

``Checkpointer.restore`` requires as many optimizers in the store as the Checkpointer has: a store
imported without optimizer state restores into a Checkpointer with optimizers too, leaving them as they
are (fresh).

Which tensors are embedding weights:

- with ``model=``: exactly the weights of its ``nn.Embedding`` / ``nn.EmbeddingBag`` modules (as the
  Checkpointer sees them); the source must hold exactly the model's state dict (missing or unexpected
  keys, or a shape that differs, raise InvalidArgument, as ``load_state_dict(strict=True)`` would);
- without a model, with ``tables=``: the keys matching any of the glob patterns (``fnmatch``, e.g.
  ``"emb.*.weight"``); each must be a 2-D floating tensor keyed ``"<path>.weight"`` or ``"weight"``, and
  each pattern must match something;
- otherwise (``tables=None``): every 2-D floating tensor keyed ``"<path>.weight"`` whose module path has a
  part containing ``"emb"`` (``emb_l.0``, ``embedding_bags.t_cat_0``, ``sparse.embeddings.3``), or that
  has at least ``min_rows`` rows (default ``DEFAULT_MIN_ROWS``). This guesses; an ``nn.Linear`` named like an
  embedding or a tiny embedding named otherwise is misfiled, and ``Checkpointer.restore`` then reports the
  missing state. Pass ``model=`` (exact) or ``tables=`` when that matters.

Every tensor is checked before the store is touched: a sparse, quantized, nested or meta tensor, a dtype a
dense array cannot hold exactly (float8, ...), a non-finite value in a table or row-wise state, a
non-floating 2-D ``*.weight`` named like an embedding (``tables=`` decides otherwise), a dense array over
the record limit, a malformed optimizer, ``extra`` or ``param_names`` entry, each raise InvalidArgument
naming the key and the fix. A source that cannot be read -- a truncated or damaged torch zip file, a
safetensors file with a bad header, a DCP directory with a truncated data file or a garbage ``.metadata``
(torch raises ``CheckpointException``, a ``BaseException``), a pickle that ``weights_only`` refuses --
raises InvalidArgument with one line saying what failed (torch's own diagnostics are not printed).

The store must hold no version yet (an import is its first version). A failed import commits nothing (the
version is aborted); a store directory the call created is removed again, and what it created inside an
existing directory that was not a store yet is removed too. (Tables it created in a store that existed
before, or that was passed open, stay, empty: a retry of the import reuses them. Every check that can fail
runs before the first table is created, so only a write failure -- a full disk -- leaves them.) Every
failure is a typed error: InvalidArgument (a source that cannot be read or does not fit, with what to
fix), the store's own errors (StorageFull, StoreLocked, ...).
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import logging
import os
import shutil
import struct
import warnings
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .. import codecs as _codecs
from .. import nested_import
from ..engine import filenames, fs
from .. import store as _store
from ..engine import arguments
from ..errors import InvalidArgument
from . import payload as _payload
from .optim_state import as_optimizer_list
from .payload import DENSE_PREFIX, PAYLOAD_FORMAT, ROW_MARK, STATE_BLOB, dense_copy
from .export import embedding_tables

__all__ = ["CHECKPOINT_KEYS", "DEFAULT_MIN_ROWS", "SOURCE_FORMATS", "ImportReport", "import_checkpoint",
           "parse_table_codecs", "read_state_dict", "select_tables"]

from ..export import DEFAULT_MIN_ROWS, SOURCE_FORMATS  # noqa: E402  (torch-free: the CLI's options read them)
#: Elements converted to float32 and written per put_rows call (bounds the import's extra memory).
_CHUNK_ELEMENTS = 1 << 24
#: The entries a source dict may hold beside its ``"model"`` (or ``"state_dict"``): what ``cnrstore export
#: --layout checkpoint`` writes (``cnrstore/torch/export.py``, ``CheckpointView.checkpoint_dict``).
CHECKPOINT_KEYS = ("optimizers", "param_names", "embedding_tables", "extra", "version", "step", "meta")
#: Where trainers keep one optimizer's ``state_dict()`` beside the model (DCP's tutorials: ``"optim"``)
OPTIMIZER_KEYS = ("optim", "optimizer", "optimizer_state_dict")


@dataclass(frozen=True)
class ImportReport:
    """What an import wrote: ``version`` (the store's first) at ``step``; ``tables`` maps each embedding
    table to ``(source key, num_rows, dim, codec)``; ``dense`` lists the state-dict keys stored as dense
    arrays; ``optimizer_tables`` the row-wise optimizer state tables; ``optimizers`` how many optimizers'
    state was recorded (the source's or ``optimizer=``'s), ``extra`` the names of the ``extra`` state
    imported; ``ignored`` the source's entries left out (``model_only=True``); ``source_format`` is one of
    SOURCE_FORMATS or ``"state_dict"`` (a dict in memory)."""

    version: int
    step: int | None
    source_format: str
    tables: dict[str, tuple[str, int, int, str]] = field(default_factory=dict)
    dense: tuple[str, ...] = ()
    optimizer_tables: tuple[str, ...] = ()
    optimizers: int = 0
    extra: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    #: a nested cnrstore export imported as it is (``cnrstore.nested_import``): ``tables`` then maps each
    #: table to ``("tables/<name>", num_rows, dim, codec)``, ``dense`` lists the dense arrays' names, and
    #: ``keyed`` maps each keyed table to ``(keys, dim, codec, column names)``
    nested: bool = False
    keyed: dict[str, tuple] = field(default_factory=dict)


def parse_table_codecs(items) -> dict[str, str]:
    """``["emb.0=int8", "emb.1=fp32"]`` (the CLI's ``--table-codec NAME=CODEC``) as ``{"emb.0": "int8", ...}``;
    InvalidArgument for an item without ``=``, an empty name, a table named twice or an unknown codec."""
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, codec = str(item).rpartition("=")
        if not sep or not name or not codec:
            raise InvalidArgument(f"--table-codec takes NAME=CODEC (e.g. emb.0=int8), got {item!r}")
        if name in out:
            raise InvalidArgument(f"table {name!r} is given a codec twice")
        _codecs.get(codec)
        out[name] = codec
    return out


# -- reading a source -------------------------------------------------------------------------------------
def detect_format(path: str) -> str:
    """``"dcp"`` for a directory holding DCP's ``.metadata``, ``"safetensors"`` for a file opening with a
    safetensors header, ``"npz"`` for a zip archive whose first member is a ``.npy`` array (``numpy.savez``;
    a torch.save archive's is ``.../data.pkl``), ``"torch"`` otherwise."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, ".metadata")):
            return "dcp"
        raise InvalidArgument(f"{path!r} is a directory but not a torch.distributed.checkpoint (no .metadata); "
                              "name a DCP directory, a torch.save file or a safetensors file")
    try:
        with open(_open_source(path), "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
            f.seek(0)
            local = f.read(30 + 1024)  # (a zip's first local file header, and the member's name)
    except FileNotFoundError:
        raise InvalidArgument(f"checkpoint to import {path!r} does not exist; check the path") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot read the checkpoint to import {path!r} ({exc})") from exc
    if len(head) == 9 and head[8:9] == b"{" and 0 < struct.unpack("<Q", head[:8])[0] <= size - 8:
        return "safetensors"
    if len(local) >= 30 and local[:4] == b"PK\x03\x04":
        name_len = struct.unpack("<H", local[26:28])[0]
        if local[30:30 + name_len].endswith(b".npy"):
            return "npz"
    return "torch"


#: What to do about an import source (or a file of a DCP directory) that is not a regular file.
_SOURCE_FIX = "name a checkpoint file (or a DCP directory of regular files)"
#: A DCP ``.metadata`` larger than this is not one (it is read whole, then unpickled from memory).
_MAX_DCP_METADATA_BYTES = 1 << 30


def _open_source(path: str) -> int:
    """A raw fd of the regular file ``path`` to import from (a link to one is followed: the user named it);
    InvalidArgument for a FIFO (never waited on), a socket, a device (``/dev/zero`` would be read without
    end) or a directory (``fs.open_regular``). FileNotFoundError and other OSErrors propagate."""
    return fs.open_regular(path, "checkpoint to import", _SOURCE_FIX, follow_symlinks=True, error=InvalidArgument)


@contextlib.contextmanager
def _checked_source(path: str):
    """A path naming exactly the regular file ``path`` names now (``_open_source``), for readers that open
    by name (torch.load with mmap, safetensors): ``/proc/self/fd/N`` of the checked file where /proc has it,
    so that nothing swapped in after the check is read; else ``path`` itself."""
    fd = _open_source(path)
    try:
        proc = f"/proc/self/fd/{fd}"
        yield proc if os.path.exists(proc) else path
    finally:
        os.close(fd)


def _one_line(exc: BaseException) -> str:
    """``"Type: first line of the message"`` of ``exc``, for a one-line error; DCP's CheckpointException
    (each rank's exception and traceback) is summed up by its first rank's exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) and first else first
        if isinstance(first, BaseException):
            return _one_line(first)
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if len(text) > 240:
        text = text[:237] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _refusal_in(exc: BaseException) -> InvalidArgument | None:
    """The InvalidArgument the import's own checks raised inside DCP's loader (its CheckpointException keeps
    each rank's exception), to be reported as it is; None if there is none."""
    failures = getattr(exc, "failures", None)
    for failure in failures.values() if isinstance(failures, Mapping) else ():
        failure = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(failure, InvalidArgument):
            return failure
    return None


class _DropDCPRecords(logging.Filter):
    """DCP's loader logs its failures, with tracebacks, on the root logger; the import reports them itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "distributed" not in record.pathname or "checkpoint" not in record.pathname


@contextlib.contextmanager
def _quiet_dcp():
    root, drop = logging.getLogger(), _DropDCPRecords()
    root.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            yield
    finally:
        root.removeFilter(drop)


#: What a DCP ``.metadata`` pickle may name (torch 2.x writes these): DCP's metadata classes (dataclasses and
#: one enum: built from their fields, no code of the file's choosing runs), torch.Size, torch dtypes, the
#: layout lookup torch.serialization._get_layout and pathlib paths. Anything else is refused.
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


def _load_dcp(path: str):
    """A DCP directory's state dict, read without running code the directory names: DCP's own reader
    unpickles ``.metadata`` with ``pickle.load`` and non-tensor values with ``torch.load(weights_only=False)``;
    here ``.metadata`` goes through an unpickler that resolves only ``_DCP_GLOBALS`` (and torch dtypes), and
    non-tensor values through ``weights_only=True`` (docs/DESIGN.md "Security")."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # pickle's pure-Python unpickler: the C one allocates the length a BINBYTES / BINUNICODE opcode claims
    # before reading it (a 111-byte .metadata claiming 512 MiB allocated 512 MiB); this one reads what is there
    class DataUnpickler(pickle._Unpickler):
        def find_class(self, module, name):
            if (module, name) in _DCP_GLOBALS or (
                    module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"its .metadata names {module}.{name}, which cnrstore does not unpickle "
                                         "(a DCP .metadata holds only DCP's metadata classes)")

    class Files(FileSystem):
        """DCP's file access, reading only regular files directly in the directory ``path``: a FIFO or device
        is refused (never waited on or read without end), and so is a data file a crafted ``.metadata`` names
        outside the directory (``../x``, ``/etc/passwd``: it would be read into the store)."""

        @contextlib.contextmanager
        def create_stream(self, file, mode):
            file = os.fspath(file)
            if mode != "rb" or os.path.dirname(os.path.abspath(file)) != os.path.abspath(path):
                raise InvalidArgument(f"DCP checkpoint {path!r} names the data file {file!r}, which is not a file "
                                      "directly in its directory (DCP writes none such): the checkpoint is damaged "
                                      "or crafted; copy it again")
            fd = fs.open_regular(file, "file of the DCP checkpoint to import", _SOURCE_FIX, follow_symlinks=True,
                                 error=InvalidArgument)
            with open(fd, "rb") as stream:
                yield stream

    class Reader(FileSystemReader):
        def __init__(self, checkpoint):
            super().__init__(checkpoint)
            self.fs = Files()

        def read_metadata(self, *args, **kwargs):
            metadata = DataUnpickler(io.BytesIO(metadata_bytes)).load()
            if not type(metadata).__name__ == "Metadata":
                raise pickle.UnpicklingError(".metadata does not hold DCP metadata")
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value):
            obj = torch.load(value, weights_only=True, map_location="cpu")
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    # read up to its size (a regular file only), then unpickled from memory: a length the pickle claims
    # allocates no more than the file holds
    metadata_bytes = fs.read_regular(os.path.join(path, ".metadata"), _MAX_DCP_METADATA_BYTES,
                                     "metadata file of the DCP checkpoint to import", _SOURCE_FIX,
                                     follow_symlinks=True, error=InvalidArgument)
    sd: dict = {}
    _load_state_dict(state_dict=sd, storage_reader=Reader(path), process_group=None, no_dist=True,
                     planner=Planner())
    return sd


def _load(path: str, fmt: str):
    """The object stored at ``path`` in ``fmt``; InvalidArgument (one line) when it cannot be read."""
    try:
        if fmt == "torch":
            with _checked_source(path) as checked:
                try:  # mapped, not read: a large checkpoint is not held twice while it is written
                    return torch.load(checked, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as exc:
                    if "mmap" not in str(exc):  # the legacy (non-zip) format cannot be mapped
                        raise
                    return torch.load(checked, map_location="cpu", weights_only=True)
        if fmt == "safetensors":
            from safetensors.torch import load_file

            with _checked_source(path) as checked:
                return load_file(checked)
        if fmt == "npz":  # (arrays only: no pickle; a nested export as numpy, anything else as tensors)
            with _checked_source(path) as checked, np.load(checked, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            return arrays if _is_nested_export(arrays) else {k: torch.from_numpy(a) for k, a in arrays.items()}
        with _quiet_dcp():
            return _load_dcp(path)
    except InvalidArgument:
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except FileNotFoundError:
        if not os.path.exists(path):
            raise InvalidArgument(f"checkpoint to import {path!r} does not exist; check the path") from None
        raise InvalidArgument(f"cannot read {path!r} as a {fmt} checkpoint: a file of it is missing; copy the "
                              "whole checkpoint again") from None
    except ImportError as exc:
        raise InvalidArgument(f"reading {fmt} needs {exc.name or 'a missing package'}: pip install it") from exc
    except BaseException as exc:  # noqa: BLE001 - every reader has its own error types (DCP's is a BaseException)
        refused = _refusal_in(exc)
        if refused is not None:
            raise refused from None
        what = _one_line(exc)
        if fmt == "torch" and "weights_only" in str(exc):
            hint = ("it holds objects other than tensors and plain containers, which are not unpickled: re-save "
                    "it as a dict of tensors")
        elif fmt == "dcp":
            hint = "a data file or .metadata is truncated, damaged or missing: copy the checkpoint again"
        else:
            hint = "the file is truncated, damaged or not a checkpoint of this format: copy it again, or name the " \
                   "format with --source-format (format=)"
        raise InvalidArgument(f"cannot read {path!r} as a {fmt} checkpoint ({what}); {hint}") from exc


@dataclass
class _Source:
    """What a source holds (module doc): the model state dict and the checkpoint layout's other entries."""

    state_dict: dict
    optimizers: list = field(default_factory=list)
    param_names: list | None = None
    tables: list | None = None
    extra: dict = field(default_factory=dict)
    step: int | None = None
    meta: dict | None = None
    version: int | None = None
    ignored: tuple = ()
    #: the optimizer state is keyed by position (``optimizer.state_dict()``): its parameters are named at
    #: the import, by ``optimizer=`` or ``model=`` (``_name_positional``)
    positional: bool = False
    #: the source's scalar entries that are not the layout's (``"epoch"``): imported into the version's meta
    scalars: dict = field(default_factory=dict)


def _is_nested_export(obj: Mapping) -> bool:
    return nested_import.is_nested(obj)


def _state_dict_of(obj, where: str) -> dict:
    """``obj`` as a model state dict: a non-empty mapping of str keys to tensors (else InvalidArgument)."""
    if not isinstance(obj, Mapping) or not obj:
        raise InvalidArgument(f"{where} is not a model state dict (a non-empty dict of tensors); save "
                              "model.state_dict()")
    odd_keys = [k for k in obj if not isinstance(k, str)][:3]
    if odd_keys:
        raise InvalidArgument(f"{where} has keys {odd_keys} that are not strings; a state dict is keyed by "
                              "parameter name: save model.state_dict()")
    odd = [f"{k} ({type(v).__name__})" for k, v in obj.items() if not torch.is_tensor(v)][:3]
    if odd:
        raise InvalidArgument(f"{where} holds entries that are not tensors: {', '.join(odd)}; a state dict holds "
                              "tensors only: save model.state_dict()")
    return dict(obj)


def _split(obj, where: str, model_only: bool) -> _Source:
    """The model state dict of ``obj`` and what else it holds (module doc); InvalidArgument for entries the
    import does not understand (unless ``model_only``) or malformed ones."""
    if not isinstance(obj, Mapping):
        raise InvalidArgument(f"{where} holds a {type(obj).__name__}, not a model state dict; save "
                              "model.state_dict()")
    if _is_nested_export(obj):
        raise InvalidArgument(f"{where} is a nested cnrstore export (tables/, dense/ and keyed/ arrays of a "
                              "key-value store), not a model state dict; import it with import_checkpoint (cnrstore "
                              "import), which takes it back as it is")
    if obj and all(torch.is_tensor(v) for v in obj.values()):
        return _Source(_state_dict_of(obj, where))
    if len(obj) == 1:  # a Stateful's state under one name (DCP's {"app": AppState(model, optimizer)} layout)
        (wrapper, inner), = obj.items()
        if isinstance(inner, Mapping) and any(k in inner for k in ("model", "state_dict")):
            obj, where = inner, f"entry {wrapper!r} of {where}"
    model_keys = [k for k in ("model", "state_dict") if k in obj]
    if not model_keys:
        odd = [k for k, v in obj.items() if not torch.is_tensor(v)][:3]
        raise InvalidArgument(f"{where} is not a model state dict: entries {odd} are not tensors (and it has no "
                              "'model' or 'state_dict' entry holding one); save model.state_dict()")
    if len(model_keys) > 1:
        raise InvalidArgument(f"{where} holds both a 'model' and a 'state_dict' entry; which is the model is a "
                              "guess: re-save it with one")
    key = model_keys[0]
    src = _Source(_state_dict_of(obj[key], f"entry {key!r} of {where}"))
    rest = [k for k in obj if k != key]
    if model_only:
        src.ignored = tuple(str(k) for k in rest)
        return src
    single = [k for k in OPTIMIZER_KEYS if k in obj]
    if len(single) > 1 or (single and "optimizers" in obj):
        raise InvalidArgument(f"{where} holds optimizer state under {[*single, *(['optimizers'] if 'optimizers' in obj else [])]}: "
                              "which one the trainer's is would be a guess; re-save it with one, or pass --model-only")
    if single:
        obj = {**{k: v for k, v in obj.items() if k != single[0]}, "optimizers": [obj[single[0]]]}
        rest = [k for k in obj if k != key]
        named = _by_name(obj["optimizers"][0])
        if named is not None:  # keyed by parameter name (DCP's get_state_dict): the names come with it
            obj["optimizers"], obj["param_names"] = [named[0]], [named[1]]
        elif "param_names" not in obj:
            obj["optimizers"] = [_by_position(obj["optimizers"][0], where)]
            src.positional = True
    scalars = {k: v for k, v in obj.items() if k in rest and k not in CHECKPOINT_KEYS
               and isinstance(k, str) and isinstance(v, (int, float, str, bool))}
    src.scalars = scalars
    unknown = [k for k in rest if k not in CHECKPOINT_KEYS and k not in scalars]
    if unknown:
        raise InvalidArgument(
            f"{where} holds entries the import does not understand: {unknown[:8]} (beside {key!r} it reads what "
            f"`cnrstore export --layout checkpoint` writes: {', '.join(CHECKPOINT_KEYS)}); pass --model-only "
            "(model_only=True) to import the model alone and leave them out, or load a trainer's optimizer "
            "state into its optimizer and pass optimizer= with model_only=True")
    optimizers = obj.get("optimizers", [])
    if not isinstance(optimizers, (list, tuple)) or not all(
            isinstance(o, Mapping) and isinstance(o.get("state"), Mapping)
            and isinstance(o.get("param_groups"), (list, tuple))
            and all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in o["param_groups"])
            for o in optimizers):
        raise InvalidArgument(f"entry 'optimizers' of {where} is not a list of optimizer state_dict()s (each with "
                              "'state' and 'param_groups'); re-export it, or pass --model-only (model_only=True)")
    src.optimizers = [dict(o) for o in optimizers]
    names = obj.get("param_names")
    if src.optimizers and names is None and not src.positional:
        raise InvalidArgument(f"{where} holds optimizer state without 'param_names': state keyed by position "
                              "cannot be matched to the embedding tables. Import the model with --model-only "
                              "(model_only=True), or load the state into the trainer's optimizer and pass "
                              "optimizer= with model_only=True")
    if names is not None:
        counts = [sum(len(g["params"]) for g in o["param_groups"]) for o in src.optimizers]
        if not isinstance(names, (list, tuple)) or len(names) != len(counts) or not all(
                isinstance(per, (list, tuple)) and len(per) == n and all(x is None or isinstance(x, str) for x in per)
                for per, n in zip(names, counts)):
            raise InvalidArgument(f"entry 'param_names' of {where} is not, per optimizer, the name of each of its "
                                  f"parameters ({counts} of them); re-export it, or pass --model-only")
        src.param_names = [list(per) for per in names]
    tables = obj.get("embedding_tables")
    if tables is not None:
        if not isinstance(tables, (list, tuple)) or not all(isinstance(t, str) and t for t in tables):
            raise InvalidArgument(f"entry 'embedding_tables' of {where} is not a list of table names; re-export it "
                                  "or pass --model-only")
        src.tables = list(tables)
    extra = obj.get("extra", {})
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
        raise InvalidArgument(f"entry 'extra' of {where} is not a dict of state dicts keyed by name; re-export it "
                              "or pass --model-only (model_only=True)")
    src.extra = dict(extra)
    step, meta, version = obj.get("step"), obj.get("meta"), obj.get("version")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise InvalidArgument(f"entry 'step' of {where} is {step!r}, not an integer; pass step= (--step) or "
                              "model_only=True (--model-only)")
    if meta is not None and not isinstance(meta, Mapping):
        raise InvalidArgument(f"entry 'meta' of {where} is a {type(meta).__name__}, not a dict; pass --model-only "
                              "(model_only=True)")
    src.step, src.meta = step, (dict(meta) if meta is not None else None)
    src.version = version if isinstance(version, int) and not isinstance(version, bool) else None
    return src


def _by_name(sd) -> tuple[dict, list] | None:
    """An optimizer state dict keyed by parameter name (``get_state_dict``'s: ``state`` and each group's
    ``params`` hold names) as one keyed by position, and the names; None if it is not keyed by name."""
    if not isinstance(sd, Mapping) or not isinstance(sd.get("param_groups"), (list, tuple)):
        return None
    groups = sd["param_groups"]
    names = [p for g in groups if isinstance(g, Mapping) for p in g.get("params", ())]
    if not names or not all(isinstance(n, str) and not n.isdigit() for n in names):
        return None
    index = {n: i for i, n in enumerate(names)}
    state = sd.get("state") or {}
    if not isinstance(state, Mapping) or any(k not in index for k in state):
        return None
    out_groups, i = [], 0
    for g in groups:
        out_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    return {**sd, "state": {index[k]: v for k, v in state.items()}, "param_groups": out_groups}, names


def _by_position(sd, where: str) -> dict:
    """An ``optimizer.state_dict()`` whose parameters are positions, with the positions as ints (DCP saves
    them as strings)."""
    def pos(k):
        if isinstance(k, int) and not isinstance(k, bool):
            return k
        if isinstance(k, str) and k.isdigit():
            return int(k)
        raise InvalidArgument(f"the optimizer state of {where} is keyed by {k!r}, neither a parameter's position nor "
                              "its name; re-save it as optimizer.state_dict(), or pass --model-only")
    if not isinstance(sd, Mapping) or not isinstance(sd.get("state"), Mapping) or not isinstance(
            sd.get("param_groups"), (list, tuple)):
        raise InvalidArgument(f"the optimizer entry of {where} is not an optimizer.state_dict() (with 'state' and "
                              "'param_groups'); re-save it, or pass --model-only")
    groups = [{**g, "params": [pos(p) for p in g.get("params", ())]} if isinstance(g, Mapping) else g
              for g in sd["param_groups"]]
    return {**sd, "state": {pos(k): v for k, v in sd["state"].items()}, "param_groups": groups}


def _name_positional(src: _Source, model, optimizers, where: str) -> list:
    """The parameter names of a source's one optimizer state keyed by position: ``optimizer=``'s parameters
    (built as the trainer built it), else ``model=``'s in ``named_parameters()`` order (an optimizer made
    with ``model.parameters()``) when every state tensor has the shape of its parameter; InvalidArgument
    saying what to pass otherwise."""
    sd = src.optimizers[0]
    count = sum(len(g["params"]) for g in sd["param_groups"])
    if optimizers:
        if len(optimizers) != 1:
            raise InvalidArgument(f"{where} holds one optimizer's state; optimizer= gives {len(optimizers)}")
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names.get(id(p)) for g in optimizers[0].param_groups for p in g["params"]]
        if len(order) != count:
            raise InvalidArgument(f"{where} holds optimizer state for {count} parameters; optimizer= has "
                                  f"{len(order)}: pass the optimizer built as the trainer built it")
        return order
    fix = ("pass optimizer= (the trainer's optimizer, built as it was when it saved) with model=, or --model-only "
           "(model_only=True) to import the model alone")
    if model is None:
        raise InvalidArgument(f"{where} holds optimizer state keyed by position ({count} parameters), which only the "
                              f"model can name: {fix}")
    params = list(model.named_parameters())
    if len(params) != count:
        raise InvalidArgument(f"{where} holds optimizer state for {count} parameters, the model has {len(params)}: "
                              f"the optimizer was not made with model.parameters(); {fix}")
    for i, (name, p) in enumerate(params):
        for k, v in sd["state"].get(i, {}).items():
            if torch.is_tensor(v) and v.dim() >= 1 and tuple(v.shape) != tuple(p.shape):
                raise InvalidArgument(f"{where}: optimizer state {k!r} of parameter {i} has shape {tuple(v.shape)}, "
                                      f"the model's parameter {i} ({name!r}) {tuple(p.shape)}: the optimizer was not "
                                      f"made with model.parameters(); {fix}")
    return [n for n, _ in params]


def _load_source(source, format: str | None) -> tuple[Any, str, str]:
    """(the object ``source`` holds, its format, how messages name it)."""
    if isinstance(source, Mapping):
        return source, "state_dict", "the state dict given"
    try:
        path = os.fspath(source)
    except TypeError:
        raise InvalidArgument(f"source must be a path or a state dict, got {type(source).__name__}") from None
    fmt = detect_format(path) if format is None else format
    if fmt not in SOURCE_FORMATS:
        raise InvalidArgument(f"unknown source format {fmt!r}; choose one of {', '.join(SOURCE_FORMATS)}")
    return _load(path, fmt), fmt, f"{path!r}"


def _read(source, format: str | None, model_only: bool) -> tuple[_Source, str]:
    obj, fmt, where = _load_source(source, format)
    return _split(obj, where, model_only), fmt


def _as_numpy(key: str, value):
    """A nested export's entry as a numpy array (a tensor's own dtype; bfloat16 has none in numpy)."""
    if not torch.is_tensor(value):
        return value
    if value.dtype == torch.bfloat16:
        raise InvalidArgument(f"entry {key!r} is bfloat16, which a nested export never holds (its dense arrays "
                              "keep bfloat16 as int16 bits): export the store again with --layout nested")
    return value.detach().cpu().numpy()


def _refuse_seeded(st) -> None:
    """InvalidArgument if ``st`` holds a version: an import seeds a new store."""
    if st.versions():
        raise InvalidArgument(f"the store holds {len(st.versions())} version(s) already; an import seeds a new "
                              "store: import into a new path")


def _import_nested(store, obj, fmt: str, where: str, *, codec: str, codecs, step, meta) -> ImportReport:
    """``import_checkpoint`` of a nested cnrstore export: its tables, dense arrays and keyed tables as they
    are (cnrstore.nested_import), one version; a failed import leaves the store as ``import_checkpoint``'s."""
    flat, scalars = nested_import.flatten(obj)
    nested = nested_import.split({k: _as_numpy(k, v) for k, v in flat.items()}, where, scalars)
    st, created, before = _open_store(store)
    ok = False
    try:
        _refuse_seeded(st)
        version = nested_import.write(st, nested, codec=codec, codecs=codecs, step=step, meta=meta)
        infos = st.tables()
        ok = True
        return ImportReport(version=version, step=nested.step if step is None else step, source_format=fmt,
                            tables={n: (f"tables/{n}", *a.shape, infos[n].codec) for n, a in nested.tables.items()},
                            dense=tuple(nested.dense), nested=True,
                            keyed={n: (int(r.keys.size), int(r.values.shape[1]), infos[n].codec,
                                       tuple(r.columns)) for n, r in nested.keyed.items()})
    finally:
        if st is not store:
            st.close()
            if not ok:
                _undo(os.fspath(store), created, before)


def read_state_dict(source, format: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """``(model state dict, format)`` of ``source``: a path (``format`` None: detected) or a dict; the model
    state dict is the source itself or its ``"model"`` / ``"state_dict"`` entry (other entries are not
    looked at: ``import_checkpoint`` does that).

    A torch file is read with ``torch.load(weights_only=True)``: tensors and plain containers only, never
    arbitrary pickled objects."""
    src, fmt = _read(source, format, model_only=True)
    return src.state_dict, fmt


# -- choosing tables --------------------------------------------------------------------------------------
def _table_name(key: str) -> str:
    return "embedding" if key == "weight" else key[: -len(".weight")]


def _is_weight_key(key: str) -> bool:
    return key == "weight" or key.endswith(".weight")


def _embedding_like(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.is_floating_point() and t.shape[0] > 0 and t.shape[1] > 0


def select_tables(state_dict: Mapping, *, model: nn.Module | None = None, tables=None,
                  min_rows: int = DEFAULT_MIN_ROWS) -> dict[str, list[str]]:
    """Which entries of ``state_dict`` are embedding tables (module doc): ``{table name: [keys]}``; the first
    key is the one read, the others (a weight shared by several modules, ``model=`` only) are the same
    tensor under other names. Raises InvalidArgument when the choice is impossible."""
    if model is not None:
        if not isinstance(model, nn.Module):
            raise InvalidArgument(f"model must be a torch.nn.Module, got {type(model).__name__}")
        sd = model.state_dict()
        missing = sorted(set(sd) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(sd))
        out = {}
        for name, keys in embedding_tables(model).items():
            present = [k for k in keys if k in state_dict]
            if present:
                missing = [k for k in missing if k not in keys]  # one key of a shared weight suffices
                out[name] = present + [k for k in keys if k not in present]
        if missing or unexpected:
            raise InvalidArgument(f"the checkpoint does not hold the model's state: missing keys {missing[:5]}, "
                                  f"unexpected keys {unexpected[:5]}; pass the model it was saved from")
        for key, want in sd.items():
            if key in state_dict and tuple(state_dict[key].shape) != tuple(want.shape):
                raise InvalidArgument(f"{key!r} has shape {tuple(state_dict[key].shape)} in the checkpoint, "
                                      f"{tuple(want.shape)} in the model; pass the model it was saved from")
        for name, keys in out.items():
            if not state_dict[keys[0]].is_floating_point():
                raise InvalidArgument(f"embedding {name!r}: {keys[0]!r} has dtype {state_dict[keys[0]].dtype}; "
                                      "an embedding weight is floating point")
        return out
    if tables is not None:
        patterns = [tables] if isinstance(tables, str) else list(tables)
        chosen = []
        for pattern in patterns:
            hits = [k for k in state_dict if fnmatch.fnmatchcase(k, pattern)]
            if not hits:
                raise InvalidArgument(f"table pattern {pattern!r} matches no key of the checkpoint (keys: "
                                      f"{sorted(state_dict)[:8]}...)")
            chosen += [k for k in hits if k not in chosen]
        for key in chosen:
            if not _is_weight_key(key) or not _embedding_like(state_dict[key]):
                raise InvalidArgument(f"{key!r} (shape {tuple(state_dict[key].shape)}, {state_dict[key].dtype}) "
                                      "cannot be an embedding table: a table is a 2-D floating tensor keyed "
                                      "'<module path>.weight'; narrow the pattern")
    else:
        if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1:
            raise InvalidArgument(f"min_rows (--min-rows) must be a positive integer, got {min_rows!r}")
        named = {k for k in state_dict
                 if _is_weight_key(k) and any("emb" in part.lower() for part in k.split(".")[:-1])}
        for k in named:
            t = state_dict[k]
            if t.dim() == 2 and not t.is_floating_point():
                raise InvalidArgument(f"{k!r} is named like an embedding table but has dtype {t.dtype}; a table holds "
                                      "floating-point rows: convert it to float before saving, or name the tables "
                                      "with --table (tables=) so that it is stored as a dense array")
        chosen = [k for k, t in state_dict.items()
                  if _is_weight_key(k) and _embedding_like(t) and (k in named or t.shape[0] >= min_rows)]
    out = {}
    for key in chosen:
        name = _table_name(key)
        if name in out:
            raise InvalidArgument(f"keys {out[name][0]!r} and {key!r} would both be table {name!r}; pass tables= "
                                  "(--table) to choose one")
        out[name] = [key]
    return out


def _listed_tables(state_dict: Mapping, names, where: str) -> dict[str, list[str]]:
    """The tables a checkpoint-layout source lists (``"embedding_tables"``), each keyed ``"<name>.weight"``
    (``"weight"`` for ``"embedding"`` when the state dict has that key), as ``select_tables`` returns them."""
    out = {}
    for name in names:
        key = "weight" if name == "embedding" and "weight" in state_dict and "embedding.weight" not in state_dict \
            else f"{name}.weight"
        t = state_dict.get(key)
        if t is None or not _embedding_like(t):
            what = "is missing" if t is None else f"is {tuple(t.shape)} {t.dtype}, not a 2-D floating tensor"
            raise InvalidArgument(f"{where} lists embedding table {name!r}, but its weight {key!r} {what}; re-export "
                                  "it, or pass tables= (--table) naming the tables")
        out[name] = [key]
    return out


def _check_tensor(key: str, t: torch.Tensor) -> None:
    """InvalidArgument unless ``t`` is a plain dense tensor with data (module doc)."""
    if t.is_quantized:
        raise InvalidArgument(f"{key!r} is a quantized tensor ({t.dtype}); the store holds plain tensors: save "
                              "t.dequantize() instead")
    if getattr(t, "is_nested", False):
        raise InvalidArgument(f"{key!r} is a nested tensor; the store holds plain tensors: save a padded dense one")
    if t.layout != torch.strided:
        raise InvalidArgument(f"{key!r} is a sparse tensor (layout {t.layout}); the store holds dense tensors: save "
                              "t.to_dense() instead")
    if t.device.type == "meta":
        raise InvalidArgument(f"{key!r} is a meta tensor (a shape without data); save the materialized tensor")


def _check_finite(what: str, t: torch.Tensor) -> None:
    """InvalidArgument if a row of ``t`` (a table or row-wise state, written as float32) is not finite: the
    store refuses such rows, and the import checks before it creates anything."""
    n = t.shape[0]
    step = max(1, _CHUNK_ELEMENTS // max(1, t[:1].numel()))
    for start in range(0, n, step):
        part = t[start:start + step].detach().reshape(min(step, n - start), -1).to(torch.float32)
        bad = ~torch.isfinite(part).all(dim=1)
        if bool(bad.any()):
            row = start + int(bad.nonzero()[0, 0])
            raise InvalidArgument(f"{what}: row {row} is not finite (NaN or infinity, or beyond float32's range); "
                                  "a table's rows must be finite: fix the checkpoint before the import")


# -- writing ----------------------------------------------------------------------------------------------
def _numpy_dtype(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def _put_table(ck, name: str, t: torch.Tensor, codec: str, block_rows: int) -> None:
    """All rows of ``t`` as table ``name``, float32, in block-aligned chunks (one record per block)."""
    n, dim = t.shape
    step = max(block_rows, (_CHUNK_ELEMENTS // max(dim, 1)) // block_rows * block_rows)
    src = t.detach().reshape(n, dim)
    for start in range(0, n, step):
        part = src[start:start + step].to("cpu", torch.float32).contiguous()
        ck.put_rows(name, np.arange(start, start + part.shape[0], dtype=np.int64), part.numpy(), codec=codec)


def _optimizer_payload(state_dicts, param_names, table_of_key: dict[str, str], rows_of: dict[str, int]):
    """(payload entries, row-state tensors by table) for optimizer ``state_dicts`` whose parameters are named
    ``param_names`` (per optimizer, in ``param_groups`` order), as the Checkpointer's state blob holds them
    (``Checkpointer._state_blob``): a state tensor of an embedding weight whose leading dimension is the
    table's rows is moved to table ``"<table>.optim.<k>"``, a marker left in its place."""
    optims, row_tables = [], {}
    for sd, names in zip(state_dicts, param_names):
        state = {}
        for idx, st in sd["state"].items():
            if isinstance(idx, int) and not isinstance(idx, bool):
                name = names[idx] if 0 <= idx < len(names) else None
            else:
                name = idx if isinstance(idx, str) else None  # a name-keyed (torchrec) optimizer's state
            table = table_of_key.get(name) if name is not None else None
            if not isinstance(st, Mapping):
                raise InvalidArgument(f"optimizer state of parameter {idx!r} is a {type(st).__name__}, not a dict; "
                                      "re-export the checkpoint, or import with --model-only")
            entry = {}
            for k, v in st.items():
                if table is not None and torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == rows_of[table]:
                    sname = f"{table}.optim.{k}"
                    if sname in row_tables:
                        raise InvalidArgument(f"two optimizers hold state {k!r} of table {table!r}; the Checkpointer "
                                              "keeps one per table: import with one of them")
                    _check_tensor(f"optimizer state {k!r} of {name!r}", v)
                    row_tables[sname] = v.detach().reshape(v.shape[0], -1)
                    entry[k] = {ROW_MARK: sname, "dtype": str(v.dtype).split(".")[-1], "shape": tuple(v.shape)}
                else:
                    entry[k] = v
            state[idx] = entry
        optims.append({**{k: v for k, v in sd.items() if k != "state"}, "state": state})
    return optims, row_tables


def _live_optimizers(optimizers, model: nn.Module):
    """(state dicts, param names) of the ``optimizer=`` objects over ``model``'s parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    return ([opt.state_dict() for opt in optimizers],
            [[names.get(id(p)) for g in opt.param_groups for p in g["params"]] for opt in optimizers])


def _open_store(store):
    """(store, path the call created or None, entries of an existing non-store directory before the call or
    None): what to undo if the import fails."""
    if isinstance(store, _store.Store):
        return store, None, None
    try:
        path = os.fspath(store)
    except TypeError:
        raise InvalidArgument(f"store must be a cnrstore.Store or a path, got {type(store).__name__}") from None
    created, before = None, None
    if not os.path.exists(path):
        created = path
    elif os.path.isdir(path) and not os.path.exists(filenames.marker_path(path)):
        before = set(os.listdir(path))
    try:
        return _store.open(path, create=True), created, before
    except BaseException:
        _undo(path, created, before)
        raise


def _undo(path: str, created, before) -> None:
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    elif before is not None:
        for name in set(os.listdir(path)) - before:
            p = os.path.join(path, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(p)


def import_checkpoint(store, source, *, model: nn.Module | None = None, optimizer=None, codec: str = "fp32",
                      codecs: Mapping[str, str] | None = None, optimizer_codec: str = "fp32", tables=None,
                      min_rows: int = DEFAULT_MIN_ROWS, format: str | None = None, step: int | None = None,
                      meta: dict | None = None, model_only: bool = False) -> ImportReport:
    """Write ``source`` as the first version of ``store`` (a writable ``cnrstore.Store`` or a path, created
    if absent), in the Checkpointer's layout, so that ``Checkpointer(store, model, optimizer).restore()``
    loads it (module doc). ``codec`` is every table's codec, ``codecs`` overrides it per table name;
    ``optimizer`` (needs ``model``) is an Optimizer or a list of them over ``model``'s parameters whose
    current state is recorded (refused when the source holds optimizer state, unless ``model_only``);
    ``step`` and ``meta`` are the version's (default: the source's, if it has them). ``model_only`` imports
    the source's model state dict alone, ignoring its other entries (``ImportReport.ignored``); without it a
    source holding entries the import does not understand is refused.

    Raises InvalidArgument for a source that cannot be read or does not fit (with what to fix), a store
    that holds versions already, an unknown codec or a ``codecs`` entry naming no table; the store's errors
    otherwise. On failure the store holds no new version (and a store this call created is removed)."""
    codec_of = dict(codecs or {})
    for c in [codec, optimizer_codec, *codec_of.values()]:
        _codecs.get(c)  # unknown name -> InvalidArgument
    optimizers = as_optimizer_list(optimizer)
    if optimizers and model is None:
        raise InvalidArgument("optimizer= needs model=: the optimizer's state is recorded by the model's "
                              "parameter names")
    obj, fmt, where = _load_source(source, format)
    if nested_import.is_nested(obj):
        if model is not None or optimizers or tables is not None:
            raise InvalidArgument(f"{where} is a nested cnrstore export (its tables named as the store named them): "
                                  "model=, optimizer= and tables= (--table) do not apply; drop them")
        return _import_nested(store, obj, fmt, where, codec=codec, codecs=codec_of, step=step, meta=meta)
    src = _split(obj, where, bool(model_only))
    state_dict = src.state_dict
    if src.positional:  # its parameters named by optimizer= or model= (optimizer= is not recorded then)
        src.param_names = [_name_positional(src, model, optimizers, where)]
        optimizers = []
    if optimizers and src.optimizers:
        raise InvalidArgument(f"{where} holds the state of {len(src.optimizers)} optimizer(s) and optimizer= is "
                              "given too; drop optimizer= to import the source's, or pass model_only=True to "
                              "record optimizer='s")
    for key, t in state_dict.items():
        _check_tensor(key, t)
    if model is None and tables is None and src.tables is not None:
        chosen = _listed_tables(state_dict, src.tables, where)
    else:
        chosen = select_tables(state_dict, model=model, tables=tables, min_rows=min_rows)
    unknown = sorted(set(codec_of) - set(chosen))
    if unknown:
        raise InvalidArgument(f"codecs= names {unknown}, which are not tables of this import (tables: "
                              f"{sorted(chosen)}); name tables by module path, e.g. 'emb.0'")
    consumed = {k for keys in chosen.values() for k in keys}
    target = model.state_dict() if model is not None else {}
    dense = {}
    for key, t in state_dict.items():
        if key in consumed:
            continue
        if key in target and t.dtype != target[key].dtype:
            if t.is_complex() and not target[key].is_complex():
                raise InvalidArgument(f"{key!r} is {t.dtype} in the checkpoint, {target[key].dtype} in the model: the "
                                      "cast would drop the imaginary part; pass the model it was saved from")
            t = t.to(target[key].dtype)
        dense[key] = t
    for key, t in dense.items():
        if t.dtype != torch.bfloat16 and not _numpy_dtype(t.dtype):
            raise InvalidArgument(f"{key!r} has dtype {t.dtype}, which a dense array cannot hold exactly; convert "
                                  "it before the import")
        arguments.dense_size(DENSE_PREFIX + key, t)
    weights = {name: state_dict[keys[0]] for name, keys in chosen.items()}
    if model is not None:  # a shared weight's keys hold one tensor: check the copies agree
        for name, keys in chosen.items():
            for k in keys[1:]:
                if k in state_dict and not torch.equal(state_dict[k], weights[name]):
                    raise InvalidArgument(f"{keys[0]!r} and {k!r} are one shared weight in the model but differ in "
                                          "the checkpoint")
    table_of_key = {k: name for name, keys in chosen.items() for k in keys}
    rows_of = {name: int(w.shape[0]) for name, w in weights.items()}
    if optimizers:
        opt_sds, param_names = _live_optimizers(optimizers, model)
    else:
        opt_sds, param_names = src.optimizers, src.param_names or []
    optims, row_tables = _optimizer_payload(opt_sds, param_names, table_of_key, rows_of)
    for name, w in weights.items():
        arguments.table_shape(name, int(w.shape[0]), int(w.shape[1]))
        _check_finite(f"table {name!r} ({chosen[name][0]!r})", w)
    for name, v in row_tables.items():
        _check_finite(f"optimizer state table {name!r}", v)
    step = src.step if step is None else step
    meta = src.meta if meta is None else meta
    if src.scalars:  # (a trainer's "epoch" and such: into the version's meta, beside what meta= says)
        meta = {**src.scalars, **(meta or {})}
    arguments.step_arg(step)
    arguments.check_meta(meta)
    payload = {"format": PAYLOAD_FORMAT, "mode": "imported", "tables": list(chosen),
               "dense_dtypes": {k: str(v.dtype).split(".")[-1] for k, v in dense.items()},
               "optimizers": optims, "extra": dict(src.extra), "param_names": param_names,
               "imported": {"format": fmt, "source": None if isinstance(source, Mapping) else os.fspath(source),
                            "version": src.version}}
    blob = _payload.encode(payload, what="the imported checkpoint's state")
    if blob.nbytes > arguments.max_dense_bytes():
        raise InvalidArgument(f"the optimizer state outside the embedding tables (and extra) pickles to "
                              f"{blob.nbytes:,} bytes, more than one dense record holds "
                              f"({arguments.max_dense_bytes():,}); import with --model-only")

    st, created, before = _open_store(store)
    ok = False
    try:
        _refuse_seeded(st)
        existing = st.tables()
        specs = {name: (w.shape[0], w.shape[1], codec_of.get(name, codec)) for name, w in weights.items()}
        specs.update({name: (v.shape[0], v.shape[1], optimizer_codec) for name, v in row_tables.items()})
        for name, (rows, dim, _c) in specs.items():
            info = existing.get(name)
            if info is not None and (info.num_rows, info.dim) != (rows, dim):
                raise InvalidArgument(f"table {name!r} exists in the store with {info.num_rows} x {info.dim}, the "
                                      f"checkpoint's is {rows} x {dim}; import into a new store")
        for name, (rows, dim, c) in specs.items():
            if name not in existing:
                st.create_table(name, int(rows), int(dim), codec=c)
        infos = st.tables()
        with st.checkpoint(step=step, meta=meta) as ck:
            for name, w in weights.items():
                _put_table(ck, name, w, specs[name][2], infos[name].block_rows)
            for name, v in row_tables.items():
                _put_table(ck, name, v, optimizer_codec, infos[name].block_rows)
            for key, t in dense.items():
                ck.put_dense(DENSE_PREFIX + key, dense_copy(t))
            ck.put_dense(STATE_BLOB, blob)
        ok = True
        return ImportReport(version=ck.version, step=step, source_format=fmt,
                            tables={name: (chosen[name][0], *specs[name]) for name in weights},
                            dense=tuple(dense), optimizer_tables=tuple(row_tables), optimizers=len(optims),
                            extra=tuple(src.extra), ignored=src.ignored)
    finally:
        if st is not store:
            st.close()
            if not ok:
                _undo(os.fspath(store), created, before)
