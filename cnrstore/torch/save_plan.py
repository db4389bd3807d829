"""Which rows each save of a ``Checkpointer`` writes (``checkpointer``'s module doc: modes, priority saves):
the rows whose fingerprint changed since the last save (``fingerprint.py``), and the state that carries over
between saves (whether the next one must be a baseline, the differentials since the last baseline).

Nothing here touches the store: ``SavePlanner.pick`` fingerprints the tables and decides, ``settle`` keeps the
fingerprints of what the snapshot took, ``note_restore`` starts over after a restore.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .fingerprint import fingerprints
from .optim_state import row_state_width, row_states, table_drift
from .tracking import ShardTable, Table

__all__ = ["MODES", "SavePlanner"]

MODES = ("incremental", "one-shot", "intermittent")


class SavePlanner:
    """The rows of ``tables`` (``tracking.Table``s) that each save in ``mode`` writes. ``force_full``: the
    next save is a baseline (the first save, and the first after a background failure or a restore);
    ``diffs``: S_1..S_i, the differentials since the last baseline as fractions of all embedding rows (the
    intermittent rule)."""

    def __init__(self, mode: str, tables: list, optimizers: list):
        self.mode = mode
        self.tables = tables
        self.optimizers = optimizers
        self.force_full = True
        #: the model has keyed embeddings (keyed_save.py): with no positional tables, a save is then a baseline
        #: only when it must be (their increments are the Checkpointer's, not this planner's)
        self.keyed = False
        self.diffs: list[float] = []
        self._now: list = []  # per table, the fingerprints of its rows taken by the last pick()

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

    def sources(self, t: Table) -> list:
        """(store table name, tensor viewed as ``num_rows`` x width) of ``t``'s weight, then of each of its
        row-wise optimizer state tables."""
        out = [(t.name, t.weight.detach())]
        for key, state in self.row_states(t):
            out.append((f"{t.name}.optim.{key}", state.detach().reshape(t.num_rows, row_state_width(state))))
        return out

    def drift(self, t: Table) -> str | None:
        """``optim_state.table_drift`` of ``t``: which rows the optimizers change without a gradient."""
        if isinstance(t, ShardTable):
            return None  # fused TBE optimizers update the rows of the batch only (sharded.py)
        return table_drift(self.optimizers, t.weight)

    def _fingerprint(self, t: Table):
        """The fingerprint of each row of ``t``: its weight and row-wise state together (``fingerprint.py``)."""
        return fingerprints([src for _name, src in self.sources(t)], numpy=True if t.on_cpu else None)

    def _changed(self, t: Table, now) -> torch.Tensor:
        """Bool per row of ``t`` (a tensor on its device): whether the row or its row-wise state differs from
        the last save's (every row before a first save)."""
        if t.saved is None:
            return torch.ones(t.num_rows, dtype=torch.bool, device=t.device)
        changed = now != t.saved
        return torch.from_numpy(changed) if isinstance(changed, np.ndarray) else changed

    def changed_rows(self, t: Table) -> torch.Tensor | None:
        """The rows of ``t`` whose weight or row-wise state differ from the last save's, now (ascending int64,
        on the CPU); None before a first save (every row). Changes nothing (``Checkpointer.image_rows``)."""
        if t.saved is None:
            return None
        return self._rows(self._changed(t, self._fingerprint(t))).cpu()

    @staticmethod
    def _rows(mask: torch.Tensor) -> torch.Tensor:
        """The rows where ``mask`` is True, ascending (int64, on its device)."""
        if mask.device.type == "cpu":
            return torch.from_numpy(np.flatnonzero(mask.numpy()))
        return mask.nonzero().squeeze(1)

    def expected(self, t: Table, rows: np.ndarray | None) -> np.ndarray:
        """The fingerprints of ``rows`` (local ids, or None for every row) of ``t`` as the last ``pick`` found
        them (a streamed save checks what it writes against them): numpy int64."""
        fp = self._now[self.tables.index(t)]
        fp = fp if isinstance(fp, np.ndarray) else fp.cpu().numpy()
        return fp if rows is None else fp[rows]

    # -- a save ---------------------------------------------------------------------------------------
    def pick(self, top: float | None = None) -> tuple[bool, bool, list]:
        """(baseline?, priority?, per table: the rows tensor to write, or None for every row) for the next
        save; ``top`` asks for a priority save, which a save that must be a baseline ignores. Fingerprints
        every table now (``settle`` keeps them once the snapshot is taken)."""
        self._now = [self._fingerprint(t) for t in self.tables]
        changed = [self._changed(t, now) for t, now in zip(self.tables, self._now)]
        if top is not None and not self.force_full and self.tables:
            return False, True, self._pick_priority(top, changed)
        baseline, picks = self._pick_rows(changed)
        return baseline, False, picks

    def _pick_rows(self, changed: list) -> tuple[bool, list]:
        if self.force_full or (not self.tables and not self.keyed):
            baseline = True
        elif not self.tables:
            return False, []
        elif self.mode == "incremental":
            return False, [self._rows(c) for c in changed]
        else:
            for t, c in zip(self.tables, changed):
                t.since_baseline.or_mask(c)
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
        self.note_baseline()
        return True, [None] * len(self.tables)

    def note_baseline(self) -> None:
        """The save being taken writes every row (a baseline; also one that superseded a queued baseline):
        the differentials start over."""
        self.force_full = False
        self.diffs = []
        for t in self.tables:
            t.since_baseline.clear()

    def _pick_priority(self, top: float, changed: list) -> list:
        """Per table, the rows a priority save writes: of the changed rows, the most updated
        (``Table.top_rows``); changes no mask."""
        picks = []
        for t, c in zip(self.tables, changed):
            # the epsilon keeps 0.07 * 100 (= 7.000000000000001) at 7 rows
            k = min(t.num_rows, max(1, math.ceil(top * t.num_rows - 1e-6)))
            picks.append(t.top_rows(self._rows(c), k))
        return picks

    def settle(self, picks: list, priority: bool) -> None:
        """After the snapshot of ``picks`` was taken: the fingerprints ``pick`` took become the last save's
        (for a priority save, those of the rows it took); a regular
        save clears every count, a priority save those of the rows it took (keeping them as changed since
        the baseline, except in incremental mode)."""
        for t, rows, now in zip(self.tables, picks, self._now):
            if not priority:
                t.saved = now
                if t.counts is not None:
                    t.clear(t.counts)
                continue
            t.settle_priority(rows, keep_since_baseline=self.mode != "incremental")
            # (a new array: the one a stream of an earlier save checks against must not change under it)
            kept = t.saved.clone() if torch.is_tensor(t.saved) else t.saved.copy()
            idx = rows if torch.is_tensor(kept) else rows.cpu().numpy()
            kept[idx] = now[idx]
            t.saved = kept
        self._now = []

    # -- a restore ------------------------------------------------------------------------------------
    def note_restore(self, *, matches_newest: bool = False) -> None:
        """The live state was just loaded from a stored version: its fingerprints become the last save's,
        the differentials and counts start over, and the next save is a baseline unless ``matches_newest``
        in incremental mode (the next increment then follows the store's newest version)."""
        for t in self.tables:
            t.since_baseline.clear()
            if t.counts is not None:
                t.counts.zero_()
            t.saved = self._fingerprint(t)
        self.force_full = not (self.mode == "incremental" and matches_newest)
        self.diffs = []
