"""The ``cnrstore`` command: inspect, verify and maintain a store offline.

    cnrstore ls STORE [--json]                      versions: step, time, bytes, read-chain length
    cnrstore info STORE [--json]                    tables, codecs, disk use, live ratio
    cnrstore verify STORE [--json]                  every checksum and the index (exit 1 on problems)
    cnrstore compact STORE [--version V]            materialize baselines (default: newest version)
    cnrstore retain STORE --keep-last N             drop all but the newest N versions
    cnrstore gc STORE                               reclaim space of dropped and shadowed data
    cnrstore export STORE --format F OUT [--version V]   fp32 tables + dense arrays: torch|safetensors|npz
    cnrstore rows STORE TABLE ROW... [--version V]  print rows
    cnrstore repair STORE [--json]                  rebuild a lost or damaged index from the segment log

``ls`` and ``verify`` also take the root of a multi-rank job (``cnrstore.distributed``): they list its
global versions, and verify its manifests and every rank store they name. The other commands take one
rank's store (``ROOT/gen-G/rank-R``).

Exit status (every failure prints one line on stderr: the error type, what happened and what to do):

    0    success
    1    ``verify`` found damage: a bad checksum, a corrupt or missing store marker beside store files,
         a missing or damaged index (the store cannot be opened), a missing segment ...; or ``repair``
         could not recover every version it found. Only verify and repair exit 1.
    2    anything else that stopped a command: a usage error (bad option, --version out of range), not a
         store at all (no marker and no store files), locked by a trainer, unknown version or table, an
         export path that cannot be written (missing or read-only directory, disk full), a gc that a
         full disk stopped part way (what needed no space was reclaimed: see the report), another OS error
    130  interrupted (Ctrl-C); an interrupted export leaves no partial file

Maintenance commands need the store not to be open for writing elsewhere: run them while no trainer
holds it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from . import compaction
from . import filenames
from .errors import CnrError, CorruptionError, InvalidArgument, StoreNotFound
from .export import FORMATS, check_path, export
from .repair import repair as repair_store
from .distributed import manifest as dist_manifest
from .distributed.verify import verify_root
from .store import Store, open as open_store


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, stream=None):
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label} [{bar:<30}] {done}/{total} {frac:6.1%}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def _versions_rows(store: Store) -> list[dict]:
    """One row per version; every version's read-chain length comes from one pass over the row index
    (``compaction.versions_with_read_chains``), so a listing is linear in versions and index entries."""
    rows = []
    for v, info, chain in compaction.versions_with_read_chains(store.engine):
        rows.append({
            "version": v,
            "step": info["step"],
            "created": info["created"],
            "bytes": info["bytes"],
            "tables": list(info["tables"]),
            "read_chain": chain,
        })
    return rows


def _print_versions(args, rows: list[dict], header: str, noun: str, rest) -> int:
    """Print ``rows`` as JSON (``--json``) or as a table: version, step, creation time, then ``rest(row)``."""
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(header)
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created"]))
        step = "-" if r["step"] is None else r["step"]
        print(f"{r['version']:>8} {step:>10} {created:<20} {rest(r)}")
    print(f"{len(rows)} {noun}")
    return 0


def _is_root(path: str) -> bool:
    return dist_manifest.Root(path).exists()


def _refuse_root(args) -> None:
    if _is_root(args.store):
        raise InvalidArgument(f"{args.store} is the root of a multi-rank job; `cnrstore {args.command}` works on "
                              f"one rank's store: {args.store}/gen-GGGGGG/rank-RRRRR (see `cnrstore ls {args.store}`)")


def cmd_ls_root(args) -> int:
    gvs = dist_manifest.Root(args.store).versions()
    rows = [{"version": g.version, "step": g.step, "created": g.created, "world_size": g.world_size,
             "generation": g.generation, "local_versions": list(g.local_versions), "stores": list(g.stores)}
            for g in gvs]
    return _print_versions(args, rows, f"{'global':>8} {'step':>10} {'created (UTC)':<20} {'ranks':>5} {'gen':>4}  "
                                       "local versions", "global version(s)",
                           lambda r: f"{r['world_size']:>5} {r['generation']:>4}  {' '.join(map(str, r['local_versions']))}")


def cmd_verify_root(args) -> int:
    report = verify_root(args.store, progress=Progress("verify"))
    if args.json:
        print(json.dumps(report.__dict__, indent=2))
    else:
        for problem in report.problems:
            print(f"problem: {problem}")
        print(f"{'ok' if report.ok else 'DAMAGED'}: {report.global_versions} global version(s), "
              f"{report.stores_checked} rank store(s), {report.records_checked} records, "
              f"{report.bytes_checked:,} bytes checked, {len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def cmd_ls(args) -> int:
    if _is_root(args.store):
        return cmd_ls_root(args)
    with open_store(args.store, readonly=True) as store:
        rows = _versions_rows(store)
    return _print_versions(args, rows, f"{'version':>8} {'step':>10} {'created (UTC)':<20} {'bytes':>14} {'chain':>6}  "
                                       "tables", "version(s)",
                           lambda r: f"{r['bytes']:>14,} {r['read_chain']:>6}  {', '.join(r['tables'])}")


def cmd_info(args) -> int:
    _refuse_root(args)
    with open_store(args.store, readonly=True) as store:
        tables = store.tables()
        stats = store.stats()
    live_ratio = stats["live_bytes"] / stats["segment_bytes"] if stats["segment_bytes"] else 1.0
    if args.json:
        print(json.dumps({"tables": {n: t.__dict__ for n, t in tables.items()}, "stats": stats,
                          "live_ratio": live_ratio}, indent=2))
        return 0
    print(f"store {args.store}")
    print(f"{'table':<24} {'rows':>12} {'dim':>6} {'codec':<10} {'block_rows':>10}")
    for t in tables.values():
        print(f"{t.name:<24} {t.num_rows:>12,} {t.dim:>6} {t.codec:<10} {t.block_rows:>10}")
    for key in ("versions", "bytes_written", "bytes_on_disk", "live_bytes", "index_bytes", "max_read_chain"):
        value = stats[key]
        print(f"{key:<16} {value:>16,}" if isinstance(value, int) else f"{key:<16} {value}")
    print(f"{'live_ratio':<16} {live_ratio:>16.1%}")
    for key, what in (("write_amplification", "all bytes appended / the checkpoints' own rows"),
                      ("space_amplification", "bytes on disk / live bytes")):
        value = stats[key]
        shown = f"{value:>16.3f}" if value is not None else f"{'-':>16}"
        print(f"{key:<20} {shown}  ({what})")
    return 0


def _store_like(path: str) -> bool:
    """Whether ``path`` holds what a store holds (its index or segments directory) without its marker."""
    return any(os.path.exists(p) for p in (filenames.index_dir(path), filenames.segments_dir(path)))


def _print_verify(args, ok: bool, problems: list[str], records: int, nbytes: int) -> int:
    if args.json:
        print(json.dumps({"ok": ok, "problems": problems, "records_checked": records, "bytes_checked": nbytes},
                         indent=2))
    else:
        for problem in problems:
            print(f"problem: {problem}")
        print(f"{'ok' if ok else 'DAMAGED'}: {records} records, {nbytes:,} bytes checked, "
              f"{len(problems)} problem(s)")
    return 0 if ok else 1


def cmd_verify(args) -> int:
    """Exit 1 whenever the store is damaged, including damage that keeps it from opening (a corrupt
    marker, a missing or damaged index: CorruptionError) and a missing marker beside store files;
    exit 2 (via main) only when the path is not a store at all, or for usage and OS errors."""
    if _is_root(args.store):
        return cmd_verify_root(args)
    try:
        store = open_store(args.store, readonly=True)
    except CorruptionError as exc:
        hint = "" if "cnrstore repair" in str(exc) else "; restore it from a copy or recover what is readable"
        return _print_verify(args, False, [f"the store cannot be opened: {exc} ({type(exc).__name__}){hint}"],
                             0, 0)
    except StoreNotFound:
        if not _store_like(args.store):
            raise
        return _print_verify(args, False, [f"store marker {filenames.marker_path(args.store)} is missing "
                                           "but the directory holds store files (index/, segments/)"], 0, 0)
    with store:
        try:
            report = store.verify(progress=Progress("verify"))
        except CorruptionError as exc:  # verify reports damage; this is a backstop for what it did not foresee
            return _print_verify(args, False, [f"verify stopped at damage it could not step over: {exc}"], 0, 0)
    return _print_verify(args, report.ok, report.problems, report.records_checked, report.bytes_checked)


def cmd_compact(args) -> int:
    _refuse_root(args)
    with open_store(args.store) as store:
        report = store.compact(args.version, progress=Progress("compact"))
    print(f"compacted at version {report.version}: {report.blocks_materialized} block baseline(s), "
          f"{report.bytes_written:,} bytes written")
    return 0


def cmd_retain(args) -> int:
    _refuse_root(args)
    with open_store(args.store) as store:
        dropped = store.retain(keep_last=args.keep_last)
    print(f"dropped {len(dropped)} version(s)" + (f": {', '.join(map(str, dropped))}" if dropped else "")
          + "; run `cnrstore gc` to reclaim their space")
    return 0


def cmd_gc(args) -> int:
    _refuse_root(args)
    with open_store(args.store) as store:
        report = store.gc(progress=Progress("gc"))
    print(f"reclaimed {report.bytes_reclaimed:,} bytes ({report.segments_deleted} segment(s) deleted, "
          f"{report.segments_rewritten} rewritten, {report.bytes_copied:,} bytes copied)"
          + (f"; {report.bytes_pending:,} bytes wait for readers to finish" if report.bytes_pending else ""))
    if report.incomplete:
        print(f"cnrstore gc: incomplete: {report.incomplete}", file=sys.stderr)
        return 2
    return 0


def cmd_export(args) -> int:
    _refuse_root(args)
    check_path(args.out)  # before the (long) restore: a bad path fails at once
    with open_store(args.store, readonly=True) as store:
        snapshot = store.restore(args.version)
    export(snapshot, args.format, args.out)
    print(f"exported version {snapshot.version} ({len(snapshot.tables)} table(s), {len(snapshot.dense)} dense "
          f"array(s)) to {args.out} as {args.format}")
    return 0


def cmd_rows(args) -> int:
    _refuse_root(args)
    with open_store(args.store, readonly=True) as store:
        values = store.read_rows(args.table, args.row, args.version)
    with np.printoptions(precision=6, suppress=False, linewidth=160):
        for row, vec in zip(args.row, values):
            print(f"{row}: {vec}")
    return 0


def cmd_repair(args) -> int:
    _refuse_root(args)
    report = repair_store(args.store, progress=Progress("repair"))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in report.bad_records:
            print(f"bad record: {line}")
        for line in report.notes:
            print(f"note: {line}")
        for v, why in sorted(report.versions_lost.items()):
            print(f"NOT RECOVERED: {why if why.startswith('version') else f'version {v}: {why}'}")
        if report.versions_dropped:
            print(f"left dropped (retain dropped them before): {len(report.versions_dropped)} version(s)")
        if report.old_index:
            print(f"the previous index was moved to {report.old_index}")
        print(f"{'ok' if report.ok else 'DAMAGED'}: {len(report.versions_recovered)} version(s) recovered, "
              f"{len(report.versions_lost)} not recovered; {len(report.tables_recovered)} table(s); "
              f"{report.segments_scanned} segment(s), {report.records_scanned} records scanned, "
              f"{len(report.bad_records)} bad")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cnrstore", description="Inspect, verify and maintain a cnrstore checkpoint store.",
        epilog="Exit status: 0 ok; 1 verify found damage (including a store that cannot be opened because "
               "its marker or index is corrupt or missing) or repair could not recover every version; 2 any other error (usage, not a store, locked, "
               "unknown version, export path not writable, disk full, OS error), with one line on stderr "
               "saying what to do; 130 interrupted.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("store", help="path of the store (ls, verify: or of a multi-rank job's root)")
        p.set_defaults(func=func)
        return p

    add("ls", cmd_ls, "list versions: step, creation time, bytes appended, read-chain length").add_argument(
        "--json", action="store_true", help="print JSON")
    add("info", cmd_info, "tables, codecs, disk use, live ratio, write and space amplification").add_argument(
        "--json", action="store_true", help="print JSON")
    add("verify", cmd_verify, "check every checksum and the index against the log (exit 1 on problems)"
        ).add_argument("--json", action="store_true", help="print JSON")
    add("compact", cmd_compact, "materialize baselines at a version (default: the newest)").add_argument(
        "--version", type=int, default=None, help="version to compact at")
    add("retain", cmd_retain, "drop all but the newest N versions").add_argument(
        "--keep-last", type=int, required=True, metavar="N", help="versions to keep")
    add("gc", cmd_gc, "reclaim the space of dropped and shadowed data")
    p = add("export", cmd_export, "write a version's fp32 tables and dense arrays to a file")
    p.add_argument("--format", choices=FORMATS, required=True, help="file format")
    p.add_argument("--version", type=int, default=None, help="version to export (default: the newest)")
    p.add_argument("out", help="output file")
    add("repair", cmd_repair, "rebuild the index from the segment log (after index loss or damage); keeps "
        "every version it can prove whole and says which it cannot (exit 1 then)").add_argument(
        "--json", action="store_true", help="print JSON")
    p = add("rows", cmd_rows, "print rows of a table")
    p.add_argument("table", help="table name")
    p.add_argument("row", type=int, nargs="+", help="row ids")
    p.add_argument("--version", type=int, default=None, help="version to read (default: the newest)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring). Never shows a traceback for
    a store error, an OS error, a closed pipe or Ctrl-C."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CnrError as exc:
        print(f"cnrstore {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `cnrstore ls | head`: the reader is gone; say nothing more
        _silence_stdout()
        return 0
    except OSError as exc:
        where = f" ({exc.filename})" if getattr(exc, "filename", None) and str(exc.filename) not in str(exc) else ""
        print(f"cnrstore {args.command}: {type(exc).__name__}: {exc}{where}; check that the path exists and is "
              "accessible, and the file system's health and free space", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cnrstore {args.command}: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
