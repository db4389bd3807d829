"""PyTorch integration: the trainer-side ``Checkpointer`` (row tracking, asynchronous checkpoints, restore;
see ``checkpointer``), reading a version back as a model state dict (``export``; files are written by
``cnrstore.export``), a keyed embedding over raw int64 ids (``keyed_embedding``, saved as keyed tables),
and seeding a store from a PyTorch checkpoint (``imports``)."""

from .checkpointer import Checkpointer, PendingSave, RestoreReport, SaveReport
from .export import CheckpointView
from .keyed_embedding import KeyedEmbedding
from .imports import ImportReport, import_checkpoint

__all__ = ["Checkpointer", "CheckpointView", "ImportReport", "KeyedEmbedding", "PendingSave", "RestoreReport", "SaveReport", "import_checkpoint"]
