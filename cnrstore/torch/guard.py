"""Copy-on-write for streamed saves: before a row of a table whose save is being written from the live tensors
changes, preserve its value as of ``save()`` (``streamed.StreamedTable.preserve``).

What changes a streamed table's rows, and where the :class:`StepGuard` sees it coming (docs/DESIGN.md,
"Streamed saves"):

- **An optimizer step** (any optimizer holding the weight, passed to the Checkpointer or not): torch's global
  step pre-hook runs before the step touches a parameter. The rows the step will change are the rows of the
  weight's gradient as it stands -- a sparse gradient's indices, a dense gradient's non-zero rows (an L2
  penalty, a tied output layer, ``F.embedding`` on the weight: whatever produced it) -- for an optimizer
  that changes no row without a gradient (``optim_state.table_drift`` None: plain SGD, Adagrad, SparseAdam,
  no weight decay); every row for any other.
- **A closure's gradients** (``opt.step(closure)``: torch runs the pre-hook before the closure): between an
  optimizer's pre- and post-hook, every gradient autograd computes for the weight (a hook on the weight,
  :meth:`torch.Tensor.register_hook`) is preserved as it arrives, before the step applies it.
- **A write announced by the trainer** (``Checkpointer.changing`` / ``reset_rows``): its rows.

A change nothing announced (an in-place write through ``.data``, numpy, ``copy_``, ``load_state_dict``,
``nn.init``) is not preserved: the writer finds the row's fingerprint changed and refuses the save
(``errors.SaveRefused``) rather than commit it torn.

Only tables with a save being written are touched: between saves the hooks return at once.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .optim_state import nonzero_rows, table_drift

__all__ = ["StepGuard", "grad_rows"]

def grad_rows(grad: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """The rows a gradient is non-zero on, as int64 ids on the CPU (duplicates allowed): a sparse COO
    gradient's indices, a dense one's rows with a non-zero bit (-0.0 and NaN count: ``nonzero_rows``);
    None: it may touch any row (another layout)."""
    if grad is None:
        return torch.zeros(0, dtype=torch.int64)
    if grad.layout == torch.sparse_coo:
        return grad._indices()[0].cpu()
    if grad.layout != torch.strided or grad.dim() == 0 or grad.shape[0] != num_rows:
        return None
    return nonzero_rows([grad], num_rows, grad.device).nonzero().squeeze(1).cpu()


class StepGuard:
    """Preserves the rows of ``tables`` (``tracking.Table``s of one Checkpointer) that optimizer steps and
    their closures are about to change, in the saves being written from them (module doc). Its hooks hold it
    weakly; :meth:`remove` takes them away (the Checkpointer's ``close()``)."""

    def __init__(self, tables: list):
        self._tables = [t for t in tables if t.weight.requires_grad]
        self._stepping: dict[int, list] = {}  # id(optimizer) -> the tables its step in progress holds
        self._holds: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> (key, {id(w)})
        me = weakref.ref(self)

        def before(optimizer, _args, _kwargs) -> None:
            guard = me()
            if guard is not None:
                guard.before_step(optimizer)

        def after(optimizer, _args, _kwargs) -> None:
            guard = me()
            if guard is not None:
                guard.after_step(optimizer)

        self._hooks = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
        for t in self._tables:
            self._hooks.append(t.weight.register_hook(self._gradient_hook(weakref.ref(t))))

    def remove(self) -> None:
        """Take every hook away."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- optimizer steps --------------------------------------------------------------------------------
    def _held(self, optimizer) -> set:
        """The ids of the parameters ``optimizer`` holds (cached while its parameter groups keep their size)."""
        groups = optimizer.param_groups
        key = (len(groups), sum(len(g["params"]) for g in groups))
        try:
            cached = self._holds.get(optimizer)
        except TypeError:  # (an optimizer that cannot be weakly referenced: not cached)
            cached = None
        if cached is not None and cached[0] == key:
            return cached[1]
        held = {id(p) for g in groups for p in g["params"]}
        try:
            self._holds[optimizer] = (key, held)
        except TypeError:
            pass
        return held

    def before_step(self, optimizer) -> None:
        """Before ``optimizer``'s step (its pre-hook): preserve, in each save of a table it holds still being
        written, the rows the step will change (module doc)."""
        streaming = [t for t in self._tables if t.open_streams()]
        self.after_step(optimizer)  # (a step that raised left its tables counted: forget them)
        if not streaming:
            return
        held = self._held(optimizer)
        mine = [t for t in streaming if id(t.weight) in held]
        if not mine:
            return
        self._stepping[id(optimizer)] = mine
        for t in mine:
            t.in_step += 1
            rows = grad_rows(t.weight.grad, t.num_rows) if table_drift([optimizer], t.weight) is None else None
            preserve(t, rows)

    def after_step(self, optimizer) -> None:
        """After ``optimizer``'s step (its post-hook): its closure's gradients are no longer preserved."""
        for t in self._stepping.pop(id(optimizer), ()):
            t.in_step = max(0, t.in_step - 1)

    def _gradient_hook(self, table_ref):
        def hook(grad):
            t = table_ref()
            if t is not None and t.in_step and t.open_streams():
                preserve(t, grad_rows(grad, t.num_rows))
            return None
        return hook


def preserve(t, rows: torch.Tensor | None) -> None:
    """Preserve ``rows`` (int64 ids, duplicates allowed; None: every row) of table ``t`` in each of its saves
    still being written."""
    for s in t.open_streams():
        if rows is None:
            s.preserve_all()
        elif rows.numel():
            s.preserve(rows)


def as_rows(rows) -> torch.Tensor | None:
    """``rows`` (None for every row, or ids as a tensor, numpy array or sequence) as int64 ids on the CPU."""
    if rows is None:
        return None
    if torch.is_tensor(rows):
        return rows.detach().reshape(-1).to("cpu", torch.int64)
    return torch.from_numpy(np.asarray(rows, dtype=np.int64).reshape(-1))
