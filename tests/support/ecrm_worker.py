"""One rank of a spawned gloo job for tests/test_ecrm.py (ECRM recovery).

    python tests/support/ecrm_worker.py '<json config>'

A small sharded model (row-wise shards of three embedding tables, a replicated dense head, Adagrad) trains
``steps`` synchronous steps on data fixed by the step number, with ``ECRM`` protecting the shards. Victims
(``victims``) die at ``fail_step``: by ``crash`` (an ECRM crash point) or by SIGKILL after the step
("kill"). Survivors notice at their next collective, re-form the group (rendezvous file ``rdzv-<epoch>``)
with the replacements the test spawned, call ``recover`` and redo the steps after its boundary. Every rank
dumps its final state (weights, optimizer state, dense parameters, parity) to ``<out>/final-rank<r>.npz``
and what it saw to ``<out>/report-rank<r>.json``. ``overlap`` is ECRM's (default True); ``capacity`` sets ``exchange.INITIAL_CAPACITY_WORDS``. ``device`` puts the model on "cuda" (tests/test_cuda.py);
the data is drawn on the CPU, the same on every device.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from cnrstore.engine import fs  # noqa: E402
from cnrstore.distributed import ECRM, DistributedCheckpointer, ShardingPlan, exchange, failures  # noqa: E402
from cnrstore.errors import InvalidArgument  # noqa: E402

TABLES = {"emb.t0": (97, 8), "emb.t1": (40, 4), "emb.t2": (64, 6)}
BATCH = 16


class Model(nn.Module):
    def __init__(self, plan: ShardingPlan, rank: int, seed: int):
        super().__init__()
        self.emb = nn.ModuleDict()
        self.bounds = {}
        shards = plan.shards_of(rank)
        for n, (name, (rows, dim)) in enumerate(TABLES.items()):
            full = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed + n))
            if name in shards:
                s = shards[name]
                bag = nn.EmbeddingBag(s.num_rows, dim, mode="sum")
                with torch.no_grad():
                    bag.weight.copy_(full[s.row_start:s.row_end])
                self.emb[name.split(".")[1]] = bag
                self.bounds[name] = (s.row_start, s.row_end)
        torch.manual_seed(seed + 99)
        self.head = nn.Linear(sum(d for _r, d in TABLES.values()), 1)

    def forward(self, ids: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        device = self.head.weight.device
        for name, (rows, dim) in TABLES.items():
            col = ids[name].to(device)
            out = torch.zeros(col.shape[0], dim, device=device)
            if name in self.bounds:
                lo, hi = self.bounds[name]
                mine = torch.nonzero((col >= lo) & (col < hi)).squeeze(1)
                out = out.index_put((mine,), self.emb[name.split(".")[1]]((col[mine] - lo).view(-1, 1)))
            parts.append(out)
        local = torch.cat(parts, dim=1)
        pooled = local.detach().clone()
        failures.all_reduce(pooled)
        pooled.requires_grad_(True)
        return self.head(pooled).squeeze(1), local, pooled


def batch(step: int):
    g = np.random.default_rng(1000 + step)
    ids = {name: torch.from_numpy(g.integers(0, rows, BATCH)) for name, (rows, _d) in TABLES.items()}
    return ids, torch.from_numpy(g.random(BATCH).astype(np.float32))


def train_step(model, optimizer, ecrm, step: int, l2: float = 0.0) -> None:
    ids, labels = batch(step)
    optimizer.zero_grad(set_to_none=True)
    logits, local, pooled = model(ids)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.device))
    loss.backward()
    local.backward(pooled.grad)
    if l2:  # an L2 penalty on this rank's tables: a gradient on every row, no lookup made it
        (l2 * sum(p.pow(2).sum() for p in model.emb.parameters())).backward()
    dense = [p.grad for p in model.head.parameters()]
    flat = torch.cat([g.reshape(-1) for g in dense])
    failures.all_reduce(flat)
    flat /= dist.get_world_size()
    off = 0
    for g in dense:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()
    with ecrm.step(step):
        optimizer.step()


def state_of(model, optimizer, ecrm) -> dict[str, np.ndarray]:
    out = {f"model/{k}": v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            out[f"optim/{names[id(p)]}/{k}"] = v.detach().cpu().numpy().copy()
    out["parity"] = ecrm.parity.copy()
    return out


def words(model, optimizer) -> dict[str, np.ndarray]:
    """The protected tensors of this rank as raw words (to count what a step changed)."""
    out = {}
    for name, p in model.named_parameters():
        if name.startswith("emb."):
            out[name] = p.detach().cpu().numpy().view(np.uint32).copy()
            for k, v in optimizer.state.get(p, {}).items():
                out[f"{name}/{k}"] = v.detach().cpu().numpy().reshape(max(1, v.shape[0] if v.dim() else 1), -1) \
                    .view(np.uint32).copy()
    return out


def changed_words(before: dict, after: dict, block: int) -> int:
    """The words of the blocks (``block`` words, aligned in each tensor's rows; a row's tail block is
    padded) in which some word changed: what ECRM's step must send, once per parity slot."""
    total = 0
    for k in before:
        diff = before[k] != after[k]
        pad = -diff.shape[1] % block
        diff = np.pad(diff, ((0, 0), (0, pad))).reshape(diff.shape[0], -1, block)
        total += int(diff.any(axis=2).sum()) * block
    return total


def main(cfg: dict) -> int:
    rank, world = cfg["rank"], cfg["world"]
    epoch = cfg.get("epoch", 0)
    replacement = cfg.get("replacement", False)

    timeout = cfg.get("pg_timeout", 60)
    watch = None
    if cfg.get("board"):     # the test (the launcher) posts each death on the failure board
        watch = failures.FailureWatch(*cfg["board"], rank=rank, epoch=epoch)
        failures.install(watch)

    def rendezvous(e):
        dist.init_process_group("gloo", init_method=f"file://{cfg['rdzv']}-{e}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        if watch is not None:
            watch.rearm(e)

    def left(exc: BaseException) -> None:
        """Leave the broken group; record how this rank learned of the failure."""
        report["learned"].append({"epoch": epoch, "how": getattr(exc, "learned", "gloo"),
                                  "cause": getattr(exc, "cause", str(exc))[:300]})
        failures.leave_group()

    report = {"recoveries": [], "traffic": [], "learned": []}
    rendezvous(epoch)
    if cfg.get("capacity"):                       # a small first capacity: messages take two sends
        exchange.INITIAL_CAPACITY_WORDS = cfg["capacity"]
    plan = ShardingPlan.row_wise(TABLES, world)
    model = Model(plan, rank, 7 if not replacement else 1234 + epoch).to(cfg.get("device", "cpu"))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    ckpt = None
    if cfg.get("ckpt_every"):
        root, bucket = cfg["root"], {}
        if cfg.get("remote"):  # a root in a bucket: each rank's node a directory of its own, a replacement's empty
            bucket = {"remote": cfg["remote"], "remote_options": cfg["remote_options"]}
            root = os.path.join(root, f"node{rank}-epoch{epoch if replacement else 0}")
        ckpt = DistributedCheckpointer(root, model, optimizer, plan=plan, codec="fp32", timeout_s=timeout, **bucket)
    ecrm = ECRM(model, optimizer, k=cfg["k"], r=cfg["r"], checkpointer=ckpt, fallback=cfg.get("fallback", "partial"),
                replacement=replacement, timeout_s=timeout, overlap=cfg.get("overlap", True))
    step = 0
    pending = None

    def recover():
        nonlocal step
        rep = ecrm.recover(cfg["victims"], step=None if replacement else step)
        report["recoveries"].append({"mode": rep.mode, "step": rep.step, "redo": rep.redo_steps,
                                     "reason": rep.reason, "replacement": rep.replacement,
                                     "bytes_received": rep.bytes_received})
        step = int(rep.step)

    if replacement:
        recover()
    report["parity_bytes"] = ecrm.memory_bytes()["parity"]
    report["data_words"] = list(ecrm.layout.lengths)
    report["unit"], report["periods"], report["block"] = ecrm.layout.unit, ecrm.layout.periods, ecrm.layout.block
    while step < cfg["steps"]:
        try:
            nxt = step + 1
            victim = rank in cfg["victims"] and nxt == cfg["fail_step"] and not replacement
            if victim and cfg["crash"] != "kill":
                os.environ[fs.CRASH_ENV] = cfg["crash"]
            if cfg.get("count_traffic"):
                before = words(model, optimizer)
            if nxt == cfg.get("misnamed_step"):   # recover() naming a rank that did not fail: refused
                try:
                    ecrm.recover(cfg["misnamed"], step=step)
                except InvalidArgument as exc:
                    report["misnamed"] = str(exc)
            if rank == 0 and nxt == cfg.get("corrupt_step"):
                ecrm.parity[0] ^= np.uint32(1 << 7)       # a flipped bit in rank 0's parity
            train_step(model, optimizer, ecrm, nxt, cfg.get("l2", 0.0))
            step = nxt
            if cfg.get("count_traffic"):
                after = words(model, optimizer)
                changed = changed_words(before, after, ecrm.layout.block)
                report["traffic"].append({"step": step, "changed_words": changed,
                                          "payload": ecrm.stats["last_step_payload_bytes"],
                                          "sent": ecrm.stats["last_step_bytes_sent"]})
            if victim and cfg["crash"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt is not None and step % cfg["ckpt_every"] == 0:
                pending = ckpt.save(step, meta={"step": step})
                pending.wait()
        except RuntimeError as exc:
            if not cfg["victims"]:                # no rank was to fail: this is a fault of its own, not a death
                raise
            if pending is not None:
                try:
                    pending.wait()
                except Exception:
                    pass
                pending = None
            left(exc)
            epoch += 1
            rendezvous(epoch)
            while True:
                try:
                    recover()
                    break
                except RuntimeError as exc:   # a replacement died during the recovery: the next one comes
                    left(exc)
                    epoch += 1
                    rendezvous(epoch)
    ecrm.flush()                                  # the last step's round: its parity is part of the state
    np.savez(os.path.join(cfg["out"], f"final-rank{rank}.npz"), **state_of(model, optimizer, ecrm))
    report["stats"] = dict(ecrm.stats)
    with open(os.path.join(cfg["out"], f"report-rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    ecrm.close()
    if ckpt is not None:
        ckpt.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
