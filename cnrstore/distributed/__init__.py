"""Multi-rank checkpoints over torch.distributed (``cnrstore.distributed``; docs/DESIGN.md, "Multi-rank jobs").

    plan = ShardingPlan.row_wise({"emb.0": (10_000_000, 64), ...}, world_size)
    ckpt = DistributedCheckpointer(root, model, optimizer, plan=plan, codec="int4")
    ckpt.save(step)                 # every rank; returns after the snapshot
    ckpt.restore()                  # any global version, any plan or world size
    ckpt.recover(failed_ranks=[3], step=step)   # CPR partial recovery
    ecrm = ECRM(model, optimizer, k=2, r=1, checkpointer=ckpt)   # erasure-coded parity of the shards
    with ecrm.step(step): optimizer.step()      # every step: the parity follows the update
    ecrm.recover(failed_ranks=[3])              # decode the lost shards: no update lost

See ``checkpointer`` for the commit protocol, ``manifest`` for the files under the root and ``ecrm`` for the
erasure-coded recovery.
"""

from .ecrm import ECRM, ECRMReport
from .checkpointer import DistributedCheckpointer, DistributedPendingSave, RecoveryReport
from .manifest import GlobalVersion, Root
from .plan import Shard, ShardingPlan

__all__ = ["ECRM", "ECRMReport", "DistributedCheckpointer", "DistributedPendingSave", "RecoveryReport", "GlobalVersion", "Root",
           "Shard", "ShardingPlan", "versions"]


def versions(root) -> list[GlobalVersion]:
    """The committed global versions under ``root``, oldest first (no process group needed)."""
    r = Root(root)
    r.check()
    return r.versions()
