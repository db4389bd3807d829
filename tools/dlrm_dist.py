#!/usr/bin/env python3
"""The multi-rank mode of ``tools/train_dlrm.py`` (``--world-size N``): the same DLRM, data and metrics
(``tools/dlrm_model.py``), trained by N processes on this machine over ``torch.distributed`` (gloo,
FileStore rendezvous under the run's temp dir) and checkpointed with
``cnrstore.distributed.DistributedCheckpointer``.

The parallel scheme (simple and exact, not fast):

- the 26 embedding tables are sharded by a ``ShardingPlan`` (``--sharding row``: every table cut into N
  row ranges; ``table``: whole tables spread over the ranks). A rank's model holds only its shards, at the
  module paths ``embs.<t>`` the plan names. Every rank starts from the same global init (the single-process
  model's, sliced), so a run on N ranks computes what the single-process run computes, up to the order of
  float sums;
- the dense layers (bottom and top MLP) are replicated: every rank runs the *same* global batch through
  them. Each rank computes the pooled outputs of its own shards (zero where another rank holds the row),
  an ``all_reduce`` (sum, non-differentiable) assembles the full pooled embeddings on every rank, the loss
  is back-propagated through the dense part, and each rank back-propagates the gradient of the pooled
  embeddings into its own shards. The dense gradients are averaged with an ``all_reduce`` (DDP's job:
  the replicas stay bit-equal);
- evaluation runs the same sharded forward under ``torch.no_grad()`` (a collective).

With ``--torchrec`` the model is ``dlrm_model.TorchRecDLRM`` sharded by torchrec's
``DistributedModelParallel`` instead (``build_dmp``; an ``Arch`` picks the model's build, training step and
evaluation once): the tables row-wise or table-wise as torchrec's planner places them, on the fused TBE
kernel with row-wise Adagrad (updated inside the backward pass), the dense layers replicated under an
Adagrad ``KeyedOptimizerWrapper``; every rank trains its slice of the global batch (data parallel: torchrec
routes the ids to the shards), the loss scaled so that the gradients are the global batch's. The
checkpointer reads the plan off the model (``DistributedCheckpointer(plan=None)``). torchrec's sharded
modules keep the process group they were built in, so after a failure a surviving rank of a partial
recovery builds its model again on the new group and carries its live state over (tables, fused optimizer
state, dense layers and optimizer) before ``recover()``. ``--recovery ecrm`` is refused.

Failure injection (``--fail-every K``): after the update of step K, 2K, ... (and before that step's
checkpoint), one rank kills itself with SIGKILL (round-robin from rank 1, or ``--fail-rank``). The
survivors notice at their next collective (gloo raises), re-form the process group under a new FileStore
file with a replacement process that the launcher spawned, and recover:

- ``--recovery full``: every rank builds a fresh model (a different init, as a restarted process would),
  restores the newest global version and training resumes from its step (the steps since are re-computed);
- ``--recovery partial`` (CPR): ``DistributedCheckpointer.recover()``: the replacement restores its shards
  from the newest global version and gets the dense replicas from a survivor; the survivors keep their live
  state and everyone goes on from the survivors' step. The failed shard's updates since the checkpoint are
  lost (estimated as in ``RecoveryReport``); ``--priority mfu|ssu`` adds CPR priority saves
  (``save(top=F)`` every ``--priority-every`` steps between the regular ones) so that less is lost;
- ``--recovery ecrm``: ``cnrstore.distributed.ECRM`` (``--parity K,R``) keeps erasure-coded parity of the
  shards in the ranks' memory, updated every step; ``ECRM.recover()`` decodes the replacement's shards and
  optimizer state from the survivors, bit for bit: nothing is lost and no checkpoint is read (the
  checkpoints stay, as the fallback for more than R failures at once). The run ends equal to the run
  without failures (``--compare`` prints the largest weight difference: 0).

Each rank appends its measurements to ``events-rank<r>.jsonl`` in the run directory (a replacement appends
to its predecessor's file); the launcher reads them after the job and prints the summary: held-out
logloss/AUC (and the same sharded run without failures or checkpoints, with ``--compare``), the time lost
to checkpoints (trainer stall) and to failures (from the kill to every rank training again, plus the
re-computed steps), and the lost-update estimate.

    python tools/train_dlrm.py --world-size 2 --quick                       # partial recovery
    python tools/train_dlrm.py --world-size 2 --quick --recovery full
    python tools/train_dlrm.py --world-size 2 --priority mfu --priority-top 0.05
    python tools/train_dlrm.py --world-size 2 --quick --torchrec                # a DMP model, partial recovery
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import dlrm_model  # noqa: E402

from cnrstore.distributed import ECRM, DistributedCheckpointer, ShardingPlan, failures  # noqa: E402

#: When this process had imported everything (a replacement's start-up, apart from the model's build).
IMPORTED = time.time()

#: Seconds a collective may wait for a peer before gloo gives up (``--pg-timeout``). Also the
#: DistributedCheckpointer's commit timeout. No recovery waits it out: the launcher posts every death on the
#: failure board (``cnrstore.distributed.failures``) and every rank leaves its blocked collective at once.
PG_TIMEOUT_S = 60.0
SHARDINGS = ("row", "table")
RECOVERIES = ("full", "partial", "ecrm")


# ---------------------------------------------------------------------------------------------- model


def table_shapes(args) -> dict[str, tuple[int, int]]:
    """The global embedding tables, by module path: ``{"embs.<t>": (rows, dim)}``."""
    return {f"embs.{t}": (n, args.dim) for t, n in enumerate(dlrm_model.cardinalities(args))}


def make_plan(args, world_size: int) -> ShardingPlan:
    tables = table_shapes(args)
    if args.sharding == "row":
        return ShardingPlan.row_wise(tables, world_size)
    return ShardingPlan.table_wise(tables, world_size)


class ShardedDLRM(nn.Module):
    """One rank's part of ``dlrm_model.DLRM``: replicated bottom/top MLPs and this rank's embedding shards
    (``embs.<t>``, rows ``[row_start, row_end)`` of table ``t``). ``forward`` is a collective."""

    def __init__(self, args, plan: ShardingPlan, rank: int, seed: int):
        super().__init__()
        full = dlrm_model.build_model(args, seed)   # the global init, identical on every rank
        self.dim = full.dim
        self.num_tables = len(full.embs)
        self.bottom, self.top = full.bottom, full.top
        self._tri = full._tri
        self.embs = nn.ModuleDict()
        self.bounds: dict[int, tuple[int, int, bool]] = {}   # table -> (row_start, row_end, whole table)
        for name, shard in plan.shards_of(rank).items():
            t = int(name.split(".", 1)[1])
            # (sparse gradients, as TorchRec's fused tables have none at all: only benchmarks ask for them)
            bag = nn.EmbeddingBag(shard.num_rows, self.dim, mode="sum", sparse=getattr(args, "sparse_grads", False))
            with torch.no_grad():
                bag.weight.copy_(full.embs[t].weight[shard.row_start:shard.row_end])
            self.embs[str(t)] = bag
            self.bounds[t] = (shard.row_start, shard.row_end, shard.num_rows == plan.tables[name][0])
        del full

    def dense_parameters(self) -> list[nn.Parameter]:
        return [*self.bottom.parameters(), *self.top.parameters()]

    def local_pooled(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T, d): this rank's contribution to every table's pooled output (zero where the row lives on
        another rank). Only the ids this rank holds are looked up, so row tracking sees exactly them."""
        b = ids.shape[0]
        zero = ids.new_zeros(()).float().expand(b, self.dim)
        cols = []
        for t in range(self.num_tables):
            bag = self.embs[str(t)] if t in self.bounds else None
            if bag is None:
                cols.append(zero)
                continue
            start, end, whole = self.bounds[t]
            col = ids[:, t]
            if whole:
                cols.append(bag(col.view(-1, 1)))
                continue
            mine = torch.nonzero((col >= start) & (col < end)).squeeze(1)
            out = torch.zeros(b, self.dim)
            cols.append(out.index_put((mine,), bag((col[mine] - start).view(-1, 1))))
        return torch.stack(cols, dim=1)

    def head(self, x: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.top(dlrm_model.interaction(x, pooled, self._tri)).squeeze(1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor):
        """(logits, this rank's pooled part with its graph, the assembled pooled leaf). Collective."""
        x = self.bottom(dense)
        part = self.local_pooled(ids)
        pooled = part.detach().clone()
        failures.all_reduce(pooled)
        if torch.is_grad_enabled():
            pooled.requires_grad_(True)
        return self.head(x, pooled), part, pooled


def train_step(model: ShardedDLRM, optimizer, loss_fn, batch, ecrm: ECRM | None = None, step: int = 0) -> float:
    """One synchronous step on the global batch (collective); returns the loss. With ``ecrm``, the
    optimizer step of training step ``step`` also updates the parity."""
    dense, ids, labels = batch
    optimizer.zero_grad(set_to_none=True)
    logits, part, pooled = model(dense, ids)
    loss = loss_fn(logits, labels)
    loss.backward()                                   # dense grads and d loss / d pooled
    if part.requires_grad:
        part.backward(pooled.grad)                    # into this rank's shards
    all_reduce_([p.grad for p in model.dense_parameters()], divisor=dist.get_world_size())
    if ecrm is None:
        optimizer.step()
    else:
        with ecrm.step(step):
            optimizer.step()
    return float(loss.detach())


def all_reduce_(tensors: list[torch.Tensor], divisor: int = 1) -> None:
    """Sum each tensor over the ranks, in place and in one collective, then divide by ``divisor``."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    failures.all_reduce(flat)
    if divisor != 1:
        flat /= divisor
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def evaluate(model: ShardedDLRM, holdout: dlrm_model.Holdout) -> tuple[float, float]:
    """Held-out (logloss, AUC) of the sharded model (collective; every rank gets the same numbers)."""
    with torch.no_grad():
        logits, _part, _pooled = model(holdout.dense, holdout.ids)
        probs = torch.sigmoid(logits).numpy()
    return dlrm_model.logloss(holdout.labels, probs), dlrm_model.auc(holdout.labels, probs)


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of the model's state: every tensor of ``state_dict()``, a ``ShardedTensor`` (a
    DistributedModelParallel table) as its local shards (``<key>@<row>,<col>``: views of the table)."""
    out = {}
    for key, value in model.state_dict().items():
        if callable(getattr(value, "local_shards", None)):
            for local in value.local_shards():
                out[f"{key}@{','.join(str(o) for o in local.metadata.shard_offsets)}"] = local.tensor
        else:
            out[key] = value
    return out


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest |a - b| over the state of two models of this rank, maximized over ranks (collective)."""
    pairs = zip(local_state(a).values(), local_state(b).values())
    d = max((float((p - q).abs().max()) for p, q in pairs if p.is_floating_point() and p.numel()), default=0.0)
    t = torch.tensor([d])
    failures.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# ----------------------------------------------------------------------------- model: torchrec (--torchrec)


def build_dmp(args, plan: None, rank: int, seed: int):
    """``dlrm_model.TorchRecDLRM`` sharded by ``DistributedModelParallel`` over the default group
    (collective), and its dense optimizer: (model, optimizer).

    The tables are sharded row-wise (``--sharding row``) or table-wise (``table``, where torchrec's planner
    puts them), on the fused TBE kernel with row-wise Adagrad (``--lr``) updating them inside the backward
    pass; every rank starts from ``dlrm_model.build_model``'s global init, written into its local shards.
    The bottom/top MLPs are replicated, updated by Adagrad through a ``KeyedOptimizerWrapper`` (state keyed
    by parameter name). ``plan`` is unused: torchrec's planner makes the plan, which the checkpointer reads
    off the model."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: PLC0415
    from torchrec.distributed import collective_utils  # noqa: PLC0415
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: PLC0415
    from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: PLC0415
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology  # noqa: PLC0415
    from torchrec.distributed.planner.types import ParameterConstraints  # noqa: PLC0415
    from torchrec.distributed.types import ShardingEnv, ShardingType  # noqa: PLC0415
    from torchrec.optim.keyed import KeyedOptimizerWrapper  # noqa: PLC0415
    from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: PLC0415

    class CPUSharder(EmbeddingBagCollectionSharder):
        """Offers row-wise sharding on CPU too (torchrec's planner offers it on GPUs only)."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value]

    world = dist.get_world_size()
    plain = dlrm_model.build_model(args, seed)
    model = dlrm_model.TorchRecDLRM(plain, device="meta")
    sharder = CPUSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": args.lr})
    kind = (ShardingType.ROW_WISE if args.sharding == "row" else ShardingType.TABLE_WISE).value
    constraints = {f"t{t}": ParameterConstraints(sharding_types=[kind], compute_kernels=["fused"])
                   for t in range(len(plain.embs))}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    sharding = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    # DMP's constructor broadcasts a setting from rank 0 the first time in a process only: a replacement's
    # first model and a survivor's second would then make different collectives. Every build makes it.
    collective_utils._INITIALIZED = False
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=sharding, sharders=[sharder],
                                   init_data_parallel=False, env=ShardingEnv(world, rank, dist.GroupMember.WORLD))
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            if not callable(getattr(value, "local_shards", None)):
                continue
            full = plain.embs[int(key.split(".")[-2][1:])].weight          # "...embedding_bags.t<i>.weight"
            for local in value.local_shards():
                r0, c0 = local.metadata.shard_offsets
                local.tensor.copy_(full[r0:r0 + local.tensor.shape[0], c0:c0 + local.tensor.shape[1]])
    optimizer = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.Adagrad(params, lr=args.lr))
    return dmp, optimizer


def dmp_train_step(model, optimizer, loss_fn, batch, ecrm: None = None, step: int = 0) -> float:
    """One synchronous data-parallel step (collective): this rank trains its slice of the global batch;
    the loss is scaled so that the tables' gradients (summed over the ranks by torchrec) and the dense
    gradients (summed here) are those of the global batch's mean loss. Returns that loss."""
    dense, ids, labels = batch
    world, rank = dist.get_world_size(), dist.get_rank()
    part = slice(rank * labels.shape[0] // world, (rank + 1) * labels.shape[0] // world)
    optimizer.zero_grad()
    loss = loss_fn(model(dense[part], ids[part]), labels[part]) * ((part.stop - part.start) / labels.shape[0])
    loss.backward()                                   # the fused optimizer updates the tables here
    total = loss.detach().reshape(1)
    all_reduce_([*(p.grad for p in optimizer.params.values()), total])
    optimizer.step()
    return float(total)


def dmp_evaluate(model, holdout: dlrm_model.Holdout) -> tuple[float, float]:
    """Held-out (logloss, AUC) of the sharded model (collective): each rank scores its slice of the held-out
    set (padded to equal slices), the scores are gathered."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = holdout.labels.size
    per = -(-n // world)
    mine = torch.arange(rank * per, (rank + 1) * per).clamp(max=n - 1)
    with torch.no_grad():
        logits = model(holdout.dense[mine], holdout.ids[mine])
    every = [torch.empty_like(logits) for _ in range(world)]
    failures.all_gather(every, logits)
    probs = torch.sigmoid(torch.cat(every)[:n]).numpy()
    return dlrm_model.logloss(holdout.labels, probs), dlrm_model.auc(holdout.labels, probs)


def dmp_carry_over(src, src_optimizer, dst, dst_optimizer) -> None:
    """Copy one rank's live state from model ``src`` into ``dst``, built alike on another process group:
    its table shards, their fused optimizer state, the dense layers and their optimizer's state."""
    with torch.no_grad():
        for (key, a), (key2, b) in zip(local_state(src).items(), local_state(dst).items(), strict=True):
            assert key == key2, (key, key2)
            b.copy_(a)
        fa, fb = src.fused_optimizer.state_dict()["state"], dst.fused_optimizer.state_dict()["state"]
        for key, states in fa.items():
            for name, value in states.items():
                for la, lb in zip(value.local_shards(), fb[key][name].local_shards(), strict=True):
                    lb.tensor.copy_(la.tensor)
    dst_optimizer.load_state_dict(src_optimizer.state_dict())


def build_sharded(args, plan: ShardingPlan, rank: int, seed: int):
    """``ShardedDLRM`` and its Adagrad: (model, optimizer)."""
    model = ShardedDLRM(args, plan, rank, seed)
    return model, dlrm_model.build_optimizer(model, args.lr)


@dataclass(frozen=True)
class Arch:
    """What the worker does differently for the two models (chosen once, by ``--torchrec``)."""

    build: Callable          # (args, plan, rank, seed) -> (model, optimizer); collective
    train_step: Callable     # (model, optimizer, loss_fn, batch, ecrm, step) -> loss; collective
    evaluate: Callable       # (model, holdout) -> (logloss, AUC); collective
    #: None: the model keeps working on a re-formed process group. Else (src, src_opt, dst, dst_opt): the
    #: model is bound to the group it was built in (torchrec's sharded modules keep it), so a survivor that
    #: keeps its state builds the model again on the new group and carries its state over with this.
    carry_over: Callable | None = None


PLAIN = Arch(build_sharded, train_step, evaluate)
TORCHREC = Arch(build_dmp, dmp_train_step, dmp_evaluate, dmp_carry_over)


def arch_of(args) -> Arch:
    return TORCHREC if getattr(args, "torchrec", False) else PLAIN


# --------------------------------------------------------------------------------------------- worker


def victim_of(failure: int, args) -> int:
    """The rank that failure number ``failure`` (0-based) kills."""
    if args.fail_rank is not None:
        return args.fail_rank
    return (failure + 1) % args.world_size


class Events:
    """Appends one JSON object per line to this rank's event file (flushed: a SIGKILL loses nothing)."""

    def __init__(self, run_dir: str, rank: int):
        self.path = os.path.join(run_dir, f"events-rank{rank}.jsonl")

    def log(self, kind: str, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n")


class Worker:
    """One rank's process: train, checkpoint, fail on schedule, recover; see the module doc."""

    def __init__(self, args, rank: int, epoch: int, run_dir: str):
        self.args = args
        self.rank = rank
        self.world = args.world_size
        self.epoch = epoch                   # failures so far: names the rendezvous file
        self.run_dir = run_dir
        self.events = Events(run_dir, rank)
        self.board: tuple[str, int] | None = None     # the launcher's failure board (host, port)
        self.resumed: int | None = None               # a failure whose first step after recovery is pending
        self.arch = arch_of(args)
        # torchrec's planner shards a DMP model; the checkpointer reads its plan off the model (plan=None)
        self.plan = None if self.arch is TORCHREC else make_plan(args, self.world)
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.pending = None
        self.ckpt: DistributedCheckpointer | None = None
        self.ecrm: ECRM | None = None
        self.prog = None

    # -- process group ------------------------------------------------------------------------------------
    def rendezvous(self) -> None:
        """Join the process group of failure epoch ``self.epoch`` (waits for every rank: after a failure,
        for the replacement's start-up), then watch that epoch on the failure board."""
        self.events.log("rdzv_start", epoch=self.epoch)
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(self.run_dir, f'rdzv-{self.epoch}')}",
                                rank=self.rank, world_size=self.world, timeout=timedelta(seconds=pg_timeout(self.args)))
        if failures.current() is not None:
            failures.current().rearm(self.epoch)
        self.events.log("rdzv_end", epoch=self.epoch)

    def leave_broken_group(self) -> None:
        """After a peer died: let the save in flight fail (at once: its commit's collectives leave on the
        failure too), then drop the process group without waiting for the work left in it."""
        if self.pending is not None:
            try:
                self.pending.wait()
            except Exception:  # its global commit could not complete: the peer is gone
                pass
            self.pending = None
        failures.leave_group()

    # -- state --------------------------------------------------------------------------------------------
    def fresh(self, restarts: int):
        """A freshly built model, optimizer and loader (a restart uses another init: what a restore misses
        shows up in the metrics)."""
        model, optimizer = self.arch.build(self.args, self.plan, self.rank, self.args.seed + 1000 * restarts)
        return model, optimizer, dlrm_model.SyntheticCriteo(self.args)

    def open_checkpointer(self) -> DistributedCheckpointer:
        a = self.args
        root, bucket = a.store_root, {}
        if a.remote:  # each rank on a node of its own; a replacement on a new, empty one (a fresh machine)
            bucket = {"remote": a.remote, "remote_options": json.loads(a.remote_options) if a.remote_options else None}
            root = os.path.join(a.store_root, f"node-rank{self.rank}-from-epoch{self.node_epoch}")
        return DistributedCheckpointer(root, self.model, self.optimizer, plan=self.plan, codec=a.codec,
                                       mode=a.mode, extra={"loader": self.loader}, priority=a.priority,
                                       timeout_s=pg_timeout(a), **bucket)

    def open_ecrm(self, replacement: bool) -> ECRM | None:
        if self.args.recovery != "ecrm":
            return None
        k, r = parity_of(self.args)
        return ECRM(self.model, self.optimizer, k=k, r=r, checkpointer=self.ckpt, fallback="partial",
                    replacement=replacement, timeout_s=pg_timeout(self.args))

    # -- the run ------------------------------------------------------------------------------------------
    def main(self, replacement: bool) -> int:
        a = self.args
        self.node_epoch = self.epoch if replacement else 0  # (a --remote run's node directory: see open_checkpointer)
        torch.set_num_threads(max(a.threads, 1))
        self.holdout = dlrm_model.Holdout(a, a.holdout_batches)
        if self.board is not None:
            failures.install(failures.FailureWatch(*self.board, rank=self.rank, epoch=self.epoch))
        early = self.arch.carry_over is None      # a plain model needs no group to be built: before the
        if early:                                 # rendezvous, so that the survivors do not wait for it
            self.model, self.optimizer, self.loader = self.fresh(self.epoch if replacement else 0)
        self.rendezvous()
        if not early:
            self.model, self.optimizer, self.loader = self.fresh(self.epoch if replacement else 0)
        self.ckpt = self.open_checkpointer()
        if replacement:
            self.events.log("opened", failure=self.epoch - 1)
        self.ecrm = self.open_ecrm(replacement)
        self.step = 0
        if replacement:
            self.recover_as_replacement()
            self.resumed = self.epoch - 1
        elif self.rank == 0:
            self.events.log("plan", plan=self.ckpt.plan.to_dict())
            self.events.log("eval", step=0, result=self.arch.evaluate(self.model, self.holdout))
        else:
            self.arch.evaluate(self.model, self.holdout)
        self.train_loop()
        self.pending = None
        if self.ecrm is not None:
            mem = self.ecrm.memory_bytes()
            self.events.log("ecrm", stats=self.ecrm.stats, parity_bytes=mem["parity"], data_bytes=mem["data"])
            self.ecrm.close()
        self.ckpt.close()
        if a.compare:
            self.compare()
        dist.destroy_process_group()
        return 0

    def train_loop(self) -> None:
        a = self.args
        eval_every = max(1, a.steps // 4)
        self.prog = dlrm_model.Progress(a.steps, f"rank {self.rank}", enabled=self.rank == 0 and not a.no_progress)
        ema = None
        replay_until = None            # full recovery: (failure, step it struck, time training resumed)
        while self.step < a.steps:
            try:
                lv = self.arch.train_step(self.model, self.optimizer, self.loss_fn, self.loader.next(), self.ecrm,
                                          self.step + 1)
                self.step += 1
                if self.resumed is not None:          # the first step after a recovery: training again
                    self.events.log("resumed", failure=self.resumed, step=self.step)
                    self.resumed = None
                ema = lv if ema is None else 0.98 * ema + 0.02 * lv
                self.prog.update(self.step, ema)
                if replay_until is not None and self.step >= replay_until[1]:
                    self.events.log("replayed", failure=replay_until[0], steps=self.step - replay_until[3],
                                    seconds=time.perf_counter() - replay_until[2])
                    replay_until = None
                if a.fail_every and self.step % a.fail_every == 0 and self.step // a.fail_every > self.epoch \
                        and self.step < a.steps:
                    if self.rank == victim_of(self.epoch, a):
                        self.events.log("kill", failure=self.epoch, step=self.step)
                        os.kill(os.getpid(), signal.SIGKILL)
                self.checkpoint()
                if self.step % eval_every == 0 and self.step < a.steps:
                    result = self.arch.evaluate(self.model, self.holdout)
                    if self.rank == 0:
                        self.events.log("eval", step=self.step, result=result)
                        self.prog.message(f"  step {self.step}: holdout logloss {result[0]:.4f} AUC {result[1]:.4f}")
            except RuntimeError as exc:   # a PeerFailure (or gloo's own error): a peer died
                if not a.fail_every or self.epoch >= self.scheduled_failures():
                    raise
                replay_until = self.recover_as_survivor(exc)
                self.resumed = self.epoch - 1
        self.prog.close()
        if self.pending is not None:
            self.pending.wait()
        result = self.arch.evaluate(self.model, self.holdout)
        if self.rank == 0:
            self.events.log("final", step=self.step, result=result, ceiling=self.holdout.ceiling)

    def scheduled_failures(self) -> int:
        a = self.args
        return (a.steps - 1) // a.fail_every if a.fail_every else 0

    def checkpoint(self) -> None:
        a = self.args
        regular = self.step % a.ckpt_every == 0
        priority = not regular and a.priority is not None and self.step % a.priority_every == 0
        if not (regular or priority):
            return
        t0 = time.perf_counter()
        pending = self.ckpt.save(self.step, meta={"step": self.step, "priority": priority},
                                 top=a.priority_top if priority else None)
        stall = time.perf_counter() - t0
        self.pending = pending
        self.events.log("save", step=self.step, stall=stall, priority=priority,
                        written_priority=bool(pending.report.priority))

    # -- recovery -----------------------------------------------------------------------------------------
    def recover_as_survivor(self, exc: BaseException):
        """A peer died (``exc``): re-form the group with its replacement and recover."""
        a = self.args
        failure = self.epoch
        detected = time.time()
        self.events.log("detected", failure=failure, how=getattr(exc, "learned", "gloo"),
                        cause=getattr(exc, "cause", str(exc))[:300])
        self.prog.message(f"  rank {self.rank}: peer failure #{failure + 1} seen at step {self.step} "
                          f"({type(exc).__name__})")
        self.leave_broken_group()
        self.events.log("left", failure=failure)
        self.epoch += 1
        self.loader.position = self.step        # a batch drawn for the step that failed is drawn again
        self.rendezvous()
        if a.recovery == "partial":
            if self.arch.carry_over is not None:
                self.rebuild_live()
            t0 = time.perf_counter()
            rep = self.ckpt.recover([victim_of(failure, a)], step=self.step)
            self.events.log("recovered", failure=failure, role="survivor", detected=detected,
                            recover_s=time.perf_counter() - t0, global_version=rep.global_version,
                            checkpoint_step=rep.checkpoint_step, step=self.step, lost_steps=rep.lost_steps,
                            lost_update_fraction=rep.lost_update_fraction, victim=victim_of(failure, a),
                            discarded=rep.discarded_save_error)
            self.prog.message(f"  partial recovery #{failure + 1}: rank {victim_of(failure, a)} restored global "
                              f"version {rep.global_version} (step {rep.checkpoint_step}); survivors kept step "
                              f"{self.step}; lost steps {rep.lost_steps}, lost-update estimate "
                              f"{rep.lost_update_fraction:.4%}")
            return None
        if a.recovery == "ecrm":
            return self.recover_ecrm(failure, detected)
        failed_step = self.step
        t0 = time.perf_counter()
        self.restart_full()
        self.events.log("recovered", failure=failure, role="survivor", detected=detected,
                        recover_s=time.perf_counter() - t0, checkpoint_step=self.step, step=failed_step,
                        lost_steps=failed_step - self.step, victim=victim_of(failure, a))
        self.prog.message(f"  full recovery #{failure + 1}: every rank restored step {self.step}; re-computing "
                          f"{failed_step - self.step} steps")
        return (failure, failed_step, time.perf_counter(), self.step)

    def recover_ecrm(self, failure: int, detected: float | None):
        """ECRM recovery on this rank (survivor or replacement); returns the replay marker when steps
        after the recovered boundary must be redone."""
        a = self.args
        failed_step = self.step
        t0 = time.perf_counter()
        rep = self.ecrm.recover([victim_of(failure, a)], step=None if detected is None else self.step)
        self.step = int(rep.step)
        self.loader.position = self.step      # data is fixed by the step: the redone steps see the same batches
        role = "replacement" if rep.replacement else "survivor"
        fields = dict(detected=detected) if detected is not None else {}
        self.events.log("recovered", failure=failure, role=role, recover_s=time.perf_counter() - t0,
                        mode=rep.mode, step=failed_step, checkpoint_step=self.step, redo_steps=rep.redo_steps,
                        lost_steps=0 if rep.mode == "ecrm" else None, decode_s=rep.decode_seconds,
                        bytes_received=rep.bytes_received, reason=rep.reason, victim=victim_of(failure, a),
                        phases=rep.phases, **fields)
        if detected is not None:
            self.prog.message(f"  ECRM recovery #{failure + 1} ({rep.mode}): rank {victim_of(failure, a)} decoded at "
                              f"step {self.step}; {rep.redo_steps} step(s) to redo"
                              + (f"; fell back: {rep.reason}" if rep.reason else ""))
        if self.step < failed_step:
            return (failure, failed_step, time.perf_counter(), self.step)
        return None

    def drop_checkpointer(self) -> None:
        try:
            self.ckpt.close()
        except Exception:  # the save the failure cut short: its error is expected
            pass

    def rebuild_live(self) -> None:
        """A survivor of a partial recovery whose model is bound to the broken process group
        (``Arch.carry_over``): the same model built again on the new group, this rank's live state carried
        over, and a checkpointer over it (collective, as the replacement's start; its first save writes
        every row, as the replacement's does)."""
        self.drop_checkpointer()
        model, optimizer = self.arch.build(self.args, self.plan, self.rank, self.args.seed + 1000 * self.epoch)
        self.arch.carry_over(self.model, self.optimizer, model, optimizer)
        self.model, self.optimizer = model, optimizer
        self.ckpt = self.open_checkpointer()

    def restart_full(self) -> None:
        """Full recovery on this rank: rebuild everything, restore the newest global version."""
        self.drop_checkpointer()
        del self.model, self.optimizer, self.loader
        self.model, self.optimizer, self.loader = self.fresh(self.epoch)
        self.ckpt = self.open_checkpointer()
        gv = self.ckpt.restore()
        self.step = int(gv.step)
        if self.loader.position != self.step:
            raise RuntimeError(f"restored data position {self.loader.position} != step {self.step}")

    def recover_as_replacement(self) -> None:
        a = self.args
        failure = self.epoch - 1
        t0 = time.perf_counter()
        if a.recovery == "ecrm":
            self.recover_ecrm(failure, None)
        elif a.recovery == "partial":
            rep = self.ckpt.recover([self.rank], step=None)
            self.step = int(rep.step)
            self.loader.position = self.step   # the survivors' data position: go on from there
            self.events.log("recovered", failure=failure, role="replacement", recover_s=time.perf_counter() - t0,
                            global_version=rep.global_version, checkpoint_step=rep.checkpoint_step, step=self.step)
        else:
            gv = self.ckpt.restore()
            self.step = int(gv.step)
            self.events.log("recovered", failure=failure, role="replacement", recover_s=time.perf_counter() - t0,
                            checkpoint_step=self.step)

    # -- the comparison run -------------------------------------------------------------------------------
    def compare(self) -> None:
        """The same sharded run without failures or checkpoints (same init as the run's first model)."""
        a = self.args
        model, optimizer, loader = self.fresh(0)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            self.arch.train_step(model, optimizer, self.loss_fn, loader.next())
        wall = time.perf_counter() - t0
        result = self.arch.evaluate(model, self.holdout)
        diff = max_abs_diff(self.model, model)
        if self.rank == 0:
            self.events.log("compare", result=result, wall_s=wall, max_weight_diff=diff)


def worker_entry(cfg: dict) -> int:
    import argparse  # noqa: PLC0415
    args = argparse.Namespace(**cfg["args"])
    if getattr(args, "torchrec", False):
        dlrm_model.quiet_torchrec()
    worker = Worker(args, cfg["rank"], cfg["epoch"], cfg["run_dir"])
    if cfg.get("board"):
        worker.board = (cfg["board"][0], int(cfg["board"][1]))
    if cfg["replacement"]:
        worker.events.log("started", failure=cfg["epoch"] - 1, imported=IMPORTED)
    return worker.main(cfg["replacement"])


def exit_now(rc: int) -> None:
    """Leave the process without interpreter teardown. Everything this worker reports is flushed to its
    event file already; a process that re-formed its gloo group after a peer died was once seen to abort
    in teardown ("terminate called without an active exception", 1 run in ~6), after its work was done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ------------------------------------------------------------------------------------------- launcher


def pg_timeout(args) -> float:
    """The process groups' timeout (``--pg-timeout``, default PG_TIMEOUT_S)."""
    return float(getattr(args, "pg_timeout", None) or PG_TIMEOUT_S)


def _spawn(args, rank: int, epoch: int, run_dir: str, replacement: bool, board=None) -> subprocess.Popen:
    cfg = {"args": vars(args), "rank": rank, "epoch": epoch, "run_dir": run_dir, "replacement": replacement,
           "board": None if board is None else [board.host, board.port]}
    env = dict(os.environ, OMP_NUM_THREADS=str(max(args.threads, 1)))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", json.dumps(cfg)], env=env)


def supervise(args, run_dir: str) -> tuple[int, list[str]]:
    """Run the job: spawn the ranks, replace a rank SIGKILL took (up to the scheduled failures), wait.
    Returns (exit status, problems)."""
    board = failures.FailureBoard()      # every death is posted here the moment this loop sees it
    procs = {r: _spawn(args, r, 0, run_dir, False, board) for r in range(args.world_size)}
    deaths = 0
    allowed = (args.steps - 1) // args.fail_every if args.fail_every else 0
    done: set[int] = set()
    problems: list[str] = []
    deadline = time.monotonic() + args.job_timeout
    while len(done) < args.world_size:
        if time.monotonic() > deadline:
            problems.append(f"the job did not finish within {args.job_timeout:.0f} s")
            break
        time.sleep(0.02)
        for r, p in list(procs.items()):
            if r in done:
                continue
            rc = p.poll()
            if rc is None:
                continue
            if rc == -signal.SIGKILL and deaths < allowed:
                board.post(deaths, f"rank {r} died (SIGKILL)")
                seen = time.time()
                deaths += 1
                procs[r] = _spawn(args, r, deaths, run_dir, True, board)
                Events(run_dir, r).log("spawned", failure=deaths - 1, seen=seen)
            elif rc == 0:
                done.add(r)
            else:
                problems.append(f"rank {r} exited with status {rc}")
        if problems:
            break
    for r, p in procs.items():      # on a problem: stop the ranks this launcher started
        if p.poll() is None:
            p.kill()
            p.wait()
    return (1 if problems else 0), problems


def read_events(run_dir: str, world: int) -> dict[int, list[dict]]:
    out = {}
    for r in range(world):
        path = os.path.join(run_dir, f"events-rank{r}.jsonl")
        out[r] = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return out


def summarize(args, events: dict[int, list[dict]], plan: ShardingPlan) -> dict:
    """The run's numbers, from every rank's events (under the plan rank 0 logged, else ``plan``)."""
    every = [e for evs in events.values() for e in evs]
    by_kind = lambda k: [e for e in every if e["kind"] == k]  # noqa: E731
    plan = next((ShardingPlan.from_dict(e["plan"]) for e in by_kind("plan")), plan)
    saves = by_kind("save")
    stall_per_rank = [sum(e["stall"] for e in evs if e["kind"] == "save") for evs in events.values()]
    failures = []
    for kill in sorted(by_kind("kill"), key=lambda e: e["failure"]):
        i = kill["failure"]
        recs = [e for e in by_kind("recovered") if e["failure"] == i]
        surv = [e for e in recs if e["role"] == "survivor"]
        replayed = [e for e in by_kind("replayed") if e["failure"] == i]
        resumed = max((e["time"] for e in recs), default=float("nan"))
        s0 = surv[0] if surv else {}
        share = plan.rows_of(kill_victim(kill, events)) / plan.total_rows()
        failures.append({
            "failure": i, "step": kill["step"], "victim": kill_victim(kill, events),
            "recovery_s": resumed - kill["time"],
            "recover_call_s": max((e["recover_s"] for e in recs), default=float("nan")),
            "checkpoint_step": s0.get("checkpoint_step"), "lost_steps": s0.get("lost_steps"),
            "global_version": s0.get("global_version"),
            "lost_update_fraction": s0.get("lost_update_fraction"), "row_share": share,
            "replayed_steps": max((e["steps"] for e in replayed), default=0),
            "mode": s0.get("mode"), "reason": s0.get("reason"),
            "replayed_s": max((e["seconds"] for e in replayed), default=0.0),
            **recovery_phases(i, kill["time"], every),
        })
    final = next((e for e in by_kind("final")), None)
    compare = next((e for e in by_kind("compare")), None)
    evals = {e["step"]: e for e in by_kind("eval")}
    start = evals.get(0)
    train_s = final["time"] - start["time"] if final is not None and start is not None else float("nan")
    if final is not None:
        evals[final["step"]] = final
    curve = [(st, e["result"]) for st, e in sorted(evals.items())]
    return {"saves": saves, "stall_per_rank": stall_per_rank, "failures": failures, "ecrm": by_kind("ecrm"),
            "final": final, "compare": compare, "curve": curve, "train_s": train_s, "plan": plan}


def recovery_phases(i: int, killed: float, every: list[dict]) -> dict:
    """Where failure ``i``'s time went, from the events (seconds; NaN where an event is missing):

    - ``detect_s``: kill -> the first survivor left its collective (``how``: board / collective / gloo);
    - ``launcher_s``: kill -> the launcher saw the death, posted it and spawned the replacement;
    - ``startup_s``: spawn -> the replacement entered the rendezvous (interpreter, imports, model build);
      ``imports_s`` of it: spawn -> its imports were done;
    - ``rendezvous_s``: the replacement entered the rendezvous -> the last rank left it;
    - ``restore_s``: the slowest rank's recover call (restore, CPR recover, or ECRM decode);
    - ``resume_s``: the last recover call ended -> every rank finished its first step again;
    - ``kill_to_training_s``: kill -> every rank finished its first step after the recovery."""
    of = lambda kind: [e for e in every if e["kind"] == kind and e.get("failure") == i]  # noqa: E731
    nan = float("nan")
    detected = of("detected")
    spawned = next(iter(of("spawned")), None)
    started = next(iter(of("started")), None)
    rdzv = [e for e in every if e["kind"] in ("rdzv_start", "rdzv_end") and e.get("epoch") == i + 1]
    replacement_in = min((e["time"] for e in rdzv if e["kind"] == "rdzv_start"), default=nan)
    if started is not None:       # the replacement's own rdzv_start: the latest start of that epoch
        replacement_in = max((e["time"] for e in rdzv if e["kind"] == "rdzv_start"), default=nan)
    recs = of("recovered")
    resumed = of("resumed")
    rec_end = max((e["time"] for e in recs), default=nan)
    back = max((e["time"] for e in resumed), default=nan)
    return {
        "detect_s": min((e["time"] for e in detected), default=nan) - killed,
        "how": sorted({e["how"] for e in detected}),
        "launcher_s": (spawned["time"] - killed) if spawned else nan,
        "imports_s": (started["imported"] - spawned["time"]) if started and spawned else nan,
        "startup_s": (replacement_in - spawned["time"]) if spawned else nan,
        "rendezvous_s": max((e["time"] for e in rdzv if e["kind"] == "rdzv_end"), default=nan) - replacement_in,
        "restore_s": max((e["recover_s"] for e in recs), default=nan),
        "resume_s": back - rec_end,
        "kill_to_training_s": back - killed,
    }


def kill_victim(kill: dict, events: dict[int, list[dict]]) -> int:
    return next(r for r, evs in events.items() if kill in evs)


def format_summary(args, s: dict, wall_s: float) -> str:
    rows: list[tuple[str, str, str]] = []
    regular = [e for e in s["saves"] if not e["priority"]]
    prio = [e for e in s["saves"] if e["priority"]]
    n_ranks = args.world_size
    rows.append(("saves per rank (priority saves) / failures",
                 f"{len(regular) / n_ranks:.0f} ({len(prio) / n_ranks:.0f}) / {len(s['failures'])}", ""))
    stalls = [e["stall"] for e in s["saves"]]
    if stalls:
        rows.append(("trainer stall per save, median / max", f"{dlrm_model.fmt_ms(float(np.median(stalls)))} / "
                     f"{dlrm_model.fmt_ms(float(np.max(stalls)))}", "all ranks' saves"))
    stall_total = max(s["stall_per_rank"]) if s["stall_per_rank"] else 0.0
    rec_total = sum(f["recovery_s"] for f in s["failures"])
    replay_total = sum(f["replayed_s"] for f in s["failures"])
    rows.append(("time lost to checkpoints (stall)", f"{stall_total:.2f} s ({stall_total / wall_s:.1%})",
                 "the most stalled rank's sum"))
    lost_s = rec_total + replay_total
    rows.append(("time lost to failures", f"{lost_s:.2f} s ({lost_s / wall_s:.1%})",
                 f"recovery {rec_total:.2f} s + re-computed steps {replay_total:.2f} s"))
    for f in s["failures"]:
        if args.recovery == "ecrm":
            what = (f"rank {f['victim']} decoded at step {f['checkpoint_step']} ({f['mode']}); "
                    f"{f['replayed_steps']} step(s) redone" + (f"; fell back: {f['reason']}" if f["reason"] else ""))
        elif args.recovery == "partial":
            what = (f"rank {f['victim']} restored global version {f['global_version']} (step "
                    f"{f['checkpoint_step']}); {f['lost_steps']} steps of its updates lost")
        else:
            what = f"all ranks restored step {f['checkpoint_step']}; {f['replayed_steps']} steps re-computed"
        rows.append((f"  recovery #{f['failure'] + 1} at step {f['step']}",
                     f"{f['recovery_s']:.2f} s", f"{what}; detected after {f['detect_s']:.2f} s, "
                     f"recover call {f['recover_call_s']:.2f} s"))
        rows.append(("    kill to training, by phase", f"{f['kill_to_training_s']:.2f} s",
                     f"detect {f['detect_s']:.2f} s ({'/'.join(f['how']) or '?'}), replacement start-up "
                     f"{f['startup_s']:.2f} s (imports {f['imports_s']:.2f} s), rendezvous {f['rendezvous_s']:.2f} s, "
                     f"restore {f['restore_s']:.2f} s, first step {f['resume_s']:.2f} s"))
    if args.recovery == "ecrm":
        modes = {f["mode"] for f in s["failures"]}
        rows.append(("lost updates", "0" if modes <= {"ecrm"} else "see the fallback",
                     "decoded bit for bit from the parity" if s["failures"] else ""))
        for e in s["ecrm"][:1]:
            st = e["stats"]
            per = st["seconds"] / max(st["steps"], 1) + st["seconds_capture"] / max(st["steps"], 1)
            rows.append(("parity update per step (rank 0)", dlrm_model.fmt_ms(per),
                         f"capture {dlrm_model.fmt_ms(st['seconds_capture'] / max(st['steps'], 1))}, encode "
                         f"{dlrm_model.fmt_ms(st['seconds_encode'] / max(st['steps'], 1))}, exchange "
                         f"{dlrm_model.fmt_ms(st['seconds_exchange'] / max(st['steps'], 1))}, apply "
                         f"{dlrm_model.fmt_ms(st['seconds_apply'] / max(st['steps'], 1))}; "
                         f"{dlrm_model.fmt_bytes(st['bytes_sent'] / max(st['steps'], 1))} sent per step"))
            rows.append(("parity memory per rank (rank 0)", dlrm_model.fmt_bytes(e["parity_bytes"]),
                         f"{e['parity_bytes'] / max(e['data_bytes'], 1):.0%} of its protected shard "
                         f"({dlrm_model.fmt_bytes(e['data_bytes'])})"))
    elif args.recovery == "partial" and s["failures"]:
        lost = sum(f["row_share"] * (f["lost_steps"] or 0) for f in s["failures"]) / args.steps
        rows.append(("lost updates (estimate)", f"{lost:.3%}",
                     "sum over failures of the failed shard's row share x steps lost, / steps"))
    else:
        rows.append(("lost updates (estimate)", "0", "full recovery re-computes them" if s["failures"] else ""))
    if s["final"] is None:
        rows.append(("final holdout logloss / AUC", "n/a (no final evaluation)", ""))
    else:
        ll, a = s["final"]["result"]
        if s["compare"] is not None:
            bll, ba = s["compare"]["result"]
            rows.append(("final holdout logloss", f"{ll:.5f}", f"{bll:.5f} (no failures)"))
            rows.append(("final holdout AUC", f"{a:.5f}", f"{ba:.5f} (no failures)"))
            rows.append(("max |weight diff| vs no failures", f"{s['compare']['max_weight_diff']:.3g}", ""))
            rows.append(("training wall time", f"{wall_s:.1f} s", f"{s['compare']['wall_s']:.1f} s (no failures, "
                         "no checkpoints)"))
        else:
            rows.append(("final holdout logloss / AUC", f"{ll:.5f} / {a:.5f}", ""))
            rows.append(("training wall time", f"{wall_s:.1f} s", "step 0 evaluation to the final one"))
    if s["curve"]:
        rows.append(("holdout logloss / AUC at step 0", f"{s['curve'][0][1][0]:.5f} / {s['curve'][0][1][1]:.5f}", ""))
    head = (f"{args.world_size} ranks, {args.recovery} recovery", "")
    w0 = max(len(r[0]) for r in rows) + 2
    w1 = max(max(len(r[1]) for r in rows), len(head[0])) + 2
    lines = [f"{'':<{w0}}{head[0]:<{w1}}{head[1]}", "-" * (w0 + w1 + 40)]
    lines += [f"{r[0]:<{w0}}{r[1]:<{w1}}{r[2]}" for r in rows]
    return "\n".join(lines)


def parity_of(args) -> tuple[int, int]:
    """ECRM's (k, r) from ``--parity K,R`` (default: world size - 1 data units, 1 parity)."""
    if getattr(args, "parity", None) is None:
        return max(1, args.world_size - 1), 1
    k, r = (int(x) for x in str(args.parity).split(","))
    return k, r


def check_args(args) -> str | None:
    """A message saying what to fix, or None."""
    if args.world_size < 1:
        return "--world-size must be >= 1"
    if getattr(args, "torchrec", False):
        if args.recovery == "ecrm":
            return "--recovery ecrm does not go with --torchrec: ECRM protects nn.Embedding shards only"
        if args.batch_size % args.world_size:
            return (f"--torchrec trains each rank on its slice of the batch: --batch-size ({args.batch_size}) must "
                    f"be a multiple of --world-size ({args.world_size})")
    if args.recovery == "ecrm" or getattr(args, "parity", None) is not None:
        if args.recovery != "ecrm":
            return "--parity goes with --recovery ecrm"
        try:
            k, r = parity_of(args)
        except ValueError:
            return f"--parity must be two integers K,R (e.g. 2,1), got {args.parity!r}"
        if k < 1 or r < 1 or k + r > args.world_size:
            return (f"--parity {k},{r} needs K >= 1, R >= 1 and K + R <= --world-size ({args.world_size}): every "
                    "stripe's K data and R parity units live on distinct ranks")
    if args.fail_rank is not None and not 0 <= args.fail_rank < args.world_size:
        return f"--fail-rank must name a rank in [0, {args.world_size})"
    if args.priority is not None:
        if args.recovery != "partial":
            return ("--priority goes with --recovery partial: a full restore of a priority save would mix rows "
                    "of different steps")
        if not 0 < args.priority_top <= 1:
            return "--priority-top must be a fraction in (0, 1]"
        if args.priority_every <= 0:
            return "--priority-every must be positive"
    return None


def run(args) -> int:
    """The launcher: ``train_dlrm.main`` calls this for ``--world-size N``."""
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="train_dlrm-dist-")
    try:
        if args.store:
            if os.path.exists(args.store) and os.listdir(args.store):
                print(f"error: --store {args.store} is not empty; give a new or empty directory", file=sys.stderr)
                return 2
            args.store_root = os.path.abspath(args.store)
        else:
            args.store_root = os.path.join(tmp, "root")
        plan = make_plan(args, args.world_size)
        card = dlrm_model.cardinalities(args)
        prio = (f", priority saves {args.priority} top {args.priority_top:g} every {args.priority_every}"
                if args.priority else "")
        if args.torchrec:
            model = (f"torchrec DistributedModelParallel, {args.sharding}-wise sharding by its planner): a torchrec "
                     "EmbeddingBagCollection of 26 tables (fused row-wise Adagrad, each rank a slice of the batch)")
        else:
            model = (f"{args.sharding}-wise sharding: {', '.join(str(plan.rows_of(r)) for r in range(args.world_size))}"
                     " rows per rank): 26 EmbeddingBags")
        print(f"DLRM on {args.world_size} ranks (gloo, FileStore rendezvous; {model}, "
              f"{sum(card):,} rows x dim {args.dim}; {args.steps} steps x batch {args.batch_size}; checkpoint every "
              f"{args.ckpt_every}{prio}, failure every {args.fail_every or 'never'} ({args.recovery} recovery); "
              f"cnrstore DistributedCheckpointer (codec {args.codec}, mode {args.mode}"
              f"{f', root in {args.remote}, a node directory per rank' if args.remote else ''})", flush=True)
        t0 = time.perf_counter()
        rc, problems = supervise(args, tmp)
        wall = time.perf_counter() - t0
        events = read_events(tmp, args.world_size)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        s = summarize(args, events, plan)
        if args.torchrec:
            print("torchrec's plan: " + ", ".join(str(s["plan"].rows_of(r)) for r in range(args.world_size))
                  + " rows per rank")
        if s["final"] is not None:
            ceiling = s["final"]["ceiling"]
            print(f"teacher (Bayes-optimal) held-out logloss {ceiling[0]:.4f} AUC {ceiling[1]:.4f}")
        print("\nholdout logloss / AUC during training: " +
              ", ".join(f"step {st}: {r[0]:.4f}/{r[1]:.4f}" for st, r in s["curve"]))
        print()
        print(format_summary(args, s, s["train_s"]))
        print(f"\ntotal run time {wall:.1f} s (processes, set-up and the comparison run included)")
        return rc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        exit_now(worker_entry(json.loads(sys.argv[2])))
    # The options are tools/train_dlrm.py's: it parses them and calls run() (importing it back from here
    # would make the two modules a circle).
    print("usage: python tools/train_dlrm.py --world-size N [options] (this file is its multi-rank mode; "
          "run it as 'dlrm_dist.py worker CONFIG' only from the launcher)", file=sys.stderr)
    sys.exit(2)
