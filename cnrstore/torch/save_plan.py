"""Which rows each save of a ``Checkpointer`` writes (``checkpointer``'s module doc: modes, drift, priority
saves): the row tracking of its tables read and cleared at each save, and the state that carries over
between saves (whether the next one must be a baseline, the differentials since the last baseline).

Nothing here touches the store: ``SavePlanner.pick`` decides, ``settle`` clears what the snapshot took,
``note_restore`` resets the tracking after a restore.
"""

from __future__ import annotations

import math

from .optim_state import nonzero_rows, row_states, table_drift
from .rowbits import RowBits
from .tracking import ShardTable, Table

__all__ = ["MODES", "SavePlanner"]

MODES = ("incremental", "one-shot", "intermittent")


class SavePlanner:
    """The rows of ``tables`` (``tracking.Table``s) that each save in ``mode`` writes, with the drift of
    ``optimizers`` taken into account. ``force_full``: the next save is a baseline (the first save, and the
    first after a background failure or a restore); ``diffs``: S_1..S_i, the differentials since the last
    baseline as fractions of all embedding rows (the intermittent rule)."""

    def __init__(self, mode: str, tables: list, optimizers: list):
        self.mode = mode
        self.tables = tables
        self.optimizers = optimizers
        self.force_full = True
        self.diffs: list[float] = []

    @property
    def total_rows(self) -> int:
        return sum(t.num_rows for t in self.tables)

    # -- per table ------------------------------------------------------------------------------------
    def row_states(self, t: Table):
        """(state name, tensor) of the row-wise optimizer state of ``t``'s weight, in a stable order."""
        if isinstance(t, ShardTable):
            yield from t.states
            return
        yield from row_states(self.optimizers, t.weight, t.num_rows)

    def drift(self, t: Table) -> str | None:
        """``optim_state.table_drift`` of ``t``: which rows the optimizers change without a lookup."""
        if isinstance(t, ShardTable):
            return None  # fused TBE optimizers update the rows of the batch only (sharded.py)
        return table_drift(self.optimizers, t.weight)

    def _add_drifted_rows(self) -> None:
        """Before a regular save: mark as touched the rows the optimizers may have changed without a lookup
        since the previous regular save, so that every mode writes them."""
        for t in self.tables:
            drift = self.drift(t)
            if drift == "all":
                t.touched.fill()
                t.nonzero_saved = None
            elif drift == "state":
                nz = nonzero_rows([v for _k, v in self.row_states(t)], t.num_rows, t.device)
                t.touched.or_mask(nz)
                t.touched.or_(t.nonzero_saved)
                t.nonzero_saved = RowBits.from_mask(nz)
            else:
                t.nonzero_saved = None

    # -- a save ---------------------------------------------------------------------------------------
    def pick(self, top: float | None = None) -> tuple[bool, bool, list]:
        """(baseline?, priority?, per table: the rows tensor to write, or None for every row) for the next
        save; ``top`` asks for a priority save, which a save that must be a baseline ignores. Updates the
        masks a regular save reads (``settle`` clears what it took)."""
        if top is not None and not self.force_full and self.tables:
            return False, True, self._pick_priority(top)
        baseline, picks = self._pick_rows()
        return baseline, False, picks

    def _pick_rows(self) -> tuple[bool, list]:
        self._add_drifted_rows()
        if self.force_full or not self.tables:
            baseline = True
        elif self.mode == "incremental":
            return False, [t.touched.rows() for t in self.tables]
        else:
            for t in self.tables:
                t.merge_touched()
            count = sum(t.since_baseline.count() for t in self.tables)
            baseline = False
            if self.mode == "intermittent":
                s = self.diffs + [count / self.total_rows]
                i = len(s)
                baseline = 1 + sum(s) <= (i + 1) * s[-1]
                if not baseline:
                    self.diffs = s
            if not baseline:
                return False, [t.since_baseline.rows() for t in self.tables]
        self.force_full = False
        self.diffs = []
        for t in self.tables:
            t.since_baseline.clear()
        return True, [None] * len(self.tables)

    def _pick_priority(self, top: float) -> list:
        """Per table, the rows a priority save writes (``Table.top_rows``); changes no mask."""
        picks = []
        for t in self.tables:
            # the epsilon keeps 0.07 * 100 (= 7.000000000000001) at 7 rows
            k = min(t.num_rows, max(1, math.ceil(top * t.num_rows - 1e-6)))
            picks.append(t.top_rows(k))
        return picks

    def settle(self, picks: list, priority: bool) -> None:
        """After the snapshot of ``picks`` was taken: a regular save clears every touched bit and count; a
        priority save only those of the rows it took (keeping them as changed since the baseline, except in
        incremental mode)."""
        for t, rows in zip(self.tables, picks):
            if priority:
                t.settle_priority(rows, keep_since_baseline=self.mode != "incremental")
            else:
                t.touched.clear()
                if t.counts is not None:
                    t.clear(t.counts)

    # -- a restore ------------------------------------------------------------------------------------
    def note_restore(self, *, matches_newest: bool = False) -> None:
        """The live state was just loaded from a stored version: clear the row tracking, remember where the
        optimizer state is non-zero, and make the next save a baseline unless ``matches_newest`` in
        incremental mode (the next increment then follows the store's newest version)."""
        for t in self.tables:
            t.touched.clear()
            t.since_baseline.clear()
            if t.counts is not None:
                t.counts.zero_()
            t.nonzero_saved = None
            if self.drift(t) == "state":
                t.nonzero_saved = RowBits.from_mask(
                    nonzero_rows([v for _k, v in self.row_states(t)], t.num_rows, t.device))
        self.force_full = not (self.mode == "incremental" and matches_newest)
        self.diffs = []
