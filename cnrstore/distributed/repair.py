"""Rebuild a bucket root's pointer from its objects (``cnrstore --remote URL repair DIR`` on a root,
``cnrstore.distributed.repair_root``), as leveldb's ``RepairDB`` rebuilds a database from its files.

A root's pointer (``ROOT``) lists its generations and global versions; it is never deleted, but an operator's
``rm``, a lifecycle rule or a partial copy can lose it while every other object is there. Readers then get
``RemoteObjectMissing`` and no job may start on the root (``RemoteRoot.pointer``: no pointer, no claim).
The repair reads what is there and writes a new pointer:

- every manifest under ``global/`` is read and checked (its checksum, its fields); for each global version
  it names, the generation's ``PLAN`` must be there, and each rank store (``gen-G/rank-R``, read through a
  read cache under ``DIR``) must hold the local version the manifest names;
- the global versions that pass are listed, in order; one version number with manifests of several jobs
  (a stale job's, unlisted, left by a crash) keeps the manifest of the job that wrote the newest version
  that passes (then: the most of them), and the others are reported;
- every generation with a ``PLAN`` is listed (none is doomed: a repair deletes nothing), and the next
  generation number is past all of them;
- the pointer names the repair as its owner: a job started afterwards claims the root as it claims any;
- first, each rank store (``gen-G/rank-R``) whose own pointer ``CURRENT`` is missing beside its objects, or
  damaged, gets it rebuilt from its newest snapshot that verifies (``cnrstore.maintenance.remote_pointer``:
  one conditional put each), whether or not ``ROOT`` needs a repair: a lost rank-store pointer makes every
  global version that reads it unreadable as surely as a lost ``ROOT``.

The new pointer is written by one conditional put (only if there is still none, or it is still the damaged
one that was read): the repair's only write to the bucket, so a repair killed at any point leaves the root as
it found it or repaired, and running it again gives the same pointer. Nothing is ever deleted. A root whose
pointer is there and decodes is left as it is (``RootRepairReport.rebuilt`` False).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import CnrError, InvalidArgument, RemoteConflict, RemoteObjectMissing
from ..maintenance.remote_pointer import pointer_needs_repair, repair_pointer
from .manifest import GLOBAL_DIR, MARKER, PLAN_FILE, ROOT_POINTER
from .remote_root import RemoteRoot, RootPointer, decode_pointer

__all__ = ["RootRepairReport", "repair_root"]

_MANIFEST = re.compile(r"^g-(\d{12})-([0-9a-f]{1,64})\.cnrg$")
_GEN = re.compile(r"^gen-(\d{6})$")


@dataclass
class RootRepairReport:
    """What ``repair_root`` did: ``rebuilt`` (a new pointer was written; False: the pointer was there and
    sound, nothing done), the global ``versions`` it lists, the ``generations``, the manifests and rank
    versions that did not pass (``problems``, one line each: not listed), the pointer found before
    (``previous``: "missing", "damaged: ..." or "sound"), and the rank stores whose own pointer was rebuilt
    (``rank_stores``: one line each, ``gen-G/rank-R: ...``)."""

    rebuilt: bool = False
    previous: str = "missing"
    versions: list[int] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rank_stores: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"rebuilt": self.rebuilt, "previous": self.previous, "versions": self.versions,
                "generations": self.generations, "problems": self.problems, "rank_stores": self.rank_stores}


def repair_root(root: RemoteRoot, *, progress=None) -> RootRepairReport:
    """Rebuild ``root``'s pointer from its manifests, plans and rank stores when it is missing or damaged
    (module doc); ``progress(done, total)`` follows the manifests checked. InvalidArgument if the prefix
    holds no root (no marker)."""
    if not isinstance(root, RemoteRoot):
        raise InvalidArgument("repair_root rebuilds the pointer of a root in a bucket (a RemoteRoot); a local "
                              "root's versions are its manifest files")
    if root.objects.size(MARKER) is None:
        raise InvalidArgument(f"{root.remote} holds no multi-rank root (no {MARKER}): nothing to repair")
    report = RootRepairReport()
    _rank_store_pointers(root, report)
    tag = None
    try:
        data, tag = root.objects.get_tagged(ROOT_POINTER)
    except RemoteObjectMissing:
        pass
    else:
        try:
            decode_pointer(data, root.objects.where(ROOT_POINTER), tag)
            report.previous = "sound"
            return report
        except CnrError as exc:
            report.previous = f"damaged: {type(exc).__name__}: {exc}"
    generations = _generations(root, report)
    chosen = _versions(root, set(generations), report, progress)
    report.versions = [v for v, _job in chosen]
    report.generations = generations
    pointer = RootPointer(root.job, tuple(generations), (), max(generations, default=0) + 1, tuple(chosen))
    try:
        root.objects.put_if(ROOT_POINTER, pointer.encode(), tag)
    except RemoteConflict as exc:
        raise RemoteConflict(f"{root.objects.where(ROOT_POINTER)} was written by someone else while the repair "
                             f"ran ({exc}); run the repair again (it leaves a sound pointer as it is)") from exc
    report.rebuilt = True
    return report


def _rank_store_pointers(root: RemoteRoot, report: RootRepairReport) -> None:
    """Rebuild the pointer of every rank store prefix that needs it (module doc); one that cannot be rebuilt is
    a problem (the global versions reading it then fail their check, and are not listed)."""
    rels = sorted({"/".join(parts[:2]) for key in root.objects.list_tree("")
                   if len(parts := key.split("/")) > 2 and _GEN.match(parts[0]) and parts[1].startswith("rank-")})
    for rel in rels:
        objects = root.objects.sub(rel)
        try:
            if not pointer_needs_repair(objects):
                continue
            rebuilt = repair_pointer(objects)
        except CnrError as exc:
            report.problems.append(f"{rel}: its pointer is missing or damaged and could not be rebuilt: "
                                   f"{type(exc).__name__}: {exc}")
            continue
        report.rank_stores.append(f"{rel}: its pointer was {rebuilt.previous}; rebuilt from "
                                  f"{rebuilt.snapshot}, listing local versions {rebuilt.versions}")
        report.problems.extend(f"{rel}: {p}" for p in rebuilt.problems)


def _generations(root: RemoteRoot, report: RootRepairReport) -> list[int]:
    """The generations whose PLAN is there and reads as a plan."""
    found = sorted({int(m.group(1)) for key in root.objects.list_tree("")
                    if (m := _GEN.match(key.split("/", 1)[0]))})
    out = []
    for g in found:
        try:
            root.plan_of(g)
        except CnrError as exc:
            report.problems.append(f"generation {g}: its {PLAN_FILE} does not read ({type(exc).__name__}: {exc}); "
                                   "its folder is left as it is, unlisted")
            continue
        out.append(g)
    return out


def _versions(root: RemoteRoot, generations: set, report: RootRepairReport, progress) -> list[tuple[int, str]]:
    """(number, job) of each global version that passes (module doc), ascending."""
    keys = sorted((int(m.group(1)), m.group(2)) for name in root.objects.list(GLOBAL_DIR)
                  if (m := _MANIFEST.match(name)))
    passed: dict[int, list[str]] = {}
    held: dict[str, set] = {}  # rank store -> its local versions (read once)
    for i, (number, job) in enumerate(keys):
        where = f"global version {number} (job {job})"
        try:
            gv = root.manifest(number, job)
            if gv.generation not in generations:
                raise CnrError(f"its generation {gv.generation} has no plan")
            for rel, local in zip(root.rank_stores(gv), gv.local_versions):
                if rel not in held:
                    with root.open_store(rel, readonly=True) as st:
                        held[rel] = {vi.version for vi in st.versions()}
                if local not in held[rel]:
                    raise CnrError(f"{rel} does not hold its local version {local}")
        except CnrError as exc:
            report.problems.append(f"{where}: not listed: {type(exc).__name__}: {exc}")
        else:
            passed.setdefault(number, []).append(job)
        if progress is not None:
            progress(i + 1, len(keys))
    newest_of: dict[str, tuple[int, int]] = {}  # job -> (its newest version that passed, how many passed)
    for number, jobs in passed.items():
        for job in jobs:
            newest, count = newest_of.get(job, (0, 0))
            newest_of[job] = (max(newest, number), count + 1)
    chosen = []
    for number in sorted(passed):
        jobs = sorted(passed[number], key=lambda j: (newest_of[j], j))
        chosen.append((number, jobs[-1]))
        for other in jobs[:-1]:
            report.problems.append(f"global version {number} (job {other}): not listed: job {jobs[-1]} wrote "
                                   "the same number later")
    return chosen
