"""The ``cnrstore`` command: inspect, verify and maintain a store offline.

    cnrstore ls STORE|ROOT [--long] [--json]             versions: step, time, bytes, read chain, tables
                                 (--long: each version's meta too)
    cnrstore info STORE|ROOT [--json]                    tables, codecs, disk use, live ratio, amplification;
                                 of a root: owner job, generations and their plans, global versions
    cnrstore verify STORE|ROOT [--json] [--progress]     every checksum and the index (exit 1 on problems)
    cnrstore rows STORE TABLE ROW... [--version V] [--json]   print rows as the store reads them
    cnrstore diff STORE V1 [V2] [--rows] [--json]        rows changed from V1 to V2 (default: newest) per table,
                                 their bytes in the codec, dense arrays put; V1 0: everything (Store.changes)
    cnrstore compact STORE [--version V] [--json] [--progress]   materialize baselines (default: newest)
    cnrstore retain STORE|ROOT [--keep-last N] [--keep-every-n-steps N] [--keep V]... [--drop V]... [--take-over]
                                 [--json] [--progress]
                                 drop the versions no rule keeps (the newest is always kept); a root: --keep-last
    cnrstore gc STORE|ROOT [--take-over] [--json] [--progress]   reclaim space of dropped and shadowed data
    cnrstore export STORE|ROOT --format F OUT [--version V] [--layout L] [--force] [--trust-pickle] [--json] [--progress]
                                 F: torch|safetensors|dcp|npz (cnrstore.export.FORMATS; dcp writes a directory);
                                 L: auto (a Checkpointer's version as the model's state dict, any other as its
                                 fp32 tables and dense arrays), state_dict, checkpoint, nested (cnrstore/export.py);
                                 an existing OUT file is replaced only with --force; a link, FIFO, socket or
                                 device at OUT (and for dcp anything but an empty directory) is always refused;
                                 --trust-pickle unpickles a payload written before payload format 2 (it warns)
    cnrstore import STORE SOURCE [--codec C] [--table-codec NAME=C] [--table PATTERN] [--min-rows N]
                                 [--source-format F] [--step S] [--model-only] [--json]
                                 seed a new store's first version from a torch.save / safetensors / DCP
                                 checkpoint, in the Checkpointer's layout (cnrstore/torch/imports.py): the
                                 model and what an export in the checkpoint layout adds (optimizers, extra,
                                 step, meta); a source holding anything else is refused unless --model-only
    cnrstore repair STORE [--json] [--progress] [--no-record-check]
                                 rebuild a lost or damaged index from the log; on a bucket, first a lost
                                 pointer, from the newest snapshot that verifies
    cnrstore migrate-payload STORE [--trust-pickle] [--json] [--progress]
                                 rewrite pickled trainer payloads (stores written before payload format 2)
                                 as data, once; without --trust-pickle only list them (export and restore
                                 refuse them with UnsafePayload, or unpickle them with --trust-pickle)

A store with an object-store tier (``cnrstore.open(..., remote=URL)``) is named with the options ``--remote URL``
and ``--remote-options JSON`` (the client's options, e.g. ``'{"client_kwargs": {"endpoint_url": ...}}'``) given
*before* the command, for every command: ``cnrstore --remote s3://bucket/ckpt ls ./cache``. On a directory that
holds no store yet, the remote's last copy point is first installed there as a read cache (a fresh machine),
which installs the newest one each time a command opens it again; ``repair`` does that explicitly, or rebuilds a
lost index from the local and the remote segments; first, a prefix whose pointer ``CURRENT`` is damaged, or was
deleted, gets it rebuilt from its newest index snapshot that verifies (maintenance/remote_pointer.py). Maintenance commands (compact, retain, gc) on a read cache
open it writable, which takes the prefix over from its writer: run them where the writer is.

``ls``, ``info``, ``verify``, ``export``, ``retain`` and ``gc`` also take the root of a multi-rank job
(``cnrstore.distributed``; cnrstore/distributed/maintenance.py): they list its global versions and the rank
stores they read; show its owner job (a bucket root's), generations with their plans (ranks, tables) and the
newest global version; verify its manifests and every rank store they name; export a global version as one
merged model; ``retain --keep-last N`` drops the older global versions, then the generations none reads any
more; ``gc`` drops every rank store's local versions no global version names and reclaims their space (bytes
freed per rank store). The other commands take one rank's store (``ROOT/gen-G/rank-R``, as ``ls ROOT`` prints
them).

A root kept in a bucket (``DistributedCheckpointer(..., remote=URL)``) is named by ``--remote URL`` (the prefix
holding its ``CNRSTORE-DIST`` object; a prefix holding neither a root nor a store is an InvalidArgument), and
ROOT is then this machine's directory for its rank stores, created if absent: each rank store read is
recovered there as a read cache (``cnrstore --remote s3://bucket/job ls ./job-cache``). ``retain`` and ``gc``
on such a root claim it (and ``gc`` takes every rank store over into that directory), which fences the job
that writes it: its next save fails. So they refuse unless ``--take-over`` is given: stop the job first (a
job started later claims the root back and goes on from the newest global version). On a local root they
need every rank store's lock, as the maintenance commands on a store do.

Output: a human-readable summary on stdout; with ``--json``, one JSON object on stdout instead (for
``ls``, a JSON list of versions). ``ls`` names a version's tables when they are few and counts them
otherwise (``--json`` always lists them). Progress bars of long work (verify, compact, retain, gc,
export, repair) go to stderr, only when stderr is a terminal or with ``--progress`` (then one line per
update, at most about one a second), so scripts and pipes see no progress output. ``export`` counts
bytes: the tables decoded (for a root, each rank's shards as its store is read), then the file written.

On a store, ``ls``, ``info``, ``verify``, ``rows`` and ``diff`` never import torch (a ~2-3 s import): reads decode
with numpy unless torch is already loaded (``cnrstore/codecs/rowwise.py``), and ``cnrstore.distributed``
is imported only for a multi-rank root (whose manifests it reads without torch, too).

Warnings the library logs during a command are folded into a failure's one line, and follow a successful
command's output on stderr as ``cnrstore CMD: note: ...`` lines (``Notes``).

Exit status (every failure prints one line on stderr: the error type, what happened and what to do, in
the command's terms -- a store another process holds names that process and says to wait for it or stop
it):

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
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time

import numpy as np

from .maintenance import compaction
from .engine import arguments, filenames
from .engine.lock import describe_holder
from .errors import CnrError, CorruptionError, InvalidArgument, RemoteObjectMissing, StoreLocked, StoreNotFound
from .export import DEFAULT_MIN_ROWS, FORMATS, LAYOUTS, SOURCE_FORMATS, check_path, export
from .maintenance.repair import damaged_blocks, repair as repair_store
from .store import Store, open as open_store
from .types import Snapshot


class Progress:
    """A progress report on stderr, a ``compaction.Progress`` callable: ``progress(done, total)``, with
    an optional note (what is being done). On a terminal it is a one-line bar redrawn in place (at
    most ten times a second); with ``force`` on a stream that is not a terminal, one line per update
    (at most one per ``interval_s``, and the last); otherwise it prints nothing. ``in_bytes`` shows
    ``done`` and ``total`` as sizes (KiB, MiB, GiB)."""

    #: The terminal whose bar was left mid-line (an error message must start on a new line), or None.
    dangling = None
    #: Least seconds between two lines on a stream that is not a terminal (a terminal's bar: 0.1 s).
    interval_s = 1.0

    def __init__(self, label: str, stream=None, force: bool = False, in_bytes: bool = False):
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.enabled = self.tty or force
        self.in_bytes = in_bytes
        self._last = float("-inf")
        self._note = ""

    def phase(self, note: str) -> None:
        """Start a phase of the work (export: reading, then writing): its note, with its first update
        shown at once."""
        self._note = note
        self._last = float("-inf")

    def __call__(self, done: int, total: int, note: str | None = None) -> None:
        now = time.monotonic()
        if note is not None:
            self._note = note
        if not self.enabled or (now - self._last < (0.1 if self.tty else self.interval_s) and done < total
                                and note is None):
            return
        self._last = now
        frac = done / total if total else 1.0
        tail = f" {self._note}" if self._note else ""
        count = f"{_size(done)}/{_size(total)}" if self.in_bytes else f"{done}/{total}"
        if self.tty:
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r{self.label} [{bar:<30}] {count} {frac:6.1%}{tail}\x1b[K")
            Progress.dangling = self.stream
            if done >= total:
                self.stream.write("\n")
                Progress.dangling = None
        else:
            self.stream.write(f"{self.label}: {count} {frac:6.1%}{tail}\n")
        self.stream.flush()


def _size(nbytes: int) -> str:
    """``nbytes`` for a person: "512 B", "1.5 KiB", "12.3 MiB", "4.56 GiB"."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit, scale in (("KiB", 2 ** 10), ("MiB", 2 ** 20), ("GiB", 2 ** 30), ("TiB", 2 ** 40)):
        if nbytes < 1024 * scale or unit == "TiB":
            value = nbytes / scale
            return f"{value:.2f} {unit}" if unit in ("GiB", "TiB") else f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _progress(args, label: str, in_bytes: bool = False) -> Progress:
    return Progress(label, force=getattr(args, "progress", False), in_bytes=in_bytes)


def _emit(args, obj, text: str) -> None:
    """``obj`` as JSON on stdout with ``--json``, else ``text``."""
    print(json.dumps(obj, indent=2) if args.json else text)


def _names(names: list[str], noun: str, width: int = 48) -> str:
    """``names`` joined when they fit ``width`` characters, else their count and the first few."""
    joined = ", ".join(names)
    if len(joined) <= width:
        return joined
    shown = []
    for name in names:
        if len(", ".join(shown + [name])) > width - 16:
            break
        shown.append(name)
    return f"{len(names)} {noun}: " + ", ".join(shown) + ", ..."


def versions_rows(store: Store) -> list[dict]:
    """One row per version; every version's read-chain length comes from one pass over the row index
    (``compaction.versions_with_read_chains``), so a listing is linear in versions and index entries."""
    with store.engine.read() as view:
        damaged = damaged_blocks(view)
        names = {info.id: name for name, info in view.tables().items()}
        dense = {did: name for name, did in view.dense_names().items()}
    rows = []
    for v, info, chain in compaction.versions_with_read_chains(store.engine):
        rows.append({
            "version": v,
            "step": info["step"],
            "created": info["created"],
            "bytes": info["bytes"],
            "tables": list(info["tables"]),
            "read_chain": chain,
            "meta": info["meta"],
            # blocks repair found damaged (reads of them raise CorruptionError; `cnrstore verify` says more)
            "damaged": [f"{names.get(d['table'], d['table'])}[{d['block']}]" if "table" in d
                        else f"dense {dense.get(d['dense'], d['dense'])}" for d in damaged.get(v, ())],
        })
    return rows


def _meta_json(meta, indent: int | None = None) -> str:
    """A version's meta as JSON (msgpack's bytes, which JSON lacks, as hex strings)."""
    return json.dumps(meta, indent=indent, default=lambda o: o.hex() if isinstance(o, (bytes, bytearray)) else repr(o))


def _print_versions(args, rows: list[dict], header: str, noun: str, rest) -> int:
    """Print ``rows`` as JSON (``--json``) or as a table: version, step, creation time, then ``rest(row)``;
    with ``--long``, each version's meta (where it has one) on an indented line below it."""
    if args.json:
        print(_meta_json(rows, indent=2))
        return 0
    print(header)
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created"]))
        step = "-" if r["step"] is None else r["step"]
        print(f"{r['version']:>8} {step:>10} {created:<20} {rest(r)}")
        if args.long and r["meta"] is not None:
            print(f"{'':>8} meta: {_meta_json(r['meta'])}")
    print(f"{len(rows)} {noun}")
    return 0


def _remote_options(args) -> dict | None:
    """--remote-options as a dict (None without it)."""
    if args.remote_options is None:
        return None
    try:
        options = json.loads(args.remote_options)
    except ValueError as exc:
        raise InvalidArgument(f"--remote-options is not JSON ({exc}): pass e.g. "
                              "'{\"client_kwargs\": {\"endpoint_url\": \"http://host:9000\"}}'") from None
    if not isinstance(options, dict):
        raise InvalidArgument("--remote-options must be a JSON object")
    return options


def _remote_args(args) -> dict:
    """open()'s remote= and remote_options= from --remote and --remote-options; without --remote, the remote
    a store's REMOTE file names (a store with an object-store tier needs no --remote to be opened)."""
    if getattr(args, "remote", None) is None:
        store = getattr(args, "store", None)
        if store is not None and os.path.isdir(store):
            from .engine import remote as remote_tier

            args.remote = remote_tier.kept_remotely(os.path.abspath(store))
        if args.remote is None:
            if getattr(args, "remote_options", None) is not None:
                raise InvalidArgument("--remote-options needs --remote URL (or a store whose REMOTE file names one)")
            return {}
    return {"remote": args.remote, "remote_options": _remote_options(args)}


def _open(args, *, readonly: bool = False) -> Store:
    """The store at ``args.store``; StoreNotFound says what is wrong in the command's terms (the Python
    API's hint, "pass create=True", is no fix here: the command never creates a store)."""
    remote = _remote_args(args)
    if remote and not readonly:
        _refuse_takeover(args)
    try:
        return open_store(args.store, readonly=readonly, **remote)
    except StoreNotFound:
        if getattr(args, "remote", None) is not None:
            raise  # (it names the remote, which holds no store either)
        if _store_like(args.store):
            raise StoreNotFound(
                f"no cnrstore store at {args.store!r}: it holds a store's index/ and segments/ but no marker "
                f"{filenames.MARKER} (its creation did not finish, or the marker was deleted); the files there are "
                "kept, and the program that was creating the store finishes it when it creates the store there again"
                ) from None
        raise StoreNotFound(f"no cnrstore store at {args.store!r} (no {filenames.MARKER} file there); check the "
                            "path") from None


def _refuse_takeover(args) -> None:
    """A command that writes never takes a remote prefix over: on a directory that is not the prefix's writer
    (a read cache, or no store yet), opening it writable would make it the writer and stop the trainer."""
    from .engine import remote as remote_tier

    ident = remote_tier.read_identity(os.path.abspath(args.store)) if os.path.isdir(args.store) else None
    if ident is None and os.path.exists(filenames.marker_path(args.store)):
        return  # a local store being attached to the remote
    if ident is None or ident.role != "writer":
        raise InvalidArgument(
            f"{args.store!r} is not the writer of {args.remote} ({'a read cache' if ident else 'no store yet'}): "
            f"`cnrstore {args.command}` would take the prefix over from its writer (a running trainer would then "
            "stop with RemoteTakenOver). Run it on the writer's directory; to move the writer here on purpose, "
            "open it writable with cnrstore.open(DIR, remote=URL)")


def _message(args, exc: CnrError) -> str:
    """The error line of a failed command: the error's type and message, in the command's terms where the
    message's fix is the Python API's. StoreLocked: a maintenance command cannot read alongside the writer
    (the Python fix, ``readonly=True``), so it names the holder and says to wait for it or stop it."""
    if isinstance(exc, StoreLocked):
        return (f"StoreLocked: store {args.store!r} is held for writing by {describe_holder(exc.pid)}; "
                f"`cnrstore {args.command}` needs the store to itself: wait for that process to finish, or stop "
                "it, then run the command again (`cnrstore ls`, `info`, `verify`, `rows` and `export` read the "
                "store meanwhile)")
    return f"{type(exc).__name__}: {exc}"


def _is_root(path: str) -> bool:
    """Whether ``path`` is a multi-rank job's root. A store (its marker present) is decided without
    importing ``cnrstore.distributed``."""
    if os.path.exists(filenames.marker_path(path)):
        return False
    from .distributed.manifest import Root

    return Root(path).exists()


def _root(args):
    """The multi-rank root the command names (a ``cnrstore.distributed.Root``), or None for a store (decided
    once per command, then kept). Without --remote: STORE holding a root's marker. With --remote: the prefix
    holding one (its ``CNRSTORE-DIST`` object); STORE is then this machine's directory for the rank stores
    (created if absent: read caches of them). InvalidArgument if the prefix holds neither a root nor a store and
    STORE holds no store."""
    if hasattr(args, "root"):
        return args.root
    args.root = None
    if getattr(args, "remote", None) is None:
        if _is_root(args.store):
            from .distributed.manifest import Root

            args.root = Root(args.store)
        return args.root
    if os.path.exists(filenames.marker_path(args.store)):
        return None  # a store's own directory: --remote is its object-store tier
    from .distributed.manifest import MARKER as ROOT_MARKER
    from .distributed.remote_root import RemoteRoot

    root = RemoteRoot(args.store, args.remote, _remote_options(args))
    if root.exists():
        os.makedirs(args.store, exist_ok=True)
        args.root = root
    elif root.objects.size(filenames.REMOTE_POINTER) is None and root.objects.bucket_exists() is not False:
        from .engine.remote import pointer_missing
        damage = pointer_missing(root.objects, filenames.REMOTE_POINTER)
        if damage is not None and args.command == "repair":
            return None  # a store's prefix whose pointer repair rebuilds (cmd_repair)
        if damage is not None:  # a store's objects without its pointer: damage, not "no store here"
            raise RemoteObjectMissing(
                f"{damage}. Run `cnrstore --remote {args.remote} repair DIR` (DIR: an empty directory, or the "
                f"store's writer directory): it rebuilds {filenames.REMOTE_POINTER} from the newest index snapshot "
                f"that verifies; or put {filenames.REMOTE_POINTER} back (a bucket with versioning keeps the previous "
                "one)", damage.path)
        raise InvalidArgument(f"{args.remote} holds neither a cnrstore store (no {filenames.REMOTE_POINTER}) nor "
                              f"a multi-rank root (no {ROOT_MARKER}), and {args.store!r} holds no store: check the "
                              "URL (a multi-rank root's prefix is the remote= its DistributedCheckpointer was given)")
    return args.root


def _rank_store_hint(args, root) -> str:
    if root.remote is None:
        return f"{args.store}/gen-GGGGGG/rank-RRRRR (see `cnrstore ls {args.store}`)"
    return (f"`cnrstore --remote {root.remote}/gen-GGGGGG/rank-RRRRR ... {args.store}/gen-GGGGGG/rank-RRRRR` (see "
            f"`cnrstore --remote {root.remote} ls {args.store}`)")


def _refuse_root(args) -> None:
    root = _root(args)
    if root is not None:
        raise InvalidArgument(f"{root.remote or args.store} is the root of a multi-rank job; `cnrstore {args.command}` "
                              f"works on one rank's store: {_rank_store_hint(args, root)}")


def _refuse_take_over(args) -> None:
    """--take-over names a bucket root's maintenance; on a store it would be a flag that does nothing."""
    if getattr(args, "take_over", False) and getattr(_root(args), "remote", None) is None:
        raise InvalidArgument("--take-over is for a multi-rank root in a bucket (`cnrstore --remote URL "
                              f"{args.command} DIR`); a store's maintenance runs on its writer's directory")


def _claim_root(args, root) -> None:
    """A bucket root's retain and gc claim the root (and gc each rank store): only with --take-over."""
    if root.remote is not None and not args.take_over:
        raise InvalidArgument(
            f"`cnrstore {args.command}` on the multi-rank root {root.remote} takes the root over from the job that "
            "writes it (and, for gc, every rank store): a job still running on it would fail at its next save with "
            "RemoteTakenOver. Stop the job first, then run the command again with --take-over (a job started "
            "later claims the root back and goes on from its newest global version)")


def cmd_ls_root(args, root) -> int:
    """The root's global versions, then the rank stores they read (the paths ``info``, ``rows`` and the
    maintenance commands take; of a bucket root, each rank store's name and remote prefix), once per
    distinct set of stores; ``--json`` gives each version's ``stores`` (relative to the root; of a bucket
    root, ``store_remotes`` too) instead."""
    rows = []
    for g in root.versions():
        row = {"version": g.version, "step": g.step, "created": g.created, "world_size": g.world_size,
               "generation": g.generation, "local_versions": list(g.local_versions), "stores": root.rank_stores(g),
               "meta": g.meta}
        if root.remote is not None:
            row["store_remotes"] = [f"{root.remote.rstrip('/')}/{rel}" for rel in row["stores"]]
        rows.append(row)
    status = _print_versions(args, rows, f"{'global':>8} {'step':>10} {'created (UTC)':<20} {'ranks':>5} {'gen':>4}  "
                                         "local versions", "global version(s)",
                             lambda r: f"{r['world_size']:>5} {r['generation']:>4}  "
                                       f"{_names([str(v) for v in r['local_versions']], 'ranks')}")
    if not args.json:
        by_stores: dict[tuple[str, ...], list[int]] = {}
        for r in rows:
            by_stores.setdefault(tuple(r["stores"]), []).append(r["version"])
        for stores, versions in by_stores.items():
            span = f"{versions[0]}" if len(versions) == 1 else f"{versions[0]}-{versions[-1]}"
            if root.remote is None:
                print(f"rank stores of global version(s) {span} (`cnrstore info`, `rows`, `compact`, ... take one):")
                for rank, rel in enumerate(stores):
                    print(f"  rank {rank}: {os.path.join(args.store, rel)}")
            else:
                print(f"rank stores of global version(s) {span} (local directory under {args.store}, remote "
                      "prefix; `cnrstore --remote PREFIX info DIR/gen-G/rank-R` reads one):")
                for rank, rel in enumerate(stores):
                    print(f"  rank {rank}: {rel}  {root.remote.rstrip('/')}/{rel}")
    return status


def cmd_info_root(args, root) -> int:
    """The root's owner job (a bucket root's), generations with their plans, global versions."""
    from .distributed.maintenance import describe

    info = describe(root)
    if args.json:
        print(_meta_json(info, indent=2))
        return 0
    print(f"multi-rank root {info['root']}" + (f" (rank stores' local directory {info['local']})"
                                              if info["remote"] else ""))
    if info["remote"] is not None:
        print(f"owner job        {info['owner'] or '-'}")
    print(f"global versions  {info['global_versions']}")
    newest = info["newest"]
    if newest is not None:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(newest["created"]))
        step = "-" if newest["step"] is None else newest["step"]
        print(f"newest           {newest['version']} (step {step}, {created} UTC, generation {newest['generation']})")
    print(f"{'generation':>10} {'ranks':>5} {'row ids':<7} {'global versions':<16}  tables")
    for g in info["generations"]:
        gvs = g["global_versions"]
        span = "-" if not gvs else str(gvs[0]) if len(gvs) == 1 else f"{gvs[0]}-{gvs[-1]} ({len(gvs)})"
        tables = [f"{name} {n:,}x{d}" for name, (n, d) in g["tables"].items()]
        print(f"{g['generation']:>10} {g['world_size']:>5} {g['row_ids']:<7} {span:<16}  {_names(tables, 'tables', 60)}")
    return 0


def cmd_verify_root(args, root) -> int:
    from .distributed.verify import verify_root

    report = verify_root(root, progress=_progress(args, "verify"))
    if args.json:
        print(json.dumps(report.__dict__, indent=2))
    else:
        for problem in report.problems:
            print(f"problem: {problem}")
        print(f"{'ok' if report.ok else 'DAMAGED'}: {report.global_versions} global version(s), "
              f"{report.stores_checked} rank store(s), {report.records_checked} records, "
              f"{report.bytes_checked:,} bytes checked, {len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def cmd_retain_root(args, root) -> int:
    """``retain --keep-last N`` on a root: drop the oldest global versions' manifests, then the generations no
    global version reads (cnrstore.distributed.maintenance.retain)."""
    from .distributed.maintenance import retain

    if args.keep_every_n_steps is not None or args.keep or args.drop or args.keep_last is None:
        raise InvalidArgument("on a multi-rank root, retain takes --keep-last N only (the newest N global versions "
                              "are kept)")
    _claim_root(args, root)
    report = retain(root, args.keep_last, progress=_progress(args, "retain"))
    _emit(args, dataclasses.asdict(report),
          f"dropped {len(report.dropped)} global version(s)"
          + (f": {', '.join(map(str, report.dropped))}" if report.dropped else "")
          + f"; kept {len(report.kept)}"
          + (f"; removed generation(s) {', '.join(map(str, report.generations_removed))}"
             if report.generations_removed else "")
          + "; run `cnrstore gc` on the root to reclaim the rank stores' space")
    return 0


def cmd_gc_root(args, root) -> int:
    """``gc`` on a root: every rank store's versions no global version names dropped and collected
    (cnrstore.distributed.maintenance.collect); bytes freed per rank store."""
    from .distributed.maintenance import collect

    _claim_root(args, root)
    report = collect(root, progress=_progress(args, "gc"))
    lines = []
    for s in report.stores:
        bucket = "" if s.bucket_bytes_freed is None else f", {s.bucket_bytes_freed:,} bytes freed in the bucket"
        lines.append(f"{s.store}: dropped {len(s.versions_dropped)} local version(s), reclaimed "
                     f"{s.bytes_reclaimed:,} bytes ({s.segments_deleted} segment(s) deleted){bucket}")
    bucket = "" if report.bucket_bytes_freed is None else f", {report.bucket_bytes_freed:,} bytes in the bucket"
    lines.append(f"reclaimed {report.bytes_reclaimed:,} bytes{bucket} over {len(report.stores)} rank store(s)")
    _emit(args, report.to_json(), "\n".join(lines))
    if report.incomplete:
        print(f"cnrstore gc: incomplete: {report.incomplete}", file=sys.stderr)
        return 2
    return 0


def cmd_ls(args) -> int:
    root = _root(args)
    if root is not None:
        return cmd_ls_root(args, root)
    with _open(args, readonly=True) as store:
        rows = versions_rows(store)
    return _print_versions(args, rows, f"{'version':>8} {'step':>10} {'created (UTC)':<20} {'bytes':>14} {'chain':>6}  "
                                       "tables", "version(s)",
                           lambda r: f"{r['bytes']:>14,} {r['read_chain']:>6}  {_names(r['tables'], 'tables')}"
                                     + (f"  DAMAGED: {_names(r['damaged'], 'blocks')}" if r["damaged"] else ""))


def cmd_info(args) -> int:
    root = _root(args)
    if root is not None:
        return cmd_info_root(args, root)
    with _open(args, readonly=True) as store:
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
        if t.keyed:  # rows by key: its partitions and columns instead of rows and blocks
            cols = ", ".join(f"{n}:{dt.lstrip('<|')}" + (f"x{w}" if w > 1 else "") for n, dt, w in t.columns)
            print(f"{t.name:<24} {'keyed':>12} {t.dim:>6} {t.codec:<10} {t.partitions:>10,} partitions"
                  + (f"; columns {cols}" if cols else ""))
            continue
        print(f"{t.name:<24} {t.num_rows:>12,} {t.dim:>6} {t.codec:<10} {t.block_rows:>10}")
    for key in ("versions", "bytes_written", "save_bytes", "merge_bytes", "bytes_on_disk", "live_bytes", "index_bytes",
                "max_read_chain"):
        value = stats[key]
        print(f"{key:<16} {value:>16,}" if isinstance(value, int) else f"{key:<16} {value}")
    print(f"{'live_ratio':<16} {live_ratio:>16.1%}")
    for key, what in (("write_amplification", "all bytes appended / the checkpoints' own rows"),
                      ("save_write_amplification", "bytes saves appended / the checkpoints' own rows"),
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
    root = _root(args)
    if root is not None:
        return cmd_verify_root(args, root)
    try:
        store = _open(args, readonly=True)
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
            report = store.verify(progress=_progress(args, "verify"))
        except CorruptionError as exc:  # verify reports damage; this is a backstop for what it did not foresee
            return _print_verify(args, False, [f"verify stopped at damage it could not step over: {exc}"], 0, 0)
    return _print_verify(args, report.ok, report.problems, report.records_checked, report.bytes_checked)


def cmd_compact(args) -> int:
    _refuse_root(args)
    with _open(args) as store:
        report = store.compact(args.version, progress=_progress(args, "compact"))
    _emit(args, dataclasses.asdict(report),
          f"compacted at version {report.version}: {report.blocks_materialized} block baseline(s), "
          f"{report.bytes_written:,} bytes written")
    return 0


def cmd_retain(args) -> int:
    """``Store.retain`` with the Checkpointer's rules (and pins and drops); one index transaction with no
    progress of its own: the progress line says what it is doing and, at the end, that it is done. On a
    multi-rank root: ``cmd_retain_root``."""
    _refuse_take_over(args)
    for option, value in (("--keep-last", args.keep_last), ("--keep-every-n-steps", args.keep_every_n_steps)):
        if value is not None and value < 1:  # here, so that the message names the option
            raise InvalidArgument(f"{option} must be a positive integer, got {value}")
    root = _root(args)
    if root is not None:
        return cmd_retain_root(args, root)
    if args.keep_last is None and args.keep_every_n_steps is None and not args.keep and not args.drop:
        raise InvalidArgument("retain needs --keep-last N, --keep-every-n-steps N, --keep V (pin) or --drop V")
    progress = _progress(args, "retain")
    with _open(args) as store:
        kept = ([f"the newest {args.keep_last} version(s)"] if args.keep_last else []) + (
            [f"the steps that are multiples of {args.keep_every_n_steps}"] if args.keep_every_n_steps else []) + (
            [f"version(s) {', '.join(map(str, args.keep))}"] if args.keep else [])
        progress(0, 1, " and ".join(filter(None, [("keeping " + " and ".join(kept)) if kept else "",
                                                 f"dropping version(s) {', '.join(map(str, args.drop))}"
                                                 if args.drop else ""])))
        dropped = store.retain(args.keep_last, keep_every_n_steps=args.keep_every_n_steps, keep=args.keep or (),
                               drop=args.drop or ())
        kept = [v.version for v in store.versions()]
    progress(1, 1, f"dropped {len(dropped)} version(s)")
    _emit(args, {"dropped": dropped, "kept": kept},
          f"dropped {len(dropped)} version(s)" + (f": {', '.join(map(str, dropped))}" if dropped else "")
          + "; run `cnrstore gc` to reclaim their space")
    return 0


def cmd_gc(args) -> int:
    _refuse_take_over(args)
    root = _root(args)
    if root is not None:
        return cmd_gc_root(args, root)
    with _open(args) as store:
        report = store.gc(progress=_progress(args, "gc"))
    _emit(args, dataclasses.asdict(report),
          f"reclaimed {report.bytes_reclaimed:,} bytes ({report.segments_deleted} segment(s) deleted, "
          f"{report.segments_rewritten} rewritten, {report.bytes_copied:,} bytes copied)"
          + (f"; {report.bytes_pending:,} bytes wait for readers to finish" if report.bytes_pending else ""))
    if report.incomplete:
        print(f"cnrstore gc: incomplete: {report.incomplete}", file=sys.stderr)
        return 2
    return 0


def _export_snapshot(args, progress: Progress) -> tuple[Snapshot, bool]:
    """The snapshot ``cnrstore export`` writes, and whether it is a merged multi-rank one: version
    ``args.version`` (default: the newest) of the store at ``args.store``, or global version
    ``args.version`` of a multi-rank root, every table assembled from all ranks' shards. (The one place
    that decides what an export reads.)"""
    root = _root(args)
    if root is not None:
        from .distributed.export import merged_snapshot

        progress.phase("assembling " + ("the newest global version" if args.version is None
                                        else f"global version {args.version}") + " from every rank")
        return merged_snapshot(root, args.version, trust_pickle=args.trust_pickle, progress=progress), True
    with _open(args, readonly=True) as store:
        progress.phase("reading " + ("the newest version" if args.version is None else f"version {args.version}"))
        return store.restore(args.version, progress=progress), False


def cmd_export(args) -> int:
    """Read the snapshot, then write it with ``export.export`` (atomically; layout "auto": a
    Checkpointer's version as the model's state dict, any other as the store's tables and dense arrays).
    Progress is in bytes, phase by phase: the tables' fp32 bytes decoded (a root: each rank's shards as
    its store is read), then the bytes of the file written."""
    check_path(args.out, args.format, overwrite=args.force)  # before the (long) read: a bad path fails at once
    progress = _progress(args, "export", in_bytes=True)
    snapshot, merged = _export_snapshot(args, progress)
    progress.phase(f"writing {args.out} ({args.format})")
    report = export(snapshot, args.format, args.out, layout=args.layout, overwrite=args.force,
                    trust_pickle=args.trust_pickle, progress=progress)
    report = dataclasses.replace(report, merged=merged)
    _emit(args, dataclasses.asdict(report),
          f"exported {'global ' if merged else ''}version {report.version} ({report.tensors} tensor(s), "
          f"{report.tables} from tables; layout {report.layout}) to {report.path} as {report.format}")
    return 0


def cmd_import(args) -> int:
    """Seed a new store's first version from a PyTorch checkpoint (``cnrstore.torch.import_checkpoint``)."""
    from .torch.imports import import_checkpoint, parse_table_codecs  # torch: only this command needs it

    remote = _remote_args(args)
    if remote and os.path.exists(args.store) and os.listdir(args.store):
        raise InvalidArgument(f"`cnrstore --remote URL import` seeds a new store into an empty directory, and "
                              f"{args.store!r} is not one; name a new directory")
    report = import_checkpoint(args.store, args.source, codec=args.codec, codecs=parse_table_codecs(args.table_codec),
                               tables=args.table, min_rows=args.min_rows, format=args.source_format,
                               step=args.step, model_only=args.model_only)
    if remote:  # the store is imported locally (nothing reaches the bucket if the import fails), then attached:
        try:    # its first copy point uploads it
            open_store(args.store, **remote).close()
        except CnrError as exc:
            raise type(exc)(f"{args.store!r} holds the imported store, but attaching it to {args.remote} failed: {exc}; "
                            "opening it writable with that remote= attaches it (`cnrstore --remote URL gc DIR`)"
                            ) from exc
    state = (f", the state of {report.optimizers} optimizer(s) ({len(report.optimizer_tables)} row-wise state "
             "table(s))" if report.optimizers else "") + (f", extra state {', '.join(report.extra)}"
                                                         if report.extra else "")
    _emit(args, dataclasses.asdict(report),
          f"imported {len(report.tables)} table(s)"
          + (f", {len(report.keyed)} keyed table(s)" if report.keyed else "")
          + f" and {len(report.dense)} dense array(s){state} from "
          f"{args.source} ({report.source_format}) into {args.store} as version {report.version}"
          + (f" (step {report.step})" if report.step is not None else "")
          + "".join(f"\n  table {name}: {rows:,} x {dim} from {key!r}, {codec}"
                    for name, (key, rows, dim, codec) in sorted(report.tables.items()))
          + "".join(f"\n  keyed table {name}: {n:,} keys x {dim}, {codec}"
                    + (f", columns {', '.join(cols)}" if cols else "")
                    for name, (n, dim, codec, cols) in sorted(report.keyed.items()))
          + (f"\n  left out (--model-only): {', '.join(report.ignored)}" if report.ignored else ""))
    return 0


def cmd_migrate_payload(args) -> int:
    """Rewrite pickled trainer payloads as data (``cnrstore.torch.migrate``); without --trust-pickle, list them."""
    _refuse_root(args)
    from .torch.migrate import migrate_payloads  # torch: only this command needs it

    report = migrate_payloads(args.store, trust_pickle=args.trust_pickle,
                              progress=_progress(args, "migrate-payload"))
    lines = [f"version {v}: the payload's pickle names {', '.join(n) or 'what weights_only refuses'}"
             for v, n in sorted(report.unsafe.items())]
    if report.dry_run:
        tail = (f"{len(report.unsafe)} version(s) hold a pickled payload that cnrstore will not unpickle; if you "
                "wrote this store and trust it, run again with --trust-pickle to rewrite them as data (this "
                "unpickles each once)" if report.unsafe else "every payload is data already: nothing to do")
    else:
        tail = (f"rewrote {len(report.rewritten)} payload(s) as data; {len(report.clean)} were data already "
                "(run `cnrstore gc` to reclaim the old payloads' bytes)")
    _emit(args, dataclasses.asdict(report), "\n".join(lines + [tail]))
    return 0


def _named_version(store, version: int | None) -> int | None:
    """``version``, or (None) the newest now, named so that what commits meanwhile is not read."""
    if version is None:
        latest = store.latest()
        version = None if latest is None else latest.version
    return version


def cmd_rows(args) -> int:
    _refuse_root(args)
    with _open(args, readonly=True) as store:
        version = _named_version(store, args.version)
        info = store.tables().get(args.table)
        if info is not None and info.keyed:
            return _print_keys(args, store.read_keys(args.table, args.row, version), version)
        values = store.read_rows(args.table, args.row, version)
    if args.json:
        print(json.dumps({"table": args.table, "version": version, "rows": args.row, "values": values.tolist()},
                         indent=2))
        return 0
    with np.printoptions(precision=6, suppress=False, linewidth=160):
        for row, vec in zip(args.row, values):
            print(f"{row}: {vec}")
    return 0


def _print_keys(args, got, version) -> int:
    """``rows`` of a keyed table: each key's value and columns, or "not found" (absent at the version)."""
    cols = {n: c.tolist() for n, c in got.columns.items()}
    if args.json:
        print(json.dumps({"table": args.table, "version": version, "keys": args.row, "found": got.found.tolist(),
                          "values": got.values.tolist(), "columns": cols}, indent=2))
        return 0
    with np.printoptions(precision=6, suppress=False, linewidth=160):
        for i, key in enumerate(args.row):
            more = "".join(f"  {n}={cols[n][i]}" for n in cols)
            print(f"{key}: {got.values[i]}{more}" if got.found[i] else f"{key}: not found")
    return 0


def cmd_diff(args) -> int:
    """Per table, the rows whose value at V2 came from a version newer than V1 (``Store.changes``) and their
    bytes in the codec they are stored in; the dense arrays put in (V1, V2]."""
    _refuse_root(args)
    from .engine import changes as changes_rule

    arguments.version_arg(args.since, "V1", optional=False)
    if args.until is not None:
        arguments.version_arg(args.until, "V2", optional=False)
    with _open(args, readonly=True) as store:
        until = _named_version(store, args.until)
        tables = {}
        for tc in store.changes(args.since, until, encoded=True):
            tables[tc.table] = _keyed_diff(tc, args.rows) if tc.keyed else _rows_diff(tc, args.rows)
            until = tc.until
        with store.engine.read() as view:
            dense = changes_rule.dense_changed(view, args.since or 0, until) if until is not None else []
    if args.json:
        print(json.dumps({"store": args.store, "since": args.since, "until": until, "tables": tables,
                          "dense": dense}, indent=2))
        return 0
    print(f"changes of {args.store} from version {args.since} to {until}"
          + (" (every row: a full sync)" if not args.since else ""))
    width = max([len(n) for n in tables] + [5])
    for name, entry in tables.items():
        if entry.get("keyed"):
            _print_keyed_diff(name, entry, width, args.rows)
            continue
        others = {c: n for c, n in entry["codecs"].items() if c != entry["codec"]}
        more = (" (" + ", ".join(f"{n} in {c}" for c, n in others.items()) + ")") if others else ""
        print(f"  {name:<{width}}  {entry['rows_changed']:>10} rows  {_size(entry['bytes']):>10} {entry['codec']}{more}")
        if args.rows and entry["rows"]:
            print(f"  {'':<{width}}  rows: {' '.join(map(str, entry['rows']))}")
    keyed = [e for e in tables.values() if e.get("keyed")]
    plain = [e for e in tables.values() if not e.get("keyed")]
    keyed_line = (f"; {sum(e['keys_changed'] for e in keyed)} keys put or changed and "
                  f"{sum(e['keys_deleted'] for e in keyed)} deleted in {len(keyed)} keyed table(s), "
                  f"{_size(sum(e['bytes'] for e in keyed))} decoded") if keyed else ""
    print(f"{sum(e['rows_changed'] for e in plain)} rows changed in {len(plain)} table(s), "
          f"{_size(sum(e['bytes'] for e in plain))} encoded{keyed_line}; dense arrays put: "
          f"{', '.join(dense) if dense else 'none'}")
    return 0


def _rows_diff(tc, rows: bool) -> dict:
    """``diff``'s entry for a positional table's changes (encoded)."""
    entry = {"rows_changed": int(tc.rows.size), "bytes": tc.nbytes, "codec": tc.codec,
             "codecs": {p.codec: int(p.rows.size) for p in tc.parts}}
    if rows:
        entry["rows"] = tc.rows.tolist()
    return entry


def _keyed_diff(tc, rows: bool) -> dict:
    """``diff``'s entry for a keyed table's changes: keys put or changed, keys deleted (evicted), and the
    bytes of their decoded values and columns."""
    nbytes = int(tc.values.nbytes) + sum(int(c.nbytes) for c in tc.columns.values())
    entry = {"keyed": True, "keys_changed": int(tc.rows.size), "keys_deleted": int(tc.deleted.size),
             "bytes": nbytes, "codec": tc.codec}
    if rows:
        entry["keys"] = tc.rows.tolist()
        entry["deleted"] = tc.deleted.tolist()
    return entry


def _print_keyed_diff(name: str, entry: dict, width: int, rows: bool) -> None:
    print(f"  {name:<{width}}  {entry['keys_changed']:>10} keys put or changed, {entry['keys_deleted']} deleted  "
          f"{_size(entry['bytes']):>10} decoded (keyed)")
    if rows and entry["keys"]:
        print(f"  {'':<{width}}  keys: {' '.join(map(str, entry['keys']))}")
    if rows and entry["deleted"]:
        print(f"  {'':<{width}}  deleted: {' '.join(map(str, entry['deleted']))}")


def cmd_repair_root(args, root) -> int:
    """``repair`` of a multi-rank root in a bucket: its pointer rebuilt from its manifests, plans and rank
    stores if it is missing or damaged (cnrstore.distributed.repair_root); nothing is deleted."""
    from .distributed.repair import repair_root

    report = repair_root(root, progress=_progress(args, "repair"))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0 if report.ok else 1
    for problem in report.problems:
        print(f"problem: {problem}")
    for line in report.rank_stores:
        print(f"rebuilt: {line}")
    if not report.rebuilt:
        did = (f"{len(report.rank_stores)} rank store pointer(s) rebuilt" if report.rank_stores
               else "nothing to repair")
        print(f"{'ok' if report.ok else 'DAMAGED'}: the root pointer of {root.remote} is there and sound; {did}")
        return 0 if report.ok else 1
    print(f"{'ok' if report.ok else 'DAMAGED'}: the root pointer of {root.remote} was {report.previous}; rebuilt "
          f"listing {len(report.versions)} global version(s) {_names([str(v) for v in report.versions], 'versions')}"
          f" and generation(s) {_names([str(g) for g in report.generations], 'generations')}; "
          f"{len(report.problems)} problem(s) (not listed, nothing deleted)")
    return 0 if report.ok else 1


def cmd_repair(args) -> int:
    root = _root(args)
    if root is not None and root.remote is not None:
        return cmd_repair_root(args, root)
    _refuse_root(args)
    report = repair_store(args.store, progress=_progress(args, "repair"), check_records=args.record_check,
                          **_remote_args(args))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in report.pointer.problems if report.pointer is not None else ():
            print(f"problem: {line}")
        for line in report.bad_records:
            print(f"bad record: {line}")
        for line in report.notes:
            print(f"note: {line}")
        for v, why in sorted(report.versions_lost.items()):
            print(f"NOT RECOVERED: {why if why.startswith('version') else f'version {v}: {why}'}")
        for v, whats in sorted(report.damaged.items()):
            for what in whats:
                print(f"DAMAGED BLOCK: version {v}: {what}")
        if report.versions_dropped:
            print(f"left dropped (retain dropped them before): {len(report.versions_dropped)} version(s)")
        if report.old_index:
            print(f"the previous index was moved to {report.old_index}")
        if report.damaged:
            print(f"{len(report.damaged)} recovered version(s) have damaged blocks: reads of them raise "
                  "CorruptionError; `cnrstore ls` marks them and `cnrstore verify` lists them. Restore an "
                  "undamaged version, or write those blocks again in a full checkpoint")
        print(f"{'ok' if report.ok else 'DAMAGED'}: {len(report.versions_recovered)} version(s) recovered"
              f" ({len(report.damaged)} with damaged blocks), "
              f"{len(report.versions_lost)} not recovered; {len(report.tables_recovered)} table(s); "
              f"{report.segments_scanned} segment(s), {report.records_scanned} records scanned, "
              f"{len(report.bad_records)} bad")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cnrstore", description="Inspect, verify and maintain a cnrstore checkpoint store.",
        epilog="Exit status: 0 ok; 1 verify found damage (including a store that cannot be opened because "
               "its marker or index is corrupt or missing) or repair could not recover every version; 2 any "
               "other error (usage, not a store, locked, unknown version, export path not writable, disk "
               "full, OS error), with one line on stderr saying what to do; 130 interrupted. --json prints "
               "one JSON object on stdout; progress goes to stderr when it is a terminal or with --progress.")
    # before the command, for every command (git -C style): a store with an object-store tier
    parser.add_argument("--remote", metavar="URL", default=None,
                        help="the store keeps its sealed segments at this object-store URL (s3://bucket/prefix, or "
                             "any fsspec URL); on a STORE directory that holds no store yet, the remote's last "
                             "copy point is installed there as a read cache (repair: the same, explicitly), which "
                             "follows the remote each time it is opened again")
    parser.add_argument("--remote-options", metavar="JSON", default=None,
                        help="options of the object store's client as a JSON object, e.g. "
                             "'{\"client_kwargs\": {\"endpoint_url\": \"http://host:9000\"}}' (credentials: "
                             "the usual AWS environment variables)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text, *, progress=False, store_help="path of the store"):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("store", help=store_help)
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of text"
                       + (" (for ls: a JSON list of versions)" if name == "ls" else ""))
        if progress:
            p.add_argument("--progress", action="store_true",
                           help="report progress on stderr even when it is not a terminal (one line per update)")
        p.set_defaults(func=func)
        return p

    root_help = ("path of the store, or of a multi-rank job's root; with --remote naming a multi-rank root in a "
                 "bucket, this machine's directory for its rank stores (created if absent; read caches)")
    take_over = ("on a multi-rank root in a bucket: claim the root for this command (and for gc, take every rank "
                 "store over into STORE); a job still running on it would fail at its next save, so stop the job "
                 "first (a job started later claims the root back)")
    add("ls", cmd_ls, "list versions: step, creation time, bytes appended, read-chain length, tables (named "
        "when few, else counted); of a multi-rank root, its global versions and the rank stores they read",
        store_help=root_help).add_argument("--long", action="store_true",
                                           help="also print each version's meta (the dict saved with it)")
    add("info", cmd_info, "tables, codecs, disk use, live ratio, write and space amplification; of a multi-rank "
        "root, its owner job (in a bucket), generations with their plans (ranks, tables) and global versions",
        store_help=root_help)
    add("verify", cmd_verify, "check every checksum and the index against the log (exit 1 on problems)",
        progress=True, store_help=root_help)
    p = add("rows", cmd_rows, "print rows of a table as the store reads them (a keyed table: the keys given, "
            "each with its value and columns, or 'not found')")
    p.add_argument("table", help="table name")
    p.add_argument("row", type=int, nargs="+", help="row ids (a keyed table's: int64 keys)")
    p.add_argument("--version", type=int, default=None, help="version to read (default: the newest)")
    add("compact", cmd_compact, "materialize baselines at a version (default: the newest)", progress=True
        ).add_argument("--version", type=int, default=None, help="version to compact at")
    p = add("retain", cmd_retain, "drop the versions no rule keeps, as a Checkpointer's retention does (the newest is "
            "always kept; then run gc to reclaim their space); on a multi-rank root, --keep-last N drops the older "
            "global versions and the generations none reads any more", progress=True, store_help=root_help)
    p.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="keep the newest N versions (of a multi-rank root: global versions; its only rule)")
    p.add_argument("--keep-every-n-steps", type=int, default=None, metavar="N",
                   help="keep the versions whose step is a multiple of N")
    p.add_argument("--keep", type=int, action="append", metavar="V", help="pin version V (repeatable)")
    p.add_argument("--drop", type=int, action="append", metavar="V",
                   help="drop version V (repeatable; alone, or on top of the rules)")
    p.add_argument("--take-over", action="store_true", help=take_over)
    add("gc", cmd_gc, "reclaim the space of dropped and shadowed data; on a multi-rank root, of every rank store's "
        "versions no global version names (bytes freed per rank store; in a bucket, the objects deleted too)",
        progress=True, store_help=root_help).add_argument("--take-over", action="store_true", help=take_over)
    p = add("export", cmd_export, "write a version to a file (a directory for dcp), atomically: a Checkpointer's "
            "version as the model's state dict, any other as its fp32 tables and dense arrays (keyed tables as "
            "keyed/<name>/keys, /values and /columns/<column>: --layout nested); a multi-rank "
            "root's global version as one merged model", progress=True, store_help=root_help)
    p.add_argument("--format", choices=FORMATS, required=True, help=f"one of {', '.join(FORMATS)}")
    p.add_argument("--version", type=int, default=None,
                   help="version to export (a global version for a root; default: the newest)")
    p.add_argument("--layout", choices=("auto",) + LAYOUTS, default="auto",
                   help="state_dict: the model's state_dict (load_state_dict / dcp.load take it as is); "
                        "checkpoint (torch only): model, optimizers and extra state; nested: tables/ and dense/ "
                        "as stored; auto (default): state_dict for a Checkpointer's version, else nested")
    p.add_argument("out", help="output file (a new directory for dcp)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it is an existing regular file (without it an existing OUT is refused); "
                        "a symbolic link, FIFO, socket or device at OUT is refused even so, and a DCP export "
                        "never replaces a non-empty directory")
    p.add_argument("--trust-pickle", action="store_true",
                   help="unpickle a trainer payload that is not data (written before payload format 2): this runs "
                        "code the pickle names, so only for a store you wrote; `cnrstore migrate-payload` rewrites "
                        "such payloads as data once")
    p = add("import", cmd_import, "seed a new, empty store's first version (a baseline in the Checkpointer's "
            "layout, restorable by cnrstore.torch.Checkpointer) from a torch.save file, a safetensors file or "
            "a DCP directory: the model, and the optimizer and extra state of an `export --layout checkpoint` "
            "file; a nested export (`export --layout nested`: tables/, dense/ and keyed/ entries) is taken back "
            "as it is, keyed tables included (their keys, values and columns, default partitions); a source "
            "that cannot be read, or holds what the import does not understand, is refused "
            "(exit 2) and the store is left as it was", store_help="path of the store (created if missing; must "
            "hold no version)")
    p.add_argument("source", help="torch.save file, safetensors file or DCP checkpoint directory")
    p.add_argument("--codec", default="fp32", help="codec of the embedding tables (default fp32: lossless)")
    p.add_argument("--table-codec", action="append", default=[], metavar="NAME=CODEC",
                   help="codec of one table (repeatable), e.g. --table-codec emb.0=int4")
    p.add_argument("--table", action="append", default=None, metavar="PATTERN",
                   help="state-dict keys (glob) that are embedding tables (repeatable); default: 2-D float "
                        "*.weight tensors whose module path contains 'emb', or with at least --min-rows rows")
    p.add_argument("--min-rows", type=int, default=DEFAULT_MIN_ROWS,
                   help=f"rows that make a 2-D *.weight tensor a table without --table (default {DEFAULT_MIN_ROWS:,})")
    p.add_argument("--source-format", choices=SOURCE_FORMATS, default=None,
                   help="format of SOURCE (default: detected)")
    p.add_argument("--step", type=int, default=None,
                   help="training step to record with the version (default: the source's 'step', if any)")
    p.add_argument("--model-only", action="store_true",
                   help="import the model state dict alone and leave out every other entry of SOURCE (a "
                        "trainer's optimizer, epoch, ...); without it SOURCE may hold beside 'model' only what "
                        "`export --layout checkpoint` writes (optimizers with param_names, extra, step, meta), "
                        "which is imported, and anything else is refused")
    p = add("migrate-payload", cmd_migrate_payload, "rewrite, once, the trainer payloads (torch.state) of a store "
            "written before payload format 2 as data, so that restore and export read them without unpickling; "
            "without --trust-pickle only list them", progress=True)
    p.add_argument("--trust-pickle", action="store_true",
                   help="unpickle each pickled payload once to rewrite it (this runs code the pickle names: only "
                        "for a store you wrote)")
    p = add("diff", cmd_diff, "what changed between two versions (Store.changes): per table the rows whose value "
            "at V2 came from a version newer than V1 and their bytes in the codec they are stored in, and the dense "
            "arrays put in between; what a serving replica at V1 loads to reach V2. Over-reports only rows put "
            "again with the value they had; never under-reports. A keyed table: the keys put or changed (exact) "
            "and the keys deleted (evicted)")
    p.add_argument("since", type=int, metavar="V1",
                   help="the version the replica holds (0: none, every row: a full sync); must be retained")
    p.add_argument("until", type=int, nargs="?", default=None, metavar="V2", help="the version to reach "
                   "(default: the newest)")
    p.add_argument("--rows", action="store_true", help="also list the changed row ids of each table (a keyed table: the keys put or changed, "
                   "and the keys deleted)")
    p = add("repair", cmd_repair, "rebuild the index from the segment log (after index loss or damage); keeps "
            "every version it can prove whole and says which it cannot (exit 1 then); with --remote, first "
            "rebuild a lost or damaged pointer from the newest snapshot that verifies", progress=True)
    p.add_argument("--no-record-check", dest="record_check", action="store_false",
                   help="with --remote, when rebuilding a pointer: check each snapshot's index and its segments' "
                        "lengths only, not every record's checksum through the bucket (one read per record: "
                        "slow on a large store in a remote bucket)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring). Never shows a traceback for
    a store error, an OS error, a closed pipe or Ctrl-C. What the library logs at WARNING or above during
    the command (``cnrstore.*`` loggers) is held (``Notes``): folded into a failed command's one line on
    stderr, written to stderr after a command that returned, one line each."""
    args = build_parser().parse_args(argv)
    notes = Notes()
    try:
        with notes.held():
            status = args.func(args)
    except CnrError as exc:
        _fail(args, _message(args, exc), notes)
        return 2
    except BrokenPipeError:  # e.g. `cnrstore ls | head`: the reader is gone; say nothing more
        _silence_stdout()
        return 0
    except OSError as exc:
        where = f" ({exc.filename})" if getattr(exc, "filename", None) and str(exc.filename) not in str(exc) else ""
        _fail(args, f"{type(exc).__name__}: {exc}{where}; check that the path exists and is accessible, and the "
                    "file system's health and free space", notes)
        return 2
    except KeyboardInterrupt:
        _fail(args, "interrupted", notes)
        return 130
    finally:
        Progress.dangling = None
    for line in notes.lines:
        print(f"cnrstore {args.command}: note: {line}", file=sys.stderr)
    return status


class Notes(logging.Handler):
    """The library's log records at WARNING or above during one command, each as one line (``held``: the
    ``cnrstore`` logger sends them here, and on to the root logger only where the caller configured a handler
    there: never to Python's last-resort one, which would write them to stderr as they come)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = " ".join(record.getMessage().split())
        except Exception:  # noqa: BLE001 - a record that does not format is not worth failing a command for
            line = str(record.msg)
        line = line.removeprefix("cnrstore: ")
        if line not in self.lines:
            self.lines.append(line)

    @contextlib.contextmanager
    def held(self):
        logger = logging.getLogger("cnrstore")
        propagate = logger.propagate
        logger.addHandler(self)
        # (with no handler configured, Python's last-resort one would write each record to stderr: held here
        # instead; a caller that configured logging, cli.main called in-process, still gets them)
        logger.propagate = propagate and logging.getLogger().hasHandlers()
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.propagate = propagate

    def folded(self, message: str) -> str:
        """``message`` with the notes it does not already say appended (one line)."""
        extra = [line for line in self.lines if line not in message]
        return message + (f" (also logged: {'; '.join(extra)})" if extra else "")


def _fail(args, message: str, notes: Notes | None = None) -> None:
    """The one line on stderr of a failed command (after finishing a progress bar it cut short), with what
    the library logged meanwhile folded into it."""
    if Progress.dangling is not None:
        Progress.dangling.write("\n")
        Progress.dangling = None
    if notes is not None:
        message = notes.folded(message)
    print(f"cnrstore {args.command}: {message}", file=sys.stderr)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
