"""What a restore loads, decided and checked against the live objects before any of them changes
(``Checkpointer.restore``: all or nothing).

A restore loads everything a version holds by default, and every live object must then get its state:
the model's tables and dense arrays, each optimizer (of the same kind, with the same parameter groups) and
each ``extra`` object. A mismatch -- a table, array or ``extra`` the version lacks or holds beyond the live
ones, another number or kind of optimizers, other parameter groups -- is InvalidArgument naming it, before
anything is read into place. ``only=`` asks for less (``"model"``, ``"optimizers"``, ``"extra"``, or names
of tables, dense arrays and ``extra`` objects); ``strict=False`` loads what matches and leaves the rest as it
is, as DCP's ``allow_partial_load`` does: optimizer state then follows the parameters by name. What was left
and what was not loaded is in the ``Outcome`` (``RestoreReport.missing`` / ``.unexpected``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidArgument
from .optim_state import is_keyed

__all__ = ["Outcome", "Selection", "check_optimizers", "check_names", "optimizer_kind", "select"]

PARTS = ("model", "optimizers", "extra")


@dataclass
class Outcome:
    """What a restore did: the state it ``restored``, the live state it left as it was because the version
    holds none for it (``missing``, only with ``strict=False``), and the stored state it did not load because
    nothing live takes it (``unexpected``, likewise). Names: table names, state-dict keys of dense arrays,
    ``extra`` names, and ``optimizer N`` (``optimizer N: <param>`` for one parameter's state)."""

    restored: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)


@dataclass
class Selection:
    """The live state a restore loads: table names, dense keys, whether the optimizers, ``extra`` names."""

    tables: set
    dense: set
    optimizers: bool
    extra: set


def select(only, tables: list[str], dense: list[str], extra: list[str], has_optimizers: bool) -> Selection:
    """The ``Selection`` for ``restore(only=...)``: None is everything; else an iterable of ``"model"`` (every
    table and dense array), ``"optimizers"``, ``"extra"`` (every ``extra`` object) and names of tables, dense
    arrays and ``extra`` objects. InvalidArgument for a name that is none of these."""
    if only is None:
        return Selection(set(tables), set(dense), has_optimizers, set(extra))
    if isinstance(only, str):
        only = [only]
    try:
        names = list(only)
    except TypeError:
        raise InvalidArgument(f"only= takes None or names ('model', 'optimizers', 'extra', tables, dense arrays, "
                              f"extra objects); got {only!r}") from None
    sel = Selection(set(), set(), False, set())
    for name in names:
        if name == "model":
            sel.tables |= set(tables)
            sel.dense |= set(dense)
        elif name == "optimizers":
            sel.optimizers = has_optimizers
        elif name == "extra":
            sel.extra |= set(extra)
        elif name in tables:
            sel.tables.add(name)
        elif name in dense:
            sel.dense.add(name)
        elif name in extra:
            sel.extra.add(name)
        else:
            raise InvalidArgument(f"only={name!r} names nothing this Checkpointer restores: pass 'model', 'optimizers', "
                                  f"'extra', a table ({sorted(tables)[:5]}), a dense array ({sorted(dense)[:5]}) or an "
                                  f"extra object ({sorted(extra)})")
    return sel


def check_names(what: str, live: set, stored: set, v: int, strict: bool, outcome: Outcome, hint: str) -> set:
    """The ``live`` names of ``what`` that version ``v`` holds (in ``stored``); with ``strict``, InvalidArgument
    if a live one is not stored or a stored one not live, else those go to the outcome."""
    missing, unexpected = sorted(live - stored), sorted(stored - live)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"it holds no {what} {missing[:5]}{' ...' if len(missing) > 5 else ''} of the live ones")
        if unexpected:
            parts.append(f"it holds {what} {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} that nothing live "
                         "takes")
        raise InvalidArgument(f"version {v} does not match: {'; '.join(parts)}. {hint}Nothing was changed; restore "
                              "with strict=False to load what matches (the rest is left as it is, and listed in the "
                              "report), or only=[...] to load part of it")
    outcome.missing += missing
    outcome.unexpected += unexpected
    return live & stored


def optimizer_kind(opt) -> str:
    """The class an optimizer is, as a payload records it (``torch.optim.adagrad.Adagrad``)."""
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def check_optimizers(payload: dict, optimizers: list, param_names: dict, v: int, strict: bool,
                     outcome: Outcome) -> list | None:
    """The stored optimizer state dicts to load into ``optimizers`` (each made to fit its optimizer's
    parameter groups), None to leave the optimizers as they are (a version holding none, or, with
    ``strict=False``, one that cannot be loaded); InvalidArgument for a mismatch with ``strict``.
    ``param_names``: {id(parameter): its name in the model}."""
    stored = payload.get("optimizers") or []
    if not stored:
        return None  # (a version of model weights only, e.g. an import: the optimizers stay as they are)
    def refuse(why: str):
        if strict:
            raise InvalidArgument(f"version {v}: {why}. Nothing was changed; restore with only='model' to load the "
                                  "model alone, or strict=False to load the optimizer state that matches")
        return None
    if len(stored) != len(optimizers):
        refuse(f"it holds {len(stored)} optimizer(s), this Checkpointer has {len(optimizers)}")
        outcome.missing += [f"optimizer {i}" for i in range(len(optimizers))]
        return None
    kinds = payload.get("optimizer_types")
    names_by_opt = payload.get("param_names") or [None] * len(stored)
    out = []
    for i, (sd, opt) in enumerate(zip(stored, optimizers)):
        if kinds is not None and i < len(kinds) and kinds[i] != optimizer_kind(opt):
            refuse(f"optimizer {i} was saved as a {kinds[i]}, this Checkpointer's is a {optimizer_kind(opt)}")
            outcome.missing.append(f"optimizer {i}")
            out.append(None)
            continue
        if is_keyed(opt) or not isinstance(opt, torch.optim.Optimizer):
            out.append(sd)  # (keyed by parameter name: torchrec's KeyedOptimizer checks its own keys)
            continue
        saved = [list(g.get("params", ())) for g in sd.get("param_groups", ())]
        live = [g["params"] for g in opt.param_groups]
        if len(saved) == len(live) and all(len(a) == len(b) for a, b in zip(saved, live)):
            out.append(sd)
            continue
        stored_names = names_by_opt[i] if i < len(names_by_opt) else None
        live_names = [param_names.get(id(p)) for g in opt.param_groups for p in g["params"]]
        why = (f"optimizer {i} holds {len(saved)} parameter group(s) of {[len(g) for g in saved]} parameters, this "
               f"Checkpointer's has {len(live)} of {[len(g) for g in live]}")
        if stored_names is not None:
            gone = sorted(set(n for n in stored_names if n) - set(n for n in live_names if n))
            new = sorted(set(n for n in live_names if n) - set(n for n in stored_names if n))
            why += f" (stored only: {gone[:5]}; live only: {new[:5]})"
        if strict or stored_names is None:
            refuse(why)
            outcome.missing.append(f"optimizer {i}")
            out.append(None)
            continue
        out.append(_by_name(sd, stored_names, opt, live_names, i, outcome))
    return out


def _by_name(sd: dict, stored_names: list, opt, live_names: list, i: int, outcome: Outcome) -> dict:
    """``sd`` made to fit ``opt``'s parameter groups: each live parameter gets the stored state of the parameter
    of its name, or keeps its own (listed in ``outcome.missing``); the live groups' settings are kept."""
    index = {name: j for j, name in enumerate(stored_names) if name is not None}
    live_state = opt.state_dict()["state"]
    state, groups, k = {}, [], 0
    for g in opt.param_groups:
        ids = []
        for _p in g["params"]:
            name = live_names[k]
            j = index.get(name)
            if j is not None and j in sd["state"]:
                state[k] = sd["state"][j]
            else:
                if k in live_state:
                    state[k] = live_state[k]
                outcome.missing.append(f"optimizer {i}: {name}")
            ids.append(k)
            k += 1
        groups.append({**{key: val for key, val in g.items() if key != "params"}, "params": ids})
    outcome.unexpected += [f"optimizer {i}: {n}" for n in stored_names if n is not None and n not in set(live_names)]
    return {**sd, "state": state, "param_groups": groups}
