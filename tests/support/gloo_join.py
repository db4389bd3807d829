"""How a spawned gloo worker joins its job (tests/support/*_worker.py): one torch thread, then the default
process group from the job's rendezvous file ``cfg["init"]``."""

from datetime import timedelta

import torch
import torch.distributed as dist


def join(cfg: dict, timeout_s: float = 60.0) -> tuple[int, int]:
    """Join the job ``cfg`` describes (``rank``, ``world``, ``init``) -> (rank, world size)."""
    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['init']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return rank, world
