"""Multi-rank checkpoints over torch.distributed: sharded saves, an atomic global commit, resharding
restores and CPR partial recovery.

Every rank runs a :class:`DistributedCheckpointer` over its part of the model: the embedding shards the
:class:`ShardingPlan` gives it (module path = table name, shard rows = module rows) and its replica of the
dense layers. Each rank writes into its own ordinary cnrstore store under one root (see ``manifest``),
through a ``cnrstore.torch.Checkpointer``: the trainer stalls only for the host snapshot.

The global commit, in each rank's background thread after its local write:

1. the local version commits (durable) or fails;
2. ``all_gather_object`` over a gloo group of the checkpointer's own collects every rank's outcome;
3. if all committed, rank 0 writes the manifest naming every local version (atomically, last);
4. rank 0 broadcasts the outcome, and ``PendingSave.wait()`` returns the global version or raises
   :class:`GlobalCommitError`.

On a root in a bucket, steps 3-4 are the save's *publication*, preceded by every rank's copy point (and a
second gather): it runs in a thread of its own behind the next saves (``remote_lag_s``; ``_publish``).

A crash of any rank at any point leaves the previous global version whole: a global version exists only
once its manifest is written, and the manifest names local versions that are durable already. Local
versions no manifest names are orphans; they are dropped when a rank starts up and as retention proceeds.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..errors import CnrError, GlobalCommitError, InvalidArgument, MissingRows, TableNotFound
from ..policy import compaction as compaction_policy
from .. import errors
from ..torch import mc_saves
from ..torch import payload as _payload
from ..torch import preemption, reports
from ..torch.async_save import PendingSave, SaveReport, WeakPendingWork
from ..torch.bucket_lag import DEFAULT_REMOTE_LAG_S, check_remote_lag_s
from ..torch.checkpointer import Checkpointer
from ..engine.uploads import BucketLag
from ..torch.optim_state import is_keyed, row_state_width
from ..torch.payload import DENSE_PREFIX, KEYED_MARK, ROW_MARK, STATE_BLOB
from ..torch.sharded import is_rank_local
from ..torch.tracking import ShardTable
from . import failures, reshard_mch
from .manifest import GlobalVersion
from .plan import ShardingPlan
from .reshard_keyed import KeyedReshard
from .remote_root import open_root

__all__ = ["DistributedCheckpointer", "DistributedPendingSave", "RecoveryReport"]

log = logging.getLogger("cnrstore.distributed")


@dataclass
class RecoveryReport:
    """What a partial recovery did. ``lost_update_fraction`` estimates the portion of all embedding
    updates of the run that the failure lost: the failed ranks' share of embedding rows times the share of
    training steps since the checkpoint (CPR's "portion of lost samples", assuming updates spread evenly
    over the rows). When the checkpoint is a priority save, only its most-updated rows are that fresh:
    the truth lies between ``lost_update_fraction`` and ``lost_update_fraction_max``."""

    global_version: int
    checkpoint_step: int | None
    step: int | None
    failed_ranks: tuple[int, ...]
    restored: bool  # this rank restored its shards from the checkpoint
    lost_steps: int | None
    lost_update_fraction: float | None
    #: the same estimate from the newest regular (non-priority) global version: an upper bound when the
    #: newest version is a priority save, whose rows not picked are only as fresh as the save before it
    lost_update_fraction_max: float | None = None
    seconds: float = 0.0
    discarded_save_error: str | None = None  # a save in flight when the failure struck, which failed


def _taken_over(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says another job took the root or a rank store over."""
    while error is not None:
        if isinstance(error, errors.RemoteTakenOver):
            return True
        error = error.__cause__
    return False


@dataclass(eq=False)
class _InFlight:
    """A save the trainer's thread has not settled yet: its commit thread (the local write's end and every
    rank's outcome) and, on a bucket root, the publication that commit thread starts."""

    pending: "DistributedPendingSave"
    commit: threading.Thread | None = None
    publish: threading.Thread | None = None
    seq: int = 0  # (this checkpointer's count of saves: what the bucket's lag is kept by)


@dataclass(eq=False)
class _Unpublished:
    """A save whose local versions committed on every rank, waiting to be listed (on a bucket root: for its
    publication)."""

    entry: _InFlight
    local: PendingSave
    outcomes: list
    step: int | None
    meta: dict | None


class DistributedPendingSave(PendingSave):
    """A distributed save: the local snapshot is taken; the local write and the global commit run in the
    background. ``wait()`` returns the global version (also ``global_version`` once committed), or raises
    ``GlobalCommitError`` (or the local write's own error on the rank where it failed). ``cancel()`` does not
    stop a global commit: every rank takes part in it (the local write it waits for is cancellable)."""

    def __init__(self, report: SaveReport):
        super().__init__(report)
        self.global_version: int | None = None


def _host_copy(v: torch.Tensor) -> torch.Tensor:
    """A copy of the optimizer state ``v`` to send: in host memory (a 0-dim tensor keeps its device)."""
    v = v.detach()
    return v.to("cpu", copy=True) if v.dim() > 0 else v.clone()


def _check_dist() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgument("torch.distributed is not initialized; call torch.distributed.init_process_group "
                              "(gloo or nccl) on every rank before creating a DistributedCheckpointer")
    return dist.get_rank(), dist.get_world_size()


class DistributedCheckpointer:
    """Checkpoints this rank's shards and replicas into ``root``; see the module doc and docs/DESIGN.md.

    Collective: construct, ``save``, ``recover`` and ``close`` on every rank of the default process group,
    in the same order. ``restore`` reads files only, but every rank must restore the same version.

    ``codec``, ``mode``, ``optimizer_codec``, ``extra``, ``priority`` and ``ssu_rate`` are those of
    ``cnrstore.torch.Checkpointer``. ``compaction`` is the rank stores' background compaction (None,
    "auto" or a ``CompactionPolicy`` without retention: versions are kept or dropped by the global
    ``keep_last``, never by one rank alone). ``keep_last`` keeps that many newest global versions
    (None: all). ``timeout_s`` bounds how long a commit waits for the slowest rank.

    ``remote`` (``"s3://bucket/prefix"``, any fsspec URL) keeps the root in an object store: its marker,
    plans and global-version manifests under the prefix, and each rank's store with its index and active
    segment under ``root`` on this node's disk (``root`` need not be shared), its sealed segments under the
    prefix (remote_root.py; docs/DESIGN.md, "Multi-node jobs on a bucket"). Each save is then *published*
    behind the trainer and the next saves: every rank's copy point, then rank 0 lists the version (``wait()``
    returns once it is listed). A save waits for the bucket only once it trails by more than ``remote_lag_s``
    seconds (600; the oldest save committed on every rank and not listed); ``remote_every=N`` (default None)
    bounds it in saves instead: how many saves may still be publishing when a save starts. ``remote_options``,
    ``remote_timeout_s`` and ``cache_bytes`` are ``cnrstore.open``'s, for every rank store.
    A job that starts on the prefix takes it over: the job that wrote it before fails at its next save
    (``GlobalCommitError`` caused by ``RemoteTakenOver``).

    ``on_report`` (as ``Checkpointer``'s): a callable given, on every rank, each save's ``SaveReport`` once
    it is a global version (``version`` is the global version; on the commit thread, before ``wait()``
    returns) and each restore's ``RestoreReport``; None: logged at INFO on the ``cnrstore.torch`` logger.

    ``optimizer`` is an ``Optimizer``, a list of them (e.g. Adagrad on the shards, Adam on the dense layers:
    the same number, in the same order, on every rank) or None, as ``Checkpointer``'s: each is saved, restored
    (by parameter name when resharding) and, for the replicated dense parameters, copied to replaced ranks by
    ``recover``.

    SIGTERM: this rank's ``Checkpointer`` is made with ``on_sigterm="finish"`` (its default; there is no
    ``"save"`` here, which would have to be collective): SIGTERM raises ``SystemExit(143)`` in the main thread,
    and ``close()`` (a ``with`` block's exit) or the exit hook waits for the global commits of the saves
    ``save()`` returned, which the commit threads of every rank complete on this checkpointer's group, whether
    or not their main threads were signalled. A SIGTERM that stops a rank *inside* ``save()`` (before its
    commit thread starts) leaves that save without this rank: the ranks where it returned get
    ``GlobalCommitError`` from it once this process has exited (docs/API.md, "Multi-rank jobs": a known gap).
    """

    def __init__(self, root, model: nn.Module, optimizer=None, *, plan: ShardingPlan | None = None, codec="fp32",
                 mode: str = "incremental", optimizer_codec: str = "fp32", extra=None, priority=None,
                 ssu_rate: float | None = None, compaction=None, keep_last: int | None = None,
                 timeout_s: float = 600.0, on_report=None, remote=None, remote_options: dict | None = None,
                 remote_timeout_s: float | None = None, cache_bytes: int | None = None,
                 remote_every: int | None = None, remote_lag_s: float = DEFAULT_REMOTE_LAG_S):
        self._on_report = reports.check_hook(on_report, "DistributedCheckpointer")
        self.rank, self.world_size = _check_dist()
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be positive, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        if remote is None and remote_every is not None:
            raise InvalidArgument("remote_every applies to a root in a bucket (remote=...)")
        if remote_every is not None and (isinstance(remote_every, bool) or not isinstance(remote_every, int)
                                         or remote_every < 1):
            raise InvalidArgument(f"remote_every={remote_every!r}: pass a count of saves >= 1, or None")
        #: a bucket root: each save's copy points and listing (its publication) run behind it, in a thread of
        #: their own, while training and the next saves go on: as far as ``remote_lag_s`` seconds behind (or,
        #: given ``remote_every``, at most that many saves behind)
        self._pipelined = remote is not None
        self.remote_every = remote_every
        self.remote_lag_s = check_remote_lag_s(remote_lag_s)
        #: the saves committed on every rank that the bucket does not list yet (by ``_InFlight.seq``)
        self._bucket_lag = BucketLag()
        self._seq = 0
        self._last_publish_error: BaseException | None = None
        self._group = self._publish_group = None
        self._world = None
        self._new_group()  # (collective) every collective of this checkpointer runs on it, whatever the backend
        try:
            self.root = open_root(root, remote=remote, remote_options=remote_options,
                                  remote_timeout_s=remote_timeout_s, cache_bytes=cache_bytes)
            self._setup(model, optimizer, plan, codec, mode, optimizer_codec, extra, priority, ssu_rate,
                        compaction, keep_last)
        except BaseException:
            self._release_group()
            raise

    def _setup(self, model, optimizer, plan, codec, mode, optimizer_codec, extra, priority, ssu_rate,
               compaction, keep_last) -> None:
        """The rest of ``__init__``, once this checkpointer's gloo group exists."""
        self._plan_from_model = plan is None
        if plan is None:  # a TorchRec model: its own sharding (collective), else a clear error
            plan = ShardingPlan.from_torchrec(model, self.world_size, group=self._group)
        if not isinstance(plan, ShardingPlan):
            raise InvalidArgument(f"plan must be a cnrstore.distributed.ShardingPlan, got {type(plan).__name__}")
        if plan.world_size != self.world_size:
            raise InvalidArgument(f"the plan is for {plan.world_size} ranks, the process group has "
                                  f"{self.world_size}; make a plan for this world size")
        policy = compaction_policy.resolve(compaction)
        if policy is not None and policy.retention is not None:
            raise InvalidArgument("a rank store's compaction policy must not drop versions (retention=None): "
                                  "a global version needs every rank's local version; use keep_last=")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise InvalidArgument(f"keep_last must be a positive integer or None, got {keep_last!r}")
        self.plan = plan
        self.model = model
        self.keep_last = keep_last
        self._shards = plan.shards_of(self.rank)
        self._check_model(model)
        self.generation = self._join()
        self.root.remove_local_leftovers()
        self.store = self.root.open_store(self.root.store_rel(self.generation, self.rank), create=True,
                                          compaction=policy)
        try:
            self._reclaim_local(startup=True)
            kwargs = {}
            if priority is not None:
                kwargs["priority"] = priority
            if ssu_rate is not None:
                kwargs["ssu_rate"] = ssu_rate
            self._local = Checkpointer(self.store, model, optimizer, codec=codec, mode=mode,
                                       optimizer_codec=optimizer_codec, extra=extra, on_report=reports.silent,
                                       **kwargs)
        except BaseException:
            self.store.close()
            raise
        # (on a bucket root without remote_every a save does not wait for the previous one's local write: a
        # failure of it is surfaced by this checkpointer's gather, two saves later, never by one rank alone)
        self._local.raises_own_failures = not (self._pipelined and self.remote_every is None)
        self._saves: list[_InFlight] = []  # saves the trainer's thread has not settled yet, oldest first
        self._last_publish: threading.Thread | None = None  # (bucket roots) each publication waits for the one before
        self._unpublished: list[_Unpublished] = []  # (bucket roots) in save order; appended by the commit thread
        self._unpublished_lock = threading.Lock()
        self._error: BaseException | None = None  # a failure the next save() raises, and which save it was
        self._error_save: DistributedPendingSave | None = None
        self._closed = False
        # the rank store's close() and the interpreter's exit wait for the global commit in flight (its
        # thread is a daemon; see store.EXIT_WAIT_S), so a save() that returned becomes a global version
        # when the process then dies of Ctrl-C or an uncaught exception, as long as the other ranks live
        # (its commit cannot be cancelled from outside: the other ranks wait on it; the local save beneath
        # has its own pending work)
        self._work = WeakPendingWork(self, DistributedCheckpointer._finish_saves, None, lambda owner: owner._error)
        self.store.add_pending_work(self._work)

    # -- set-up ---------------------------------------------------------------------------------------
    def _check_model(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidArgument(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if self.plan.row_ids == "global":
            return  # the plan was read off the model's TorchRec shards
        seen = set()
        for path, module in model.named_modules():
            if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                continue
            name = path or "embedding"
            shard = self._shards.get(name)
            if shard is None:
                raise InvalidArgument(f"rank {self.rank}'s model has embedding {name!r}, which the plan does not "
                                      f"give this rank (it gives {sorted(self._shards)}); fix the plan or the model")
            rows, dim = module.weight.shape
            want = (shard.num_rows, self.plan.tables[name][1])
            if (rows, dim) != want:
                raise InvalidArgument(f"rank {self.rank}: embedding {name!r} is {rows} x {dim}, its shard in the "
                                      f"plan is rows [{shard.row_start}, {shard.row_end}) x {want[1]}")
            seen.add(name)
        missing = sorted(set(self._shards) - seen)
        if missing:
            raise InvalidArgument(f"the plan gives rank {self.rank} shards of {missing}, but its model has no "
                                  "embedding module of that name")

    def _release_group(self) -> None:
        """Destroy this checkpointer's gloo groups while the default group they were made in is alive (after
        the default group is destroyed, torch has released them already)."""
        groups = (self._group, self._publish_group)
        self._group = self._publish_group = None
        for group in groups:
            if group is not None and dist.is_initialized() and dist.group.WORLD is self._world:
                try:
                    dist.destroy_process_group(group)
                except Exception:  # a group broken by a dead peer: nothing left to release
                    pass

    def _new_group(self) -> None:
        """Create this checkpointer's gloo group over the current default group (collective). Every
        collective of the checkpointer runs on it: its messages are CPU tensors, which an NCCL default
        group cannot carry, and a trainer's own NCCL collectives never queue behind a checkpoint's."""
        self._release_group()
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        if self._pipelined:  # the publications' own: they run beside the next save's commit (see _publish)
            self._publish_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        self._world = dist.group.WORLD

    def _join(self) -> int:
        """Agree on the generation over this checkpointer's group (collective). Rank 0 makes the root and
        the generation's plan file."""
        answer: list = [None]
        failed = None
        if self.rank == 0:
            try:
                self.root.create()
                answer = [("ok", self.root.generation_for(self.plan))]
            except BaseException as exc:  # every rank must hear of it, or the others wait forever
                failed = exc
                answer = [("error", (type(exc).__name__, str(exc)))]
        failures.broadcast_object_list(answer, src=0, group=self._group)
        status, value = answer[0]
        if status != "ok":
            if failed is not None:
                raise failed  # (rank 0: its own error, as raised)
            name, message = value  # (the others: the same type, when it is one of cnrstore's errors)
            kind = getattr(errors, name, None)
            kind = kind if isinstance(kind, type) and issubclass(kind, CnrError) else CnrError
            raise kind(f"rank 0 could not prepare the distributed root {self.root.path}: {name}: {message}")
        self.root.check()
        return int(value)

    def _regroup(self) -> None:
        """After the default group was re-created: the collectives a new checkpointer of the replaced ranks
        runs in its constructor (the plan read off a TorchRec model, then ``_join``), checking the plan."""
        if dist.group.WORLD is self._world:
            return
        _check_dist()
        self._new_group()
        if self._plan_from_model:
            plan = ShardingPlan.from_torchrec(self.model, self.world_size, group=self._group)
            if plan != self.plan:
                raise InvalidArgument("the re-formed job's TorchRec shards are not the ones this checkpointer saved "
                                      "(another world size or plan): open a new DistributedCheckpointer and restore()")
        self._join()

    def needs_rejoin(self) -> bool:
        """*For sibling modules* (``ECRM.recover``): whether the default process group was re-created since
        this checkpointer last joined it, so that :meth:`rejoin` must run before its other collectives."""
        return dist.group.WORLD is not self._world

    def rejoin(self) -> str | None:
        """Join the default process group re-formed after a failure (collective, on every rank of the new
        group, before other collectives of this checkpointer). ``recover`` does it by itself;
        ``ECRM.recover`` calls it so that every rank creates its groups in the same order. A save that
        was in flight when the failure struck failed (the previous global version is intact): its error
        is dropped here and returned as text, so that the next ``save`` does not raise it."""
        self._finish()
        discarded = None
        if self._error is not None:
            discarded, self._error = f"{type(self._error).__name__}: {self._error}", None
        self._regroup()
        return discarded

    def _referenced(self) -> set[int]:
        return self.root.named_local_versions().get(self.root.store_rel(self.generation, self.rank), set())

    def _reclaim_local(self, startup: bool = False) -> list[int]:
        """Drop local versions no global version refers to, then collect their space.

        At start-up every unreferenced version goes (no commit of this store can be in flight: we hold its
        lock); later only those older than the newest referenced one (a newer one may be in a commit)."""
        referenced = self._referenced()
        newest = max(referenced, default=0)
        drop = {vi.version for vi in self.store.versions()
                if vi.version not in referenced and (startup or vi.version < newest)}
        if not drop:
            return []
        dropped = self.store.drop_versions(drop, allow_newest=startup)
        self.store.gc()
        return dropped

    # -- queries --------------------------------------------------------------------------------------
    def versions(self) -> list[GlobalVersion]:
        """Committed global versions, oldest first."""
        return self.root.versions()

    def latest(self) -> GlobalVersion | None:
        return self.root.latest()

    @property
    def local(self) -> Checkpointer:
        """This rank's ``cnrstore.torch.Checkpointer`` (its store is ``self.store``)."""
        return self._local

    # -- save -----------------------------------------------------------------------------------------
    def _finish(self) -> None:
        self._settle(0)

    def _finish_saves(self, timeout: float | None) -> bool:
        """Wait for every global commit in flight (for good, or ``timeout`` seconds); whether all ended."""
        return self._settle(0, timeout)

    def _settle(self, running: int, timeout: float | None = None) -> bool:
        """Wait for the saves in flight, except the publications of the newest ``running`` saves (bucket
        roots; 0: wait for all, or ``timeout`` seconds); whether they ended. Their first failure becomes
        ``_error`` (for the next save). Which saves are settled depends only on the calls made, never on
        how fast threads ran, so every rank raises a failure at the same call. A save is forgotten only
        once it has ended: an interrupt while waiting leaves it to the next wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = [e for e in self._saves if e.commit is not None]
        for e in waited:  # (the commits first: a commit starts its save's publication)
            e.commit.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(e.commit.is_alive() for e in waited):
            return False
        leave = self._saves[len(self._saves) - running:] if running else []
        for e in self._saves:
            if e.publish is not None and e not in leave:
                e.publish.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if e.publish.is_alive():
                    return False
        settled = [e for e in self._saves if e.publish is None or e not in leave]
        for e in settled:
            error = e.pending.failure()
            if error is not None and self._error is None:
                self._error, self._error_save = error, e.pending
        self._saves = [e for e in self._saves if e not in settled]
        return True

    def _settle_behind(self) -> float:
        """The settling of a save on a bucket root without ``remote_every``: the commits of the saves in
        flight but the newest (every rank's local outcome, gathered: a failure is raised at the same call on
        every rank, two saves later; this rank's local checkpointer raises none of its own, ``_setup``),
        never their publications, unless the bucket lags past ``remote_lag_s``: then wait until it is back
        within it. A publication that failed is logged and left to the next, which lists the saves after it
        (its ``wait()`` raised it); one that found the root taken over by another job is raised. Returns
        the seconds waited for the bucket."""
        newest = self._saves[-1:]  # (its local write may go on: the local queue holds two saves, max_lag=2)
        for e in self._saves:
            if e.commit is not None and e not in newest:
                e.commit.join()
        waited = 0.0
        if self._bucket_lag.seconds() > self.remote_lag_s:
            waited = self._bucket_lag.wait_within(self.remote_lag_s, self._no_publication_running,
                                                  f"rank {self.rank}'s save")
        settled = [e for e in self._saves if e not in newest and (e.publish is None or not e.publish.is_alive())]
        for e in settled:
            error = e.pending.failure()
            if error is None:
                continue
            if e.publish is None or _taken_over(error):
                if self._error is None:
                    self._error, self._error_save = error, e.pending
            else:
                log.warning("cnrstore: rank %d: the bucket does not list the save of step %s (the next save's "
                            "publication lists the saves after it; the bucket lags %.1f s): %s: %s", self.rank,
                            e.pending.report.step, self._bucket_lag.seconds(), type(error).__name__, error)
        self._saves = [e for e in self._saves if e not in settled]
        return waited

    def _no_publication_running(self) -> BaseException | None:
        """While a save waits for the bucket: the error to raise once no publication is left that could list
        what the bucket lacks (None while one runs)."""
        if any(e.publish is not None and e.publish.is_alive() for e in self._saves):
            return None
        last = self._last_publish_error
        return GlobalCommitError(
            f"rank {self.rank}: the bucket lags {self._bucket_lag.seconds():.0f} s ({self._bucket_lag.versions()} "
            f"save(s)), past remote_lag_s={self.remote_lag_s:g}, and no publication is running"
            + ("" if last is None else f": the last failed: {type(last).__name__}: {last}")
            + "; the saves stand in every rank's local store", [])

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def save(self, step: int | None = None, meta: dict | None = None, *, top: float | None = None
             ) -> DistributedPendingSave:
        """Snapshot this rank's state and commit it as a global version in the background (collective).

        Waits for the previous save's local write and its gather first (on a bucket root: with ``remote_every``,
        also for the publications of the saves before the newest ``remote_every``; without it, for the commit of
        the save before the previous one only, and for the bucket only past ``remote_lag_s``); a failure among
        those is raised here
        once (whether or not ``wait()`` raised it already, so that every rank raises at the same call),
        without taking a snapshot. ``top`` makes a CPR priority save
        (see ``cnrstore.torch.Checkpointer.save``)."""
        if self._closed:
            raise InvalidArgument("this DistributedCheckpointer is closed")
        with preemption.deferred():  # (a SIGTERM here exits once this rank has taken its part in the save)
            bucket_wait_s = 0.0
            if self._pipelined and self.remote_every is None:
                bucket_wait_s = self._settle_behind()
            else:
                self._settle(self.remote_every if self._pipelined else 0)
            if self._error is not None:
                # surfaced here, once: the local checkpointer must not raise it again at its next save, or
                # this rank would skip a collective the others enter
                # (a local version that committed while the global commit failed is an orphan that later
                # increments still read through: drop_versions keeps whatever a kept version reads)
                self._local.forget_failure()
            self._raise_pending_error()
            local = self._local.save(step, meta) if top is None else self._local.save(step, meta, top=top)
            if self._pipelined:
                local.report.bucket_lag_s = self._bucket_lag.seconds()
                local.report.bucket_lag_versions = self._bucket_lag.versions()
                local.report.bucket_wait_s = bucket_wait_s
                local.report.stall_s += bucket_wait_s
            self._seq += 1
            entry = _InFlight(DistributedPendingSave(local.report), seq=self._seq)
            previous = next((e.commit for e in reversed(self._saves) if e.commit is not None), None)
            entry.commit = threading.Thread(target=self._commit, args=(entry, local, step, meta, previous),
                                            name=f"cnrstore-dist-commit-{step}", daemon=True)
            self._saves.append(entry)
            entry.commit.start()
        return entry.pending

    def _commit(self, entry: "_InFlight", local, step, meta, previous: threading.Thread | None = None) -> None:
        """The commit thread: the local write's end and every rank's outcome; then, on a shared file system,
        the listing; on a bucket root, the publication is started in a thread of its own. It starts once the
        previous save's commit thread has ended (``previous``: on a bucket root without ``remote_every`` the
        next save may start before it has), so that the gathers run in save order on every rank."""
        try:
            if previous is not None:
                previous.join()
            outcomes = self._gather_outcomes(local, step)
            if self._pipelined:
                self._bucket_lag.committed(entry.seq)
                with self._unpublished_lock:
                    self._unpublished.append(_Unpublished(entry, local, outcomes, step, meta))
                entry.publish = threading.Thread(target=self._publish, args=(entry, self._last_publish),
                                                 name=f"cnrstore-dist-publish-{step}", daemon=True)
                self._last_publish = entry.publish
                entry.publish.start()
                return
            [version] = self._list_many([_Unpublished(entry, local, outcomes, step, meta)], self._group)
        except BaseException as exc:
            self._ended(entry.pending, local, None, exc)
            return
        error = None
        try:
            if self.keep_last is not None:
                self._reclaim_local()
        except BaseException as exc:
            error = exc
        self._ended(entry.pending, local, version, error)

    def _ended(self, pending: "DistributedPendingSave", local, version: int | None,
               error: BaseException | None) -> None:
        pending.global_version = version
        try:
            if error is None and version is not None:
                reports.deliver(self._on_report, dataclasses.replace(local.report, version=version), background=True)
        finally:
            pending.finish(version, error)

    def _gather_outcomes(self, local, step) -> list:
        """Wait for this rank's local write, then gather every rank's outcome (collective); raises the local
        write's error on the rank where it failed, GlobalCommitError on the others.

        On a bucket root the writer is idle from the local commit until the next save opens (which waits for
        this thread): its segment is sealed now, whole, for the publication to upload, and the local versions
        no listed global version needs are reclaimed (best effort: a failure is logged)."""
        ok, version, reason, local_error = True, None, "", None
        try:
            version = local.wait()
            if self._pipelined:
                self.store.engine.seal_idle_writer_segment()
        except BaseException as exc:
            ok, reason, local_error = False, f"{type(exc).__name__}: {exc}", exc
        if ok and self._pipelined and self.keep_last is not None:
            try:
                self._reclaim_local()
            except Exception as exc:  # noqa: BLE001 - space comes back at a later save
                log.warning("cnrstore: rank %d could not reclaim local versions no global version needs: %s: %s",
                            self.rank, type(exc).__name__, exc)
        outcomes: list = [None] * self.world_size
        try:
            failures.all_gather_object(outcomes, (ok, version, reason, bool(local.report.priority)),
                                       group=self._group)
        except Exception as exc:
            raise self._incomplete(step, exc) from exc
        failed = [r for r, (ok_, _v, _why, _prio) in enumerate(outcomes) if not ok_]
        if not failed:
            return outcomes
        if not ok:
            raise local_error
        why = "; ".join(f"rank {r}: {outcomes[r][2]}" for r in failed)
        raise GlobalCommitError(f"the save of step {step} is not a global version: the local write failed on "
                                f"rank(s) {failed} ({why})", failed)

    def _incomplete(self, step, exc: BaseException) -> GlobalCommitError:
        """The error of a collective of the commit that failed (``exc``, torch.distributed's), in words."""
        text = str(exc)
        low = text.lower()
        if "not initialized" in low or "not registered" in low or "destroyed" in low:
            why = ("this rank's process group was destroyed before the commit ended (destroy_process_group, or "
                   "the job's exit, ran while it was in flight; close() the checkpointer first)")
        elif "closed by peer" in low or "connection reset" in low or "broken pipe" in low:
            why = "another rank closed its connection: it died, or left the job"
        elif "timed out" in low or "timeout" in low:
            why = f"another rank did not take part within timeout_s={self.timeout_s:g}: it died or is stalled"
        else:
            why = f"a rank may have died or be slower than timeout_s={self.timeout_s:g}"
        return GlobalCommitError(
            f"rank {self.rank}: the global commit of step {step} did not complete: {why}. The previous global "
            f"version is intact. (torch.distributed: {type(exc).__name__}: {text.splitlines()[0] if text else ''})")

    def _publish(self, entry: "_InFlight", previous: threading.Thread | None) -> None:
        """A bucket root's publication of ``entry``'s save, and of the saves queued behind it that every rank
        has committed locally too (a publication that fell behind catches up in one): each rank's copy point
        (its store's sealed segments and index snapshot in the bucket, holding every local version committed
        so far), gathered with how many queued saves it covers; then rank 0 lists the first that many saves
        at once (``commit_many``). Runs behind the trainer, one publication at a time, in save order, over a
        gloo group of its own (the next save's gather may run meanwhile on the checkpointer's group). A save
        that an earlier publication listed already has nothing left to do."""
        batch: list[_Unpublished] = []
        versions: list[int] | None = None
        error = None
        try:
            if previous is not None:
                previous.join()
            with self._unpublished_lock:
                queued = list(self._unpublished)
            if not queued or queued[0].entry is not entry:
                return  # (an earlier publication listed it, or failed it)
            batch = queued[:1]
            ok, reason, own = True, "", None
            try:
                self.store.sync_remote()  # (after `queued` was read: it holds every local version queued)
            except BaseException as exc:
                ok, reason, own = False, f"{type(exc).__name__}: {exc}", exc
            copies: list = [None] * self.world_size
            try:
                failures.all_gather_object(copies, (ok, reason, len(queued)), group=self._publish_group)
            except Exception as exc:
                raise self._incomplete(batch[0].step, exc) from exc
            batch = queued[:min(n for _ok, _why, n in copies)]  # (the same saves on every rank: saves are in order)
            failed = [r for r, (ok_, _why, _n) in enumerate(copies) if not ok_]
            if failed:
                if own is not None:
                    raise own
                why = "; ".join(f"rank {r}: {copies[r][1]}" for r in failed)
                raise GlobalCommitError(f"the save of step {batch[0].step} is not a global version: rank(s) {failed} "
                                        f"could not make their copy point in the bucket ({why})", failed)
            versions = self._list_many(batch, self._publish_group)
            self._bucket_lag.copied(batch[-1].entry.seq)
        except BaseException as exc:
            error = self._last_publish_error = exc
            self._bucket_lag.wake()
        finally:
            with self._unpublished_lock:
                self._unpublished = [q for q in self._unpublished if all(q is not b for b in batch)]
        for i, item in enumerate(batch):
            self._ended(item.entry.pending, item.local, None if versions is None else versions[i], error)

    def _list_many(self, batch: list[_Unpublished], group) -> list[int]:
        """Rank 0 lists every save of ``batch`` (on a bucket root, with one pointer swap) and broadcasts the
        outcome (collective over ``group``); returns their global versions, or raises GlobalCommitError."""
        step = batch[0].step
        decision: list = [None]
        cause = None  # (rank 0: the object store's own error, if the listing failed)
        try:
            if self.rank == 0:
                outcome, cause = self._decide_many(batch)
                decision = [outcome]
            failures.broadcast_object_list(decision, src=0, group=group)
        except Exception as exc:
            raise self._incomplete(step, exc) from exc
        status, value, failed = decision[0]
        if status == "ok":
            return [int(v) for v in value]
        error = GlobalCommitError(f"the save of step {step} is not a global version: {value}", failed)
        if status == "taken":  # (every rank learns that another job owns the root: the next save raises it)
            raise error from errors.RemoteTakenOver(value)
        raise error from cause

    def _decide_many(self, batch: list[_Unpublished]):
        """Rank 0: write the manifests of ``batch``'s saves (every rank committed them); returns
        ((status, [versions] | reason, ranks), the exception that failed it or None)."""
        try:
            first = max(self.root.version_numbers(), default=0) + 1
            gvs = [self._global_version(first + i, item.outcomes, item.step, item.meta)
                   for i, item in enumerate(batch)]
            self.root.commit_many(gvs)
        except BaseException as exc:
            what = "manifest" if len(batch) == 1 else "manifests"
            status = "taken" if isinstance(exc, (errors.RemoteTakenOver, errors.RemoteConflict)) else "error"
            return (status, f"rank 0 could not write the {what}: {type(exc).__name__}: {exc}", [0]), exc
        self._apply_retention()
        return ("ok", [gv.version for gv in gvs], []), None

    def _global_version(self, number: int, outcomes, step, meta) -> GlobalVersion:
        return GlobalVersion(version=number, step=step, meta=meta, created=time.time(), generation=self.generation,
                             plan=self.plan, local_versions=tuple(int(v) for _ok, v, _why, _prio in outcomes),
                             stores=tuple(self.root.store_rel(self.generation, r) for r in range(self.world_size)),
                             priority=any(prio for _ok, _v, _why, prio in outcomes))

    def _apply_retention(self) -> None:
        """Rank 0, after listing: drop the global versions beyond ``keep_last`` and the generations none reads
        (best effort: the versions are listed)."""
        try:
            if self.keep_last is not None:
                numbers = self.root.version_numbers()
                self.root.drop(numbers[:-self.keep_last])
                self.root.remove_unreferenced_generations(self.generation)
        except BaseException:  # retention is best effort: the versions are listed
            pass

    # -- restore --------------------------------------------------------------------------------------
    def restore(self, version: int | None = None, *, trust_pickle: bool = False) -> GlobalVersion:
        """Load global ``version`` (default newest) into this rank's model, optimizers and ``extra``.

        A version written under this checkpointer's plan is restored from this rank's own store; one
        written under another plan or world size is resharded: each shard's rows are read, at their
        point in time, from the stores of the ranks that held them (read-only), dense state from rank 0's
        store and optimizer state by parameter name; TorchRec MCH state is remapped (reshard_mch: ids re-routed,
        slots renumbered, a RuntimeWarning if a rank must drop ids), MPZCH moved by whole buckets, and each
        KeyedEmbedding gets the ids its rank owns (reshard_keyed). Every rank reads and checks its share before
        any loads: a refusal on one rank is raised on every rank, nothing loaded. Every rank must restore the
        same version.

        Each store's trainer payload is read as data (``Checkpointer.restore``): UnsafePayload for one whose
        pickle names code, unless ``trust_pickle=True`` (a warning, then a full unpickle)."""
        if self._closed:
            raise InvalidArgument("this DistributedCheckpointer is closed")
        start = time.perf_counter()
        self._finish()
        gv = self.root.latest() if version is None else self.root.read(version)
        if gv is None:
            raise InvalidArgument(f"{self.root.path} holds no global version to restore; save() one first")
        if gv.generation == self.generation and gv.plan == self.plan:
            self._local.restore(gv.local_versions[self.rank], trust_pickle=trust_pickle)
        else:
            self._reshard_agreed(gv, trust_pickle)
        reports.deliver(self._on_report, reports.RestoreReport(gv.version, gv.step, time.perf_counter() - start))
        return gv

    def _reshard_agreed(self, gv: GlobalVersion, trust_pickle: bool) -> None:
        """``restore`` of a version of another plan: every rank reads and checks its share first (each reads
        different rows and partitions, so one may refuse what another accepted); if any rank refused, every
        rank raises, and no rank has loaded anything (collective)."""
        failure = staged = resharder = None
        try:
            resharder = _Resharder(self, gv, trust_pickle=trust_pickle)
            staged = resharder.read()
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank has said whether it can load
            failure = exc
        said: list = [None] * self.world_size
        failures.all_gather_object(said, None if failure is None else f"{type(failure).__name__}: {failure}",
                                   group=self._group)
        if failure is not None:
            raise failure
        refused = [(r, m) for r, m in enumerate(said) if m is not None]
        if refused:
            rank, why = refused[0]
            raise InvalidArgument(f"restore of global version {gv.version} refused on rank {rank} ({why}); nothing "
                                  "was loaded on any rank")
        resharder.apply(staged)

    # -- partial recovery (CPR) -----------------------------------------------------------------------
    def recover(self, failed_ranks, step: int | None = None) -> RecoveryReport:
        """Partial recovery after ``failed_ranks`` were replaced (collective, on the new process group).

        The failed ranks (new processes with freshly built models) restore their shards, the row-wise
        optimizer state and ``extra`` from the newest global version; every other rank keeps its live
        state. Dense layers and their optimizer state, replicated on every rank, are copied to the failed
        ranks from the lowest surviving rank, so the replicas stay equal. ``step`` is the survivors'
        current training step (used for the lost-update estimate; a replaced rank may pass None).
        Re-joins the default process group first if it was re-created since this checkpointer last did.
        """
        if self._closed:
            raise InvalidArgument("this DistributedCheckpointer is closed")
        start = time.perf_counter()
        failed = tuple(sorted({int(r) for r in failed_ranks}))
        if not failed or any(not 0 <= r < self.world_size for r in failed):
            raise InvalidArgument(f"failed_ranks must name ranks in [0, {self.world_size}), got {failed_ranks!r}")
        discarded = None
        self._finish()
        if self._error is not None:
            discarded, self._error = f"{type(self._error).__name__}: {self._error}", None
        self._regroup()
        survivors = [r for r in range(self.world_size) if r not in failed]
        answer: list = [None]
        if self.rank == 0:
            gv0 = self.root.latest()
            answer = [None if gv0 is None else gv0.version]
        failures.broadcast_object_list(answer, src=0, group=self._group)
        if answer[0] is None:
            raise InvalidArgument("no global version to recover from; restart the job from scratch")
        gv = self.root.read(answer[0])
        if gv.plan != self.plan:
            raise InvalidArgument(f"global version {gv.version} was written under another plan; partial recovery "
                                  "needs the same plan: restore() every rank instead")
        restored = self.rank in failed
        if restored:
            if gv.generation == self.generation:
                self._local.restore(gv.local_versions[self.rank])
            else:
                _Resharder(self, gv).load()
        steps: list = [None] * self.world_size
        failures.all_gather_object(steps, step, group=self._group)
        if survivors:
            payload = [self._replicated_state() if self.rank == survivors[0] else None]
            failures.broadcast_object_list(payload, src=survivors[0], group=self._group)
            if restored:
                self._load_replicated_state(payload[0])
        current = max((s for s in steps if s is not None), default=None)
        share = sum(self.plan.rows_of(r) for r in failed) / max(self.plan.total_rows(), 1)

        def lost(since):
            if current is None or since is None:
                return None
            return share * max(current - since, 0) / current if current > 0 else 0.0

        regular = next((g for g in reversed(self.root.versions()) if not g.priority and g.version <= gv.version), None)
        return RecoveryReport(global_version=gv.version, checkpoint_step=gv.step, step=current,
                              failed_ranks=failed, restored=restored,
                              lost_steps=None if current is None or gv.step is None else max(current - gv.step, 0),
                              lost_update_fraction=lost(gv.step),
                              lost_update_fraction_max=lost(regular.step) if regular is not None else None,
                              seconds=time.perf_counter() - start, discarded_save_error=discarded)

    def _param_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    def _replicated_state(self) -> dict:
        """The dense parameters/buffers and their optimizer state, by name (sent to replaced ranks over the
        gloo group: tensors in host memory, but for 0-dim ones, which keep their device)."""
        names = self._param_names()
        local = self._local.trainer_state()
        dense_ids = {id(v) for v in local.dense.values()}
        optims = []
        for opt in local.optimizers:
            optims.append({names[id(p)]: {k: (_host_copy(v) if torch.is_tensor(v) else v)
                                          for k, v in opt.state.get(p, {}).items()}
                           for g in opt.param_groups for p in g["params"]
                           if id(p) in dense_ids and id(p) in names})
        return {"dense": {k: v.detach().cpu().clone() for k, v in local.dense.items() if not is_rank_local(k)},
                "optim": optims}

    def _load_replicated_state(self, state: dict) -> None:
        names = self._param_names()
        local = self._local.trainer_state()
        with torch.no_grad():
            for k, v in state["dense"].items():
                if k in local.dense and not is_rank_local(k):  # (managed-collision state is the rank's own)
                    local.dense[k].copy_(v)
        for opt, by_name in zip(local.optimizers, state["optim"]):
            for g in opt.param_groups:
                for p in g["params"]:
                    st = by_name.get(names.get(id(p)))
                    if st is not None:
                        # (a 0-dim state on a device, e.g. a capturable step, goes to this rank's device too)
                        opt.state[p] = {k: (v.to(p.device) if torch.is_tensor(v) and (v.dim() > 0 or v.is_cuda)
                                            else v)
                                        for k, v in st.items()}

    # -- lifecycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight, close the local checkpointer and store. Idempotent. A commit
        failure that neither ``wait()`` nor ``save()`` has raised is raised here (after closing)."""
        if self._closed:
            return
        self._finish()
        self._closed = True
        try:
            self._local.close()
        finally:
            self.store.close()
            self._release_group()
        if self._error is not None and self._error_save is not None and not self._error_save.failure_reported:
            err, self._error = self._error, None
            raise err

    def __enter__(self) -> "DistributedCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Resharder:
    """Loads a global version written under another plan into one rank's checkpointer (read-only reads
    of the other ranks' stores at their local versions)."""

    def __init__(self, owner: DistributedCheckpointer, gv: GlobalVersion, *, trust_pickle: bool = False):
        self.owner = owner
        self.trust_pickle = trust_pickle
        self.gv = gv
        self.local = owner.local
        self.state = owner.local.trainer_state()
        self._stores: dict[int, object] = {}
        new, old = owner.plan.tables, gv.plan.tables
        if owner.plan.row_ids != gv.plan.row_ids:
            raise InvalidArgument(f"global version {gv.version} was written by a model sharded "
                                  f"{'by TorchRec' if gv.plan.row_ids == 'global' else 'with a ShardingPlan'}, this "
                                  "checkpointer's model the other way; restore into a model of the same kind")
        if new != old:
            diff = sorted(set(new.items()) ^ set(old.items()))
            raise InvalidArgument(f"global version {gv.version} has tables {old}, this plan {new} (differences: "
                                  f"{diff}); restore into a model with the same tables")
        #: managed-collision state (each rank's own): read from this rank's store under the same plan, remapped
        #: from the old ranks' stores under another (reshard_mch; refused there if it cannot be)
        self.rank_local = sorted(k for k in self.state.dense if is_rank_local(k))
        self.mc = reshard_mch.plan(gv, owner.plan, owner.rank, owner.model, self.state, self.rank_local,
                                   owner._shards, self._store)

    def _store(self, rank: int):
        if rank not in self._stores:
            self._stores[rank] = self.owner.root.open_store(self.owner.root.rank_stores(self.gv)[rank],
                                                            readonly=True)
        return self._stores[rank]

    def _payload(self, rank: int) -> dict:
        blob = self._store(rank).read_dense(STATE_BLOB, self.gv.local_versions[rank])
        return _payload.decode(blob, self.gv.local_versions[rank], trust_pickle=self.trust_pickle,
                               store=self.gv.stores[rank] if self.gv.stores else None)

    def rows(self, name: str, table: str, width: int) -> np.ndarray:
        """Rows of this rank's shard of ``table`` from store table ``name`` (the weight or a row state)."""
        shard = self.owner._shards[table]
        out = np.empty((shard.num_rows, width), dtype=np.float32)
        for s in self.gv.plan.shards_of_table(table):
            lo, hi = max(shard.row_start, s.row_start), min(shard.row_end, s.row_end)
            if lo >= hi:
                continue
            st, v = self._store(s.rank), self.gv.local_versions[s.rank]
            first = lo if self.gv.plan.row_ids == "global" else lo - s.row_start  # the store numbers rows so
            try:  # straight into this shard's rows of ``out`` (every record verified first)
                st.read_tables({name: (first, out[lo - shard.row_start:hi - shard.row_start])}, v)
            except (TableNotFound, MissingRows) as exc:
                raise InvalidArgument(f"global version {self.gv.version}: rank {s.rank}'s store lacks {name!r} "
                                      f"rows [{lo}, {hi}) ({exc})") from exc
            except InvalidArgument as exc:
                raise InvalidArgument(f"{name!r} in global version {self.gv.version} (rank {s.rank}'s store) does "
                                      f"not hold rows [{lo}, {hi}) of width {width}, as here: {exc}") from exc
        return out if self.mc is None else self.mc.rows(name, table, out)  # (an MCH table's kept ids' rows moved)

    def _dense(self, key: str, shape) -> torch.Tensor:
        for rank in range(self.gv.world_size):  # rank 0 first: replicas are equal
            try:
                arr = self._store(rank).read_dense(DENSE_PREFIX + key, self.gv.local_versions[rank])
            except (MissingRows, TableNotFound):
                continue
            if tuple(arr.shape) != tuple(shape):
                raise InvalidArgument(f"state {key!r}: global version {self.gv.version} has shape "
                                      f"{tuple(arr.shape)}, the model {tuple(shape)}")
            return torch.from_numpy(arr.copy())
        raise InvalidArgument(f"global version {self.gv.version} has no state {key!r} of the model on any rank")

    def _rank_local_state(self) -> dict:
        """{key: tensor} of this rank's managed-collision state: from its own store under the same plan, else
        remapped from the old ranks' (reshard_mch)."""
        if not self.rank_local:
            return {}
        if self.mc is not None:
            return self.mc.state()
        rank = self.owner.rank
        st, v = self._store(rank), self.gv.local_versions[rank]
        targets = {k: self.state.dense[k] for k in self.rank_local}
        out = mc_saves.restore_groups(st, targets, v)
        for k in self.rank_local:
            if k not in out:
                arr = st.read_dense(DENSE_PREFIX + k, v)
                if tuple(arr.shape) != tuple(targets[k].shape):
                    raise InvalidArgument(f"state {k!r}: global version {self.gv.version} has shape "
                                          f"{tuple(arr.shape)} on rank {rank}, the model {tuple(targets[k].shape)}")
                out[k] = torch.from_numpy(arr.copy())
        return out

    def _optimizer_states(self, payloads: dict[int, dict]) -> list[dict]:
        names = self.owner._param_names()
        table_of = {id(t.weight): t for t in self.state.tables}
        optimizers = self.state.optimizers
        out = []
        for i, opt in enumerate(optimizers):
            by_rank = {}
            for r, payload in payloads.items():
                if len(payload["optimizers"]) != len(optimizers):
                    raise InvalidArgument(f"global version {self.gv.version} holds {len(payload['optimizers'])} "
                                          f"optimizer(s) on rank {r}, this checkpointer has {len(optimizers)}")
                pnames = payload.get("param_names")
                if pnames is None:
                    raise InvalidArgument(f"global version {self.gv.version} was saved without parameter names "
                                          "(an older cnrstore); restore it under the plan it was written with")
                saved = payload["optimizers"][i]
                if any(isinstance(k, str) for k in saved["state"]):   # torchrec's KeyedOptimizer: keyed by name
                    by_rank[r] = dict(saved["state"])
                else:
                    by_rank[r] = {n: saved["state"].get(j) for j, n in enumerate(pnames[i]) if n is not None}
            current = opt.state_dict()
            keyed = is_keyed(opt)
            params = [p for g in opt.param_groups for p in g["params"]]
            name_of = names
            if keyed:
                params = list(opt.params.values())
                name_of = {id(p): n for n, p in opt.params.items()}
            state = {}
            for idx, p in enumerate(params):
                name = name_of.get(id(p))
                t = table_of.get(id(p))
                ranks = ([s.rank for s in self.gv.plan.shards_of_table(t.name)] if t is not None
                         else list(range(self.gv.world_size)))
                src = next((by_rank[r][name] for r in ranks if by_rank[r].get(name) is not None), None)
                if src is None:
                    continue
                st = {}
                for k, val in src.items():
                    if isinstance(val, dict) and ROW_MARK in val:
                        shape = (self.owner._shards[t.name].num_rows,) + tuple(val["shape"][1:])
                        width = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
                        arr = torch.from_numpy(self.rows(val[ROW_MARK], t.name, width))
                        val = arr.reshape(shape).to(_payload.torch_dtype(val["dtype"], self.gv.version))
                    elif isinstance(val, dict) and KEYED_MARK in val:  # a KeyedEmbedding's: its rows read by id
                        val = self.keyed.optimizer_value(val)
                    st[k] = val
                state[name if keyed else idx] = st
            sd = {**current, "state": state}
            groups = current.get("param_groups")
            saved_groups = payloads[min(payloads)]["optimizers"][i].get("param_groups")
            if groups is not None and saved_groups is not None and len(saved_groups) == len(groups):
                sd["param_groups"] = [{**sg, "params": g["params"]} for g, sg in zip(groups, saved_groups)]
            out.append(sd)
        return out

    def load(self) -> None:
        """Read, check and load (one rank alone: ``recover``'s replaced ranks)."""
        self.apply(self.read())

    def read(self) -> tuple:
        """Everything to load, read from the stores and checked, nothing live changed (``apply`` loads it)."""
        state = self.state
        try:
            # the KeyedEmbeddings' ids this rank owns at this world size, from every rank store (reshard_keyed)
            self.keyed = KeyedReshard(state.keyed, [(self._store(r), self.gv.local_versions[r])
                                                    for r in range(self.gv.world_size)],
                                      self.owner.rank, self.owner.world_size, self.gv.version)
            self.keyed.read()
            weights = [torch.from_numpy(self.rows(t.name, t.name, t.dim)) for t in state.tables]
            own_seeds = {id(k.module.seed) for k in state.keyed}  # (each rank's KeyedEmbedding keeps its own seed)
            dense = {k: self._dense(k, v.shape) if id(v) not in own_seeds else v.detach().clone()
                     for k, v in state.dense.items() if k not in self.rank_local}
            dense.update(self._rank_local_state())
            for k, v in state.dense.items():
                if v.dtype == torch.bfloat16:
                    dense[k] = dense[k].view(torch.bfloat16)
            payloads = {r: self._payload(r) for r in range(self.gv.world_size)}
            optim_sds = self._optimizer_states(payloads)
            shard_states = [(st, torch.from_numpy(self.rows(f"{t.name}.optim.{key}", t.name, row_state_width(st))))
                            for t in state.tables if isinstance(t, ShardTable) for key, st in t.states]
            extra_src = payloads[self.owner.rank if self.owner.rank in payloads else 0]["extra"]
            missing = [k for k in state.extra if k not in extra_src]
            if missing:
                raise InvalidArgument(f"global version {self.gv.version} holds no extra state {missing}")
        finally:
            for st in self._stores.values():
                st.close()
        return weights, shard_states, dense, optim_sds, {k: extra_src[k] for k in state.extra}

    def apply(self, staged: tuple) -> None:
        """Load what ``read`` returned into the live objects."""
        self.local.load_state(*staged)
        self.keyed.load()
        self.local.note_restore()
