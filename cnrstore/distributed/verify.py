"""Offline checks of a distributed root (``cnrstore verify ROOT``): every manifest verifies, every rank
store a manifest names verifies, and holds the local version the manifest names."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .. import store as _store
from ..errors import CnrError
from .manifest import GLOBAL_DIR, Root

__all__ = ["RootReport", "verify_root"]


@dataclass
class RootReport:
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    global_versions: int = 0
    stores_checked: int = 0
    records_checked: int = 0
    bytes_checked: int = 0

    def problem(self, text: str) -> None:
        self.ok = False
        self.problems.append(text)


def verify_root(path, progress=None) -> RootReport:
    """Check the root at ``path``; problems are collected, not raised (a missing root still raises)."""
    root = Root(path)
    root.check()
    report = RootReport()
    referenced: dict[str, set[int]] = {}
    for name in sorted(os.listdir(os.path.join(root.path, GLOBAL_DIR))):
        m = re.match(r"^g-(\d{12})\.cnrg$", name)
        if not m:
            continue
        try:
            gv = root.read(int(m.group(1)))
        except CnrError as exc:
            report.problem(f"global version {int(m.group(1))}: {type(exc).__name__}: {exc}")
            continue
        report.global_versions += 1
        for rank, (rel, v) in enumerate(zip(gv.stores, gv.local_versions)):
            referenced.setdefault(rel, set()).add(v)
    for i, (rel, wanted) in enumerate(sorted(referenced.items())):
        try:
            with _store.open(root.store_path(rel), readonly=True) as st:
                sub = st.verify()
                have = {vi.version for vi in st.versions()}
        except CnrError as exc:
            report.problem(f"{rel}: {type(exc).__name__}: {exc}")
            continue
        report.stores_checked += 1
        report.records_checked += sub.records_checked
        report.bytes_checked += sub.bytes_checked
        for p in sub.problems:
            report.problem(f"{rel}: {p}")
        for v in sorted(wanted - have):
            report.problem(f"{rel}: local version {v}, named by a global version, is missing")
        if progress is not None:
            progress(i + 1, len(referenced))
    return report
