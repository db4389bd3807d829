"""One rank of a torchft replica group of several ranks whose embedding table is sharded across the group's
ranks (model parallelism inside the group, data parallelism across groups: torchft's HSDP shape), saved by a
``DistributedCheckpointer`` and healed through ``TorchftTransport`` (each rank from the same rank of a peer
group: the rows of its shard from that rank's store, plus the rows changed since its newest save). For
tests/test_torchft_recovery.py; tools/torchft_job.run_groups starts it.

    python tools/torchft_group.py SPEC_JSON

SPEC: lighthouse, group, rank, group_size, groups, group_port (the group's TCPStore, hosted by the launcher),
incarnation (of the group: its ranks' default process group is formed under it), steps, root, log, rows,
save_every, kill_at (this rank SIGKILLs itself once it has committed that step; null: never).

Each step: every rank looks its shard's rows up for the group's batch, a sum over the group's ranks
(``all_reduce`` on the group's default process group) gives every rank the pooled embeddings, the dense
layer (the same on every rank of the group) trains on them, and each rank's shard gradient and the dense
gradients are averaged with the same rank of the other groups (torchft's ``allreduce``). Events as
tools/torchft_replica.py's: ``start``, ``healed``, ``commit``, ``done``.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo

from cnrstore.distributed import DistributedCheckpointer, ShardingPlan, TorchftTransport
from torchft_replica import BATCH, DIM, POOL, digests


def main() -> None:
    spec = json.loads(sys.argv[1])
    group, rank, size, rows = spec["group"], spec["rank"], spec["group_size"], spec["rows"]
    log = open(spec["log"], "a")

    def event(**kw):
        log.write(json.dumps({"t": time.time(), "pid": os.getpid(), **kw}) + "\n")
        log.flush()

    store = TCPStore("127.0.0.1", spec["group_port"], is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"group-{spec['incarnation']}", store), rank=rank,
                            world_size=size)
    plan = ShardingPlan.row_wise({"emb": (rows, DIM)}, size)
    shard = plan.shards_of(rank)["emb"]
    torch.manual_seed(100 + group * 10 + rank)  # (every group starts apart: the heal must bring the peer's state)
    emb = nn.Embedding(shard.num_rows, DIM)
    torch.manual_seed(777)  # (the dense layer: the same on every rank; torchft's sync at step 0 goes either way)
    holder = nn.ModuleDict({"emb": emb, "top": nn.Linear(DIM, 1)})
    sparse = torch.optim.Adagrad(holder["emb"].parameters(), lr=0.05)
    dense = torch.optim.Adam(holder["top"].parameters(), lr=0.01)
    ckpt = DistributedCheckpointer(os.path.join(spec["root"], f"group-{group}"), holder, [sparse, dense], plan=plan)
    transport = TorchftTransport(ckpt, host="127.0.0.1")

    def state_dict():
        return {"model": holder.state_dict(), "sparse": sparse.state_dict(), "dense": dense.state_dict()}

    def load_state_dict(sd):
        holder.load_state_dict(sd["model"])
        sparse.load_state_dict(sd["sparse"])
        dense.load_state_dict(sd["dense"])

    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=spec["groups"], load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=str(group), store_addr="127.0.0.1",
                      store_port=spec["group_port"], rank=rank, world_size=size, lighthouse_addr=spec["lighthouse"],
                      port=0, use_async_quorum=False, checkpoint_transport=transport)
    event(ev="start", rank=rank)
    while manager.current_step() < spec["steps"]:
        sparse.zero_grad()
        dense.zero_grad()
        manager.start_quorum()
        step = manager.current_step()
        if transport.last_recv is not None:
            r = transport.last_recv
            event(ev="healed", step=step, version=r.version, rows=r.rows, whole=r.whole, bytes=r.bytes)
            transport.last_recv = None
        g = torch.Generator().manual_seed(step * 1_000_003 + group)
        ids = torch.randint(rows, (BATCH, POOL), generator=g)
        local = ids - shard.row_start
        mine = (local >= 0) & (local < shard.num_rows)
        part = (holder["emb"](local.clamp(0, shard.num_rows - 1)) * mine[..., None]).sum(1)  # this shard's share
        pooled = part.detach().clone()
        dist.all_reduce(pooled)  # (the group's sum: every rank has the pooled embeddings)
        pooled.requires_grad_(True)
        holder["top"](pooled).square().mean().backward()
        part.backward(pooled.grad)
        for p in [holder["emb"].weight, *holder["top"].parameters()]:
            manager.allreduce(p.grad).wait()
        if manager.should_commit():
            sparse.step()
            dense.step()
            event(ev="commit", step=step)
            if (step + 1) % spec["save_every"] == 0:
                ckpt.save(step).wait()
            if spec.get("kill_at") is not None and step >= spec["kill_at"]:
                os.kill(os.getpid(), 9)
    ckpt.close()
    event(ev="done", step=manager.current_step(), digests=digests(holder.state_dict()),
          sparse=digests({str(k): v["sum"] for k, v in sparse.state_dict()["state"].items()}))
    manager.shutdown(wait=False)
    transport.shutdown(wait=False)
    dist.destroy_process_group()
    log.close()


if __name__ == "__main__":
    main()
