"""Offline checks of a distributed root (``cnrstore verify ROOT``, ``cnrstore --remote URL verify DIR``): every
manifest verifies, every rank store a manifest names verifies, and holds the local version the manifest names.
A bucket root's rank stores are read through ``RemoteRoot.open_store`` (read caches under its local directory)."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def verify_root(root, progress=None) -> RootReport:
    """Check ``root`` (a ``Root``, local or in a bucket, or a local root's path); problems are collected, not
    raised (a missing root still raises)."""
    root = root if isinstance(root, Root) else Root(root)
    root.check()
    report = RootReport()
    gvs = []
    for number in root.version_numbers():  # by file name: a manifest that does not verify is listed too
        try:
            gvs.append(root.read(number))
        except CnrError as exc:
            report.problem(f"global version {number}: {type(exc).__name__}: {exc}")
    report.global_versions = len(gvs)
    referenced = root.named_local_versions(gvs)
    for i, (rel, wanted) in enumerate(sorted(referenced.items())):
        try:
            with root.open_store(rel, readonly=True) as st:
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
