"""Multi-rank checkpoints over torch.distributed (``cnrstore.distributed``; docs/DESIGN.md, "Multi-rank jobs").

    plan = ShardingPlan.row_wise({"emb.0": (10_000_000, 64), ...}, world_size)
    ckpt = DistributedCheckpointer(root, model, optimizer, plan=plan, codec="int4")
    ckpt.save(step)                 # every rank; returns after the snapshot
    ckpt.restore()                  # any global version, any plan or world size
    ckpt.recover(failed_ranks=[3], step=step)   # CPR partial recovery
    ecrm = ECRM(model, optimizer, k=2, r=1, checkpointer=ckpt)   # erasure-coded parity of the shards
    with ecrm.step(step): optimizer.step()      # every step: the parity follows the update
    ecrm.recover(failed_ranks=[3])              # decode the lost shards: no update lost
    Manager(..., checkpoint_transport=TorchftTransport(ckpt))   # torchft: a replaced group heals from the store

See ``checkpointer`` for the commit protocol, ``manifest`` for the files under the root, ``ecrm`` for the
erasure-coded recovery and ``torchft_transport`` for healing under torchft.
"""

from ..lazy import lazy_names
from .manifest import GlobalVersion, Root
from .plan import Shard, ShardingPlan
from .remote_root import RemoteRoot, open_root
from .repair import RootRepairReport, repair_root

__all__ = ["ECRM", "ECRMReport", "DistributedCheckpointer", "DistributedPendingSave", "RecoveryReport", "GlobalVersion", "Root",
           "RemoteRoot", "RootRepairReport", "Shard", "ShardingPlan", "TorchftTransport", "HealReport", "open_root",
           "repair_root", "versions"]

#: Names whose modules import torch: loaded on first use, so that reading a root's manifests (the CLI's
#: ``ls ROOT`` / ``verify ROOT``) does not pay torch's import.
_LAZY = {"ECRM": "ecrm", "ECRMReport": "ecrm", "DistributedCheckpointer": "checkpointer",
         "DistributedPendingSave": "checkpointer", "RecoveryReport": "checkpointer",
         "TorchftTransport": "torchft_transport", "HealReport": "torchft_transport"}


__getattr__ = lazy_names(__name__, _LAZY, globals())


def versions(root, *, remote=None, remote_options: dict | None = None) -> list[GlobalVersion]:
    """The committed global versions under ``root``, oldest first (no process group needed); with
    ``remote``, of the root in that bucket prefix (``root``: this machine's directory for its rank stores)."""
    r = open_root(root, remote=remote, remote_options=remote_options)
    r.check()
    return r.versions()
