"""PyTorch integration: the trainer-side ``Checkpointer`` (row tracking, asynchronous checkpoints, restore;
see ``checkpointer``), reading a version back as a model state dict (``export``; files are written by
``cnrstore.export``), a keyed embedding over raw int64 ids (``keyed_embedding``, saved as keyed tables),
and seeding a store from a PyTorch checkpoint (``imports``)."""

from ..lazy import lazy_names
from .checkpointer import Checkpointer, PendingSave, RestoreReport, SaveReport
from .keyed_embedding import KeyedEmbedding

#: Names imported on first use (a trainer's start-up does not pay for them): name -> its module
_LAZY = {"CheckpointView": "export", "ImportReport": "imports", "import_checkpoint": "imports"}
__getattr__ = lazy_names(__name__, _LAZY, globals())

__all__ = ["Checkpointer", "CheckpointView", "ImportReport", "KeyedEmbedding", "PendingSave", "RestoreReport", "SaveReport", "import_checkpoint"]
