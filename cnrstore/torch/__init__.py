"""PyTorch integration: the trainer-side ``Checkpointer`` (row tracking, asynchronous checkpoints, restore;
see ``checkpointer``) and exporting a version as a ``torch.save`` file (see ``export``)."""

from .checkpointer import Checkpointer, PendingSave, SaveReport

__all__ = ["Checkpointer", "PendingSave", "SaveReport"]
