"""One torchft replica group (world size 1) healing through cnrstore's TorchftTransport, for
tests/test_torchft_recovery.py and benchmarks/bench_recovery.py (tools/torchft_job.py starts them).

    python tools/torchft_replica.py SPEC_JSON

SPEC: lighthouse, replica, replicas, steps, root, log, tables ("replicated" or "own"), save_every,
rows (per table), step_sleep (seconds after each step), kill_at (this process SIGKILLs itself once it has
committed that step; null: never), async_quorum (torchft's default: the quorum and a heal run beside the
forward pass; ``tables="replicated"`` only), ckpt ("cnrstore", or "dcp": torch.distributed.checkpoint saves into
``root/dcp-R`` and, at start, loads the newest -- the full restart bench_recovery.py compares with), reset_at (``tables="own"``, the reference run of CPR's semantics: at the
start of that step, put this group's table and its row-wise state back to its store's newest version, as a
replacement healing then would).

- ``tables="replicated"``: every group holds the same two tables and dense layer, gradients averaged over
  the groups (torchft's data parallelism); a group that joins heals from a peer: rows from the peer's store
  and the rows changed since its newest save. (The quorum waits for every group here too, so that the
  survivor is still training when its peer comes back; torchft itself would let it go on alone.)
- ``tables="own"``: a DLRM split across the groups: group r owns table r, each step exchanges the pooled
  embeddings and their gradients with two allreduces (model parallelism across groups), the dense layer is
  averaged. The lighthouse waits for every group (min_replicas = replicas), so a lost group stalls the step
  until its replacement has healed: its table from its own store's newest version (CPR), the rest from a peer.
  With ``ecrm`` (true), ``cnrstore.distributed.ECRM(k=replicas-1, r=1, overlap=False)`` keeps the tables'
  parity over a gloo group of its own (a default process group formed through the launcher's ``rdzv_port``
  store, one per epoch); the replacement heals with ``TorchftTransport(tables="keep")`` (the rest from a
  peer, the epoch included), then every group sees the replacement's flag in a one-element allreduce after
  the quorum, re-forms the default group and calls ``ECRM.recover``: the replacement's table and its
  Adagrad state are decoded from the parity, with no update lost.

Each group saves every ``save_every`` committed steps into ``root/replica-R`` and logs JSON lines: ``start``
(pid, times), ``healed`` (the transport's HealReport, and whether the tables then equal the store's version),
``commit`` (each committed step) and ``done`` (its state's digests).
"""

import json
import os
import sys
import time

T0 = time.time()
import hashlib  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed import ReduceOp, TCPStore  # noqa: E402

T_TORCH = time.time()
from torchft import Manager, ProcessGroupGloo  # noqa: E402

T_TORCHFT = time.time()
from cnrstore.distributed import ECRM, TorchftTransport, failures  # noqa: E402
from cnrstore.torch import Checkpointer  # noqa: E402

T_IMPORTED = time.time()
BATCH, POOL, DIM = 16, 4, 16


class Groups(nn.Module):
    """The tables this group holds: both (replicated), or its own."""

    def __init__(self, tables: int, rows: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, DIM, mode="sum") for _ in range(tables))


def batch(step: int, replica: int, table: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1_000_003 + replica * 1009 + table)
    return torch.randint(rows, (BATCH, POOL), generator=g)


def digests(obj) -> dict:
    out = {}
    for k, v in obj.items():
        out[k] = hashlib.sha256(v.detach().contiguous().numpy().tobytes()).hexdigest()[:16]
    return out


def dcp_save(path: str, step: int, state: dict) -> None:
    """torch.distributed.checkpoint's save of this group's state (no process group), then its step."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=os.path.join(path, f"step-{step}"), no_dist=True)
    with open(os.path.join(path, "step.tmp"), "w") as f:
        f.write(str(step))
    os.replace(os.path.join(path, "step.tmp"), os.path.join(path, "step"))


def dcp_load(path: str, state_dict, load_state_dict) -> int:
    """Load the newest dcp_save into the live objects -> its step."""
    import torch.distributed.checkpoint as dcp

    step = int(open(os.path.join(path, "step")).read())
    state = state_dict()
    dcp.load(state, checkpoint_id=os.path.join(path, f"step-{step}"), no_dist=True)
    load_state_dict(state)
    return step


def main() -> None:
    spec = json.loads(sys.argv[1])
    rid, replicas, rows, own = spec["replica"], spec["replicas"], spec["rows"], spec["tables"] == "own"
    use_ecrm, replacement = bool(spec.get("ecrm")), spec.get("incarnation", 0) > 0
    log = open(spec["log"], "a")

    def event(**kw):
        log.write(json.dumps({"t": time.time(), "pid": os.getpid(), **kw}) + "\n")
        log.flush()

    model = Groups(1 if own else 2, rows, seed=1000 + (rid if own else 0))
    torch.manual_seed(777)  # the dense layer starts equal in every group
    top = nn.Linear(replicas * DIM if own else 2 * DIM, 1)
    sparse = torch.optim.Adagrad(model.tables.parameters(), lr=0.05)
    dense = torch.optim.Adam(top.parameters(), lr=0.01)
    holder = nn.ModuleDict({"groups": model, "top": top})
    use_dcp = spec.get("ckpt") == "dcp"
    t_ckpt = time.time()
    if use_dcp:
        ckpt, transport, dcp_dir = None, None, os.path.join(spec["root"], f"dcp-{rid}")
    else:
        ckpt = Checkpointer(os.path.join(spec["root"], f"replica-{rid}"), holder, [sparse, dense], keep_last=3)
        transport = TorchftTransport(ckpt, tables="keep" if use_ecrm else spec["tables"], host="127.0.0.1")
    t_ckpt = time.time() - t_ckpt

    epoch = [0]  # (ECRM: which default process group the groups are on; a replacement heals it from a peer)

    def state_dict():
        return {"model": holder.state_dict(), "sparse": sparse.state_dict(), "dense": dense.state_dict(),
                "epoch": epoch[0]}

    def load_state_dict(sd):
        holder.load_state_dict(sd["model"])
        sparse.load_state_dict(sd["sparse"])
        dense.load_state_dict(sd["dense"])
        epoch[0] = sd["epoch"]

    rdzv = TCPStore("127.0.0.1", spec["rdzv_port"], is_master=False, wait_for_workers=False) if use_ecrm else None

    def join(e: int) -> None:  # the default process group of epoch e, over every group
        dist.init_process_group("gloo", store=dist.PrefixStore(f"ecrm-{e}", rdzv), rank=rid, world_size=replicas,
                                timeout=timedelta(seconds=120))

    ecrm = None
    if use_ecrm and not replacement:
        join(0)
        ecrm = ECRM(holder, [sparse], k=replicas - 1, r=1, overlap=False)

    store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=replicas,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=str(rid),
                      store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=spec["lighthouse"], port=0, use_async_quorum=bool(spec.get("async_quorum")),
                      checkpoint_transport=transport, init_sync=False)
    loaded, load_s = None, None
    if use_dcp and os.path.exists(os.path.join(dcp_dir, "step")):
        load_s = time.time()
        loaded = dcp_load(dcp_dir, state_dict, load_state_dict)
        load_s = time.time() - load_s
        manager.load_state_dict({"step": loaded + 1, "batches_committed": 0})
    event(ev="start", t0=T0, torch=T_TORCH, torchft=T_TORCHFT, imported=T_IMPORTED, checkpointer_s=t_ckpt,
          dcp_loaded=loaded, dcp_load_s=load_s)
    healed = False
    while manager.current_step() < spec["steps"]:
        sparse.zero_grad()
        dense.zero_grad()
        manager.start_quorum()
        step = manager.current_step()
        if transport is not None and transport.last_recv is not None and not healed:
            healed = True
            r = transport.last_recv
            version = ckpt.store.latest() if own else None
            same = None
            if own:  # the rows restored are exactly the own store's newest version
                same = bool(torch.equal(model.tables[0].weight,
                                        torch.from_numpy(ckpt.store.read_table("groups.tables.0", version.version))))
            event(ev="healed", step=step, version=r.version, seconds=r.seconds, fetch_seconds=r.fetch_seconds,
                  read_seconds=r.read_seconds, bytes=r.bytes, rows=r.rows, whole=r.whole, equals_store=same,
                  version_step=None if version is None else version.step)
        if own and spec.get("reset_at") == step:
            newest = ckpt.store.latest()
            with torch.no_grad():
                for name, tensor in (("groups.tables.0", model.tables[0].weight),
                                     ("groups.tables.0.optim.sum", sparse.state[model.tables[0].weight]["sum"])):
                    tensor.copy_(torch.from_numpy(ckpt.store.read_table(name, newest.version)))
            event(ev="reset", step=step, version_step=newest.step)
        if use_ecrm:  # a replacement in the quorum? every group learns it here, and all recover together
            flags = torch.zeros(replicas)
            flags[rid] = float(ecrm is None)
            manager.allreduce(flags, reduce_op=ReduceOp.SUM).wait()
            if not manager.errored() and flags.any():
                (victim,) = flags.nonzero().flatten().tolist()
                t_rec = time.time()
                failures.leave_group()
                epoch[0] += 1
                join(epoch[0])
                t_joined = time.time()
                if ecrm is None:
                    ecrm = ECRM(holder, [sparse], k=replicas - 1, r=1, overlap=False, replacement=True)
                t_built = time.time()
                rep = ecrm.recover([victim], step=step - 1)
                if rep.mode != "ecrm" or rep.step != step - 1 or rep.redo_steps:
                    raise RuntimeError(f"ECRM recovered step {rep.step} ({rep.mode}, redo {rep.redo_steps}), not the "
                                       f"step torchft committed last ({step - 1}): refused")
                event(ev="ecrm", step=step, victim=victim, seconds=time.time() - t_rec, decode=rep.decode_seconds,
                      replacement=rep.replacement, group_s=t_joined - t_rec, construct_s=t_built - t_joined,
                      recover_s=rep.seconds, phases=rep.phases)
        if own:
            ids = [batch(step, q, rid, rows) for q in range(replicas)]
            mine = torch.stack([model.tables[0](i) for i in ids])  # (replicas, BATCH, DIM): every group's lookups
            feats = torch.zeros(replicas, BATCH, replicas, DIM)
            feats[:, :, rid] = mine.detach()
            manager.allreduce(feats, reduce_op=ReduceOp.SUM).wait()
            feats.requires_grad_(True)
            top(feats[rid].reshape(BATCH, -1)).square().mean().backward()
            grads = feats.grad.clone()
            manager.allreduce(grads, reduce_op=ReduceOp.SUM).wait()
            mine.backward(grads[:, :, rid])
        else:
            x = torch.cat([model.tables[t](batch(step, rid, t, rows)) for t in range(2)], 1)
            top(x).square().mean().backward()
            for p in model.tables.parameters():
                manager.allreduce(p.grad).wait()
        for p in top.parameters():
            manager.allreduce(p.grad).wait()
        if manager.should_commit():
            if ecrm is not None:
                with ecrm.step(step):  # (the parity follows the rows the step changes)
                    sparse.step()
            else:
                sparse.step()
            dense.step()
            event(ev="commit", step=step)
            if (step + 1) % spec["save_every"] == 0:
                if use_dcp:
                    dcp_save(dcp_dir, step, state_dict())
                else:
                    ckpt.save(step).wait()  # (committed at once: the runs compared restore the same version)
            if spec.get("kill_at") is not None and step >= spec["kill_at"]:
                event(ev="kill", step=step)
                os.kill(os.getpid(), 9)
        time.sleep(spec["step_sleep"])
    if ecrm is not None:
        ecrm.close()
        dist.destroy_process_group()
    if ckpt is not None:
        ckpt.close()
    event(ev="done", step=manager.current_step(), digests=digests(holder.state_dict()),
          sparse=digests({str(k): v["sum"] for k, v in sparse.state_dict()["state"].items()}))
    manager.shutdown(wait=False)
    if transport is not None:
        transport.shutdown(wait=False)
    log.close()


if __name__ == "__main__":
    main()
