"""The parts of an open engine that its two collaborators in this package work on: the checkpoint writer
(writer.py) and the maintenance handle (handle.py).

``Engine`` keeps its parts private. It hands them to these two explicitly, as one ``EngineParts``
made when a writer opens or a maintenance handle is made, so that no module reaches into another's
private attributes. Code outside ``cnrstore/engine/`` never sees one: it has the engine's public methods
and the handle.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, ContextManager, NamedTuple

if TYPE_CHECKING:
    from ..options import Options
    from .chain_costs import ChainCosts
    from .index import IndexView
    from .storage import SegmentStorage


class EngineParts(NamedTuple):
    """An open engine's parts (see the module docstring)."""

    #: an index read transaction (``with parts.read() as view``)
    read: Callable[[], ContextManager["IndexView"]]
    #: where the segments live (storage.py)
    storage: "SegmentStorage"
    #: the checkpoint writer's appender and compaction's (segments.SegmentAppender; None when readonly)
    writer_appender: Any
    compaction_appender: Any
    #: held while the open checkpoint's pins are read or extended, and through a commit that decides
    #: which entries to prune (retention must not delete a base a delta being written reads)
    pin_lock: threading.Lock
    #: the open checkpoint's pins (call with ``pin_lock`` held)
    pinned: Callable[[], frozenset]
    #: the one commit path: ``commit(appender, edit, *, appended, on_failure=None)`` (Engine._commit)
    commit: Callable[..., None]
    #: what each block's read chain costs, for the save path's bound check (chain_costs.py)
    chain_costs: "ChainCosts"
    #: the store's tunables (cnrstore.Options)
    options: "Options"
    #: maintenance's: the cached version history (policy.compaction.History), the sealing of the idle
    #: writer's segment, the deletion of freed segments, and the feed of blocks checkpoints wrote
    history: Callable[[], Any]
    seal_idle_writer_segment: Callable[[], None]
    delete_doomed: Callable[[Any], Any]
    take_written_blocks: Callable[[], "set | None"]
    look_at_every_block: Callable[[], None]
