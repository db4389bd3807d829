"""Offline checks of a distributed root (``cnrstore verify ROOT``): every manifest verifies, every rank
store a manifest names verifies, and holds the local version the manifest names."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import store as _store
from ..errors import CnrError
from .manifest import Root

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
    for number in root.version_numbers():  # by file name: a manifest that does not verify is listed too
        try:
            gv = root.read(number)
        except CnrError as exc:
            report.problem(f"global version {number}: {type(exc).__name__}: {exc}")
            continue
        report.global_versions += 1
        for rel, v in zip(gv.stores, gv.local_versions):
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
