"""``cnrstore migrate-payload``: rewrite, once, the trainer payloads of a store written before payload
format 2 as data (docs/FORMAT.md "Trainer payload", docs/DESIGN.md "Security").

A version's payload (dense array ``"torch.state"``) that ``torch.load(weights_only=True)`` refuses is
unpickled in full -- which runs whatever code its pickle names, so only with ``trust_pickle=True``: the
caller vouches that it wrote every byte of the store --, its numpy scalars become the Python numbers they
subclass or hold (``np.float64`` -> ``float``), then it is checked to be data (``payload.encode``) and
written back as a new DENSE record of the same version (``Store.replace_dense``). Nothing else
changes: tables, dense arrays, steps and metadata read exactly as before. Without ``trust_pickle`` the
command only lists the versions it would rewrite (a static scan: nothing is unpickled).
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgument, MissingRows, UnsafePayload
from . import payload as _payload

__all__ = ["MigrateReport", "migrate_payloads"]


@dataclass
class MigrateReport:
    """Versions whose payload holds a pickle naming code (``unsafe``: version -> names), those rewritten as
    data (``rewritten``), and those already data (``clean``). ``dry_run``: nothing was unpickled or written."""

    path: str
    dry_run: bool
    unsafe: dict[int, list[str]] = field(default_factory=dict)
    rewritten: list[int] = field(default_factory=list)
    clean: list[int] = field(default_factory=list)


def _plain(obj):
    """``obj`` with numpy scalars as Python numbers, containers rebuilt; everything else as it is."""
    if isinstance(obj, np.generic):
        return obj.item()
    t = type(obj)
    if t in (dict, OrderedDict):
        return t((_plain(k), _plain(v)) for k, v in obj.items())
    if t in (list, tuple, set):
        return t(_plain(v) for v in obj)
    return obj


def _is_unsafe(blob, version) -> list[str] | None:
    """What the pickle names beyond data (a list, maybe empty when torch's own unpickler refuses it), or None
    when the payload reads as data."""
    try:
        _payload.decode(blob, version)
    except UnsafePayload as exc:
        return list(exc.names)
    return None


def migrate_payloads(path, *, trust_pickle: bool = False, progress=None) -> MigrateReport:
    """Rewrite every payload of the store at ``path`` that is not data (module doc). The store must not be
    open for writing elsewhere. Raises InvalidArgument when an unpickled payload holds objects that are not
    data (name them with ``torch.serialization.add_safe_globals`` in this process, or restore that version
    with ``trust_pickle=True`` and save again)."""
    from .. import store as _store

    path = os.fspath(path)
    report = MigrateReport(path=path, dry_run=not trust_pickle)
    with _store.open(path, readonly=not trust_pickle) as st:
        versions = [vi.version for vi in st.versions() if _payload.STATE_BLOB in vi.dense]
        for i, v in enumerate(versions):
            try:
                blob = st.read_dense(_payload.STATE_BLOB, v)
            except MissingRows:
                continue
            names = _is_unsafe(blob, v)
            if names is None:
                report.clean.append(v)
            else:
                report.unsafe[v] = names
                if trust_pickle:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)
                        data = _payload.decode(blob, v, trust_pickle=True)
                    try:
                        new = _payload.encode(_plain(data), what=f"version {v}'s trainer payload")
                    except InvalidArgument as exc:
                        raise InvalidArgument(f"{exc}; versions rewritten so far: {report.rewritten}") from None
                    st.replace_dense(_payload.STATE_BLOB, v, new)
                    report.rewritten.append(v)
            if progress is not None:
                progress(i + 1, len(versions))
    return report
